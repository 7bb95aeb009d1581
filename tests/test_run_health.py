"""Loud failures: a failing env stops the run with its traceback; no-signal steps warn; the
failed, timed-out and zero-signal episodes reach ``trajectories.jsonl``; cut turns truncate."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import torch

from agentrl import Env, Message, StepResult, Task, register
from agentrl.config import load_config
from agentrl.errors import TrainingError
from agentrl.inference.engine import LocalEngine
from agentrl.loop.trainer import Trainer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine


class _Base(Env):
    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        return [Message(role="user", content=task.prompt)], {}

    @classmethod
    def sample_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        return [Task(id=f"{split}-{i}", prompt=f"say {i}", answer=str(i)) for i in range(n)]


class Broken(_Base):
    sees_cut_turns = True

    async def step(self, action: str) -> StepResult:
        raise ValueError("boom in the env's step")


class Flat(_Base):
    sees_cut_turns = True

    async def step(self, action: str) -> StepResult:
        return StepResult(reward=0.0, terminated=True)


class Counting(_Base):
    steps = 0

    async def step(self, action: str) -> StepResult:
        Counting.steps += 1
        return StepResult(reward=1.0, terminated=True)


register("health-broken-v0", Broken)
register("health-flat-v0", Flat)
register("health-counting-v0", Counting)


def run_config(tmp_path: Path, env_id: str, **train: int) -> dict:
    return {
        "run_dir": str(tmp_path / "run"),
        "env": {"id": env_id, "num_train_tasks": 8, "num_eval_tasks": 2},
        "rollout": {"group_size": 2, "max_turns": 1, "max_new_tokens": 3, "max_total_tokens": 48},
        "learner": {"num_minibatches": 1},
        "train": {"steps": 6, "tasks_per_step": 2, "eval_every": 0, "max_staleness": 0, **train},
    }


def records(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "trajectories.jsonl").read_text().splitlines()]


def test_a_failing_env_stops_the_run_with_its_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config(run_config(tmp_path, "health-broken-v0", max_failed_steps=2))
    trainer = Trainer(config)
    with caplog.at_level(logging.ERROR), pytest.raises(TrainingError) as info:
        asyncio.run(trainer.run())
    message = str(info.value)
    first_line = message.splitlines()[0]
    assert first_line.startswith("stopping at step 2: more than train.max_failed_frac=0.5")
    assert first_line.endswith(  # one line says why, and what failed first
        "The first failure: ValueError: boom in the env's step (task train-4, env health-broken-v0)"
    )
    assert "Traceback (most recent call last)" in message
    assert 'raise ValueError("boom in the env\'s step")' in message
    assert "ValueError: boom in the env's step" in message
    # printed once, as soon as it happened
    firsts = [r for r in caplog.records if "first failure of this run" in r.getMessage()]
    assert len(firsts) == 1 and "boom" in firsts[0].getMessage()
    recs = records(trainer.run_dir)
    assert {r["kind"] for r in recs} == {"failed"} and {r["step"] for r in recs} == {1, 2}
    assert all(r["trajectory"]["error"].startswith("ValueError: boom") for r in recs)


def test_zero_signal_steps_warn_and_are_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(load_config(run_config(tmp_path, "health-flat-v0", steps=2)))
    with caplog.at_level(logging.WARNING):
        asyncio.run(trainer.run())
    warned = [r for r in caplog.records if "no learning signal" in r.getMessage()]
    assert [r.getMessage().split(":")[0] for r in warned] == ["step 1"]  # once, then counted
    assert trainer.health.warnings == {"no_learning_signal": 2}
    recs = records(trainer.run_dir)
    assert len(recs) == 4 and {r["kind"] for r in recs} == {"zero_signal"}  # 2 groups x 2 steps
    metrics = [
        json.loads(ln) for ln in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["rollout/zero_signal_groups"] for m in metrics if "rollout/episodes" in m] == [2, 2]


async def test_a_cut_turn_truncates_unless_the_env_sees_it() -> None:
    engine = LocalEngine.from_pretrained("tiny")
    tasks = Counting.sample_tasks(3)
    try:
        cfg = RolloutConfig(group_size=2, max_turns=1, max_new_tokens=2, seed=3)
        groups = await RolloutEngine(engine, engine.tokenizer, cfg).run_groups(Counting, tasks)
        trajs = [t for g in groups for t in g.trajectories]
        cut = [t for t in trajs if t.finish_reason == "max_new_tokens"]
        assert cut, "the untrained tiny model should run out of its 2 tokens"
        assert all(t.truncated and not t.terminated and t.reward == 0.0 for t in cut)
        assert Counting.steps == len(trajs) - len(cut)  # a cut turn never reached step()
        Counting.steps = 0
        Counting.sees_cut_turns = True
        groups = await RolloutEngine(engine, engine.tokenizer, cfg).run_groups(Counting, tasks)
        assert Counting.steps == 6
        assert all(t.terminated and t.reward == 1.0 for g in groups for t in g.trajectories)
    finally:
        Counting.sees_cut_turns = False
        await engine.aclose()


def test_records_keep_text_with_lone_surrogates(tmp_path: Path) -> None:
    """An env's text may hold a lone surrogate: its record is still written, and reads back."""
    from agentrl.loop.health import write_records
    from agentrl.types import Trajectory

    traj = Trajectory(
        task_id="t",
        env_id="e",
        messages=[
            Message(role="user", content="bad \ud800 byte"),
            Message(role="assistant", content="é"),
        ],
        prompt_len=1,
        tokens=[5, 6, 7],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.25, -1.5],
        versions=[-1, 0, 0],
    )
    path = tmp_path / "trajectories.jsonl"
    write_records(path, 3, [(traj, torch.tensor([0.0, 0.1234567, -2.0]))], [], [("failed", traj)])
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["advantages"] == [0.0, 0.123457, -2.0] and first["trainer_logprobs"] is None
    assert first["trajectory"]["messages"][0]["content"] == "bad \ud800 byte"
    assert Trajectory.model_validate(first["trajectory"]) == traj
    assert second["kind"] == "failed" and second["advantages"] == [0.0, 0.0, 0.0]
