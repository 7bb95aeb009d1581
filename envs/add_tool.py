r"""``add-tool-v0``: add two long numbers by calling an ``add`` tool, then answer with its output.

The task of ``make demo``. Numbers of four digits are more than the tiny CPU model can add
reliably, but it can copy them into a tool call, read the tool's output and copy that into its
answer. Operands are drawn from the upper half of their range (5000 to 9999), so every sum
has five digits. A demonstrated episode takes two turns:

.. code-block:: text

    user:       4821+7390
    assistant:  <tool_call>{"name":"add","arguments":{"a":4821,"b":7390}}</tool_call>
    tool:       <tool_response>\n12211\n</tool_response>
    assistant:  12211

The reward is 1 when the last integer of the final answer (a turn without a tool call) is the sum,
else 0; an agent that answers at once is scored the same way. A malformed call gets an error
message as the tool's output and the episode goes on (see :class:`~agentrl.env.ToolEnv`). A pair
belongs to the held-out split when ``(7 * a + b) % 10 == 0``, so the two splits never share one.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from agentrl.env import Tool, ToolEnv
from agentrl.errors import EnvError
from agentrl.types import Message, Task

_INT = re.compile(r"-?\d+")


def _is_test(a: int, b: int) -> bool:
    return (7 * a + b) % 10 == 0


async def _add(**arguments: Any) -> int:
    """The tool: ``a + b`` for two integers (a JSON number or a string of digits each)."""
    if set(arguments) != {"a", "b"}:
        raise ValueError(f'expected arguments {{"a": int, "b": int}}, got {sorted(arguments)}')
    values = []
    for name in ("a", "b"):
        v = arguments[name]
        if isinstance(v, str) and _INT.fullmatch(v.strip()):
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name}: expected an integer, got {v!r}")
        values.append(v)
    return values[0] + values[1]


ADD = Tool(
    "add",
    "a + b for two integers",
    _add,
    {
        "type": "object",
        "required": ["a", "b"],
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    },
)


def tool_call_text(a: int, b: int) -> str:
    """The demonstrated call, in the compact JSON that costs the fewest tokens."""
    call = {"name": "add", "arguments": {"a": a, "b": b}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


class AddToolEnv(ToolEnv):
    """Add the two numbers of ``"a+b"`` with the ``add`` tool; answer with the sum.

    Args:
        system_prompt: an optional system message (the tiny demo model learns the tool from
            demonstrations, so by default there is none and the prompt stays short).
    """

    tools = [ADD]

    def __init__(self, *, system_prompt: str | None = None) -> None:
        super().__init__()
        self.system_prompt = system_prompt

    def prompt(self, task: Task) -> list[Message]:
        """The question as the user message (after the system message, if any)."""
        system = [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        return system + [Message(role="user", content=task.prompt)]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Start an episode on ``task`` (which must have the sum as its answer)."""
        if task.answer is None:
            raise EnvError(f"task {task.id}: add-tool-v0 needs the sum as the task's answer")
        return await super().reset(task, seed=seed)

    async def score(self, answer: str) -> tuple[float, dict[str, Any]]:
        """1 when the last integer of ``answer`` is the sum, else 0."""
        assert self.task is not None
        found = _INT.findall(answer)
        ok = bool(found) and found[-1] == self.task.answer
        return float(ok), {"format_error": not found, "extracted": found[-1] if found else None}

    def demonstration(self, task: Task) -> list[str] | None:
        """Call ``add`` on the task's two numbers, then answer with the sum."""
        a, b = task.data.get("a"), task.data.get("b")
        if not isinstance(a, int) or not isinstance(b, int) or task.answer is None:
            return super().demonstration(task)
        return [tool_call_text(a, b), task.answer]

    @classmethod
    def sample_tasks(
        cls, n: int, *, seed: int = 0, split: str = "train", digits: int = 4
    ) -> list[Task]:
        """``n`` random ``"a+b"`` questions with operands of ``digits`` digits.

        Operands are drawn from the upper half of the range (5000 to 9999 for 4 digits), so
        every sum has one digit more than its operands: all episodes have the same shape, and
        no subset of tasks stays out of reach of the tiny model's copying (where every sample of
        a group fails, RL has no signal).
        """
        if split not in ("train", "test"):
            raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
        if digits < 1:
            raise ValueError(f"digits: expected >= 1, got {digits}")
        rng = random.Random(f"add-tool/{seed}/{split}")
        lo, hi = 5 * 10 ** (digits - 1), 10**digits - 1
        tasks: list[Task] = []
        while len(tasks) < n:
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if _is_test(a, b) == (split == "test"):
                tasks.append(
                    Task(
                        id=f"{split}-{a}+{b}",
                        prompt=f"{a}+{b}",
                        answer=str(a + b),
                        data={"a": a, "b": b},
                    )
                )
        return tasks
