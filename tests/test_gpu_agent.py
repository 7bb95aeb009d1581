"""The gpu-agent workload on a GPU (marked ``gpu``): three steps through ``agentrl train``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).parents[1]
AGENT_GPU = ROOT / "recipes" / "configs" / "agent-gpu.toml"


def test_three_steps_of_gpu_agent_through_agentrl_train(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "agentrl.cli",
        "train",
        str(AGENT_GPU),
        f"--run_dir={tmp_path}",
        "--train.steps=3",
        "--train.eval_every=0",
        "--cold_start.steps=50",
        "--env.num_eval_tasks=64",
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cold start on" in out.stdout and "4.0 assistant turns" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["env"] == "calc-chain-v0"
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "time/train_s" in r]
    assert len(steps) == 3
    assert all(r["time/sync_s"] > 0 for r in steps)
    # 50 cold-start steps at lr 3e-4 teach the call format: episodes go past one turn
    assert max(r["rollout/turns_mean"] for r in steps) > 1.0
    assert 0 <= summary["tool_use_frac"] <= 1 and summary["turns_mean"] >= 1
