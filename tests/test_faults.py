"""Faults and bad input (issue 20): bad envs, hanging envs, duplicate tasks, the rollout CLI.

Real parts throughout: the embedded tiny engine, `agentrl serve` subprocesses on loopback.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from agentrl.env import Env, StepResult, SyncEnv, register
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.inference.engine import LocalEngine
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, rollout_metrics
from agentrl.tiny import build_tiny_tokenizer
from agentrl.types import Message, Task


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine.from_pretrained("tiny")
    yield eng
    asyncio.run(eng.aclose())


def config(**kw) -> RolloutConfig:
    base = dict(group_size=2, max_turns=2, max_new_tokens=4, max_total_tokens=128, seed=1)
    return RolloutConfig(**{**base, **kw})


class Misbehaving(Env):
    """Returns garbage, raises or hangs, by task id; everything else is a well-behaved env."""

    sees_cut_turns = True  # every turn reaches step(), also one cut by max_new_tokens

    def __init__(self) -> None:
        self.task: Task | None = None

    async def reset(self, task, *, seed=None):
        self.task = task
        if task.id == "reset-garbage":
            return "hello"
        if task.id == "reset-hangs":
            await asyncio.sleep(3600)
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action):
        kind = self.task.id
        if kind == "str-observation":
            return StepResult("a string")
        if kind == "content-not-str":
            return StepResult([Message.model_construct(role="user", content=5)])
        if kind == "dict-observation":
            return StepResult([{"role": "robot", "content": "x"}])
        if kind == "reward-none":
            return StepResult(reward=None, terminated=True)
        if kind == "reward-nan":
            return StepResult(reward=math.nan, terminated=True)
        if kind == "info-not-json":
            return StepResult(reward=1.0, terminated=True, info={"obj": object()})
        if kind == "not-a-result":
            return {"reward": 1.0}
        if kind == "raises":
            raise RuntimeError("boom")
        if kind == "step-hangs":
            await asyncio.sleep(3600)
        return StepResult(
            [Message(role="user", content="again")], reward=1.0, terminated=kind != "two-turns"
        )

    async def close(self):
        if self.task is not None and self.task.id == "close-hangs":
            await asyncio.sleep(3600)


class SlowSync(SyncEnv):
    """A synchronous env whose step blocks its worker thread (bounded, so the test can end)."""

    sees_cut_turns = True

    def reset_sync(self, task, *, seed=None):
        return [Message(role="user", content=task.prompt)], {}

    def step_sync(self, action):
        time.sleep(2.0)
        return StepResult(reward=1.0, terminated=True)


BAD = [
    "str-observation",
    "content-not-str",
    "dict-observation",
    "reward-none",
    "reward-nan",
    "info-not-json",
    "not-a-result",
    "reset-garbage",
]


async def test_malformed_env_returns_fail_only_their_episode(engine) -> None:
    tasks = [Task(id=k, prompt="p") for k in [*BAD, "ok", "two-turns", "raises"]]
    ro = RolloutEngine(engine, engine.tokenizer, config())
    groups = await ro.run_groups(Misbehaving, tasks)  # before: a ValidationError lost the batch
    by = {g.task.id: g.trajectories for g in groups}
    assert len(groups) == len(tasks)
    for kind in BAD:
        for t in by[kind]:
            assert t.failed and t.finish_reason == "error" and t.info["failure"] == "env", kind
            assert t.error.startswith("EnvError"), t.error
    assert (
        "reward" in by["reward-none"][0].error and "observation" in by["str-observation"][0].error
    )
    assert (
        by["raises"][0].error == "RuntimeError: boom" and by["raises"][0].info["failure"] == "env"
    )
    assert all(not t.failed and t.reward == 1.0 for t in by["ok"])
    assert all(not t.failed and t.finish_reason == "max_turns" for t in by["two-turns"])
    m = rollout_metrics(groups)
    assert m["rollout/failed"] == m["rollout/failed_env"] == 2 * (len(BAD) + 1)
    assert m["rollout/failed_timeout"] == m["rollout/failed_server"] == 0


async def test_env_calls_time_out_and_count_as_failed(engine) -> None:
    tasks = [Task(id=k, prompt="p") for k in ("step-hangs", "close-hangs", "reset-hangs", "ok")]
    ro = RolloutEngine(engine, engine.tokenizer, config(env_timeout_s=0.5))
    t0 = time.perf_counter()
    groups = await ro.run_groups(Misbehaving, tasks)  # before: close() hung forever
    assert time.perf_counter() - t0 < 30
    by = {g.task.id: g.trajectories for g in groups}
    for kind in ("step-hangs", "close-hangs", "reset-hangs"):
        for t in by[kind]:
            assert t.failed and t.finish_reason == "timeout" and t.info["failure"] == "timeout"
    assert "close()" in by["close-hangs"][0].error and "step()" in by["step-hangs"][0].error
    assert all(not t.failed for t in by["ok"])
    [sync] = await ro.run_groups(SlowSync, [Task(id="sync", prompt="p")])
    assert all(t.info["failure"] == "timeout" for t in sync.trajectories)
    m = rollout_metrics([*groups, sync])
    assert m["rollout/failed"] == m["rollout/failed_timeout"] == 8


async def test_episode_timeout_counts_as_failed(engine) -> None:
    ro = RolloutEngine(engine, engine.tokenizer, config(episode_timeout_s=0.5, env_timeout_s=None))
    [g] = await ro.run_groups(Misbehaving, [Task(id="step-hangs", prompt="p")])
    assert [t.finish_reason for t in g.trajectories] == ["timeout", "timeout"]
    assert all(t.truncated and t.failed for t in g.trajectories)  # before: error=None
    assert rollout_metrics([g])["rollout/failed_timeout"] == 2


async def test_same_task_in_flight_twice(tiny_server) -> None:
    # An overlapped step meeting the next epoch's shuffle, eval on training tasks, a task file
    # with repeated ids: the same (task, index, seed) twice at once, on one engine and on two.
    tasks = [Task(id="t0", prompt="p"), Task(id="t0", prompt="p")]
    async with SGLangClient(tiny_server.url) as client:
        tok = build_tiny_tokenizer()
        ro = RolloutEngine(client, tok, config(max_new_tokens=24, ignore_eos=True))
        other = RolloutEngine(client, tok, config(max_new_tokens=24, ignore_eos=True))
        runs = await asyncio.gather(
            ro.run_groups(Misbehaving, tasks),
            ro.run_groups(Misbehaving, tasks),
            other.run_groups(Misbehaving, tasks),
        )
    trajs = [t for groups in runs for g in groups for t in g.trajectories]
    assert len(trajs) == 12 and [t.error for t in trajs] == [None] * 12
    # same seed, same weights: the duplicates sampled the same tokens
    assert len({tuple(groups[0].trajectories[0].tokens) for groups in runs}) == 1


class _RegisteredMisbehaving(Misbehaving):
    @classmethod
    def sample_tasks(cls, n, *, seed=0, split="train"):
        return [Task(id="raises" if i % 4 == 0 else "ok", prompt="p") for i in range(n)]


register("test-faults-v0", _RegisteredMisbehaving)


def test_rollout_cli_exits_nonzero_over_max_failed_frac(tmp_path, capsys) -> None:
    from agentrl.cli import main

    base = ["rollout", "test-faults-v0", "--num-tasks", "8", "--max-turns", "1"]
    base += ["--group-size", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "out.jsonl")]
    assert main(base) == 1  # 2 of 8 failed; before: exit 0 unless every episode failed
    out = capsys.readouterr().out
    assert "failed" in out and "env" in out.split("failed", 1)[1]
    assert main([*base, "--max-failed-frac", "0.25"]) == 0
    assert main([*base, "--max-failed-frac", "0.2"]) == 1
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 24
