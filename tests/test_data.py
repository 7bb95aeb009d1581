"""Task loading from JSONL, Parquet and iterables of dicts; errors that name the row and field."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentrl.data import load_records, load_tasks
from agentrl.errors import ConfigError
from agentrl.types import Task

ROWS = [
    {"question": "1+1?", "answer": 2, "level": 1},
    {"question": "Half of 1?", "answer": "\\frac{1}{2}", "level": 3},
    {"question": "Pi?", "answer": 3.14, "level": 2},
]


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_records_and_tasks(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "d.jsonl", [json.dumps(ROWS[0]), "", json.dumps(ROWS[1]), json.dumps(ROWS[2])]
    )
    assert load_records(path) == ROWS
    assert load_records(str(path), limit=2) == ROWS[:2]
    tasks = load_tasks(path)
    assert tasks == [
        Task(id="0", prompt="1+1?", answer="2", data={"level": 1}),
        Task(id="1", prompt="Half of 1?", answer="\\frac{1}{2}", data={"level": 3}),
        Task(id="2", prompt="Pi?", answer="3.14", data={"level": 2}),
    ]


def test_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    bad = _jsonl(tmp_path / "bad.jsonl", [json.dumps(ROWS[0]), "{oops"])
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not valid JSON"):
        load_records(bad)
    arr = _jsonl(tmp_path / "arr.jsonl", ["[1, 2]"])
    with pytest.raises(ConfigError, match=r"arr\.jsonl:1: expected a JSON object, got list"):
        load_records(arr)
    with pytest.raises(ConfigError, match="no such file"):
        load_records(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="got suffix '.csv'"):
        load_records(tmp_path / "d.csv")


def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {"problem": r["question"], "solution": str(r["answer"]), "uid": f"u{i}"}
        for i, r in enumerate(ROWS)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    tasks = load_tasks(
        tmp_path / "d.parquet", prompt_field="problem", answer_field="solution", id_field="uid"
    )
    assert [(t.id, t.prompt, t.answer, t.data) for t in tasks] == [
        ("u0", "1+1?", "2", {}),
        ("u1", "Half of 1?", "\\frac{1}{2}", {}),
        ("u2", "Pi?", "3.14", {}),
    ]


def test_parquet_without_pyarrow_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` fail
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="needs pyarrow.*pip install pyarrow"):
        load_records(path)


class _DatasetLike:
    """Iterates dicts, as a Hugging Face ``datasets.Dataset`` does."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)


def test_iterables_of_dicts() -> None:
    assert load_records(ROWS) == ROWS
    assert load_records(r for r in ROWS) == ROWS
    tasks = load_tasks(_DatasetLike(ROWS), data_fields=[])
    assert [t.answer for t in tasks] == ["2", "\\frac{1}{2}", "3.14"] and tasks[0].data == {}
    assert load_records(_DatasetLike(ROWS), limit=1) == ROWS[:1]
    with pytest.raises(ConfigError, match="record 1: expected a mapping, got list"):
        load_records([ROWS[0], [1, 2]])
    with pytest.raises(TypeError, match="expected a path or an iterable of records"):
        load_records(ROWS[0])  # a single dict is not a data set


def test_field_mapping_and_data_fields() -> None:
    rows = [{"q": "x?", "a": "1", "id": "k1", "tests": ["t"], "meta": {"s": 1}}]
    (task,) = load_tasks(
        rows, prompt_field="q", answer_field="a", id_field="id", data_fields=["tests"]
    )
    assert task == Task(id="k1", prompt="x?", answer="1", data={"tests": ["t"]})
    (no_answer,) = load_tasks(rows, prompt_field="q", answer_field=None)
    assert no_answer.answer is None and no_answer.data == {
        "a": "1",
        "id": "k1",
        "tests": ["t"],
        "meta": {"s": 1},
    }


def test_errors_name_the_record_and_the_field(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"list record 1: missing answer field 'answer' "
        r"\(fields: \['question'\]\)",
    ):
        load_tasks([ROWS[0], {"question": "q"}])
    path = _jsonl(tmp_path / "d.jsonl", [json.dumps({"question": ["a"], "answer": "1"})])
    with pytest.raises(
        ConfigError,
        match=r"d\.jsonl record 0: field 'question': expected a "
        r"string or a number, got list",
    ):
        load_tasks(path)
    with pytest.raises(
        ConfigError, match="record 0: field 'answer': expected a string or a number, got bool"
    ):
        load_tasks([{"question": "q", "answer": True}])
    with pytest.raises(ConfigError, match="record 2: id 'a' repeats"):
        load_tasks(
            [{"question": "q", "answer": "1", "id": i} for i in ["a", "b", "a"]], id_field="id"
        )
    with pytest.raises(ConfigError, match="record 0: missing data field 'tests'"):
        load_tasks([{"question": "q", "answer": "1"}], data_fields=["tests"])
