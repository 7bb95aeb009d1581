"""Partial rollouts and overlap on a long-tailed workload: synchronous vs overlapped training.

Workload: each episode's response length is drawn from a Pareto distribution (seeded by the
episode), ``min(20 x median, ceil(16 * Pareto(1.2)))`` tokens: median 29, mean 57, 3% of
episodes over 10x the median, capped at 20x (580). The model is made to produce exactly that
many tokens: sampling ignores EOS and :class:`WorkloadClient` gives each request what its
episode has left (resumed requests included), as if the policy stopped there by itself.
By default an episode is one turn; ``--turn-tokens 32 --tool-latency 0.1`` makes it agentic:
turns of 32 tokens, each followed by a 0.1 s tool call. Rewards depend on the sampled text, so
groups carry learning signal.

Serving: ``agentrl serve --model tiny`` in a subprocess (the embedded engine behind SGLang's
HTTP API; CUDA when available, else one CPU thread) with ``SGLangClient``; weights travel
through a safetensors directory (``update_weights_from_disk``), as in a deployment. The learner
trains in this process (the trainer builds it on the CPU; one thread), so generation and
training can overlap.

Runs, each for the same number of trained response tokens, repeated ``--rounds`` times:

- ``sync``: the synchronous trainer step (all G episodes of ``tasks_per_step`` tasks, then
  train, then push weights);
- ``overlap-k``: ``agentrl.loop.pipeline`` with ``max_staleness = k``, partial rollouts, a token
  budget per step equal to the expected tokens of ``tasks_per_step`` groups, and
  ``2 x tasks_per_step`` groups in flight. A step waits for the groups that would otherwise
  outlive the staleness bound (nothing is dropped), so at ``max_staleness=1`` a step can
  train more than its budget (every group started before the last weight update).

Each run trains ``--tokens`` (30k: ~17 synchronous steps). Much shorter runs favour a rule
that leaves stragglers running: the work spent on groups still in flight or buffered at the
end counts in the wall time but not in the trained tokens, and a short run trains the short
episodes first.

Reported: trained trajectories per minute, trained tokens per second, the server's idle share
(no request open) and mean open requests, the learner's idle share (wall time outside
``learner.step``), the mean trained episode length (against the workload's mean: a rule that
drops or restarts long episodes would show here), the groups trained at the last version the
staleness window allowed and the learner's wait for them, and the token staleness histogram.
The last line is one JSON object; ``speedup`` is the median over rounds of the last
``--staleness`` run's trained-token throughput over the sync run's of the same round (paired,
so that load drifts cancel).

Usage: ``python benchmarks/partial_rollouts.py [--rounds 2] [--staleness 1 4]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _serve import start_server, stop_server  # noqa: E402 - benchmarks/ is a folder of scripts

from agentrl.config import load_config  # noqa: E402
from agentrl.env import Env, StepResult, register  # noqa: E402
from agentrl.inference.base import GenerateOutput, SamplingParams  # noqa: E402
from agentrl.loop.pipeline import Pipeline, staleness_metrics  # noqa: E402
from agentrl.loop.trainer import Trainer  # noqa: E402
from agentrl.types import Message, Task  # noqa: E402

MIN_TOKENS = 16
ALPHA = 1.2
MEDIAN = math.ceil(MIN_TOKENS * 2 ** (1 / ALPHA))
MAX_TOKENS = 20 * MEDIAN


def response_length(seed: int) -> int:
    """The response length of the episode with sampling seed ``seed`` (a Pareto draw)."""
    x = random.Random(seed).paretovariate(ALPHA)
    return min(MAX_TOKENS, math.ceil(MIN_TOKENS * x))


def mean_length() -> float:
    return sum(response_length(i) for i in range(100_000)) / 100_000


class LongTailEnv(Env):
    """Ends once the episode's response length is sampled, in turns of ``turn_tokens``.

    Between turns the agent makes a tool call that takes ``latency`` seconds and returns
    nothing. The reward is the parity of the last turn's vowel count.
    """

    def __init__(self, turn_tokens: int = MAX_TOKENS, latency: float = 0.0) -> None:
        self.turn_tokens, self.latency = turn_tokens, latency

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        self.turns = math.ceil(response_length(seed or 0) / self.turn_tokens)
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action: str) -> StepResult:
        self.turns -= 1
        if self.turns == 0:
            vowels = sum(c in "aeiou" for c in action)
            return StepResult(reward=float(vowels % 2), terminated=True)
        await asyncio.sleep(self.latency)
        return StepResult()

    @classmethod
    def sample_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        """``n`` prompts (the episode's seed, not the task, decides its length)."""
        return [Task(id=f"{split}-{i}", prompt=f"Think about {i}.") for i in range(n)]


register("longtail-bench-v0", LongTailEnv)


class WorkloadClient:
    """Forwards to a client, stopping each episode at its length; measures occupancy.

    The rollout engine names an episode ``task#index@seed`` (``session_id``); each request may
    sample what the episode has left, as if the policy stopped there by itself.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sampled: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        self.open, self.area, self.idle = 0, 0.0, 0.0
        self.t = self.t0 = time.perf_counter()

    def _tick(self, delta: int) -> None:
        now = time.perf_counter()
        self.area += self.open * (now - self.t)
        self.idle += (now - self.t) if self.open == 0 else 0.0
        self.t, self.open = now, self.open + delta

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateOutput:
        """The inner client's ``generate`` for what the episode has left, counted."""
        assert session_id is not None  # the rollout engine names every episode
        seed = int(session_id.rsplit("@", 1)[1].split("~", 1)[0])  # <task>#<i>@<seed>~<attempt>
        left = response_length(seed) - self.sampled.get(session_id, 0)
        params = replace(params, max_new_tokens=min(params.max_new_tokens, left))
        self._tick(+1)
        try:
            out = await self.inner.generate(input_ids, params, rid=rid, session_id=session_id)
        finally:
            self._tick(-1)
        self.sampled[session_id] = self.sampled.get(session_id, 0) + len(out.output_ids)
        return out

    def report(self) -> tuple[float, float]:
        """(idle share, mean open requests) since ``reset``."""
        self._tick(0)
        wall = max(self.t - self.t0, 1e-9)
        return self.idle / wall, self.area / wall

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_trainer(url: str, run_dir: str, args: argparse.Namespace, staleness: int) -> Trainer:
    train: dict[str, Any] = {"steps": 10**6, "tasks_per_step": args.tasks, "eval_every": 0}
    train["max_staleness"] = staleness
    if staleness:
        expected = args.tasks * args.group * mean_length()
        train |= {"max_staleness": staleness, "tokens_per_step": int(expected)}
        train |= {"max_inflight_groups": args.inflight or 2 * args.tasks}
    cfg = {
        "run_dir": run_dir,
        "seed": 0,
        "env": {
            "id": "longtail-bench-v0",
            "kwargs": {"turn_tokens": args.turn_tokens, "latency": args.tool_latency},
            "num_train_tasks": 4096,
            "num_eval_tasks": 1,
        },
        "inference": {"endpoints": [url]},
        "rollout": {
            "group_size": args.group,
            "max_turns": math.ceil(MAX_TOKENS / args.turn_tokens),
            "max_new_tokens": args.turn_tokens,
            "max_total_tokens": 1000,
            "ignore_eos": True,
            "concurrency": 1024,
        },
        "learner": {"lr": 1e-5, "num_minibatches": 4, "micro_batch_tokens": 512},
        "train": train,
    }
    trainer = Trainer(load_config(cfg))
    trainer.rollout.client = WorkloadClient(trainer.client)
    return trainer


async def run_sync(trainer: Trainer, target_tokens: float) -> list[dict[str, float]]:
    await trainer.sync_weights()
    out: list[dict[str, float]] = []
    tokens = 0.0
    while tokens < target_tokens:
        m = await trainer.train_step()
        m["rollout/response_tokens"] = m["rollout/response_len_mean"] * m["rollout/episodes"]
        m.update(staleness_metrics([], trainer.step - 1, 0))  # (every token is on-policy)
        m["staleness/hist_0"] = 1.0
        tokens += m["rollout/response_tokens"]
        out.append(m)
    return out


async def run_overlapped(trainer: Trainer, target_tokens: float) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    tokens = 0.0
    async with aclosing(Pipeline(trainer).steps()) as steps:
        async for m in steps:
            tokens += m["rollout/response_tokens"]
            out.append(m)
            if tokens >= target_tokens:
                break
    return out


async def measure(url: str, args: argparse.Namespace, staleness: int, target: float) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = make_trainer(url, run_dir, args, staleness)
        busy: WorkloadClient = trainer.rollout.client  # type: ignore[assignment]
        busy.reset()
        t0 = time.perf_counter()
        if staleness:
            steps = await run_overlapped(trainer, target)
        else:
            steps = await run_sync(trainer, target)
        wall = time.perf_counter() - t0
        idle, mean_open = busy.report()
        await trainer.client.aclose()
    tokens = sum(m["rollout/response_tokens"] for m in steps)
    hist: dict[int, float] = {}
    for m in steps:
        for key, frac in m.items():
            if key.startswith("staleness/hist_"):
                s = int(key.rsplit("_", 1)[1])
                hist[s] = hist.get(s, 0.0) + frac * m["rollout/response_tokens"] / tokens
    train_s = sum(m["time/train_s"] for m in steps)
    return {
        "mode": f"overlap-{staleness}" if staleness else "sync",
        "steps": len(steps),
        "trajectories": int(sum(m["rollout/episodes"] for m in steps)),
        "tokens": int(tokens),
        "wall_s": wall,
        "traj_per_min": sum(m["rollout/episodes"] for m in steps) / wall * 60,
        "tokens_per_s": tokens / wall,
        "server_idle": idle,
        "server_mean_open": mean_open,
        "learner_idle": 1 - train_s / wall,
        "due_groups": int(sum(m.get("staleness/due_groups", 0) for m in steps)),
        "due_wait_s": sum(m.get("pipeline/due_wait_s", 0.0) for m in steps),
        "resumed_episodes": int(sum(m.get("staleness/resumed_episodes", 0) for m in steps)),
        "hist": {str(k): round(v, 4) for k, v in sorted(hist.items())},
    }


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


def pooled(runs: list[dict]) -> dict:
    """One row for a mode: throughputs over all its runs, token-weighted histogram."""
    wall, tokens = sum(r["wall_s"] for r in runs), sum(r["tokens"] for r in runs)
    hist: dict[str, float] = {}
    for r in runs:
        for s, frac in r["hist"].items():
            hist[s] = hist.get(s, 0.0) + frac * r["tokens"] / tokens
    return {
        "mode": runs[0]["mode"],
        "steps": sum(r["steps"] for r in runs),
        "trajectories": sum(r["trajectories"] for r in runs),
        "tokens": tokens,
        "wall_s": wall,
        "traj_per_min": sum(r["trajectories"] for r in runs) / wall * 60,
        "tokens_per_s": tokens / wall,
        "server_idle": sum(r["server_idle"] * r["wall_s"] for r in runs) / wall,
        "server_mean_open": sum(r["server_mean_open"] * r["wall_s"] for r in runs) / wall,
        "learner_idle": sum(r["learner_idle"] * r["wall_s"] for r in runs) / wall,
        "mean_len": tokens / sum(r["trajectories"] for r in runs),
        "due_groups": sum(r["due_groups"] for r in runs),
        "due_wait_s": sum(r["due_wait_s"] for r in runs),
        "hist": {s: round(v, 4) for s, v in hist.items()},
    }


async def main(args: argparse.Namespace) -> None:
    proc, url = start_server(
        ["--model", "tiny", "--torch-threads", "1", "--weights-dir", tempfile.gettempdir()],
        Path(tempfile.mkdtemp(prefix="partial_rollouts_")) / "serve.log",
        120.0,
        env={"OMP_NUM_THREADS": "1"},
    )
    load = [os.getloadavg()[0]]
    runs: dict[str, list[dict]] = {}
    ratios: dict[str, list[float]] = {}
    try:
        for _ in range(args.rounds):  # sync and overlapped back to back: load drifts cancel
            sync = await measure(url, args, 0, args.tokens)
            runs.setdefault("sync", []).append(sync)
            for k in args.staleness:
                r = await measure(url, args, k, sync["tokens"])
                runs.setdefault(r["mode"], []).append(r)
                ratios.setdefault(r["mode"], []).append(r["tokens_per_s"] / sync["tokens_per_s"])
            load.append(os.getloadavg()[0])
    finally:
        stop_server(proc, 30.0)
    rows = [pooled(mode_runs) for mode_runs in runs.values()]
    print(
        f"{'mode':<11} {'steps':>5} {'traj':>5} {'tokens':>7} {'wall s':>7} {'traj/min':>9} "
        f"{'tok/s':>7} {'srv idle':>8} {'srv open':>8} {'lrn idle':>8} {'mean len':>8} "
        f"{'due':>4} {'due wait':>8}  staleness"
    )
    for r in rows:
        print(
            f"{r['mode']:<11} {r['steps']:>5} {r['trajectories']:>5} {r['tokens']:>7} "
            f"{r['wall_s']:>7.1f} {r['traj_per_min']:>9.0f} {r['tokens_per_s']:>7.0f} "
            f"{r['server_idle']:>8.1%} {r['server_mean_open']:>8.1f} {r['learner_idle']:>8.1%} "
            f"{r['mean_len']:>8.1f} {r['due_groups']:>4} {r['due_wait_s']:>8.1f}  {r['hist']}"
        )
    speedups = {mode: round(statistics.median(v), 3) for mode, v in ratios.items()}
    headline = f"overlap-{args.staleness[-1]}"
    summary = {
        "benchmark": "partial_rollouts",
        "speedup": speedups[headline],
        "speedup_of": headline,
        "speedup_by_mode": speedups,
        "traj_per_min": {r["mode"]: round(r["traj_per_min"], 1) for r in rows},
        "tokens_per_s": {r["mode"]: round(r["tokens_per_s"], 1) for r in rows},
        "server_idle": {r["mode"]: round(r["server_idle"], 3) for r in rows},
        "learner_idle": {r["mode"]: round(r["learner_idle"], 3) for r in rows},
        "mean_len": {r["mode"]: round(r["mean_len"], 1) for r in rows},
        "due_groups": {r["mode"]: r["due_groups"] for r in rows},
        "due_wait_s": {r["mode"]: round(r["due_wait_s"], 2) for r in rows},
        "staleness_hist": {r["mode"]: r["hist"] for r in rows},
        "workload": {
            "turn_tokens": args.turn_tokens,
            "tool_latency_s": args.tool_latency,
            "response_tokens": {
                "median": MEDIAN,
                "mean": round(mean_length(), 1),
                "max": MAX_TOKENS,
            },
            "tasks_per_step": args.tasks,
            "group_size": args.group,
            "inflight_groups": args.inflight or 2 * args.tasks,
            "tokens_per_run": args.tokens,
            "rounds": args.rounds,
        },
        "server": "agentrl serve --model tiny (subprocess, HTTP); learner in process, CPU",
        "loadavg_1min": [round(x, 2) for x in load],
        "machine": machine(),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=8, help="tasks per step")
    parser.add_argument("--group", type=int, default=4, help="episodes per task (G)")
    parser.add_argument(
        "--turn-tokens", type=int, default=MAX_TOKENS, help="tokens per turn (default: one turn)"
    )
    parser.add_argument("--tool-latency", type=float, default=0.0, help="seconds per tool call")
    parser.add_argument("--inflight", type=int, default=0, help="groups in flight (0: 2 x tasks)")
    parser.add_argument("--rounds", type=int, default=2, help="sync/overlapped repetitions")
    parser.add_argument("--tokens", type=float, default=30000, help="trained tokens per run")
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 4])
    torch.set_num_threads(1)
    asyncio.run(main(parser.parse_args()))
