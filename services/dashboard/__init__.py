"""`kaizen dashboard`: a read-only web view of online learning (buffer, checkpoints, Trainer steps)."""
