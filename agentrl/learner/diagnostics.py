"""What a learner step reports beside its loss.

The engine/trainer mismatch, TIS weights, and the trainer's log-probs per sample for the
trajectory viewer.

All of it runs on the device and is read at the step's end (``StepStats.later``), so that no
statistic makes the host wait for the GPU mid-step.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from agentrl.learner.distributed import StepStats
from agentrl.learner.packing import PackedBatch, TrainSample


def mismatch_stats(
    batch: PackedBatch, trainer: torch.Tensor, engine: torch.Tensor, stats: StepStats
) -> None:
    """Trainer vs engine log-probs of one micro-batch, on the device, read at the step's end."""
    diff = trainer.float() - engine  # (n,)
    n = diff.numel()
    if n == 0:
        return
    seq_mean, counts = batch.sequence_means(diff)  # (S,) a sequence's mean log-ratio
    trained = counts > 0
    values = torch.stack(
        [
            diff.abs().sum(),
            diff.abs().max(),
            torch.where(trained, seq_mean, 0.0).sum(),
            torch.where(trained, seq_mean.abs(), 0.0).max(),
            trained.sum(),
        ]
    )

    def record(stats: StepStats) -> None:
        abs_sum, abs_max, seq_sum, seq_abs_max, num_seqs = values.tolist()
        stats.mean("mismatch/mean_abs", abs_sum / n, n)
        stats.extreme("mismatch/max_abs", abs_max, high=True)
        stats.mean("mismatch/seq_log_ratio_mean", seq_sum / num_seqs, num_seqs)
        stats.extreme("mismatch/seq_log_ratio_abs_max", seq_abs_max, high=True)

    stats.later(record)


def trainer_logprobs_by_sample(
    samples: Sequence[TrainSample], pre_update: dict[int, torch.Tensor]
) -> dict[int, np.ndarray]:
    """This rank's samples' trainer log-prob of each token (0 where nothing trains).

    Vectorised: this host work sits between two steps, with the GPU idle. The ranks' dicts are
    merged with the step's statistics (:meth:`StepStats.merged`), in one collective.
    """
    keys = list(pre_update)
    if not keys:
        return {}
    trainer = torch.cat([pre_update[i].float() for i in keys]).cpu().numpy()  # one copy
    lengths = [len(samples[i].loss_mask) for i in keys]
    flat = chain.from_iterable(samples[i].loss_mask for i in keys)
    mask = np.fromiter(flat, dtype=bool, count=sum(lengths))
    full = np.zeros(mask.shape[0], dtype=np.float32)
    full[mask] = trainer
    rows = np.split(full, np.cumsum(lengths)[:-1])
    return dict(zip(keys, rows, strict=True))
