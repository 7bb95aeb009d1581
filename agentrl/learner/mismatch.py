"""Engine vs trainer log-probs, split by where the difference comes from.

A token sampled by the weights being trained (its version equals the learner's
``weight_version``) differs from the trainer's log-prob only by numerics: kernels, batch
shapes, dtype (``mismatch/numeric_*``; about 1e-6 in float32 on CPU, 1e-2 in bfloat16). A token
sampled by an older version (the overlapped loop's partial rollouts and bounded staleness) also
carries the policy lag, the change of the weights since it was sampled (``mismatch/lag_*``),
which is expected and is what GSPO's clipped ratio is there for. ``mismatch/lag_tokens_frac``
is the share of trained tokens that came from older versions.

The same differences are split by where the token sits: by assistant turn (``mismatch/turn_1``,
``turn_2``, ``turn_3``, ``turn_4plus``: the k-th run of loss-mask 1s in the sample) and by
position in the sample (``mismatch/pos_0_512``, ``pos_512_2k``, ``pos_2k_8k``, ``pos_8k_up``),
each as ``<name>_mean_abs``, the mean ``|trainer - engine|`` over those tokens.

**Rollout correction** (``LearnerConfig.rollout_correction``, or the older ``tis``). With
``ρ = exp(old_trainer - old_engine)`` per trained token and ``ρ_seq = exp(mean_t log ρ)`` (the
*geometric mean* over the sequence's trained tokens, GSPO's length-normalised ratio; the product
explodes with length), each token's advantage is multiplied by a constant weight:

* ``token_tis``: ``clamp(ρ, low, high)`` (truncated IS; ``low`` defaults to 0, ``high`` to 2);
* ``seq_tis``: ``clamp(ρ_seq, low, high)`` for every token of the sequence;
* ``token_mis``: ``1[low <= ρ <= high]`` (masked IS as rejection: the token is dropped, the
  others keep weight 1; verl's token-level rejection sampling); defaults [0.5, 2];
* ``seq_mis``: ``1[low <= ρ_seq <= high]``: the whole sequence is dropped or kept;
* ``icepop``: ``ρ 1[low <= ρ <= high]`` (Ring-1T's IcePop, arXiv:2510.18855, as slime's
  ``icepop_function``: in-range tokens are reweighted by ρ, the others masked); defaults
  ``[α, β] = [0.5, 5]``, the paper's.

Logged: ``mismatch/masked_token_frac`` (share of trained tokens with weight 0 from the mask),
``mismatch/masked_seq_frac`` (share of trained sequences with at least one such token),
``mismatch/correction_weight_mean``; TIS presets also ``tis/capped_frac`` and ``tis/weight_mean``.
A masked token keeps its place in the loss (its length, GSPO's sequence ratio) but its advantage,
hence its policy gradient, is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from agentrl.learner.config import LearnerConfig
from agentrl.learner.distributed import StepStats
from agentrl.learner.packing import TrainSample, masked_values

__all__ = [
    "Correction",
    "apply_correction",
    "correction_weights",
    "record_turn_position_split",
    "record_version_split",
    "resolve_correction",
]

TURN_NAMES = ("turn_1", "turn_2", "turn_3", "turn_4plus")
POSITION_EDGES = (512, 2048, 8192)
POSITION_NAMES = ("pos_0_512", "pos_512_2k", "pos_2k_8k", "pos_8k_up")
_DEFAULTS = {  # preset: (low, high)
    "token_tis": (0.0, 2.0),
    "seq_tis": (0.0, 2.0),
    "token_mis": (0.5, 2.0),
    "seq_mis": (0.5, 2.0),
    "icepop": (0.5, 5.0),
}


@dataclass(frozen=True, slots=True)
class Correction:
    """A rollout-correction preset with its resolved bounds (module docs)."""

    preset: str
    low: float
    high: float


def resolve_correction(config: LearnerConfig) -> Correction | None:
    """The correction ``config`` asks for (``tis`` maps to the TIS presets), or ``None``."""
    if config.tis is not None:
        return Correction("token_tis" if config.tis == "token" else "seq_tis", 0.0, config.tis_cap)
    if config.rollout_correction == "none":
        return None
    low, high = _DEFAULTS[config.rollout_correction]
    if config.rollout_correction_low is not None:
        low = config.rollout_correction_low
    if config.rollout_correction_high is not None:
        high = config.rollout_correction_high
    return Correction(config.rollout_correction, low, high)


def correction_weights(
    trainer: torch.Tensor,
    engine: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    correction: Correction,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per trained token: the weight, whether TIS capped it, whether the mask dropped it.

    Args:
        trainer: ``(n,)`` the trainer's old log-prob of each trained token.
        engine: ``(n,)`` the engine's log-prob of the same tokens.
        seq_index: ``(n,)`` the sequence (``0 .. num_seqs-1``) each token belongs to.
        num_seqs: the number of sequences.
        correction: the preset and its bounds.
    """
    log_rho = (trainer.detach().float() - engine.float()).clamp(-20.0, 20.0)  # (n,)
    c = correction
    if c.preset.startswith("seq_"):
        sums = log_rho.new_zeros(num_seqs).index_add(0, seq_index, log_rho)
        counts = torch.zeros_like(sums).index_add(0, seq_index, torch.ones_like(log_rho))
        log_rho = (sums / counts.clamp(min=1))[seq_index]  # (n,) its sequence's mean
    rho = log_rho.exp()
    inside = (rho >= c.low) & (rho <= c.high)
    no = torch.zeros_like(inside)
    if c.preset.endswith("_tis"):
        weight = rho.clamp(c.low, c.high)
        return weight, ~inside, no
    if c.preset.endswith("_mis"):
        return inside.to(rho.dtype), no, ~inside
    return torch.where(inside, rho, 0.0), no, ~inside  # icepop


def apply_correction(
    trainer: torch.Tensor,
    engine: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    correction: Correction,
    stats: StepStats,
) -> torch.Tensor:
    """:func:`correction_weights`, with its metrics recorded at the step's end (module docs)."""
    weight, capped, masked = correction_weights(trainer, engine, seq_index, num_seqs, correction)
    n = weight.numel()
    if n == 0:
        return weight
    seq_masked = torch.zeros(num_seqs, device=weight.device).index_add(0, seq_index, masked.float())
    seq_trained = torch.zeros_like(seq_masked).index_add(0, seq_index, torch.ones_like(weight))
    values = torch.stack(
        [
            masked.float().mean(),
            ((seq_masked > 0) & (seq_trained > 0)).sum(),
            (seq_trained > 0).sum(),
            weight.mean(),
            capped.float().mean(),
        ]
    )
    tis = correction.preset.endswith("_tis")

    def record(stats: StepStats) -> None:
        token_frac, seqs_masked, seqs, w_mean, capped_frac = values.tolist()
        stats.mean("mismatch/masked_token_frac", token_frac, n)
        stats.mean("mismatch/masked_seq_frac", seqs_masked / max(seqs, 1.0), seqs)
        stats.mean("mismatch/correction_weight_mean", w_mean, n)
        if tis:
            stats.mean("tis/capped_frac", capped_frac, n)
            stats.mean("tis/weight_mean", w_mean, n)

    stats.later(record)
    return weight


def _turns_and_positions(samples: Sequence[TrainSample]) -> tuple[np.ndarray, np.ndarray]:
    """Per trained token, in packing order: its turn bucket (0..3) and position bucket (0..3)."""
    turns, positions = [], []
    for s in samples:
        m = np.asarray(s.loss_mask, dtype=bool)
        starts = m & ~np.concatenate(([False], m[:-1]))  # a turn starts where a run of 1s does
        turns.append(np.minimum(np.cumsum(starts)[m], 4) - 1)
        positions.append(np.searchsorted(POSITION_EDGES, np.nonzero(m)[0], side="right"))
    if not turns:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(turns).astype(np.int64), np.concatenate(positions).astype(np.int64)


def record_turn_position_split(
    samples: Sequence[TrainSample], trainer: torch.Tensor, engine: torch.Tensor, stats: StepStats
) -> None:
    """Record ``mismatch/turn_*_mean_abs`` and ``mismatch/pos_*_mean_abs`` (module docs).

    Args:
        samples: the micro-batch's samples, in packing order.
        trainer: the trainer's log-prob of each trained token (before any update).
        engine: the engine's log-prob of each trained token, in the same order.
        stats: the step's statistics (read at the step's end).
    """
    if engine.numel() == 0:
        return
    turn, pos = _turns_and_positions(samples)
    if turn.shape[0] != engine.numel():
        raise ValueError(f"engine: expected {turn.shape[0]} trained tokens, got {engine.numel()}")
    bucket = torch.from_numpy(np.concatenate([turn, pos + 4])).to(engine.device)  # (2n,)
    diff = (trainer.detach().float() - engine.float()).abs().repeat(2)  # (2n,)
    sums = diff.new_zeros(8).index_add(0, bucket, diff)
    counts = torch.zeros_like(sums).index_add(0, bucket, torch.ones_like(diff))
    values = torch.cat([sums, counts])

    def record(stats: StepStats) -> None:
        v = values.tolist()
        for k, name in enumerate(TURN_NAMES + POSITION_NAMES):
            if v[8 + k]:
                stats.mean(f"mismatch/{name}_mean_abs", v[k] / v[8 + k], v[8 + k])

    stats.later(record)


def record_version_split(
    samples: Sequence[TrainSample],
    trainer: torch.Tensor,
    engine: torch.Tensor,
    weight_version: int | None,
    stats: StepStats,
) -> None:
    """Record ``mismatch/numeric_*`` and ``mismatch/lag_*`` of one micro-batch (module docs).

    Args:
        samples: the micro-batch's samples, in packing order.
        trainer: the trainer's log-prob of each trained token (before any update).
        engine: the engine's log-prob of each trained token, in the same order.
        weight_version: the version of the weights being trained; ``None`` records nothing.
        stats: the step's statistics (read at the step's end).
    """
    if weight_version is None or engine.numel() == 0:
        return
    versions = masked_values(
        [s.versions for s in samples], [s.loss_mask for s in samples], engine.device
    )
    diff = (trainer.float() - engine).abs()
    current = versions == float(weight_version)
    values = torch.stack(
        [
            torch.where(current, diff, 0.0).sum(),
            torch.where(current, diff, 0.0).max(),
            torch.where(current, 0.0, diff).sum(),
            torch.where(current, 0.0, diff).max(),
            current.sum(),
        ]
    )
    n = engine.numel()

    def record(stats: StepStats) -> None:
        num_sum, num_max, lag_sum, lag_max, n_current = values.tolist()
        n_lag = n - n_current
        stats.mean("mismatch/lag_tokens_frac", n_lag / n, n)
        if n_current:
            stats.mean("mismatch/numeric_mean_abs", num_sum / n_current, n_current)
            stats.extreme("mismatch/numeric_max_abs", num_max, high=True)
        if n_lag:
            stats.mean("mismatch/lag_mean_abs", lag_sum / n_lag, n_lag)
            stats.extreme("mismatch/lag_max_abs", lag_max, high=True)

    stats.later(record)
