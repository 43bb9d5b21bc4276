"""SFT: cross-entropy (negative log-likelihood) of the response tokens of selected experiences.

Which experiences are demonstrations is decided before the loss (reward threshold or a feedback
label such as ``demonstration``); here every given response token counts, weighted per sequence.
Shapes: (B, T) logprobs of the response tokens under the policy at temperature 1, (B, T) mask.
"""

from __future__ import annotations

import torch

from services.trainer.algorithms.masking import aggregate


def sft_loss(
    *, logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor, normalizer: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = aggregate(-logprobs, weights * mask, normalizer)
    return loss, {"loss": loss.detach(), "nll": aggregate(-logprobs.detach(), mask, normalizer)}
