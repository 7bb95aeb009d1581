"""``guess-v0``: guess a secret number over several turns, told "higher" or "lower".

A multi-turn env with feedback between turns, written synchronously to show the thread adapter
(:class:`~agentrl.env.SyncEnv`). The reward is 1 for finding the number; the per-turn info says
how far off each guess was.
"""

from __future__ import annotations

import random
import re

from agentrl.env import StepResult, SyncEnv
from agentrl.errors import EnvError
from agentrl.types import Message, Task

_INT = re.compile(r"-?\d+")


class GuessEnv(SyncEnv):
    """Find a secret integer in ``[1, high]`` (the task's answer)."""

    sees_cut_turns = True  # every turn is a guess answered with a hint, cut or not

    def __init__(self) -> None:
        self.secret: int | None = None
        self.high = 0

    def reset_sync(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Start with the task's secret and range."""
        if task.answer is None:
            raise EnvError(f"task {task.id}: guess-v0 needs the secret as its answer")
        self.secret, self.high = int(task.answer), int(task.data.get("high", 100))
        return [Message(role="user", content=task.prompt)], {"high": self.high}

    def step_sync(self, action: str) -> StepResult:
        """Compare the last integer of ``action`` with the secret."""
        if self.secret is None:
            raise EnvError("step() before reset()")
        found = _INT.findall(action)
        if not found:
            text = f"Answer with one number between 1 and {self.high}."
            return StepResult([Message(role="user", content=text)], info={"format_error": True})
        guess = int(found[-1])
        if guess == self.secret:
            return StepResult(reward=1.0, terminated=True, info={"distance": 0})
        hint = "higher" if guess < self.secret else "lower"
        return StepResult(
            [Message(role="user", content=hint)], info={"distance": abs(guess - self.secret)}
        )

    @classmethod
    def sample_tasks(
        cls, n: int, *, seed: int = 0, split: str = "train", high: int = 100
    ) -> list[Task]:
        """``n`` games with secrets drawn from ``[1, high]``."""
        rng = random.Random(f"{seed}/{split}")
        prompt = f"I picked a number between 1 and {high}. Guess it."
        return [
            Task(
                id=f"{split}-{i}",
                prompt=prompt,
                answer=str(rng.randint(1, high)),
                data={"high": high},
            )
            for i in range(n)
        ]
