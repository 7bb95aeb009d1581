r"""Math answer verifier: extract the final answer, then decide equivalence with math-verify.

Design:

- **Extraction** runs in the caller (pure Python, linear in the text): the last ``\boxed{...}``
  with nested braces (default), the last ``Answer: ...`` line, the last number, or the whole text.
- **Equivalence** is math-verify's (LaTeX and plain expressions, fractions, intervals, sets,
  units, symbolic equality), run in a small pool of worker *processes*. Threads are not enough:
  math-verify's own timeout uses ``SIGALRM`` (main thread only), a thread cannot be killed, and
  a check such as ``9^{9^{9}}`` against ``1`` ran in sympy for over 40 s here (then we stopped
  it). In a worker the check runs in the main thread under a ``SIGALRM`` soft limit; a worker
  that ignores it (stuck in C code that never checks for signals) is killed past a hard limit,
  and a kernel CPU limit ends it even if the parent is gone.
- Each worker is a plain ``python -c`` subprocess on a socket pair (not multiprocessing's spawn or
  forkserver, which re-import the caller's ``__main__``: a recipe script without a main guard would
  re-run in every worker). A check that outlives its limit gets its worker killed and replaced,
  and scores 0 with reason ``"timeout"``; ``concurrent.futures.ProcessPoolExecutor`` is not used
  because it cannot kill one worker: a kill breaks the pool and fails every check in flight.
- Integers on both sides are compared exactly in the caller, with no process hop (the CPU demo).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Literal, get_args

from agentrl.errors import VerifierError

if TYPE_CHECKING:
    from agentrl.types import Task

logger = logging.getLogger(__name__)

Extract = Literal["boxed", "answer_line", "last_number", "none"]
"""How the final answer is found in a response (``none``: the whole response is the answer)."""

MAX_ANSWER_CHARS = 1000
"""Longer extracted answers score 0 without a check (no math answer is that long)."""

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_LINE = re.compile(
    r"^[\s*#>]*(?:final\s+)?answer\s*(?:is)?\s*\**\s*[:：]\s*(.+?)\s*$", re.I | re.M
)
# A "-" counts as a sign only where it cannot be a binary minus ("12-34" -> 34, "=-22" -> -22).
_NUMBER = re.compile(r"(?<![\w.)])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_INTEGER = re.compile(r"[-+]?\d{1,4000}")
_DELIMS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


@dataclass(frozen=True, slots=True)
class MathResult:
    """The verdict on one response."""

    score: float
    """1.0 when the extracted answer equals the reference, else 0.0."""
    extracted: str | None
    """The answer found in the response, or ``None`` when there was none."""
    reason: str
    """Why: ``correct``, ``wrong answer``, ``timeout``, ``no \\boxed{} answer``, ..."""


@dataclass(frozen=True, slots=True)
class GoldReport:
    """Result of :func:`validate_gold`: how many references verify against themselves."""

    total: int
    valid: int
    invalid: dict[str, str] = field(default_factory=dict)
    """Task id -> reason, for every task whose reference did not verify."""


# ----------------------------------------------------------------------------- extraction


def _boxed(text: str) -> tuple[str | None, str]:
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None, "no \\boxed{} answer"
    i = starts[-1]
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == "\\":  # an escaped brace (\{ \}) does not open or close a group
                j += 2
                continue
            depth += (c == "{") - (c == "}")
            if depth == 0:
                return text[i + 1 : j], ""
            j += 1
        return None, "unterminated \\boxed{"
    bare = re.match(r"[^\s$]+", text[i:])  # "\boxed 5"
    return (bare.group(0), "") if bare else (None, "empty \\boxed")


def _strip_delimiters(answer: str) -> str:
    answer = answer.strip()
    for left, right in _DELIMS:
        if len(answer) > len(left) + len(right) and answer.startswith(left):
            if answer.endswith(right):
                return answer[len(left) : -len(right)].strip()
    return answer


def extract_answer(response: str, extract: Extract = "boxed") -> tuple[str | None, str]:
    r"""Find the final answer in ``response``.

    Args:
        response: the model's text.
        extract: ``boxed`` (last ``\boxed{...}``), ``answer_line`` (last ``Answer: ...`` line),
            ``last_number`` (last number, thousands separators removed) or ``none`` (all of it).

    Returns:
        ``(answer, "")``, or ``(None, reason)`` when no answer was found.
    """
    if extract == "boxed":
        found, why = _boxed(response)
    elif extract == "answer_line":
        lines = _ANSWER_LINE.findall(response)
        found, why = (lines[-1].strip("*").rstrip("."), "") if lines else (None, "no answer line")
        if found is not None and _BOXED.search(found):
            found, why = _boxed(found)
    elif extract == "last_number":
        numbers = _NUMBER.findall(response)
        found, why = (numbers[-1].replace(",", ""), "") if numbers else (None, "no number")
    elif extract == "none":
        found, why = response, ""
    else:
        raise ValueError(f"extract: expected one of {get_args(Extract)}, got {extract!r}")
    if found is None:
        return None, why
    found = _strip_delimiters(found)
    if not found:
        return None, "empty answer"
    return found, ""


# ----------------------------------------------------------------------------- parent side

_START_TIMEOUT_S = 120.0
_GRACE_S = 0.5  # past the soft limit, the parent waits this long before killing the worker


class _Worker:
    """One checking subprocess and its end of a socket pair."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        code = f"from agentrl.verifiers._math_worker import serve; serve({theirs.fileno()})"
        # -P and the parent's own sys.path: the worker imports the same agentrl as the parent,
        # never a same-named folder in the current directory.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-c", code],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(_START_TIMEOUT_S):
            raise VerifierError(f"math verifier worker not ready after {_START_TIMEOUT_S:.0f} s")
        try:
            self.conn.recv()
        except (EOFError, OSError):
            code = self.process.wait()
            raise VerifierError(f"math verifier worker exited at start (code {code})") from None
        self.ready = True

    def call(self, job: tuple[str, str, float], limit_s: float) -> tuple[bool, str, bool]:
        """Run one job: ``(equal, reason, worker still healthy)``."""
        self.wait_ready()
        try:
            self.conn.send(job)
        except OSError:
            raise VerifierError(f"math verifier worker died (code {self.process.poll()})") from None
        if not self.conn.poll(limit_s):
            return False, "timeout", False
        try:
            ok, reason = self.conn.recv()
        except (EOFError, OSError):
            return False, f"verifier worker died (code {self.process.wait()})", False
        return ok, reason, True

    def kill(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.wait()

    def reap(self) -> None:
        try:
            self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _Pool:
    """Worker processes handed out one check at a time; thread-safe."""

    lock = threading.Lock()  # guards the module-level pool

    def __init__(self, size: int) -> None:
        self.size, self.pid = size, os.getpid()
        self._cond = threading.Condition()
        self._idle = [_Worker() for _ in range(size)]
        self._closed = False
        self.threads = ThreadPoolExecutor(size, thread_name_prefix="agentrl-math-verify")
        """Threads that wait on checks for :func:`verify_async` (one per worker)."""

    def usable(self) -> bool:
        return not self._closed and self.pid == os.getpid()

    def _acquire(self) -> _Worker:
        with self._cond:
            while not self._idle and not self._closed:
                self._cond.wait()
            if self._closed:
                raise VerifierError("the math verifier pool was shut down")
            worker = self._idle.pop()
            if worker.process.poll() is not None:  # died while idle (OOM killer, a signal)
                logger.warning(
                    "math verifier worker %d had exited (code %s); replaced",
                    worker.process.pid,
                    worker.process.returncode,
                )
                worker.conn.close()
                worker = _Worker()
            return worker

    def _release(self, worker: _Worker, healthy: bool) -> None:
        with self._cond:
            if self._closed or not healthy:
                worker.kill()
            if not self._closed:
                self._idle.append(worker if healthy else _Worker())
                self._cond.notify()

    def wait_ready(self) -> None:
        workers = [self._acquire() for _ in range(self.size)]
        try:
            for w in workers:
                w.wait_ready()
        finally:
            for w in workers:
                self._release(w, w.ready)

    def check(self, answer: str, reference: str, timeout_s: float) -> tuple[bool, str]:
        worker, healthy = self._acquire(), False
        try:
            ok, reason, healthy = worker.call((answer, reference, timeout_s), timeout_s + _GRACE_S)
        finally:
            self._release(worker, healthy)
        if not healthy:
            logger.info(
                "math check %s (%s); worker %d replaced", reason, answer[:80], worker.process.pid
            )
        return ok, reason

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        if self.pid != os.getpid():
            return  # a forked child must not touch its parent's workers
        for w in idle:
            w.conn.close()  # EOF: an idle worker exits by itself
        for w in idle:
            w.reap()
        self.threads.shutdown(wait=False)


_pool: _Pool | None = None


def _default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _get_pool() -> _Pool:
    global _pool
    with _Pool.lock:
        if _pool is None or not _pool.usable():
            _pool = _Pool(_default_workers())
        return _pool


def start_pool(workers: int | None = None, *, wait: bool = True) -> None:
    """Start the checking processes now (or resize them) rather than at the first check.

    Args:
        workers: number of worker processes; by default half the CPU cores, 1 to 8.
        wait: block until every worker has loaded math-verify (about a second).
    """
    global _pool
    n = workers if workers is not None else _default_workers()
    if n < 1:
        raise ValueError(f"workers: expected >= 1, got {n}")
    with _Pool.lock:
        old = _pool
        if old is None or not old.usable() or old.size != n:
            pool = _pool = _Pool(n)
        else:
            pool = old
    if old is not None and old is not pool:
        old.close()
    if wait:
        pool.wait_ready()


def shutdown_pool() -> None:
    """Stop the checking processes (idempotent; also runs at interpreter exit).

    Checks waiting for a worker fail with :class:`VerifierError`; the next check starts a new pool.
    """
    global _pool
    with _Pool.lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()


atexit.register(shutdown_pool)


def _fast(answer: str, reference: str) -> MathResult | None:
    """Exact integer comparison, or ``None`` when math-verify must decide."""
    if len(answer) > MAX_ANSWER_CHARS:
        return MathResult(0.0, answer, "answer too long")
    ref = reference.strip()
    if _INTEGER.fullmatch(answer) and _INTEGER.fullmatch(ref):
        same = int(answer) == int(ref)
        return MathResult(float(same), answer, "correct" if same else "wrong answer")
    return None


def _prepare(
    response: str, reference: str, extract: Extract, timeout_s: float
) -> tuple[str | None, MathResult | None]:
    if not isinstance(response, str) or not isinstance(reference, str):
        raise TypeError(
            f"expected str response and reference, got {type(response).__name__} and "
            f"{type(reference).__name__}"
        )
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
    answer, why = extract_answer(response, extract)
    if answer is None:
        return None, MathResult(0.0, None, why)
    return answer, _fast(answer, reference)


def verify(
    response: str, reference: str, *, timeout_s: float = 5.0, extract: Extract = "boxed"
) -> MathResult:
    """Score ``response`` against ``reference``: 1.0 when its final answer is equal, else 0.0.

    Thread-safe; blocks the calling thread for the check (use :func:`verify_async` in a loop).

    Args:
        response: the model's text.
        reference: the gold answer (LaTeX or a plain expression).
        timeout_s: limit of the equivalence check; past it the worker is killed (within about
            half a second more) and the result is score 0 with reason ``"timeout"``.
        extract: how to find the answer in ``response`` (see :func:`extract_answer`).

    Returns:
        A :class:`MathResult`, for every input; malformed answers score 0 with a reason.

    Raises:
        VerifierError: the checking processes could not start or were shut down mid-check.
    """
    answer, done = _prepare(response, reference, extract, timeout_s)
    if done is not None:
        return done
    assert answer is not None
    ok, reason = _get_pool().check(answer, reference, timeout_s)
    return MathResult(float(ok), answer, reason)


async def verify_async(
    response: str, reference: str, *, timeout_s: float = 5.0, extract: Extract = "boxed"
) -> MathResult:
    """:func:`verify` without blocking the event loop (the check waits in a pool thread)."""
    answer, done = _prepare(response, reference, extract, timeout_s)
    if done is not None:
        return done
    assert answer is not None
    pool = _get_pool()
    loop = asyncio.get_running_loop()
    try:
        ok, reason = await loop.run_in_executor(
            pool.threads, pool.check, answer, reference, timeout_s
        )
    except RuntimeError as e:  # the executor was shut down between _get_pool and here
        raise VerifierError(f"math verifier pool unavailable: {e}") from None
    return MathResult(float(ok), answer, reason)


def validate_gold(tasks: Iterable[Task], *, timeout_s: float = 10.0) -> GoldReport:
    """Check that every task's reference verifies against itself, and log the outcome.

    A reference that does not (unparseable, or slower than ``timeout_s``) can never be rewarded.

    Args:
        tasks: tasks with ``answer`` set.
        timeout_s: limit per check.

    Returns:
        Counts, and the id and reason of every failing task.
    """
    items = list(tasks)
    reasons: dict[str, str | None] = {}
    pending = []
    for task in items:
        if task.answer is None:
            reasons[task.id] = "no reference answer"
        elif (fast := _fast(task.answer.strip(), task.answer)) is not None:
            reasons[task.id] = None if fast.score == 1.0 else fast.reason
        else:
            pending.append(task)
    if pending:  # integers alone never start the worker processes
        pool = _get_pool()

        def check(task: Task) -> str | None:
            assert task.answer is not None
            ok, reason = pool.check(_strip_delimiters(task.answer), task.answer, timeout_s)
            return None if ok else reason

        reasons.update(zip([t.id for t in pending], pool.threads.map(check, pending), strict=True))
    invalid = {t.id: why for t in items if (why := reasons[t.id]) is not None}
    report = GoldReport(total=len(items), valid=len(items) - len(invalid), invalid=invalid)
    if invalid:
        shown = ", ".join(f"{k} ({v})" for k, v in list(invalid.items())[:10])
        logger.warning(
            "gold answers: %d of %d do not verify: %s%s",
            len(invalid),
            len(items),
            shown,
            " ..." if len(invalid) > 10 else "",
        )
    else:
        logger.info("gold answers: all %d verify against themselves", len(items))
    return report
