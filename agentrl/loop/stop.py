"""Runs that stop well: SIGINT and SIGTERM end a training run at a step, checkpointed.

While :func:`signals` is installed (``agentrl train`` and the recipes, through
:func:`agentrl.loop.jobs.run_training`):

* before the run's loop starts (config, model loading) a signal stops at once: nothing to save;
* during the run the first signal is noted (:func:`requested`): the trainer finishes the step in
  flight, writes a checkpoint and raises :class:`Stopped` (a cold start in progress is
  abandoned: a resume redoes it); a second signal abandons the step in flight (the main task is
  cancelled): if it was still rolling out, the step before it is checkpointed
  (:func:`checkpoint_abandoned`), else the run stops at its newest checkpoint.

The CLI prints ``stopped at step N; resume with <command>`` and exits ``128 + signal``: 130 for
SIGINT (Ctrl-C), 143 for SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from agentrl.errors import AgentRLError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(AgentRLError):
    """A run stopped on a signal; its newest checkpoint is of ``step`` (0: none, or step 0).

    Attributes:
        step: the step a resume continues from.
        signum: the signal that stopped it.
        run_dir: the run directory (``None``: stopped before there was one).
        command: the command that resumes it (set by the CLI; ``None`` when unknown).
    """

    def __init__(self, step: int, signum: int, run_dir: Path | None = None) -> None:
        super().__init__(f"stopped at step {step}")
        self.step = step
        self.signum = signum
        self.run_dir = run_dir
        self.command: str | None = None

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 130 (SIGINT), 143 (SIGTERM)."""
        return 128 + self.signum

    def line(self) -> str:
        """The one line the CLI prints."""
        if self.run_dir is None:
            return "stopped before the run started; nothing to resume"
        if self.command is None:
            return f"stopped at step {self.step}; resume it with --resume in {self.run_dir}"
        return f"stopped at step {self.step}; resume with {self.command}"


class _State:
    def __init__(self) -> None:
        self.installed = False
        self.signum: int | None = None
        self.count = 0
        self.deferred = False  # a run is under way: note the signal, the trainer stops itself
        self.task: asyncio.Task[object] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None


_state = _State()


def _handle(signum: int, frame: FrameType | None) -> None:
    _state.count += 1
    if _state.signum is None:
        _state.signum = signum
    if not _state.deferred:
        raise Stopped(0, signum)
    if _state.count >= 2 and _state.task is not None and _state.loop is not None:
        _state.loop.call_soon_threadsafe(_state.task.cancel)  # abandon the step in flight


def requested() -> int | None:
    """The signal that asked the run to stop, if one did (``None`` outside :func:`signals`)."""
    return _state.signum


@contextlib.contextmanager
def signals() -> Iterator[None]:
    """Handle SIGINT and SIGTERM as this module says, for the duration of the block.

    Outside the main thread (where Python cannot take signals) it does nothing.
    """
    if threading.current_thread() is not threading.main_thread() or _state.installed:
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    _state.__init__()  # type: ignore[misc]
    _state.installed = True
    for s in SIGNALS:
        signal.signal(s, _handle)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _state.installed = False
        _state.deferred = False
        _state.task = _state.loop = None


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Inside a running event loop: a signal is noted (and a second cancels this task)."""
    if not _state.installed:
        yield
        return
    _state.deferred = True
    _state.task = asyncio.current_task()
    _state.loop = asyncio.get_running_loop()
    try:
        yield
    finally:
        _state.deferred = False
        _state.task = _state.loop = None


def checkpoint_abandoned(trainer: Any) -> None:
    """After a second signal cancelled the step in flight: checkpoint the last finished step.

    Only while the step was still rolling out (``trainer.updating`` is false: the learner has not
    started on it), in one process (a checkpoint is a collective). The synchronous loop goes
    back to the cursor and RNG states the step began with, so the resume is exact; the
    overlapped loop's checkpoint is the one it would have written at that point.
    """
    if requested() is None or trainer.updating or trainer.ranks.world_size > 1:
        return
    if trainer.step_start is not None and trainer.config.train.max_staleness == 0:
        from agentrl.loop.resume import set_rng_state

        trainer.cursor, rng = trainer.step_start
        set_rng_state(rng)
    trainer.save_checkpoint()


def resume_command(run_dir: Path, argv: Sequence[str] | None = None) -> str:
    """The command line that resumes ``run_dir``: this process's, with ``--resume``.

    ``--overwrite``, ``--resume`` and any ``run_dir`` override are dropped; the exact
    ``--run_dir=...`` and ``--resume`` are added. ``python -m agentrl.cli`` stays a module run;
    a recipe (``python recipes/x.py``) is run by this interpreter.
    """
    args = list(sys.argv if argv is None else argv)
    prog, rest = (args[0] if args else "agentrl"), args[1:]
    head = [prog]
    if Path(prog).name == "cli.py" and Path(prog).parent.name == "agentrl":
        head = [sys.executable, "-m", "agentrl.cli"]
    elif prog.endswith(".py"):
        head = [sys.executable, prog]
    keep = [
        a
        for a in rest
        if a not in ("--resume", "--overwrite") and not a.lstrip("-").startswith("run_dir=")
    ]
    return shlex.join([*head, *keep, f"--run_dir={run_dir}", "--resume"])
