"""How busy the card is in ``loop_gpu.py``'s timed steps: a CUDA-only kernel trace (its
union, the idle gaps by stream and launching thread, a 10 ms timeline) and ``nvidia-smi``."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
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
        self.timeline: dict[str, Any] = {}  # card_timeline of the traced span

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
                events = json.load(open(f.name)).get("traceEvents", [])
            self.gaps = stream_gaps(events, wall)
            self.gaps["detail"] = gap_detail(events)
            del events
            # name the launching threads (the autograd engine's worker is a C++ thread: unnamed)
            names = {}
            for t in threading.enumerate():  # traces name a thread by its id or its pthread id
                names[str(t.native_id)] = names[str((t.ident or 0) & 0xFFFFFFFF)] = t.name
            self.gaps["thread_names"] = names
        kernels = device_spans(self._prof, torch.autograd.DeviceType.CUDA)
        self.timeline = card_timeline(kernels, wall)
        spans = sorted((a, b) for a, b, _ in kernels)
        busy = sum(b - a for a, b in _merge(spans))  # microseconds
        return busy / 1e6 / wall if wall > 0 else float("nan")


def device_spans(prof: Any, device: Any) -> list[tuple[float, float, int]]:
    """A stopped profiler's ``device`` events: ``(start, end, stream)``, in us from its start.

    Read from the raw kineto results: ``prof.events()`` builds a Python event tree first, ~90
    us an event (45 s for 500k events on a CPU here; a loop run traces over a million kernels),
    against ~5 us here.
    """
    result = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    try:
        t0 = result.trace_start_ns()
        return [
            ((e.start_ns() - t0) / 1e3, (e.end_ns() - t0) / 1e3, e.device_resource_id())
            for e in result.events()
            if e.device_type() == device and not e.name().startswith("[")  # "[memory]" records
        ]
    except AttributeError:  # a torch without these accessors: the slow way
        return [
            (e.time_range.start, e.time_range.end, e.device_resource_id)
            for e in prof.events()
            if e.device_type == device
        ]


Work = dict[Any, list[tuple[float, float, Any, str]]]  # stream: (start, end, correlation, name)


def _trace(
    events: list[dict[str, Any]],
) -> tuple[dict[Any, tuple[float, float, str, Any]], dict[tuple[Any, str], list[float]], Work]:
    """A chrome trace's CUDA API calls by correlation id ``(begin, end, name, thread)``, their
    durations by ``(thread, name)``, and each stream's kernels, copies and memsets (us)."""
    calls: dict[Any, tuple[float, float, str, Any]] = {}
    api: dict[tuple[Any, str], list[float]] = {}
    work: Work = {}
    for e in events:
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat in ("cuda_runtime", "cuda_driver"):
            ts, dur = float(e["ts"]), float(e.get("dur", 0))
            calls[args.get("correlation")] = (ts, ts + dur, e.get("name", ""), e.get("tid"))
            api.setdefault((e.get("tid"), e.get("name", "")), []).append(dur)
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset") and "stream" in args:
            start = float(e["ts"])
            work.setdefault(args["stream"], []).append(
                (start, start + float(e.get("dur", 0)), args.get("correlation"), e.get("name", ""))
            )
    return calls, api, work


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
    calls, _, work = _trace(events)
    launches = {c: (begin, tid) for c, (begin, _, name, tid) in calls.items() if "aunch" in name}
    out: dict[str, Any] = {}
    for stream, items in sorted(work.items(), key=lambda kv: -sum(b - a for a, b, *_ in kv[1]))[:4]:
        items.sort()
        host = device = 0.0
        latency: list[float] = []
        threads: Counter[Any] = Counter()
        prev_end = None
        for start, end, corr, _ in items:
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
            "busy_s": round(sum(b - a for a, b, *_ in items) / 1e6, 4),
            "gap_host_s": round(host / 1e6, 4),
            "gap_device_s": round(device / 1e6, 4),
            "launch_to_start_median_us": round(latency[len(latency) // 2], 1) if latency else None,
            "threads": {str(t): round(k / n, 3) for t, k in threads.most_common(3)},
        }
    out["wall_s"] = round(wall_s, 4)
    return out


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covered(merged: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    """How much of [a, b] the merged intervals cover."""
    import bisect

    i, got = max(bisect.bisect_right(starts, a) - 1, 0), 0.0
    while i < len(merged) and merged[i][0] < b:
        got += max(0.0, min(b, merged[i][1]) - max(a, merged[i][0]))
        i += 1
    return got


def gap_detail(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the least-graphed busy stream (the learner's) waits, from a chrome trace.

    Each gap before a kernel splits into ``host`` (before its launch call began), ``call`` (the
    launch call still running: driver or GIL-held launcher blocked) and ``device`` (launched,
    not started); the device part further into time another stream ran a kernel and time the
    card ran nothing. Also: the launch and sync calls that took the most time, by thread, and
    the largest gaps with their kernel and call.
    """
    calls, api, work = _trace(events)
    if not work:
        return {}
    merged = {s: _merge([(a, b) for a, b, _, _ in items]) for s, items in work.items()}
    every = _merge([iv for m in merged.values() for iv in m])
    every_starts = [a for a, _ in every]
    graphed = {  # the share of a stream's kernels launched by a graph launch
        s: sum(1 for it in items if it[2] in calls and "Graph" in calls[it[2]][2]) / len(items)
        for s, items in work.items()
    }
    busy = {s: sum(b - a for a, b in m) for s, m in merged.items()}
    learner = max((s for s in work if graphed[s] < 0.5), key=lambda s: busy[s], default=None)
    out: dict[str, Any] = {"graphed_share": {str(s): round(g, 3) for s, g in graphed.items()}}
    top_api = sorted(api.items(), key=lambda kv: -sum(kv[1]))[:14]
    out["api_top"] = [
        {"thread": str(t), "name": n, "calls": len(d), "total_s": round(sum(d) / 1e6, 4),
         "median_us": round(sorted(d)[len(d) // 2], 1), "max_us": round(max(d), 1)}
        for (t, n), d in top_api
    ]  # fmt: skip
    if learner is None:
        return out
    others = _merge([iv for s, m in merged.items() if s != learner for iv in m])
    other_starts = [a for a, _ in others]
    part = {"host": 0.0, "call": 0.0, "device_other_busy": 0.0, "device_idle": 0.0}
    buckets = {"<10us": [0, 0.0], "10-100us": [0, 0.0], "0.1-1ms": [0, 0.0], "1-10ms": [0, 0.0],
               ">10ms": [0, 0.0]}  # fmt: skip
    largest: list[tuple[float, dict[str, Any]]] = []
    items = sorted(work[learner])
    prev_end = None
    for start, end, corr, name in items:
        if prev_end is not None and start > prev_end:
            c = calls.get(corr)
            begin, done = (c[0], c[1]) if c else (prev_end, prev_end)
            host = min(max(begin - prev_end, 0.0), start - prev_end)
            call = min(max(done - max(begin, prev_end), 0.0), start - prev_end - host)
            dev_a = prev_end + host + call
            dev = start - dev_a
            other = _covered(others, other_starts, dev_a, start) if dev > 0 else 0.0
            part["host"] += host
            part["call"] += call
            part["device_other_busy"] += other
            part["device_idle"] += dev - other
            gap = start - prev_end
            key = ("<10us" if gap < 10 else "10-100us" if gap < 100 else "0.1-1ms" if gap < 1e3
                   else "1-10ms" if gap < 1e4 else ">10ms")  # fmt: skip
            buckets[key][0] += 1
            buckets[key][1] += gap
            if gap > 500:
                largest.append((gap, {
                    "gap_us": round(gap), "host_us": round(host), "call_us": round(call),
                    "device_us": round(dev), "other_busy_us": round(other),
                    "card_busy_us": round(_covered(every, every_starts, prev_end, start)),
                    "kernel": name[:70], "call": c[2] if c else None,
                    "thread": str(c[3]) if c else None,
                }))  # fmt: skip
        prev_end = end if prev_end is None else max(prev_end, end)
    largest.sort(key=lambda kv: -kv[0])
    out["learner_stream"] = str(learner)
    out["learner_gap_s"] = {k: round(v / 1e6, 4) for k, v in part.items()}
    out["learner_gap_buckets"] = {k: [n, round(t / 1e6, 4)] for k, (n, t) in buckets.items()}
    out["learner_largest_gaps"] = [d for _, d in largest[:16]]
    return out


class GpuBusy:
    """``nvidia-smi``'s utilisation of this process's card 0 (the first of
    ``CUDA_VISIBLE_DEVICES``: nvidia-smi counts every card of the host), sampled every 100 ms
    between start and stop."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling."""
        card = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
               "-i", card, "-lms", "100"]  # fmt: skip
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


def card_timeline(
    spans: list[tuple[float, float, int]], wall_s: float, bucket_ms: float = 10.0
) -> dict[str, Any]:
    """The card's busy share per ``bucket_ms`` (all streams, and the two busiest apart) and
    its idle gaps, from kernel spans ``(start_us, end_us, stream)`` relative to the trace start.

    ``idle_by_gap``: idle time (s) by gap length; ``idle_gaps``: ``[start_ms, ms]`` of every
    gap over 2 ms. Tells whether the card idles in a few long holes (the loop waiting) or
    in many short ones (launches).
    """
    n = max(int(wall_s * 1e3 / bucket_ms) + 1, 1)
    width = bucket_ms * 1e3

    def per_bucket(merged: list[tuple[float, float]]) -> list[int]:
        got = [0.0] * n
        for a, b in merged:
            i = int(a // width)
            while i < n and a < b:
                edge = min(b, (i + 1) * width)
                got[i] += edge - a
                a, i = edge, i + 1
        return [round(100 * g / width) for g in got]

    by_stream: dict[int, list[tuple[float, float]]] = {}
    for a, b, s in spans:
        by_stream.setdefault(s, []).append((a, b))
    merged = {s: _merge(v) for s, v in by_stream.items()}
    top = sorted(merged, key=lambda s: -sum(b - a for a, b in merged[s]))[:2]
    every = _merge([(a, b) for a, b, _ in spans])
    buckets = {"<0.1ms": 0.0, "0.1-1ms": 0.0, "1-10ms": 0.0, "10-50ms": 0.0, ">50ms": 0.0}
    gaps: list[list[float]] = []
    prev = 0.0
    for a, b in every + [(wall_s * 1e6, wall_s * 1e6)]:
        gap = a - prev
        if gap > 0:
            key = ("<0.1ms" if gap < 100 else "0.1-1ms" if gap < 1e3 else "1-10ms" if gap < 1e4
                   else "10-50ms" if gap < 5e4 else ">50ms")  # fmt: skip
            buckets[key] += gap / 1e6
            if gap > 2e3:
                gaps.append([round(prev / 1e3, 1), round(gap / 1e3, 1)])
        prev = max(prev, b)
    return {
        "bucket_ms": bucket_ms,
        "busy_pct": per_bucket(every),
        "streams": {str(s): per_bucket(merged[s]) for s in top},
        "idle_by_gap": {k: round(v, 4) for k, v in buckets.items()},
        "idle_gaps": gaps,
    }
