"""Recipe smoke tests: each script runs end to end in a subprocess with tiny settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run_recipe(name: str, run_dir: Path, *overrides: str, preset: str = "cpu-tiny") -> dict:
    cmd = [sys.executable, str(ROOT / "recipes" / name), "--preset", preset,
           f"run_dir={run_dir}", *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                              "HOME": str(run_dir)})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] >= 1
    assert "held-out success at end" in out.stdout
    summary["stdout"], summary["stderr"] = out.stdout, out.stderr
    for name in ("metrics.jsonl", "config.yaml", "reward.png"):
        assert (run_dir / name).stat().st_size > 0
    return summary


@pytest.mark.slow
def test_math_recipe_smoke(tmp_path: Path) -> None:
    run_recipe("math_agent.py", tmp_path, "train.steps=2", "train.tasks_per_step=4",
               "cold_start.steps=20", "env.num_eval_tasks=8", "rollout.group_size=4")


@pytest.mark.slow
def test_math_recipe_tool_demo_smoke(tmp_path: Path) -> None:
    """`make demo`'s preset, a few steps: cold start progress, tool figures in the summary."""
    s = run_recipe("math_agent.py", tmp_path, "train.steps=2", "train.tasks_per_step=2",
                   "cold_start.steps=4", "cold_start.check_every=2", "cold_start.batch_size=8",
                   "env.num_train_tasks=16", "env.num_eval_tasks=4", "rollout.group_size=4",
                   "env.task_kwargs.digits=2", preset="cpu-tiny-tool")
    assert s["env"] == "add-tool-v0"
    assert s["turns_mean"] >= 1 and 0 <= s["tool_use_frac"] <= 1 and s["tool_calls_mean"] >= 0
    for row in ("turns per episode at end", "tool calls per episode at end",
                "episodes that used the tool"):
        assert row in s["stdout"]
    assert "cold start on 16 demonstrations: 2.0 assistant turns" in s["stdout"]
    assert "cold start step 4: loss" in s["stdout"]
    assert "cold start 4/4 (100%)" in s["stderr"]  # the bar's progress


@pytest.mark.slow
def test_math_recipe_gpu_agent_dry_run_on_cpu(tmp_path: Path) -> None:
    """gpu-agent shrunk onto the CPU: 4-turn demonstrations with the tools, then 2 RL steps."""
    s = run_recipe("math_agent.py", tmp_path, "model.tiny={}", "model.device=cpu",
                   "train.steps=2", "train.tasks_per_step=2", "cold_start.steps=2",
                   "cold_start.check_every=2", "cold_start.batch_size=4",
                   "env.num_train_tasks=8", "env.num_eval_tasks=2", "rollout.group_size=2",
                   "rollout.max_new_tokens=8", "inference.max_batch_size=16",
                   "learner.micro_batch_tokens=2048", preset="gpu-agent")
    assert s["env"] == "calc-chain-v0" and s["steps"] == 2
    assert "cold start on 8 demonstrations: 4.0 assistant turns" in s["stdout"]
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("sft/assistant_turns_mean") == 4.0 for r in rows)
    ends = [r for r in rows if "eval/tool_use_frac" in r]
    assert ends and all(r["eval/turns_mean"] >= 1 for r in ends)
    assert 0 <= s["tool_use_frac"] <= 1 and s["turns_mean"] >= 1


@pytest.mark.slow
def test_code_recipe_smoke(tmp_path: Path) -> None:
    run_recipe("code_agent.py", tmp_path, "train.steps=1", "train.tasks_per_step=2",
               "env.num_eval_tasks=2", "rollout.group_size=2", "rollout.max_new_tokens=24")
