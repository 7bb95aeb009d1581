"""Shared command-line plumbing of the recipes: presets, overrides, progress, summary table."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
from typing import Any

from tqdm import tqdm

from agentrl.config import load_config
from agentrl.trainer import Trainer


def parse(doc: str, presets: dict[str, dict[str, Any]], argv: list[str] | None = None):
    """``--preset NAME``, repeated ``--endpoint URL``, ``--resume`` and ``key=value`` overrides."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(presets), default=next(iter(presets)))
    ap.add_argument("--endpoint", action="append", default=[],
                    help="SGLang base URL (repeat for several); default: the embedded engine")
    ap.add_argument("--resume", action="store_true", help="continue the run in --run_dir")
    args, rest = ap.parse_known_args(argv)
    tree = copy.deepcopy(presets[args.preset])
    if args.endpoint:
        tree.setdefault("inference", {})["endpoints"] = args.endpoint
    return load_config(tree, rest), args.resume


def train(config, resume: bool = False) -> dict[str, Any]:
    """Run the trainer with a progress bar; print and return the summary."""
    bar = tqdm(total=config.train.steps, desc=config.name, unit="step")

    def on_step(m: dict[str, float]) -> None:
        if "rollout/reward_mean" in m:
            bar.update(1)
            post = {"reward": f"{m['rollout/reward_mean']:.3f}"}
            if "eval/success_rate" in m:
                post["held-out"] = f"{m['eval/success_rate']:.3f}"
            bar.set_postfix(post)
        elif "eval/success_rate" in m:
            bar.write(f"held-out success {m['eval/success_rate']:.3f} at step {m['step']}")

    summary = asyncio.run(Trainer(config, resume=resume, on_step=on_step).run())
    bar.close()
    rows = [("held-out success at RL start", f"{summary['success_start']:.3f}"),
            ("held-out success at end", f"{summary['success_end']:.3f}"),
            ("change (points)", f"{100 * (summary['success_end'] - summary['success_start']):+.1f}"),
            ("RL steps", str(summary["steps"])),
            ("cold start (s)", f"{summary['cold_start_s']:.1f}"),
            ("wall time (s)", f"{summary['wall_s']:.1f}"),
            ("run directory", summary["run_dir"])]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(json.dumps(summary))
    return summary
