"""The math verifier's worker process: math-verify equivalence checks under time and memory limits.

Runs in a plain ``python -c`` subprocess started by :mod:`agentrl.verifiers.math`'s pool (see
its docstring for why processes, and why not multiprocessing); answers ``(answer, reference,
timeout_s)`` jobs on a socket with ``(equivalent, reason)``.
"""

from __future__ import annotations

import logging
import os
import re
from multiprocessing.connection import Connection

from agentrl.verifiers.math import _strip_delimiters

_SCI = re.compile(r"(?<![\w\\.])(\d+(?:\.\d+)?)[eE]([-+]?\d+)(?![\w.])")
_MEMORY_LIMIT = 4 << 30  # a 10^{10^{10}} bigint fails fast with MemoryError instead of swapping


class _CheckTimeout(BaseException):  # BaseException: sympy's `except Exception` must not eat it
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise _CheckTimeout


def _parse(text: str) -> list[object]:
    from math_verify import parse

    # "1.5e-3" in LaTeX reads as 1.5*e - 3 (Euler's e): rewrite plain scientific notation first.
    text = _SCI.sub(r"\1\\times 10^{\2}", _strip_delimiters(text))
    return parse(f"${text}$", parsing_timeout=None) or parse(text, parsing_timeout=None)


def _equivalent(answer: str, reference: str) -> tuple[bool, str]:
    from math_verify import verify as mv_verify

    # math-verify falls back to the raw string when it cannot parse; that is no math answer.
    gold = _parse(reference)
    if all(isinstance(x, str) for x in gold):
        return False, "unparseable reference"
    pred = _parse(answer)
    if all(isinstance(x, str) for x in pred):
        return False, "unparseable answer"
    ok = bool(mv_verify(gold, pred, timeout_seconds=None))
    return ok, "correct" if ok else "wrong answer"


def _set_soft_limit(which: int, soft: int) -> None:
    import resource

    hard = resource.getrlimit(which)[1]
    resource.setrlimit(which, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _run_job(answer: str, reference: str, timeout_s: float) -> tuple[bool, str]:
    import resource
    import signal

    # Kernel-enforced CPU cap: ends this process even inside a C call, should the parent be gone.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + timeout_s) + 2
    _set_soft_limit(resource.RLIMIT_CPU, soft)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)  # soft limit: works between bytecodes
    try:
        return _equivalent(answer, reference)
    except MemoryError:
        return False, "out of memory"
    except Exception as e:  # math-verify/sympy failing on odd input is a verdict, not a crash
        return False, f"error: {type(e).__name__}: {e}"[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def serve(fd: int) -> None:
    """Entry point of a worker process: answer ``(answer, reference, timeout_s)`` jobs on ``fd``."""
    import resource
    import signal

    conn = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGALRM, _on_alarm)
    _set_soft_limit(resource.RLIMIT_AS, _MEMORY_LIMIT)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout disabled" noise
    _equivalent("1/2", "0.5")  # load the LaTeX parser and warm sympy's caches
    conn.send(("ready", os.getpid()))
    while True:
        try:
            answer, reference, timeout_s = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent closed the pool or died; skip a slow interpreter teardown
        try:
            result = _run_job(answer, reference, timeout_s)
        except _CheckTimeout:  # the alarm fired between the check's end and its cancellation
            result = (False, "timeout")
        try:
            conn.send(result)
        except OSError:
            os._exit(0)
