"""MCP tools' cost: server start, per-call latency vs a Python tool, and leaks over many episodes.

Times (CPU) what decides the lifecycle of ``agentrl.mcp_client``: starting the ``add`` stdio
server written with the ``mcp`` SDK (connect + list its tools) against one tool call through
it, and a call through ``add-mcp-v0`` against the same call through ``add-tool-v0`` (a Python
tool). Then runs many episodes with a share of failing calls and counts the server processes and
threads left after closing.

    python benchmarks/mcp_overhead.py [--calls 300] [--starts 3] [--episodes 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import threading
import time

from agentrl.env import ToolEnv, make
from agentrl.envs.add_mcp import server_command
from agentrl.envs.add_tool import AddToolEnv, tool_call_text
from agentrl.mcp_client import MCPConnection, MCPServerSpec, _child_pids, close_servers
from agentrl.types import Task

BAD = '<tool_call>{"name":"add","arguments":{"a":"x","b":1}}</tool_call>'


async def start_s(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn = MCPConnection(MCPServerSpec(command=tuple(server_command())))
        await conn.ready()
        out.append(time.perf_counter() - t0)
        await asyncio.to_thread(conn.close)
    return out


async def step_us(env: ToolEnv, task: Task, calls: int) -> list[float]:
    await env.reset(task)
    action = tool_call_text(task.data["a"], task.data["b"])
    await env.step(action)  # warm
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        r = await env.step(action)
        out.append((time.perf_counter() - t0) * 1e6)
        assert r.info["tool_errors"] == 0, r
    await env.close()
    return out


async def episodes(n: int, fail_every: int = 10, concurrency: int = 32) -> dict:
    tasks = AddToolEnv.sample_tasks(n, seed=1)
    errors = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, task: Task) -> int:
        async with sem:
            env = make("add-mcp-v0")
            try:
                await env.reset(task)
                bad = i % fail_every == 0
                r = await env.step(BAD if bad else tool_call_text(task.data["a"], task.data["b"]))
                await env.step(task.answer or "")
                return int(r.info["tool_errors"])
            finally:
                await env.close()

    t0 = time.perf_counter()
    for e in await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))):
        errors += e
    wall = time.perf_counter() - t0
    during = len(_child_pids())
    close_servers()
    return {"episodes": n, "tool_errors": errors, "wall_s": round(wall, 2),
            "servers_during": during, "children_after": len(_child_pids()),
            "mcp_threads_after": sum(t.name.startswith("mcp ") for t in threading.enumerate())}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=1000)
    args = ap.parse_args()
    task = AddToolEnv.sample_tasks(1)[0]
    starts = await start_s(args.starts)
    direct = await step_us(make("add-tool-v0"), task, args.calls)
    mcp = await step_us(make("add-mcp-v0"), task, args.calls)
    close_servers()
    leaks = await episodes(args.episodes)
    out = {
        "server_start_s": round(statistics.median(starts), 3),
        "direct_step_us": round(statistics.median(direct), 1),
        "mcp_step_us": round(statistics.median(mcp), 1),
        "mcp_overhead_us_per_call": round(statistics.median(mcp) - statistics.median(direct), 1),
        "start_over_call": round(statistics.median(starts) * 1e6 / statistics.median(mcp)),
        "leaks": leaks,
        "machine": platform.machine(),
    }
    print(f"stdio server start (connect + list tools): {out['server_start_s']} s (median of "
          f"{args.starts})")
    print(f"one add call, ToolEnv.step: Python tool {out['direct_step_us']} us, MCP stdio "
          f"{out['mcp_step_us']} us (median of {args.calls})")
    print(f"a server start costs {out['start_over_call']} MCP calls")
    print(f"{leaks['episodes']} episodes, {leaks['tool_errors']} failed calls: "
          f"{leaks['children_after']} processes and {leaks['mcp_threads_after']} MCP threads left")
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
