r"""``calc-chain-v0``: a chain of three additions and subtractions, one tool call per operation.

The task of ``recipes/math_agent.py --preset gpu-agent``. The question is evaluated left to
right; each tool call does one operation, so the agent must copy the previous tool's output into
its next call, and answer with the last output: three tool turns and one answer, four assistant
turns. The operands have four digits, more than a small model adds reliably, but copying them
is learnable (as in ``add-tool-v0``). The system message lists the tools. A demonstrated
episode:

.. code-block:: text

    system:     Tools (call one per turn, then answer with the last result):
                add(a, b): a + b
                sub(a, b): a - b
                <tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>
    user:       4821+7390-5127+6604
    assistant:  <tool_call>{"name":"add","arguments":{"a":4821,"b":7390}}</tool_call>
    tool:       <tool_response>\n12211\n</tool_response>
    assistant:  <tool_call>{"name":"sub","arguments":{"a":12211,"b":5127}}</tool_call>
    tool:       <tool_response>\n7084\n</tool_response>
    assistant:  <tool_call>{"name":"add","arguments":{"a":7084,"b":6604}}</tool_call>
    tool:       <tool_response>\n13688\n</tool_response>
    assistant:  13688

The reward is 1 when the last integer of the final answer (a turn without a tool call) is the
result, else 0; an answer given at once is scored the same way, and a turn that still calls a
tool is never scored (the rollout's turn limit ends that episode with 0). Every intermediate
result stays between 1000 and 99999, so all episodes have the same shape. A chain belongs to
the held-out split when ``(7a + 5b + 3c + d) % 10 == 0`` over its four numbers, so the splits
never share one.
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
_MAX_ABS = 10**15  # tool arguments past this are refused before any work
OPS = {"+": "add", "-": "sub"}


def _is_test(numbers: list[int]) -> bool:
    a, b, c, d = numbers
    return (7 * a + 5 * b + 3 * c + d) % 10 == 0


def _operands(arguments: dict[str, Any]) -> tuple[int, int]:
    """``a`` and ``b`` as integers (a JSON number or a string of digits each), bounded."""
    if set(arguments) != {"a", "b"}:
        raise ValueError(f'expected arguments {{"a": int, "b": int}}, got {sorted(arguments)}')
    values = []
    for name in ("a", "b"):
        v = arguments[name]
        if isinstance(v, str) and len(v) <= 20 and _INT.fullmatch(v.strip()):
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name}: expected an integer, got {v!r:.40}")
        if abs(v) > _MAX_ABS:
            raise ValueError(f"{name}: expected |{name}| <= 10**15")
        values.append(v)
    return values[0], values[1]


async def _add(**arguments: Any) -> int:
    a, b = _operands(arguments)
    return a + b


async def _sub(**arguments: Any) -> int:
    a, b = _operands(arguments)
    return a - b


_SCHEMA = {
    "type": "object",
    "required": ["a", "b"],
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
}
ADD = Tool("add", "a + b", _add, _SCHEMA)
SUB = Tool("sub", "a - b", _sub, _SCHEMA)


def tool_call_text(name: str, a: int, b: int) -> str:
    """One demonstrated call, in the compact JSON that costs the fewest tokens."""
    call = {"name": name, "arguments": {"a": a, "b": b}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def chain_steps(numbers: list[int], ops: list[str]) -> list[tuple[str, int, int, int]]:
    """The chain's calls left to right: ``(tool name, a, b, result)`` each."""
    steps, acc = [], numbers[0]
    for op, b in zip(ops, numbers[1:], strict=True):
        out = acc + b if op == "+" else acc - b
        steps.append((OPS[op], acc, b, out))
        acc = out
    return steps


class CalcChainEnv(ToolEnv):
    """Work out ``"a+b-c+d"`` one operation per ``add``/``sub`` call; answer with the result.

    Args:
        system_prompt: the system message; by default one that lists the tools, the call format
            and the rule (one call per turn, then the last result). ``""`` sends none.
    """

    tools = [ADD, SUB]

    def __init__(self, *, system_prompt: str | None = None) -> None:
        super().__init__()
        self.system_prompt = default_system_prompt() if system_prompt is None else system_prompt

    def prompt(self, task: Task) -> list[Message]:
        """The system message (unless empty), then the chain as the user message."""
        system = [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        return system + [Message(role="user", content=task.prompt)]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Start an episode on ``task`` (which must have the result as its answer)."""
        if task.answer is None:
            raise EnvError(f"task {task.id}: calc-chain-v0 needs the result as the task's answer")
        return await super().reset(task, seed=seed)

    async def score(self, answer: str) -> tuple[float, dict[str, Any]]:
        """1 when the last integer of ``answer`` is the result, else 0."""
        assert self.task is not None
        found = _INT.findall(answer[:1000])
        ok = bool(found) and found[-1] == self.task.answer
        return float(ok), {"format_error": not found, "extracted": found[-1] if found else None}

    def demonstration(self, task: Task) -> list[str] | None:
        """One call per operation, each on the previous call's output, then the result."""
        numbers, ops = task.data.get("numbers"), task.data.get("ops")
        if (
            not isinstance(numbers, list)
            or not isinstance(ops, list)
            or len(numbers) != len(ops) + 1
            or not all(isinstance(n, int) for n in numbers)
            or not all(op in OPS for op in ops)
            or task.answer is None
        ):
            return super().demonstration(task)
        calls = [tool_call_text(name, a, b) for name, a, b, _ in chain_steps(numbers, ops)]
        return calls + [task.answer]

    @classmethod
    def sample_tasks(
        cls, n: int, *, seed: int = 0, split: str = "train", digits: int = 4
    ) -> list[Task]:
        """``n`` random chains of four ``digits``-digit numbers and three ``+``/``-``.

        Every intermediate result is drawn to have ``digits`` or ``digits + 1`` digits, so no
        result goes negative or short and every episode has the same shape.
        """
        if split not in ("train", "test"):
            raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
        if not 1 <= digits <= 9:
            raise ValueError(f"digits: expected 1 to 9, got {digits}")
        if not 0 <= n <= 1_000_000:
            raise ValueError(f"n: expected 0 to 1000000, got {n}")
        rng = random.Random(f"calc-chain/{seed}/{split}")
        lo, hi = 10 ** (digits - 1), 10**digits - 1
        tasks: list[Task] = []
        while len(tasks) < n:
            numbers = [rng.randint(lo, hi) for _ in range(4)]
            ops = [rng.choice("+-") for _ in range(3)]
            steps = chain_steps(numbers, ops)
            if not all(lo <= out <= 10 * hi for *_, out in steps):
                continue
            if _is_test(numbers) != (split == "test"):
                continue
            rest = "".join(f"{op}{b}" for op, b in zip(ops, numbers[1:], strict=True))
            prompt = f"{numbers[0]}{rest}"
            tasks.append(
                Task(
                    id=f"{split}-{prompt}",
                    prompt=prompt,
                    answer=str(steps[-1][3]),
                    data={"numbers": numbers, "ops": ops},
                )
            )
        return tasks


def default_system_prompt() -> str:
    """The tools, one line each, and one example call (short: every token costs context)."""
    lines = ["Tools (call one per turn, then answer with the last result):"]
    lines += [f"{t.name}(a, b): {t.description}" for t in CalcChainEnv.tools]
    lines.append(tool_call_text("add", 1, 2))
    return "\n".join(lines)
