"""Policy losses: GSPO, GSPO-token and GRPO, plus a KL-to-reference term; the registry of all.

Pure tensor functions: log-probs, behaviour ("old") log-probs, advantages and a loss mask in,
``(loss, stats)`` out. No model, no config. Equation numbers refer to the GSPO paper (Zheng et al.,
"Group Sequence Policy Optimization", Qwen team, 2025, arXiv:2507.18071); ``docs/architecture.md``
restates them.

Design choices, shared by the three losses:

* **Aggregation.** Every loss is *minus the mean over sequences of a per-sequence quantity*. For
  GSPO the quantity is the clipped sequence objective; for GSPO-token and GRPO it is the mean of
  the clipped token objectives over that sequence's loss-masked tokens. Sequences are weighted
  equally whatever their length (never a token sum, which would let long responses dominate).
* **Empty rows.** A row whose ``loss_mask`` is all zero contributes nothing and is *not* counted
  in the denominator: the default denominator is the number of rows with at least one loss token
  (:func:`count_sequences`). Padding rows therefore never dilute the gradient.
* **Micro-batches.** The keyword-only ``num_sequences`` replaces that denominator. A learner that
  splits a mini-batch into micro-batches passes the mini-batch's ``count_sequences`` to every
  micro-batch call; the summed losses and gradients then equal one call on the whole mini-batch.
* **Numerics.** Arithmetic runs in float32 (float64 if ``logprobs`` is float64), also for bf16
  inputs, so a 32k-token mean log-ratio keeps its precision. Log-ratios are clamped to
  ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` before ``exp``: the value is capped and its gradient is zero
  beyond the cap (``e^20 ≈ 5e8``), much like PPO's dual clip; such a sequence is stale or broken
  data. Masked positions are zeroed before any arithmetic, so ``-inf``/NaN padding is harmless.
* **What is detached.** ``old_logprobs`` and ``advantages`` are treated as constants.

Memory: nothing larger than ``(B, T)`` is materialised (a handful of ``(B, T)`` temporaries).
"""

from __future__ import annotations

from typing import Protocol

import torch

from agentrl.errors import ConfigError
from agentrl.learner.loss_math import (
    MAX_LOG_RATIO,
    _aggregate,
    _check,
    _check_policy_args,
    _clipped_objective,
    _prepare,
    _sequence_log_ratio,
    _stats,
    _token_mean,
    count_sequences,
)
from agentrl.learner.loss_stats import KLStats, LossStats
from agentrl.learner.weighted_losses import cispo_loss, dppo_loss

__all__ = [
    "LOSSES",
    "MAX_LOG_RATIO",
    "KLStats",
    "LossFn",
    "LossStats",
    "cispo_loss",
    "count_sequences",
    "dppo_loss",
    "get_loss",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "kl_to_reference",
]


class LossFn(Protocol):
    """Signature shared by every loss of :data:`LOSSES` (DPPO adds a keyword ``kl_coef``)."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        eps_low: float = ...,
        eps_high: float = ...,
        *,
        num_sequences: int | None = None,
    ) -> tuple[torch.Tensor, LossStats]:
        """Return ``(loss, stats)``; the loss is minus a mean over sequences."""
        ...


# ---------------------------------------------------------------------------------------------
# losses


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    *,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """GSPO loss with a sequence-level importance ratio (paper eqs. 5–7).

    ``s_i = exp(mean_t (logp[i,t] - old[i,t]))`` over row i's loss tokens (eq. 7) and the loss is
    ``-(1/B) Σ_i min(s_i A_i, clip(s_i, 1-ε_low, 1+ε_high) A_i)`` (eq. 5). Its gradient (eq. 11)
    gives every loss token of sequence i the same weight ``s_i A_i / |y_i|`` where the clip is
    inactive and zero where it is active (``s_i > 1+ε_high`` with ``A_i > 0``, or
    ``s_i < 1-ε_low`` with ``A_i < 0``).

    Args:
        logprobs: ``(B, T)`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``(B, T)`` behaviour log-probs (the engine's); treated as constant.
        advantages: ``(B,)`` one advantage per sequence; treated as constant.
        loss_mask: ``(B, T)``, nonzero on the tokens the policy sampled.
        eps_low: lower clip range (paper default 3e-4).
        eps_high: upper clip range (paper default 4e-4).
        num_sequences: denominator replacing ``B`` (default: the number of non-empty rows).

    Returns:
        The scalar loss (float32, or float64 for float64 inputs) and its :class:`LossStats`.
    """
    _check("old_logprobs", logprobs, old_logprobs, loss_mask, num_sequences)
    _check_policy_args(advantages, logprobs.shape, eps_low, eps_high, per_token=False)
    lp, old, mask, n = _prepare(logprobs, old_logprobs, loss_mask)
    adv = advantages.detach().to(lp.dtype)  # (B,)
    s = _sequence_log_ratio(lp, old, n).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # (B,)
    obj, clipped = _clipped_objective(s, adv, eps_low, eps_high)  # (B,)
    valid = n > 0
    loss = -_aggregate(obj, valid, num_sequences)
    stats = _stats(lp, old, mask, s, valid, clipped[:, None].expand_as(mask))
    return loss, stats


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    *,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """GSPO-token loss: sequence ratio, per-token advantages (the paper's GSPO-token variant).

    ``s[i,t] = sg(s_i) · exp(logp[i,t] - sg(logp[i,t]))``: its value is the sequence ratio
    ``s_i`` and its gradient is ``s_i ∇logp[i,t]``. The loss is
    ``-(1/B) Σ_i (1/|y_i|) Σ_t min(s[i,t] A[i,t], clip(s[i,t]) A[i,t])``, so token t of sequence
    i gets weight ``s_i A[i,t] / |y_i|`` unless the clip is active for that token's sign (compare
    eq. 11). With ``A[i,t] = A_i`` it equals :func:`gspo_loss` in value, clipping and gradient.

    Args:
        logprobs: ``(B, T)`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``(B, T)`` behaviour log-probs; treated as constant.
        advantages: ``(B, T)`` per-token advantages (``(B,)`` is broadcast); treated as constant.
        loss_mask: ``(B, T)``, nonzero on the tokens the policy sampled.
        eps_low: lower clip range (paper default 3e-4).
        eps_high: upper clip range (paper default 4e-4).
        num_sequences: denominator replacing ``B`` (default: the number of non-empty rows).

    Returns:
        The scalar loss and its :class:`LossStats` (ratio statistics over sequences).
    """
    _check("old_logprobs", logprobs, old_logprobs, loss_mask, num_sequences)
    _check_policy_args(advantages, logprobs.shape, eps_low, eps_high, per_token=True)
    lp, old, mask, n = _prepare(logprobs, old_logprobs, loss_mask)
    adv = advantages.detach().to(lp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv  # (B, T) or (B, 1)
    log_s = _sequence_log_ratio(lp, old, n).detach()  # (B,)
    s = log_s.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # (B,)
    # value s_i, gradient s_i ∇logp; no gradient past the clamp, exactly as in gspo_loss
    live = (log_s.abs() <= MAX_LOG_RATIO)[:, None]  # (B, 1)
    ratio = s[:, None] * torch.where(live, torch.exp(lp - lp.detach()), 1.0)  # (B, T)
    obj, clipped = _clipped_objective(ratio, adv, eps_low, eps_high)  # (B, T)
    valid = n > 0
    loss = -_aggregate(_token_mean(obj, mask, n), valid, num_sequences)
    stats = _stats(lp, old, mask, s, valid, clipped)
    return loss, stats


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    *,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """GRPO loss with a token-level ratio (the paper's GRPO baseline), without a KL term.

    ``r[i,t] = exp(logp[i,t] - old[i,t])``, clipped per token; the loss is
    ``-(1/B) Σ_i (1/|y_i|) Σ_t min(r[i,t] A[i,t], clip(r[i,t]) A[i,t])``. A token's gradient is
    ``r[i,t] A[i,t] / |y_i|`` unless its own ratio left the clip range in the direction its
    advantage pushes. Add :func:`kl_to_reference` for GRPO's KL penalty.

    Args:
        logprobs: ``(B, T)`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``(B, T)`` behaviour log-probs; treated as constant.
        advantages: ``(B,)`` or ``(B, T)``; treated as constant.
        loss_mask: ``(B, T)``, nonzero on the tokens the policy sampled.
        eps_low: lower clip range (DAPO's clip-higher defaults 0.2 / 0.28).
        eps_high: upper clip range.
        num_sequences: denominator replacing ``B`` (default: the number of non-empty rows).

    Returns:
        The scalar loss and its :class:`LossStats` (ratio statistics over tokens).
    """
    _check("old_logprobs", logprobs, old_logprobs, loss_mask, num_sequences)
    _check_policy_args(advantages, logprobs.shape, eps_low, eps_high, per_token=True)
    lp, old, mask, n = _prepare(logprobs, old_logprobs, loss_mask)
    adv = advantages.detach().to(lp.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv  # (B, T) or (B, 1)
    ratio = (lp - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # (B, T)
    obj, clipped = _clipped_objective(ratio, adv, eps_low, eps_high)  # (B, T)
    valid = n > 0
    loss = -_aggregate(_token_mean(obj, mask, n), valid, num_sequences)
    stats = _stats(lp, old, mask, ratio, mask, clipped)
    return loss, stats


def kl_to_reference(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, KLStats]:
    """KL(π_θ || π_ref) penalty with the k3 estimator, aggregated like the policy losses.

    Per token ``k3 = exp(d) - d - 1`` with ``d = ref_logp - logp`` (non-negative, unbiased under
    samples from π_θ, as in GRPO); mean over each sequence's loss tokens, then over sequences.
    The returned value is positive: add ``beta * kl`` to the policy loss. Its gradient
    ``(1 - exp(d)) ∇logp`` lowers tokens the policy likes more than the reference does.

    Args:
        logprobs: ``(B, T)`` log-probs under the current policy.
        ref_logprobs: ``(B, T)`` log-probs under the reference model; treated as constant.
        loss_mask: ``(B, T)``, nonzero on the tokens the policy sampled.
        num_sequences: denominator replacing ``B`` (default: the number of non-empty rows).

    Returns:
        The scalar KL estimate and its :class:`KLStats`.
    """
    _check("ref_logprobs", logprobs, ref_logprobs, loss_mask, num_sequences)
    lp, ref, mask, n = _prepare(logprobs, ref_logprobs, loss_mask)
    d = (ref - lp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, T)
    k3 = d.exp() - d - 1.0  # (B, T), 0 at masked positions since d = 0 there
    kl = _aggregate(_token_mean(k3, mask, n), n > 0, num_sequences)
    with torch.no_grad():
        parts = [k3.sum() / n.sum().clamp(min=1), k3.max(), n.sum()]
        values = torch.stack([v.to(torch.float64) for v in parts])
    return kl, KLStats(values)


LOSSES: dict[str, LossFn] = {
    "gspo_token": gspo_token_loss,
    "gspo": gspo_loss,
    "grpo": grpo_loss,
    "cispo": cispo_loss,
    "dppo": dppo_loss,
}
"""Policy losses by config name; GSPO-token is the default of the learner. CISPO and DPPO live in
:mod:`agentrl.learner.weighted_losses`."""


def get_loss(name: str) -> LossFn:
    """The loss registered under ``name`` in :data:`LOSSES`.

    Raises:
        ConfigError: ``name`` is not registered.
    """
    if name not in LOSSES:
        raise ConfigError(f"loss: expected one of {sorted(LOSSES)}, got {name!r}")
    return LOSSES[name]
