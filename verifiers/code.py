"""Score Python programs against tests, run in the sandbox; load code task sets.

Two test formats:

- :class:`IOTest` (competitive programming): the program runs once per case with ``stdin``; its
  stdout must equal ``stdout`` after whitespace normalisation (trailing spaces, runs of blanks,
  surrounding blank lines).
- :class:`AssertTest` (HumanEval/MBPP): statements run after the program, in its namespace
  (``assert f(2) == 4``, or HumanEval's ``check(entry_point)``); a test passes if it raises nothing.
  All assert tests of a program share one execution: a harness loads the program as module
  ``solution`` (so its ``__main__`` block does not run), then runs each test under its own
  ``SIGALRM`` time limit and reports one line per test behind a random nonce. A program that exits
  early (``sys.exit``, ``os._exit``) reports nothing and fails. Tests share the program's process,
  so a program that deliberately inspects the harness could forge its lines; the sandbox still
  contains it.

The score is the fraction of tests passed (``mode="fraction"``) or 1/0 (``mode="all"``). Bad
programs get a :class:`CodeResult` with per-test outcomes, never an exception; a sandbox that
cannot run at all raises :class:`~agentrl.errors.VerifierError`.

Code task sets load in :mod:`agentrl.verifiers.code_tasks`.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from agentrl.errors import VerifierError
from agentrl.verifiers.sandbox import ExecResult, Isolation, Sandbox, default_sandbox

logger = logging.getLogger(__name__)

CaseStatus = Literal["passed", "failed", "runtime_error", "timeout", "memory", "output_limit"]
ScoreMode = Literal["fraction", "all"]
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_CLIP = 300
_HARNESS = r"""
import os as _os, signal as _signal, time as _time


class _HarnessTimeout(BaseException):
    pass


def _harness_alarm(signum, frame):
    raise _HarnessTimeout()


def _harness_where(tb, name, src):
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == name:
            line = tb.tb_lineno
        tb = tb.tb_next
    lines = src.splitlines()
    return f" (line {line}: {lines[line - 1].strip()})" if line and line <= len(lines) else ""


def _harness_run(src, name, env, limit):
    start = _time.perf_counter()
    _signal.setitimer(_signal.ITIMER_REAL, limit)
    try:
        exec(compile(src, name, "exec"), env)
        status, detail = "passed", ""
    except _HarnessTimeout:
        status, detail = "timeout", f"took longer than {limit:g}s"
    except MemoryError:
        status, detail = "memory", "MemoryError"
    except BaseException as e:
        status = "failed" if isinstance(e, AssertionError) else "runtime_error"
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        detail = detail[:300] + _harness_where(e.__traceback__, name, src)
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
    return status, detail, _time.perf_counter() - start


def _harness(program, tests, nonce, limit):
    _signal.signal(_signal.SIGALRM, _harness_alarm)
    env = {"__name__": "solution", "__builtins__": __builtins__}
    status, detail, took = _harness_run(program, "solution.py", env, limit)
    if status != "passed":  # every test fails the way the program did
        status = "runtime_error" if status == "failed" else status
        result = [status, "the program failed: " + detail, took]
    for i, src in enumerate(tests):
        if status == "passed":
            result = list(_harness_run(src, f"<test {i}>", env, limit))
        _os.write(1, ("\n" + nonce + repr([i, *result]) + "\n").encode())
"""


@dataclass(frozen=True, slots=True)
class IOTest:
    """Run the program with ``stdin``; pass if it prints ``stdout`` (whitespace-normalised)."""

    stdin: str
    stdout: str


@dataclass(frozen=True, slots=True)
class AssertTest:
    """Run ``code`` after the program, in its namespace; pass if it raises nothing."""

    code: str


CodeTest = IOTest | AssertTest


@dataclass(frozen=True, slots=True)
class CaseResult:
    """What happened to one test."""

    status: CaseStatus
    detail: str = ""
    """Why it did not pass: expected vs got, the exception and its line."""
    time_s: float = 0.0

    @property
    def passed(self) -> bool:
        """Whether the test passed."""
        return self.status == "passed"


@dataclass(frozen=True, slots=True)
class CodeResult:
    """Outcome of scoring one program against a list of tests."""

    score: float
    status: CaseStatus
    """``passed`` if every test passed, else the status of the first test that did not."""
    tests: tuple[CaseResult, ...]
    stdout: str
    """stdout of the first run that did not pass (else of the first run), clipped to 4 KB."""
    stderr: str
    time_s: float
    """Wall time of all runs together."""
    isolation: Isolation

    @property
    def num_passed(self) -> int:
        """How many tests passed."""
        return sum(t.passed for t in self.tests)

    def report(self, *, what: str = "tests", max_tests: int = 3, max_chars: int = 1500) -> str:
        """A compact failure report for the agent: the count, then the first failing tests."""
        lines = [f"Passed {self.num_passed}/{len(self.tests)} {what}."]
        failing = [(i, t) for i, t in enumerate(self.tests) if not t.passed]
        for i, t in failing[:max_tests]:
            lines.append(f"Test {i + 1}: {t.status.replace('_', ' ')}. {t.detail}".rstrip())
        if len(failing) > max_tests:
            lines.append(f"... and {len(failing) - max_tests} more failing tests.")
        text = "\n".join(lines)
        return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def extract_code(text: str) -> str | None:
    """The last fenced ```python block of ``text`` (else the last fenced block), or None."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return None
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def normalise_output(text: str) -> str:
    """Output as compared: lines with runs of whitespace collapsed, outer blank lines dropped."""
    return "\n".join(" ".join(line.split()) for line in text.strip().splitlines())


def score(
    code: str,
    tests: Sequence[CodeTest],
    *,
    mode: ScoreMode = "fraction",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    sandbox: Sandbox | None = None,
) -> CodeResult:
    """Run ``code`` against ``tests`` (one after another) and score it.

    Args:
        code: the program.
        tests: at least one test.
        mode: ``"fraction"`` (share of tests passed) or ``"all"`` (1 if all pass, else 0).
        timeout_s: time limit per test.
        memory_mb: address-space limit of each run.
        sandbox: where to run (default: the shared auto-isolation sandbox).

    Raises:
        VerifierError: the sandbox itself failed.
    """
    box = sandbox or default_sandbox()
    runs, nonce = _plan(code, tests, timeout_s, mode)
    results = [
        box.execute(prog, stdin=stdin, timeout_s=limit, memory_mb=memory_mb)
        for prog, stdin, limit in runs
    ]
    return _assemble(tests, results, mode, nonce)


async def score_async(
    code: str,
    tests: Sequence[CodeTest],
    *,
    mode: ScoreMode = "fraction",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    sandbox: Sandbox | None = None,
) -> CodeResult:
    """:func:`score` with the runs in parallel, under the sandbox's concurrency limit."""
    box = sandbox or default_sandbox()
    runs, nonce = _plan(code, tests, timeout_s, mode)
    results = await asyncio.gather(
        *(box.execute_async(p, stdin=s, timeout_s=t, memory_mb=memory_mb) for p, s, t in runs)
    )
    return _assemble(tests, list(results), mode, nonce)


def _plan(
    code: str, tests: Sequence[CodeTest], timeout_s: float, mode: str
) -> tuple[list[tuple[str, str, float]], str]:
    """The executions to make: one per IO test, one for all assert tests (last)."""
    if not tests:
        raise ValueError("tests: expected at least one test, got none")
    if mode not in ("fraction", "all"):
        raise ValueError(f"mode: expected 'fraction' or 'all', got {mode!r}")
    nonce = secrets.token_hex(8)
    runs = [(code, t.stdin, timeout_s) for t in tests if isinstance(t, IOTest)]
    asserts = [t.code for t in tests if isinstance(t, AssertTest)]
    if asserts:
        call = f"\n_harness({code!r}, {asserts!r}, {nonce!r}, {timeout_s!r})\n"
        runs.append((_HARNESS + call, "", timeout_s * (len(asserts) + 1) + 2.0))
    return runs, nonce


def _assemble(
    tests: Sequence[CodeTest], results: list[ExecResult], mode: str, nonce: str
) -> CodeResult:
    for r in results:
        if r.status == "sandbox_error":
            raise VerifierError(f"sandbox failed: {r.stderr.strip()[-500:]}")
    pairs = _merge(tests, results, nonce)
    outcomes = [o for o, _ in pairs]
    passed = sum(o.passed for o in outcomes)
    value = passed / len(outcomes) if mode == "fraction" else float(passed == len(outcomes))
    first_bad = next((o for o in outcomes if not o.passed), None)
    shown = next((r for o, r in pairs if not o.passed), results[0])  # the first failing run
    stdout = re.sub(rf"\n{nonce}[^\n]*\n", "", shown.stdout)
    return CodeResult(
        score=value,
        status=first_bad.status if first_bad else "passed",
        tests=tuple(outcomes),
        stdout=stdout[:4096],
        stderr=shown.stderr[-4096:],
        time_s=sum(r.time_s for r in results),
        isolation=results[0].isolation,
    )


def _merge(
    tests: Sequence[CodeTest], results: list[ExecResult], nonce: str
) -> list[tuple[CaseResult, ExecResult]]:
    """Per-test outcomes in the order of ``tests``, each with the run it came from."""
    n_io = sum(isinstance(t, IOTest) for t in tests)
    io = iter(zip(results[:n_io], [t for t in tests if isinstance(t, IOTest)], strict=True))
    batch = iter(_parse_harness(results[-1], nonce, len(tests) - n_io) if n_io < len(tests) else [])
    pairs = []
    for t in tests:
        if isinstance(t, IOTest):
            r, io_test = next(io)
            pairs.append((_io_outcome(r, io_test), r))
        else:
            pairs.append((next(batch), results[-1]))
    return pairs


def _io_outcome(r: ExecResult, t: IOTest) -> CaseResult:
    if r.status == "ok":
        if normalise_output(r.stdout) == normalise_output(t.stdout):
            return CaseResult("passed", "", r.time_s)
        detail = f"input: {_clip(t.stdin)} expected: {_clip(t.stdout)} got: {_clip(r.stdout)}"
        return CaseResult("failed", detail, r.time_s)
    return CaseResult(_exec_status(r), _error_line(r), r.time_s)


def _parse_harness(r: ExecResult, nonce: str, n: int) -> list[CaseResult]:
    found: dict[int, CaseResult] = {}
    for line in r.stdout.splitlines():
        if line.startswith(nonce):
            i, status, detail, took = ast.literal_eval(line[len(nonce) :])
            found[i] = CaseResult(status, detail, took)
    # Tests the harness never reported: the run ended early (a limit, os._exit, a crash).
    missing = CaseResult(
        _exec_status(r) if r.status != "ok" else "runtime_error",
        _error_line(r) if r.status != "ok" else "the program exited before the test ran",
        r.time_s,
    )
    return [found.get(i, missing) for i in range(n)]


def _exec_status(r: ExecResult) -> CaseStatus:
    if r.status in ("timeout", "memory", "output_limit"):
        return r.status
    return "runtime_error"


def _error_line(r: ExecResult) -> str:
    if r.status == "timeout":
        return f"time limit exceeded ({r.time_s:.1f}s)"
    if r.status == "output_limit":
        return "too much output"
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit code {r.exit_code}"
    at = [i for i, ln in enumerate(lines[:-1]) if ln.startswith('File "main.py", line ')]
    if at:  # the innermost frame of the program, and its source line
        where = lines[at[-1]].split(",")[1].strip()
        last += f" ({where}: {lines[at[-1] + 1]})" if at[-1] + 1 < len(lines) - 1 else f" ({where})"
    return last[:_CLIP]


def _clip(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _CLIP else text[:_CLIP] + "...")
