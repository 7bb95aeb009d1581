"""The benchmarks' hashed-reward env (``bench-hash-v0``): one turn, a seeded hash of the answer.

A random model never answers right and a constant reward gives no group a signal; a hash of the
response gives every group one, the same on agentrl's side and TRL's. Importing this module
registers the env.
"""

from __future__ import annotations

import hashlib

import torch

from agentrl.env import Env, StepResult, register
from agentrl.types import Message, Task


def hashed_reward(text: str, seed: int = 0) -> float:
    """A reward in [0, 1) that depends only on the text (the same on both sides)."""
    digest = hashlib.sha256(f"{seed}/{text}".encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32


class HashEnv(Env):
    """One turn: the question, then a hashed reward of the answer."""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Show the question."""
        return [Message(role="user", content=task.prompt)], {}

    async def step(self, action: str) -> StepResult:
        """Score the answer by its hash."""
        return StepResult(reward=hashed_reward(action), terminated=True)

    @classmethod
    def sample_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        """Three-digit sums as questions."""
        g = torch.Generator().manual_seed(seed + (split == "test"))
        ab = torch.randint(100, 1000, (n, 2), generator=g).tolist()
        return [Task(id=f"{split}-{i}", prompt=f"{a}+{b}", answer=str(a + b)) for i, (a, b) in
                enumerate(ab)]  # fmt: skip


register("bench-hash-v0", HashEnv)


class StandinHashEnv(HashEnv):
    """``bench-hash-v0`` for random-weight stand-ins: held-out episodes stop at 16 tokens.

    A stand-in never passes them, and a full-length evaluation would cost as much decoding as a
    training step (at 8k tokens a turn, most of a short run).
    """

    held_out = False

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Show the question; note whether the task is held out."""
        self.held_out = task.id.startswith("test")
        return await super().reset(task, seed=seed)

    def turn_max_new_tokens(self, turn: int) -> int | None:
        """16 tokens on held-out tasks; the rollout's limit on training tasks."""
        return 16 if self.held_out else None


register("standin-hash-v0", StandinHashEnv)
