"""On-policy distillation's advantage (services/ppo/distill.py): its closed form, zero for a
teacher identical to the student, and the first-order guarantee: one small policy-gradient step on
a fixed batch raises the student's log-probs where the teacher likes a token more than it does and
lowers the reverse KL it estimates."""

import pytest
import torch

from services.ppo import distillation_advantages


def test_the_advantage_is_teacher_minus_student_plus_the_weighted_task_advantage():
    task = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    student = torch.tensor([[-2.0, -2.0, -1.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, metrics = distillation_advantages(task, teacher, student, mask, kl_coef=2.0, reward_weight=0.5)
    want = torch.tensor([[0.5 + 2.0, 0.5 + 0.0, 0.5 + 1.0], [-0.5 - 4.0, -0.5 + 0.0, 0.0]])
    assert torch.allclose(adv, want)
    # student - teacher over the 5 trained tokens: (-1 + 0 - 0.5 + 2 + 0) / 5
    assert metrics["distill/reverse_kl"] == pytest.approx(0.1)
    pure, _ = distillation_advantages(task, teacher, student, mask, kl_coef=1.0, reward_weight=0.0)
    assert torch.allclose(pure, (teacher - student) * mask)


def test_a_teacher_identical_to_the_student_gives_no_advantage():
    lp = torch.randn(4, 6).clamp(max=0)
    mask = torch.ones(4, 6)
    adv, metrics = distillation_advantages(torch.zeros(4, 6), lp.clone(), lp, mask, 1.0, 0.0)
    assert torch.count_nonzero(adv) == 0 and metrics["distill/reverse_kl"] == 0.0


def test_one_step_moves_the_student_toward_the_teachers_tokens():
    """A student (a free table of logits per position) sampled one sequence; the teacher likes
    some of its tokens more than the student does and some less. One small REINFORCE step with the
    distillation advantage raises the student's log-prob of each token the teacher prefers and
    lowers the others (each position's logits are its own: to first order the change of log pi(y_t)
    is lr x A_t x |grad log pi(y_t)|^2, of A_t's sign)."""
    g = torch.Generator().manual_seed(0)
    vocab, steps = 8, 6
    student_logits = torch.randn(steps, vocab, generator=g).requires_grad_()
    teacher_logits = torch.randn(steps, vocab, generator=g)
    tokens = torch.randint(vocab, (steps,), generator=g)

    def log_probs(logits):
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0][None]  # (1, T)

    old = log_probs(student_logits).detach()
    teacher = log_probs(teacher_logits)
    adv, _ = distillation_advantages(torch.zeros(1, steps), teacher, old, torch.ones(1, steps), 1.0, 0.0)
    assert (adv > 0).any() and (adv < 0).any()
    (-(adv * log_probs(student_logits)).sum()).backward()
    with torch.no_grad():
        new = log_probs(student_logits - 1e-3 * student_logits.grad)
    assert torch.equal((new - old).sign(), adv.sign())
    assert (adv * (new - old)).sum() > 0  # the objective rose


def test_the_topk_forward_kl_is_zero_at_the_teacher_and_its_step_moves_mass_to_the_teachers_tokens():
    """sum_k q_k (log q_k - log p_k) over the teacher's top-k (q renormalised over them): 0 where
    the student's log-probs at those tokens are the teacher's renormalised ones, positive elsewhere;
    one small gradient step on a free table of logits lowers it, and the student's log-probs of the
    teacher's top tokens rise in proportion (the first-order guarantee, per position)."""
    from services.ppo.distill import topk_forward_kl

    g = torch.Generator().manual_seed(1)
    vocab, steps, k = 10, 5, 3
    teacher_top = torch.log_softmax(torch.randn(1, steps, k, generator=g), -1) - 0.3  # not normalised over k
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(steps)])[None]  # (1, T, k)
    at_teacher = torch.log_softmax(teacher_top, -1)
    assert torch.allclose(topk_forward_kl(at_teacher, teacher_top), torch.zeros(1, steps), atol=1e-6)

    logits = torch.randn(steps, vocab, generator=g).requires_grad_()
    student_top = torch.log_softmax(logits, -1)[None].gather(-1, ids)
    loss = topk_forward_kl(student_top, teacher_top)
    assert (loss > 0).all()
    loss.sum().backward()
    with torch.no_grad():
        after_logits = logits - 1e-2 * logits.grad
        after = topk_forward_kl(torch.log_softmax(after_logits, -1)[None].gather(-1, ids), teacher_top)
        mass = torch.log_softmax(after_logits, -1)[None].gather(-1, ids).exp().sum(-1)
        mass_before = student_top.exp().sum(-1)
    assert (after < loss.detach()).all()
    assert (mass > mass_before).all()  # the student gives the teacher's top-k more probability
