"""What ``loop_gpu.py`` watches on the engine's and the host's side: the engine's running rows and
timed steps, device-to-host synchronisations by call site, the CUDA allocator's counters."""

from __future__ import annotations

import json
import threading
import time
import traceback
import warnings
from collections import Counter
from typing import Any

import torch


class EngineRows:
    """The engine's running rows, sampled every 10 ms from a thread: mean, and share of time > 0.

    ``read`` returns the running-request count (the in-process engine's ``stats()``, or the
    server's ``/v1/loads``), or a (running, waiting) pair; :attr:`timeline` keeps
    ``(ms since start, running, waiting)`` per sample.
    """

    def __init__(self, read: Any) -> None:
        self.read = read
        self.samples: list[int] = []
        self.timeline: list[tuple[int, int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0

    def start(self) -> None:
        """Start sampling."""
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                got = self.read()
            except Exception:  # noqa: BLE001 - a missed sample (server busy) is skipped
                continue
            running, waiting = got if isinstance(got, tuple) else (got, -1)
            self.samples.append(int(running))
            ms = round((time.perf_counter() - self.t0) * 1e3)
            self.timeline.append((ms, int(running), int(waiting)))

    def stop(self) -> dict[str, float]:
        """Stop; ``mean`` running rows, ``active`` (share of samples with any) and ``queued``
        (share with none running but some open: queued, settling or in their first prefill)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        n = len(self.samples) or 1
        queued = sum(r == 0 and w > 0 for _, r, w in self.timeline)
        return {"mean": sum(self.samples) / n, "active": sum(x > 0 for x in self.samples) / n,
                "queued": queued / n, "samples": len(self.samples)}  # fmt: skip


def server_running_rows(url: str) -> int:
    """Running requests of an ``agentrl serve`` engine (``/v1/loads``)."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/loads", timeout=1.0) as r:
        return int(json.loads(r.read())["loads"][0]["num_running_reqs"])


class SyncCount:
    """Device-to-host synchronisations by part and call site (torch's sync debug mode).

    Every synchronising op (``.item()``, ``.tolist()``, a blocking copy to the host, ...) warns;
    the warning's Python stack names the part (``learner``: ``agentrl/learner`` or
    ``agentrl/kernels`` on the stack, ``engine``: ``agentrl/inference``) and the innermost
    agentrl line. Explicit ``synchronize()`` calls are not counted.
    """

    def __init__(self) -> None:
        self.parts: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self._show = warnings.showwarning

    def start(self) -> None:
        """Count from now on."""
        warnings.filterwarnings("always", message=".*synchroniz")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        """Stop counting."""
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show

    def _record(self, message: Any, category: Any, filename: str, lineno: int, *a: Any) -> None:
        if "synchroniz" not in str(message):
            self._show(message, category, filename, lineno, *a)
            return
        ours = [f for f in traceback.extract_stack()[:-1] if "/agentrl/" in f.filename]
        files = " ".join(f.filename for f in ours)
        part = ("learner" if "/learner/" in files or "/kernels/" in files else
                "engine" if "/inference/" in files else "other")  # fmt: skip
        self.parts[part] += 1
        if ours:
            f = ours[-1]
            self.sites[f"{part}: {f.filename.split('/agentrl/')[-1]}:{f.lineno} {f.name}"] += 1


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's counters of calls that synchronise the device."""
    stats = torch.cuda.memory_stats()
    return {
        "device_allocs": stats.get("num_device_alloc", 0),
        "device_frees": stats.get("num_device_free", 0),
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "sync_all_streams": stats.get("num_sync_all_streams", 0),
    }


class EngineSteps:
    """The in-process engine's steps, pauses, resumes and arrivals, timed (ms since ``start``).

    Wraps the engine's batcher ``compute`` (worker thread) and ``submit``, and its ``pause`` and
    ``resume``: each computed plan is ``[start, end, decode rows, joining requests, their
    tokens, decode steps]``; ``events`` holds ``[ms, "pause" | "resume" | "push+" | "push-"]``
    and ``arrivals`` the submit times.
    """

    def __init__(self, engine: Any, trainer: Any) -> None:
        self.t0: float | None = None
        self.steps: list[list[float]] = []
        self.events: list[list[Any]] = []
        self.arrivals: list[float] = []
        batcher = engine._batcher
        compute, submit = batcher.compute, batcher.submit
        pause, resume, sync = engine.pause, engine.continue_generation, trainer.sync_weights

        def now() -> float | None:
            return None if self.t0 is None else round((time.perf_counter() - self.t0) * 1e3, 2)

        def timed_compute(plan: Any, *args: Any) -> Any:
            a = now()
            out = compute(plan, *args)
            if a is not None:
                joining = sum(len(r.prompt) + len(r.output_ids) for r in plan.admit)
                self.steps.append([a, now(), len(plan.decode), len(plan.admit), joining,
                                   plan.steps])  # fmt: skip
            return out

        def timed_submit(req: Any) -> None:
            if self.t0 is not None:
                self.arrivals.append(now())  # type: ignore[arg-type]
            submit(req)

        def mark(name: str, fn: Any) -> Any:
            async def wrapped(*a: Any, **k: Any) -> Any:
                if self.t0 is not None:
                    self.events.append([now(), name + "+"])
                try:
                    return await fn(*a, **k)
                finally:
                    if self.t0 is not None:
                        self.events.append([now(), name + "-"])

            return wrapped

        batcher.compute, batcher.submit = timed_compute, timed_submit
        engine.pause = mark("pause", pause)
        engine.resume = engine.continue_generation = mark("resume", resume)
        trainer.sync_weights = mark("push", sync)

    def start(self, t0: float) -> None:
        """Record from now on, on the clock that starts at ``t0`` (``perf_counter``)."""
        self.t0 = t0

    def stop(self) -> dict[str, Any]:
        """Stop recording; the records."""
        self.t0 = None
        return {"steps": self.steps, "events": self.events, "arrivals": self.arrivals}
