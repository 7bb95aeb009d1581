"""Code sandbox: start-up cost and sandboxed executions per second, with and without namespaces.

For each isolation level (``namespaces`` through bwrap when it works here, ``rlimits`` always):

1. Start-up: the median wall time of one trivial run (``pass``) done alone, and the same for a
   bare ``python -I -S -c pass`` subprocess; the sandbox's own cost is the difference. Also the
   CPU time per run (this process plus children), which a loaded machine inflates less.
2. Throughput on all cores (``max_concurrency`` = CPU count, runs issued through
   ``execute_async``): trivial programs per second, and 1-second programs (a CPU-bound loop that
   runs 1 s) per second; the ideal for the latter is one per core.

    python benchmarks/_code_bench.py     # table, then one JSON line
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable

from agentrl.errors import VerifierError
from agentrl.verifiers.sandbox import Isolation, Sandbox

TRIVIAL = "pass\n"
ONE_SECOND = (
    "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 1.0:\n    pass\n"
)


def _cost_ms(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """Median wall ms of ``fn`` run alone, and the CPU ms it used (this process and children)."""

    def cpu() -> float:
        me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    times, cpu0 = [], cpu()
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), 1000 * (cpu() - cpu0) / n


def _rate(box: Sandbox, code: str, n: int, timeout_s: float) -> float:
    async def go() -> float:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(box.execute_async(code, timeout_s=timeout_s) for _ in range(n))
        )
        bad = [r.status for r in results if r.status != "ok"]
        if bad:
            raise RuntimeError(f"benchmark runs failed: {bad[:3]}")
        return n / (time.perf_counter() - start)

    return asyncio.run(go())


def _level(level: Isolation, cores: int) -> dict[str, float] | None:
    box = Sandbox(isolation=level, max_concurrency=cores)
    try:
        _ = box.isolation
    except VerifierError:
        return None
    box.execute(TRIVIAL)  # warm the page cache
    wall_ms, cpu_ms = _cost_ms(lambda: box.execute(TRIVIAL), 30)
    out = {
        "startup_ms": wall_ms,
        "startup_cpu_ms": cpu_ms,
        "trivial_per_s": _rate(box, TRIVIAL, 60, 10.0),
        "one_second_per_s": _rate(box, ONE_SECOND, 2 * cores, 10.0),
    }
    box.close()
    return out


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run() -> tuple[list[str], dict]:
    """Measure; return table rows and the headline figures."""
    cores = os.cpu_count() or 1
    python = Sandbox().python
    bare = [python, "-I", "-S", "-c", "pass"]
    bare_ms, bare_cpu = _cost_ms(lambda: subprocess.run(bare, check=True), 30)
    levels: dict[Isolation, dict[str, float] | None] = {
        "namespaces": _level("namespaces", cores),
        "rlimits": _level("rlimits", cores),
    }
    head = f"{f'code sandbox, {cores} cores':<24}{'start ms':>10}{'CPU ms':>9}{'extra ms':>10}"
    rows = [head + f"{'trivial/s':>11}{'1-s prog/s':>11}"]
    rows.append(f"  {'bare python -I -S':<22}{bare_ms:>10.1f}{bare_cpu:>9.1f}{0.0:>10.1f}")
    figures: dict = {"code_bare_python_ms": round(bare_ms, 1), "code_cores": cores}
    for name, m in levels.items():
        if m is None:
            rows.append(f"  {name:<22}{'unavailable':>10}")
            continue
        extra = m["startup_ms"] - bare_ms
        rows.append(
            f"  {name:<22}{m['startup_ms']:>10.1f}{m['startup_cpu_ms']:>9.1f}{extra:>10.1f}"
            f"{m['trivial_per_s']:>11.1f}{m['one_second_per_s']:>11.2f}"
        )
        figures[f"code_startup_ms_{name}"] = round(m["startup_ms"], 1)
        figures[f"code_startup_cpu_ms_{name}"] = round(m["startup_cpu_ms"], 1)
        figures[f"code_overhead_ms_{name}"] = round(extra, 1)
        figures[f"code_trivial_per_s_{name}"] = round(m["trivial_per_s"], 1)
        figures[f"code_one_second_per_s_{name}"] = round(m["one_second_per_s"], 2)
    return rows, figures


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.ERROR)
    table, heads = run()
    print("\n".join(table))
    # the machine's load is part of the result: these figures are wall-clock rates
    machine = {"cpu": _cpu_name(), "cores": os.cpu_count(), "gpu": None}
    print(json.dumps({**heads, "machine": {**machine, "load_avg_1m": os.getloadavg()[0]}}))
