"""No hang from an env (issue 43): blocking envs are cut off within ``env_timeout_s`` plus a
margin, a failed run always exits with its error, and an oversized observation is cut before
it is tokenised.

Real parts: the embedded tiny engine, `agentrl train` subprocesses, real threads that block.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentrl.env import Env, StepResult, SyncEnv
from agentrl.inference.engine import LocalEngine
from agentrl.rollout.engine import RolloutConfig, RolloutEngine, rollout_metrics
from agentrl.rollout.env_pool import EnvThreadsStuck
from agentrl.rollout.observations import CHARS_PER_TOKEN
from agentrl.rollout.watchdog import STALL_MARGIN_S
from agentrl.types import Message, Task

ROOT = Path(__file__).resolve().parents[1]
RELEASE = threading.Event()  # set at the end of a test: the blocked threads return


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine.from_pretrained("tiny")
    yield eng
    asyncio.run(eng.aclose())


@pytest.fixture(autouse=True)
def release_blocked_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


def config(**kw) -> RolloutConfig:
    base = dict(group_size=2, max_turns=1, max_new_tokens=3, max_total_tokens=128, seed=1)
    return RolloutConfig(**{**base, **kw})


class _Prompted:
    sees_cut_turns = True  # every turn reaches step(), also one cut by max_new_tokens

    def first(self, task: Task) -> tuple[list[Message], dict]:
        self.task = task
        return [Message(role="user", content=task.prompt)], {}


class Hangs(_Prompted, SyncEnv):
    """A synchronous env whose step blocks its thread (until the test ends) on task ``hang``."""

    def reset_sync(self, task, *, seed=None):
        return self.first(task)

    def step_sync(self, action):
        if self.task.id.startswith("hang"):
            RELEASE.wait()
        return StepResult(reward=1.0, terminated=True)


class BlocksLoop(_Prompted, Env):
    """An async env whose step blocks the event loop (``time.sleep``) on task ``block``."""

    started = 0.0

    async def reset(self, task, *, seed=None):
        return self.first(task)

    async def step(self, action):
        if self.task.id == "block":
            BlocksLoop.started = time.monotonic()
            time.sleep(1.0)
        return StepResult(reward=1.0, terminated=True)


class Floods(_Prompted, Env):
    """Answers with a 10 MB observation on task ``flood``, a short one otherwise."""

    async def reset(self, task, *, seed=None):
        return self.first(task)

    async def step(self, action):
        size = 10_000_000 if self.task.id == "flood" else 10
        return StepResult([Message(role="user", content="x" * size)])


class ThreadBlocks(_Prompted, Env):
    """An async env whose step hands a blocking call to asyncio's default threads, on ``hang``."""

    async def reset(self, task, *, seed=None):
        return self.first(task)

    async def step(self, action):
        if self.task.id.startswith("hang"):
            await asyncio.to_thread(RELEASE.wait)
        return StepResult(reward=1.0, terminated=True)


def tasks(*ids: str) -> list[Task]:
    return [Task(id=i, prompt="p") for i in ids]


async def test_a_blocking_sync_env_times_out_and_the_others_finish(engine) -> None:
    # 34 stuck calls: more than asyncio's default executor has threads (min(32, cores + 4)),
    # which the embedded engine generates in; they used to take them all
    hang = [f"hang{i}" for i in range(17)]
    ro = RolloutEngine(engine, engine.tokenizer, config(env_timeout_s=0.5))
    groups = await ro.run_groups(Hangs, tasks(*hang, "ok"))
    assert ro.env_threads.stuck == 34 and ro.env_threads.abandoned == 34
    [ok] = await ro.run_groups(Hangs, tasks("ok2"))  # generation and sync envs still run
    by = {g.task.id: g.trajectories for g in [*groups, ok]}
    for t in (t for k in hang for t in by[k]):
        assert t.failed and t.finish_reason == "timeout" and t.info["failure"] == "timeout"
        env_s = t.timing.wall_s - t.timing.generate_s  # cut off at the deadline
        assert 0.5 <= env_s < 0.5 + 1.0, t.timing
        assert t.error.startswith("EnvTimeout: env step() took longer than env_timeout_s=0.5")
        assert "its thread is stuck in Hangs.step_sync" in t.error and "RELEASE.wait()" in t.error
        assert "in step_sync\n    RELEASE.wait()" in t.info["traceback"]  # the stuck stack
    assert all(not t.failed and t.reward == 1.0 for k in ("ok", "ok2") for t in by[k])
    RELEASE.set()  # the stuck calls return: their threads end, nothing is stuck any more
    for _ in range(100):
        if ro.env_threads.stuck == 0:
            break
        await asyncio.sleep(0.01)
    assert ro.env_threads.stuck == 0
    assert rollout_metrics(groups)["rollout/failed_timeout"] == 34


async def test_fresh_threads_replace_stuck_ones_until_too_many_stop_the_run(engine) -> None:
    ro = RolloutEngine(engine, engine.tokenizer, config(env_timeout_s=0.3, env_threads=3))
    [g] = await ro.run_groups(Hangs, tasks("hang"))
    assert [t.finish_reason for t in g.trajectories] == ["timeout", "timeout"]
    assert ro.env_threads.stuck == 2
    # 2 of 3 threads are stuck: new calls still get fresh threads and finish
    [ok] = await ro.run_groups(Hangs, tasks("ok"))
    assert [t.reward for t in ok.trajectories] == [1.0, 1.0]
    t0 = time.perf_counter()
    with pytest.raises(EnvThreadsStuck) as info:  # 4 stuck now: the run must stop
        await ro.run_groups(Hangs, tasks("hang-again"))
    assert time.perf_counter() - t0 < 0.3 + 2.0
    message = str(info.value)
    assert re.match(r"[34] synchronous env calls ran past rollout.env_timeout_s", message)
    assert "rollout.env_threads=3" in message and "Hangs.step_sync for" in message
    assert "RELEASE.wait()" in message and "\n" not in message


async def test_an_async_env_that_blocks_the_loop_is_reported_within_the_deadline(engine) -> None:
    stalls: list[tuple[str, str, float]] = []
    ro = RolloutEngine(
        engine,
        engine.tokenizer,
        config(group_size=1, env_timeout_s=0.2),
        on_stall=lambda message, stack: stalls.append((message, stack, time.monotonic())),
    )
    groups = await ro.run_groups(BlocksLoop, tasks("block", "ok"))
    [(message, stack, at)] = stalls  # reported once, while the loop was still blocked
    assert at - BlocksLoop.started < 0.2 + STALL_MARGIN_S + 0.25 + 0.15
    assert message.startswith("env call BlocksLoop.step() has blocked the event loop for ")
    assert "past rollout.env_timeout_s=0.2" in message and "time.sleep(1.0)" in message
    assert "in step\n    time.sleep(1.0)" in stack
    by = {g.task.id: g.trajectories[0] for g in groups}
    assert by["block"].finish_reason == "timeout" and by["block"].info["failure"] == "timeout"
    assert "returned after 1.0 s, past env_timeout_s=0.2" in by["block"].error
    assert not by["ok"].failed and by["ok"].reward == 1.0


async def test_an_oversized_observation_truncates_the_episode_before_tokenising(engine) -> None:
    ro = RolloutEngine(engine, engine.tokenizer, config(max_turns=2, max_observation_tokens=64))
    t0 = time.perf_counter()
    groups = await ro.run_groups(Floods, tasks("flood", "short"), env_id="floods-v0")
    assert time.perf_counter() - t0 < 5  # tokenising 10 MB whole took ~25 s (and 3.6 GB)
    by = {g.task.id: g.trajectories for g in groups}
    for t in by["flood"]:
        assert t.truncated and not t.failed and t.finish_reason == "observation_too_long"
        assert t.info["observation_too_long"] == (
            "env floods-v0 (Floods) returned an observation of 10000000 characters, over "
            "rollout.max_observation_tokens=64; the episode is truncated (finish reason "
            "observation_too_long)"
        )
        kept = t.messages[-1].content  # the transcript keeps the cut text, not 10 MB
        assert kept.startswith("x" * 64 * CHARS_PER_TOKEN + "\n[... cut: the observation has")
        assert len(kept) < 64 * CHARS_PER_TOKEN + 100
        assert [s.kind for s in t.turns] == ["assistant"]  # nothing of it was appended
    assert all(t.finish_reason == "max_turns" for t in by["short"])
    # within the character bound, the token count decides (the tiny tokenizer: 1 per char)
    ro = RolloutEngine(engine, engine.tokenizer, config(max_turns=2, max_observation_tokens=8))
    [g] = await ro.run_groups(Floods, tasks("short"))
    assert all(t.finish_reason == "observation_too_long" for t in g.trajectories)
    why = g.trajectories[0].info["observation_too_long"]
    assert re.search(r"returned an observation of \d\d tokens, over .*_tokens=8;", why), why


ENVS = """
import threading, time
from agentrl import Env, Message, StepResult, Task, register
from agentrl.env import SyncEnv

class _Base:
    sees_cut_turns = True

    @classmethod
    def sample_tasks(cls, n, *, seed=0, split="train"):
        return [Task(id=f"{split}-{i}", prompt=f"say {i}") for i in range(n)]

class Hang(_Base, SyncEnv):
    def reset_sync(self, task, *, seed=None):
        return [Message(role="user", content=task.prompt)], {}

    def step_sync(self, action):
        threading.Event().wait()  # forever, in a thread that is not a daemon's

class Block(_Base, Env):
    async def reset(self, task, *, seed=None):
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action):
        time.sleep(600)  # blocks the event loop

register("hang-v0", Hang)
register("block-v0", Block)
"""

CONFIG = """
[env]
num_train_tasks = 4
num_eval_tasks = 1
[rollout]
group_size = 2
max_turns = 1
max_new_tokens = 3
max_total_tokens = 48
env_timeout_s = 0.3
[learner]
num_minibatches = 1
[train]
steps = 5
tasks_per_step = 2
eval_every = 0
max_staleness = 0
max_failed_steps = 2
"""


def train(tmp_path: Path, env_id: str) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "envs.py").write_text(ENVS)
    (tmp_path / "run.toml").write_text(CONFIG)
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "run.toml", "--import", "envs.py"]
    cmd += [f"--env.id={env_id}", f"--run_dir={tmp_path / env_id}"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return out, time.perf_counter() - t0


def test_train_with_an_env_that_hangs_forever_stops_at_the_failure_limit(tmp_path) -> None:
    out, took = train(tmp_path, "hang-v0")
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("agentrl: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith("agentrl: error: stopping at step 2: more than ")
    assert (
        "The first failure: EnvTimeout: env step() took longer than env_timeout_s=0.3; its "
        "thread is stuck in Hang.step_sync" in errors[0]
    )
    assert "threading.Event().wait()" in errors[0] and "env hang-v0" in errors[0]
    assert took < 90, took


def test_train_with_an_env_that_blocks_the_event_loop_exits_with_one_line(tmp_path) -> None:
    out, took = train(tmp_path, "block-v0")
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("agentrl: error: env call Block.step() has blocked the event loop")
    assert "past rollout.env_timeout_s=0.3" in last and "time.sleep(600)" in last
    assert "the env call that blocks the event loop:" in out.stderr  # its stack, logged
    assert took < 60, took


GUARDED = {  # a failed run whose teardown waits for a thread that never returns
    "asyncio.run joins the default executor": """
import asyncio, threading
from agentrl.rollout.watchdog import exit_guard, guard_exit

async def main():
    try:
        await asyncio.wait_for(asyncio.to_thread(threading.Event().wait), 0.1)
    except TimeoutError:
        guard_exit("stopping: the env hangs\\nits traceback", grace_s=0.5)
        raise SystemExit(1)

with exit_guard():
    asyncio.run(main())
""",
    "the interpreter joins a thread": """
import sys, threading
from agentrl.rollout.watchdog import end_process

threading.Thread(target=threading.Event().wait, name="stuck-env").start()
print("agentrl: error: stopping: the env hangs", file=sys.stderr)
end_process(1, grace_s=0.5)
""",
}


@pytest.mark.parametrize("case", sorted(GUARDED))
def test_a_failed_process_exits_even_when_threads_are_stuck(case: str) -> None:
    t0 = time.perf_counter()
    script = GUARDED[case]
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 1 and time.perf_counter() - t0 < 10, out.stderr
    assert out.stderr.startswith("agentrl: error: stopping: the env hangs")
    assert "threads stuck: " in out.stderr


def test_a_guard_armed_outside_a_job_or_after_it_never_ends_the_process() -> None:
    # a library caller (a notebook, this test session) is not ended by a run that failed in it
    script = """
import asyncio, threading, time
from agentrl.rollout.watchdog import exit_guard, guard_exit

guard_exit("outside any job", grace_s=0.2)  # not armed: no job
with exit_guard():
    guard_exit("a failed job", grace_s=0.2)  # armed, then disarmed as the job's teardown ends
stuck = threading.Event()

async def main():
    asyncio.get_running_loop().run_in_executor(None, stuck.wait)

threading.Timer(1.0, stuck.set).start()
asyncio.run(main())  # its teardown waits 1 s for the thread: longer than any grace above
print("survived")
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0 and out.stdout.strip() == "survived", out.stderr


async def test_an_env_filling_the_default_threads_does_not_stall_generation(engine) -> None:
    # 34 calls blocked in asyncio.to_thread take every default thread; the engine decodes on
    # threads of its own, so the other episodes still generate and finish in time
    hang = [f"hang{i}" for i in range(17)]
    ro = RolloutEngine(engine, engine.tokenizer, config(env_timeout_s=0.5, episode_timeout_s=60))
    t0 = time.monotonic()
    try:
        groups = await asyncio.wait_for(ro.run_groups(ThreadBlocks, tasks(*hang, "ok")), 30)
        [ok] = await asyncio.wait_for(ro.run_groups(ThreadBlocks, tasks("ok2")), 30)
    finally:
        RELEASE.set()  # before the loop closes: it waits for its default threads
    by = {g.task.id: g.trajectories for g in [*groups, ok]}
    assert all(t.error is None and t.reward == 1.0 for t in by["ok"] + by["ok2"])
    assert all("EnvTimeout" in (t.error or "") for k in hang for t in by[k])
    assert time.monotonic() - t0 < 20
