"""Watchdogs for what asyncio cannot time out.

- :class:`LoopWatchdog`: an async env that blocks (``time.sleep``, a blocking socket) stalls the
  whole event loop, so no timeout can fire. A heartbeat on the loop and a thread that watches it
  notice a loop that has not ticked for ``limit_s`` + :data:`STALL_MARGIN_S` while it runs env
  code (the loop thread's stack, from ``sys._current_frames``, passes through
  :func:`~agentrl.rollout.episode.env_call`): the env call and its stack are reported, and by
  default the process stops (:func:`stop_process`). A blocked loop cannot be preempted; failing
  loudly within the deadline is all that can be done. A loop busy with anything else (a
  learner step, a long tokenisation) is left alone.
- :func:`guard_exit`: once a run has failed, the process must end even if stuck threads (an
  env's own ``asyncio.to_thread`` call) keep ``asyncio.run`` waiting for them: after
  :data:`EXIT_GRACE_S` in that teardown, the error is printed and the process exits with status
  1. Only inside :func:`exit_guard` (the command-line jobs wrap their ``asyncio.run`` in it),
  and disarmed on leaving it: a library caller's process (a notebook, a test session) is never
  ended by a run that failed in it earlier.
- :func:`end_process`: a script's ``sys.exit``; a failed one ends even if threads that are not
  daemons (an env's own) keep the interpreter waiting at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import NoReturn

log = logging.getLogger(__name__)

STALL_MARGIN_S = 0.5
"""How much longer than the env timeout the loop may stall in env code before it is reported
(a stall is seen within this plus one poll interval, at most 0.25 s)."""
EXIT_GRACE_S = 15.0
"""How long a failed run's teardown may wait for stuck threads before the process exits."""

OnStall = Callable[[str, str], None]
"""``on_stall(message, stack)``: what to do about an env call that blocks the loop."""

_STDLIB = sysconfig.get_paths()["stdlib"]


def where(summary: traceback.StackSummary) -> str:
    """The innermost frame outside the standard library, as ``file:line in name: code``."""
    own = [f for f in summary if not f.filename.startswith(_STDLIB)] or list(summary)
    return f"{own[-1].filename}:{own[-1].lineno} in {own[-1].name}: {own[-1].line}"


def stop_process(message: str, stack: str) -> None:
    """Log the blocking call's stack, print ``message`` as one error line, exit with status 1."""
    log.error("the env call that blocks the event loop:\n%s", stack)
    for handler in logging.getLogger().handlers:
        handler.flush()
    _exit_now(message)


def _exit_now(message: str) -> None:
    sys.stdout.flush()
    tqdm = sys.modules.get("tqdm")
    drawing = tqdm is not None and bool(getattr(tqdm.tqdm, "_instances", None))
    # a progress bar's line has no newline yet: the error starts a line of its own
    print(f"{chr(10) if drawing else ''}agentrl: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def blocking_env_call(frame: FrameType | None, marker: CodeType) -> tuple[str, str, str] | None:
    """``(call, where, stack)`` if ``frame``'s stack runs env code below ``marker``, else None.

    ``call`` is the env function's qualified name, ``where`` its innermost line (see
    :func:`where`), ``stack`` the frames from the env function inwards.
    """
    inner: list[FrameType] = []
    while frame is not None and frame.f_code is not marker:
        inner.append(frame)
        frame = frame.f_back
    if frame is None or not inner:
        return None
    call = inner[-1].f_code.co_qualname
    summary = traceback.StackSummary.extract((f, f.f_lineno) for f in reversed(inner))
    return call, where(summary), "".join(summary.format())


class LoopWatchdog:
    """Reports an env call that blocks the event loop (module docstring).

    Args:
        limit_s: the env timeout; a stall in env code longer than this (plus the margin) is
            reported.
        marker: the code object of the function that calls env code
            (:func:`~agentrl.rollout.episode.env_call`).
        on_stall: called once per stall, from the watchdog thread (default: stop the process).
        limit_name: the setting ``limit_s`` comes from, for the message.
    """

    def __init__(
        self,
        limit_s: float,
        marker: CodeType,
        on_stall: OnStall | None = None,
        *,
        limit_name: str = "rollout.env_timeout_s",
    ) -> None:
        self.limit_s = limit_s
        self.marker = marker
        self.on_stall = on_stall or stop_process
        self.limit_name = limit_name
        self.interval = min(0.25, limit_s / 4)
        self._users = 0
        self._tick = time.monotonic()
        self._stop: threading.Event | None = None
        self._beat_handle: asyncio.TimerHandle | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Watch the running loop while the block runs (concurrent uses share one thread)."""
        if self._users == 0:
            self._tick = time.monotonic()
            self._stop = threading.Event()
            self._beat(asyncio.get_running_loop())
            args = (threading.get_ident(), self._stop)
            name = "agentrl-loop-watchdog"
            threading.Thread(target=self._watch, args=args, name=name, daemon=True).start()
        self._users += 1
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0 and self._stop is not None and self._beat_handle is not None:
                self._stop.set()
                self._beat_handle.cancel()

    def _beat(self, loop: asyncio.AbstractEventLoop) -> None:
        self._tick = time.monotonic()
        self._beat_handle = loop.call_later(self.interval, self._beat, loop)

    def _watch(self, loop_thread: int, stop: threading.Event) -> None:
        reported = None
        while not stop.wait(self.interval):
            tick = self._tick
            stalled = time.monotonic() - tick
            if stalled <= self.limit_s + STALL_MARGIN_S or tick == reported:
                continue
            found = blocking_env_call(sys._current_frames().get(loop_thread), self.marker)
            if found is None or stop.is_set():
                continue
            reported = tick  # once per stall
            call, where, stack = found
            message = (
                f"env call {call}() has blocked the event loop for {stalled:.1f} s, past "
                f"{self.limit_name}={self.limit_s:g}, at {where}: an async env must await, "
                "never block (run blocking code in a SyncEnv or a thread)"
            )
            self.on_stall(message, stack)


_TEARDOWN = (
    (os.path.join(_STDLIB, "threading.py"), "_shutdown"),  # the interpreter joins threads
    (os.path.join(_STDLIB, "asyncio", "runners.py"), "close"),  # asyncio.run joins its executor
)
_guard_lock = threading.Lock()
_guarded = False
_enabled = False
_disarm: threading.Event | None = None


def _in_teardown(frame: FrameType | None) -> bool:
    while frame is not None:
        if (frame.f_code.co_filename, frame.f_code.co_name) in _TEARDOWN:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def exit_guard() -> Iterator[None]:
    """A command-line job's run: :func:`guard_exit` arms within, and is disarmed on leaving.

    Leaving means the run's teardown is over, so nothing is left to guard.
    """
    global _enabled, _guarded, _disarm
    _enabled = True
    try:
        yield
    finally:
        with _guard_lock:
            _enabled, _guarded = False, False
            if _disarm is not None:
                _disarm.set()
                _disarm = None


def _holding(main: int | None) -> str:
    """The threads that keep the process alive (not daemons), beside the main one."""
    me = threading.get_ident()
    stuck = [t.name for t in threading.enumerate() if t.ident not in (main, me) and not t.daemon]
    return ", ".join(stuck[:5]) + (" ..." if len(stuck) > 5 else "")


def guard_exit(message: str, grace_s: float = EXIT_GRACE_S) -> None:
    """Make sure a failed run's process ends (module docstring); inside :func:`exit_guard` only.

    Args:
        message: the run's error, printed if the process has to be ended.
        grace_s: how long the main thread may sit in teardown before that.
    """
    global _guarded, _disarm
    with _guard_lock:
        if _guarded or not _enabled:
            return
        _guarded = True
        disarmed = _disarm = threading.Event()
    main = threading.main_thread().ident
    interval = min(0.5, grace_s / 4)

    def watch() -> None:
        since: float | None = None
        while not disarmed.wait(interval):
            frame = sys._current_frames().get(main) if main is not None else None
            if not _in_teardown(frame):
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since >= grace_s and not disarmed.is_set():
                shown = _holding(main)
                _exit_now(f"{message.splitlines()[0]} (exiting: threads stuck: {shown})")

    threading.Thread(target=watch, name="agentrl-exit-guard", daemon=True).start()


def end_process(code: int, grace_s: float = EXIT_GRACE_S) -> NoReturn:
    """``sys.exit(code)`` for a script, which stuck threads cannot hold up.

    If ``code`` is non-zero and threads that are not daemons still hold the process ``grace_s``
    later (an env's own, stuck), it is ended with ``code``.
    """
    if code:
        main = threading.main_thread().ident

        def watch() -> None:
            time.sleep(grace_s)
            print(f"agentrl: exiting: threads stuck: {_holding(main)}", file=sys.stderr, flush=True)
            os._exit(code)

        threading.Thread(target=watch, name="agentrl-end-process", daemon=True).start()
    sys.exit(code)
