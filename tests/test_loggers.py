"""``train.loggers``: one real tiny run logged to W&B (offline), Trackio (a local store) and
TensorBoard (the ``tensorboard: true`` alias) under metrics.jsonl's names; no network."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.loop.loggers import COLUMNS, logger_names, sample_rows

CONFIG = """
name = "logged"
seed = 3
tensorboard = true
[env]
id = "arith-v0"
task_kwargs = { digits = 1 }
num_train_tasks = 64
num_eval_tasks = 4
[rollout]
group_size = 2
max_turns = 1
max_new_tokens = 4
max_total_tokens = 48
[cold_start]
steps = 2
batch_size = 8
[learner]
num_minibatches = 1
[train]
steps = 2
tasks_per_step = 2
eval_every = 1
checkpoint_every = 0
loggers = ["wandb", "trackio"]
"""


def wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file (LevelDB log format: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, records, part = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()  # type: ignore[attr-defined]
            rec.ParseFromString(part)
            records.append(rec)
            part = b""
    return records


def test_a_run_logs_the_same_metrics_to_wandb_trackio_and_tensorboard(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(CONFIG)
    home = tmp_path / "home"
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_CONFIG_DIR": str(home),
        "WANDB_CACHE_DIR": str(home),
        "WANDB_DATA_DIR": str(home),
        "WANDB_API_KEY": "",
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "HF_HUB_OFFLINE": "1",
    }
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "run.toml", "--run_dir=run"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Trackio" not in out.stdout  # its banner stays out of the summary
    run_dir = tmp_path / "run"
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    jsonl_keys = {k for ln in lines for k, v in ln.items() if k not in ("step", "time")}
    assert {"rollout/reward_mean", "eval/success_rate", "sft/loss"} <= jsonl_keys

    # W&B, offline: the run's files under run/wandb, every metrics.jsonl key, config, tables
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    recs = wandb_records(wandb_file)
    logged: set[str] = set()
    steps: list[int] = []
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            # a table's fields come as nested keys under its name
            row = {i.key or i.nested_key[0]: json.loads(i.value_json) for i in r.history.item}
            logged |= set(row)
            steps.append(row["step"])
    assert jsonl_keys <= logged
    assert "samples" in logged and max(steps) == 2
    (run_rec,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run_rec.config.update}
    assert config["train"]["loggers"] == ["jsonl", "wandb", "trackio"]
    assert config["env"]["id"] == "arith-v0"
    tables = list((run_dir / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    table = json.loads(max(tables, key=lambda p: p.stat().st_mtime).read_text())
    assert table["columns"] == COLUMNS
    assert table["data"] and {row[0] for row in table["data"]} == {2}
    assert all("user:" in row[-1] for row in table["data"])

    # Trackio, from its local store: the same names and steps, the config, the sample table
    probe = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage as S; "
        "name = S.get_runs('agentrl')[0]; "
        "print(json.dumps([name, S.get_logs('agentrl', name), S.get_run_config('agentrl', name)]))"
    )
    read = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60
    )
    assert read.returncode == 0, read.stderr[-2000:]
    name, logs, config = json.loads(read.stdout.strip().splitlines()[-1])
    assert name == "run" and config["train"]["tasks_per_step"] == 2
    assert jsonl_keys <= {k for row in logs for k in row}
    rewards = [
        (row["step"], row["rollout/reward_mean"]) for row in logs if "rollout/reward_mean" in row
    ]
    assert rewards == [
        (ln["step"], ln["rollout/reward_mean"]) for ln in lines if "rollout/reward_mean" in ln
    ]
    samples = [row for row in logs if "samples" in row]
    assert samples and samples[-1]["samples"]["_type"] == "trackio.table"
    assert set(samples[-1]["samples"]["_value"][0]) == set(COLUMNS)

    # TensorBoard through the old alias
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_loggers_are_named_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_config(None).train.loggers == ["jsonl"]
    cfg = load_config(None, ["--train.loggers=wandb,trackio,wandb"])
    assert cfg.train.loggers == ["jsonl", "wandb", "trackio"]
    with pytest.raises(ConfigError, match=r"train.loggers\[1\].*did you mean 'wandb'"):
        load_config(None, ["--train.loggers=[wandbb]"])
    assert logger_names(["jsonl"], tensorboard=True) == ["tensorboard"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ConfigError) as err:
        logger_names(["jsonl", "wandb"])
    assert str(err.value) == (
        "train.loggers: wandb needs the wandb package: pip install 'agentrl[wandb]'"
    )


def test_sample_rows_read_the_newest_step_from_a_bounded_tail(tmp_path: Path) -> None:
    path = tmp_path / "trajectories.jsonl"
    messages = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    traj = {"task_id": "t", "reward": 1.0, "turns": [{}], "finish_reason": "terminated",
            "messages": messages}  # fmt: skip
    with path.open("w") as f:
        for step in (1, 2, 2, 2):
            f.write(json.dumps({"step": step, "kind": "trained", "trajectory": traj}) + "\n")
    step, rows = sample_rows(path, limit=2)
    assert step == 2 and len(rows) == 2
    assert rows[0] == [2, "trained", "t", 1.0, 1, "terminated", "", "user: 1+1\nassistant: 2"]
    assert sample_rows(tmp_path / "missing.jsonl") == (-1, [])
