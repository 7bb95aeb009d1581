"""A served OpenEnv env's first episode must not stall the event loop while openenv-core imports.

The import takes 3-6 s (it pulls in gradio), more on a busy host. Done on the event loop, it
froze every other episode of the process, whose armed timers then expired: on a loaded 2-core
machine two of four episodes of ``agentrl rollout openenv:...`` failed their 10 s connect
timeout. A fresh interpreter (openenv not yet imported) opens one episode while a ticker runs on
the same loop; the loop's longest pause must be a small part of the episode's opening.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("openenv")

sys.path.insert(0, str(Path(__file__).parent))
from test_openenv import serve, write_env  # noqa: E402

PROBE = """
import asyncio, json, sys, time
from agentrl.env import make
from agentrl.types import Task

async def main(url):
    gaps, last, done = [], time.perf_counter(), False
    async def tick():
        nonlocal last
        while not done:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    ticker = asyncio.create_task(tick())
    env = make("openenv:" + url)
    t0 = time.perf_counter()
    await env.reset(Task(id="t", prompt="", data={"seed": 1}))
    opened = time.perf_counter() - t0
    await env.close()
    done = True
    await ticker
    print(json.dumps({"opened_s": opened, "max_gap_s": max(gaps)}))

assert "openenv" not in sys.modules
asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("openenv-loop")
    write_env(folder)
    url, proc = serve(folder)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_first_episode_keeps_the_event_loop_running(server: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, server], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the import alone is seconds; with it on the loop, the longest pause was all of it
    assert got["opened_s"] > 1.0, got
    assert got["max_gap_s"] < 0.3 * got["opened_s"], got
