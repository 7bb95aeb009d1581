"""``add-tool-v0`` and the cold start on whole demonstrated conversations (tool call, answer)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import agentrl
from agentrl.env import Env, StepResult
from agentrl.envs.add_tool import AddToolEnv, tool_call_text
from agentrl.errors import EnvError
from agentrl.loop.cold_start import (
    assistant_turns,
    build_demonstrations,
    demonstration_example,
    masked_nll,
    sft,
)
from agentrl.rollout.chat import ChatTokenizer
from agentrl.tiny import build_tiny
from agentrl.types import Message, Task

TASK = Task(id="t", prompt="8596+7876", answer="16472", data={"a": 8596, "b": 7876})
CALL = '<tool_call>{"name":"add","arguments":{"a":8596,"b":7876}}</tool_call>'


def test_tool_call_parsed_and_answer_scored() -> None:
    async def go() -> None:
        env = agentrl.make("add-tool-v0")
        first, _ = await env.reset(TASK)
        assert [(m.role, m.content) for m in first] == [("user", "8596+7876")]
        r = await env.step(CALL)
        assert r.observation == [
            Message(role="tool", content="<tool_response>\n16472\n</tool_response>")
        ]
        assert (r.reward, r.terminated, r.info) == (0.0, False, {"tool_calls": 1, "tool_errors": 0})
        # digits as strings are accepted; a missing argument is an error the agent reads
        r = await env.step('<tool_call>{"name":"add","arguments":{"a":"1","b":2}}</tool_call>')
        assert "\n3\n" in r.observation[0].content
        r = await env.step('<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>')
        assert "error: ValueError" in r.observation[0].content and r.info["tool_errors"] == 1
        r = await env.step('<tool_call>{"name":"add",</tool_call>')
        assert "not valid JSON" in r.observation[0].content and r.info["format_error"]
        r = await env.step("16472")
        assert (r.reward, r.terminated, r.observation) == (1.0, True, [])
        with pytest.raises(EnvError, match="after the episode ended"):
            await env.step("16472")
        env = agentrl.make("add-tool-v0")
        await env.reset(TASK)
        r = await env.step("16471")  # a direct, wrong answer ends the episode with 0
        assert (r.reward, r.terminated, r.info["extracted"]) == (0.0, True, "16471")

    asyncio.run(go())


def test_sample_tasks_splits_and_demonstration() -> None:
    train = AddToolEnv.sample_tasks(300, seed=1)
    test = AddToolEnv.sample_tasks(300, seed=1, split="test")
    assert train == AddToolEnv.sample_tasks(300, seed=1)
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    for t in train[:20] + test[:20]:
        a, b = t.data["a"], t.data["b"]
        assert 5000 <= a <= 9999 and 5000 <= b <= 9999 and t.answer == str(a + b)
        assert len(t.answer) == 5  # every episode has the same shape
        assert t.prompt == f"{a}+{b}"
        assert AddToolEnv().demonstration(t) == [tool_call_text(a, b), str(a + b)]
    assert {len(t.answer or "") for t in AddToolEnv.sample_tasks(20, digits=2)} == {3}


def test_demonstration_is_the_whole_conversation_with_the_tool_masked() -> None:
    _, tok = build_tiny()
    chat = ChatTokenizer(tok)
    env = agentrl.make("add-tool-v0")
    example = asyncio.run(demonstration_example(env, TASK, chat, tok.eos_token_id))
    assert example is not None
    ids, mask = example
    assert tok.decode(ids) == (
        "<|im_start|>user\n8596+7876<|im_end|>\n<|im_start|>assistant\n"
        f"{CALL}<|im_end|>\n<|im_start|>tool\n<tool_response>\n16472\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n16472<|im_end|>"
    )
    trained = [tok.decode(ids[i : i + 1]) if m else "\0" for i, m in enumerate(mask)]
    runs = "".join(trained).split("\0")
    assert [r for r in runs if r] == [f"{CALL}<|im_end|>", "16472<|im_end|>"]
    assert assistant_turns(mask) == 2
    # the tool call's markers are one token each, and decoding keeps them (not special tokens)
    call_ids = chat.encode(CALL)
    assert len(call_ids) == len(CALL) - len("<tool_call></tool_call>") + 2
    assert tok.decode(call_ids, skip_special_tokens=True) == CALL


class _Echo(Env):
    """A two-turn env without tools: feedback after the first turn."""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action: str) -> StepResult:
        if action == "stop":
            return StepResult(reward=1.0, terminated=True)
        return StepResult([Message(role="user", content="again")])


def test_default_demonstrations_single_turn_and_from_task_data() -> None:
    _, tok = build_tiny()
    chat = ChatTokenizer(tok)
    stop = tok.eos_token_id
    arith = Task(id="a", prompt="12+34", answer="46")
    [(ids, mask)] = asyncio.run(
        build_demonstrations(lambda: agentrl.make("arith-v0"), chat, [arith], stop)
    )
    prompt = chat.prompt_ids([Message(role="user", content="12+34")])
    assert ids == prompt + chat.encode("46") + [stop]  # unchanged for single-turn envs
    assert mask == [0] * len(prompt) + [1, 1, 1]
    demo = Task(id="d", prompt="go", data={"demonstration": ["more", "stop"]})
    no_demo = Task(id="n", prompt="go")
    examples = asyncio.run(build_demonstrations(_Echo, chat, [demo, no_demo], stop))
    assert len(examples) == 1 and assistant_turns(examples[0][1]) == 2
    assert "<|im_start|>user\nagain<|im_end|>" in tok.decode(examples[0][0])
    short = Task(id="s", prompt="go", data={"demonstration": ["stop", "extra"]})
    with pytest.raises(EnvError, match="after turn 1 of 2"):
        asyncio.run(build_demonstrations(_Echo, chat, [short], stop))


def _turn_nll(model: Any, examples: list[tuple[list[int], list[int]]], turn: int) -> float:
    """Masked NLL of only the ``turn``-th assistant turn (0-based) of each example."""
    only = []
    for ids, mask in examples:
        keep, k = [], -1
        for i, m in enumerate(mask):
            k += bool(m and (i == 0 or not mask[i - 1]))
            keep.append(int(bool(m) and k == turn))
        only.append((ids, keep))
    with torch.no_grad():
        return float(masked_nll(model, only, pad_id=0))


def test_masked_nll_counts_only_the_assistant_tokens() -> None:
    model, tok = build_tiny()
    chat = ChatTokenizer(tok)
    ids, mask = asyncio.run(
        demonstration_example(agentrl.make("add-tool-v0"), TASK, chat, tok.eos_token_id)
    )  # type: ignore[misc]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        manual = -sum(logp[i - 1, ids[i]] for i in range(1, len(ids)) if mask[i]) / sum(mask)
        assert float(masked_nll(model, [(ids, mask)], pad_id=0)) == pytest.approx(float(manual))


@pytest.fixture
def one_thread() -> Any:
    """One torch thread: on a loaded 2-core machine two threads make this test 5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_cold_start_trains_every_assistant_turn_with_progress(one_thread: None) -> None:
    torch.manual_seed(0)
    model, tok = build_tiny()
    chat = ChatTokenizer(tok)
    tasks = AddToolEnv.sample_tasks(32, seed=0, digits=2)  # short, so the test is quick
    demos = asyncio.run(
        build_demonstrations(lambda: agentrl.make("add-tool-v0"), chat, tasks, tok.eos_token_id)
    )
    before = [_turn_nll(model, demos, k) for k in (0, 1)]
    seen: list[dict[str, float]] = []
    stats = asyncio.run(
        sft(model, demos, steps=20, batch_size=8, lr=3e-3, seed=0, on_progress=seen.append)
    )
    after = [_turn_nll(model, demos, k) for k in (0, 1)]
    assert after[0] < 0.5 * before[0] and after[1] < 0.7 * before[1], (before, after)
    assert [int(m["sft/step"]) for m in seen] == list(range(1, 21))
    assert stats["sft/steps"] == 20 and seen[-1]["sft/loss"] == stats["sft/loss"]
