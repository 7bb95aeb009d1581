"""Policy losses: GSPO, GSPO-token and GRPO, plus a KL-to-reference term.

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
from agentrl.learner.loss_stats import KLStats, LossStats

__all__ = [
    "LOSSES",
    "MAX_LOG_RATIO",
    "KLStats",
    "LossFn",
    "LossStats",
    "count_sequences",
    "get_loss",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "kl_to_reference",
]

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ``±MAX_LOG_RATIO`` before ``exp`` (finite in float32 and bf16)."""


class LossFn(Protocol):
    """Signature shared by :func:`gspo_loss`, :func:`gspo_token_loss` and :func:`grpo_loss`."""

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
# shared helpers


def count_sequences(loss_mask: torch.Tensor) -> int:
    """Number of rows of a ``(B, T)`` mask with at least one loss token.

    This is the default denominator of every loss here; pass the whole mini-batch's count as
    ``num_sequences`` to each of its micro-batches.
    """
    return int((loss_mask != 0).any(dim=-1).sum())


def _check(
    name: str,
    logprobs: torch.Tensor,
    other: torch.Tensor,
    loss_mask: torch.Tensor,
    num_sequences: int | None,
) -> None:
    if logprobs.dim() != 2 or logprobs.numel() == 0:
        raise ValueError(
            f"logprobs: expected a non-empty (B, T) tensor, got shape {tuple(logprobs.shape)}"
        )
    if not logprobs.is_floating_point():
        raise TypeError(f"logprobs: expected a floating-point tensor, got {logprobs.dtype}")
    for what, t in ((name, other), ("loss_mask", loss_mask)):
        if t.shape != logprobs.shape:
            raise ValueError(
                f"{what}: expected shape {tuple(logprobs.shape)}, got {tuple(t.shape)}"
            )
    if num_sequences is not None and num_sequences < 1:
        raise ValueError(f"num_sequences: expected a positive int or None, got {num_sequences}")


def _check_policy_args(
    advantages: torch.Tensor, shape: torch.Size, eps_low: float, eps_high: float, per_token: bool
) -> None:
    allowed = [(shape[0],), tuple(shape)] if per_token else [(shape[0],)]
    if tuple(advantages.shape) not in allowed:
        raise ValueError(f"advantages: expected shape in {allowed}, got {tuple(advantages.shape)}")
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(
            f"eps_low, eps_high: expected 0 <= eps_low < 1 and eps_high >= 0, "
            f"got {eps_low}, {eps_high}"
        )


def _prepare(
    logprobs: torch.Tensor, other: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upcast, zero the masked positions and count loss tokens per row."""
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    mask = loss_mask != 0  # (B, T) bool
    # where() (not multiplication) so that -inf/NaN padding gives neither NaN values nor grads
    lp = torch.where(mask, logprobs.to(dtype), 0.0)  # (B, T)
    ot = torch.where(mask, other.detach().to(dtype), 0.0)  # (B, T)
    return lp, ot, mask, mask.sum(dim=-1)  # n: (B,)


def _sequence_log_ratio(lp: torch.Tensor, old: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``log s_i = mean_t (logp - old)`` over each row's loss tokens (eq. 7), unclamped."""
    return (lp - old).sum(dim=-1) / n.clamp(min=1)


def _clipped_objective(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``min(r A, clip(r, 1-ε_low, 1+ε_high) A)`` and where the clip removed the gradient."""
    obj = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    clipped = ((ratio > 1.0 + eps_high) & (adv > 0)) | ((ratio < 1.0 - eps_low) & (adv < 0))
    return obj, clipped


def _aggregate(
    per_seq: torch.Tensor, valid: torch.Tensor, num_sequences: int | None
) -> torch.Tensor:
    """Sum over non-empty sequences divided by ``num_sequences`` (default: their count)."""
    total = torch.where(valid, per_seq, 0.0).sum()
    denom = valid.sum().clamp(min=1) if num_sequences is None else num_sequences
    return total / denom


def _token_mean(values: torch.Tensor, mask: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Mean over each row's loss tokens, ``(B, T) -> (B,)``; 0 for an empty row."""
    return torch.where(mask, values, 0.0).sum(dim=-1) / n.clamp(min=1)


@torch.no_grad()
def _stats(
    lp: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    ratio: torch.Tensor,
    ratio_mask: torch.Tensor,
    clipped_tokens: torch.Tensor,
) -> LossStats:
    """The diagnostics, left on the device (one copy to the host when first read)."""
    valid = mask.any(dim=-1)  # (B,)
    clipped_tokens = clipped_tokens & mask  # (B, T)
    num_tokens = mask.sum()
    num_seqs = valid.sum()
    d = (lp - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, T), 0 where masked
    r = ratio.detach()
    num_ratios = ratio_mask.sum()
    has_ratio = num_ratios > 0
    one = r.new_ones(())
    values = [
        clipped_tokens.sum() / num_tokens.clamp(min=1),
        (clipped_tokens.any(dim=-1) & valid).sum() / num_seqs.clamp(min=1),
        torch.where(has_ratio, torch.where(ratio_mask, r, 0.0).sum() / num_ratios, one),
        torch.where(has_ratio, torch.where(ratio_mask, r, torch.inf).amin(), one),
        torch.where(has_ratio, torch.where(ratio_mask, r, -torch.inf).amax(), one),
        (d.exp() - 1.0 - d).sum() / num_tokens.clamp(min=1),  # k3 is 0 where masked
        num_tokens,
        num_seqs,
    ]
    return LossStats(torch.stack([v.to(torch.float64) for v in values]))


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
}
"""Policy losses by config name; GSPO-token is the default of the learner."""


def get_loss(name: str) -> LossFn:
    """The loss registered under ``name`` in :data:`LOSSES`.

    Raises:
        ConfigError: ``name`` is not registered.
    """
    if name not in LOSSES:
        raise ConfigError(f"loss: expected one of {sorted(LOSSES)}, got {name!r}")
    return LOSSES[name]
