"""One assembly step (``agentrl.loop.assemble``): a trainer runs on parts handed in by hand."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from agentrl.config import load_config
from agentrl.loop.assemble import assemble
from agentrl.loop.placement import load_policy, make_local_engine
from agentrl.loop.trainer import Trainer

TIMING = ("time", "time/", "perf/", "cold_start_s", "rollout/generate_s")


def quick(run_dir: Path) -> dict:
    return {
        "run_dir": str(run_dir),
        "seed": 5,
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_train_tasks": 16,
                "num_eval_tasks": 4},
        "rollout": {"group_size": 2, "max_turns": 1, "max_new_tokens": 3, "max_total_tokens": 40},
        "cold_start": {"steps": 0},
        # every sampled token of a 3-token reply is pushed down: a signal without a cold start
        "advantages": {"shapers": [{"name": "overlong", "max_tokens": 3, "cache": 2}]},
        "learner": {"lr": 1e-3},
        "train": {"steps": 2, "tasks_per_step": 2, "eval_every": 0, "checkpoint_every": 0,
                  "max_staleness": 0},
    }  # fmt: skip


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(ln).items() if not k.startswith(TIMING)} for ln in lines]


def test_a_trainer_runs_on_parts_made_by_hand(tmp_path: Path) -> None:
    """The policy and engine made by hand: the run matches the one assembled from the config."""
    asyncio.run(Trainer(load_config(quick(tmp_path / "assembled"))).run())

    config = load_config(quick(tmp_path / "by-hand"))
    model, tokenizer = load_policy(config)
    engine = make_local_engine(model, tokenizer, config)
    parts = assemble(config, policy=(model, tokenizer), client=engine)
    assert parts.model is model and parts.learner.model is model
    assert parts.client is engine and parts.rollout.client is parts.evaluator.client is engine
    with pytest.raises(ValueError, match="parts"):  # resume goes to assemble, with the parts
        Trainer(config, resume=True, parts=parts)
    trainer = Trainer(config, parts=parts)
    summary = asyncio.run(trainer.run())

    assert summary["steps"] == 2 and trainer.client is engine
    assert engine.weight_version == 2  # type: ignore[attr-defined]  # it got every push
    served = engine.model.state_dict()  # type: ignore[attr-defined]
    for name, value in served.items():  # it serves the trained policy
        assert torch.equal(value, trainer.learner.model.state_dict()[name].to(value.dtype))
    by_hand = records(tmp_path / "by-hand")
    assert [r["loss/num_tokens"] for r in by_hand if "loss/policy" in r] == [12.0, 12.0]
    assert by_hand == records(tmp_path / "assembled")  # every figure, to the last bit
