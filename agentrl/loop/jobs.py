"""The long-running jobs behind the CLI: ``train`` and ``rollout``, with progress and summaries.

Library modules never print; these are the user-facing front ends, so they draw a tqdm progress
bar on stderr, print a summary table at the end, and return the figures for scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from agentrl.config import TrainConfig, load_config

log = logging.getLogger(__name__)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_training(config: TrainConfig, *, resume: bool = False) -> dict[str, Any]:
    """Train with a progress bar showing the latest reward; print and return the summary."""
    from agentrl.loop.trainer import Trainer

    bar = tqdm(total=config.train.steps, desc=config.name, unit="step", dynamic_ncols=True)

    def on_step(m: dict[str, float]) -> None:
        if "rollout/reward_mean" in m:
            bar.n = int(m["step"])
            post = {"reward": f"{m['rollout/reward_mean']:.3f}"}
            if "eval/success_rate" in m:
                post["held-out"] = f"{m['eval/success_rate']:.3f}"
            bar.set_postfix(post)
        elif "eval/success_rate" in m:
            bar.write(f"step {m['step']}: held-out success {m['eval/success_rate']:.3f}")
        elif "sft/step" in m:  # the cold start's progress
            post = {"cold start": f"{int(m['sft/step'])}/{int(m['sft/steps'])}"}
            bar.set_postfix(post | {"loss": f"{m['sft/loss']:.3f}"})
            if "sft/held_out_success" in m:
                bar.write(
                    f"cold start step {int(m['sft/step'])}: loss {m['sft/loss']:.3f}, "
                    f"held-out success {m['sft/held_out_success']:.3f}"
                )
        elif "sft/demonstrations" in m:
            bar.write(
                f"cold start on {int(m['sft/demonstrations'])} demonstrations: "
                f"{m['sft/assistant_turns_mean']:.1f} assistant turns, "
                f"{m['sft/tokens_mean']:.0f} tokens each"
            )

    trainer = Trainer(config, resume=resume, on_step=on_step)
    bar.write(f"run directory: {trainer.run_dir}")
    summary = asyncio.run(trainer.run())
    bar.close()
    change = 100 * (summary["success_end"] - summary["success_start"])
    print(
        _table(
            [
                ("held-out success at RL start", f"{summary['success_start']:.3f}"),
                ("held-out success at end", f"{summary['success_end']:.3f}"),
                ("change", f"{change:+.1f} points"),
                ("turns per episode at end", f"{summary['turns_mean']:.2f}"),
                ("tool calls per episode at end", f"{summary['tool_calls_mean']:.2f}"),
                ("episodes that used the tool", f"{summary['tool_use_frac']:.1%}"),
                ("RL steps", str(summary["steps"])),
                ("cold start", f"{summary['cold_start_s']:.1f} s"),
                ("wall time", f"{summary['wall_s']:.1f} s"),
                ("run directory", summary["run_dir"]),
            ]
        )
    )
    return summary


def add_train(subparsers: Any) -> None:
    """Declare ``agentrl train CONFIG [--key=value ...] [--resume]``."""
    p = subparsers.add_parser(
        "train",
        help="train an agent from a TOML/YAML config",
        description="Train from CONFIG (TOML or YAML); override any field as --section.key=value.",
    )
    p.add_argument("config", help="config file (TOML or YAML)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run_dir")
    p.set_defaults(func=_cmd_train, accepts_overrides=True)


def _cmd_train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    run_training(config, resume=args.resume)
    return 0


def add_rollout(subparsers: Any) -> None:
    """Declare ``agentrl rollout ENV_ID ...``."""
    p = subparsers.add_parser(
        "rollout",
        help="generate trajectories with no training (data generation, evaluation)",
        description="Run G episodes per task against SGLang endpoints (or the embedded engine) "
        "and write trajectories to JSONL as they finish.",
    )
    p.add_argument("env_id", help="a registered env id, e.g. arith-v0")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help="SGLang base URL; repeat for several (default: the embedded engine)",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="embedded engine's model when no endpoint: HF dir or 'tiny' (default)",
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir for remote endpoints (default: --model's)"
    )
    p.add_argument("--tasks", default=None, help="JSONL/Parquet of tasks (default: env generator)")
    p.add_argument("--prompt-field", default="question", help="task file's question field")
    p.add_argument("--answer-field", default="answer", help="task file's answer field")
    p.add_argument("--num-tasks", type=int, default=16, help="generated tasks when no --tasks")
    p.add_argument("--split", default="test", help="generator split (default test)")
    p.add_argument("--group-size", type=int, default=1, help="episodes per task (G)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL file; trajectories are appended")
    p.set_defaults(func=_cmd_rollout)


def _cmd_rollout(args: argparse.Namespace) -> int:
    return asyncio.run(_rollout(args))


async def _rollout(args: argparse.Namespace) -> int:
    from agentrl.env import env_class, make
    from agentrl.rollout.engine import JsonlSink, RolloutConfig, RolloutEngine, rollout_metrics

    client: Any
    if args.endpoint:
        from transformers import AutoTokenizer

        from agentrl.inference.client import SGLangClient
        from agentrl.tiny import build_tiny_tokenizer

        name = args.tokenizer or args.model
        tokenizer = (
            build_tiny_tokenizer() if name == "tiny" else AutoTokenizer.from_pretrained(name)
        )
        client = SGLangClient(args.endpoint)
    else:
        from agentrl.inference.engine import LocalEngine

        client = LocalEngine.from_pretrained(args.model)
        tokenizer = client.tokenizer
    if args.tasks:
        from agentrl.data import load_tasks

        tasks = load_tasks(
            args.tasks, prompt_field=args.prompt_field, answer_field=args.answer_field
        )
    else:
        tasks = env_class(args.env_id).sample_tasks(  # type: ignore[attr-defined]
            args.num_tasks, seed=args.seed, split=args.split
        )
    config = RolloutConfig(
        group_size=args.group_size,
        max_turns=args.max_turns,
        max_new_tokens=args.max_new_tokens,
        max_total_tokens=args.max_total_tokens,
        temperature=args.temperature,
        concurrency=args.concurrency,
        seed=args.seed,
    )
    engine = RolloutEngine(client, tokenizer, config)
    sink = JsonlSink(args.out, extra={"env_id": args.env_id})
    groups = []
    t0 = time.perf_counter()
    bar = tqdm(total=len(tasks) * args.group_size, desc=args.env_id, unit="episode")
    try:
        async for group in engine.stream_groups(
            lambda: make(args.env_id), tasks, env_id=args.env_id, sink=sink
        ):
            groups.append(group)
            bar.update(len(group.trajectories))
            m = rollout_metrics(groups)
            bar.set_postfix(reward=f"{m['rollout/reward_mean']:.3f}")
    finally:
        bar.close()
        sink.close()
        await client.aclose()
    m = rollout_metrics(groups)
    rows = [
        ("episodes", f"{int(m['rollout/episodes'])}"),
        ("reward mean", f"{m.get('rollout/reward_mean', 0.0):.3f}"),
        ("success rate", f"{m.get('rollout/success_rate', 0.0):.3f}"),
        ("failed", f"{int(m.get('rollout/failed', 0))}"),
        ("truncated", f"{m.get('rollout/truncated_frac', 0.0):.1%}"),
        ("wall time", f"{time.perf_counter() - t0:.1f} s"),
        ("written to", str(Path(args.out))),
    ]
    print(_table(rows))
    print(json.dumps({k: round(v, 6) for k, v in m.items()}))
    return 0 if m.get("rollout/failed", 0) < m["rollout/episodes"] else 1
