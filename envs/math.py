r"""``math-v0`` (one turn: question, answer) and ``math-tool-v0`` (a calculator over several turns).

Rewards come from :mod:`agentrl.verifiers.math`: the final answer (``\boxed{}`` by default) is
checked for mathematical equality with the reference by math-verify, off the event loop.

Tasks come from offline generators (:func:`generate_tasks`, also ``sample_tasks``): a built-in
two-digit addition for the CPU demo, or reasoning-gym's arithmetic and GSM-symbolic style
generators, which need no download. A question belongs to the held-out ``test`` split when the
SHA-256 of its text is 0 mod 10, so train and test never share a question, whatever the seed.
Data files go through :func:`load_math_tasks`, which checks every gold answer at load.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Any

from agentrl.data import Source, load_tasks
from agentrl.env import Env, StepResult, Tool, ToolEnv, describe_tools
from agentrl.envs.calculator import DEFAULT_LIMITS, CalculatorError, Limits, calculate
from agentrl.errors import EnvError
from agentrl.types import Message, Task
from agentrl.verifiers.math import Extract, GoldReport, MathResult, validate_gold, verify_async

REASONING_GYM_SOURCES = (
    "basic_arithmetic",
    "chain_sum",
    "decimal_chain_sum",
    "gsm_symbolic",
    "products",
    "gcd",
    "lcm",
    "simple_equations",
)
"""reasoning-gym generators whose gold answers all verify (checked by the tests)."""
SOURCES = ("addition", *REASONING_GYM_SOURCES)

DEFAULT_TEMPLATE = "{question}\n\nPut your final answer within \\boxed{}."
"""``{question}`` is replaced by the task's prompt; nothing else in a template is special."""
TOOL_TEMPLATE = (
    "{question}\n\nUse the calculator tool for arithmetic if it helps. "
    "Put your final answer within \\boxed{}."
)


def in_test_split(question: str) -> bool:
    """Whether ``question`` belongs to the held-out split (SHA-256 of the text is 0 mod 10)."""
    return int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % 10 == 0


def generate_tasks(
    n: int, *, seed: int = 0, split: str = "train", source: str = "addition"
) -> list[Task]:
    """``n`` generated tasks of ``split`` (``train`` or ``test``) from ``source``.

    Args:
        n: how many.
        seed: the generator's seed; the same seed gives the same tasks.
        split: ``train`` or ``test`` (disjoint by question, see the module doc).
        source: ``addition`` (``"12+34"`` -> ``"46"``) or a name in :data:`REASONING_GYM_SOURCES`.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
    if source not in SOURCES:
        raise ValueError(f"source: expected one of {SOURCES}, got {source!r}")
    want_test = split == "test"
    tasks: list[Task] = []
    if source == "addition":
        rng = random.Random(f"addition/{seed}")
        while len(tasks) < n:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if in_test_split(q := f"{a}+{b}") == want_test:
                tasks.append(
                    Task(
                        id=f"addition-{split}-{seed}-{len(tasks)}",
                        prompt=q,
                        answer=str(a + b),
                        data={"source": source},
                    )
                )
        return tasks
    import reasoning_gym  # 1.5 s to import; only when asked for

    budget = 50 * n + 1000
    dataset = reasoning_gym.create_dataset(source, size=budget, seed=seed)
    for i in range(budget):
        if len(tasks) == n:
            return tasks
        item = dataset[i]
        if in_test_split(item["question"]) == want_test:
            tasks.append(
                Task(
                    id=f"{source}-{split}-{seed}-{len(tasks)}",
                    prompt=item["question"],
                    answer=str(item["answer"]),
                    data={"source": source},
                )
            )
    if len(tasks) < n:
        raise EnvError(f"{source}: only {len(tasks)} {split} tasks in {budget} draws")
    return tasks


def load_math_tasks(
    source: Source,
    *,
    prompt_field: str = "question",
    answer_field: str = "answer",
    id_field: str | None = None,
    timeout_s: float = 10.0,
) -> tuple[list[Task], GoldReport]:
    """Load math tasks (see :func:`agentrl.data.load_tasks`) and check their gold answers.

    Tasks whose reference does not verify against itself can never be rewarded: they are left
    out, and listed (id and reason) in the report, which is also logged.

    Returns:
        The tasks whose gold answers verify, and the report.
    """
    tasks = load_tasks(
        source, prompt_field=prompt_field, answer_field=answer_field, id_field=id_field
    )
    report = validate_gold(tasks, timeout_s=timeout_s)
    return [t for t in tasks if t.id not in report.invalid], report


def _render(template: str, task: Task) -> str:
    return template.replace("{question}", task.prompt)


def _check_template(template: str) -> None:
    if "{question}" not in template:
        raise ValueError(
            f"prompt_template: expected a '{{question}}' placeholder, got {template!r}"
        )


def _info(result: MathResult) -> dict[str, Any]:
    return {
        "extracted": result.extracted,
        "reason": result.reason,
        "format_error": result.extracted is None,
    }


class MathEnv(Env):
    """One turn: the question; the reply is scored 1 when its final answer equals the reference.

    Args:
        prompt_template: the user message, with ``{question}``; for a tiny char-level model
            use a bare ``"{question}="`` with ``extract="last_number"``.
        system_prompt: an optional system message.
        extract: how the answer is found in the reply (see ``agentrl.verifiers.math``).
        timeout_s: limit of one equivalence check.
    """

    def __init__(
        self,
        *,
        prompt_template: str = DEFAULT_TEMPLATE,
        system_prompt: str | None = None,
        extract: Extract = "boxed",
        timeout_s: float = 5.0,
    ) -> None:
        _check_template(prompt_template)
        self.prompt_template, self.system_prompt = prompt_template, system_prompt
        self.extract, self.timeout_s = extract, timeout_s
        self.task: Task | None = None
        self.done = False

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Show the question."""
        if task.answer is None:
            raise EnvError(f"task {task.id}: math envs need a reference answer")
        self.task, self.done = task, False
        system = [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        return system + [Message(role="user", content=_render(self.prompt_template, task))], {}

    async def step(self, action: str) -> StepResult:
        """Score the reply; the episode ends."""
        if self.task is None or self.task.answer is None:
            raise EnvError("step() before reset()")
        if self.done:
            raise EnvError("step() called after the episode ended")
        self.done = True
        result = await verify_async(
            action, self.task.answer, timeout_s=self.timeout_s, extract=self.extract
        )
        return StepResult(reward=result.score, terminated=True, info=_info(result))

    @classmethod
    def sample_tasks(
        cls, n: int, *, seed: int = 0, split: str = "train", source: str = "addition"
    ) -> list[Task]:
        """``n`` generated tasks; see :func:`generate_tasks`."""
        return generate_tasks(n, seed=seed, split=split, source=source)


class MathToolEnv(ToolEnv):
    """Several turns: the agent may call ``calculator`` before its final answer.

    A turn with a ``<tool_call>`` gets the result (or the error) as a tool message; a turn
    without one is the final answer, scored as in :class:`MathEnv`. The calculator is
    :mod:`agentrl.envs.calculator` (never ``eval``), run in a worker thread under a time limit; an
    expression that runs too long is an error observation and the episode goes on.

    Args:
        prompt_template: the user message, with ``{question}``.
        system_prompt: text put before the tool description in the system message.
        extract: how the final answer is found.
        timeout_s: limit of one equivalence check.
        calculator_limits: size and time bounds of one calculator call.
    """

    def __init__(
        self,
        *,
        prompt_template: str = TOOL_TEMPLATE,
        system_prompt: str | None = None,
        extract: Extract = "boxed",
        timeout_s: float = 5.0,
        calculator_limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        super().__init__()
        _check_template(prompt_template)
        self.prompt_template, self.system_prompt = prompt_template, system_prompt
        self.extract, self.timeout_s = extract, timeout_s
        self.calculator_limits = calculator_limits
        calculator = Tool(
            "calculator",
            "Evaluate an arithmetic expression: numbers, + - * / // % ** (power), parentheses, "
            "pi, e, sqrt, log, exp, sin, cos, tan, abs, round, floor, ceil, min, max, factorial.",
            self._calculate,
            {
                "type": "object",
                "required": ["expression"],
                "properties": {"expression": {"type": "string", "description": "e.g. (3+4)**2/7"}},
            },
        )
        self.tools = [calculator]  # per instance: the calculator carries its limits

    async def _calculate(self, **arguments: Any) -> str:
        expression = arguments.get("expression")
        if set(arguments) != {"expression"} or not isinstance(expression, (str, int, float)):
            raise CalculatorError(
                f'expected arguments {{"expression": "<text>"}}, got {sorted(arguments)}'
            )
        limit = self.calculator_limits.time_limit_s
        try:  # the evaluator stops itself at the limit; wait_for is the backstop
            return await asyncio.wait_for(
                asyncio.to_thread(calculate, str(expression), self.calculator_limits), limit + 1.0
            )
        except TimeoutError:
            raise CalculatorError(f"time limit of {limit:g} s exceeded") from None

    def prompt(self, task: Task) -> list[Message]:
        """System message with the tool description, then the question."""
        system = describe_tools(self.tools)
        if self.system_prompt:
            system = f"{self.system_prompt}\n\n{system}"
        return [
            Message(role="system", content=system),
            Message(role="user", content=_render(self.prompt_template, task)),
        ]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Start an episode on ``task`` (which must have a reference answer)."""
        if task.answer is None:
            raise EnvError(f"task {task.id}: math envs need a reference answer")
        return await super().reset(task, seed=seed)

    async def score(self, answer: str) -> tuple[float, dict[str, Any]]:
        """Reward of the final answer."""
        assert self.task is not None and self.task.answer is not None
        result = await verify_async(
            answer, self.task.answer, timeout_s=self.timeout_s, extract=self.extract
        )
        return result.score, _info(result)

    @classmethod
    def sample_tasks(
        cls, n: int, *, seed: int = 0, split: str = "train", source: str = "addition"
    ) -> list[Task]:
        """``n`` generated tasks; see :func:`generate_tasks`."""
        return generate_tasks(n, seed=seed, split=split, source=source)
