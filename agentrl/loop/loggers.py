"""The run's trackers (``train.loggers``): ``jsonl`` always, plus TensorBoard, W&B and Trackio.

``metrics.jsonl`` is written by the Trainer itself; :class:`Loggers` sends the same lines, under
the same metric names, to the trackers named in ``train.loggers`` (``tensorboard: true`` is an
alias of ``"tensorboard"``). W&B and Trackio get the whole config as the run's config and, at
each evaluation, a table of the newest step's sample trajectories (TensorBoard has no tables).
Cold-start metrics (``sft/*``) are plotted against ``sft/step``, the rest against ``step``.

W&B runs offline with ``WANDB_MODE=offline`` (files under the run directory's ``wandb/``);
Trackio writes to its local store (``TRACKIO_DIR``) unless a Space is configured.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from agentrl.errors import ConfigError

LOGGERS = ("jsonl", "tensorboard", "wandb", "trackio")
"""Every name ``train.loggers`` accepts."""
PROJECT = "agentrl"
"""The W&B / Trackio project when ``WANDB_PROJECT`` / ``TRACKIO_PROJECT`` is not set."""
SAMPLE_ROWS = 16
"""Sample trajectories per table."""
_TAIL_BYTES = 4 << 20  # of trajectories.jsonl read for the newest step's samples
_TEXT_CHARS = 4000  # of one sample's conversation in a table
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}

COLUMNS = ["step", "kind", "task_id", "reward", "turns", "finish_reason", "error", "conversation"]
"""The sample table's columns."""


class _Tracker(Protocol):
    def scalars(self, step: int, metrics: dict[str, float]) -> None: ...
    def table(self, step: int, rows: list[list[Any]]) -> None: ...
    def close(self) -> None: ...


def logger_names(loggers: Sequence[str], tensorboard: bool = False) -> list[str]:
    """The trackers to start: ``loggers`` less ``jsonl`` (the Trainer's own), plus the alias.

    Raises:
        ConfigError: a tracker's package is not installed (one line saying what to install).
    """
    names = [n for n in dict.fromkeys([*loggers, *(["tensorboard"] if tensorboard else [])])]
    names = [n for n in names if n != "jsonl"]
    for name in names:
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            extra = "tensorboard" if name == "tensorboard" else f"'agentrl[{name}]'"
            raise ConfigError(
                f"train.loggers: {name} needs the {name} package: pip install {extra}"
            )
    return names


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _run_id(run_dir: Path) -> str:
    # stable per run directory, so a resumed run continues the same tracker run
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in run_dir.name)[:48]
    return f"{name}-{digest}"


class _TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        x = int(metrics.get("sft/step", step))
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, x if key.startswith("sft/") else step)
        self.writer.flush()

    def table(self, step: int, rows: list[list[Any]]) -> None:
        pass  # TensorBoard has no tables

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        settings = wandb.Settings(console="off", save_code=False, x_disable_stats=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or PROJECT,
            name=name,
            id=_run_id(run_dir),
            resume="allow",
            dir=str(run_dir),
            config=config,
            settings=settings,
        )
        # cold-start rows all have step 0: their x axis is sft/step
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run.define_metric("sft/step")
        self.run.define_metric("sft/*", step_metric="sft/step")

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({"step": step, **metrics})

    def table(self, step: int, rows: list[list[Any]]) -> None:
        self.run.log({"step": step, "samples": self.wandb.Table(columns=[*COLUMNS], data=rows)})

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        import trackio

        self.trackio = trackio
        with contextlib.redirect_stdout(io.StringIO()):  # its banner would mix with the summary
            self.run = trackio.init(
                project=os.environ.get("TRACKIO_PROJECT") or PROJECT,
                name=name,
                config=config,
                resume="allow",
                auto_log_gpu=False,
                auto_log_cpu=False,
                embed=False,  # never a dashboard server
            )
        # this object finishes the run (close); trackio's exit hook would finish it again
        trackio.context_vars.current_run.set(None)

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        sft = {k: v for k, v in metrics.items() if k.startswith("sft/")}
        rest = {k: v for k, v in metrics.items() if not k.startswith("sft/")}
        if sft:
            self.run.log(sft, step=int(sft.get("sft/step", step)))
        if rest:
            self.run.log(rest, step=step)

    def table(self, step: int, rows: list[list[Any]]) -> None:
        self.run.log({"samples": self.trackio.Table(columns=COLUMNS, data=rows)}, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.run.finish()


def sample_rows(path: Path, limit: int = SAMPLE_ROWS) -> tuple[int, list[list[Any]]]:
    """``(step, rows)``: up to ``limit`` trajectories of the newest step in ``trajectories.jsonl``.

    Reads at most the file's last 4 MiB, so the cost does not grow with the run.
    """
    if not path.is_file():
        return -1, []
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - _TAIL_BYTES))
        lines = f.read().split(b"\n")
    if size > _TAIL_BYTES:
        lines = lines[1:]  # the first may be cut
    recs: list[dict[str, Any]] = []
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if recs and rec.get("step") != recs[0].get("step"):
            break
        recs.append(rec)
    recs = recs[::-1][:limit]
    rows = []
    for rec in recs:
        t = rec.get("trajectory") or {}
        text = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in t.get("messages", []))
        rows.append([
            int(rec.get("step", 0)),
            str(rec.get("kind", "")),
            str(t.get("task_id", "")),
            float(t.get("reward", 0.0)),
            len(t.get("turns", [])),
            str(t.get("finish_reason", "")),
            str(t.get("error") or ""),
            text[:_TEXT_CHARS],
        ])  # fmt: skip
    return (int(recs[0].get("step", 0)) if recs else -1), rows


class Loggers:
    """The trackers of one run (rank 0): :meth:`log` as ``metrics.jsonl`` gets a line."""

    def __init__(
        self, names: Sequence[str], run_dir: Path, *, name: str, config: dict[str, Any]
    ) -> None:
        self.run_dir = run_dir
        self._trackers: list[_Tracker] = []
        self._tabled = -1  # the newest step whose samples went out
        try:
            for tracker in logger_names(names):
                if tracker == "tensorboard":
                    self._trackers.append(_TensorBoard(run_dir))
                elif tracker == "wandb":
                    self._trackers.append(_Wandb(run_dir, name, config))
                elif tracker == "trackio":
                    self._trackers.append(_Trackio(run_dir, name, config))
        except BaseException:
            self.close()
            raise

    def __bool__(self) -> bool:
        return bool(self._trackers)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Send one ``metrics.jsonl`` line's numbers; an evaluation also sends sample tables."""
        values = _scalars(metrics)
        for tracker in self._trackers:
            tracker.scalars(step, values)
        if "eval/success_rate" in metrics:
            self.samples()

    def samples(self) -> None:
        """Send the newest step's trajectories as a table, once per step."""
        if not self._trackers:
            return
        step, rows = sample_rows(self.run_dir / "trajectories.jsonl")
        if rows and step > self._tabled:
            self._tabled = step
            for tracker in self._trackers:
                tracker.table(step, rows)

    def close(self) -> None:
        """Finish every tracker (idempotent)."""
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()
