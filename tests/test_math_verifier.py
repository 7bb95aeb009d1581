"""Math verifier: equivalence cases, extraction, time limits, worker faults, threads and asyncio."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentrl.errors import VerifierError
from agentrl.types import Task
from agentrl.verifiers import math as mv
from agentrl.verifiers.math import (
    MathResult,
    extract_answer,
    shutdown_pool,
    start_pool,
    validate_gold,
    verify,
    verify_async,
)


@pytest.fixture(scope="module", autouse=True)
def pool():
    start_pool(2)
    yield
    shutdown_pool()


def _pids() -> list[int]:
    p = mv._get_pool()
    with p._cond:
        return [w.process.pid for w in p._idle]


# (model's boxed answer, reference, expected score)
CASES = [
    # fractions
    ("\\frac{1}{2}", "0.5", 1),
    ("\\dfrac{3}{4}", "0.75", 1),
    ("2/4", "\\frac{1}{2}", 1),
    ("3\\frac{1}{2}", "\\frac72", 1),
    ("\\frac{a}{b}", "a/b", 1),
    ("\\frac{2}{3}", "0.67", 0),
    ("0.333", "\\frac{1}{3}", 0),
    ("\\frac{22}{7}", "\\pi", 0),
    # decimals
    ("3.50", "3.5", 1),
    ("2.0", "2", 1),
    ("0.9999", "1", 0),
    ("100", "99.99", 0),
    ("1.4142", "\\sqrt{2}", 0),
    # integers (exact, in the caller) and separators
    ("46", "46", 1),
    ("47", "46", 0),
    ("012", "12", 1),
    ("1,000", "1000", 1),
    ("1001", "1000", 0),
    # LaTeX and symbolic
    ("\\sqrt{8}", "2\\sqrt{2}", 1),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", 1),
    ("\\frac{\\pi}{2}", "\\pi/2", 1),
    ("2\\pi", "6.283185307179586", 1),
    ("x^2+2x+1", "(x+1)^2", 1),
    ("x^2+2x", "(x+1)^2", 0),
    ("y = 2x+1", "2x+1", 1),
    ("\\sqrt{3}", "1.732", 0),
    # units, text, percent, currency
    ("5\\text{ cm}", "5", 1),
    ("5 \\text{ dollars}", "5", 1),
    ("\\$5", "5", 1),
    ("10\\%", "10", 1),
    ("\\text{(B)}", "B", 1),
    # intervals
    ("[1,2)", "[1,2)", 1),
    ("[1,2]", "[1,2)", 0),
    ("(-\\infty, 3]", "(-\\infty,3]", 1),
    ("\\left( 1, 2 \\right)", "(1,2)", 1),
    ("(0,1)", "[0,1]", 0),
    ("[1,2) \\cup (3,4]", "(3,4] \\cup [1,2)", 1),
    ("x \\in [2, 5]", "[2,5]", 1),
    # sets and lists
    ("\\{1,2,3\\}", "\\{3,2,1\\}", 1),
    ("{1,2,3}", "\\{1,2,3\\}", 1),
    ("\\{1,2\\}", "\\{1,2,3\\}", 0),
    ("2,3", "3,2", 1),
    # negatives
    ("-\\frac{3}{4}", "-0.75", 1),
    ("-(-3)", "3", 1),
    ("\u22127", "-7", 1),  # unicode minus sign
    ("-3", "3", 0),
    ("5", "-5", 0),
    # scientific notation ("1.5e-3" must not read as 1.5*e - 3)
    ("1.5e-3", "0.0015", 1),
    ("6.02e23", "6.02\\times10^{23}", 1),
    ("1.5\\times 10^{-3}", "0.0015", 1),
    ("2.5 \\times 10^{3}", "2500", 1),
    ("1e10", "10000000000", 1),
    ("1.5e-3", "0.015", 0),
    ("6.02\\times10^{22}", "6.02\\times10^{23}", 0),
]


def test_enough_cases() -> None:
    assert (
        len(CASES) >= 40 and sum(e for *_, e in CASES) >= 20 and sum(1 - e for *_, e in CASES) >= 15
    )


@pytest.mark.parametrize(("answer", "reference", "expected"), CASES)
def test_equivalence(answer: str, reference: str, expected: int) -> None:
    r = verify(f"So the answer is $\\boxed{{{answer}}}$.", reference)
    assert (r.score, r.extracted) == (expected, answer), r.reason
    assert r.reason == ("correct" if expected else "wrong answer")


@pytest.mark.parametrize(
    ("text", "mode", "expected"),
    [
        ("a \\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}}} end", "boxed", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{\\{1,2\\}}", "boxed", "\\{1,2\\}"),  # escaped braces do not close the box
        ("\\fbox{7}", "boxed", "7"),
        ("the answer is \\boxed 5.", "boxed", "5."),
        ("\\boxed{$3$}", "boxed", "3"),
        (
            "work\nAnswer: 3/4\nmore\n**Final Answer:** $\\frac{5}{6}$.",
            "answer_line",
            "\\frac{5}{6}",
        ),
        ("answer: \\boxed{12}", "answer_line", "12"),
        ("12+34=46", "last_number", "46"),
        ("12-34=-22", "last_number", "-22"),
        ("total 1,234.5 or 3e5 apples", "last_number", "3e5"),
        ("we get 1,2,3", "last_number", "3"),
        ("  x+1  ", "none", "x+1"),
    ],
)
def test_extraction(text: str, mode: mv.Extract, expected: str) -> None:
    assert extract_answer(text, mode) == (expected, "")


@pytest.mark.parametrize(
    ("response", "extract", "reason"),
    [
        ("I think it is 7", "boxed", "no \\boxed{} answer"),
        ("\\boxed{12", "boxed", "unterminated \\boxed{"),
        ("\\boxed{}", "boxed", "empty answer"),
        ("\\boxed{???}", "boxed", "unparseable answer"),
        ("no digits here", "last_number", "no number"),
        ("no line", "answer_line", "no answer line"),
        ("\\boxed{" + "1+" * 600 + "1}", "boxed", "answer too long"),
    ],
)
def test_malformed_answers_score_zero_with_a_reason(
    response: str, extract: mv.Extract, reason: str
) -> None:
    r = verify(response, "7", extract=extract)
    assert r.score == 0.0 and r.reason == reason


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="extract: expected one of"):
        verify("\\boxed{1}", "1", extract="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s: expected > 0"):
        verify("\\boxed{1}", "1", timeout_s=0)
    with pytest.raises(TypeError, match="expected str response"):
        verify(None, "1")  # type: ignore[arg-type]


def test_pathological_input_times_out_and_the_pool_goes_on() -> None:
    # sympy on 9^{9^{9}} vs 1 ran for over 40 s here (killed by `timeout`) with no limit.
    t = time.monotonic()
    r = verify("\\boxed{9^{9^{9}}}", "1", timeout_s=1.0)
    elapsed = time.monotonic() - t
    assert r == MathResult(0.0, "9^{9^{9}}", "timeout")
    assert 0.9 < elapsed < 2.5
    assert verify("\\boxed{\\frac{1}{2}}", "0.5").score == 1.0


def test_a_worker_that_ignores_the_soft_limit_is_killed_and_replaced() -> None:
    victim = _pids()[-1]  # the next check takes the last idle worker
    os.kill(victim, signal.SIGSTOP)  # a stopped process answers nothing, like one stuck in C
    t = time.monotonic()
    r = verify("\\boxed{\\frac{1}{2}}", "0.5", timeout_s=0.5)
    assert r.reason == "timeout" and r.score == 0.0
    assert 0.9 < time.monotonic() - t < 3.0  # soft limit + 0.5 s grace, then a kill
    assert victim not in _pids()
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)
    assert verify("\\boxed{\\frac{1}{2}}", "0.5").score == 1.0


def test_a_worker_killed_mid_check_or_while_idle() -> None:
    busy = _pids()[-1]
    threading.Timer(0.5, os.kill, (busy, signal.SIGKILL)).start()
    r = verify("\\boxed{9^{9^{9}}}", "1", timeout_s=5.0)
    assert r.score == 0.0 and r.reason == "verifier worker died (code -9)"
    for pid in _pids():  # every idle worker dies: the next checks replace them, nothing is lost
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    assert [verify("\\boxed{0.5}", "1/2").score for _ in range(3)] == [1.0] * 3


def test_threads_share_the_pool() -> None:
    results: list[float] = []

    def work(i: int) -> None:
        results.append(verify(f"\\boxed{{\\frac{{{i}}}{{4}}}}", str(i / 4)).score)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [1.0] * 8


def test_verify_async_keeps_the_loop_free() -> None:
    async def go() -> tuple[list[MathResult], float]:
        lags: list[float] = []

        async def ticker() -> None:
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)

        tick = asyncio.create_task(ticker())
        rs = await asyncio.gather(
            *[verify_async(f"\\boxed{{x^2+{i}x}}", f"x(x+{i})") for i in range(12)],
            verify_async("\\boxed{9^{9^{9}}}", "1", timeout_s=1.0),
        )
        tick.cancel()
        return rs, max(lags)

    rs, worst = asyncio.run(go())
    assert [r.score for r in rs] == [1.0] * 12 + [0.0] and rs[-1].reason == "timeout"
    # the loop never waited on a check: a blocked loop lags by the checks it ran, 1 s or more
    # here (the timed-out one alone holds 1 s); a loaded 2-core box (other test workers, other
    # jobs) has starved the process for up to ~0.5 s, which is no block
    assert worst < 0.8
    # a second event loop uses the same pool
    assert asyncio.run(verify_async("\\boxed{[0,1]}", "[0,1]")).score == 1.0


def test_validate_gold_reports_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    tasks = [
        Task(id="a", prompt="q", answer="\\frac{1}{2}"),
        Task(id="b", prompt="q", answer="[0, \\infty)"),
        Task(id="c", prompt="q", answer="42"),
        Task(id="d", prompt="q", answer="???"),
        Task(id="e", prompt="q", answer=None),
        Task(id="f", prompt="q", answer="$\\{1, 2\\}$"),
    ]
    with caplog.at_level(logging.WARNING, logger="agentrl.verifiers.math"):
        report = validate_gold(tasks)
    assert (report.total, report.valid) == (6, 4)
    assert report.invalid == {"d": "unparseable reference", "e": "no reference answer"}
    assert "2 of 6 do not verify" in caplog.text and "d (unparseable reference)" in caplog.text


def test_shutdown_and_restart() -> None:
    pids = _pids()
    shutdown_pool()
    shutdown_pool()  # idempotent
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert verify("\\boxed{1/3}", "\\frac{1}{3}").score == 1.0  # a fresh pool starts


def test_checks_waiting_when_the_pool_shuts_down_fail_loudly() -> None:
    p = mv._get_pool()
    held = [p._acquire() for _ in range(p.size)]  # every worker busy
    errors: list[BaseException] = []

    def waiting() -> None:
        try:
            p.check("1/2", "0.5", 5.0)
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=waiting)
    th.start()
    time.sleep(0.2)
    shutdown_pool()
    th.join(5)
    for w in held:
        p._release(w, True)  # the pool is closed: the worker is stopped
        assert w.process.poll() is not None
    assert len(errors) == 1 and isinstance(errors[0], VerifierError)
    assert "shut down" in str(errors[0])


_CHILD = """
import os, sys
from agentrl.verifiers import math as mv
assert mv.verify("\\\\boxed{1/2}", "0.5").score == 1.0
print(" ".join(str(w.process.pid) for w in mv._get_pool()._idle), flush=True)
if sys.argv[1] == "hang":
    import time; time.sleep(60)
"""


def _gone(pids: list[int], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if Path(f"/proc/{p}").exists()
            and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
        ]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_no_worker_outlives_its_parent(how: str) -> None:
    cmd = [sys.executable, "-c", _CHILD, how]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        pids = [int(p) for p in child.stdout.readline().split()]
        assert len(pids) >= 1
        if how == "hang":
            child.kill()  # no atexit: the workers see EOF on their socket and leave
        assert child.wait(timeout=30) == (0 if how == "exit" else -9)
    assert _gone(pids, within_s=5.0)
