"""Threads for synchronous env code: a call that never returns cannot starve or hang a run.

``asyncio.to_thread`` shares the loop's default executor (``min(32, cores + 4)`` threads) with
the embedded engine's own work; a few env calls that block forever used to fill it, and its
non-daemon threads then kept the process from exiting after the run had failed. Here:

- every call gets a thread of :class:`EnvThreads` (daemon threads, started on demand, at most
  ``max_threads`` working at once; an idle one exits after :data:`IDLE_S`);
- a call whose awaiting task is cancelled (``env_timeout_s``, the episode timeout) while it runs
  is *abandoned*: its thread is counted as stuck and no longer counts as working, so a fresh
  thread takes its place; if the call returns later, its thread simply ends;
- once ``max_threads`` threads are stuck, every new call raises :class:`EnvThreadsStuck` (a
  :class:`~agentrl.errors.TrainingError`: the run stops), naming the calls and where they hang.

:func:`run_sync` runs a call on the pool of the current context: the rollout engine's (sized by
``rollout.env_threads``) during its episodes, else a process-wide one.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from agentrl.errors import TrainingError
from agentrl.rollout.watchdog import guard_exit, where

T = TypeVar("T")

IDLE_S = 30.0
"""Seconds an idle thread waits for work before it ends."""
SHOWN_STUCK = 3
"""Stuck calls described in :class:`EnvThreadsStuck`'s message."""


class EnvThreadsStuck(TrainingError):
    """Too many synchronous env calls ran past their timeout and never returned."""


@dataclass(eq=False, slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    state: Literal["queued", "running", "done", "cancelled"] = "queued"
    thread: int | None = None
    started: float = 0.0
    where: str = field(default="")
    """Where the call was when it was abandoned (its innermost frame), for messages."""
    stack: str = field(default="")
    """Its stack then, from the env's function inwards."""

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", None) or repr(self.fn)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile: nobody waits for it
        return
    if isinstance(exc, StopIteration):  # a future cannot hold one (as asyncio.to_thread's)
        exc = RuntimeError(f"StopIteration raised in a synchronous env call: {exc!r}")
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _stack_of(thread_id: int) -> tuple[str, str]:
    """``(innermost frame, stack below the pool's own frames)`` of a worker thread, as text."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "", ""
    summary = traceback.extract_stack(frame)
    ours = [i for i, f in enumerate(summary) if f.filename == __file__ and f.name == "_work"]
    shown = traceback.StackSummary.from_list(summary[ours[-1] + 1 :] if ours else summary)
    return (where(shown) if shown else ""), "".join(shown.format())


class EnvThreads:
    """A pool of daemon threads for synchronous env calls (module docstring).

    Args:
        max_threads: threads working at once, and stuck threads that stop new calls.
    """

    def __init__(self, max_threads: int = 64) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads: expected >= 1, got {max_threads}")
        self.max_threads = max_threads
        self._cv = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._working = 0  # threads alive and not stuck
        self._idle = 0  # of which waiting for a job
        self._stuck: dict[int, _Job] = {}  # thread id -> the call it is stuck in
        self.abandoned = 0
        """Calls abandoned so far (each left a thread stuck until it returned)."""

    @property
    def stuck(self) -> int:
        """Threads stuck in an abandoned call right now."""
        return len(self._stuck)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in a pool thread; cancelling the caller abandons the call.

        Raises:
            EnvThreadsStuck: ``max_threads`` threads are stuck already.
        """
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, kwargs, loop.create_future(), loop)
        self._submit(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            self._abandon(job)
            raise

    def _submit(self, job: _Job) -> None:
        with self._cv:
            if len(self._stuck) >= self.max_threads:
                message = self._describe_stuck()
                guard_exit(message)  # the stuck threads must not keep the failed run alive
                raise EnvThreadsStuck(message)
            self._jobs.append(job)
            if len(self._jobs) > self._idle and self._working < self.max_threads:
                self._working += 1
                threading.Thread(target=self._work, name="agentrl-env", daemon=True).start()
            else:
                self._cv.notify()

    def _abandon(self, job: _Job) -> None:
        with self._cv:
            if job.state == "queued":
                job.state = "cancelled"
                self._jobs.remove(job)
                return
            if job.state != "running" or job.thread is None:
                return
            job.where, job.stack = _stack_of(job.thread)
            self._stuck[job.thread] = job
            self._working -= 1  # its place goes to a fresh thread
            self.abandoned += 1
        _ABANDONED.set(job)

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            with self._cv:
                self._idle += 1
                while not self._jobs:
                    if not self._cv.wait(IDLE_S) and not self._jobs:
                        self._idle -= 1
                        self._working -= 1
                        return
                self._idle -= 1
                job = self._jobs.popleft()
                job.state, job.thread, job.started = "running", me, time.monotonic()
            result: Any = None
            exc: BaseException | None = None
            try:
                result = job.fn(*job.args, **job.kwargs)
            except BaseException as e:  # handed to the caller, like asyncio.to_thread does
                exc = e
            try:
                job.loop.call_soon_threadsafe(_settle, job.future, result, exc)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass
            del result, exc  # (no reference cycle through a traceback while idle)
            with self._cv:
                job.state = "done"
                if self._stuck.pop(me, None) is not None:
                    return  # abandoned: a fresh thread has taken this one's place

    def _describe_stuck(self) -> str:
        now = time.monotonic()
        jobs = sorted(self._stuck.values(), key=lambda j: j.started)[:SHOWN_STUCK]
        shown = "; ".join(f"{j.name} for {now - j.started:.0f} s at {j.where}" for j in jobs)
        return (
            f"{len(self._stuck)} synchronous env calls ran past rollout.env_timeout_s and never "
            f"returned, so every rollout.env_threads={self.max_threads} thread is stuck; the env "
            f"hangs (give its blocking calls a timeout of their own). Stuck: {shown}"
        )


_DEFAULT = EnvThreads()
_POOL: contextvars.ContextVar[EnvThreads] = contextvars.ContextVar("agentrl_env_threads")
_ABANDONED: contextvars.ContextVar[_Job | None] = contextvars.ContextVar(
    "agentrl_env_abandoned", default=None
)


def current_pool() -> EnvThreads:
    """The pool :func:`run_sync` uses here (the rollout engine's during its episodes)."""
    return _POOL.get(_DEFAULT)


def use_pool(pool: EnvThreads) -> contextvars.Token[EnvThreads]:
    """Make ``pool`` the current context's (undo with ``_POOL.reset(token)``)."""
    return _POOL.set(pool)


def reset_pool(token: contextvars.Token[EnvThreads]) -> None:
    """Undo :func:`use_pool`."""
    _POOL.reset(token)


async def run_sync(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run synchronous env code in a thread of the current pool (see :class:`EnvThreads`)."""
    return await current_pool().run(fn, *args, **kwargs)


def take_abandoned() -> tuple[str, str, str] | None:
    """The call this task abandoned last as ``(call, where, stack)``, once; else ``None``."""
    job = _ABANDONED.get()
    if job is None:
        return None
    _ABANDONED.set(None)
    return job.name, job.where, job.stack
