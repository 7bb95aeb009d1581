"""What ``loop_gpu.py`` measures besides throughput: GPU busy (a CUDA-only kernel trace and
``nvidia-smi``), the engine's running rows, and device-to-host synchronisations by call site."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import traceback
import warnings
from collections import Counter
from typing import Any

import torch


class KernelBusy:
    """The share of wall time at least one kernel runs: a CUDA-only profiler trace's union.

    With ``gaps``, :meth:`stop` also splits each stream's idle time by cause
    (:func:`stream_gaps`, read from the exported trace into :attr:`gaps`).
    """

    def __init__(self, gaps: bool = False) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._t0 = 0.0
        self._want_gaps = gaps
        self.gaps: dict[str, Any] = {}

    def start(self) -> None:
        """Start tracing kernels."""
        torch.cuda.synchronize()
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Stop; busy time / wall time since ``start``."""
        torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        if self._want_gaps:
            import tempfile

            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                self._prof.export_chrome_trace(f.name)
                self.gaps = stream_gaps(json.load(open(f.name)).get("traceEvents", []), wall)
        spans = sorted(
            (e.time_range.start, e.time_range.end)
            for e in self._prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
        busy, end = 0.0, float("-inf")
        for s, e in spans:  # microseconds
            if s > end:
                busy, end = busy + (e - s), e
            elif e > end:
                busy, end = busy + (e - end), e
        return busy / 1e6 / wall if wall > 0 else float("nan")


def stream_gaps(events: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Each CUDA stream's busy and idle time, the idle split by what the next kernel waited for.

    From a chrome trace's events: kernels, copies and memsets (``ts``/``dur`` in us, ``args``
    ``stream`` and ``correlation``) and the runtime/driver launch calls that share their
    correlation id (a graph's kernels share their ``cudaGraphLaunch``'s). Before each kernel, the
    stream's gap since its previous kernel ended is ``host`` for the part before the kernel was
    launched (the launching thread was late: host-bound) and ``device`` for the rest (launched,
    yet waiting: other streams' work, dependencies, launch latency). Per stream (the four
    busiest): kernels, busy, host and device gaps (s), the median launch-to-start latency (us),
    and the threads (ids) that launched its kernels, with their share.
    """
    launches: dict[Any, tuple[float, Any]] = {}
    work: dict[Any, list[tuple[float, float, Any]]] = {}
    for e in events:
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat in ("cuda_runtime", "cuda_driver") and "aunch" in e.get("name", ""):
            launches[args.get("correlation")] = (float(e["ts"]), e.get("tid"))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset") and "stream" in args:
            start = float(e["ts"])
            work.setdefault(args["stream"], []).append(
                (start, start + float(e.get("dur", 0)), args.get("correlation"))
            )
    out: dict[str, Any] = {}
    for stream, items in sorted(work.items(), key=lambda kv: -sum(b - a for a, b, _ in kv[1]))[:4]:
        items.sort()
        host = device = 0.0
        latency: list[float] = []
        threads: Counter[Any] = Counter()
        prev_end = None
        for start, end, corr in items:
            launch = launches.get(corr)
            if launch is not None:
                latency.append(start - launch[0])
                threads[launch[1]] += 1
            if prev_end is not None and start > prev_end:
                gap = start - prev_end
                late = 0.0 if launch is None else min(max(launch[0] - prev_end, 0.0), gap)
                host, device = host + late, device + gap - late
            prev_end = end if prev_end is None else max(prev_end, end)
        latency.sort()
        n = sum(threads.values()) or 1
        out[str(stream)] = {
            "kernels": len(items),
            "busy_s": round(sum(b - a for a, b, _ in items) / 1e6, 4),
            "gap_host_s": round(host / 1e6, 4),
            "gap_device_s": round(device / 1e6, 4),
            "launch_to_start_median_us": round(latency[len(latency) // 2], 1) if latency else None,
            "threads": {str(t): round(k / n, 3) for t, k in threads.most_common(3)},
        }
    out["wall_s"] = round(wall_s, 4)
    return out


class GpuBusy:
    """``nvidia-smi``'s utilisation of card 0, sampled every 100 ms between start and stop."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling."""
        cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
               "-i", "0", "-lms", "100"]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self.samples.append(float(line) / 100)

    def stop(self) -> float:
        """Stop; the mean busy fraction (nan without samples)."""
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        return sum(self.samples) / len(self.samples) if self.samples else float("nan")


class EngineRows:
    """The engine's running rows, sampled every 10 ms from a thread: mean, and share of time > 0.

    ``read`` returns the running-request count (the in-process engine's ``stats()``, or the
    server's ``/v1/loads``).
    """

    def __init__(self, read: Any) -> None:
        self.read = read
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling."""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.samples.append(int(self.read()))
            except Exception:  # noqa: BLE001 - a missed sample (server busy) is skipped
                continue

    def stop(self) -> dict[str, float]:
        """Stop; ``mean`` running rows and ``active`` (share of samples with any)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        n = len(self.samples) or 1
        return {"mean": sum(self.samples) / n, "active": sum(x > 0 for x in self.samples) / n,
                "samples": len(self.samples)}  # fmt: skip


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
