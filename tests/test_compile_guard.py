"""Compiled functions called while another thread traces: retried, not failed.

The colocated engine's worker thread and the learner's thread both compile lazily; Dynamo's
"FX tracing" flag is process-wide, so a compiled call that lands in the other thread's trace
raised (H200, 2026-11-28: 10 episodes of the agent-loop benchmark's warm-up step failed).
Here a real ``torch.fx.symbolic_trace`` holds the flag in one thread while another calls a
``torch.compile``d function.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.fx

from agentrl.kernels.compile_guard import FX_TRACING, compiled, guarded


class _SlowTrace(torch.nn.Module):
    def __init__(self, entered: threading.Event, hold_s: float) -> None:
        super().__init__()
        self.entered, self.hold_s = entered, hold_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        time.sleep(self.hold_s)  # the trace (and its process-wide flag) lasts this long
        return x + 1


def _while_tracing(call: object, hold_s: float = 0.6) -> tuple[object, float]:
    entered = threading.Event()
    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(_SlowTrace(entered, hold_s),))
    tracer.start()
    assert entered.wait(10)
    t0 = time.perf_counter()
    try:
        out = call()  # type: ignore[operator]
    except RuntimeError as e:
        out = e
    took = time.perf_counter() - t0
    tracer.join()
    return out, took


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_a_bare_compiled_call_fails_inside_another_threads_trace() -> None:
    fn = torch.compile(_double, backend="eager")
    fn(torch.ones(2))  # compiled before the trace begins
    out, _ = _while_tracing(lambda: fn(torch.ones(2)))
    assert isinstance(out, RuntimeError) and FX_TRACING in str(out)


def test_a_guarded_call_waits_for_the_trace_and_returns_the_result() -> None:
    fn = compiled(_double, backend="eager")
    fn(torch.ones(2))
    out, took = _while_tracing(lambda: fn(torch.ones(2)), hold_s=0.6)
    assert isinstance(out, torch.Tensor) and out.tolist() == [2.0, 2.0]
    assert 0.2 < took < 5.0  # it waited for the trace (~0.6 s from its start), then ran


def test_other_errors_and_a_trace_that_never_ends_still_raise() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a real error")

    with pytest.raises(RuntimeError, match="a real error"):
        guarded(broken)(torch.ones(1))
    fn = guarded(torch.compile(_double, backend="eager"), wait_s=0.2)
    fn(torch.ones(2))
    out, took = _while_tracing(lambda: fn(torch.ones(2)), hold_s=1.5)
    assert isinstance(out, RuntimeError) and FX_TRACING in str(out)
    assert took < 1.4  # gave up after wait_s, not when the trace ended
