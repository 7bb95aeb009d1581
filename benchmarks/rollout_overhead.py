"""Rollout engine overhead per turn: 1,024 concurrent episodes against an instant client.

The client answers every request at once with a fixed reply, and the env is a trivial async
multi-turn env, so what is timed is the engine itself: scheduling, append-only tokenisation of
observations, bookkeeping, and building trajectories. Run with ``taskset -c 0`` for one core.

    python benchmarks/rollout_overhead.py [--episodes 1024] [--turns 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time

from agentrl.env import Env, StepResult
from agentrl.inference.base import GenerateOutput, SamplingParams
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.tiny import build_tiny_tokenizer
from agentrl.types import Message, Task


class InstantClient:
    """Answers every request immediately with ``reply`` + the stop token."""

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
        self.calls = 0

    async def generate(self, input_ids, params: SamplingParams, *, rid=None, session_id=None):
        self.calls += 1
        n = len(self.reply)
        return GenerateOutput(
            rid=rid or "",
            output_ids=list(self.reply),
            logprobs=[-0.1] * n,
            versions=[0] * n,
            finish_reason="stop",
            weight_version=0,
            prompt_tokens=len(input_ids),
        )

    async def abort(self, rid=None) -> None: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None: ...

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None: ...


class CountdownEnv(Env):
    """Ends after ``turns`` steps; replies with a short observation each turn."""

    def __init__(self, turns: int) -> None:
        self.turns, self.t = turns, 0

    async def reset(self, task, *, seed=None):
        self.t = 0
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action):
        self.t += 1
        if self.t >= self.turns:
            return StepResult(reward=1.0, terminated=True)
        return StepResult([Message(role="tool", content="ok")])


async def one_run(episodes: int, turns: int) -> tuple[float, int]:
    tok = build_tiny_tokenizer()
    client = InstantClient(tok.encode("42", add_special_tokens=False) + [tok.eos_token_id])
    cfg = RolloutConfig(
        group_size=8, max_turns=turns + 1, concurrency=episodes, max_total_tokens=4096
    )
    engine = RolloutEngine(client, tok, cfg)
    tasks = [Task(id=f"t{i}", prompt="go") for i in range(episodes // cfg.group_size)]
    t = time.perf_counter()
    groups = await engine.run_groups(lambda: CountdownEnv(turns), tasks)
    dt = time.perf_counter() - t
    assert sum(len(g.trajectories) for g in groups) == episodes
    return dt, client.calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(one_run(64, args.turns))  # warm-up (imports, template compilation)
    runs = [asyncio.run(one_run(args.episodes, args.turns)) for _ in range(args.repeats)]
    per_turn = [dt / calls for dt, calls in runs]
    med = statistics.median(per_turn)
    print(f"{'episodes':>10} {'turns':>7} {'median s':>10} {'turns/s':>10} {'us/turn':>9}")
    for dt, calls in runs:
        print(
            f"{args.episodes:>10} {calls:>7} {dt:>10.3f} {calls / dt:>10.0f} "
            f"{dt / calls * 1e6:>9.1f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "rollout_overhead",
                "episodes": args.episodes,
                "turns_per_s": round(1 / med),
                "overhead_us_per_turn": round(med * 1e6, 1),
                "machine": platform.processor() or platform.machine(),
                "device": "cpu",
            }
        )
    )


if __name__ == "__main__":
    main()
