"""GSPO-token vs GRPO on the same CPU recipe, several seeds: held-out success and clipping.

    python benchmarks/gspo_vs_grpo.py --seeds 0 1 2 --jobs 3

Each run is the math recipe's ``cpu-tiny`` preset (tiny Qwen3 model, cold start, then RL on
two-digit addition) with ``learner.loss`` set to ``gspo_token`` (eps 3e-4/4e-4) or ``grpo``
(eps 0.2/0.28) and everything else equal. The GSPO paper reports clipped-token fractions two
orders of magnitude apart (~15% vs ~0.13%); this prints ours, and the held-out success per step.
Runs are independent processes (``--jobs`` at a time, ``--threads`` torch threads each).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(loss: str, seed: int, steps: int, env: str | None, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT / "recipes"))
    from math_agent import PRESETS

    from agentrl.config import load_config
    from agentrl.loop.trainer import Trainer

    tree = copy.deepcopy(PRESETS["cpu-tiny"])
    tree.update(seed=seed, name=f"{loss}-s{seed}", out_dir=tempfile.mkdtemp())
    tree["learner"]["loss"] = loss
    tree["train"].update(steps=steps, eval_every=5, max_wall_s=None, max_staleness=0)
    if env is not None:  # e.g. arith-v0: the same task without the math-verify dependency
        tree["env"] = {"id": env, "num_eval_tasks": tree["env"]["num_eval_tasks"]}
    summary = asyncio.run(Trainer(load_config(tree)).run())
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(ln) for ln in lines]
    return {
        "loss": loss,
        "seed": seed,
        "summary": summary,
        "eval": {r["step"]: r["eval/success_rate"] for r in records if "eval/success_rate" in r},
        "clip": [r["loss/clip_frac_tokens"] for r in records if "loss/clip_frac_tokens" in r],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--losses", nargs="+", default=["gspo_token", "grpo"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--env", default=None, help="override the preset's env id")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    jobs = [
        (loss, s, args.steps, args.env, args.threads) for loss in args.losses for s in args.seeds
    ]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        runs = pool.starmap(one_run, jobs)
    steps = sorted({k for r in runs for k in r["eval"]})
    print("held-out success (mean over seeds) per step")
    print(f"{'step':>5} " + " ".join(f"{loss:>12}" for loss in args.losses))
    for st in steps:
        cells = []
        for loss in args.losses:
            vals = [r["eval"][st] for r in runs if r["loss"] == loss and st in r["eval"]]
            cells.append(f"{statistics.mean(vals):>12.3f}" if vals else f"{'-':>12}")
        print(f"{st:>5} " + " ".join(cells))
    out: dict[str, object] = {
        "benchmark": "gspo_vs_grpo",
        "seeds": args.seeds,
        "steps": args.steps,
        "machine": platform.machine(),
    }
    print(f"\n{'loss':>12} {'start':>7} {'end':>7} {'gain':>7} {'clip_frac_tokens':>17}")
    for loss in args.losses:
        mine = [r for r in runs if r["loss"] == loss]
        start = statistics.mean(r["summary"]["success_start"] for r in mine)
        end = statistics.mean(r["summary"]["success_end"] for r in mine)
        clip = statistics.mean(c for r in mine for c in r["clip"])
        print(f"{loss:>12} {start:>7.3f} {end:>7.3f} {end - start:>+7.3f} {clip:>17.4f}")
        out |= {
            f"{loss}_success_start": round(start, 4),
            f"{loss}_success_end": round(end, 4),
            f"{loss}_clip_frac_tokens": round(clip, 5),
        }
    if "gspo_token_clip_frac_tokens" in out and "grpo_clip_frac_tokens" in out:
        grpo_clip = max(float(out["grpo_clip_frac_tokens"]), 1e-9)  # type: ignore[arg-type]
        out["clip_frac_ratio"] = round(float(out["gspo_token_clip_frac_tokens"]) / grpo_clip, 1)  # type: ignore[arg-type]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
