"""math-v0 and math-tool-v0: prompts, rewards, tool turns and faults, generators, data loading."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import gymnasium
import pytest

from agentrl.env import make
from agentrl.env_check import check_env
from agentrl.envs.calculator import CalculatorError, Limits, calculate
from agentrl.envs.math import (
    REASONING_GYM_SOURCES,
    MathEnv,
    MathToolEnv,
    generate_tasks,
    in_test_split,
    load_math_tasks,
)
from agentrl.errors import EnvError
from agentrl.types import Task
from agentrl.verifiers.math import shutdown_pool, start_pool, validate_gold


@pytest.fixture(scope="module", autouse=True)
def pool():
    start_pool(2)
    yield
    shutdown_pool()


TASK = Task(id="t", prompt="What is 12 * 34?", answer="408")


def _call(expression: object, **extra: object) -> str:
    args = {"expression": expression, **extra}
    return f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': args})}</tool_call>"


def test_registered_envs_conform() -> None:
    for env_id in ("math-v0", "math-tool-v0"):
        check_env(env_id)
        check_env(env_id, [TASK])


def test_math_env_single_turn() -> None:
    async def go() -> None:
        env = make("math-v0", system_prompt="Be brief.")
        msgs, info = await env.reset(TASK)
        assert [m.role for m in msgs] == ["system", "user"] and info == {}
        assert msgs[1].content == "What is 12 * 34?\n\nPut your final answer within \\boxed{}."
        r = await env.step("12*34 = 408, so \\boxed{408}")
        assert (r.reward, r.terminated, r.observation) == (1.0, True, [])
        assert r.info == {"extracted": "408", "reason": "correct", "format_error": False}
        with pytest.raises(EnvError, match="after the episode ended"):
            await env.step("\\boxed{408}")
        await env.reset(TASK)  # a new episode on the same instance
        r = await env.step("it is 408")
        assert r.reward == 0.0 and r.info["format_error"] and r.info["reason"].startswith("no")
        await env.close()
        await env.close()

    asyncio.run(go())


def test_bare_prompt_and_last_number_for_the_tiny_demo() -> None:
    async def go() -> list[float]:
        env = MathEnv(prompt_template="{question}=", extract="last_number")
        (task,) = MathEnv.sample_tasks(1, seed=3)
        msgs, _ = await env.reset(task)
        assert msgs[0].content == task.prompt + "=" and "+" in task.prompt
        rewards = []
        for guess in (task.answer, str(int(task.answer or 0) + 1)):
            await env.reset(task)
            rewards.append((await env.step(f"{guess}<|im_end|>")).reward)
        return rewards

    assert asyncio.run(go()) == [1.0, 0.0]


def test_bad_construction_and_tasks() -> None:
    with pytest.raises(ValueError, match="'{question}' placeholder"):
        MathEnv(prompt_template="no placeholder")
    with pytest.raises(EnvError, match="need a reference answer"):
        asyncio.run(MathToolEnv().reset(Task(id="x", prompt="q")))
    with pytest.raises(ValueError, match="source: expected one of"):
        generate_tasks(1, source="gsm8k")
    with pytest.raises(ValueError, match="split: expected"):
        generate_tasks(1, split="valid")


def test_tool_env_normal_call_then_final_answer() -> None:
    async def go() -> None:
        env = make("math-tool-v0")
        msgs, _ = await env.reset(TASK)
        assert msgs[0].role == "system" and '"name": "calculator"' in msgs[0].content
        r = await env.step("Let me compute. " + _call("12*34"))
        assert r.observation[0].role == "tool" and "408" in r.observation[0].content
        assert r.info == {"tool_calls": 1, "tool_errors": 0} and not r.terminated
        r = await env.step("So \\boxed{408}.")
        assert r.terminated and r.reward == 1.0 and r.info["reason"] == "correct"

    asyncio.run(go())


def test_tool_env_malformed_and_failing_calls_are_observations() -> None:
    async def go() -> None:
        env = MathToolEnv()
        await env.reset(TASK)
        r = await env.step('<tool_call>{"name": "calculator", "arguments": </tool_call>')
        assert r.info["format_error"] and r.info["tool_errors"] == 1 and not r.terminated
        assert "not valid JSON" in r.observation[0].content
        cases = [
            (_call("1/0"), "CalculatorError: division by zero"),
            (_call("2^3"), "'^' is XOR, not a power"),
            (_call("__import__('os').system('ls')"), "unknown function"),
            (_call("factorial(10**6)"), "factorial: expected 0 <= n <= 1000"),
            (
                '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
                "expected arguments",
            ),
        ]
        for action, error in cases:
            r = await env.step(action)
            assert error in r.observation[0].content and r.info["tool_errors"] == 1
            assert not r.terminated
        r = await env.step("\\boxed{408}")
        assert r.reward == 1.0  # the episode went on through every error

    asyncio.run(go())


def test_tool_that_runs_too_long_is_an_error_and_the_episode_goes_on() -> None:
    async def go() -> tuple[str, float]:
        env = MathToolEnv(calculator_limits=Limits(max_chars=20_000, time_limit_s=0.002))
        await env.reset(TASK)
        term = "(" + "+".join(["factorial(1000) % 7"] * 10) + ")"
        slow = "max(" + ",".join([term] * 60) + ")"  # 600 factorials: ~20x the limit, all legal
        t = time.monotonic()
        r = await env.step(_call(slow))
        elapsed = time.monotonic() - t
        assert r.info == {"tool_calls": 1, "tool_errors": 1} and not r.terminated
        r2 = await env.step(_call("12*34"))
        assert "408" in r2.observation[0].content
        assert (await env.step("\\boxed{408}")).reward == 1.0
        return r.observation[0].content, elapsed

    content, elapsed = asyncio.run(go())
    assert "time limit of 0.002 s exceeded" in content and elapsed < 0.5


def test_addition_generator_is_seeded_and_splits_are_disjoint() -> None:
    train = generate_tasks(400, seed=1)
    test = generate_tasks(100, seed=1, split="test")
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in test})
    assert all(in_test_split(t.prompt) for t in test) and not any(
        in_test_split(t.prompt) for t in train
    )
    assert [t.prompt for t in generate_tasks(5, seed=1)] == [t.prompt for t in train[:5]]
    assert [t.prompt for t in generate_tasks(5, seed=2)] != [t.prompt for t in train[:5]]
    for t in train:
        a, b = map(int, t.prompt.split("+"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and t.answer == str(a + b)
    assert len({t.id for t in train}) == 400


def test_reasoning_gym_sources_split_and_gold_answers_verify() -> None:
    for source in REASONING_GYM_SOURCES:
        train = generate_tasks(12, seed=0, source=source)
        test = generate_tasks(3, seed=0, split="test", source=source)
        assert {t.prompt for t in train}.isdisjoint({t.prompt for t in test}), source
        assert generate_tasks(2, seed=0, source=source) == train[:2], source
        report = validate_gold(train + test)
        assert report.valid == report.total == 15, (source, report.invalid)


def test_load_math_tasks_drops_and_reports_bad_gold(tmp_path: Path) -> None:
    rows = [
        {"problem": "p1", "solution": "\\frac{1}{2}"},
        {"problem": "p2", "solution": "???"},
        {"problem": "p3", "solution": 7},
    ]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks, report = load_math_tasks(path, prompt_field="problem", answer_field="solution")
    assert [t.id for t in tasks] == ["0", "2"] and tasks[1].answer == "7"
    assert (report.total, report.valid, report.invalid) == (3, 2, {"1": "unparseable reference"})


def test_gymnasium_adapter() -> None:
    env = gymnasium.make("agentrl/math-v0")
    obs, _ = env.reset(seed=0, options={"task": TASK.model_dump()})
    assert obs.startswith("user: What is 12 * 34?")
    _, reward, terminated, _, info = env.step("\\boxed{408}")
    assert (reward, terminated, info["reason"]) == (1.0, True, "correct")
    env.close()


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1+2*3", "7"),
        ("7/2", "3.5"),
        ("7//2 + 7%2", "4"),
        ("-(2**10)", "-1024"),
        ("2**-3", "0.125"),
        ("sqrt(16)", "4"),
        ("sqrt(2)", "1.4142135623731"),
        ("0.1+0.2", "0.3"),
        ("log(8, 2) + log10(1000)", "6"),
        ("round(2.567, 2)", "2.57"),
        ("max(1, 5, 3) - min(4, 2)", "3"),
        ("sin(pi/2) + cos(0)", "2"),
        ("exp(1) - e", "0"),
        ("factorial(20)", "2432902008176640000"),
        ("abs(-3) * floor(2.7) * ceil(0.2)", "6"),
        ("1e20", "1e+20"),
    ],
)
def test_calculator_values(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("2^3", "'^' is XOR"),
        ("1/0", "division by zero"),
        ("(-8)**(1/3)", "complex result"),
        ("2**100000", "power larger than 10000 bits"),
        ("(2**6000)*(2**6000)", "product larger than 10000 bits"),
        ("9**9**9", "power larger than"),
        ("factorial(1001)", "expected 0 <= n <= 1000"),
        ("round(5, -10**9)", "ndigits within"),
        ("1e308*10", "not finite"),
        ("exp(1000)", "exp: math range error"),
        ("sqrt(-1)", "sqrt: math domain error"),
        ("x + 1", "unknown name 'x'"),
        ("__import__('os')", "unknown function '__import__'"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("max(*[1, 2])", "only positional arguments"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1 +", "syntax error"),
        ("1" * 501, "longer than 500 characters"),
    ],
)
def test_calculator_rejects(expression: str, error: str) -> None:
    with pytest.raises(CalculatorError, match=re.escape(error)):
        calculate(expression)
