"""Code agent: write a program, see failing public tests, revise; rewarded on hidden tests.

    python recipes/code_agent.py --preset cpu-tiny           # CPU smoke run of the whole loop
    python recipes/code_agent.py --preset qwen3-1.7b --endpoint http://gpu-host:30000

Reads top to bottom: the config (a preset plus ``--section.key=value`` overrides), the sandbox
that runs every program the model writes (bubblewrap namespaces where available, else resource
limits), then the trainer. ``cpu-tiny`` runs the full loop (multi-turn code-v0, sandboxed tests,
GSPO updates) on a tiny model in minutes; a 0.6M-parameter model does not learn to code, so it
is a plumbing check, not a learning demo. ``qwen3-1.7b`` trains on HumanEval's train split
(every fifth problem is held out) on a GPU host.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from typing import Any

from agentrl.config import load_config
from agentrl.loop.jobs import exit_code, run_training
from agentrl.rollout.watchdog import end_process
from agentrl.verifiers.sandbox import default_sandbox

# -------------------------------------------------------------------------------- config
PRESETS: dict[str, dict[str, Any]] = {
    "cpu-tiny": {
        "name": "code-cpu-tiny",
        "env": {"id": "code-v0", "kwargs": {"max_attempts": 2, "timeout_s": 5.0},
                "num_train_tasks": 64, "num_eval_tasks": 6},
        "rollout": {"group_size": 4, "max_turns": 2, "max_new_tokens": 48,
                    "max_total_tokens": 1024, "temperature": 1.0},
        # Untrained, every answer scores 0; the format penalty (no code block) still gives the
        # update a signal, so the smoke run exercises the learner too.
        "advantages": {"shapers": [{"name": "format", "penalty": 0.1}]},
        "learner": {"lr": 5e-5, "num_minibatches": 2},
        "train": {"steps": 4, "tasks_per_step": 4, "eval_every": 0},
    },
    "qwen3-1.7b": {
        "name": "code-qwen3-1.7b",
        "model": {"path": "Qwen/Qwen3-1.7B", "dtype": "bfloat16"},
        "env": {"id": "code-v0", "kwargs": {"max_attempts": 3},
                "task_kwargs": {"source": "humaneval"},
                "num_train_tasks": 131, "num_eval_tasks": 33},
        "rollout": {"group_size": 8, "max_turns": 3, "max_new_tokens": 1536,
                    "max_total_tokens": 6144, "temperature": 1.0, "concurrency": 512},
        "learner": {"lr": 1e-6, "num_minibatches": 4, "dtype": "bfloat16",
                    "micro_batch_tokens": 16384, "compile": True, "selective_recompute": True,
                    "attention_kernel": "triton"},
        "train": {"steps": 200, "tasks_per_step": 32, "eval_every": 20, "eval_samples": 4,
                  "eval_temperature": 1.0, "checkpoint_every": 20},
    },
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    ap.add_argument("--endpoint", action="append", default=[], help="SGLang URL (repeatable)")
    ap.add_argument("--resume", action="store_true", help="continue the run in run_dir=...")
    ap.add_argument(
        "--overwrite", action="store_true", help="replace the run that run_dir=... holds"
    )
    ap.add_argument("--debug", action="store_true", help="print the full trace of a failure")
    ap.add_argument("--import", dest="imports", action="append", default=[],
                    help="a module or .py file that registers envs (repeatable)")
    # any other argument is a config override: --section.key=value (or section.key=value)
    args, overrides = ap.parse_known_args(argv)
    tree = copy.deepcopy(PRESETS[args.preset])
    if args.endpoint:
        tree["inference"] = {"endpoints": args.endpoint}
    config = load_config(tree, overrides, imports=args.imports)

    # ---------------------------------------------------------------- sandbox
    # Every program the model writes runs here; say which isolation this machine gives.
    print(f"sandbox isolation: {default_sandbox().isolation}")

    # ---------------------------------------------------------------- trainer
    run_training(config, resume=args.resume, overwrite=args.overwrite)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    end_process(exit_code(main, debug="--debug" in sys.argv[1:]))
