"""On-policy distillation's advantage: the per-token reverse KL to a teacher, on the student's own
samples (Thinking Machines' recipe; GKD with lambda 1). For a token y_t the student sampled,
log teacher(y_t) - log student(y_t) is minus the one-sample estimate of KL(student || teacher) at
that position; used as the token's advantage with discount 0 (no sum over later tokens), a policy
gradient step lowers the reverse KL. It adds to the task's advantage, each weighted:

    A_t = reward_weight x A_task_t + kl_coef x (log teacher(y_t) - log student(y_t))

The student's log-probs are the old ones the update starts from (detached: the advantage is a
constant of the step).

The top-k forward KL (`distill.forward_kl_coef`) is a loss beside it, on the same sampled
positions: with q the teacher's probabilities over its k most likely tokens, renormalised over
them, and p the student's (under the weights being trained) at those tokens,

    L_t = sum_k q_k (log q_k - log p_k)

KL(q || p) over the teacher's top-k (GKD's forward KL on the student's own samples): its gradient
raises the student's log-prob of each of the teacher's top tokens in proportion to q_k, a dense
signal beyond the one sampled token.
"""

from __future__ import annotations

import torch

from .core import masked_mean


def distillation_advantages(
    task_advantages: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    reward_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, T) advantages (zero where `mask` is 0) and the metrics distill/reverse_kl (the mean
    per-token log student - log teacher over trained tokens), distill/advantage_mean and
    distill/task_advantage_weight."""
    reverse = (teacher_log_probs - student_log_probs.detach()) * mask
    advantages = reward_weight * task_advantages * mask + kl_coef * reverse
    metrics = {
        "distill/reverse_kl": -masked_mean(reverse, mask).item(),
        "distill/advantage_mean": masked_mean(advantages, mask).item(),
        "distill/task_advantage_weight": float(reward_weight),
    }
    return advantages, metrics


def topk_forward_kl(student_top: torch.Tensor, teacher_top: torch.Tensor) -> torch.Tensor:
    """(B, T) sum_k q_k (log q_k - log p_k): `teacher_top` (B, T, k) the teacher's top-k log-probs
    (renormalised over the k here), `student_top` (B, T, k) the student's log-probs of the same
    tokens (with gradients)."""
    log_q = torch.log_softmax(teacher_top.float(), dim=-1)
    return (log_q.exp() * (log_q - student_top)).sum(-1)
