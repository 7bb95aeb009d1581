"""Loud failures: a run that cannot learn says so, and shows the episodes that went wrong.

:class:`RunHealth` watches every training step of both loops (called from
:meth:`~agentrl.loop.trainer.Trainer.update` and :meth:`~agentrl.loop.trainer.Trainer.after_step`):

- the first traceback of a failing episode is logged at ERROR, once per run;
- a step where every group had equal rewards (no signal: the learner did nothing) is a warning;
  each kind of warning is printed once, then counted (:attr:`RunHealth.warnings`: the progress
  line and ``summary.json`` show the counts);
- failed episodes are counted by cause over the run (:meth:`RunHealth.failures`, for
  ``summary.json`` and the summary table);
- a run stops with :class:`~agentrl.errors.TrainingError` when more than
  ``train.max_failed_frac`` of a step's episodes fail for ``train.max_failed_steps`` steps in a
  row: its first line says so and names the first failure, the first traceback follows; the
  process then ends even if env threads are stuck (:func:`~agentrl.rollout.watchdog.guard_exit`);
- a few failed, timed-out and zero-signal episodes of each step are written to
  ``trajectories.jsonl`` beside the trained ones, marked by ``"kind"``, so the report shows them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl import fast_json
from agentrl.config import TrainLoopConfig
from agentrl.errors import TrainingError
from agentrl.rollout.watchdog import guard_exit
from agentrl.types import Group, Trajectory

log = logging.getLogger("agentrl.loop.trainer")

SAMPLES_PER_KIND = 2
"""Untrained episodes of each kind (failed, timeout, zero_signal) written per step."""


class RunHealth:
    """Failure and signal checks of a run (module docstring).

    Args:
        config: the ``train`` section (``max_failed_frac``, ``max_failed_steps``).
    """

    def __init__(self, config: TrainLoopConfig) -> None:
        self.config = config
        self.first_traceback: str | None = None
        self.first_error: str | None = None
        """``"Type: message"`` of the run's first failed episode, with its task."""
        self.failed_streak = 0
        self.warnings: dict[str, int] = {}
        """How often each kind of warning was raised (``{"no_learning_signal": 28}``)."""
        self.episodes = 0
        self.failed = 0
        self.failed_by_cause: dict[str, int] = {}

    def warn(self, kind: str, message: str) -> None:
        """Log ``message`` the first time ``kind`` is raised; afterwards only count it."""
        self.warnings[kind] = self.warnings.get(kind, 0) + 1
        if self.warnings[kind] == 1:
            log.warning("%s (shown once; the progress and summary count the rest)", message)

    def failures(self) -> dict[str, Any]:
        """The run's failed training episodes: total, by cause and the first error (one line)."""
        first = None if self.first_error is None else " ".join(self.first_error.split())
        return {
            "episodes": self.episodes,
            "failed": self.failed,
            "by_cause": dict(self.failed_by_cause),
            "first_error": first,
        }

    def observe(
        self, step: int, groups: Sequence[Group], trained: Sequence[Trajectory]
    ) -> list[tuple[str, Trajectory]]:
        """Look at a step's groups; returns the untrained episodes to record, as (kind, traj).

        Args:
            step: the step these groups train (for messages).
            groups: every group of the step, failed episodes included.
            trained: the trajectories sent to the learner.
        """
        kept = {id(t) for t in trained}
        samples: dict[str, list[Trajectory]] = {"failed": [], "timeout": [], "zero_signal": []}
        alive = zero = 0
        for g in groups:
            ok = [t for t in g.trajectories if not t.failed]
            alive += bool(ok)
            if ok and not any(id(t) in kept for t in ok):
                zero += 1
                samples["zero_signal"].append(ok[0])
            for t in g.trajectories:
                if t.failed:
                    samples["failed"].append(t)
                    if self.first_traceback is None:
                        self.first_traceback = t.info.get("traceback") or t.error
                        self.first_error = f"{t.error} (task {t.task_id}, env {t.env_id})"
                        log.error(
                            "an episode failed (first failure of this run, task %s):\n%s",
                            t.task_id,
                            self.first_traceback,
                        )
                elif t.finish_reason == "timeout" and id(t) not in kept:
                    samples["timeout"].append(t)
        if alive and zero == alive:
            self.warn(
                "no_learning_signal",
                f"step {step}: every group's episodes got equal rewards (no learning signal), so "
                "the learner did nothing; check the reward function and the task difficulty",
            )
        return [(k, t) for k, ts in samples.items() for t in ts[:SAMPLES_PER_KIND]]

    def check(self, step: int, metrics: dict[str, float]) -> None:
        """Count a step's failed episodes; raise when too many failed for too long.

        Raises:
            TrainingError: more than ``max_failed_frac`` of the episodes failed in each of the
                last ``max_failed_steps`` steps; the message holds the first traceback.
        """
        episodes = metrics.get("rollout/episodes", 0.0)
        if not episodes:
            return
        self.episodes += int(episodes)
        self.failed += int(metrics.get("rollout/failed", 0.0))
        prefix = "rollout/failed_"
        for key, n in metrics.items():
            if key.startswith(prefix) and n:
                cause = key[len(prefix) :]
                self.failed_by_cause[cause] = self.failed_by_cause.get(cause, 0) + int(n)
        frac = metrics.get("rollout/failed", 0.0) / episodes
        self.failed_streak = self.failed_streak + 1 if frac > self.config.max_failed_frac else 0
        if self.failed_streak >= self.config.max_failed_steps:
            first = (self.first_error or "").replace("\n", " ")
            message = (
                f"stopping at step {step}: more than train.max_failed_frac="
                f"{self.config.max_failed_frac:g} of the episodes failed in each of the last "
                f"{self.failed_streak} steps (train.max_failed_steps); {frac:.0%} failed in the "
                f"last one. The first failure: {first}\n{self.first_traceback}"
            )
            guard_exit(message)  # stuck threads must not keep a failed run alive
            raise TrainingError(message)


def write_records(
    path: Path,
    step: int,
    trained: Sequence[tuple[Trajectory, torch.Tensor]],
    trainer_logprobs: Sequence[Any],
    samples: Sequence[tuple[str, Trajectory]],
) -> None:
    """Append a step's trained trajectories and its sampled untrained ones to ``path``.

    Each line is ``{"step", "kind", "advantages", "trainer_logprobs", "trajectory"}``; ``kind``
    is ``trained``, ``failed``, ``timeout`` or ``zero_signal`` (untrained: zero advantages, no
    trainer log-probs).
    """
    # fast_json and numpy rounding: the stdlib's json and a Python round() per token took
    # ~36 ms a step for 64 x 300 tokens, on the event loop (and its GIL); this takes ~6 ms.
    lp = [*trainer_logprobs, *[None] * len(trained)]  # None where the learner gave none
    recs = [
        ("trained", t, np.round(a.detach().double().cpu().numpy(), 6).tolist(), lp[i])
        for i, (t, a) in enumerate(trained)
    ]
    untrained = sorted(samples, key=lambda s: (s[1].task_id, s[1].group_index))
    recs += [(kind, t, [0.0] * len(t.tokens), None) for kind, t in untrained]
    with path.open("ab") as f:
        for kind, t, advantages, logprobs in recs:
            rec = {"step": step, "kind": kind, "advantages": advantages,
                   "trainer_logprobs": logprobs, "trajectory": t}  # fmt: skip
            f.write(fast_json.dumps(rec) + b"\n")
