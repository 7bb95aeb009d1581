"""Engine vs trainer log-probs, split by where the difference comes from.

A token sampled by the weights being trained (its version equals the learner's
``weight_version``) differs from the trainer's log-prob only by numerics: kernels, batch
shapes, dtype (``mismatch/numeric_*``; about 1e-6 in float32 on CPU, 1e-2 in bfloat16). A token
sampled by an older version (the overlapped loop's partial rollouts and bounded staleness) also
carries the policy lag, the change of the weights since it was sampled (``mismatch/lag_*``),
which is expected and is what GSPO's clipped ratio is there for. ``mismatch/lag_tokens_frac``
is the share of trained tokens that came from older versions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentrl.learner.distributed import StepStats
from agentrl.learner.packing import TrainSample, masked_values

__all__ = ["record_version_split"]


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
