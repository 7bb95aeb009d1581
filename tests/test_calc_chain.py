"""``calc-chain-v0``: tasks, tools, scoring against adversarial answers, the demonstration."""

from __future__ import annotations

import asyncio

import pytest

import agentrl
from agentrl.envs.calc_chain import CalcChainEnv, chain_steps, default_system_prompt
from agentrl.loop.cold_start import assistant_turns, demonstration_example
from agentrl.rollout.chat import ChatTokenizer
from agentrl.tiny import build_tiny_tokenizer
from agentrl.types import Task

TASK = Task(
    id="t",
    prompt="4821+7390-5127+6604",
    answer="13688",
    data={"numbers": [4821, 7390, 5127, 6604], "ops": ["+", "-", "+"]},
)


def call(name: str, a: object, b: object) -> str:
    return f'<tool_call>{{"name":"{name}","arguments":{{"a":{a},"b":{b}}}}}</tool_call>'


async def play(turns: list[str], task: Task = TASK) -> tuple[float, int]:
    """Reward and assistant turns of an episode whose turns are scripted (0 if it never ends)."""
    env = agentrl.make("calc-chain-v0")
    await env.reset(task)
    for k, text in enumerate(turns, 1):
        r = await env.step(text)
        if r.terminated or r.truncated:
            return r.reward, k
    return 0.0, len(turns)


def test_sample_tasks_seeded_split_disjoint_and_same_shape() -> None:
    train = CalcChainEnv.sample_tasks(400, seed=1)
    test = CalcChainEnv.sample_tasks(400, seed=1, split="test")
    assert train == CalcChainEnv.sample_tasks(400, seed=1)
    assert train != CalcChainEnv.sample_tasks(400, seed=2)
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    ops_seen: set[str] = set()
    for t in train + test:
        numbers, ops = t.data["numbers"], t.data["ops"]
        assert all(1000 <= n <= 9999 for n in numbers) and len(ops) == 3
        steps = chain_steps(numbers, ops)
        assert all(1000 <= out <= 99990 for *_, out in steps) and t.answer == str(steps[-1][3])
        assert eval(t.prompt) == int(t.answer)  # left to right, as Python reads it
        ops_seen.update(name for name, *_ in steps)
    assert ops_seen == {"add", "sub"}
    assert all(t.prompt.count("+") + t.prompt.count("-") == 3 for t in test)
    assert len(CalcChainEnv.sample_tasks(5, digits=2)[0].prompt) == 11
    for bad in ({"split": "dev"}, {"digits": 0}):
        with pytest.raises(ValueError):
            CalcChainEnv.sample_tasks(1, **bad)


def test_tools_and_the_system_prompt() -> None:
    async def go() -> None:
        env = agentrl.make("calc-chain-v0")
        first, _ = await env.reset(TASK)
        assert [m.role for m in first] == ["system", "user"] and first[1].content == TASK.prompt
        assert first[0].content == default_system_prompt()
        assert "add(a, b): a + b" in first[0].content and "sub(a, b): a - b" in first[0].content
        r = await env.step(call("sub", 12211, 5127))
        assert r.observation[0].content == "<tool_response>\n7084\n</tool_response>"
        assert r.info == {"tool_calls": 1, "tool_errors": 0} and not r.terminated
        r = await env.step(call("add", '"12"', -3))  # digits as a string are accepted
        assert "\n9\n" in r.observation[0].content
        for bad, why in [
            (call("add", 1, "true"), "expected an integer"),
            (call("add", 10**16, 1), "<= 10**15"),
            (call("mul", 2, 3), "unknown tool 'mul'"),
            ('<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>', "expected arguments"),
        ]:
            r = await env.step(bad)
            assert why in r.observation[0].content and r.info["tool_errors"] == 1, bad
        assert CalcChainEnv(system_prompt="").prompt(TASK)[0].role == "user"

    asyncio.run(go())


def test_scoring_against_adversarial_answers() -> None:
    demo = CalcChainEnv().demonstration(TASK)
    assert demo is not None
    calls = demo[:3]
    cases = {
        "the demonstration": (demo, 1.0, 4),
        "answer at once, right": (["13688"], 1.0, 1),
        "answer at once, wrong": (["13687"], 0.0, 1),
        "calls, then the answer in words": ([*calls, "the result is 13688."], 1.0, 4),
        "several numbers, right one first": ([*calls, "13688 or 7084"], 0.0, 4),
        "a negative copy": ([*calls, "-13688"], 0.0, 4),
        "no number": ([*calls, "done"], 0.0, 4),
        "an empty answer": ([*calls, ""], 0.0, 4),
        # a final turn that still calls a tool is never scored, even with the result in it
        "a call in the last turn": ([*calls, call("add", 13688, 0) + " 13688"], 0.0, 4),
        "a malformed call with the result": ([*calls, "<tool_call>13688"], 0.0, 4),
    }
    for name, (turns, reward, n) in cases.items():
        assert asyncio.run(play(turns)) == (reward, n), name


def test_demonstration_replays_to_reward_one_with_the_tools_masked() -> None:
    for task in CalcChainEnv.sample_tasks(20, seed=3, split="test"):
        demo = CalcChainEnv().demonstration(task)
        assert demo is not None and len(demo) == 4
        assert asyncio.run(play(demo, task)) == (1.0, 4)
    tok = build_tiny_tokenizer()
    chat = ChatTokenizer(tok)
    example = asyncio.run(
        demonstration_example(agentrl.make("calc-chain-v0"), TASK, chat, tok.eos_token_id)
    )
    assert example is not None
    ids, mask = example
    text = tok.decode(ids)
    for out in ("12211", "7084", "13688"):  # the tool's real outputs sit between the turns
        assert f"<|im_start|>tool\n<tool_response>\n{out}\n</tool_response><|im_end|>" in text
    assert assistant_turns(mask) == 4 and len(ids) < 448  # fits rollout.max_total_tokens 512
    trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert "tool_response" not in trained and "Tools" not in trained
    assert max(len(chat.encode(t)) for t in CalcChainEnv().demonstration(TASK) or []) < 56
    # a task without numbers falls back to its answer (the base class's default)
    assert CalcChainEnv().demonstration(Task(id="x", prompt="1+2", answer="3")) == ["3"]
