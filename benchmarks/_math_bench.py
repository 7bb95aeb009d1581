"""Math verifier: checks per second on 2 worker processes, and how much it blocks the event loop.

1. Throughput: checks per second by kind (integers compared in the caller; fractions and
   decimals; symbolic: polynomials, intervals, sets; pathological: ``9^{9^{9}}`` with a 1 s limit)
   and for a mix, issued from as many threads as workers. Inputs are randomised so sympy's caches
   do not flatter the figures.
2. Event-loop share during a rollout-sized batch (256 ``verify_async`` calls): CPU time of the
   loop's thread over wall time (what the loop spent running code), and the worst lag of a
   ticker task that sleeps 5 ms at a time. Reported beside an idle loop (the ticker alone) and a
   naive baseline that calls math-verify on the loop.

    python benchmarks/_math_bench.py     # table, then one JSON line
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from agentrl.verifiers.math import start_pool, verify, verify_async

WORKERS = 2
Case = tuple[str, str, float]  # response, reference, timeout_s


def _integer(rng: random.Random) -> Case:
    a = rng.randint(10, 10**6)
    return f"so \\boxed{{{a}}}", str(a if rng.random() < 0.7 else a + 1), 5.0


def _numeric(rng: random.Random) -> Case:
    a, b = rng.randint(1, 99), rng.randint(2, 64)
    answer = rng.choice([f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"{a / b:.6f}"])
    return f"\\boxed{{{answer}}}", rng.choice([f"{a / b}", f"\\dfrac{{{a}}}{{{b}}}"]), 5.0


def _symbolic(rng: random.Random) -> Case:
    a, b = rng.randint(1, 30), rng.randint(1, 30)
    return rng.choice(
        [
            (f"\\boxed{{x^2+{2 * a}x+{a * a}}}", f"(x+{a})^2", 5.0),
            (f"\\boxed{{[{a}, {a + b})}}", f"[{a},{a + b})", 5.0),
            (f"\\boxed{{\\{{{a}, {b}, {a + b}\\}}}}", f"\\{{{a + b},{b},{a}\\}}", 5.0),
            (
                f"\\boxed{{\\frac{{\\sqrt{{{a * a * 2}}}}}{{{b}}}}}",
                f"\\frac{{{a}\\sqrt{{2}}}}{{{b}}}",
                5.0,
            ),
        ]
    )


def _pathological(rng: random.Random) -> Case:
    return f"\\boxed{{{rng.randint(7, 9)}^{{9^{{9}}}}}}", "1", 1.0


KINDS: dict[str, Callable[[random.Random], Case]] = {
    "integer": _integer,
    "numeric": _numeric,
    "symbolic": _symbolic,
    "pathological": _pathological,
}
MIX = {"integer": 0.3, "numeric": 0.4, "symbolic": 0.3}


def _cases(kind: str, n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    if kind == "mix":
        kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=n)
        return [KINDS[k](rng) for k in kinds]
    return [KINDS[kind](rng) for _ in range(n)]


def _throughput(cases: list[Case]) -> float:
    with ThreadPoolExecutor(WORKERS) as ex:
        t = time.perf_counter()
        list(ex.map(lambda c: verify(c[0], c[1], timeout_s=c[2]), cases))
        return len(cases) / (time.perf_counter() - t)


async def _blocked(work: Callable[[], Awaitable[object]]) -> tuple[float, float, float]:
    """(loop-thread CPU share of wall time, worst tick lag in ms, wall s) while ``work`` runs.

    CPU time of the loop's thread is what the loop spent running code; unlike tick lag it does
    not count time the OS gave other processes (the workers, on a machine with few cores).
    """
    lags: list[float] = []

    async def ticker() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    lags.clear()
    t, cpu = time.perf_counter(), time.thread_time()
    await work()
    wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
    tick.cancel()
    return cpu / wall, 1e3 * max(lags, default=0.0), wall


def _naive(response: str, reference: str) -> bool:
    from math_verify import parse
    from math_verify import verify as mv_verify

    return bool(mv_verify(parse(reference), parse(response)))


def _loop_figures(batch: list[Case]) -> dict[str, tuple[float, float, float]]:
    async def pooled() -> None:
        await asyncio.gather(*[verify_async(r, g, timeout_s=s) for r, g, s in batch])

    async def idle() -> None:
        await asyncio.sleep(1.0)

    async def naive() -> None:
        for r, g, _ in batch[:64]:  # on the loop: each check blocks it for its whole duration
            _naive(r, g)
            await asyncio.sleep(0)

    return {
        name: asyncio.run(_blocked(fn))
        for name, fn in [
            ("idle loop", idle),
            ("verify_async", pooled),
            ("math-verify on loop", naive),
        ]
    }


def _machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu}


def run() -> tuple[list[str], dict]:
    """Measure; return table rows and the headline figures."""
    start_pool(WORKERS)
    verify("\\boxed{x+1}", "1+x")  # warm both sides
    sizes = {"integer": 2000, "numeric": 120, "symbolic": 80, "pathological": 4, "mix": 200}
    rate = {k: _throughput(_cases(k, n, seed=i)) for i, (k, n) in enumerate(sizes.items())}
    loop = _loop_figures(_cases("mix", 256, seed=99))
    rows = [f"{'math verifier, ' + str(WORKERS) + ' workers':<38}{'checks/s':>12}"]
    rows += [f"  {k:<36}{v:>12.1f}" for k, v in rate.items()]
    rows.append(
        f"{'event loop during 256 checks':<38}{'loop CPU %':>12}{'worst ms':>10}{'wall s':>9}"
    )
    rows += [f"  {k:<36}{100 * b:>12.2f}{w:>10.1f}{s:>9.2f}" for k, (b, w, s) in loop.items()]
    figures = {
        "math_checks_per_s_mix": round(rate["mix"], 1),
        "math_checks_per_s": {k: round(v, 1) for k, v in rate.items()},
        "math_loop_share": round(loop["verify_async"][0], 4),
        "math_loop_share_idle": round(loop["idle loop"][0], 4),
        "math_loop_share_naive": round(loop["math-verify on loop"][0], 4),
        "math_loop_worst_lag_ms": round(loop["verify_async"][1], 1),
        "math_workers": WORKERS,
    }
    return rows, figures


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    table, heads = run()
    print("\n".join(table))
    print(json.dumps({**heads, "machine": _machine()}))
