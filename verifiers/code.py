"""Score Python programs against tests, run in the sandbox; load code task sets.

Two test formats:

- :class:`IOTest` (competitive programming): the program runs once per case with ``stdin``; its
  stdout must equal ``stdout`` after whitespace normalisation (trailing spaces, runs of blanks,
  surrounding blank lines). The expected output never enters the sandbox.
- :class:`AssertTest` (HumanEval/MBPP): statements run after the program, with its names
  (``assert f(2) == 4``, or HumanEval's ``check(entry_point)``); a test passes if it raises nothing.
  All assert tests of a program share one sandbox run, in which the tests and the program run in
  two processes (:mod:`agentrl.verifiers._assert_harness`): a non-dumpable checker runs the tests
  and asks the program's process for each call, getting plain data back (rebuilt as built-in
  values: no ``__eq__`` of the program's), and reports on its own stdout, which the program cannot
  write to. Printing result lines, writing to inherited fds, ``sys.exit``/``os._exit``, patching
  builtins or the tests' helpers, or reading memory, environment and ``/proc`` cannot turn a failed
  test into a passed one. A test may use only the program's functions, classes and plain values:
  objects come back as handles that can be called or have attributes read, never compared.

The score is the fraction of tests passed (``mode="fraction"``) or 1/0 (``mode="all"``). No program
and no failure of the sandbox makes :func:`score` raise: each gives a :class:`CodeResult` (with
``error`` set when the verifier could not judge the program, score 0).

Code task sets load in :mod:`agentrl.verifiers.code_tasks`.
"""

from __future__ import annotations

import asyncio
import binascii
import functools
import json
import logging
import marshal
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agentrl.verifiers.sandbox import ExecResult, Isolation, Sandbox, default_sandbox

logger = logging.getLogger(__name__)

CaseStatus = Literal[
    "passed", "failed", "runtime_error", "timeout", "memory", "output_limit", "verifier_error"
]
ScoreMode = Literal["fraction", "all"]
_STATUSES = frozenset(CaseStatus.__args__)  # type: ignore[attr-defined]
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_CLIP = 300
_MAX_REPORT_LINE = 16 << 10
"""Longest harness line read (a test's detail is clipped to far less)."""


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
    isolation: Isolation | None
    """The sandbox's level (None when nothing ran)."""
    error: str = ""
    """Why the verifier could not judge the program (sandbox or harness failure); else empty."""

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
    """Run ``code`` against ``tests`` (one after another) and score it; never raises for a run.

    Args:
        code: the program.
        tests: at least one test.
        mode: ``"fraction"`` (share of tests passed) or ``"all"`` (1 if all pass, else 0).
        timeout_s: time limit per test.
        memory_mb: address-space limit of each run.
        sandbox: where to run (default: the shared auto-isolation sandbox).

    Raises:
        ValueError: no tests, or an unknown mode (a caller's mistake, checked before any run).
    """
    box = sandbox or default_sandbox()
    runs = _plan(code, tests, timeout_s, mode, box)
    try:
        results = [
            box.execute(prog, stdin=stdin, timeout_s=limit, memory_mb=memory_mb)
            for prog, stdin, limit in runs
        ]
    except Exception as e:  # no isolation works, fork or pipe failed: nothing to judge
        return _unjudged(tests, f"sandbox failed: {e}")
    return _assemble(tests, results, mode)


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
    runs = _plan(code, tests, timeout_s, mode, box)
    try:
        results = await asyncio.gather(
            *(box.execute_async(p, stdin=s, timeout_s=t, memory_mb=memory_mb) for p, s, t in runs)
        )
    except Exception as e:
        return _unjudged(tests, f"sandbox failed: {e}")
    return _assemble(tests, list(results), mode)


@functools.cache
def _harness(python: str) -> str:
    """The assert harness as the sandbox's ``main.py``: the wire codec, then the harness.

    Precompiled (a marshal of its code, ~5 ms less per run) when the sandbox runs this very
    interpreter, so that the bytecode format is the same; else as source.
    """
    folder = Path(__file__).parent
    wire = (folder / "_wire.py").read_text(encoding="utf-8")
    harness = (folder / "_assert_harness.py").read_text(encoding="utf-8")
    source = wire + "\n" + harness.replace("from __future__ import annotations\n", "", 1)
    if python != os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable):
        return source
    blob = binascii.b2a_base64(marshal.dumps(compile(source, "main.py", "exec", optimize=2)))
    return f"import binascii, marshal\nexec(marshal.loads(binascii.a2b_base64({blob!r})))\n"


def _plan(
    code: str, tests: Sequence[CodeTest], timeout_s: float, mode: str, box: Sandbox
) -> list[tuple[str, str, float]]:
    """The executions to make, (program, stdin, time limit).

    One per IO test, then one for all assert tests: the harness, with the program and the tests
    as its stdin.
    """
    if not tests:
        raise ValueError("tests: expected at least one test, got none")
    if mode not in ("fraction", "all"):
        raise ValueError(f"mode: expected 'fraction' or 'all', got {mode!r}")
    runs = [(code, t.stdin, timeout_s) for t in tests if isinstance(t, IOTest)]
    asserts = [t.code for t in tests if isinstance(t, AssertTest)]
    if asserts:
        job = {"program": code, "tests": asserts, "limit": timeout_s, "site": box.site_packages}
        runs.append((_harness(box.python), json.dumps(job), timeout_s * (len(asserts) + 1) + 2.0))
    return runs


def _assemble(tests: Sequence[CodeTest], results: list[ExecResult], mode: str) -> CodeResult:
    try:
        return _judge(tests, results, mode)
    except Exception as e:  # a bug here must not take the caller down: the program is unjudged
        logger.warning("code verifier: could not read the runs: %s", e)
        return _unjudged(tests, f"could not read the runs: {e}", results)


def _judge(tests: Sequence[CodeTest], results: list[ExecResult], mode: str) -> CodeResult:
    broken = [r for r in results if r.status == "sandbox_error"]
    if broken:
        return _unjudged(tests, f"sandbox failed: {broken[0].stderr.strip()[-500:]}", results)
    n_io = sum(isinstance(t, IOTest) for t in tests)
    harness = _parse_harness(results[-1], len(tests) - n_io) if n_io < len(tests) else None
    io = iter(zip(results[:n_io], [t for t in tests if isinstance(t, IOTest)], strict=True))
    batch = iter(harness[0] if harness else [])
    pairs: list[tuple[CaseResult, ExecResult]] = []
    for t in tests:
        if isinstance(t, IOTest):
            r, io_test = next(io)
            pairs.append((_io_outcome(r, io_test), r))
        else:
            pairs.append((next(batch), results[-1]))
    outcomes = [o for o, _ in pairs]
    passed = sum(o.passed for o in outcomes)
    value = passed / len(outcomes) if mode == "fraction" else float(passed == len(outcomes))
    first_bad = next((o for o in outcomes if not o.passed), None)
    shown = next((r for o, r in pairs if not o.passed), results[0])  # the first failing run
    stdout, stderr = shown.stdout, shown.stderr
    if harness is not None and shown is results[-1]:
        stdout, stderr = harness[1], harness[2]
    return CodeResult(
        score=value,
        status=first_bad.status if first_bad else "passed",
        tests=tuple(outcomes),
        stdout=stdout[:4096],
        stderr=stderr[-4096:],
        time_s=sum(r.time_s for r in results),
        isolation=results[0].isolation,
        error=harness[3] if harness else "",
    )


def _unjudged(
    tests: Sequence[CodeTest], why: str, results: Sequence[ExecResult] = ()
) -> CodeResult:
    """Score 0: the verifier could not judge the program (``why`` in every test and ``error``)."""
    logger.warning("code verifier: %s", why)
    case = CaseResult("verifier_error", why[:_CLIP])
    return CodeResult(
        score=0.0,
        status="verifier_error",
        tests=(case,) * len(tests),
        stdout="",
        stderr=results[0].stderr[-4096:] if results else "",
        time_s=sum(r.time_s for r in results),
        isolation=results[0].isolation if results else None,
        error=why,
    )


def _io_outcome(r: ExecResult, t: IOTest) -> CaseResult:
    if r.status == "ok":
        if normalise_output(r.stdout) == normalise_output(t.stdout):
            return CaseResult("passed", "", r.time_s)
        detail = f"input: {_clip(t.stdin)} expected: {_clip(t.stdout)} got: {_clip(r.stdout)}"
        return CaseResult("failed", detail, r.time_s)
    return CaseResult(_exec_status(r), _error_line(r), r.time_s)


def _parse_harness(r: ExecResult, n: int) -> tuple[list[CaseResult], str, str, str]:
    """(per-test outcomes, the program's stdout and stderr, harness error) from the checker's lines.

    Only the checker writes these lines; they are still parsed as untrusted (any malformed line
    is skipped), and a test without a line gets the run's own outcome.
    """
    found: dict[int, CaseResult] = {}
    stdout, stderr, error = "", "", ""
    for line in r.stdout.splitlines():
        try:
            item = json.loads(line[:_MAX_REPORT_LINE], parse_constant=_no_constant)
        except (ValueError, RecursionError):
            continue
        if not isinstance(item, list) or not item:
            continue
        if len(item) == 4 and type(item[0]) is int and 0 <= item[0] < n and item[1] in _STATUSES:
            detail, took = item[2], item[3]
            if isinstance(detail, str) and type(took) in (int, float) and 0 <= took < 1e6:
                found[item[0]] = CaseResult(item[1], detail[: 2 * _CLIP], float(took))
        elif item[0] == "out" and len(item) == 3 and all(isinstance(x, str) for x in item[1:]):
            stdout, stderr = item[1], item[2]
        elif item[0] == "error" and len(item) == 2 and isinstance(item[1], str):
            error = item[1][:_CLIP]
    if error and len(found) < n:  # the harness itself failed: say so, once, in the logs
        logger.warning("code verifier: %s", error)
    missing = _missing(r, error)
    return [found.get(i, missing) for i in range(n)], stdout, stderr or r.stderr, error


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} in a harness line")


def _missing(r: ExecResult, error: str) -> CaseResult:
    """The outcome of a test the checker never reported: the run ended early, the harness broke."""
    if r.status != "ok" and r.status != "runtime_error":  # a limit of the whole run
        return CaseResult(_exec_status(r), _error_line(r), r.time_s)
    if error:
        return CaseResult("verifier_error", error, r.time_s)
    return CaseResult("runtime_error", "the test harness stopped: " + _error_line(r), r.time_s)


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
