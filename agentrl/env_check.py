"""``check_env``: a conformance check every registered env passes (the tests run it over all).

It drives an env through reset, a few adversarial steps and a double close, and checks the types
of everything returned. It needs no model: actions are fixed strings, including a malformed tool
call and an empty answer, which must become observations or a finished episode, never a crash.
"""

from __future__ import annotations

import asyncio
import math

from agentrl.env import Env, StepResult, env_class, make
from agentrl.errors import EnvError
from agentrl.types import Message, Task

PROBE_ACTIONS = ["", "I do not know.", '<tool_call>{"name": oops</tool_call>', "42", "\\boxed{1}"]


async def _check(env: Env, task: Task) -> None:
    first, info = await env.reset(task, seed=0)
    if not isinstance(first, list) or not first or not all(isinstance(m, Message) for m in first):
        raise EnvError(f"reset() must return a non-empty list[Message] first, got {first!r}")
    if not isinstance(info, dict):
        raise EnvError(f"reset() must return (messages, dict), got info {info!r}")
    for action in PROBE_ACTIONS:
        r = await env.step(action)
        if not isinstance(r, StepResult):
            raise EnvError(f"step() returned {type(r).__name__}, expected StepResult")
        if not isinstance(r.reward, (int, float)) or not math.isfinite(r.reward):
            raise EnvError(f"step() reward must be a finite number, got {r.reward!r}")
        if not all(isinstance(m, Message) for m in r.observation):
            raise EnvError("step() observation must be a list[Message]")
        if not isinstance(r.terminated, bool) or not isinstance(r.truncated, bool):
            raise EnvError("step() terminated/truncated must be bools")
        if not isinstance(r.info, dict):
            raise EnvError("step() info must be a dict")
        if r.terminated or r.truncated:
            break
    await env.close()
    await env.close()  # idempotent


def check_env(env_id: str, tasks: list[Task] | None = None) -> None:
    """Check that the env registered as ``env_id`` honours the contract.

    Args:
        env_id: a registered id.
        tasks: tasks to reset with; by default two from the env's ``sample_tasks``.

    Raises:
        EnvError: naming the first broken rule.
    """
    if tasks is None:
        tasks = env_class(env_id).sample_tasks(2, seed=0)  # type: ignore[attr-defined]
    for task in tasks:
        env = make(env_id)
        if not isinstance(env, Env):
            raise EnvError(f"{env_id}: make() returned {type(env).__name__}, expected Env")
        asyncio.run(_check(env, task))
