"""`kaizen demo`: the embedded default, end to end (see services/demo/run.py)."""

from services.demo.run import run_demo

__all__ = ["run_demo"]
