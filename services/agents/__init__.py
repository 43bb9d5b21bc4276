"""Agents that run a model locally and learn with Kaizen's services (they import torch; the
runner SDK does not)."""

from services.agents.learnable import LearnableAgent, LearnableAgentError, PeftHead, RunResult

__all__ = ["LearnableAgent", "LearnableAgentError", "PeftHead", "RunResult"]
