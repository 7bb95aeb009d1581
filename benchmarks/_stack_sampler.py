"""Where each Python thread is while the card idles: a sampler of every thread's stack.

A daemon thread reads ``sys._current_frames()`` every ``interval_ms`` and keeps, per thread,
the innermost frame of agentrl or the benchmarks and the innermost frame of all (a torch or
asyncio call). Taken at the card's idle gaps, the samples say what the host was doing when it
launched nothing: the event loop's work, the learner's host-side Python, a lock.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any

OURS = ("agentrl", "benchmarks")


def _where(frame: Any) -> str:
    inner = f"{frame.f_code.co_name}@{frame.f_code.co_filename.rsplit('/', 1)[-1]}"
    ours = None
    while frame is not None and ours is None:
        name = frame.f_code.co_filename
        if any(f"/{p}/" in name for p in OURS) and "_stack_sampler" not in name:
            ours = f"{frame.f_code.co_name}@{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return f"{ours or '-'} | {inner}"


class StackSampler:
    """Samples of ``(ms since t0, thread name, where)`` between :meth:`start` and :meth:`stop`."""

    def __init__(self, interval_ms: float = 1.0) -> None:
        self.interval = interval_ms / 1e3
        self.samples: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")
        self.t0 = 0.0

    def start(self, t0: float) -> None:
        """Sample from now on; times in ms since ``t0`` (``perf_counter``)."""
        self.t0 = t0
        self._thread.start()

    def _run(self) -> None:
        names = {}
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            now = (time.perf_counter() - self.t0) * 1e3
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                self.samples.append((now, names.get(ident, str(ident)), _where(frame)))

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()

    def in_gaps(self, gaps: list[tuple[float, float]], top: int = 12) -> dict[str, Any]:
        """Per thread, the most sampled places inside ``gaps`` (``(start ms, length ms)``)."""
        spans = sorted(gaps)
        by_thread: dict[str, Counter[str]] = {}
        j = 0
        for t, thread, where in sorted(self.samples):
            while j < len(spans) and spans[j][0] + spans[j][1] < t:
                j += 1
            if j < len(spans) and spans[j][0] <= t:
                by_thread.setdefault(thread, Counter())[where] += 1
        return {k: c.most_common(top) for k, c in by_thread.items()}
