"""Does one thread reading a CUDA tensor stall another thread's kernel launches?

Thread A queues ``--busy-ms`` of GPU work (``torch.cuda._sleep``) on a stream of its own or
on the default stream (where the embedded engine replays its graphs), then reads the result on
the host: the plain way (``.tolist()``: the wait happens inside a device-to-host copy into
pageable memory), with :func:`agentrl.kernels.transfer.to_host` (an event wait first), or
it uploads a pageable host tensor (``.to(device)``, as the engine's prefill did).
Meanwhile thread B, on another stream, launches ``--launches`` small kernels and times each
launch call. The six ways run ``--repeats`` times, interleaved, in one process; printed: the
median over repeats of B's total launch time and of its slowest launch.

It looks for the mechanism behind the overlapped loop's stalled launches (benchmarks/README.md):
there, each thread's launch calls were blocked up to ~17 ms while the other waited in a copy.

Usage: ``python benchmarks/launch_stall.py [--busy-ms 50] [--launches 2000] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from agentrl.kernels.transfer import to_host


def _cycles_per_ms() -> float:
    """GPU clock cycles a millisecond, measured with ``torch.cuda._sleep``."""
    torch.cuda._sleep(1_000_000)  # warm
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / start.elapsed_time(end)


def trial(way: str, busy_cycles: int, launches: int) -> dict[str, float]:
    """One read on thread A while thread B launches; B's launch times."""
    dev = torch.device("cuda")
    side = way.endswith("side stream")
    sa = torch.cuda.Stream() if side else torch.cuda.default_stream()
    sb = torch.cuda.Stream()
    x = torch.zeros(4096, device=dev)
    y = torch.zeros(1024, device=dev)
    started, times = threading.Event(), []

    def reader() -> None:
        with torch.cuda.stream(sa):
            torch.cuda._sleep(busy_cycles)
            z = x + 1
            started.set()
            if way.startswith("tolist"):
                z.tolist()
            elif way.startswith("to_host"):
                to_host(z).tolist()
            else:  # a pageable host-to-device copy queued behind the work, then its wait
                torch.tensor([1.0] * 4096).to(dev)

    def launcher() -> None:
        started.wait()
        time.sleep(0.002)  # the reader is inside its read now
        with torch.cuda.stream(sb):
            for _ in range(launches):
                t = time.perf_counter()
                y.add_(1.0)
                times.append(time.perf_counter() - t)

    threads = [threading.Thread(target=reader), threading.Thread(target=launcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    return {"total_ms": sum(times) * 1e3, "max_ms": max(times) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy-ms", type=float, default=50.0)
    ap.add_argument("--launches", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_stall.py needs a CUDA device")
    cycles = int(a.busy_ms * _cycles_per_ms())
    ways = [f"{read}, {where}" for where in ("side stream", "default stream")
            for read in ("tolist", "to_host", "pageable upload")]  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    for _ in range(a.repeats + 1):  # the first round warms up and is dropped
        for way in runs:
            runs[way].append(trial(way, cycles, a.launches))
    out: dict[str, object] = {"card": torch.cuda.get_device_name(), "busy_ms": a.busy_ms,
                              "launches": a.launches, "repeats": a.repeats}  # fmt: skip
    for way, rs in runs.items():
        rs = rs[1:]
        out[f"{way}_launch_total_ms"] = round(statistics.median(r["total_ms"] for r in rs), 2)
        out[f"{way}_launch_max_ms"] = round(statistics.median(r["max_ms"] for r in rs), 2)
        print(f"{way:24s}: B's {a.launches} launches took {out[f'{way}_launch_total_ms']} ms "
              f"(slowest {out[f'{way}_launch_max_ms']} ms) while A read after {a.busy_ms} ms "
              "of GPU work", flush=True)  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
