"""A run's append-only logs, and cutting them back without a window where a kill loses them.

A run killed between two checkpoints has logged steps that its resume will run again, so
resuming first cuts its logs back to the checkpoint's step. The cut goes through a temporary
file that replaces the log (:func:`~agentrl.loop.atomic.replace_file`): a SIGKILL at any
instant leaves the old log or the cut one, whole. A run with no good checkpoint starts over and
its logs are set aside (renamed), never deleted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from agentrl.loop.atomic import replace_file

LOGS = ("metrics.jsonl", "trajectories.jsonl")
"""The run directory's append-only logs, cut back to the checkpoint a resumed run starts from."""


def _kept(line: bytes, step: int | None) -> bool:
    """Whether a log line survives a cut back to ``step``: JSON (not torn), of a step <= it."""
    if step is None:
        return False
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    return isinstance(rec, dict) and rec.get("step", 0) <= step


def _drop_lines_after(path: Path, step: int | None) -> None:
    """Remove records of steps after ``step`` (all of them when ``None``), atomically.

    A torn line goes too. The kept lines go to a temporary file that replaces ``path``
    (:func:`~agentrl.loop.atomic.replace_file`): a kill at any instant leaves the old log or
    the cut one, whole. A log with nothing to cut is left as it is.
    """
    if not path.exists():
        return
    with open(path, "rb") as f:
        if all(_kept(ln, step) and ln.endswith(b"\n") for ln in f):
            return

    def kept() -> Iterator[bytes]:  # in ~1 MiB chunks: a few writes, bounded memory
        chunk: list[bytes] = []
        size = 0
        with open(path, "rb") as f:
            for ln in f:
                if _kept(ln, step):
                    chunk.append(ln if ln.endswith(b"\n") else ln + b"\n")
                    size += len(chunk[-1])
                if size >= 1 << 20:
                    yield b"".join(chunk)
                    chunk, size = [], 0
        yield b"".join(chunk)

    replace_file(path, kept())


def cut_logs(run_dir: Path, step: int | None) -> None:
    """Cut every log of ``run_dir`` back to ``step`` (to nothing when ``None``)."""
    for name in LOGS:
        _drop_lines_after(run_dir / name, step)


def set_aside(path: Path) -> Path | None:
    """Rename ``path`` to the first free ``<name>.before-restart-<n>``; None if it is absent."""
    if not path.exists():
        return None
    n = 1
    while (aside := path.with_name(f"{path.name}.before-restart-{n}")).exists():
        n += 1
    path.rename(aside)
    return aside


def start_over(run_dir: Path) -> str:
    """Set aside the logs of a run with no good checkpoint (kept, renamed); returns the notice.

    Its summaries go (the run starts over: cold start and all).
    """
    moved = [m for name in LOGS if (m := set_aside(run_dir / name)) is not None]
    for name in ("summary_state.json", "summary.json"):
        (run_dir / name).unlink(missing_ok=True)
    notice = f"resume: no good checkpoint in {run_dir}; starting the run over"
    if moved:
        notice += " (its logs were kept as " + ", ".join(m.name for m in moved) + ")"
    return notice
