"""What makes a resumed run exact: RNG states, logs cut back to the checkpoint, finished runs.

A run directory's logs (:data:`LOGS`) are append-only; a run killed between two checkpoints has
logged steps that its resume will run again, so resuming first cuts them back to the
checkpoint's step (or to nothing when there is no checkpoint yet). A run that already reached
its last step resumes as a no-op.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def state_file(path: Path, rank: int) -> Path:
    """A checkpoint's trainer-state file of ``rank`` (rank 0's keeps the single-process name)."""
    return path / ("trainer_state.pt" if rank == 0 else f"trainer_state-rank{rank}.pt")


def write_checkpoint(path: Path, learner: Any, state: dict[str, Any], ranks: Any) -> None:
    """Write the learner's checkpoint and the trainer's ``state`` under ``path``; mark it latest.

    Every rank calls: each writes its shards and its state; ``checkpoints/latest`` (``path``'s
    parent) names the checkpoint once all have (``ranks``: :class:`~agentrl.loop.ranks.Ranks`).
    """
    path.mkdir(parents=True, exist_ok=True)
    learner.save_checkpoint(path)
    torch.save(state, state_file(path, ranks.rank))
    ranks.barrier()
    if ranks.is_main:
        (path.parent / "latest").write_text(path.name)


def read_checkpoint(run_dir: Path, learner: Any, ranks: Any) -> dict[str, Any] | None:
    """Restore the latest checkpoint of ``run_dir`` into ``learner`` and the global RNGs.

    Returns:
        The trainer state :func:`write_checkpoint` saved (``step``, ``cursor``, ``rng``), or
        ``None`` when the run has no checkpoint.
    """
    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return None
    path = run_dir / "checkpoints" / latest.read_text().strip()
    learner.load_checkpoint(path)
    state: dict[str, Any] = torch.load(state_file(path, ranks.rank), weights_only=False)
    set_rng_state(state["rng"])
    return state


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's and torch's global RNG states (a checkpoint restores them)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


LOGS = ("metrics.jsonl", "trajectories.jsonl")
"""The run directory's append-only logs, cut back to the checkpoint a resumed run starts from."""


def _drop_lines_after(path: Path, step: int | None) -> None:
    """Remove records of steps after ``step`` (all of them when ``step`` is ``None``).

    A torn last line (the process died mid-write) is dropped too.
    """
    if not path.exists():
        return
    keep = []
    for ln in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if step is not None and rec.get("step", 0) <= step:
            keep.append(ln)
    path.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")


def cut_logs(run_dir: Path, step: int | None) -> None:
    """Cut every log of ``run_dir`` back to ``step`` (to nothing when ``None``)."""
    for name in LOGS:
        _drop_lines_after(run_dir / name, step)


def start_over(run_dir: Path) -> str:
    """Empty the logs and summaries of a run that has no checkpoint; returns the notice."""
    logged = any((run_dir / name).exists() for name in LOGS)
    cut_logs(run_dir, None)
    for name in ("summary_state.json", "summary.json"):
        (run_dir / name).unlink(missing_ok=True)
    notice = f"resume: no checkpoint in {run_dir}; starting the run over"
    return notice + (" (its logs were cut to nothing)" if logged else "")


def finished_summary(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """``summary.json`` of a run that finished ``steps`` steps and checkpointed the last."""
    latest = run_dir / "checkpoints" / "latest"
    summary_path = run_dir / "summary.json"
    if not (latest.exists() and summary_path.exists()):
        return None
    summary = json.loads(summary_path.read_text())
    done = int(summary.get("steps", -1))
    if done < steps or latest.read_text().strip() != f"step-{done:06d}":
        return None
    return dict(summary)
