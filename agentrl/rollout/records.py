"""What leaves the rollout engine: the JSONL sink and the summary metrics of a batch."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from agentrl.rollout.episode import FAILURE_CAUSES
from agentrl.types import Group, Trajectory


class JsonlSink:
    """Appends each trajectory to a JSONL file as it finishes (flushed, so a crash loses none)."""

    def __init__(self, path: str | os.PathLike[str], *, extra: dict[str, Any] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.extra = extra or {}
        self._f: TextIO | None = self.path.open("a", encoding="utf-8")

    def write(self, traj: Trajectory, **fields: Any) -> None:
        """Write one trajectory line (``extra`` and ``fields`` are added beside it)."""
        if self._f is None:
            raise ValueError(f"sink {self.path} is closed")
        rec = {**self.extra, **fields, "trajectory": traj.model_dump(mode="json")}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._f is not None:
            self._f.close()
            self._f = None


def failures_by_cause(trajs: Sequence[Trajectory]) -> dict[str, int]:
    """Failed episodes per cause (every cause of ``FAILURE_CAUSES``, zeros included)."""
    counts: dict[str, int] = dict.fromkeys(FAILURE_CAUSES, 0)
    for t in trajs:
        if t.failed:
            cause = t.info.get("failure", "other")
            counts[cause if cause in counts else "other"] += 1
    return counts


def rollout_metrics(groups: Sequence[Group], *, success_threshold: float = 1.0) -> dict[str, float]:
    """Namespaced summary metrics of a batch of groups (``rollout/...``).

    ``rollout/failed`` counts every failed episode (timeouts included) and
    ``rollout/failed_<cause>`` splits it by cause (``timeout``, ``env``, ``server``, ``other``).
    """
    trajs = [t for grp in groups for t in grp.trajectories]
    if not trajs:
        return {"rollout/episodes": 0.0}
    n = len(trajs)
    rewards = [t.reward for t in trajs]
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    metrics = {
        "rollout/episodes": float(n),
        "rollout/reward_mean": mean,
        "rollout/reward_std": std,
        "rollout/success_rate": sum(r >= success_threshold for r in rewards) / n,
        "rollout/failed": float(sum(t.failed for t in trajs)),
        "rollout/truncated_frac": sum(t.truncated for t in trajs) / n,
        "rollout/response_len_mean": sum(t.num_response_tokens for t in trajs) / n,
        "rollout/turns_mean": sum(len(t.turn_rewards) for t in trajs) / n,
        "rollout/generate_s_mean": sum(t.timing.generate_s for t in trajs) / n,
    }
    for cause, count in failures_by_cause(trajs).items():
        metrics[f"rollout/failed_{cause}"] = float(count)
    return metrics
