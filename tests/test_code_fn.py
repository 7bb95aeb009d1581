"""code-fn-v0 (recipes/code_agent.py): generated tasks, the real sandbox, cold start vs rollout.

Issue 40: gpu-small's cold start ended with held-out success 0.000. These tests pin what the
cold start and the episodes must agree on, so that a mismatch cannot be the reason again: the
demonstrated program passes the env's hidden tests in the real sandbox (both isolation levels),
a wrong one fails them, the demonstration fits the turn's token budget, and the cold start's
example is token for token the episode that a policy writing the demonstrated answer produces.
The presets' ``layout="constants"`` (the fix) keeps the draws and tests and puts every constant
at a fixed distance from where the demonstration copies it.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from agentrl.inference.base import GenerateOutput, SamplingParams
from agentrl.loop.cold_start import demonstration_example
from agentrl.rollout.chat import ChatTokenizer
from agentrl.rollout.engine import RolloutConfig, RolloutEngine
from agentrl.tiny import build_tiny_tokenizer
from agentrl.types import Task
from agentrl.verifiers.sandbox import Sandbox

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
from code_agent import PRESETS, FunctionCodeEnv  # noqa: E402

FN_PRESETS = ("cpu-tiny-fn", "gpu-small")


def env_of(preset: str, **kw: object) -> FunctionCodeEnv:
    """The env as the preset's trainer makes it (its ``env.kwargs``)."""
    return FunctionCodeEnv(**{**PRESETS[preset]["env"]["kwargs"], **kw})


def tasks_of(preset: str, n: int, **kw: object) -> list[Task]:
    """The preset's tasks (its ``env.task_kwargs``)."""
    return FunctionCodeEnv.sample_tasks(n, **{**PRESETS[preset]["env"]["task_kwargs"], **kw})


def wrong(task: Task) -> str:
    """The demonstrated answer with its last number (the second constant) off by one."""
    assert task.answer is not None
    *_, last = re.finditer(r"\d+", task.answer)
    return f"{task.answer[: last.start()]}{int(last[0]) + 1}{task.answer[last.end() :]}"


@pytest.fixture(scope="module", params=["namespaces", "rlimits"])
def sandbox(request: pytest.FixtureRequest):
    if request.param == "namespaces" and Sandbox().isolation != "namespaces":
        pytest.skip("bubblewrap is not available here")
    box = Sandbox(isolation=request.param, max_concurrency=2)
    assert box.isolation == request.param
    yield box
    box.close()


def test_tasks_are_seeded_and_held_out_tasks_are_new() -> None:
    a, b = FunctionCodeEnv.sample_tasks(50, seed=3), FunctionCodeEnv.sample_tasks(50, seed=3)
    assert [(t.prompt, t.answer, t.data) for t in a] == [(t.prompt, t.answer, t.data) for t in b]
    assert [t.prompt for t in a] != [t.prompt for t in FunctionCodeEnv.sample_tasks(50, seed=4)]
    test = FunctionCodeEnv.sample_tasks(50, seed=3, split="test")
    assert {t.prompt for t in a}.isdisjoint(t.prompt for t in test)
    first = FunctionCodeEnv.sample_tasks(1)[0]
    assert first.prompt == (
        "Write a Python function `calc(x)` that adds 22 to x and then multiplies by 18."
    )
    assert first.answer == "```python\ndef calc(x):\n    return (x + 22) * 18\n```"
    assert first.data["hidden_tests"][2] == {"assert": "assert calc(-3) == 342"}


def test_the_constants_layout_keeps_the_draws_and_tests_and_states_the_constants() -> None:
    plain = FunctionCodeEnv.sample_tasks(300, seed=5, split="test")
    fixed = FunctionCodeEnv.sample_tasks(300, seed=5, split="test", layout="constants")
    assert [(t.id, t.data) for t in plain] == [(t.id, t.data) for t in fixed]
    assert all(
        f.prompt.startswith(p.prompt + "\nconstants: a=") for p, f in zip(plain, fixed, strict=True)
    )
    first = FunctionCodeEnv.sample_tasks(1, layout="constants")[0]
    assert first.prompt.endswith("multiplies by 18.\nconstants: a=22 b=18")
    assert first.answer == "```python\na, b = 22, 18\ndef calc(x):\n    return (x + a) * b\n```"
    one_digit = next(t for t in fixed if re.search(r"a= \d ", t.prompt))
    assert re.search(r"\na, b =  \d, ", one_digit.answer or "")  # padded to the same width
    with pytest.raises(ValueError, match="layout"):
        FunctionCodeEnv.sample_tasks(1, layout="words")


@pytest.mark.parametrize("preset", FN_PRESETS)
def test_each_constant_is_copied_from_a_fixed_distance(preset: str) -> None:
    """In the cold-start example, each digit the answer writes sits at the same offset back in
    the prompt for every task (the layout's point); in the plain layout it moves."""
    chat, env = ChatTokenizer(build_tiny_tokenizer()), env_of(preset)

    def offsets(task: Task) -> tuple[int, ...]:
        messages, _ = asyncio.run(env.reset(task))
        ids = chat.prompt_ids(messages) + chat.encode(task.answer or "")
        # one character per token (a chat marker is one token): text offsets are token offsets
        text = "".join(t if len(t) == 1 else "\0" for t in map(chat.tokenizer.decode, ids))
        prompt_at, answer_at = text.index(task.prompt), text.rindex("```python")
        a, b = re.findall(r"\d+", task.prompt)[:2]
        copied = [m.start() for m in re.finditer(r"\b\d+\b", text[answer_at:])][:2]
        stated = [text.index(f" {a} ", prompt_at), text.index(f" {b}.", prompt_at)]
        if "\nconstants:" in task.prompt:
            line = re.finditer(r"[ab]= ?(\d+)", text[prompt_at:answer_at])
            stated = [prompt_at + m.start(1) for m in line]
        return tuple(answer_at + c - s for c, s in zip(copied, stated, strict=True))

    fixed = {offsets(t) for t in tasks_of(preset, 200)}
    assert len(fixed) == 1, fixed
    plain = {offsets(t) for t in tasks_of(preset, 200, layout="plain")}
    assert len(plain) > 20


async def test_demonstrated_programs_pass_the_hidden_tests_and_wrong_ones_fail(
    sandbox: Sandbox,
) -> None:
    tasks = FunctionCodeEnv.sample_tasks(3, seed=1) + FunctionCodeEnv.sample_tasks(
        3, seed=1, split="test", layout="constants"
    )

    async def episode(task: Task, answer: str, attempts: int) -> tuple[float, dict]:
        env = env_of("gpu-small", sandbox=sandbox, max_attempts=attempts)
        await env.reset(task)
        r = await env.step(answer)
        assert r.terminated
        return r.reward, r.info

    right = await asyncio.gather(*(episode(t, t.answer, 2) for t in tasks))
    assert [(r, i["tests_passed"], i["hidden_passed"]) for r, i in right] == [(1.0, 2, 3)] * 6
    assert all("verifier_error" not in i for _, i in right)
    bad = await asyncio.gather(*(episode(t, wrong(t), 1) for t in tasks))
    assert [(r, i["tests_passed"], i["hidden_passed"]) for r, i in bad] == [(0.0, 0, 0)] * 6


@pytest.mark.parametrize("preset", FN_PRESETS)
def test_every_demonstration_fits_the_turn_and_episode_budgets(preset: str) -> None:
    """A demonstration longer than ``max_new_tokens`` would be cut in every episode (reward 0)."""
    chat, rollout = ChatTokenizer(build_tiny_tokenizer()), PRESETS[preset]["rollout"]
    env = env_of(preset)
    longest_answer = longest_episode = 0
    for task in tasks_of(preset, 200) + tasks_of(preset, 200, split="test"):
        messages, _ = asyncio.run(env.reset(task))
        assert task.answer is not None
        answer = len(chat.encode(task.answer)) + 1  # and its stop token
        longest_answer = max(longest_answer, answer)
        longest_episode = max(longest_episode, len(chat.prompt_ids(messages)) + answer)
    assert longest_answer <= rollout["max_new_tokens"]
    assert longest_episode <= rollout["max_total_tokens"]


class Replay:
    """A policy that writes the demonstrated answer (the rest of the episode is real)."""

    def __init__(self, chat: ChatTokenizer, answer: str, stop_id: int) -> None:
        self.ids = chat.encode(answer) + [stop_id]
        self.prompts: list[list[int]] = []

    async def generate(self, input_ids, params: SamplingParams, **_: object) -> GenerateOutput:
        self.prompts.append(list(input_ids))
        assert len(self.ids) <= params.max_new_tokens
        n = len(self.ids)
        return GenerateOutput("r", list(self.ids), [0.0] * n, [0] * n, "stop", 0)

    async def abort(self, rid: str | None = None) -> None:
        return None


@pytest.mark.parametrize("preset", FN_PRESETS)
async def test_the_cold_start_example_is_the_episode_the_answer_makes(preset: str) -> None:
    tok = build_tiny_tokenizer()
    chat = ChatTokenizer(tok)
    task = tasks_of(preset, 1, seed=7, split="test")[0]
    demo = await demonstration_example(env_of(preset), task, chat, tok.eos_token_id)
    assert demo is not None
    ids, mask = demo
    assert task.answer is not None
    policy = Replay(chat, task.answer, tok.eos_token_id)
    rollout = {k: v for k, v in PRESETS[preset]["rollout"].items() if k != "concurrency"}
    engine = RolloutEngine(policy, tok, RolloutConfig(**rollout), chat=chat)  # type: ignore[arg-type]
    traj = await engine.run_episode(lambda: env_of(preset), task, env_id="code-fn-v0")
    assert traj.reward == 1.0 and traj.finish_reason == "terminated", traj.info
    assert (traj.tokens, traj.loss_mask) == (ids, mask)
    system = PRESETS[preset]["env"]["kwargs"]["system"]
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{task.prompt}<|im_end|>\n"
        f"<|im_start|>assistant\n{task.answer}<|im_end|>"
    )
    assert sum(mask) == len(policy.ids) and policy.prompts == [ids[: len(ids) - sum(mask)]]
