"""The long-running jobs behind the CLI: ``train`` and ``rollout``, with progress and summaries.

Library modules never print; these are the user-facing front ends, so they show progress on
stderr (a tqdm bar on a terminal, plain lines in a log: :mod:`agentrl.loop.progress`), print a
summary table at the end, and return the figures for scripts. Both
commands (and the recipes) configure one :class:`~agentrl.config.TrainConfig` the same way: a
config file, ``--section.key=value`` overrides and ``--import`` for envs of your own;
``rollout``'s short flags (``--group-size``) are generated from the config's models, with their
defaults (:mod:`agentrl.config_reference`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from agentrl.config import TrainConfig, load_config
from agentrl.config_reference import add_flags, flag_dest, flag_overrides, reference
from agentrl.errors import ConfigError, TrainingError
from agentrl.loop import stop
from agentrl.loop.atomic import DiskFull, is_disk_full
from agentrl.rollout.watchdog import exit_guard

log = logging.getLogger(__name__)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_training(
    config: TrainConfig, *, resume: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Train with progress on stderr (latest reward, RL rate and ETA); print and return the summary.

    The summary table ends with the failed training episodes (by cause, the first error) and
    the warnings' counts, as ``summary.json`` holds them.

    Under ``torchrun`` (``WORLD_SIZE > 1``) the ranks train together
    (:mod:`agentrl.loop.ranks`); rank 0 alone draws progress and prints the summary. SIGINT and
    SIGTERM stop the run at a step, checkpointed (:mod:`agentrl.loop.stop`).

    Raises:
        Stopped: a signal stopped the run; its ``command`` resumes it (:func:`exit_code`
            prints it and returns 130 or 143).
    """
    from agentrl.loop.placement import resolve_device
    from agentrl.loop.ranks import process_group

    with stop.signals():
        device = resolve_device(config.model.device)
        with process_group(device, config.train.dist_timeout_s) as ranks:
            return _train(config, resume=resume, overwrite=overwrite, quiet=not ranks.is_main)


def _train(config: TrainConfig, *, resume: bool, overwrite: bool, quiet: bool) -> dict[str, Any]:
    from agentrl.loop.progress import Progress
    from agentrl.loop.trainer import Trainer

    progress: Progress | None = None
    trainer: Trainer | None = None
    if not logging.getLogger().handlers:  # the env's first traceback and warnings reach stderr
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:  # the other ranks of a multi-process run are quiet
        if not quiet:  # a bar on a terminal, plain lines in a log (agentrl.loop.progress)
            progress = Progress(
                config.name,
                config.train.steps,
                warnings=lambda: trainer.health.warnings if trainer is not None else {},
            )
        trainer = Trainer(config, resume=resume, overwrite=overwrite, on_step=progress)
        if progress is not None:
            progress.write(f"run directory: {trainer.run_dir}")
        with exit_guard():  # a failed run's teardown cannot hang on stuck env threads
            summary = asyncio.run(trainer.run())
    except (stop.Stopped, asyncio.CancelledError) as e:
        signum = e.signum if isinstance(e, stop.Stopped) else stop.requested()
        if signum is None:  # cancelled, not by a stop signal
            raise
        if trainer is None:
            raise stop.Stopped(0, signum) from None
        # a second signal abandons the step in flight: the newest checkpoint is what remains
        done = stop.Stopped(trainer.saved_step or 0, signum, trainer.run_dir)
        done.command = stop.resume_command(trainer.run_dir.resolve())
        raise done from None
    finally:
        if progress is not None:
            progress.close()
    if trainer.notice and not quiet:
        print(trainer.notice)
    if summary.get("already_finished") or quiet:
        return summary
    change = 100 * (summary["success_end"] - summary["success_start"])
    rows = [
        ("held-out success at RL start", f"{summary['success_start']:.3f}"),
        ("held-out success at end", f"{summary['success_end']:.3f}"),
        ("change", f"{change:+.1f} points"),
        ("turns per episode at end", f"{summary['turns_mean']:.2f}"),
        ("tool calls per episode at end", f"{summary['tool_calls_mean']:.2f}"),
        ("episodes that used the tool", f"{summary['tool_use_frac']:.1%}"),
        ("RL steps", str(summary["steps"])),
        ("cold start", f"{summary['cold_start_s']:.1f} s"),
        ("RL wall time", f"{summary['rl_wall_s']:.1f} s"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
    ]
    rows += summary_health_rows(summary, config.train.max_failed_frac)
    print(_table([*rows, ("run directory", summary["run_dir"])]))
    return summary


def summary_health_rows(summary: dict[str, Any], max_failed_frac: float) -> list[tuple[str, str]]:
    """The summary table's lines for failed episodes (by cause, the first error) and warnings.

    A run that ended under ``train.max_failed_frac`` with failures says how many failed.
    """
    f = summary.get("failures") or {}
    failed, episodes = int(f.get("failed", 0)), int(f.get("episodes", 0))
    share = f" ({failed / episodes:.1%})" if episodes else ""
    note = f"; under train.max_failed_frac={max_failed_frac:g}" if failed else ""
    rows = [("failed training episodes", f"{failed} of {episodes}{share}{note}")]
    rows += [(f"  {cause}", str(n)) for cause, n in sorted(f.get("by_cause", {}).items())]
    if f.get("first_error"):
        rows.append(("  first error", str(f["first_error"])))
    for kind, n in sorted((summary.get("warnings") or {}).items()):
        rows.append((f"warning {kind}", f"{n} times"))
    return rows


def exit_code(main: Callable[[], int | None], *, debug: bool = False) -> int:
    """Run ``main``; any failure is one line on stderr, not a traceback (``debug``: the trace too).

    A dead inference server is one line naming the endpoint and the run's last good step; any
    other exception is its type and message plus the root cause of its chain
    (``__cause__``/``__context__``), folded into one line.

    Returns:
        ``main``'s code (0 for ``None``), 2 for a :class:`ConfigError` (a bad config, path or
        argument), 1 for a :class:`TrainingError` (the run stopped: its message says why; a full
        disk is one), a :class:`ServerError` or any other exception, and ``128 + signal`` for a
        run a signal stopped (130 SIGINT, 143 SIGTERM).
    """
    import traceback

    from agentrl.errors import ServerError

    def clip(text: str) -> str:  # one bounded line: a message may embed a whole response
        text = " ".join(text.split()) or "(no message)"
        return text if len(text) <= 300 else text[:300].rsplit(" ", 1)[0] + " ..."

    def said(e: BaseException) -> str:
        return f"{type(e).__name__}: {clip(str(e))}"

    def root(e: BaseException) -> BaseException:
        seen = {id(e)}
        while (nxt := e.__cause__ or (None if e.__suppress_context__ else e.__context__)) and (
            id(nxt) not in seen
        ):
            seen.add(id(nxt))
            e = nxt
        return e

    def last_step(e: BaseException) -> str:
        # the Trainer whose frame the error crossed knows its last finished step
        trainer = sys.modules.get("agentrl.loop.trainer")
        tb = e.__traceback__
        while trainer is not None and tb is not None:
            obj = tb.tb_frame.f_locals.get("self")
            if isinstance(obj, trainer.Trainer):
                return f"after step {obj.step}" if obj.step else "before the first step"
            tb = tb.tb_next
        return ""

    def fail(e: BaseException, line: str, code: int) -> int:
        if debug:
            traceback.print_exception(e, file=sys.stderr)
        print(f"agentrl: error: {line}", file=sys.stderr)
        return code

    try:
        return int(main() or 0)
    except ConfigError as e:
        return fail(e, str(e), 2)
    except TrainingError as e:
        return fail(e, str(e), 1)
    except stop.Stopped as e:
        print(e.line(), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C before the run's handlers were installed
        print("stopped before the run started; nothing to resume", file=sys.stderr)
        return 130
    except ServerError as e:
        cause = root(e)
        where = last_step(e)
        line = (
            f"inference server {e.endpoint or '(unknown endpoint)'} failed"
            + (f" {where}" if where else "")
            + f": {clip(e.message)}"
            + (f" (root cause: {said(cause)})" if cause is not e else "")
        )
        return fail(e, line + ("" if debug else "; --debug for the full trace"), 1)
    except OSError as e:  # a write this code did not wrap
        if is_disk_full(e):
            return fail(e, str(DiskFull(e.filename or "the run directory")), 1)
        return fail(e, said(e) + ("" if debug else "; --debug for the full trace"), 1)
    except Exception as e:  # anything else: one line with its root cause
        if debug:
            raise
        cause = root(e)
        line = said(e) + (f" (root cause: {said(cause)})" if cause is not e else "")
        return fail(e, line + "; --debug for the full trace", 1)


def add_imports(parser: argparse.ArgumentParser) -> None:
    """Declare ``--import MODULE_OR_FILE.py`` (repeatable): envs of your own, by id."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE_OR_FILE.py",
        help="import a module or .py file that registers envs (repeatable; adds to `imports`)",
    )


class _HelpWithReference(argparse.Action):
    """``-h``: the command's help, then every config field (generated from the models)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(parser.format_help())
        print("config fields (--section.key=value; docs/config.md):")
        print(reference("text"))
        parser.exit()


def add_train(subparsers: Any) -> None:
    """Declare ``agentrl train CONFIG [--section.key=value ...] [--import M] [--resume]``."""
    p = subparsers.add_parser(
        "train",
        help="train an agent from a TOML/YAML config",
        description="Train from CONFIG (TOML or YAML); override any field as --section.key=value. "
        "The whole config is checked before anything is built or written.",
        add_help=False,
    )
    p.add_argument("-h", "--help", action=_HelpWithReference, help="this help and every field")
    p.add_argument("config", help="config file (TOML or YAML)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run_dir")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run --run_dir holds (else a run directory in use is refused)",
    )
    add_imports(p)
    p.set_defaults(func=_cmd_train, accepts_overrides=True)


def _cmd_train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides, imports=args.imports)
    run_training(config, resume=args.resume, overwrite=args.overwrite)
    return 0


def add_rollout(subparsers: Any) -> None:
    """Declare ``agentrl rollout ENV_ID ...`` (flags from ``RolloutConfig`` and the config)."""
    p = subparsers.add_parser(
        "rollout",
        help="generate trajectories with no training (data generation, evaluation)",
        description="Run G episodes per task against SGLang endpoints (or the embedded engine) "
        "and write trajectories to JSONL as they finish. Every flag below is a field of the "
        "config (its default is the field's); any other field is --section.key=value.",
    )
    p.add_argument("env_id", help="a registered env id, e.g. arith-v0")
    p.add_argument("--out", required=True, help="JSONL file; trajectories are appended")
    p.add_argument("--config", default=None, help="a TOML/YAML config to start from")
    add_imports(p)
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        help="SGLang base URL; repeat for several (inference.endpoints; default: the embedded "
        "engine)",
    )
    p.add_argument("--model", default=None, help="model.path: HF dir or 'tiny' (default tiny)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir for remote endpoints (default: --model's)"
    )
    p.add_argument("--split", default="test", choices=["train", "test"], help="task split")
    p.add_argument(
        "--tasks",
        default=None,
        help="JSONL/Parquet of tasks (env.eval_tasks, or env.train_tasks "
        "with --split train; default: the env's generator)",
    )
    p.add_argument(
        "--num-tasks",
        type=int,
        default=None,
        help="generated tasks when no --tasks (env.num_eval_tasks / env.num_train_tasks)",
    )
    add_fault_flags(p)
    add_flags(p, "env", ["prompt_field", "answer_field"])
    add_flags(p, "rollout")
    add_flags(p, "inference", [n for n in _inference_fields() if n != "endpoints"])
    p.set_defaults(func=_cmd_rollout, accepts_overrides=True)


def _inference_fields() -> list[str]:
    from agentrl.config import InferenceConfig

    return list(InferenceConfig.model_fields)


def rollout_config(args: argparse.Namespace) -> TrainConfig:
    """The config of ``agentrl rollout``: file, then its flags, then ``--section.key=value``."""
    split = "train" if args.split == "train" else "eval"
    items = [f"--env.id={json.dumps(args.env_id)}"]
    if args.endpoint:
        items.append(f"--inference.endpoints={json.dumps(args.endpoint)}")
    if args.model is not None:
        items.append(f"--model.path={json.dumps(args.model)}")
    if args.tasks is not None:
        items.append(f"--env.{split}_tasks={json.dumps(args.tasks)}")
    if args.num_tasks is not None:
        items.append(f"--env.num_{split}_tasks={args.num_tasks}")
    items += flag_overrides(args) + list(args.overrides)
    return load_config(args.config, items, imports=args.imports)


# ---- faults (issue 20): the flags and the exit status of `agentrl rollout` --------------------


def add_fault_flags(p: argparse.ArgumentParser) -> None:
    """``--request-timeout`` (``inference.timeout_s``) and ``--max-failed-frac``.

    ``--retry-s``, ``--stall-s`` and ``--env-timeout-s`` are generated from the config.
    """
    p.add_argument(
        "--request-timeout",
        dest=flag_dest("inference", "timeout_s"),
        default=argparse.SUPPRESS,
        metavar="FLOAT",
        help="seconds one generate call may take (--inference.timeout_s)",
    )
    p.add_argument(
        "--max-failed-frac",
        type=float,
        default=0.0,
        help="exit non-zero when more than this fraction of episodes failed (default 0)",
    )


def failure_rows(m: dict[str, float]) -> list[tuple[str, str]]:
    """The summary table's failure lines: the total, then one line per cause that occurred."""
    rows = [("failed", f"{int(m.get('rollout/failed', 0))}")]
    prefix = "rollout/failed_"
    rows += [
        (f"  {key[len(prefix) :]}", f"{int(v)}")
        for key, v in m.items()
        if key.startswith(prefix) and v
    ]
    return rows


def rollout_exit_code(m: dict[str, float], max_failed_frac: float) -> int:
    """1 when more than ``max_failed_frac`` of the episodes failed (or none ran), else 0."""
    n = m.get("rollout/episodes", 0.0)
    return 0 if n and m.get("rollout/failed", 0.0) <= max_failed_frac * n else 1


def _cmd_rollout(args: argparse.Namespace) -> int:
    with exit_guard():
        return asyncio.run(_rollout(args))


async def endpoint_client(cfg: Any, tokenizer_name: str | None) -> tuple[Any, Any]:
    """``(client, tokenizer)`` for ``cfg.inference.endpoints``, checked by ``/health`` first.

    The tokenizer is ``tokenizer_name``'s, else ``model.path``'s (a preset builds its own).
    """
    from transformers import AutoTokenizer

    from agentrl.inference.client.sglang_client import SGLangClient
    from agentrl.tiny import PRESETS, build_tiny_tokenizer

    name = tokenizer_name or cfg.model.path
    tokenizer = build_tiny_tokenizer() if name in PRESETS else AutoTokenizer.from_pretrained(name)
    client = SGLangClient(cfg.inference.endpoints, **cfg.inference.client_options())
    if not await client.health():  # a dead server is one line, not a table of failures
        await client.aclose()
        raise TrainingError(
            f"inference server {', '.join(cfg.inference.endpoints)} does not answer /health "
            "(is it running? check inference.endpoints)"
        )
    return client, tokenizer


async def _rollout(args: argparse.Namespace) -> int:
    from agentrl.data import tasks_for
    from agentrl.env import import_envs, make
    from agentrl.rollout.engine import JsonlSink, RolloutEngine, rollout_metrics

    cfg = rollout_config(args)
    import_envs(cfg.imports)
    tasks = tasks_for(cfg, args.split)  # checked before any model is loaded
    config = cfg.rollout
    client: Any
    if cfg.inference.endpoints:
        client, tokenizer = await endpoint_client(cfg, args.tokenizer)
    else:
        from agentrl.inference.engine import LocalEngine

        client = LocalEngine.from_pretrained(
            cfg.model.path, max_batch_size=cfg.inference.max_batch_size
        )
        tokenizer = client.tokenizer
    engine = RolloutEngine(client, tokenizer, config)
    sink = JsonlSink(args.out, extra={"env_id": cfg.env.id})
    groups = []
    t0 = time.perf_counter()
    bar = tqdm(total=len(tasks) * config.group_size, desc=cfg.env.id, unit="episode")
    try:
        async for group in engine.stream_groups(
            lambda: make(cfg.env.id, **cfg.env.kwargs), tasks, env_id=cfg.env.id, sink=sink
        ):
            groups.append(group)
            bar.update(len(group.trajectories))
            m = rollout_metrics(groups)
            bar.set_postfix(reward=f"{m['rollout/reward_mean']:.3f}")
    finally:
        if bar is not None:
            bar.close()
        sink.close()
        await client.aclose()
    m = rollout_metrics(groups)
    rows = [
        ("episodes", f"{int(m['rollout/episodes'])}"),
        ("reward mean", f"{m.get('rollout/reward_mean', 0.0):.3f}"),
        ("success rate", f"{m.get('rollout/success_rate', 0.0):.3f}"),
        *failure_rows(m),
        ("truncated", f"{m.get('rollout/truncated_frac', 0.0):.1%}"),
        ("wall time", f"{time.perf_counter() - t0:.1f} s"),
        ("written to", str(Path(args.out))),
    ]
    print(_table(rows))
    print(json.dumps({k: round(v, 6) for k, v in m.items()}))
    return rollout_exit_code(m, args.max_failed_frac)
