"""Shared pieces of the policy losses: input checks, masking, aggregation and statistics.

The conventions they implement (sequence-mean aggregation, empty rows, ``num_sequences`` for
micro-batches, float32/float64 arithmetic, the log-ratio clamp) are described in
:mod:`agentrl.learner.losses`.
"""

from __future__ import annotations

import torch

from agentrl.learner.loss_stats import LossStats

MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to ``±MAX_LOG_RATIO`` before ``exp`` (finite in float32 and bf16)."""


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
