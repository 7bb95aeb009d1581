"""Python's garbage collections during a benchmark's timed steps: how many, how long.

A full collection holds the GIL while it walks every tracked object; in the loop's one process
that is time the engine's and the learner's threads cannot launch kernels.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Collections by generation between :meth:`start` and :meth:`stop` (``gc.callbacks``)."""

    def __init__(self) -> None:
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
        return {"collections": self.counts, "ms": ms, "full": self.full}
