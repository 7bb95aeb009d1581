"""Per-turn overhead of the env adapters (OpenEnv), without a model: the env's own cost is nil.

One section per adapter (``ADAPTERS``); each returns ``{"name": ..., "us_per_turn": ...}`` rows.

- ``openenv``: docs/envs.md's guessing env, stepped through ``OpenEnvEnv`` in this process
  (``openenv:guess_openenv:GuessEnvironment``) and served by openenv-core's own server on
  loopback (``openenv:http://...``, one WebSocket per episode), against the same env called
  directly; also the per-episode cost (session open + reset + close).

    python benchmarks/env_adapters.py [--quick] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


async def _episodes(env_id: str, n: int, turns: int, concurrency: int) -> tuple[float, float]:
    """(µs per turn, ms per episode open+reset+close) over n episodes of `turns` non-digit steps."""
    from agentrl.env import make
    from agentrl.types import Task

    sem = asyncio.Semaphore(concurrency)
    step_s = 0.0
    total_turns = 0

    async def one(i: int) -> None:
        nonlocal step_s, total_turns
        async with sem:
            env = make(env_id)
            try:
                await env.reset(Task(id=str(i), prompt="", data={"seed": i}))
                t0 = time.perf_counter()
                for _ in range(turns):  # "?" is never right: the episode goes on
                    await env.step("?")
                step_s += time.perf_counter() - t0
                total_turns += turns
            finally:
                await env.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t0
    return 1e6 * step_s / total_turns, 1e3 * (wall - step_s / concurrency) / n


def bench_openenv(quick: bool, concurrency: int) -> list[dict[str, Any]]:
    from test_openenv import serve, write_env

    n, turns = (32, 8) if quick else (256, 16)
    folder = Path(tempfile.mkdtemp(prefix="openenv-bench-"))
    write_env(folder)
    sys.path.insert(0, str(folder))
    import guess_openenv

    env = guess_openenv.GuessEnvironment()
    env.reset(seed=0)
    action = guess_openenv.GuessAction(guess="?")
    t0 = time.perf_counter()
    for _ in range(n * turns):
        env.step(action)
    direct = 1e6 * (time.perf_counter() - t0) / (n * turns)
    rows = [{"name": "openenv direct Environment.step", "us_per_turn": round(direct, 1)}]

    def run(env_id: str) -> tuple[float, float]:
        return asyncio.run(_episodes(env_id, n, turns, concurrency))

    run("openenv:guess_openenv:GuessEnvironment")  # warm: imports
    us, ms = run("openenv:guess_openenv:GuessEnvironment")
    rows.append(
        {"name": "openenv in-process", "us_per_turn": round(us, 1), "ms_per_episode": round(ms, 2)}
    )
    url, proc = serve(folder)
    try:
        run(f"openenv:{url}")  # warm: schema cache
        us, ms = run(f"openenv:{url}")
        rows.append(
            {
                "name": f"openenv served (WebSocket, {concurrency} at once)",
                "us_per_turn": round(us, 1),
                "ms_per_episode": round(ms, 2),
            }
        )
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return rows


ADAPTERS: dict[str, Callable[[bool, int], list[dict[str, Any]]]] = {"openenv": bench_openenv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few episodes (CI-sized)")
    ap.add_argument("--concurrency", type=int, default=16, help="episodes at once")
    ap.add_argument("--only", choices=sorted(ADAPTERS), help="one adapter")
    args = ap.parse_args()
    for name, bench in ADAPTERS.items():
        if args.only in (None, name):
            for row in bench(args.quick, args.concurrency):
                print(json.dumps(row))


if __name__ == "__main__":
    main()
