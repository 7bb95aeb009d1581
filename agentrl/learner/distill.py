"""On-policy distillation: a teacher's per-token log-probs as a dense advantage.

The student samples; a teacher scores the very tokens it sampled (teacher-forced, one forward
over the whole sequence). On sampled token t the single-sample estimate of the reverse KL is

    k_t = log p_student(y_t | y_<t) - log p_teacher(y_t | y_<t)

(the estimate Tinker's on-policy distillation, verl and slime use), and its negative becomes the
token's advantage: ``A_t = -kl_coef * k_t``. A token the teacher finds likelier than the student
is pushed up, one it finds unlikely is pushed down; the expectation over the student's samples
is minus the reverse KL, so the policy-gradient step descends ``KL(student || teacher)``.
``mode = "distill"`` trains on that term alone; ``"rl+distill"`` adds it to the RL reward's
per-token advantage (:func:`~agentrl.learner.advantages.compute_token_advantages`). Only
sampled tokens (``loss_mask`` 1) carry the term: prompt, tool and observation tokens stay 0.

The student's log-probs are the engine's (``Trajectory.logprobs``, at the rollout's
temperature). The teacher's are those of its distribution at ``teacher.temperature`` (tau):
``log p_teacher(y_t) = log_softmax(z_t / tau)[y_t]`` of its logits ``z_t``. tau = 1 (the
default, and an endpoint teacher's only value: SGLang's prompt log-probs are untempered) is the
teacher itself; tau < 1 sharpens it toward its greedy choice, so the student descends
``KL(student || softmax(z / tau))``: a teacher that samples poorly at temperature 1 but well
greedily then teaches its greedy behaviour rather than its sampling noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from agentrl.learner.advantages import Shaper, compute_token_advantages
from agentrl.types import Group, Trajectory

if TYPE_CHECKING:
    import torch

DistillMode = Literal["distill", "rl+distill"]

__all__ = ["DistillMode", "distill_token_advantages", "reverse_kl"]


def reverse_kl(traj: Trajectory, teacher_logprobs: Sequence[float]) -> torch.Tensor:
    """Per-token ``logp_student - logp_teacher`` on sampled tokens, 0 elsewhere (float64).

    Args:
        traj: the student's trajectory (its ``logprobs`` are the engine's).
        teacher_logprobs: the teacher's log-prob of ``traj.tokens[i]`` given the tokens before
            it, one per token (position 0, which nothing predicts, is ignored: it is a prompt
            token).

    Raises:
        ValueError: ``teacher_logprobs`` is not one per token.
    """
    import torch

    if len(teacher_logprobs) != len(traj.tokens):
        raise ValueError(
            f"teacher_logprobs: expected {len(traj.tokens)} (one per token), "
            f"got {len(teacher_logprobs)}"
        )
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    student = torch.tensor(traj.logprobs, dtype=torch.float64)
    teacher = torch.tensor(teacher_logprobs, dtype=torch.float64)
    return torch.where(mask, student - teacher, 0.0)


def distill_token_advantages(
    group: Group,
    teacher_logprobs: Sequence[Sequence[float]],
    *,
    mode: DistillMode = "distill",
    kl_coef: float = 1.0,
    shapers: Sequence[Mapping[str, Any] | Shaper] = (),
    eps: float = 1e-6,
) -> tuple[list[torch.Tensor], float, int]:
    """Per-token advantages of a group under distillation, and the group's reverse-KL sum.

    Args:
        group: the trajectories of one task (failed ones already left out).
        teacher_logprobs: per trajectory, the teacher's log-prob of every token (see
            :func:`reverse_kl`).
        mode: ``distill`` (the KL term alone) or ``rl+distill`` (added to the outcome
            advantage and the shapers' adjustments).
        kl_coef: the weight of the KL term.
        shapers: ``rl+distill``: the RL side's shapers.
        eps: ``rl+distill``: added to the group's reward std.

    Returns:
        One float32 tensor per trajectory (0 wherever ``loss_mask`` is 0), the sum of
        ``logp_student - logp_teacher`` over the group's sampled tokens and their number.
    """
    import torch

    kls = [reverse_kl(t, lp) for t, lp in zip(group.trajectories, teacher_logprobs, strict=True)]
    terms = [-kl_coef * k for k in kls]
    if mode == "distill":
        out = [t.to(torch.float32) for t in terms]  # already 0 off the sampled tokens
    else:
        out = compute_token_advantages(group, shapers, eps=eps, extra=terms)
    tokens = sum(t.num_response_tokens for t in group.trajectories)
    return out, float(sum(float(k.sum()) for k in kls)), tokens
