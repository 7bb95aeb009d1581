"""``inference.engine_gpus=1`` on two cards (marked ``gpu``): learner on card 0, engine on 1."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from agentrl.config import load_config
from agentrl.loop.trainer import Trainer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).parents[1]
GPU_SMALL = ROOT / "recipes" / "configs" / "arith-gpu-small.toml"
SIGNAL = "advantages.shapers=[{name: format, penalty: 0.1}]"  # a signal every step


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_dedicated_engine_on_the_second_card(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    config = load_config(GPU_SMALL, [
        f"run_dir={tmp_path}", "train.steps=3", "cold_start.steps=0", "train.eval_every=0",
        "train.export=false", SIGNAL, "inference.engine_gpus=1",
    ])  # fmt: skip
    seen: list[int] = []

    def on_step(rec: dict[str, float]) -> None:
        if not seen and (tmp_path / "engines" / "engines.json").exists():
            pids = json.loads((tmp_path / "engines" / "engines.json").read_text())["pids"]
            seen.extend(p for p in pids if alive(p))

    trainer = Trainer(config, on_step=on_step)
    assert trainer.learner.device == torch.device("cuda", 0)
    engines = json.loads((tmp_path / "engines" / "engines.json").read_text())
    assert len(engines["cards"]) == 1 and engines["cards"][0] != "0"  # not the learner's card
    summary = asyncio.run(trainer.run())
    assert summary["steps"] == 3 and seen
    assert not wait_gone(seen, 30)  # stopped with the run
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "rollout/episodes" in m]
    assert len(steps) == 3 and all(m["time/sync_s"] > 0 for m in steps)  # NCCL pushes
    assert any("perf/tokens" in m for m in steps) and all(m["staleness/max"] <= 1 for m in steps)
    assert not (tmp_path / "weights").exists()  # nothing through the disk
    records = [json.loads(ln) for ln in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    last = [r["trajectory"] for r in records if r["step"] == 3]
    assert last and all(max(t["versions"]) >= 1 for t in last)  # pushed versions were served
