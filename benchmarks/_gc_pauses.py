"""Python's garbage collections during a benchmark's timed steps: how many, how long.

A full collection holds the GIL while it walks every tracked object; in the loop's one process
that is time the engine's and the learner's threads cannot launch kernels.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections import Counter
from typing import Any


class GcPauses:
    """Collections by generation between :meth:`start` and :meth:`stop` (``gc.callbacks``).

    ``sites``: also count where each young collection began (the thread, and the innermost
    frames of agentrl, torch or triton code in it): a young collection starts at the allocation
    that crossed the threshold, so the counts sample where tracked objects are allocated.
    """

    def __init__(self, sites: bool = False) -> None:
        self.sites: Counter[str] | None = Counter() if sites else None
        self.t0: float | None = None
        self._began = 0.0
        self.counts = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self.full: list[list[float]] = []  # [start ms since t0, duration ms] of each full one
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        if self.t0 is None:
            return
        now = time.perf_counter()
        if phase == "start":
            self._began = now
            if self.sites is not None and info["generation"] == 0:
                self.sites[_site()] += 1
            return
        gen, took = int(info["generation"]), (now - self._began) * 1e3
        self.counts[gen] += 1
        self.ms[gen] += took
        if gen == 2:
            self.full.append([round((self._began - self.t0) * 1e3, 2), round(took, 2)])

    def start(self, t0: float) -> None:
        """Count from now on; times are ms since ``t0`` (``perf_counter``)."""
        self.t0 = t0

    def stop(self) -> dict[str, Any]:
        """Stop counting (and unhook); the counts, total ms per generation, the full ones."""
        self.t0 = None
        gc.callbacks.remove(self._on)
        ms = [round(m, 1) for m in self.ms]
        top = None if self.sites is None else dict(self.sites.most_common(25))
        return {"collections": self.counts, "ms": ms, "full": self.full, "sites": top}


def _site() -> str:
    """The calling thread's name and its three innermost agentrl/torch/triton frames."""
    frame, names = sys._getframe(0).f_back, []  # (``_on``: skipped, it is in benchmarks/)
    frame = frame.f_back if frame is not None else None
    while frame is not None and len(names) < 3:
        path = frame.f_code.co_filename
        for lib in ("agentrl/", "torch/", "triton/", "benchmarks/"):
            if lib in path:
                names.append(f"{lib}{path.split(lib)[-1]}:{frame.f_lineno}")
                break
        frame = frame.f_back
    return f"{threading.current_thread().name}: {' < '.join(names) or '?'}"
