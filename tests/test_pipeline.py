"""The overlapped loop (``agentrl.loop.pipeline``) on the tiny model and the embedded engine."""

from __future__ import annotations

import asyncio
import json
import random
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.config import load_config
from agentrl.env import Env, StepResult
from agentrl.loop.pipeline import Pipeline, staleness_metrics
from agentrl.loop.trainer import Trainer
from agentrl.types import Group, Message, Task, Trajectory

TIMING = ("time", "time/", "perf/", "cold_start_s", "rollout/generate_s")


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def run_config(run_dir: Path, **train: Any) -> dict:
    return {
        "run_dir": str(run_dir),
        "seed": 3,
        "env": {
            "id": "arith-v0",
            "task_kwargs": {"digits": 1},
            "num_train_tasks": 256,
            "num_eval_tasks": 8,
        },
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "learner": {"lr": 1e-4, "num_minibatches": 2},
        "train": {"steps": 3, "tasks_per_step": 6, "eval_every": 2, **train},
    }


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(ln).items() if not k.startswith(TIMING)} for ln in lines]


def test_max_staleness_zero_is_the_synchronous_loop(tmp_path: Path) -> None:
    """``max_staleness=0`` (the default is 1) is the synchronous trainer, step for step."""
    assert load_config(run_config(tmp_path / "default")).train.max_staleness == 1
    asyncio.run(Trainer(load_config(run_config(tmp_path / "zero", max_staleness=0))).run())

    async def synchronous() -> list[dict[str, Any]]:
        """The synchronous trainer's schedule, driven through its step API."""
        trainer = Trainer(load_config(run_config(tmp_path / "hand", max_staleness=0)))
        try:
            await trainer.sync_weights()
            out = [{"step": 0, **await trainer.cold_start(), **await trainer.evaluate()}]
            for _ in range(3):
                metrics = await trainer.train_step()
                if trainer.step == 2:  # eval_every=2, and not at the last step
                    metrics.update(await trainer.evaluate())
                out.append({"step": trainer.step, **metrics})
            out.append({"step": trainer.step, **await trainer.evaluate()})
        finally:
            await trainer.client.aclose()
        return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in out]

    zero = records(tmp_path / "zero")
    assert [r["step"] for r in zero] == [0, 1, 2, 3, 3]
    assert zero == asyncio.run(synchronous())
    assert not any(k.startswith(("staleness/", "pipeline/")) for r in zero for k in r)


def test_overlapped_run_reports_staleness(tmp_path: Path) -> None:
    cfg = run_config(tmp_path, max_staleness=1)
    # fixed-length turns, scored: the untrained model's turns would otherwise all be cut by
    # max_new_tokens (truncated, reward 0), leaving no signal, no update and so no overlap
    cfg["rollout"]["ignore_eos"] = True
    summary = asyncio.run(Trainer(load_config(cfg)).run())
    assert summary["steps"] == 3
    steps = [r for r in records(tmp_path) if "rollout/episodes" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        # tasks_per_step complete groups of 4: admission keeps the due groups within it
        assert r["rollout/episodes"] == 24
        assert r["staleness/hist_0"] + r["staleness/hist_1"] == pytest.approx(1.0)
        assert r["staleness/max"] <= 1 and r["staleness/version_spread"] <= 1
        assert r["staleness/old_token_frac"] == pytest.approx(r["staleness/hist_1"])
        assert 0 <= r["staleness/due_groups"] <= r["rollout/episodes"] / 4
        assert r["pipeline/due_wait_s"] >= 0
        assert r["staleness/resumed_episodes"] <= r["staleness/interrupted_episodes"] <= 24
    # step 2's batch was generated (at least partly) while step 1 trained: overlap happened
    assert sum(r["staleness/old_token_frac"] for r in steps) > 0
    # every trained token obeys the bound: a step that ends at version s trained at s - 1
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert lines
    for rec in map(json.loads, lines):
        t = rec["trajectory"]
        sampled = [v for v, m in zip(t["versions"], t["loss_mask"], strict=True) if m]
        assert min(sampled) >= rec["step"] - 2 and max(sampled) <= rec["step"] - 1


class Turns(Env):
    """Ends after ``task.data["turns"]`` assistant turns; says "go on" in between."""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        self.left = int(task.data["turns"])
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action: str) -> StepResult:
        self.left -= 1
        if self.left == 0:
            return StepResult(reward=float(action.count("e") % 2), terminated=True)
        return StepResult([Message(role="user", content="go on")])


@pytest.mark.parametrize("tokens_per_step", [None, 60])
def test_long_group_is_waited_for_and_nothing_is_lost_or_repeated(
    tmp_path: Path, tokens_per_step: int | None
) -> None:
    """A group that spans many versions is trained when due, once; every group is accounted.

    With ``tokens_per_step=60`` a step needs 5 of the short groups (2 x 6 tokens), more than
    the 4 that ``(max_staleness + 1) * tasks_per_step`` admits: the loop must not starve.
    """
    cfg = run_config(
        tmp_path,
        max_staleness=1,
        tasks_per_step=2,
        max_inflight_groups=3,
        tokens_per_step=tokens_per_step,
    )
    cfg["rollout"] = {
        "group_size": 2,
        "max_turns": 24,
        "max_new_tokens": 6,
        "max_total_tokens": 800,
        "ignore_eos": True,
    }
    trainer = Trainer(load_config(cfg))
    # the first task of the (seeded, shuffled) stream takes 24 turns, the others 1: the other
    # groups finish many times over meanwhile
    order = list(range(200))
    random.Random(cfg["seed"] * 7919).shuffle(order)  # the trainer's epoch-0 task order
    trainer.train_tasks = [
        Task(id=f"t{i}", prompt=f"Say {i}.", data={"turns": 24 if i == order[0] else 1})
        for i in range(200)
    ]
    long_id = f"t{order[0]}"
    trainer.make_env = Turns  # type: ignore[method-assign]
    batches: list[list[Group]] = []
    training_batch = trainer.training_batch

    def spy(groups: list[Group]) -> Any:
        batches.append(list(groups))
        return training_batch(groups)

    trainer.training_batch = spy  # type: ignore[method-assign]
    pipeline = Pipeline(trainer)

    async def run() -> list[dict[str, float]]:
        out = []
        async with asyncio.timeout(60), aclosing(pipeline.steps()) as steps:
            async for metrics in steps:
                out.append(metrics)
                if len(out) == 8:
                    break
        return out

    metrics = asyncio.run(run())
    stats = pipeline.stats
    trained = [g for batch in batches for g in batch]
    assert stats.started == stats.trained + stats.unfinished
    assert stats.trained == len(trained) >= 8 * 2
    ids = [g.task.id for g in trained]
    assert len(set(ids)) == len(ids)  # no group twice
    # every started task is trained or unfinished: the first `started` tasks of the stream
    assert set(ids) <= {f"t{i}" for i in order[: stats.started]}
    (step,) = [i for i, batch in enumerate(batches) if any(g.task.id == long_id for g in batch)]
    # it started at version 0, so it was due at learner version 1: that step waited for it
    assert step == 1 and metrics[1]["pipeline/due_wait_s"] > 0
    assert metrics[1]["staleness/due_groups"] >= 1
    assert stats.due == sum(m["staleness/due_groups"] for m in metrics)
    for g in trained:
        assert [t.group_index for t in g.trajectories] == [0, 1]
        assert all(not t.failed for t in g.trajectories)
    (long,) = [g for g in trained if g.task.id == long_id]
    assert all(t.num_response_tokens == 24 * 6 for t in long.trajectories)
    for m in metrics:
        assert m["staleness/max"] <= 1
    assert trainer.step == 8 and trainer.client.weight_version == 8  # type: ignore[attr-defined]
    assert not trainer.client.paused  # type: ignore[attr-defined]


def test_staleness_metrics_by_hand() -> None:
    def traj(versions: list[int], **info: int) -> Trajectory:
        n = len(versions)
        return Trajectory(
            task_id="x",
            env_id="e",
            tokens=[1] * (n + 1),
            loss_mask=[0] + [1] * n,
            logprobs=[0.0] + [-1.0] * n,
            versions=[-1, *versions],
            info=info,
        )

    task = Task(id="x", prompt="p")
    groups = [
        Group(task=task, trajectories=[traj([3, 3, 4], interruptions=1, resumes=1)]),
        Group(task=task, trajectories=[traj([5, 5, 5], interruptions=2), traj([4])]),
    ]
    m = staleness_metrics(groups, version=5, max_staleness=2)
    # ages of the 7 sampled tokens: 2 2 1 | 0 0 0 | 1
    assert m["staleness/hist_0"] == pytest.approx(3 / 7)
    assert m["staleness/hist_1"] == pytest.approx(2 / 7)
    assert m["staleness/hist_2"] == pytest.approx(2 / 7)
    assert m["staleness/old_token_frac"] == pytest.approx(4 / 7)
    assert m["staleness/version_spread"] == 2 and m["staleness/max"] == 2
    assert m["staleness/interrupted_episodes"] == 2 and m["staleness/resumed_episodes"] == 1


def test_room_a_push_admits_is_filled_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a push the admission bound grows by a step's groups; they start right away.

    With ``max_inflight_groups`` = two steps' groups and fixed-length turns, every wave of
    groups ends together: unless the push itself starts the next wave, only one step's groups
    are ever generated at once (the engine decodes half the rows it could).
    """
    started_by_push: list[int] = []
    synced = Pipeline._next_version

    def spy(self: Pipeline) -> None:
        before = self.stats.started
        synced(self)
        started_by_push.append(self.stats.started - before)
        # never beyond the bounds: in flight, and (S + 1) steps' groups past those trained
        assert len(self._inflight) <= 4
        assert self.stats.started - self._taken_before_served <= 4

    monkeypatch.setattr(Pipeline, "_next_version", spy)
    cfg = run_config(tmp_path, max_staleness=1, tasks_per_step=2, max_inflight_groups=4, steps=6)
    cfg["rollout"] = {"group_size": 2, "max_turns": 1, "max_new_tokens": 4,
                      "max_total_tokens": 48, "ignore_eos": True}  # fmt: skip
    cfg["train"]["eval_every"] = 0
    asyncio.run(Trainer(load_config(cfg)).run())
    # each push admits the two groups its step took: the next wave starts at the push
    assert started_by_push == [2] * 6


def test_requests_sent_around_a_push_sample_only_the_pushed_weights(tmp_path: Path) -> None:
    """The groups a push admits start at its interrupt, and the embedded engine queues what is
    sent while it is paused (interrupted turns re-sent, the new groups' first turns) instead of
    a gate holding them until the push is done; none of it samples a token before the push."""
    cfg = run_config(tmp_path, max_staleness=1, tasks_per_step=2, max_inflight_groups=4, steps=4)
    cfg["rollout"] = {"group_size": 2, "max_turns": 1, "max_new_tokens": 4,
                      "max_total_tokens": 48, "ignore_eos": True}  # fmt: skip
    cfg["train"]["eval_every"] = 0
    trainer = Trainer(load_config(cfg))
    log: list[str] = []
    pushing: list[int] = []  # the version of each push begun
    floors: list[tuple[int, list[int]]] = []  # (newest push begun at the call, versions sampled)
    make_env, generate, sync = trainer.make_env, trainer.client.generate, trainer.sync_weights

    def env() -> Env:
        log.append("env")
        return make_env()

    async def gen(*args: Any, **kwargs: Any) -> Any:
        log.append("generate")
        floor = pushing[-1] if pushing else 0
        out = await generate(*args, **kwargs)
        floors.append((floor, list(out.versions)))
        return out

    async def push() -> float:
        log.append("push")
        pushing.append(trainer.step)
        try:
            return await sync()
        finally:
            log.append("pushed")

    trainer.make_env, trainer.sync_weights = env, push  # type: ignore[method-assign]
    trainer.client.generate = gen  # type: ignore[method-assign]
    asyncio.run(trainer.run())
    pushes = [i for i, e in enumerate(log) if e == "push"]
    assert len(pushes) == 6  # two before the overlapped loop, then one a step
    assert pushing == [0, 0, 1, 2, 3, 4]
    assert log.count("env") == 40  # every episode of the run (train and eval) started once
    assert log.count("generate") >= 40
    assert sum(floor >= 1 for floor, _ in floors) >= 16  # requests sent after the pushes began
    assert all(v >= floor for floor, versions in floors for v in versions), floors
    assert log[pushes[-1] :].count("generate") >= 4


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_turns_stay_open_across_pushes_with_a_pausing_interrupt_mode(
    tmp_path: Path, mode: str
) -> None:
    """``rollout.interrupt_mode`` ``retract`` / ``in_place``: no turn is cut and re-sent; a turn
    in flight at a push goes on in the paused engine, its tokens of two versions in one turn."""
    cfg = run_config(tmp_path, max_staleness=1)
    cfg["rollout"].update(ignore_eos=True, max_new_tokens=24, max_total_tokens=64,
                          max_turns=1, interrupt_mode=mode)  # fmt: skip
    # five steps: four pushes, so that some turn is in flight at one even when a loaded machine
    # (another test worker) lets every turn of a step finish before its push (three flaked once)
    cfg["train"].update(eval_every=0, steps=5)
    trainer = Trainer(load_config(cfg))
    # one turn scored by its text (every group has a signal: each step updates and pushes)
    trainer.train_tasks = [Task(id=f"t{i}", prompt=f"Say {i}.", data={"turns": 1})
                           for i in range(64)]  # fmt: skip
    trainer.make_env = Turns  # type: ignore[method-assign]
    summary = asyncio.run(trainer.run())
    assert summary["steps"] == 5
    steps = [r for r in records(tmp_path) if "rollout/episodes" in r]
    assert all(r["staleness/interrupted_episodes"] == 0 for r in steps)
    assert all(r["staleness/resumed_episodes"] == 0 for r in steps)
    assert sum(r.get("rollout/zero_signal_groups", 0) < 6 for r in steps) >= 3  # >= 3 pushes
    mixed = 0
    for rec in map(json.loads, (tmp_path / "trajectories.jsonl").read_text().splitlines()):
        t = rec["trajectory"]
        sampled = [v for v, m in zip(t["versions"], t["loss_mask"], strict=True) if m]
        assert len(sampled) == 24 and sampled == sorted(sampled)  # one turn, versions rising
        assert min(sampled) >= rec["step"] - 2 and max(sampled) <= rec["step"] - 1
        mixed += len(set(sampled)) > 1
    assert mixed > 0  # some turns were in flight at a push and went on after it


def test_interrupt_modes_that_keep_turns_open_need_a_pausing_client() -> None:
    from agentrl.errors import ConfigError
    from agentrl.rollout import RolloutConfig, RolloutEngine

    class NoPause:  # an InferenceClient without pause / continue_generation
        async def generate(self, *a: Any, **k: Any) -> Any:
            raise AssertionError("not called")

    with pytest.raises(ConfigError, match="interrupt_mode: 'in_place' needs a client"):
        RolloutEngine(NoPause(), None, RolloutConfig(interrupt_mode="in_place"))  # type: ignore[arg-type]
