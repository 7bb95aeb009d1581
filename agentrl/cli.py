"""The ``agentrl`` command: one subcommand per job.

Each subcommand has a function that declares its arguments and sets the function that runs it
as the parser's ``func`` (returning the exit code): ``train`` and ``rollout`` are declared by
:func:`agentrl.loop.jobs.add_train` / :func:`~agentrl.loop.jobs.add_rollout` and take the
config's ``--section.key=value`` overrides and ``--import``; ``serve`` here; ``report`` by
:func:`agentrl.report.build.add_report_command`. ``main(argv)`` returns the exit code; a bad
config or argument is one line on stderr naming the field, and any other failure one line with
its root cause; ``agentrl --debug COMMAND`` prints the full traceback as well.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from agentrl import __version__
from agentrl.loop.evaluate import add_eval
from agentrl.loop.export_run import add_export
from agentrl.loop.jobs import add_rollout, add_train, exit_code
from agentrl.report.build import add_report_command


def _gib(text: str) -> float:
    """A positive size in GiB (argparse type)."""
    value = float(text)
    if not 0 < value < 1e6:
        raise argparse.ArgumentTypeError(f"expected a size in GiB > 0, got {text}")
    return value


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the embedded engine behind SGLang's native HTTP API",
        description=(
            "Serve a model with agentrl's embedded engine behind the subset of SGLang's native "
            "HTTP API that agentrl's client uses (/generate, /abort_request, /pause_generation, "
            "/update_weights_from_disk, /model_info, ...). '--model tiny' needs no download."
        ),
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--model", help="HF model directory, or a preset ('tiny', 'tiny-moe')"
    )
    which.add_argument(
        "--config",
        help="a training config: serve its policy with the engine 'agentrl train' would build "
        "(model, dtype, device, KV budget, batch size), e.g. on the learner's card for "
        "inference.weight_sync=tensor; --section.key=value items after it override it",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port; 0 picks a free one")
    parser.add_argument(
        "--max-batch-size", type=int, default=64,
        help="requests decoded together (--model; a --config sets its own)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default=None, help="torch device (--model; default: cuda if present)"
    )
    parser.add_argument(
        "--kv-cache-gib", type=_gib, default=None,
        help="KV cache size in GiB (--model; default: a share of the card's free memory)",
    )  # fmt: skip
    parser.add_argument(
        "--weight-version", default="default", help="label of the initial weights (SGLang's)"
    )
    parser.add_argument("--served-model-name", default=None, help="model id in /v1/models")
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="let requests ask for their routed experts (return_routed_experts; MoE models)",
    )
    parser.add_argument("--torch-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    keys = parser.add_argument_group(
        "access", "keys as SGLang's: KEY, env:NAME or file:PATH (the last two keep it out of ps)"
    )
    keys.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="every route but /health and /ready wants 'Authorization: Bearer KEY' "
        "(--config: default inference.api_key)",
    )  # fmt: skip
    keys.add_argument(
        "--admin-api-key", default=None, metavar="KEY",
        help="the weight, pause, continue, abort and flush routes want this key instead "
        "(--config: default inference.admin_api_key)",
    )  # fmt: skip
    keys.add_argument(
        "--allowed-hosts", action="append", default=[], metavar="HOST[,HOST]",
        help="more Host names to answer besides loopback, the bind address and this machine's "
        "names ('*': any, e.g. behind a reverse proxy)",
    )  # fmt: skip
    keys.add_argument(
        "--weights-dir", action="append", default=[], metavar="DIR",
        help="a directory /update_weights_from_disk may load from (repeatable; default: the "
        "model directory and, with --config, the run's weights directory)",
    )  # fmt: skip
    parser.set_defaults(func=_cmd_serve, accepts_overrides=True)


def _cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import torch

    from agentrl.inference.api_keys import read_key
    from agentrl.inference.server.engine_server import run_engine_server

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    def announce(url: str) -> None:
        # One stable line on stdout: scripts and test fixtures wait for it (port 0 included).
        print(f"agentrl serve: listening on {url}", flush=True)

    if args.overrides and args.config is None:  # a bad argument, one line, as argparse says
        print(f"agentrl serve: error: overrides need --config: {' '.join(args.overrides)}",
              file=sys.stderr)  # fmt: skip
        return 2
    weights_dirs = list(args.weights_dir)
    try:  # one line naming the option and the variable or file, never the key
        api_key = read_key(args.api_key, "--api-key")
        admin_api_key = read_key(args.admin_api_key, "--admin-api-key")
    except ValueError as exc:
        print(f"agentrl serve: error: {exc}", file=sys.stderr)
        return 2
    if args.config is not None:  # the policy and engine `agentrl train CONFIG` would build
        from agentrl.config import load_config
        from agentrl.loop.placement import load_policy, make_local_engine

        config = load_config(args.config, args.overrides)
        config_keys = config.inference.keys()
        api_key = api_key if args.api_key is not None else config_keys[0]
        admin_api_key = admin_api_key if args.admin_api_key is not None else config_keys[1]
        # the run's weights directory; without run_dir its name is not known yet: out_dir
        run_weights = Path(config.run_dir) / "weights" if config.run_dir else Path(config.out_dir)
        weights_dirs.append(str(run_weights))
        if config.run_dir:  # learner.lora: the adapters the trainer writes for /load_lora_adapter
            weights_dirs.append(str(Path(config.run_dir) / "adapters"))
        model, tokenizer = load_policy(config)
        engine = make_local_engine(model, tokenizer, config, copy_model=False)
        model_path = config.model.path
    else:
        from agentrl.inference.engine import LocalEngine
        from agentrl.inference.sglang_api import parse_weight_version

        engine = LocalEngine.from_pretrained(  # ConfigError: routed experts of a dense model
            args.model,
            device=args.device,
            max_batch_size=args.max_batch_size,
            weight_version=parse_weight_version(args.weight_version),
            return_routed_experts=args.enable_return_routed_experts,
            kv_cache_gib=args.kv_cache_gib,
        )
        model_path = args.model
    if Path(model_path).expanduser().is_dir():  # reloading the weights it started from
        weights_dirs.append(model_path)
    run_engine_server(
        engine,
        model_path=model_path,
        host=args.host,
        port=args.port,
        weight_version=args.weight_version,
        served_model_name=args.served_model_name,
        on_ready=announce,
        api_key=api_key,
        admin_api_key=admin_api_key,
        extra_hosts=args.allowed_hosts,
        weights_dirs=weights_dirs,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``agentrl`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="agentrl",
        description="Train LLM agents with reinforcement learning over multi-turn interactions.",
    )
    parser.add_argument("--version", action="version", version=f"agentrl {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on failure, print the full traceback (else one line with the root cause)",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_serve(subparsers)
    add_train(subparsers)
    add_rollout(subparsers)
    add_eval(subparsers)
    add_export(subparsers)
    add_report_command(subparsers)
    return parser


def _stack_dump_on_usr1() -> None:
    """``kill -USR1 PID`` prints every thread's stack to stderr (where a hung run waits)."""
    if not hasattr(signal, "SIGUSR1") or sys.__stderr__ is None:
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (OSError, ValueError, io.UnsupportedOperation):  # no file descriptor behind stderr
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``agentrl`` command line; returns the process exit code."""
    _stack_dump_on_usr1()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # only --section.key=value items are config overrides; anything else is a bad argument
    bad = (
        extra
        if not getattr(args, "accepts_overrides", False)
        else [x for x in extra if "=" not in x]
    )
    if bad:
        parser.error(
            f"unrecognized arguments: {' '.join(bad)}"
            + (" (config overrides are --section.key=value)" if extra != bad else "")
        )
    args.overrides = extra
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    # a bad config, a dead server, any failure: one line (the full trace with --debug)
    return exit_code(lambda: args.func(args), debug=args.debug)


def entry() -> None:
    """The ``agentrl`` console script: :func:`main`, then an exit stuck threads cannot hold."""
    from agentrl.rollout.watchdog import end_process

    end_process(main())


if __name__ == "__main__":
    entry()
