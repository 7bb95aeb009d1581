"""Task loading: records from JSONL, Parquet or any iterable of dicts, mapped onto :class:`Task`.

The math and code envs load their data sets through here. A source is a path (``.jsonl``/``.json``
with one object per line, ``.parquet`` when pyarrow is installed) or an iterable of mappings,
such as a Hugging Face ``datasets.Dataset`` or a list. Errors name the source, the row and the
field, because a data set with one bad row out of 50,000 should say which.

:func:`tasks_for` is the one task source of a run (the trainer and ``agentrl rollout``): the
config's task file when it names one, else the env's ``sample_tasks`` generator.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.errors import ConfigError
from agentrl.types import Task

if TYPE_CHECKING:
    from agentrl.config import TrainConfig

logger = logging.getLogger(__name__)

Source = str | os.PathLike[str] | Iterable[Mapping[str, Any]]
"""A ``.jsonl``/``.json``/``.parquet`` path, or records (dicts, a ``datasets.Dataset``)."""

_JSONL = (".jsonl", ".json", ".ndjson")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ConfigError(
                    f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}"
                )
            records.append(obj)
    return records


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    return list(pq.read_table(path).to_pylist())


def load_records(source: Source, *, limit: int | None = None) -> list[dict[str, Any]]:
    """Read records from ``source``.

    Args:
        source: a ``.jsonl``/``.json``/``.ndjson`` path (one object per line), a ``.parquet``
            path, or an iterable of mappings (a list, a generator, a ``datasets.Dataset``).
        limit: keep only the first ``limit`` records.

    Returns:
        The records as plain dicts, in order.

    Raises:
        ConfigError: the file is missing, has an unknown suffix, or a line is not a JSON object;
            a record of an iterable is not a mapping.
        ImportError: a Parquet file was given and pyarrow is not installed.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit: expected >= 0 or None, got {limit}")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"data source {path}: no such file")
        suffix = path.suffix.lower()
        if suffix in _JSONL:
            records = _read_jsonl(path)
        elif suffix == ".parquet":
            records = _read_parquet(path)
        else:
            raise ConfigError(
                f"data source {path}: expected a .jsonl, .json, .ndjson or "
                f".parquet file, got suffix {suffix!r}"
            )
        return records[:limit] if limit is not None else records
    if isinstance(source, (bytes, Mapping)):
        raise TypeError(
            f"source: expected a path or an iterable of records, got {type(source).__name__}"
        )
    records = []
    for i, row in enumerate(source):
        if limit is not None and i >= limit:
            break
        if not isinstance(row, Mapping):
            raise ConfigError(f"record {i}: expected a mapping, got {type(row).__name__}")
        records.append(dict(row))
    return records


def _field(row: Mapping[str, Any], name: str, where: str, what: str) -> Any:
    if name not in row:
        raise ConfigError(f"{where}: missing {what} field {name!r} (fields: {sorted(row)})")
    return row[name]


def _text(row: Mapping[str, Any], name: str, where: str, what: str) -> str:
    value = _field(row, name, where, what)
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # numeric answers (GSM8K-style) become their decimal text
    raise ConfigError(
        f"{where}: field {name!r}: expected a string or a number, got {type(value).__name__}"
    )


def load_tasks(
    source: Source,
    *,
    prompt_field: str = "question",
    answer_field: str | None = "answer",
    id_field: str | None = None,
    data_fields: Sequence[str] | None = None,
    limit: int | None = None,
) -> list[Task]:
    """Read ``source`` (see :func:`load_records`) and map each record onto a :class:`Task`.

    Args:
        source: a file path or an iterable of mappings.
        prompt_field: field holding the question shown to the agent.
        answer_field: field holding the reference answer (numbers become text); ``None`` for
            tasks without one (code tasks judged by tests).
        id_field: field holding a unique id; by default the record's index, as text.
        data_fields: fields copied into ``Task.data``; by default every other field.
        limit: keep only the first ``limit`` records.

    Returns:
        One task per record, in order.

    Raises:
        ConfigError: a record lacks a field, a field has the wrong type, or ids repeat; the
            message names the record and the field.
    """
    records = load_records(source, limit=limit)
    used = {prompt_field, answer_field, id_field} - {None}
    tasks, seen = [], set()
    for i, row in enumerate(records):
        where = f"{_describe(source)} record {i}"
        prompt = _text(row, prompt_field, where, "prompt")
        answer = None if answer_field is None else _text(row, answer_field, where, "answer")
        tid = str(i) if id_field is None else _text(row, id_field, where, "id")
        if tid in seen:
            raise ConfigError(f"{where}: id {tid!r} repeats an earlier record's")
        seen.add(tid)
        if data_fields is None:
            data = {k: v for k, v in row.items() if k not in used}
        else:
            data = {k: _field(row, k, where, "data") for k in data_fields}
        tasks.append(Task(id=tid, prompt=prompt, answer=answer, data=data))
    logger.info("loaded %d tasks from %s", len(tasks), _describe(source))
    return tasks


def _describe(source: Source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return type(source).__name__


def tasks_for(config: TrainConfig, split: str) -> list[Task]:
    """The tasks of a run's ``split``: from the config's file, else from the env's generator.

    ``train`` reads ``env.train_tasks`` and ``test`` reads ``env.eval_tasks`` (JSONL/Parquet,
    one task per record: ``env.prompt_field``, ``env.answer_field``, every other field goes to
    ``Task.data``); without a file, ``sample_tasks(env.num_train_tasks | env.num_eval_tasks,
    seed=config.seed, split=split, **env.task_kwargs)`` of the env's class.

    Raises:
        ConfigError: the env is unknown, a file is missing or malformed, or the env has no
            generator and no file was given (the message names the fields to set).
    """
    from agentrl.env import Env, env_class

    env = config.env
    key = "train_tasks" if split == "train" else "eval_tasks"
    path = getattr(env, key)
    if path is not None:
        try:
            return load_tasks(path, prompt_field=env.prompt_field, answer_field=env.answer_field)
        except ConfigError as e:
            raise ConfigError(f"env.{key}: {e}") from None
    cls = env_class(env.id)
    generator = getattr(cls, "sample_tasks", None)
    base = vars(Env)["sample_tasks"].__func__  # Env's own raises: the env has no generator
    if generator is None or getattr(generator, "__func__", None) is base:
        raise ConfigError(
            f"env.{key}: {env.id} has no built-in task generator (a sample_tasks classmethod); "
            f"give a JSONL file of tasks, one object per line with the fields named by "
            f"env.prompt_field ({env.prompt_field!r}) and env.answer_field "
            f"({env.answer_field!r}), as env.train_tasks=FILE and env.eval_tasks=FILE"
        )
    n = env.num_train_tasks if split == "train" else env.num_eval_tasks
    tasks: list[Task] = generator(n, seed=config.seed, split=split, **env.task_kwargs)
    return tasks
