"""The training loop on CPU: exact resume, the run directory, learning that comes from reward."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.trainer import Trainer

TIMING = ("time", "time/", "perf/", "cold_start_s", "rollout/generate_s")


def tiny_run(run_dir: Path, **sections) -> dict:
    base = {
        "run_dir": str(run_dir),
        "seed": 3,
        "env": {
            "id": "arith-v0",
            "task_kwargs": {"digits": 1},
            "num_train_tasks": 256,
            "num_eval_tasks": 32,
        },
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "cold_start": {"steps": 40, "lr": 2e-3, "batch_size": 32},
        "learner": {"lr": 1e-4, "num_minibatches": 2},
        "train": {"steps": 4, "tasks_per_step": 8, "eval_every": 2, "checkpoint_every": 2},
    }
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return base


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(ln).items() if not k.startswith(TIMING)} for ln in lines]


def test_resume_continues_exactly(tmp_path: Path) -> None:
    full = tmp_path / "full"
    asyncio.run(Trainer(load_config(tiny_run(full))).run())
    part = tmp_path / "part"
    asyncio.run(Trainer(load_config(tiny_run(part, train={"steps": 2}))).run())
    # simulate a crash after step 3 was logged but before its checkpoint
    with (part / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "rollout/reward_mean": -1}) + "\n")
    summary = asyncio.run(Trainer(load_config(tiny_run(part)), resume=True).run())
    a, b = records(full), records(part)
    # (a step that is the last of its process logs its evaluation on a line of its own)
    steps_a = [
        {k: v for k, v in r.items() if not k.startswith("eval/")}
        for r in a
        if "rollout/reward_mean" in r
    ]
    steps_b = [
        {k: v for k, v in r.items() if not k.startswith("eval/")}
        for r in b
        if "rollout/reward_mean" in r
    ]
    assert [r["step"] for r in steps_b] == [1, 2, 3, 4]
    assert steps_a == steps_b
    assert a[-1] == b[-1]  # the final evaluation
    assert summary["steps"] == 4
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "trajectories.jsonl",
        "summary.json",
        "reward.png",
    ):
        assert (part / name).stat().st_size > 0
    s = json.loads((part / "summary.json").read_text())
    assert {"success_start", "success_end", "steps", "wall_s"} <= set(s)


def test_trajectories_record_what_the_update_saw(tmp_path: Path) -> None:
    asyncio.run(Trainer(load_config(tiny_run(tmp_path, train={"steps": 1}))).run())
    lines = [json.loads(ln) for ln in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert lines, "a step with signal writes its trajectories"
    for rec in lines:
        t = rec["trajectory"]
        assert len(rec["advantages"]) == len(t["tokens"]) == len(rec["trainer_logprobs"])
        for m, adv, lp, tlp in zip(
            t["loss_mask"], rec["advantages"], t["logprobs"], rec["trainer_logprobs"], strict=True
        ):
            if m:
                assert abs(tlp - lp) < 1e-3  # engine and trainer agree in float32
            else:
                assert adv == 0.0


def test_bad_config_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_config(tiny_run(tmp_path, rollout={"group_size": 0}))
    with pytest.raises(ConfigError, match="train.stepz"):
        load_config(tiny_run(tmp_path), ["train.stepz=3"])
    with pytest.raises(ConfigError, match="resume needs"):
        Trainer(load_config({"env": {"id": "arith-v0"}}), resume=True)
