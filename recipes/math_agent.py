"""Math agent: GSPO-token on arithmetic / competition-style questions, rewarded by math-verify.

    python recipes/math_agent.py --preset cpu-tiny-tool       # make demo: a tool agent on CPU
    python recipes/math_agent.py --preset cpu-tiny            # CPU, single turn, ~3 minutes
    python recipes/math_agent.py --preset cpu-tiny-mcp        # cpu-tiny-tool, tool over MCP
    python recipes/math_agent.py --preset cpu-tiny-distill    # CPU, distil cpu-tiny's export
    python recipes/math_agent.py --preset cpu-tiny-lora       # LoRA RL on cpu-tiny's cold start
    python recipes/math_agent.py --preset gpu-small           # one GPU, 25M model, < 10 min
    python recipes/math_agent.py --preset gpu-agent           # one GPU, a 4-turn tool agent
    python recipes/math_agent.py --preset qwen3-1.7b --endpoint http://gpu-host:30000
    python recipes/math_agent.py --preset qwen3-4b-lora --model.path=/models/Qwen3-4B  # 1 GPU
    python recipes/math_agent.py --preset cpu-tiny --train.steps=10 --learner.lr=3e-5

Reads top to bottom: the config (a preset plus overrides), the environment and its verifier,
then the trainer. ``cpu-tiny-tool`` is what the README's ``make demo`` runs: a Qwen3-architecture
model of 0.6M parameters built from a config (no download) learns to add two 4-digit numbers
with a tool over two turns (``add-tool-v0``: call ``add``, read its output, answer), first by a
short supervised cold start on demonstrated conversations, then by RL. ``cpu-tiny`` is the
single-turn two-digit addition (``math-v0``), the quick check the tests run. ``gpu-agent`` is
the multi-turn agent on one GPU: ``calc-chain-v0`` chains three ``add``/``sub`` calls listed
in the system prompt, each on the previous tool output, then the answer (4 assistant turns);
the held-out success, ``turns_mean`` and ``tool_use_frac`` are in ``summary.json``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from typing import Any

import torch

from agentrl.config import load_config
from agentrl.loop.jobs import exit_code, run_training
from agentrl.rollout.watchdog import end_process
from agentrl.verifiers.math import start_pool

# -------------------------------------------------------------------------------- config
PRESETS: dict[str, dict[str, Any]] = {
    # 2 CPU cores, ~5 minutes. The learning rate decides everything at this size: 3e-5..1e-4
    # learns, 3e-4 collapses. The cold start stops at ~30% held-out success so RL has room.
    "cpu-tiny": {
        "name": "math-cpu-tiny",
        "env": {
            "id": "math-v0",
            "kwargs": {"prompt_template": "{question}=", "extract": "last_number"},
            "task_kwargs": {"source": "addition"},
            "num_train_tasks": 4096,
            "num_eval_tasks": 200,
        },
        "rollout": {"group_size": 8, "max_turns": 1, "max_new_tokens": 6,
                    "max_total_tokens": 64, "temperature": 1.0},
        "cold_start": {"steps": 600, "lr": 1e-3, "batch_size": 64, "target_success": 0.3,
                       "check_every": 25},
        "learner": {"lr": 1e-4, "num_minibatches": 4, "loss": "gspo_token",
                    "micro_batch_tokens": 1024},
        "train": {"steps": 80, "tasks_per_step": 32, "eval_every": 10, "max_wall_s": 540},
    },
    # One GPU, no download: a 25M-parameter Qwen3-architecture model built from config learns
    # three-digit addition (carries across three places; harder than the CPU demo). Policy,
    # learner and embedded engine share the card (model.device=auto). float32 throughout: at
    # this size the step is launch-bound, and GSPO's clip range is below bf16 precision.
    "gpu-small": {
        "name": "math-gpu-small",
        "model": {"tiny": {"hidden_size": 512, "intermediate_size": 1536,
                           "num_hidden_layers": 8, "num_attention_heads": 8,
                           "num_key_value_heads": 4, "head_dim": 64}},
        "inference": {"max_batch_size": 512, "kv_cache_frac": 0.3},
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 3},
                "num_train_tasks": 20000, "num_eval_tasks": 500},
        "rollout": {"group_size": 8, "max_turns": 1, "max_new_tokens": 8,
                    "max_total_tokens": 64, "temperature": 1.0, "concurrency": 1024},
        "cold_start": {"steps": 3000, "lr": 3e-4, "batch_size": 128, "target_success": 0.25,
                       "check_every": 25},
        "learner": {"lr": 3e-5, "num_minibatches": 4, "loss": "gspo_token",
                    "micro_batch_tokens": 16384},
        "train": {"steps": 400, "tasks_per_step": 64, "eval_every": 10, "max_wall_s": 540},
    },
    # `make demo`: a multi-turn tool agent on 2 CPU cores within 10 minutes. add-tool-v0 asks for
    # the sum of two 4-digit numbers, which the tiny model cannot add, but can copy into an `add`
    # tool call and then copy the tool's output into its answer. The cold start trains on whole
    # demonstrated conversations and stops at a modest held-out success, so RL has room.
    "cpu-tiny-tool": {
        "name": "math-cpu-tiny-tool",
        "env": {
            "id": "add-tool-v0",
            "task_kwargs": {"digits": 4},
            "num_train_tasks": 4096,
            "num_eval_tasks": 200,
        },
        # temperature 0.6: one wrong digit fails an episode, and at 1.0 a fresh copier gets
        # few of its 13 copied digits all right, so most groups would carry no signal
        "rollout": {"group_size": 8, "max_turns": 2, "max_new_tokens": 56,
                    "max_total_tokens": 160, "temperature": 0.6},
        "inference": {"max_batch_size": 128},
        # Copying forms abruptly (held-out 0% for ~200 steps, then up fast), hence the check.
        "cold_start": {"steps": 400, "lr": 2e-3, "batch_size": 16, "target_success": 0.3,
                       "check_every": 25},
        "learner": {"lr": 1e-4, "num_minibatches": 4, "loss": "gspo_token",
                    "micro_batch_tokens": 4096},
        "train": {"steps": 100, "tasks_per_step": 16, "eval_every": 10, "max_wall_s": 570},
    },
    # One GPU, no download: gpu-small's 25M model as a multi-turn tool agent. calc-chain-v0 asks
    # for "a+b-c+d" on 4-digit numbers with add/sub tools listed in the system prompt, one
    # operation per call: three tool turns, each copying the last tool output, then the answer
    # (4 assistant turns, ~420 tokens). Cold start on demonstrated conversations, then
    # GSPO-token. The cold start and RL are both bounded so the whole run fits in 10 minutes.
    "gpu-agent": {
        "name": "math-gpu-agent",
        "model": {"tiny": {"hidden_size": 512, "intermediate_size": 1536,
                           "num_hidden_layers": 8, "num_attention_heads": 8,
                           "num_key_value_heads": 4, "head_dim": 64}},
        "inference": {"max_batch_size": 512, "kv_cache_frac": 0.3},
        "env": {"id": "calc-chain-v0", "task_kwargs": {"digits": 4},
                "num_train_tasks": 20000, "num_eval_tasks": 500},
        # a call is 48-50 tokens; temperature 0.6 as in cpu-tiny-tool: ~30 copied digits per
        # episode, and at 1.0 a fresh copier would get few episodes all right
        "rollout": {"group_size": 8, "max_turns": 5, "max_new_tokens": 56,
                    "max_total_tokens": 512, "temperature": 0.6, "concurrency": 1024},
        "cold_start": {"steps": 3000, "lr": 3e-4, "batch_size": 128, "target_success": 0.3,
                       "check_every": 25, "max_wall_s": 230},
        # lr 1e-5: the copying forms abruptly late in the cold start and is fragile; at 5e-5 RL
        # wiped it out in ten steps (held-out 0.326 -> 0.002 on an H200), at 1e-5 it grows
        "learner": {"lr": 1e-5, "num_minibatches": 4, "loss": "gspo_token",
                    "micro_batch_tokens": 16384},
        "train": {"steps": 400, "tasks_per_step": 32, "eval_every": 10, "max_wall_s": 270},
    },
    # A GPU host: Qwen3-1.7B served by SGLang (--endpoint) or loaded locally with transformers.
    "qwen3-1.7b": {
        "name": "math-qwen3-1.7b",
        "model": {"path": "Qwen/Qwen3-1.7B", "dtype": "bfloat16"},
        "env": {"id": "math-v0", "task_kwargs": {"source": "gsm_symbolic"},
                "num_train_tasks": 20000, "num_eval_tasks": 500},
        "rollout": {"group_size": 8, "max_turns": 1, "max_new_tokens": 2048,
                    "max_total_tokens": 3072, "temperature": 1.0, "concurrency": 512},
        "learner": {"lr": 1e-6, "num_minibatches": 4, "loss": "gspo_token",
                    "dtype": "bfloat16", "micro_batch_tokens": 16384,
                    "compile": True, "selective_recompute": True,
                    "attention_kernel": "triton"},
        "train": {"steps": 300, "tasks_per_step": 64, "eval_every": 20,
                  "checkpoint_every": 20},
    },
}

# LoRA adapts a trained base: cpu-tiny's cold start alone (full weights, to ~30% held-out
# success) is the base, then RL trains only adapters on every linear layer (rank 32), and each
# push moves only the adapters to the engine. Make the base first (~3 minutes):
#   python recipes/math_agent.py --preset cpu-tiny --run_dir=runs/math-base --train.steps=0
# LoRA wants ~10x the full fine-tuning learning rate (cpu-tiny's RL: 1e-4).
# On-policy distillation on CPU: cpu-tiny's trained model teaches a student of its own shape
# from its own cold start (~0.33 held-out success, where cpu-tiny's RL starts); the per-token
# reverse KL to the teacher, sharpened to temperature 0.25, is added at 0.1 to the RL advantage
# (teacher.mode=rl+distill). The teacher samples poorly at temperature 1 (~0.36 success, 0.715
# greedy): the KL to it alone (mode=distill) levelled off near its sampling success; to the
# sharpened teacher alone, a few tokens at -20 nats (those it all but rules out) swamp the
# step; at 0.1 beside the outcome advantage it tells which digit of a wrong answer is wrong.
# That comes within 10 points of the teacher in 50 steps (RL alone: 80), though not in less
# wall time: a step costs ~1.5x (2-core CPU, 2026-12-08; benchmarks/README.md). A student half as
# wide and 2 layers deep stayed near 0.38 in 80 steps of RL alone and of distillation (its
# capacity; --model.tiny='{hidden_size: 64, ...}' shrinks it). GRPO's token ratio, not
# GSPO-token's sequence ratio: a dense per-token advantage of either sign met GSPO-token's
# 3e-4/4e-4 clip on ~50% of tokens, ~90% of sequences. Train the teacher, then distil from it:
#   python recipes/math_agent.py --preset cpu-tiny --run_dir=runs/math-teacher
#   python recipes/math_agent.py --preset cpu-tiny-distill
# (another teacher: --teacher.model=DIR, or a served one: --teacher.endpoint=URL)
PRESETS["cpu-tiny-distill"] = copy.deepcopy(PRESETS["cpu-tiny"])
PRESETS["cpu-tiny-distill"]["name"] = "math-cpu-tiny-distill"
PRESETS["cpu-tiny-distill"]["rollout"]["group_size"] = 4
PRESETS["cpu-tiny-distill"]["learner"]["loss"] = "grpo"
PRESETS["cpu-tiny-distill"]["teacher"] = {
    "model": "runs/math-teacher/export", "mode": "rl+distill", "kl_coef": 0.1,
    "temperature": 0.25,
}

PRESETS["cpu-tiny-lora"] = copy.deepcopy(PRESETS["cpu-tiny"])
PRESETS["cpu-tiny-lora"]["name"] = "math-cpu-tiny-lora"
PRESETS["cpu-tiny-lora"]["model"] = {"path": "runs/math-base/export"}
PRESETS["cpu-tiny-lora"]["cold_start"] = {"steps": 0}
PRESETS["cpu-tiny-lora"]["learner"].update(lr=1e-3, lora={"rank": 32, "alpha": 64.0})

# One GPU: Qwen3-4B with LoRA rank 32 on every linear layer, bf16, the engine on the same card
# (colocated); only the adapter (66M parameters, 264 MB in float32) reaches the engine at each push.
PRESETS["qwen3-4b-lora"] = copy.deepcopy(PRESETS["qwen3-1.7b"])
PRESETS["qwen3-4b-lora"]["name"] = "math-qwen3-4b-lora"
PRESETS["qwen3-4b-lora"]["model"]["path"] = "Qwen/Qwen3-4B"
PRESETS["qwen3-4b-lora"]["learner"].update(lr=1e-5, lora={"rank": 32, "alpha": 64.0})
PRESETS["qwen3-4b-lora"]["inference"] = {"kv_cache_frac": 0.35}

# cpu-tiny-tool with its `add` tool served by an MCP server over stdio (add-mcp-v0, the server
# agentrl/envs/mcp_add_server.py): the same conversations, only the tool's transport differs.
PRESETS["cpu-tiny-mcp"] = copy.deepcopy(PRESETS["cpu-tiny-tool"])
PRESETS["cpu-tiny-mcp"]["name"] = "math-cpu-tiny-mcp"
PRESETS["cpu-tiny-mcp"]["env"]["id"] = "add-mcp-v0"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    ap.add_argument("--endpoint", action="append", default=[], help="SGLang URL (repeatable)")
    ap.add_argument("--resume", action="store_true", help="continue the run in run_dir=...")
    ap.add_argument(
        "--overwrite", action="store_true", help="replace the run that run_dir=... holds"
    )
    ap.add_argument("--debug", action="store_true", help="print the full trace of a failure")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 1 for the cpu-* presets, whose engine and learner "
        "run side by side; two threads each thrash a loaded 2-core machine)",
    )
    ap.add_argument("--import", dest="imports", action="append", default=[],
                    help="a module or .py file that registers envs (repeatable)")
    # any other argument is a config override: --section.key=value (or section.key=value)
    args, overrides = ap.parse_known_args(argv)
    threads = args.torch_threads or (1 if args.preset.startswith("cpu-") else None)
    if threads:
        torch.set_num_threads(threads)
    tree = copy.deepcopy(PRESETS[args.preset])
    if args.endpoint:
        tree.setdefault("inference", {})["endpoints"] = args.endpoint
    config = load_config(tree, overrides, imports=args.imports)

    # ---------------------------------------------------------------- env and verifier
    # math-v0 scores the final answer with agentrl.verifiers.math (math-verify, in worker
    # processes with a time limit); start the pool now so the first batch does not wait.
    if config.env.id.startswith("math") and config.env.kwargs.get("extract") != "last_number":
        start_pool()

    # ---------------------------------------------------------------- trainer
    run_training(config, resume=args.resume, overwrite=args.overwrite)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    end_process(exit_code(main, debug="--debug" in sys.argv[1:]))
