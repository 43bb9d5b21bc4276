"""Importance correction between the policy that sampled and the one the Trainer holds.

The recorded logprobs come from the engine that sampled (``behaviour``): an older version (stale
rows) and a different numeric path (the engine's kernels and dtype, not the Trainer's). The
decoupled objective (Hilton et al. 2021, "Batch size-invariance for policy optimization"; used
by AReaL for asynchronous RL) separates the two jobs the recorded logprobs do in PPO: the clipped
ratio is taken against the *proximal* policy (the Trainer's own logprobs before this step's update),
and the gap between proximal and behaviour is corrected by an importance weight
``w = pi_prox / pi_behav`` per token, truncated at ``cap`` (truncated importance sampling, as in
Espeholt et al. 2018's V-trace and the TIS fix for engine/trainer mismatch) or, with ``mask``,
set to 0 where it exceeds ``cap`` (tokens the Trainer finds far likelier than the engine did are
left out). Shapes: (B, T) each.
"""

from __future__ import annotations

import torch

from services.trainer.algorithms.masking import aggregate


def behaviour_weights(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, *, mode: str, cap: float,
                      normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights pi_prox / pi_behav, truncated (``mode="truncate"``: min(w, cap)) or masked
    (``mode="mask"``: 0 where w > cap); no gradient flows through them. Statistics (shares of the
    batch over ``normalizer`` tokens): the weights' mean and the share of tokens truncated or masked."""
    if mode not in ("truncate", "mask"):
        raise ValueError(f"importance mode {mode!r}: use truncate or mask")
    w = torch.exp(proximal.detach() - behaviour)
    over = (w > cap).float()
    w = w.clamp(max=cap) if mode == "truncate" else w * (1.0 - over)
    return w, {"is_weight_mean": aggregate(w, mask, normalizer), "is_capped_frac": aggregate(over, mask, normalizer)}
