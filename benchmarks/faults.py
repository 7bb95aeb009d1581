"""Fault scenarios replayed end to end: nothing lost, nothing duplicated, nothing hung (issue 20).

Real parts only: ``agentrl serve --model tiny`` subprocesses on loopback, real SIGKILL / SIGSTOP,
real ``agentrl train`` subprocesses killed and resumed. Per scenario it prints the units
expected (episodes, or logged training steps), written, duplicated, lost, failed by cause, and
whether it hung; the last line is JSON ``{"scenarios", "lost", "duplicated", "hung",
"server_5xx", "unauth_accepted", "forged_rewards", "max_rss_growth_mb", ...}``.

    python benchmarks/faults.py [--tasks 16] [--group-size 4] [--only envs,hostile,...]

Groups (``--only``, default all): ``envs`` (misbehaving envs), ``server_faults`` (servers
killed, frozen, restarted), ``hostile`` (issue 43's hostile requests against a keyed server:
``_faults_server.py``), ``resume`` (``agentrl train`` killed at each phase and resumed),
``runs`` (kills at ``--seeds`` seeded instants of a log cut and of a checkpoint write, eight
checkpoint corruptions resumed, envs that block: ``_faults_runs.py``), ``verifier`` (forged
programs against the code verifier: ``_code_bench.py``).

Failed episodes are written (as error records), so they are not lost: a scenario loses an
episode only if no record of it reaches the JSONL file.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _code_bench import forged_rewards
from _faults_runs import resume_scenarios, run_scenarios, train_reference
from _faults_server import hostile_scenarios, hostile_table

from agentrl.env import Env, StepResult, make
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.rollout.engine import JsonlSink, RolloutConfig, RolloutEngine
from agentrl.tiny import build_tiny_tokenizer

HANG_S = 240.0  # a scenario still running after this has hung


class Server:
    """One ``agentrl serve --model tiny`` subprocess on a loopback port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--model", "tiny"]
        cmd += ["--port", str(self.port), "--torch-threads", "1", "--log-level", "ERROR"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def wait_ready(self, timeout_s: float = 120.0) -> Server:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"{self.url} never became healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Faulty(Env):
    """``arith-v0``, except that every ``every``-th task misbehaves in the way ``mode`` names."""

    def __init__(self, mode: str, every: int = 4) -> None:
        self.inner, self.mode, self.every, self.bad = make("arith-v0"), mode, every, False

    async def reset(self, task, *, seed=None):
        self.bad = int(task.id.rsplit("-", 1)[1]) % self.every == 0
        return await self.inner.reset(task, seed=seed)

    async def step(self, action):
        if self.bad and self.mode == "raise":
            raise RuntimeError("env bug")
        if self.bad and self.mode == "garbage":
            return StepResult("not a list of messages", reward=None)  # type: ignore[arg-type]
        if self.bad and self.mode == "hang_step":
            await asyncio.sleep(1e6)
        return await self.inner.step(action)

    async def close(self):
        if self.bad and self.mode == "hang_close":
            await asyncio.sleep(1e6)
        await self.inner.close()


def count(path: Path, expected: set[tuple[str, int]]) -> dict[str, Any]:
    """Written / duplicated / lost episodes and failures by cause, from the JSONL file."""
    seen: collections.Counter[tuple[str, int]] = collections.Counter()
    causes: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        t = json.loads(line)["trajectory"]
        seen[t["task_id"], t["group_index"]] += 1
        if t["error"] is not None:
            causes[t["info"].get("failure", "other")] += 1
    return {
        "expected": len(expected),
        "written": sum(seen.values()),
        "duplicated": sum(n - 1 for n in seen.values() if n > 1),
        "lost": len(expected - set(seen)),
        "failed": dict(causes),
    }


async def rollout_scenario(
    out: Path,
    endpoints: list[str],
    env_mode: str | None,
    args: argparse.Namespace,
    fault: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    generated = make("arith-v0").sample_tasks(args.tasks, seed=1)
    tasks = [t.model_copy(update={"id": f"t-{i}"}) for i, t in enumerate(generated)]
    cfg = RolloutConfig(
        group_size=args.group_size,
        max_turns=1,
        max_new_tokens=128,
        max_total_tokens=320,
        ignore_eos=True,
        env_timeout_s=2.0,
        episode_timeout_s=120.0,
    )
    client = SGLangClient(endpoints, retry_s=90.0, stall_s=3.0, health_timeout_s=3.0)
    sink = JsonlSink(out)
    engine = RolloutEngine(client, build_tiny_tokenizer(), cfg)

    async def run() -> None:
        job = asyncio.ensure_future(
            engine.run_groups(lambda: Faulty(env_mode or "none"), tasks, sink=sink)
        )
        if fault is not None:
            await fault()
            at_fault.append(len(out.read_text().splitlines()))
        await job

    hung = False
    at_fault: list[int] = []
    try:
        await asyncio.wait_for(run(), HANG_S)
    except TimeoutError:
        hung = True
    finally:
        sink.close()
        await client.aclose()
    expected = {(t.id, g) for t in tasks for g in range(args.group_size)}
    result = {**count(out, expected), "hung": hung}
    if at_fault:  # the fault hit mid-batch only if episodes were still running then
        result["failed"]["(done when fault hit)"] = at_fault[0]
    return result


def _after(delay_s: float, action: Callable[[], Any]) -> Callable[[], Awaitable[None]]:
    async def fault() -> None:
        await asyncio.sleep(delay_s)
        await asyncio.to_thread(action)

    return fault


async def server_scenarios(
    tmp: Path, args: argparse.Namespace, envs: bool = True, faults: bool = True
) -> dict[str, dict[str, Any]]:
    """Misbehaving envs (``envs``) and killed, frozen, restarted servers (``faults``)."""
    results: dict[str, dict[str, Any]] = {}
    a = Server()
    b = Server() if faults else a
    a.wait_ready(), b.wait_ready()
    try:
        for mode in ("raise", "garbage", "hang_step", "hang_close") if envs else ():
            results[f"env {mode}"] = await rollout_scenario(
                tmp / f"{mode}.jsonl", [a.url], mode, args
            )
        if not faults:
            return results
        results["server killed"] = await rollout_scenario(
            tmp / "killed.jsonl", [a.url, b.url], None, args, _after(1.0, b.stop)
        )
        b = Server()
        b.wait_ready()
        results["server frozen"] = await rollout_scenario(
            tmp / "frozen.jsonl",
            [a.url, b.url],
            None,
            args,
            _after(1.0, lambda: b.proc.send_signal(signal.SIGSTOP)),
        )
        b.stop()

        def restart() -> None:
            nonlocal a
            port = a.port
            a.stop()
            time.sleep(2.0)  # requests fail to connect meanwhile: the retry window holds them
            a = Server(port)

        results["server restarted"] = await rollout_scenario(
            tmp / "restarted.jsonl", [a.url], None, args, _after(1.0, restart)
        )
    finally:
        a.stop()
        b.stop()
    return results


GROUPS = ("envs", "server_faults", "hostile", "resume", "runs", "verifier")


def run_groups(only: list[str], tmp: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The scenarios of the groups in ``only`` (see the module docstring)."""
    results: dict[str, dict[str, Any]] = {}
    if "envs" in only or "server_faults" in only:
        results |= asyncio.run(
            server_scenarios(tmp, args, envs="envs" in only, faults="server_faults" in only)
        )
    if "hostile" in only:
        results |= asyncio.run(hostile_scenarios(tmp))
    if "resume" in only or "runs" in only:
        reference = train_reference(tmp)
        if "resume" in only:
            results |= resume_scenarios(tmp, reference)
        if "runs" in only:
            results |= run_scenarios(tmp, reference, seeds=args.seeds)
    if "verifier" in only:
        forged = forged_rewards("auto")
        results["forged code-verifier programs"] = {
            "expected": forged["forgeries"], "written": forged["forgeries"], "duplicated": 0,
            "lost": 0, "failed": {f"paid {k}": 1 for k in forged["paid"]}, "hung": False,
            "forged_rewards": forged["forged_rewards"],
        }  # fmt: skip
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)}")
    p.add_argument("--skip-resume", action="store_true", help="same as leaving resume out")
    p.add_argument("--seeds", type=int, default=20, help="kill instants per write (runs group)")
    args = p.parse_args()
    only = [g.strip() for g in args.only.split(",") if g.strip()]
    if unknown := sorted(set(only) - set(GROUPS)):
        p.error(f"--only: unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    only = [g for g in only if not (args.skip_resume and g == "resume")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agentrl-faults-") as tmp:
        results = run_groups(only, Path(tmp), args)
    print(f"{'scenario':<46} {'expected':>8} {'written':>8} {'dup':>4} {'lost':>4}  hung  failed")
    for name, r in results.items():
        failed = ", ".join(f"{k} {v}" for k, v in sorted(r["failed"].items())) or "-"
        print(f"{name:<46} {r['expected']:>8} {r['written']:>8} {r['duplicated']:>4} "
              f"{r['lost']:>4}  {'yes' if r['hung'] else 'no':<4}  {failed}")  # fmt: skip
    if "hostile" in only:
        print("\n".join(["", *hostile_table(results), ""]))
    rows = [q for r in results.values() for q in r.get("requests", [])]
    summary = {
        "scenarios": len(results),
        "groups": only,
        "lost": sum(r["lost"] for r in results.values()),
        "duplicated": sum(r["duplicated"] for r in results.values()),
        "hung": sum(bool(r["hung"]) for r in results.values()),
        "server_5xx": sum(r.get("server_5xx", 0) for r in results.values()),
        "unauth_accepted": sum(r.get("unauth_accepted", 0) for r in results.values()),
        "forged_rewards": sum(r.get("forged_rewards", 0) for r in results.values()),
        "max_rss_growth_mb": max(
            (r.get("rss_growth_mb", 0.0) for r in results.values()), default=0.0
        ),  # fmt: skip
        "hostile_requests": len(rows),
        "hostile_unexpected": sum(bool(q["faults"]) for q in rows),
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": f"{platform.machine()} {os.cpu_count()} cores (CPU, loopback)",
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
