"""The code agent's gpu-small preset on a GPU (marked ``gpu``): 3 steps through agentrl train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "recipes" / "configs" / "code-gpu-small.toml"


def test_three_steps_of_code_gpu_small_through_agentrl_train(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(CONFIG), f"--run_dir={tmp_path}",
           "--train.steps=3", "--train.eval_every=0", "--cold_start.steps=50",
           "--env.num_eval_tasks=32"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["env"] == "code-fn-v0"
    assert "cold start on" in out.stdout  # demonstrated solutions were found and trained on
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in lines if "time/train_s" in r]) == 3
