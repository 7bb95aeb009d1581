"""What each ``rollout.interrupt_mode`` costs in log-prob agreement, in the overlapped loop.

At a weight push the turns in flight are either aborted and re-sent (``abort``: the new weights
prefill prompt + partial output again), kept open with their cache recomputed at resume
(``retract``), or frozen with the cache the old weights computed (``in_place``: no recompute).
With ``in_place`` the tokens sampled after the push come from the new weights reading a prefix
the old weights encoded; the learner's recompute reads it with the new weights throughout. Those
tokens carry the learner's version, so the gap shows in ``mismatch/numeric_*`` (which is ~1e-7
in float32 when prefix and token agree), not in ``mismatch/lag_*``.

The workload keeps turns in flight at every push: few rows (``--tasks`` x ``--group``) and long
responses (``--new-tokens``, EOS ignored), so that generating a step's groups outlasts an
update; the reward is a seeded hash of the response (``_hash_env``). The tiny model in float32
on the CPU (``model.device=cpu``) or the card (``--device auto``), every mode from the same seed,
side by side in one process. Reported per mode, over the run's steps: ``mismatch/numeric_*``
and ``mismatch/lag_*`` (mean of the steps' values, and the largest), interrupted and resumed
episodes a step, and wall time.

Usage: ``python benchmarks/interrupt_modes.py [--modes abort retract in_place] [--steps 12]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import _hash_env  # noqa: E402, F401  (registers bench-hash-v0)

from agentrl.config import load_config  # noqa: E402
from agentrl.loop.trainer import Trainer  # noqa: E402

KEYS = (
    "mismatch/numeric_mean_abs",
    "mismatch/numeric_max_abs",
    "mismatch/lag_mean_abs",
    "mismatch/lag_max_abs",
    "mismatch/lag_tokens_frac",
    "staleness/interrupted_episodes",
    "staleness/resumed_episodes",
)


def run(mode: str, a: argparse.Namespace) -> dict[str, Any]:
    """One overlapped run in ``mode``; each key's mean and largest value over its steps."""
    run_dir = tempfile.mkdtemp(prefix=f"interrupt_{mode}_")
    config = load_config({
        "run_dir": run_dir, "seed": 0, "model": {"device": a.device},
        "env": {"id": "bench-hash-v0", "num_train_tasks": 1024, "num_eval_tasks": 1},
        "rollout": {"group_size": a.group, "max_turns": 1, "max_new_tokens": a.new_tokens,
                    "max_total_tokens": a.new_tokens + 32, "ignore_eos": True,
                    "temperature": 1.0, "interrupt_mode": mode},
        "learner": {"lr": a.lr, "num_minibatches": 1},
        "train": {"steps": a.steps, "tasks_per_step": a.tasks, "eval_every": 0,
                  "max_staleness": 1},
        "cold_start": {"steps": 0},
    })  # fmt: skip
    t0 = time.perf_counter()
    asyncio.run(Trainer(config).run())
    wall = time.perf_counter() - t0
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    recs = [r for r in map(json.loads, lines) if "perf/tokens" in r]
    out: dict[str, Any] = {"wall_s": wall, "steps": len(recs)}
    for k in KEYS:
        values = [r[k] for r in recs if k in r]
        out[k] = (
            {"mean": statistics.mean(values), "max": max(values), "steps": len(values)}
            if values
            else None
        )
    return out


def main() -> None:
    """Run every mode; print a table, then one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["abort", "retract", "in_place"],
                    choices=["abort", "retract", "in_place"])  # fmt: skip
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tasks", type=int, default=4, help="tasks a step")
    ap.add_argument("--group", type=int, default=2, help="samples a task")
    ap.add_argument("--new-tokens", type=int, default=900, help="response tokens (EOS ignored)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--device", default="cpu", help="model.device (cpu, auto, cuda)")
    a = ap.parse_args()
    results = {}
    for mode in a.modes:
        results[mode] = r = run(mode, a)
        cells = [f"{mode:9s} {r['wall_s']:6.1f} s"]
        for k in KEYS:
            v = r[k]
            cells.append(
                f"{k.split('/')[1]} " + ("-" if v is None else f"{v['mean']:.3g}/{v['max']:.3g}")
            )
        print("  ".join(cells), flush=True)
    print(json.dumps({"modes": results, "device": a.device}))


if __name__ == "__main__":
    main()
