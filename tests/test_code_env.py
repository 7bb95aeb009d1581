"""``code-v0``: attempts, failure reports, fixed/broke per turn, hidden-test reward, tasks."""

from __future__ import annotations

import pytest

from agentrl.env import make
from agentrl.envs.code import CodeEnv
from agentrl.errors import EnvError
from agentrl.types import Task
from agentrl.verifiers.code_tasks import load_humaneval
from agentrl.verifiers.sandbox import Sandbox

SUM = Task(
    id="sum",
    prompt="Print a + b.",
    data={
        "public_tests": [{"stdin": "1 2", "stdout": "3"}, {"stdin": "5 5", "stdout": "10"}],
        "hidden_tests": [
            {"stdin": "7 8", "stdout": "15"},
            {"stdin": "0 0", "stdout": "0"},
            {"stdin": "-1 1", "stdout": "0"},
        ],
    },
)


def answer(code: str) -> str:
    return f"Here is my program:\n```python\n{code}```\n"


async def test_malformed_answers_use_up_attempts_and_earn_nothing() -> None:
    env = make("code-v0", max_attempts=2)
    first, info = await env.reset(SUM)
    assert [m.role for m in first] == ["system", "user"] and first[1].content == "Print a + b."
    assert info == {"public_tests": 2, "hidden_tests": 3}
    r = await env.step("the answer is 3")
    assert not r.terminated and r.reward == 0.0 and r.info["format_error"] is True
    assert (
        "no fenced code block" in r.observation[0].content
        and "1 attempt left" in r.observation[0].content
    )
    r = await env.step("still no code")
    assert r.terminated and r.reward == 0.0 and r.info["format_error"] and r.info["attempt"] == 2
    with pytest.raises(EnvError, match="after the episode ended"):
        await env.step(answer("print(3)"))
    await env.close()
    await env.close()


async def test_wrong_then_fixed_over_turns_with_fixed_and_broke() -> None:
    env = make("code-v0", max_attempts=4)
    await env.reset(SUM)
    r = await env.step(
        answer("a, b = map(int, input().split())\nprint(a * b if a == 5 else a - b)\n")
    )
    # 1*2 -> -1 wrong; 5*5 -> 25 wrong
    assert (r.info["tests_passed"], r.info["fixed"], r.info["broke"]) == (0, 0, 0)
    assert r.observation[0].content.startswith("Passed 0/2 public tests.")
    assert "expected: '3' got: '-1'" in r.observation[0].content and not r.terminated
    r = await env.step(answer("a, b = map(int, input().split())\nprint(a + b if a == 1 else 0)\n"))
    assert (r.info["tests_passed"], r.info["fixed"], r.info["broke"]) == (1, 1, 0)
    r = await env.step(answer("a, b = map(int, input().split())\nprint(a + b if a == 5 else 0)\n"))
    assert (r.info["tests_passed"], r.info["fixed"], r.info["broke"]) == (1, 1, 1)
    r = await env.step(answer("a, b = map(int, input().split())\nprint(a + b)\n"))
    assert r.terminated and r.reward == 1.0 and r.observation == []
    assert (r.info["fixed"], r.info["broke"], r.info["hidden_passed"]) == (1, 0, 3)


async def test_passing_public_tests_ends_early_and_hidden_tests_pay() -> None:
    env = CodeEnv(max_attempts=3)
    await env.reset(SUM)
    # passes both public tests, fails the negative hidden one
    r = await env.step(answer("a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n"))
    assert r.terminated and r.info["attempt"] == 1 and r.reward == pytest.approx(2 / 3)
    env = CodeEnv(final_mode="all")
    await env.reset(SUM)
    r = await env.step(answer("a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n"))
    assert r.reward == 0.0 and r.info["hidden_status"] == "failed"


async def test_a_program_that_hangs_times_out_and_is_reported() -> None:
    env = CodeEnv(max_attempts=2, timeout_s=0.5)
    await env.reset(SUM)
    r = await env.step(answer("while True:\n    pass\n"))
    assert (
        r.info["tests_failed"] == 2 and "timeout. time limit exceeded" in r.observation[0].content
    )
    r = await env.step(answer("while True:\n    pass\n"))
    assert r.terminated and r.reward == 0.0 and r.info["hidden_status"] == "timeout"


async def test_a_broken_sandbox_pays_nothing_and_says_why() -> None:
    env = CodeEnv(max_attempts=1, sandbox=Sandbox(isolation="rlimits", python="/bin/false"))
    await env.reset(SUM)
    r = await env.step(answer("a, b = map(int, input().split())\nprint(a + b)\n"))
    assert r.terminated and r.reward == 0.0 and r.info["hidden_status"] == "verifier_error"
    assert r.info["verifier_error"].startswith("sandbox failed: sandbox cannot run ")


async def test_function_task_and_humaneval_task() -> None:
    env = CodeEnv()
    task = next(t for t in CodeEnv.sample_tasks(20) if t.id == "running-sum")
    await env.reset(task)
    r = await env.step(answer("def running_sum(xs):\n    return xs\n"))
    assert not r.terminated and "AssertionError (line 1: assert running_sum([1, 2, 3])" in (
        r.observation[0].content
    )
    r = await env.step(answer(task.data["solution"]))
    assert r.terminated and r.reward == 1.0
    he = load_humaneval(validate=False)[2]  # no public tests: the first answer is final
    await env.reset(he)
    r = await env.step(answer(he.data["solution"]))
    assert r.terminated and r.reward == 1.0 and r.info["tests_passed"] == 0
    with pytest.raises(EnvError, match="needs hidden tests"):
        await env.reset(Task(id="x", prompt="p"))


def test_builtin_tasks_are_split_seeded_and_gold_checked() -> None:
    train = CodeEnv.sample_tasks(40, seed=3)
    test = CodeEnv.sample_tasks(6, seed=0, split="test")
    assert len(train) == 40 and len({t.id for t in train}) == 20  # the set repeats past its size
    assert {t.id for t in train}.isdisjoint({t.id for t in test}) and len({t.id for t in test}) == 6
    assert [t.id for t in CodeEnv.sample_tasks(5, seed=3)] == [t.id for t in train[:5]]
    assert [t.id for t in CodeEnv.sample_tasks(5, seed=4)] != [t.id for t in train[:5]]
    kinds = {t.data["kind"] for t in train + test}
    assert kinds == {"stdio", "function"} and all(t.data["solution"] for t in train + test)
    with pytest.raises(ValueError, match="expected 'train' or 'test'"):
        CodeEnv.sample_tasks(1, split="dev")
