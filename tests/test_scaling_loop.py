"""``benchmarks/scaling_gpu.py --loop``: the loop's weak and strong scaling and per-rank profile.

The dry run is the GPU run's code path on two gloo ranks with a tiny model: one torchrun launch
per rank count, a Trainer per measurement, untimed warm-up steps, then the timed ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _scaling_loop  # noqa: E402


def _run(gpus: int, mode: str, tps: float) -> dict[str, object]:
    return {"workload": "gen", "mode": mode, "gpus": gpus, "tasks": 16, "tokens_per_s": tps,
            "profile": [{"step_s": 1.0}] * gpus}  # fmt: skip


def test_figures_are_weak_efficiency_and_strong_speedup() -> None:
    results = [_run(1, "base", 1000.0), _run(2, "weak", 1800.0), _run(2, "strong", 1600.0),
               _run(4, "weak", 3400.0), _run(4, "strong", 2000.0)]  # fmt: skip
    out = _scaling_loop.figures(results)
    assert out["loop_weak_efficiency_2"] == {"gen": 0.9}
    assert out["loop_strong_speedup_2"] == {"gen": 1.6}
    assert out["loop_weak_efficiency_4"] == {"gen": 0.85}
    assert out["loop_strong_speedup_4"] == {"gen": 2.0}
    assert out["loop_tokens_per_s"]["gen"] == {"base-1": 1000.0, "weak-2": 1800.0,
                                               "strong-2": 1600.0, "weak-4": 3400.0,
                                               "strong-4": 2000.0}  # fmt: skip
    assert len(out["loop_profile"]["gen"]["weak-4"]) == 4


def test_plan_scales_tasks_with_cards_for_weak_scaling_only() -> None:
    args = type("A", (), {"loop_workloads": ["short", "gen"], "loop_short_tasks": 64,
                          "loop_gen_tasks": 16})()  # fmt: skip
    assert _scaling_loop.plan(args, 1) == [
        {"workload": "short", "mode": "base", "tasks": 64},
        {"workload": "gen", "mode": "base", "tasks": 16},
    ]
    assert [m["tasks"] for m in _scaling_loop.plan(args, 4)] == [256, 64, 64, 16]


def test_dedicated_layout_is_compared_with_colocated_strong_scaling() -> None:
    args = type("A", (), {"loop_workloads": ["gen"], "loop_short_tasks": 64,
                          "loop_gen_tasks": 16})()  # fmt: skip
    assert _scaling_loop.plan(args, 4, dedicated=True) == [
        {"workload": "gen", "mode": "dedicated", "tasks": 16, "cards": 4, "engine_gpus": 2}
    ]
    results = [_run(1, "base", 1000.0), _run(2, "strong", 1600.0), _run(2, "dedicated", 2000.0)]
    assert _scaling_loop.figures(results)["loop_dedicated_vs_colocated_2"] == {"gen": 1.25}


def test_tokens_per_s_is_the_timed_steps_tokens_over_their_time() -> None:
    # the overlapped loop's steps: one takes a batch that finished during the update, the next
    # waits for a tail; the median of the steps' own ratios (58.6k) would say nothing
    steps = [{"tokens": 137_822.0, "step_s": 2.35}, {"tokens": 212_913.0, "step_s": 76.64}]
    steps = [{**s, **{k: 0.0 for k in _scaling_loop.PARTS}} for s in steps]
    per_rank = [{"workload": "gen", "mode": "base", "gpus": 1, "tasks": 16, "steps": steps}]
    assert _scaling_loop.summary(per_rank)["tokens_per_s"] == pytest.approx(350_735 / 78.99, 1e-4)


@pytest.mark.slow
def test_loop_dry_run_on_two_gloo_ranks(tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / "scaling_gpu.py"
    cmd = [sys.executable, str(script), "--dry-run", "--no-learner", "--no-push",
           "--gpus", "1", "2", "--loop-workloads", "short", "--loop-dedicated",
           "--loop-max-staleness", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loop_errors"] == []
    assert 0 < out["loop_weak_efficiency_2"]["short"] < 2
    assert 0 < out["loop_strong_speedup_2"]["short"] < 3
    assert "loop_weak_efficiency_4" not in out  # two ranks at most in the dry run
    prof = out["loop_profile"]["short"]
    assert sorted(prof) == ["base-1", "dedicated-2", "strong-2", "weak-2"]
    assert 0 < out["loop_dedicated_vs_colocated_2"]["short"] < 5  # 1 learner + 1 served engine
    for label, ranks in prof.items():
        assert len(ranks) == (1 if label == "dedicated-2" else int(label[-1]))  # one per rank
        for p in ranks:  # the parts add up to the step (other_s is the rest)
            parts = sum(p[k] for k in _scaling_loop.PARTS)
            assert parts == pytest.approx(p["step_s"], abs=2e-3), (label, p)
            assert p["generate_s"] > 0 and p["update_s"] > 0 and p["other_s"] > -1e-3
    assert all(r[0]["gather_s"] == 0.0 for r in [prof["base-1"]])  # one rank gathers nothing
    assert "rank:" in proc.stdout and "generate" in proc.stdout  # the printed profile
