"""The rollout engine against a real tiny model (the embedded engine), with faults injected."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pydantic
import pytest

from agentrl.env import Env, StepResult, make
from agentrl.errors import ServerError
from agentrl.inference.engine import LocalEngine
from agentrl.rollout.engine import JsonlSink, RolloutConfig, RolloutEngine, rollout_metrics
from agentrl.types import Message, Task, Trajectory


class Recording:
    """Wraps a real client; records every request and reply; can fail chosen requests."""

    def __init__(self, inner, fail_rids: str | None = None) -> None:
        self.inner, self.fail = inner, re.compile(fail_rids) if fail_rids else None
        self.calls: list[tuple[str, list[int], list[int]]] = []

    async def generate(self, input_ids, params, *, rid=None, session_id=None):
        if self.fail and self.fail.search(rid or ""):
            raise ServerError("injected failure", endpoint="test", rid=rid)
        out = await self.inner.generate(list(input_ids), params, rid=rid, session_id=session_id)
        self.calls.append((rid, list(input_ids), list(out.output_ids)))
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine.from_pretrained("tiny")
    yield eng
    asyncio.run(eng.aclose())


def config(**kw) -> RolloutConfig:
    base = dict(group_size=3, max_turns=3, max_new_tokens=8, max_total_tokens=256, seed=1)
    return RolloutConfig(**{**base, **kw})


def guess_tasks(n=2):
    return make("guess-v0").sample_tasks(n, seed=0)


def check_layout(t: Trajectory) -> None:
    n = len(t.tokens)
    assert len(t.loss_mask) == len(t.logprobs) == len(t.versions) == n
    assert t.loss_mask[: t.prompt_len] == [0] * t.prompt_len
    pos = t.prompt_len
    for span in t.turns:  # turns tile the sequence after the prompt
        assert span.start == pos and span.end > span.start
        want = 1 if span.kind == "assistant" else 0
        assert t.loss_mask[span.start : span.end] == [want] * (span.end - span.start)
        pos = span.end
    assert pos == n
    for m, lp, v in zip(t.loss_mask, t.logprobs, t.versions, strict=True):
        assert (lp <= 0 and v == 0) if m else (lp == 0.0 and v == -1)


async def test_groups_multi_turn_token_in_token_out(engine) -> None:
    client = Recording(engine)
    ro = RolloutEngine(client, engine.tokenizer, config())
    groups = await ro.run_groups(lambda: make("guess-v0"), guess_tasks(), env_id="guess-v0")
    assert [len(g.trajectories) for g in groups] == [3, 3]
    assert [t.group_index for t in groups[0].trajectories] == [0, 1, 2]
    by_rid = {rid: (inp, out) for rid, inp, out in client.calls}
    for g in groups:
        for t in g.trajectories:
            assert t.error is None and t.env_id == "guess-v0"
            check_layout(t)
            spans = [s for s in t.turns if s.kind == "assistant"]
            # every request saw exactly the trajectory's prefix, and produced exactly its tokens
            mine = sorted(
                (rid, v)
                for rid, v in by_rid.items()
                if rid.startswith(f"{t.task_id}#{t.group_index}@")
            )
            assert len(mine) == len(spans)
            for (_, (inp, out)), span in zip(mine, spans, strict=True):
                assert inp == t.tokens[: span.start]
                assert out == t.tokens[span.start : span.end]


async def test_seeded_runs_repeat(engine) -> None:
    ro = RolloutEngine(engine, engine.tokenizer, config())
    a = await ro.run_groups(lambda: make("guess-v0"), guess_tasks())
    b = await ro.run_groups(lambda: make("guess-v0"), guess_tasks())
    assert [t.tokens for g in a for t in g.trajectories] == [
        t.tokens for g in b for t in g.trajectories
    ]


class Flaky(Env):
    """Raises in step for task 'bad'; counts closes; optionally slow."""

    sees_cut_turns = True  # the untrained model's turns are cut: step must still see them
    closes: list[str] = []

    def __init__(self, delay: float = 0.0, raise_in_close: bool = False) -> None:
        self.delay, self.raise_in_close, self.task = delay, raise_in_close, None

    async def reset(self, task, *, seed=None):
        self.task = task
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action):
        if self.task.id == "bad":
            raise RuntimeError("boom")
        if self.delay:
            await asyncio.to_thread(time.sleep, self.delay)  # a slow verifier, off the loop
        return StepResult(reward=1.0, terminated=True)

    async def close(self):
        Flaky.closes.append(self.task.id if self.task else "?")
        if self.raise_in_close:
            raise OSError("close failed")


async def test_failures_are_recorded_and_isolated(engine) -> None:
    Flaky.closes = []
    client = Recording(engine, fail_rids=r"^req-fail#1@")
    ro = RolloutEngine(client, engine.tokenizer, config(group_size=2))
    tasks = [Task(id="bad", prompt="x"), Task(id="ok", prompt="y"), Task(id="req-fail", prompt="z")]
    groups = await ro.run_groups(Flaky, tasks)
    by = {(t.task_id, t.group_index): t for g in groups for t in g.trajectories}
    assert by["bad", 0].error == "RuntimeError: boom" and by["bad", 0].finish_reason == "error"
    assert by["ok", 0].error is None and by["ok", 1].reward == 1.0
    assert by["req-fail", 1].error.startswith("ServerError: injected failure")
    assert by["req-fail", 0].error is None
    assert sorted(Flaky.closes) == ["bad", "bad", "ok", "ok", "req-fail", "req-fail"]
    m = rollout_metrics(groups)
    assert m["rollout/failed"] == 3 and m["rollout/episodes"] == 6


async def test_error_in_close_is_recorded(engine) -> None:
    ro = RolloutEngine(engine, engine.tokenizer, config(group_size=1))
    [g] = await ro.run_groups(lambda: Flaky(raise_in_close=True), [Task(id="ok", prompt="p")])
    assert g.trajectories[0].error == "OSError in close(): close failed"


async def test_budgets_truncate_without_error(engine) -> None:
    tasks = guess_tasks(1)
    ro = RolloutEngine(engine, engine.tokenizer, config(max_total_tokens=100, max_turns=50))
    [g] = await ro.run_groups(lambda: make("guess-v0"), tasks)
    for t in g.trajectories:
        assert t.error is None and (t.terminated or t.truncated)
        if t.truncated:
            assert t.finish_reason == "max_tokens" and len(t.tokens) <= 100
    ro = RolloutEngine(engine, engine.tokenizer, config(max_turns=1))
    [g] = await ro.run_groups(lambda: make("guess-v0"), tasks)
    assert {t.finish_reason for t in g.trajectories} <= {"max_turns", "terminated"}
    assert all(len(t.turn_rewards) == 1 for t in g.trajectories)
    m = rollout_metrics([g])
    assert m["rollout/failed"] == 0


async def test_episode_timeout_truncates(engine) -> None:
    ro = RolloutEngine(engine, engine.tokenizer, config(group_size=2, episode_timeout_s=0.3))
    [g] = await ro.run_groups(lambda: Flaky(delay=2.0), [Task(id="slow", prompt="p")])
    assert [t.finish_reason for t in g.trajectories] == ["timeout", "timeout"]
    assert all(t.truncated and t.info["failure"] == "timeout" for t in g.trajectories)


async def test_scoring_overlaps_other_episodes(engine) -> None:
    # 8 episodes whose verifier takes 0.4 s each finish in far less than 8 x 0.4 s.
    ro = RolloutEngine(engine, engine.tokenizer, config(group_size=8))
    t = time.perf_counter()
    [g] = await ro.run_groups(lambda: Flaky(delay=0.4), [Task(id="ok", prompt="p")])
    assert time.perf_counter() - t < 2.4  # serial would be >= 3.2 s; slack for a loaded box
    assert all(tr.reward == 1.0 for tr in g.trajectories)


async def test_jsonl_sink_writes_as_episodes_finish(engine, tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "out.jsonl", extra={"run": "x"})
    ro = RolloutEngine(engine, engine.tokenizer, config())
    groups = await ro.run_groups(lambda: make("guess-v0"), guess_tasks(), sink=sink)
    sink.close()
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(lines) == 6
    back = [Trajectory.model_validate(json.loads(ln)["trajectory"]) for ln in lines]
    assert sorted(t.tokens for t in back) == sorted(
        t.tokens for g in groups for t in g.trajectories
    )


def test_config_errors_name_the_field() -> None:
    with pytest.raises(pydantic.ValidationError, match="group_size"):
        RolloutConfig(group_size=0)
    with pytest.raises(pydantic.ValidationError, match="max_turn"):
        RolloutConfig(max_turn=3)  # typo: unknown fields are rejected


def test_readme_example_runs(tmp_path: Path) -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Write your own environment", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("reward=")]
    assert len(lines) == 4
