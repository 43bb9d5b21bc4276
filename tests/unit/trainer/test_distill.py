"""The distillation advantage (services/trainer/algorithms/distill.py), worked by hand."""

from __future__ import annotations

import math

import torch

from services.trainer.algorithms.distill import centred_per_row, distillation_advantage


def test_each_token_gets_the_teachers_logprob_minus_the_samplers_clamped_and_masked():
    teacher = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.8, 1e-9, 0.5]]))
    sampled = torch.log(torch.tensor([[0.25, 0.9, 0.4], [0.4, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = distillation_advantage(teacher, sampled, mask, clip=5.0)
    # 0.5 vs 0.25: log 2 up; 0.9 vs 0.9: 0; 0.2 vs 0.4: log 2 down; 0.8 vs 0.4: log 2 up
    assert torch.allclose(adv[0], torch.tensor([math.log(2), 0.0, -math.log(2)]), atol=1e-6)
    assert abs(adv[1, 0].item() - math.log(2)) < 1e-6
    assert adv[1, 1].item() == -5.0  # log(1e-9 / 0.5) = -20.0, clamped
    assert adv[1, 2].item() == 0.0  # padding


def test_its_mean_over_the_students_own_samples_is_minus_the_reverse_kl():
    # one position, a student over 3 tokens and a teacher: E_student[A] = -KL(student || teacher)
    student = torch.tensor([0.5, 0.3, 0.2])
    teacher = torch.tensor([0.2, 0.6, 0.2])
    adv = distillation_advantage(teacher.log().unsqueeze(0), student.log().unsqueeze(0), torch.ones(1, 3), clip=50.0)
    kl = (student * (student / teacher).log()).sum()
    assert abs((student * adv[0]).sum().item() + kl.item()) < 1e-6


def test_centred_per_row_each_calls_mean_is_taken_off_its_own_tokens_only():
    adv = torch.tensor([[0.4, -1.0, 9.0], [-0.2, -0.2, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = centred_per_row(adv, mask)
    # row 1: mean of (0.4, -1.0) is -0.3 -> (0.7, -0.7), padding stays 0; row 2: a constant gap moves nothing
    assert torch.allclose(out, torch.tensor([[0.7, -0.7, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)
    assert centred_per_row(torch.zeros(1, 2), torch.zeros(1, 2)).tolist() == [[0.0, 0.0]]  # no token: no division by 0


def test_it_carries_no_gradient():
    teacher = torch.zeros(1, 2, requires_grad=True)
    assert not distillation_advantage(teacher, torch.zeros(1, 2), torch.ones(1, 2), clip=1.0).requires_grad


def test_the_top_k_term_is_the_kl_over_the_teachers_top_k_and_the_rest_and_moves_mass_where_the_teacher_has_it():
    from services.trainer.algorithms.distill import top_k_distillation

    # teacher's top 2 at one position: 0.3 and 0.1 (rest 0.6); the student has 0.5 and 0.25 on them (rest 0.25)
    teacher = torch.log(torch.tensor([[[0.3, 0.1]]]))
    student = torch.log(torch.tensor([[[0.5, 0.25]]])).requires_grad_()
    kl = top_k_distillation(student, teacher, torch.ones(1, 1))
    expected = 0.3 * math.log(0.3 / 0.5) + 0.1 * math.log(0.1 / 0.25) + 0.6 * math.log(0.6 / 0.25)
    assert abs(kl.item() - expected) < 1e-6
    kl.sum().backward()
    # d/d log s_v = -t_v + t_rest * s_v / s_rest: 0.9 and 0.5, so descent lowers both (the teacher has more elsewhere)
    assert torch.allclose(student.grad, torch.tensor([[[0.9, 0.5]]]))
    # a token the teacher wants more of than the student has is raised: teacher 0.6 where the student has 0.1
    student = torch.log(torch.tensor([[[0.1, 0.1]]])).requires_grad_()
    top_k_distillation(student, torch.log(torch.tensor([[[0.6, 0.1]]])), torch.ones(1, 1)).sum().backward()
    assert student.grad[0, 0, 0].item() < 0  # -0.6 + 0.3 * 0.1 / 0.8
    assert top_k_distillation(student, teacher, torch.zeros(1, 1)).item() == 0.0


def test_the_top_k_term_stays_finite_where_the_student_has_minus_infinity():
    from services.trainer.algorithms.distill import top_k_distillation

    # a grammar forbade token 2 at the first position (-inf), and the second row is padding (masked)
    student = torch.tensor([[[math.log(0.5), float("-inf")]], [[float("-inf"), float("-inf")]]]).requires_grad_()
    teacher = torch.log(torch.tensor([[[0.3, 0.1]], [[0.5, 0.5]]]))
    kl = top_k_distillation(student, teacher, torch.tensor([[1.0], [0.0]]))
    kl.sum().backward()
    assert torch.isfinite(kl).all() and kl[1, 0].item() == 0.0 and torch.isfinite(student.grad).all()
    assert student.grad[1].abs().sum().item() == 0.0
