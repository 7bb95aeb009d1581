"""benchmarks/algorithms.py: each loss's clip defaults, the plan of runs (the teacher reused, the
students' arms), the figures read back from a run's files, and ``--quick`` end to end (opt-in:
four real training processes take ~35 s on 2 cores, past the suite's budget)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "recipes"))

import _algorithm_results as results  # noqa: E402
import algorithms as bench  # noqa: E402


def test_spread_and_time_to_level() -> None:
    assert results.spread([0.5, 0.9, 0.7]) == {"median": 0.7, "min": 0.5, "max": 0.9, "n": 3}
    # a seed that never reached the level counts as infinite: median and max say "never"
    assert results.spread([30.0, None, None], 1) == {"median": None, "min": 30.0, "max": None,
                                                   "n": 1}  # fmt: skip
    assert results.spread([30.0, 50.0, None], 1) == {"median": 50.0, "min": 30.0, "max": None,
                                                   "n": 2}  # fmt: skip
    assert results.spread([None, None]) is None and results.spread([]) is None
    evals = [(0, 0.4, 0.0), (10, 0.79, 31.24), (20, 0.8, 60.06), (30, 0.95, 90.0)]
    assert results.time_to(evals, 0.8) == 60.1  # the first at or above, not the best
    assert results.time_to(evals, 0.3) == 0.0  # already there at RL start
    assert results.time_to(evals, 0.96) is None
    assert results.steps_to(evals, 0.8) == 20 and results.steps_to(evals, 0.96) is None


def test_each_loss_keeps_its_own_clip_defaults() -> None:
    assert bench.loss_defaults("gspo_token") == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert bench.loss_defaults("grpo") == {"eps_low": 0.2, "eps_high": 0.28}  # DAPO's clip-higher
    assert bench.loss_defaults("cispo") == {"eps_low": 1.0, "eps_high": 0.28}  # no lower bound
    assert bench.loss_defaults("dppo") == {"eps_low": 0.2, "eps_high": 0.2, "kl_coef": 1e-3}
    from math_agent import PRESETS  # the task's preset sets none, so the defaults apply

    assert {"eps_low", "eps_high"}.isdisjoint(PRESETS["cpu-tiny"]["learner"])


def _args(*argv: str) -> argparse.Namespace:
    ns = argparse.Namespace(
        task="cpu-tiny",
        arms=list(bench.ARMS),
        seeds=[0, 1, 2],
        steps=None,
        quick=False,
        override=[],
        rollout_correction=None,
        teacher=None,
        teacher_success=None,
        student_cold_start=0,
        distill_mode=None,
        teacher_temperature=None,
        distill_override=[],
        no_distill=False,
    )
    for item in argv:
        key, value = item.split("=", 1)
        setattr(ns, key, json.loads(value))
    return ns


def test_plan_reuses_the_gspo_token_run_as_teacher(tmp_path: Path) -> None:
    runs, teacher = bench.plan(_args(), tmp_path)
    assert len(runs) == 4 * 3 + 2 * 3  # arms x seeds, then distil and RL alone per seed
    assert runs[0] is teacher["run"] and (runs[0].arm, runs[0].seed) == ("gspo_token", 0)
    grpo = next(r for r in runs if r.arm == "grpo" and r.seed == 2)
    assert grpo.preset == "cpu-tiny" and grpo.args == ["--learner.loss=grpo"]
    distill = [r for r in runs if r.group == "distill"]
    assert [(r.arm, r.seed, r.needs_teacher) for r in distill] == [
        ("distill", 0, True), ("rl", 0, False), ("distill", 1, True), ("rl", 1, False),
        ("distill", 2, True), ("rl", 2, False)]  # fmt: skip
    assert all(r.preset == "cpu-tiny-distill" for r in distill)
    assert "--teacher.model=null" in distill[1].args  # RL alone: the same student, no teacher
    assert len({r.run_dir for r in runs}) == len(runs)
    # another task, or no GSPO-token arm: the teacher is a cpu-tiny run of its own
    runs, teacher = bench.plan(_args('task="cpu-tiny-tool"', "seeds=[3]"), tmp_path)
    assert teacher["run"].group == "teacher" and teacher["run"].preset == "cpu-tiny"
    runs, _ = bench.plan(_args("student_cold_start=200", "no_distill=false"), tmp_path)
    assert "--cold_start.steps=200" in runs[-1].args and "--cold_start.steps=200" in runs[-2].args
    # the distillation arm runs the preset's teacher settings unless told otherwise
    assert not any("temperature" in a or "teacher.mode=" in a for r in runs for a in r.args)
    runs, _ = bench.plan(_args('distill_mode="distill"'), tmp_path)
    assert [r.arm for r in runs if "--teacher.mode=distill" in r.args] == ["distill"] * 3
    # a tempered teacher: the distillation arm only, RL alone has no teacher to temper
    runs, _ = bench.plan(_args("teacher_temperature=0.5"), tmp_path)
    tempered = [r.arm for r in runs if "--teacher.temperature=0.5" in r.args]
    assert tempered == ["distill"] * 3
    runs, _ = bench.plan(_args('distill_override=["--learner.lr=0.0002"]'), tmp_path)
    lrs = [(r.arm, a) for r in runs if r.group == "distill" for a in r.args if "lr=" in a]
    assert lrs == [("distill", "--learner.lr=0.0002"), ("rl", "--learner.lr=0.0001")] * 3


def _write_run(run_dir: Path, seed: int, evals: list[float], clip: list[float]) -> None:
    """A run's files as the trainer writes them: start evaluation, steps, end evaluation."""
    run_dir.mkdir(parents=True)
    t = 1000.0 + seed
    recs = [{"step": 0, "time": t, "sft/loss": 1.0, "eval/success_rate": evals[0],
             "cold_start_s": 5.0}]  # fmt: skip
    for step, c in enumerate(clip, 1):
        rec = {"step": step, "time": t + 10 * step, "rollout/episodes": 256.0,
               "loss/clip_frac_tokens": c, "loss/clip_frac_seqs": 2 * c, "loss/approx_kl": c / 10,
               "loss/ratio_min": 1 - c, "loss/ratio_max": 1 + c}  # fmt: skip
        if step == 1:
            rec["eval/success_rate"] = evals[1]
        recs.append(rec)
    recs.append({"step": len(clip), "time": t + 10 * len(clip) + 2, "eval/success_rate": evals[2]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = {"success_start": evals[0], "success_end": evals[2], "steps": len(clip),
               "wall_s": 50.0 + seed, "rl_wall_s": 40.0 + seed, "cold_start_s": 5.0,
               "warnings": {}}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_figures_read_back_from_run_files(tmp_path: Path) -> None:
    runs = []
    for seed, evals, clip in ((0, [0.4, 0.85, 0.9], [0.1, 0.3]), (1, [0.5, 0.6, 0.82], [0.2, 0.2]),
                              (2, [0.3, 0.5, 0.7], [0.0, 0.0])):  # fmt: skip
        d = tmp_path / f"s{seed}"
        _write_run(d, seed, evals, clip)
        run = results.Run("arms", "grpo", seed, "cpu-tiny", [], d)
        run.result = results.parse_run(d)
        runs.append(run)
    r0 = runs[0].result
    assert r0 is not None
    assert r0["eval"] == [(0, 0.4, 0.0), (1, 0.85, 10.0), (2, 0.9, 22.0)]
    assert r0["clip_frac_tokens"] == pytest.approx(0.2) and r0["clip_frac_seqs"] == pytest.approx(
        0.4
    )
    assert r0["ratio_var"] == pytest.approx(2 * 0.02)  # 2 x the mean k3
    assert (r0["ratio_min"], r0["ratio_max"]) == (0.7, 1.3)
    s = results.summarise(runs, 0.8)
    assert s["eval"]["1"] == {"median": 0.6, "min": 0.5, "max": 0.85, "n": 3}
    assert s["success_end"] == {"median": 0.82, "min": 0.7, "max": 0.9, "n": 3}
    assert s["time_to_level_s"] == {"median": 22.0, "min": 10.0, "max": None, "n": 2}
    assert s["reached_level"] == 2 and s["failed"] == []
    assert s["clip_frac_tokens"]["max"] == pytest.approx(0.2)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("AGENTRL_BENCH_ALGORITHMS") != "1",
    reason="~35 s of four training processes; AGENTRL_BENCH_ALGORITHMS=1 runs it",
)
def test_quick_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "algorithms.py"), "--quick",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert sum(ln.startswith("[progress] done") for ln in lines) == 4
    report = json.loads(lines[-1])
    assert list(report["arms"]) == ["gspo_token", "cispo"] and report["seeds"] == [0]
    for arm in report["arms"].values():
        assert set(arm["eval"]) == {"0", "1", "2"} and arm["failed"] == []
    d = report["distill"]
    assert d["teacher"].endswith("arms/gspo_token-s0/export")
    assert d["distill"]["reverse_kl_first"]["median"] > 0  # the teacher scored the student
    assert d["distill"]["clip_frac_tokens"] is not None and d["rl"]["reverse_kl_first"] is None
    assert report["machine"]["cores"] >= 1 and report["failed"] == {}
