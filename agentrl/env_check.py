"""``check_env``: a conformance check every registered env passes (the tests run it over all).

It drives an env through reset, a few adversarial steps and a double close, and checks the types
of everything returned. It needs no model: actions are fixed strings, including a malformed tool
call and an empty answer, which must become observations or a finished episode, never a crash.
Every call must return within ``timeout_s`` (an env that blocks fails the check, never hangs it).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable
from typing import TypeVar

from agentrl.env import Env, StepResult, env_class, make
from agentrl.errors import EnvError
from agentrl.types import Message, Task

T = TypeVar("T")

PROBE_ACTIONS = ["", "I do not know.", '<tool_call>{"name": oops</tool_call>', "42", "\\boxed{1}"]


async def _call(what: str, call: Awaitable[T], timeout_s: float) -> T:
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            out = await call
    except TimeoutError:
        raise EnvError(f"{what}() took longer than {timeout_s} s") from None
    if time.monotonic() - t0 > timeout_s:  # it blocked the event loop: no timeout could fire
        raise EnvError(f"{what}() blocked the event loop for more than {timeout_s} s")
    return out


async def _check(env: Env, task: Task, timeout_s: float) -> None:
    first, info = await _call("reset", env.reset(task, seed=0), timeout_s)
    if not isinstance(first, list) or not first or not all(isinstance(m, Message) for m in first):
        raise EnvError(f"reset() must return a non-empty list[Message] first, got {first!r}")
    if not isinstance(info, dict):
        raise EnvError(f"reset() must return (messages, dict), got info {info!r}")
    for action in PROBE_ACTIONS:
        r = await _call("step", env.step(action), timeout_s)
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
    await _call("close", env.close(), timeout_s)
    await _call("close", env.close(), timeout_s)  # idempotent


def check_env(env_id: str, tasks: list[Task] | None = None, *, timeout_s: float = 60.0) -> None:
    """Check that the env registered as ``env_id`` honours the contract.

    Args:
        env_id: a registered id.
        tasks: tasks to reset with; by default two from the env's ``sample_tasks``.
        timeout_s: the most one ``reset``, ``step`` or ``close`` may take.

    Raises:
        EnvError: naming the first broken rule.
    """
    if tasks is None:
        tasks = env_class(env_id).sample_tasks(2, seed=0)  # type: ignore[attr-defined]
    for task in tasks:
        env = make(env_id)
        if not isinstance(env, Env):
            raise EnvError(f"{env_id}: make() returned {type(env).__name__}, expected Env")
        asyncio.run(_check(env, task, timeout_s))
