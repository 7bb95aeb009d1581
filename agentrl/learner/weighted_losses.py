"""Importance-weighted REINFORCE losses: CISPO (MiniMax-M1) and DPPO (prime-rl's default loss).

Unlike GSPO and GRPO, neither takes PPO's ``min`` of a clipped and an unclipped objective:

* **CISPO** keeps every token's gradient and truncates its importance *weight* (a constant);
* **DPPO** drops the tokens whose *probability* (not ratio) moved too far in the direction their
  advantage pushes, and adds a small penalty on the squared log-ratio.

Both follow the conventions of :mod:`agentrl.learner.losses` (its module docstring): minus a mean
over sequences of each sequence's mean over its loss tokens (the papers and prime-rl take one
token mean over the whole batch instead; the house convention weighs sequences equally whatever
their length and lets micro-batches add up via ``num_sequences``), float32 or float64
arithmetic, log-ratios clamped to ``±MAX_LOG_RATIO`` before ``exp``, masked positions zeroed
before any arithmetic. ``old_logprobs`` are the engine's (the behaviour policy), as in prime-rl.
``docs/architecture.md`` restates the equations.
"""

from __future__ import annotations

import torch

from agentrl.learner.loss_math import (
    MAX_LOG_RATIO,
    _aggregate,
    _check,
    _prepare,
    _stats,
    _token_mean,
)
from agentrl.learner.loss_stats import LossStats

__all__ = ["cispo_loss", "dppo_loss"]


def _token_advantages(advantages: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """``(B,)`` or ``(B, T)`` advantages as a constant broadcastable to ``(B, T)``."""
    allowed = [(lp.shape[0],), tuple(lp.shape)]
    if tuple(advantages.shape) not in allowed:
        raise ValueError(f"advantages: expected shape in {allowed}, got {tuple(advantages.shape)}")
    adv = advantages.detach().to(lp.dtype)
    return adv[:, None] if adv.dim() == 1 else adv


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    *,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio.

    MiniMax-M1 (arXiv:2506.13585), eqs. 4-5: ``r[i,t] = exp(logp[i,t] - old[i,t])``,
    ``w[i,t] = sg(clip(r[i,t], 1-ε_low, 1+ε_high))`` and the loss is
    ``-(1/B) Σ_i (1/|y_i|) Σ_t w[i,t] A[i,t] logp[i,t]``. Every token keeps a gradient,
    ``w[i,t] A[i,t] ∇logp[i,t] / |y_i|``: the clip bounds the weight, it never drops the token
    (PPO's clip zeroes the rare, high-ratio "fork" tokens after the first update). The paper sets
    no lower bound (``ε_low = 1``: the weight only has to be non-negative) and tunes ``ε_high``;
    the defaults are Trinity-RFT's CISPO defaults (``clip_range_low=1.0``,
    ``clip_range_high=0.28``). The loss value depends on ``logp`` itself, so it is not comparable
    with the other losses' values; its gradient is. ``LossStats.clip_frac_*`` count the tokens
    whose weight the clip truncated (whatever the advantage's sign; they keep a gradient).

    Args:
        logprobs: ``(B, T)`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``(B, T)`` behaviour log-probs (the engine's); treated as constant.
        advantages: ``(B,)`` or ``(B, T)``; treated as constant.
        loss_mask: ``(B, T)``, nonzero on the tokens the policy sampled.
        eps_low: the weight's lower bound is ``1 - eps_low`` (``0 <= eps_low <= 1``).
        eps_high: the weight's upper bound is ``1 + eps_high``.
        num_sequences: denominator replacing ``B`` (default: the number of non-empty rows).

    Returns:
        The scalar loss and its :class:`LossStats` (ratio statistics over tokens).
    """
    _check("old_logprobs", logprobs, old_logprobs, loss_mask, num_sequences)
    if not (0.0 <= eps_low <= 1.0 and eps_high >= 0.0):
        raise ValueError(
            f"eps_low, eps_high: expected 0 <= eps_low <= 1 and eps_high >= 0 for cispo, "
            f"got {eps_low}, {eps_high}"
        )
    lp, old, mask, n = _prepare(logprobs, old_logprobs, loss_mask)
    adv = _token_advantages(advantages, lp)  # (B, T) or (B, 1)
    ratio = (lp - old).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # (B, T) constant
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # (B, T)
    obj = weight * adv * lp  # (B, T), 0 where masked since lp = 0 there
    valid = n > 0
    loss = -_aggregate(_token_mean(obj, mask, n), valid, num_sequences)
    truncated = (ratio > 1.0 + eps_high) | (ratio < 1.0 - eps_low)
    return loss, _stats(lp, old, mask, ratio, mask, truncated)


def dppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    *,
    num_sequences: int | None = None,
    kl_coef: float = 1e-3,
) -> tuple[torch.Tensor, LossStats]:
    """DPPO as prime-rl's default loss: a probability-difference trust region plus a KL term.

    prime-rl ``src/prime_rl/trainer/rl/loss.py`` (``default_loss_fn``, "DPPO+KL": DPPO-Binary-TV,
    arXiv:2602.04879, with Kimi-K2.5's KL, arXiv:2602.02276; config ``DefaultLossConfig``:
    ``dppo_mask_low = dppo_mask_high = 0.2``, ``kl_tau = 1e-3``, ``adv_tau = 1``). With
    ``r = exp(logp - old)`` and ``Δp = exp(logp) - exp(old)`` (the sampled token's probability
    change, a one-token total-variation estimate), a token is **masked** when it moved too far
    in the direction its advantage pushes: ``A > 0 and Δp > δ_high`` or ``A < 0 and Δp <
    -δ_low``. Per token, ``ℓ[i,t] = -(1 - m[i,t]) A[i,t] r[i,t] + τ (logp[i,t] - old[i,t])²``,
    and the loss is ``(1/B) Σ_i (1/|y_i|) Σ_t ℓ[i,t]``. Gradient of a kept token:
    ``(-A r + 2τ log r) ∇logp / |y_i|``; a masked token keeps only the KL part. ``eps_low`` and
    ``eps_high`` are ``δ_low``, ``δ_high`` (probability differences, not ratio ranges).
    ``LossStats.clip_frac_*`` count the masked tokens.

    Args:
        logprobs: ``(B, T)`` log-probs of the sampled tokens under the current policy.
        old_logprobs: ``(B, T)`` behaviour log-probs (the engine's); treated as constant.
        advantages: ``(B,)`` or ``(B, T)``; treated as constant.
        loss_mask: ``(B, T)``, nonzero on the tokens the policy sampled.
        eps_low: ``δ_low``, the largest probability drop kept for a negative advantage.
        eps_high: ``δ_high``, the largest probability rise kept for a positive advantage.
        num_sequences: denominator replacing ``B`` (default: the number of non-empty rows).
        kl_coef: ``τ``, the weight of the squared log-ratio (prime-rl's ``kl_tau``).

    Returns:
        The scalar loss and its :class:`LossStats` (ratio statistics over tokens).
    """
    _check("old_logprobs", logprobs, old_logprobs, loss_mask, num_sequences)
    if not (eps_low >= 0.0 and eps_high >= 0.0 and kl_coef >= 0.0):
        raise ValueError(
            f"eps_low, eps_high, kl_coef: expected >= 0 for dppo, got {eps_low}, {eps_high}, "
            f"{kl_coef}"
        )
    lp, old, mask, n = _prepare(logprobs, old_logprobs, loss_mask)
    adv = _token_advantages(advantages, lp)  # (B, T) or (B, 1)
    log_r = lp - old  # (B, T), 0 where masked
    ratio = log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    with torch.no_grad():
        dp = lp.exp() - old.exp()  # (B, T), 0 where masked
        masked = ((adv > 0) & (dp > eps_high)) | ((adv < 0) & (dp < -eps_low))  # (B, T)
    per_token = kl_coef * log_r.square() - torch.where(masked, 0.0, adv * ratio)  # (B, T)
    valid = n > 0
    loss = _aggregate(_token_mean(per_token, mask, n), valid, num_sequences)
    return loss, _stats(lp, old, mask, ratio, mask, masked)
