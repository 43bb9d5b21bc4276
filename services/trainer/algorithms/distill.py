"""On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; Lu & Thinking Machines 2025,
"On-Policy Distillation"): the student samples, a teacher scores the sampled tokens, and each token's
advantage is how much likelier the teacher finds it than the student did,

    A_t = log pi_teacher(y_t | x', y_<t) - log pi_student(y_t | x, y_<t),

whose expectation over the student's samples is minus the reverse KL(student || teacher) at that
position: a policy-gradient step on A_t lowers the reverse KL, one token at a time, on the agent's own
samples. Kaizen's teacher is the agent itself reading a hint (x' = the conversation and the hint:
self-distillation with privileged context), or any model that shares its tokenizer. The student's
logprobs are those recorded at sampling, so the advantage is fixed for the step, as a reward's is.
Shapes: (B, T) each, right-padded; ``mask`` 1 on the tokens that have a teacher.
"""

from __future__ import annotations

import torch


def distillation_advantage(teacher_logprobs: torch.Tensor, sampled_logprobs: torch.Tensor, mask: torch.Tensor, *,
                           clip: float) -> torch.Tensor:
    """Per-token ``teacher - sampled`` logprob, clamped to [-clip, clip] (one token a teacher finds
    impossible must not swamp the rest), 0 where ``mask`` is 0."""
    return ((teacher_logprobs - sampled_logprobs).clamp(-clip, clip) * mask).detach()


def centred_per_row(advantage: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's advantage less its mean over the row's masked tokens (0 where ``mask`` is 0): a
    baseline per call. The plain advantage's mean is minus the reverse KL, never above 0, so a step
    pushes down most sampled tokens and spreads their mass over the rest (the tools demo's entropy
    rose from 0.005-0.035 to 0.10-0.23 under it); centred, a call's tokens the teacher agrees with
    more than the call's average go up, the others down, and a constant shift no longer moves them."""
    n = mask.sum(-1, keepdim=True)
    mean = (advantage * mask).sum(-1, keepdim=True) / n.clamp(min=1)
    return ((advantage - mean) * mask).detach()


def top_k_distillation(student_logprobs: torch.Tensor, teacher_top_logprobs: torch.Tensor, mask: torch.Tensor
                       ) -> torch.Tensor:
    """Per position, KL(teacher || student) over the teacher's k likeliest tokens and one bucket for all
    the others: ``sum_v t(v) (log t(v) - log s(v)) + t_rest (log t_rest - log s_rest)`` (GKD's forward KL
    on the student's own sequences, the teacher's distribution in brief; never more than the full KL).
    Its gradient raises every token the teacher prefers to the student, sampled or not: what the
    one-sample advantage above cannot do for a token the student never samples. No renormalization: a
    flat teacher's top k are not made a sharp target. Shapes: (B, T, k) each (the student's logprobs of
    the teacher's top-k ids), (B, T) mask; returns (B, T), 0 where ``mask`` is 0."""
    keep = mask.unsqueeze(-1).bool() & torch.isfinite(student_logprobs)  # masked: no inf reaches the arithmetic
    student = torch.where(keep, student_logprobs, torch.zeros_like(student_logprobs))
    teacher = torch.where(keep, teacher_top_logprobs.detach(), torch.full_like(student, -30.0))
    t_rest = (1.0 - teacher.exp().sum(-1)).clamp(min=1e-8)
    s_rest = (1.0 - torch.where(keep, student.exp(), torch.zeros_like(student)).sum(-1)).clamp(min=1e-8)
    kl = (teacher.exp() * (teacher - student)).sum(-1) + t_rest * (t_rest.log() - s_rest.log())
    return torch.where(mask.bool(), kl, torch.zeros_like(kl))
