"""Every registered env passes ``check_env``; registry, gymnasium adapter and tool parsing."""

from __future__ import annotations

import asyncio
import threading
import time

import gymnasium
import pytest

import agentrl.env as envmod
from agentrl.env import (
    Env,
    StepResult,
    SyncEnv,
    Tool,
    ToolCallError,
    ToolEnv,
    make,
    parse_tool_calls,
    register,
    registered,
)
from agentrl.env_check import check_env
from agentrl.errors import ConfigError, EnvError
from agentrl.types import Message, Task


@pytest.mark.parametrize("env_id", registered())
def test_every_registered_env_conforms(env_id: str) -> None:
    check_env(env_id)


def test_builtins_registered() -> None:
    assert {"arith-v0", "guess-v0"} <= set(registered())


def test_gymnasium_make_finds_agentrl_envs() -> None:
    env = gymnasium.make("agentrl/guess-v0")
    obs, info = env.reset(seed=0, options={"task": {"id": "t", "prompt": "go", "answer": "7"}})
    assert "go" in obs and info == {"high": 100}
    obs, reward, terminated, truncated, _ = env.step("5")
    assert (obs, reward, terminated, truncated) == ("user: higher", 0.0, False, False)
    obs, reward, terminated, _, _ = env.step("7")
    assert reward == 1.0 and terminated
    env.close()


def test_unknown_env_and_bad_id_are_clear() -> None:
    with pytest.raises(ConfigError, match="unknown env 'nope-v0'"):
        make("nope-v0")
    with pytest.raises(ConfigError, match="expected 'name-vN'"):
        register("no_version", "x:y")


def test_register_a_class_directly() -> None:
    class Echo(Env):
        async def reset(self, task, *, seed=None):
            return [Message(role="user", content=task.prompt)], {}

        async def step(self, action):
            return StepResult(reward=float(action == "hi"), terminated=True)

    register("echo-test-v0", Echo)
    try:
        check_env("echo-test-v0", [Task(id="a", prompt="say hi")])
        assert (
            gymnasium.make("agentrl/echo-test-v0").reset(
                options={"task": Task(id="a", prompt="p")}
            )[0]
            == "user: p"
        )
    finally:
        envmod._REGISTRY.pop("echo-test-v0")


def test_check_env_fails_an_env_that_blocks_instead_of_hanging() -> None:
    release = threading.Event()

    class Stuck(SyncEnv):
        def reset_sync(self, task, *, seed=None):
            return [Message(role="user", content=task.prompt)], {}

        def step_sync(self, action):
            release.wait()  # blocks its thread until the test ends
            return StepResult(terminated=True)

    class Sleeps(Stuck, Env):
        async def step(self, action):
            time.sleep(0.3)  # blocks the event loop: no timeout can fire
            return StepResult(terminated=True)

    register("stuck-test-v0", Stuck)
    register("sleeps-test-v0", Sleeps)
    try:
        t0 = time.perf_counter()
        with pytest.raises(EnvError, match=r"^step\(\) took longer than 0.2 s$"):
            check_env("stuck-test-v0", [Task(id="a", prompt="p")], timeout_s=0.2)
        assert time.perf_counter() - t0 < 2
        with pytest.raises(EnvError, match=r"^step\(\) blocked the event loop for more than 0.2"):
            check_env("sleeps-test-v0", [Task(id="a", prompt="p")], timeout_s=0.2)
    finally:
        release.set()
        envmod._REGISTRY.pop("stuck-test-v0")
        envmod._REGISTRY.pop("sleeps-test-v0")


def test_parse_tool_calls() -> None:
    calls = parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> y')
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1})]
    assert parse_tool_calls("no calls") == []
    for bad, msg in [
        ("<tool_call>{oops}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be an object'),
        ('<tool_call>{"name": "f"}', "unterminated"),
    ]:
        with pytest.raises(ToolCallError, match=msg):
            parse_tool_calls(bad)


class Adder(ToolEnv):
    tools = [
        Tool("add", "add two ints", lambda a, b: a + b),
        Tool("boom", "always fails", lambda: 1 / 0),
    ]

    def prompt(self, task):
        return [Message(role="user", content=task.prompt)]

    async def score(self, answer):
        return float(answer.strip() == self.task.answer), {}


def test_tool_env_turns() -> None:
    async def go():
        env = Adder()
        await env.reset(Task(id="t", prompt="2+3?", answer="5"))
        r = await env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
        assert r.observation[0].role == "tool" and "5" in r.observation[0].content
        assert r.info == {"tool_calls": 1, "tool_errors": 0} and not r.terminated
        r = await env.step('<tool_call>{"name": "boom", "arguments": {}}</tool_call>')
        assert "ZeroDivisionError" in r.observation[0].content and r.info["tool_errors"] == 1
        r = await env.step("<tool_call>{bad json</tool_call>")
        assert "not valid JSON" in r.observation[0].content and r.info["format_error"]
        r = await env.step('<tool_call>{"name": "mul", "arguments": {}}</tool_call>')
        assert "unknown tool 'mul'" in r.observation[0].content
        r = await env.step("5")
        assert r.terminated and r.reward == 1.0
        with pytest.raises(EnvError, match="after the episode ended"):
            await env.step("5")

    asyncio.run(go())


def test_arith_splits_are_disjoint_and_seeded() -> None:
    cls = envmod.env_class("arith-v0")
    train = cls.sample_tasks(300, seed=1)
    test = cls.sample_tasks(300, seed=1, split="test")
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in test})
    assert [t.prompt for t in cls.sample_tasks(5, seed=1)] == [t.prompt for t in train[:5]]
    assert all(int(t.answer) == sum(map(int, t.prompt.split("+"))) for t in train[:50])
