"""What ``benchmarks/algorithms.py`` reads back from its training runs, and its figures over seeds.

One :class:`Run` is one training subprocess; :func:`parse_run` reads a finished run's
``metrics.jsonl`` and ``summary.json``; :func:`summarise` gives an arm's medians and min-max over
its seeds (a seed that never reached a level counts as infinite).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Run:
    """One training run (a subprocess) and what was read back from it."""

    group: str  # "arms" or "distill"
    arm: str
    seed: int
    preset: str
    args: list[str]
    run_dir: Path
    needs_teacher: bool = False
    proc: subprocess.Popen[bytes] | None = None
    t0: float = 0.0
    result: dict[str, Any] | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.group}/{self.arm}/s{self.seed}"


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in records if key in r and math.isfinite(float(r[key]))]
    return statistics.fmean(vals) if vals else None


def parse_run(run_dir: Path) -> dict[str, Any]:
    """The figures of one finished run from its ``metrics.jsonl`` and ``summary.json``."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    start = next(r for r in records if "cold_start_s" in r)  # the evaluation at RL start
    t_rl = float(start["time"])
    evals = [(int(r["step"]), float(r["eval/success_rate"]), float(r["time"]) - t_rl)
             for r in records if "eval/success_rate" in r and r["time"] >= t_rl]  # fmt: skip
    steps = [r for r in records if "loss/clip_frac_tokens" in r or "rollout/episodes" in r]
    approx_kl = _mean(steps, "loss/approx_kl")
    kl = [r["distill/reverse_kl_mean"] for r in steps if "distill/reverse_kl_mean" in r]
    return {
        "success_start": summary["success_start"],
        "success_end": summary["success_end"],
        "steps": summary["steps"],
        "eval": evals,  # (step, held-out success, RL seconds at the evaluation's end)
        "clip_frac_tokens": _mean(steps, "loss/clip_frac_tokens"),
        "clip_frac_seqs": _mean(steps, "loss/clip_frac_seqs"),
        "masked_token_frac": _mean(steps, "mismatch/masked_token_frac"),
        "masked_seq_frac": _mean(steps, "mismatch/masked_seq_frac"),
        "ratio_var": None if approx_kl is None else 2.0 * approx_kl,
        "ratio_min": min(
            (r["loss/ratio_min"] for r in steps if "loss/ratio_min" in r), default=None
        ),
        "ratio_max": max(
            (r["loss/ratio_max"] for r in steps if "loss/ratio_max" in r), default=None
        ),
        "mismatch_mean_abs": _mean(steps, "mismatch/numeric_mean_abs"),
        "reverse_kl_first": kl[0] if kl else None,
        "reverse_kl_last": kl[-1] if kl else None,
        "no_signal_steps": summary.get("warnings", {}).get("no_learning_signal", 0),
        "wall_s": summary["wall_s"],
        "rl_wall_s": summary["rl_wall_s"],
        "cold_start_s": summary["cold_start_s"],
    }


def time_to(evals: list[tuple[int, float, float]], level: float) -> float | None:
    """RL seconds to the first evaluation at or above ``level`` (``None``: never)."""
    return next((round(t, 1) for _, s, t in evals if s >= level - 1e-9), None)


def steps_to(evals: list[tuple[int, float, float]], level: float) -> int | None:
    """RL steps to the first evaluation at or above ``level`` (``None``: never)."""
    return next((step for step, s, _ in evals if s >= level - 1e-9), None)


def spread(values: list[float | None], digits: int = 4) -> dict[str, Any] | None:
    """Median and min-max over seeds; a ``None`` (never reached) counts as infinite."""
    known = [v for v in values if v is not None]
    if not values or not known:
        return None
    inf = [math.inf if v is None else v for v in values]
    med = statistics.median(inf)
    return {
        "median": round(med, digits) if math.isfinite(med) else None,
        "min": round(min(known), digits),
        "max": round(max(inf), digits) if math.isfinite(max(inf)) else None,
        "n": len(known),
    }


def summarise(runs: list[Run], level: float) -> dict[str, Any]:
    """One arm's figures over its seeds."""
    ok = [r.result for r in runs if r.result is not None]
    out: dict[str, Any] = {
        "seeds": [r.seed for r in runs],
        "failed": [r.name for r in runs if r.result is None],
    }
    if not ok:
        return out
    for key in ("success_start", "success_end", "clip_frac_tokens", "clip_frac_seqs",
                "masked_token_frac", "masked_seq_frac", "ratio_var", "mismatch_mean_abs",
                "reverse_kl_first", "reverse_kl_last", "wall_s", "rl_wall_s"):  # fmt: skip
        out[key] = spread([r[key] for r in ok], 6 if "frac" in key or "var" in key else 4)
    out["ratio_min"] = min((r["ratio_min"] for r in ok if r["ratio_min"] is not None), default=None)
    out["ratio_max"] = max((r["ratio_max"] for r in ok if r["ratio_max"] is not None), default=None)
    steps = sorted({s for r in ok for s, _, _ in r["eval"]})
    out["eval"] = {str(s): spread([next((v for st, v, _ in r["eval"][::-1] if st == s), None)
                                   for r in ok]) for s in steps}  # fmt: skip
    times = [time_to(r["eval"], level) for r in ok]
    out["time_to_level_s"] = spread(times, 1)
    out["steps_to_level"] = spread([steps_to(r["eval"], level) for r in ok], 0)
    out["reached_level"] = sum(t is not None for t in times)
    out["no_signal_steps"] = sum(r["no_signal_steps"] for r in ok)
    return out
