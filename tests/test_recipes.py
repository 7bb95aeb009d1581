"""Recipe smoke tests: each script runs end to end in a subprocess with tiny settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run_recipe(name: str, run_dir: Path, *overrides: str) -> dict:
    cmd = [sys.executable, str(ROOT / "recipes" / name), "--preset", "cpu-tiny",
           f"run_dir={run_dir}", *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                              "HOME": str(run_dir)})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] >= 1
    assert "held-out success at end" in out.stdout
    for name in ("metrics.jsonl", "config.yaml", "reward.png"):
        assert (run_dir / name).stat().st_size > 0
    return summary


@pytest.mark.slow
def test_math_recipe_smoke(tmp_path: Path) -> None:
    run_recipe("math_agent.py", tmp_path, "train.steps=2", "train.tasks_per_step=4",
               "cold_start.steps=20", "env.num_eval_tasks=8", "rollout.group_size=4")


@pytest.mark.slow
def test_code_recipe_smoke(tmp_path: Path) -> None:
    run_recipe("code_agent.py", tmp_path, "train.steps=1", "train.tasks_per_step=2",
               "env.num_eval_tasks=2", "rollout.group_size=2", "rollout.max_new_tokens=24")
