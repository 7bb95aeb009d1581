"""``arith-v0``: single-turn integer arithmetic (``"12+34"`` -> ``"46"``).

The smallest useful RL task: the CPU demo trains a tiny model on two-digit addition. Reward is 1
when the last integer in the answer equals the result, else 0. Train and test tasks are disjoint:
an operand pair belongs to the test split when ``(7 * a + b) % 5 == 0``.
"""

from __future__ import annotations

import random
import re

from agentrl.env import Env, StepResult
from agentrl.errors import EnvError
from agentrl.types import Message, Task

_INT = re.compile(r"-?\d+")


def _is_test(a: int, b: int) -> bool:
    return (7 * a + b) % 5 == 0


class ArithEnv(Env):
    """Answer an arithmetic question in one turn."""

    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.task: Task | None = None

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Show the question."""
        if task.answer is None:
            raise EnvError(f"task {task.id}: arith-v0 needs an answer")
        self.task = task
        msgs = [Message(role="system", content=self.system)] if self.system else []
        return msgs + [Message(role="user", content=task.prompt)], {}

    async def step(self, action: str) -> StepResult:
        """Score the last integer of ``action`` against the answer."""
        if self.task is None:
            raise EnvError("step() before reset()")
        found = _INT.findall(action)
        ok = bool(found) and found[-1] == self.task.answer
        return StepResult(
            reward=float(ok),
            terminated=True,
            info={"format_error": not found, "extracted": found[-1] if found else None},
        )

    @classmethod
    def sample_tasks(
        cls, n: int, *, seed: int = 0, split: str = "train", digits: int = 2, op: str = "+"
    ) -> list[Task]:
        """``n`` random ``a op b`` questions with operands of ``digits`` digits."""
        if split not in ("train", "test"):
            raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
        if op not in ("+", "-", "*"):
            raise ValueError(f"op: expected one of '+', '-', '*', got {op!r}")
        rng = random.Random(f"{seed}/{split}")
        lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
        tasks: list[Task] = []
        while len(tasks) < n:
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if _is_test(a, b) != (split == "test"):
                continue
            value = a + b if op == "+" else a - b if op == "-" else a * b
            tasks.append(Task(id=f"{split}-{a}{op}{b}", prompt=f"{a}{op}{b}", answer=str(value)))
        return tasks
