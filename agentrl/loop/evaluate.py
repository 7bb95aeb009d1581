"""Held-out evaluation: pass@k, avg@k, turns and tool use; ``agentrl eval`` and the trainer's.

:func:`~agentrl.pass_at_k.eval_metrics` turns groups of K episodes per task into the figures
both report, under the same names (the trainer prefixes them with ``eval/``): ``success_rate``,
``reward_mean``, ``turns_mean``, ``tool_calls_mean``, ``tool_use_frac`` and, for K samples,
``pass@1`` .. ``pass@K`` (the unbiased estimator) and ``avg@K`` (the mean reward).

``agentrl eval MODEL_OR_RUN_DIR --env ID --samples K`` runs K episodes on each held-out task
against the embedded engine or ``--endpoint`` servers and writes ``episodes.jsonl`` (one
trajectory a line, as they finish) and ``summary.json`` into ``--out``. A run directory brings
its config (env, model, rollout budgets) and the weights of its newest checkpoint that verifies
(else its ``export/`` directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError
from agentrl.pass_at_k import eval_metrics
from agentrl.types import Group

log = logging.getLogger(__name__)

MAX_SAMPLES = 4096
"""``--samples`` above this is refused (pass@k past it says nothing new)."""
MAX_EPISODES = 1_000_000
"""Tasks times samples above this are refused before any task is made."""
MAX_TASK_FILE_BYTES = 256 << 20
"""A ``--tasks`` file larger than this is refused before it is read (it is read whole)."""


# ---- where the policy comes from --------------------------------------------------------------


def run_dir_of(target: str) -> Path | None:
    """``target`` as a run directory (it holds ``config.yaml``, not ``config.json``), else None."""
    path = Path(target).expanduser()
    if path.is_dir() and (path / "config.yaml").is_file() and not (path / "config.json").exists():
        return path
    return None


def run_checkpoint(run_dir: Path, step: int | None) -> Path | None:
    """The checkpoint of ``step`` (``None``: the newest that verifies) of ``run_dir``.

    ``None`` when the run has no checkpoint but an ``export/`` model directory (its weights are
    then the model's own).

    Raises:
        ConfigError: no such step, or neither checkpoint nor export.
        TrainingError: the checkpoint asked for (or every one) fails its manifest check.
    """
    from agentrl.loop.checkpoints import committed
    from agentrl.loop.export_run import find_checkpoint

    if step is None and not committed(run_dir / "checkpoints"):
        if (run_dir / "export" / "config.json").is_file():
            return None
    path, _, skipped = find_checkpoint(run_dir, step)
    for line in skipped:
        log.warning("eval: %s", line.removeprefix("export: "))
    return path


def load_checkpoint_weights(model: Any, path: Path) -> None:
    """Copy the model weights of a run's checkpoint into ``model`` (the shards consolidated).

    Only the model is read, not the optimizer state; ``model`` keeps its dtype and device.

    Raises:
        ValueError: the checkpoint does not hold ``model``'s weights.
    """
    from agentrl.learner.export import checkpoint_weights

    weights = checkpoint_weights(path / "learner")
    own = model.state_dict()
    if set(weights) != set(own):
        wrong = sorted(set(weights) ^ set(own))[:3]
        raise ValueError(f"{path}: holds the weights of another model (names differ: {wrong})")
    model.load_state_dict(weights, strict=True)  # copies in place, cast to the model's dtype


def eval_config(args: argparse.Namespace) -> tuple[Any, Path | None]:
    """The config of ``agentrl eval`` and the checkpoint to load (``None``: the model's own).

    A run directory's ``config.yaml`` is the base (its env, model and budgets); the flags, then
    ``--section.key=value`` items, override it.
    """
    from agentrl.config import load_config, read_file
    from agentrl.config_reference import flag_overrides

    if not 1 <= args.samples <= MAX_SAMPLES:
        raise ConfigError(f"--samples: expected 1 <= K <= {MAX_SAMPLES}, got {args.samples}")
    if args.num_tasks is not None and not 1 <= args.num_tasks * args.samples <= MAX_EPISODES:
        raise ConfigError(
            f"--num-tasks: expected 1 <= tasks x samples <= {MAX_EPISODES}, got "
            f"{args.num_tasks} x {args.samples}"
        )
    if args.tasks is not None:
        path = Path(args.tasks)
        if not path.is_file():
            raise ConfigError(f"--tasks: {path}: no such file")
        if path.stat().st_size > MAX_TASK_FILE_BYTES:
            raise ConfigError(
                f"--tasks: {path} holds {path.stat().st_size / 2**20:.0f} MiB, over the "
                f"{MAX_TASK_FILE_BYTES >> 20} MiB limit; evaluate a part of it"
            )
    run_dir = run_dir_of(args.model)
    tree: dict[str, Any] = {}
    items: list[str] = []
    checkpoint: Path | None = None
    if run_dir is not None:
        tree = read_file(run_dir / "config.yaml")
        tree.get("learner", {}).pop("temperature", None)  # follows the eval's temperature
        tree.pop("run_dir", None)
        checkpoint = run_checkpoint(run_dir, args.step)
        if checkpoint is None:
            items.append(f"--model.path={json.dumps(str(run_dir / 'export'))}")
    else:
        if args.step is not None:
            raise ConfigError("--step: expected a run directory as MODEL_OR_RUN_DIR")
        items.append(f"--model.path={json.dumps(args.model)}")
        if args.env is None:
            raise ConfigError("--env: expected an env id (MODEL_OR_RUN_DIR is not a run directory)")
    if args.env is not None:
        items.append(f"--env.id={json.dumps(args.env)}")
    if args.tasks is not None:
        items.append(f"--env.eval_tasks={json.dumps(args.tasks)}")
    if args.num_tasks is not None:
        items.append(f"--env.num_eval_tasks={args.num_tasks}")
    temperature = args.temperature if args.temperature is not None else (
        1.0 if args.samples > 1 else 0.0
    )  # fmt: skip
    items += [
        f"--inference.endpoints={json.dumps(args.endpoint)}",  # none: the embedded engine
        f"--rollout.group_size={args.samples}",
        f"--rollout.temperature={temperature}",
        "--rollout.return_routed_experts=false",  # an MoE's routing would swell the JSONL
    ]
    if args.seed is not None:
        items += [f"--seed={args.seed}", f"--rollout.seed={args.seed}"]
    items += flag_overrides(args) + list(args.overrides)
    return load_config(tree or None, items, imports=args.imports), checkpoint


# ---- the command ------------------------------------------------------------------------------


def add_eval(subparsers: Any) -> None:
    """Declare ``agentrl eval MODEL_OR_RUN_DIR --env ID [--tasks FILE] --samples K ...``."""
    from agentrl.config_reference import add_flags
    from agentrl.loop.jobs import add_fault_flags, add_imports

    p = subparsers.add_parser(
        "eval",
        help="evaluate a model or a run's checkpoint: pass@k, avg@k, turns, tool use",
        description="Run K episodes on each held-out task (the env's test split, or --tasks) "
        "and report pass@1 and the unbiased pass@k for k up to K, avg@K (the mean reward), turns "
        "and tool use; write every episode to OUT/episodes.jsonl and the figures to "
        "OUT/summary.json. Any config field is --section.key=value.",
    )
    p.add_argument(
        "model", metavar="MODEL_OR_RUN_DIR",
        help="an HF model directory, a preset ('tiny'), or a run directory (its config and "
        "newest verified checkpoint)",
    )  # fmt: skip
    p.add_argument("--env", default=None, help="env id (default: the run directory's)")
    p.add_argument(
        "--step", type=int, default=None,
        help="a run directory's checkpoint of this step (default: the newest that verifies)",
    )  # fmt: skip
    p.add_argument("--samples", type=int, default=1, metavar="K", help="episodes per task")
    p.add_argument("--tasks", default=None, help="JSONL/Parquet of tasks (env.eval_tasks)")
    p.add_argument(
        "--num-tasks", type=int, default=None,
        help="tasks of the env's test split (env.num_eval_tasks); with --tasks, the first N",
    )  # fmt: skip
    p.add_argument(
        "--temperature", type=float, default=None,
        help="sampling temperature (default: 1.0 when K > 1, else 0, greedy)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=None, help="seed of tasks and sampling")
    p.add_argument("--endpoint", action="append", default=[], help="SGLang base URL (repeatable)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir for --endpoint (default: the model's)"
    )
    p.add_argument("--out", default=None, help="output directory (default: evals/ENV-TIME)")
    add_imports(p)
    add_fault_flags(p)
    skip = {"group_size", "temperature", "seed", "return_routed_experts", "interrupt_mode"}
    add_flags(p, "rollout", [n for n in _fields("rollout") if n not in skip])
    served = [n for n in _fields("inference") if n != "endpoints" and "weight_sync" not in n]
    add_flags(p, "inference", served)
    p.set_defaults(func=_cmd_eval, accepts_overrides=True)


def _fields(section: str) -> list[str]:
    from agentrl.config import TrainConfig

    return list(getattr(TrainConfig.model_fields[section].annotation, "model_fields", {}))


def _cmd_eval(args: argparse.Namespace) -> int:
    from agentrl.rollout.watchdog import exit_guard

    with exit_guard():
        return asyncio.run(evaluate(args))


def _out_dir(args: argparse.Namespace, env_id: str, run_dir: Path | None) -> Path:
    if args.out is not None:
        out = Path(args.out)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = (run_dir or Path(".")) / "evals" / f"{env_id}-{stamp}"
    for name in ("episodes.jsonl", "summary.json"):
        if (out / name).exists():
            raise ConfigError(f"--out: {out / name} exists; give another directory")
    return out


async def _client(cfg: Any, checkpoint: Path | None, tokenizer_name: str | None) -> Any:
    """The embedded engine ``agentrl train`` would build, or a client of the endpoints."""
    if cfg.inference.endpoints:
        from agentrl.loop.jobs import endpoint_client

        return await endpoint_client(cfg, tokenizer_name)
    from agentrl.loop.placement import load_policy, make_local_engine

    model, tok = load_policy(cfg)
    if checkpoint is not None:
        load_checkpoint_weights(model, checkpoint)
    return make_local_engine(model, tok, cfg, copy_model=False), tok


async def evaluate(args: argparse.Namespace) -> int:
    """Run ``agentrl eval``; prints a table and the summary's JSON; returns the exit code."""
    from agentrl.data import tasks_for
    from agentrl.env import import_envs, make
    from agentrl.loop.atomic import replace_file
    from agentrl.loop.jobs import _table, failure_rows, rollout_exit_code
    from agentrl.loop.trainer import EVAL_SEED_OFFSET
    from agentrl.rollout.engine import JsonlSink, RolloutEngine, rollout_metrics

    cfg, checkpoint = eval_config(args)
    import_envs(cfg.imports)
    tasks = tasks_for(cfg, "test")  # checked before any model is loaded
    if args.num_tasks is not None:
        tasks = tasks[: args.num_tasks]
    if not tasks or len(tasks) * args.samples > MAX_EPISODES:
        raise ConfigError(f"tasks: expected 1 to {MAX_EPISODES // args.samples}, got {len(tasks)}")
    run_dir = run_dir_of(args.model)
    out = _out_dir(args, cfg.env.id, run_dir)
    client, tok = await _client(cfg, checkpoint, args.tokenizer)
    engine = RolloutEngine(client, tok, cfg.rollout)
    out.mkdir(parents=True, exist_ok=True)
    sink = JsonlSink(out / "episodes.jsonl", extra={"env_id": cfg.env.id})
    groups: list[Group] = []
    total = len(tasks) * args.samples
    progress = _Progress(f"eval {cfg.env.id}", total)
    t0 = time.perf_counter()
    try:  # the trainer's eval seeds: a run's final evaluation is repeated exactly
        async for group in engine.stream_groups(
            lambda: make(cfg.env.id, **cfg.env.kwargs), tasks, env_id=cfg.env.id, sink=sink,
            seed_offset=EVAL_SEED_OFFSET,
        ):  # fmt: skip
            groups.append(group)
            progress.update(len(group.trajectories))
    finally:
        progress.close()
        sink.close()
        await client.aclose()
    order = {id(t): i for i, t in enumerate(tasks)}
    groups.sort(key=lambda g: order.get(id(g.task), 0))  # task order, as they were given
    threshold = cfg.rollout.success_threshold
    m = rollout_metrics(groups, success_threshold=threshold)
    figures = eval_metrics(groups, success_threshold=threshold)
    summary: dict[str, Any] = {
        "model": args.model,
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "endpoints": cfg.inference.endpoints,
        "env": cfg.env.id,
        "tasks": len(groups),
        "samples": args.samples,
        "episodes": int(m["rollout/episodes"]),
        "temperature": cfg.rollout.temperature,
        "seed": cfg.rollout.seed,
        "success_threshold": threshold,
        **figures,
        "failed": int(m["rollout/failed"]),
        "truncated_frac": m["rollout/truncated_frac"],
        "wall_s": time.perf_counter() - t0,
        "episodes_file": str(out / "episodes.jsonl"),
    }
    replace_file(out / "summary.json", json.dumps(summary, indent=2))
    rows = [(k, f"{figures[k]:.3f}") for k in figures if "@" in k]
    rows += [
        ("turns per episode", f"{figures['turns_mean']:.2f}"),
        ("tool calls per episode", f"{figures['tool_calls_mean']:.2f}"),
        ("episodes", f"{summary['episodes']} ({summary['tasks']} tasks x {args.samples})"),
        *failure_rows(m),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("written to", str(out)),
    ]
    print(_table(rows))
    print(json.dumps(summary))
    return rollout_exit_code(m, args.max_failed_frac)


class _Progress:
    """Episodes done of ``total``: a tqdm bar on a terminal, else a plain line now and then."""

    def __init__(self, name: str, total: int, every_s: float = 30.0) -> None:
        from tqdm import tqdm

        from agentrl.loop.progress import duration

        self.name, self.total, self.done, self.every_s = name, total, 0, every_s
        self.t0 = self.last = time.perf_counter()
        self._duration = duration
        tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=name, unit="episode") if tty else None

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.perf_counter()
        if self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            left = (now - self.t0) / self.done * (self.total - self.done)
            print(
                f"{self.name}: {self.done}/{self.total} episodes "
                f"({self.done / self.total:.0%}), ETA {self._duration(left)}",
                file=sys.stderr, flush=True,
            )  # fmt: skip

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
