"""What makes a resumed run exact: RNG states, logs cut back to the checkpoint, finished runs.

A run directory's logs (:data:`LOGS`) are append-only; a run killed between two checkpoints has
logged steps that its resume will run again, so resuming first cuts them back to the
checkpoint's step, atomically (a kill leaves the old log or the cut one, whole). With no good
checkpoint the run starts over and its old logs are kept aside, renamed. A run that already
reached its last step resumes as a no-op. Checkpoints are written aside and sealed by a
manifest (:mod:`agentrl.loop.checkpoints`); resume uses the newest one that verifies.
"""

from __future__ import annotations

import io
import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentrl.loop.atomic import disk_errors
from agentrl.loop.checkpoints import begin, commit, committed, name_of, verify
from agentrl.loop.hosts import collect_files
from agentrl.loop.logs import LOGS, cut_logs, start_over

__all__ = [
    "LOGS",
    "cut_logs",
    "finished_summary",
    "read_checkpoint",
    "rng_state",
    "set_rng_state",
    "start_over",
    "write_checkpoint",
]

log = logging.getLogger("agentrl.loop.trainer")


def state_file(path: Path, rank: int) -> Path:
    """A checkpoint's trainer-state file of ``rank`` (rank 0's keeps the single-process name)."""
    return path / ("trainer_state.pt" if rank == 0 else f"trainer_state-rank{rank}.pt")


def torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through memory: a full disk is then ``ENOSPC``, not a torch RuntimeError."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with disk_errors(path), open(path, "wb") as f:
        f.write(buf.getbuffer())


def write_checkpoint(
    root: Path, step: int, learner: Any, state: dict[str, Any], ranks: Any, *, keep: int | None
) -> Path:
    """Write the learner's checkpoint and the trainer's ``state`` as ``root/step-NNNNNN``.

    Every rank calls (``ranks``: :class:`~agentrl.loop.ranks.Ranks`): each writes its shards and
    its state into the temporary directory rank 0 made, then rank 0 seals and renames it
    (:mod:`agentrl.loop.checkpoints`) and keeps the ``keep`` newest.

    Raises:
        DiskFull: no space left (the previous checkpoints are untouched).
    """
    final = root / name_of(step)
    tmp = Path(ranks.broadcast(str(begin(root, step)) if ranks.is_main else ""))
    try:
        with disk_errors(final):
            learner.save_checkpoint(tmp)
            torch_save(state, state_file(tmp, ranks.rank))
            ranks.barrier()
            collect_files(ranks, tmp)  # ranks on other hosts: their shards, to rank 0's disk
        if ranks.is_main:
            commit(tmp, step, keep=keep)
    except Exception:
        if ranks.is_main:  # a full disk: give back the space of the half-written one
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


def read_checkpoint(
    run_dir: Path, learner: Any, ranks: Any
) -> tuple[dict[str, Any] | None, list[str]]:
    """Restore the newest good checkpoint of ``run_dir`` into ``learner`` and the global RNGs.

    Checkpoints are tried newest first; one whose manifest does not hold
    (:func:`~agentrl.loop.checkpoints.verify`) or that fails to load on any rank is skipped,
    with one warning line saying why.

    Returns:
        The trainer state :func:`write_checkpoint` saved (``step``, ``cursor``, ``rng``), or
        ``None`` when no checkpoint is good; and the skip lines.
    """
    root = run_dir / "checkpoints"
    names = ranks.broadcast([p.name for p in committed(root)] if ranks.is_main else [])
    skipped: list[str] = []
    for name in names:
        path = root / name
        reason = ranks.broadcast(verify(path) if ranks.is_main else None)
        state: dict[str, Any] | None = None
        if reason is None:
            try:
                learner.load_checkpoint(path)
                state = torch.load(state_file(path, ranks.rank), weights_only=False)
                _ = int(state["step"]), int(state["cursor"]), state["rng"]["python"]  # its shape
            except Exception as e:  # any load error: this checkpoint is not usable
                reason = f"cannot be loaded ({_first_line(e)})"
            reason = next((r for r in ranks.all_gather(reason) if r is not None), None)
        if reason is not None or state is None:
            line = f"resume: skipping checkpoint {path}: {reason}"
            log.warning("%s", line)
            skipped.append(line)
            continue
        set_rng_state(state["rng"])
        return state, skipped
    return None, skipped


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


def finished_summary(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """``summary.json`` of a run that finished ``steps`` steps and checkpointed the last."""
    latest = run_dir / "checkpoints" / "latest"
    summary_path = run_dir / "summary.json"
    if not (latest.exists() and summary_path.exists()):
        return None
    summary = json.loads(summary_path.read_text())
    done = int(summary.get("steps", -1))
    name = latest.read_text().strip()
    if done < steps or name != name_of(done) or verify(run_dir / "checkpoints" / name):
        return None
    return dict(summary)
