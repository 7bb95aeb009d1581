"""Compiled functions called from two threads: the learner's and the colocated engine's.

While Dynamo traces a function it sets torch.fx's process-wide "FX tracing" flag, and a
``torch.compile``d function entered from *another* thread at that moment raises
``RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized
function``. The learner (the trainer's thread) and the colocated engine (its worker thread) both
compile lazily, on new shapes, so in the overlapped loop one side's call can land inside the
other's trace: on an H200 the agent-loop benchmark lost 10 episodes of its warm-up step while
the learner compiled and the engine captured a new decode graph (2026-11-28).

The error is raised on entry, before the function runs anything, so :func:`guarded` retries the
call once the other thread's trace is over. A thread that is itself tracing never sees the flag
clear: after :data:`WAIT_S` the error is raised as it came.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

FX_TRACING = "Detected that you are using FX to symbolically trace a dynamo-optimized function"
WAIT_S = 1800.0  # the longest compile seen: ~110 s (the learner's first 8k-token step)
POLL_S = 0.005


def guarded(fn: F, wait_s: float = WAIT_S) -> F:
    """``fn`` (a compiled function), retried while another thread's Dynamo trace is running."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced into by an outer compile: no retries there
            return fn(*args, **kwargs)
        deadline: float | None = None
        while True:
            try:
                return fn(*args, **kwargs)
            except RuntimeError as e:
                if FX_TRACING not in str(e):
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + wait_s
                    log.info("a compiled call waits for another thread's torch.compile trace")
                elif now > deadline:
                    raise
            while is_fx_symbolic_tracing() and time.monotonic() <= deadline:
                time.sleep(POLL_S)

    return call  # type: ignore[return-value]


def compiled(fn: F, **options: Any) -> F:
    """``torch.compile(fn, **options)``, :func:`guarded`."""
    return guarded(cast(F, torch.compile(fn, **options)))
