"""Feedback in words as training signal: the teacher's logprobs of the sampled tokens, for the calls
that carry a hint (``TrainItem.teacher_prompt_ids``: the call's conversation with the hint, rendered
by the Explorer), and the distillation advantage they give (services/trainer/algorithms/distill.py).
Shared by ``opd`` (hints alone) and ``grpo`` (``hint_coef``: added to the reward's advantage). The
tensor functions import torch where they run, in the learners: the driver reads only the settings
and ``hint_figures``, and loads no torch."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from services.trainer.batches import TrainItem
from services.trainer.recipes.base import GATHER_IDS, MicroBatch, RecipeConfig, Scorer

if TYPE_CHECKING:
    import torch


class HintSettings(RecipeConfig):
    teacher: str = Field(
        default="policy", min_length=1,
        description="Who reads the hint: policy (the agent itself as the version that sampled the call, its published "
        "adapter read by the learner; as before the step if it cannot be read: self-distillation), "
        "base (the base model without the adapter), or the path of another model that shares the agent's tokenizer "
        "(loaded once by each learner).")
    hint_clip: float = Field(default=5.0, gt=0, description="The largest |teacher - sampled| logprob gap a token counts.")
    hint_skip_first: int = Field(
        default=0, ge=0,
        description="The first N tokens of each hinted call get no distillation (neither term): 1 leaves the choice "
        "between calling a tool and answering in words, the response's first token, to the reward. On the calculator "
        "demo the agent reading a hint almost never opens the call by mid-loop (0.05-0.13 against 0.98-0.99) while "
        "it still prefers the right call's arguments (docs/DEMO.md).")
    hint_baseline: Literal["none", "call"] = Field(
        default="none",
        description="none: each hinted token's advantage is its teacher - sampled logprob as it is (its mean, minus the "
        "reverse KL, is never above 0: most sampled tokens are pushed down); call: less that gap's mean over the "
        "call's tokens (a baseline per call: the tokens the teacher agrees with more than the call's average go up).")
    top_k: int = Field(
        default=16, ge=0, le=256,
        description="Also pull the student, at each position of a hinted call, towards the teacher's k likeliest tokens "
        "(their KL, top_k_coef times): it teaches tokens the agent never sampled (SmolLM2 told to begin with 'Sure': "
        "0.002 -> 0.77 with 16, no gain with 0). 0: the sampled tokens alone.")
    top_k_coef: float = Field(default=1.0, gt=0, description="top_k: the weight of that KL term.")


def teacher_inputs(items: list[TrainItem], scorer: Scorer, teacher: str, top_k: int = 0) -> dict[str, torch.Tensor]:
    """{"teacher": (B, R) logprobs of each hinted item's sampled tokens after its teacher prompt, 0 for
    the others; "hinted": (B,) 1 where an item has a hint; "teacher_s": the forward's seconds;
    "teacher_unmatched": hinted items whose sampling version could not be read}; with
    ``top_k``, also the teacher's k likeliest tokens at each position: "teacher_top" (B, R, k) logprobs
    and their ids as GATHER_IDS (the learner's forward then gives the student's logprobs of them)."""
    import torch

    width = max((len(it.response_ids) for it in items), default=0)
    hinted = [k for k, it in enumerate(items) if it.teacher_prompt_ids]
    out = torch.zeros(len(items), width)
    top_lp, top_ids = torch.zeros(len(items), width, top_k), torch.zeros(len(items), width, top_k, dtype=torch.long)
    start = time.perf_counter()
    # the policy as teacher: the version that sampled each call (its tokens' logprobs are the student's side), one
    # forward per version; a version that cannot be read is scored as the adapter stands before the step
    by_version: dict[int | None, list[int]] = {}
    for k in hinted:
        by_version.setdefault(items[k].model_version if teacher == "policy" else None, []).append(k)
    elsewhere = 0
    for version, rows in by_version.items():
        args = ([items[k].teacher_prompt_ids for k in rows], [items[k].response_ids for k in rows],
                [items[k].temperature for k in rows])
        who: dict = {"adapter": teacher == "policy"}
        if teacher not in ("policy", "base"):
            who["model"] = teacher
        if version is not None:
            who["version"] = version
            elsewhere += 0 if scorer.has_version(version) else len(rows)
        if top_k:
            lp, values, ids = scorer.top_logprobs(*args, top_k, **who)
            values, ids = values.float().cpu(), ids.cpu()
        else:
            lp = scorer.logprobs(*args, **who)
        lp = lp.float().cpu()
        for row, k in enumerate(rows):
            n = len(items[k].response_ids)
            out[k, :n] = lp[row, :n]
            if top_k:
                top_lp[k, :n], top_ids[k, :n] = values[row, :n], ids[row, :n]
    flags = torch.tensor([1.0 if it.teacher_prompt_ids else 0.0 for it in items])
    extra = {"teacher": out, "hinted": flags, "teacher_s": torch.tensor(time.perf_counter() - start),
             "teacher_unmatched": torch.tensor(float(elsewhere))}
    # the top-k term leaves out calls sampled under a grammar: their tokens were scored over what it allowed
    top_rows = torch.tensor([1.0 if it.teacher_prompt_ids and not it.grammar else 0.0 for it in items])
    if top_k and bool(top_rows.any()):
        extra.update({"teacher_top": top_lp, "top_k_rows": top_rows, GATHER_IDS: top_ids})
    return extra


def _skip_first(mask: torch.Tensor, skip: int) -> torch.Tensor:
    """``mask`` without each row's first ``skip`` response tokens (``HintSettings.hint_skip_first``)."""
    if skip <= 0:
        return mask
    mask = mask.clone()
    mask[:, :skip] = 0
    return mask


def hint_advantage(mb: MicroBatch, *, clip: float, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) distillation advantage of the hinted rows (0 elsewhere, and on each row's first ``skip``
    tokens), and the (B, R) mask of the tokens it is on."""
    import torch

    from services.trainer.algorithms.distill import distillation_advantage

    dev = mb.mask.device
    teacher, hinted = mb.extra["teacher"].to(dev), mb.extra["hinted"].to(dev)
    width = mb.mask.shape[1]
    if teacher.shape[1] < width:  # the batch's padding may be wider than its longest response
        teacher = torch.nn.functional.pad(teacher, (0, width - teacher.shape[1]))
    mask = _skip_first(mb.mask * hinted.unsqueeze(-1), skip)
    return distillation_advantage(teacher[:, :width], mb.old_logprobs, mask, clip=clip), mask


def trained_hint_advantage(adv: torch.Tensor, mask: torch.Tensor, baseline: str) -> torch.Tensor:
    """What the step trains on (``HintSettings.hint_baseline``): ``hint_advantage``'s as it is, or
    centred per call. The step's figures keep the uncentred one (its mean is minus the reverse KL)."""
    from services.trainer.algorithms.distill import centred_per_row

    return centred_per_row(adv, mask) if baseline == "call" else adv


def hint_top_k_loss(mb: MicroBatch, coef: float, skip: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The top-k term (``HintSettings.top_k``): ``coef`` times the KL from the teacher's k likeliest
    tokens to the student at each hinted position, each row at its staleness weight, over the batch's
    tokens; and its share of the step's ``teacher_kl`` figure."""
    import torch

    from services.trainer.algorithms.distill import top_k_distillation

    if "teacher_top" not in mb.extra:  # no hinted call here that the term can teach
        return mb.logprobs.sum() * 0.0, {}
    dev = mb.mask.device
    width = mb.mask.shape[1]
    teacher = mb.extra["teacher_top"].to(dev)
    if teacher.shape[1] < width:
        teacher = torch.nn.functional.pad(teacher, (0, 0, 0, width - teacher.shape[1]))
    mask = _skip_first(mb.mask * mb.extra["top_k_rows"].to(dev).unsqueeze(-1), skip)
    kl = top_k_distillation(mb.gathered, teacher[:, :width], mask)
    n = max(mb.norms.tokens, 1.0)
    loss = coef * (kl * mb.weights.unsqueeze(-1)).sum() / n
    return loss, {"teacher_kl_sum_share": kl.detach().sum() / n}


def hint_statistics(mb: MicroBatch, adv: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """This micro-batch's shares of the step's figures (``hint_figures`` turns their sums into the
    step record's): hinted tokens and their advantage over the batch's tokens, the teacher's seconds
    (the same in every epoch: a step's figures are its epochs' mean)."""
    n = max(mb.norms.tokens, 1.0)
    return {
        "hinted_share": mask.sum() / n,
        "distill_sum_share": (adv * mask).sum() / n,
        "teacher_s": mb.extra["teacher_s"],
        "teacher_unmatched": mb.extra.get("teacher_unmatched", 0.0),
    }


def hint_figures(sums: dict[str, float]) -> dict[str, float]:
    """The step record's hint figures: ``hinted_share`` of the trained tokens, ``distill_advantage``
    (the mean advantage of a hinted token: minus the clipped reverse KL to the teacher) and
    ``teacher_s`` (the teacher's forward passes, in seconds), ``teacher_unmatched`` (hinted calls the policy
    as teacher scored as it stands before the step: their sampling version could not be read)."""
    out = dict(sums)
    share, total = out.get("hinted_share", 0.0), out.pop("distill_sum_share", 0.0)
    out["distill_advantage"] = total / share if share > 0 else 0.0
    if "teacher_kl_sum_share" in out:  # top_k: the mean KL from the teacher's top-k over a hinted token
        kl = out.pop("teacher_kl_sum_share")
        out["teacher_kl"] = kl / share if share > 0 else 0.0
    return out
