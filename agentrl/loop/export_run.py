"""``agentrl export RUN_DIR [--step N] --out DIR``: a run's checkpoint as a Hugging Face model.

A run's checkpoints (:mod:`agentrl.loop.checkpoints`) hold the learner's training state, sharded
by ``torch.distributed.checkpoint``; engines and transformers want a model directory. This
module picks a checkpoint (``--step N``, else the newest whose ``MANIFEST`` verifies), rebuilds
the run's model on the ``meta`` device from the run's ``config.yaml`` (``model.path`` and
``model.tiny``: the same architecture and tokenizer the run used, chat template included),
consolidates the shards in this process and writes config, safetensors shards, tokenizer files,
chat template and generation config (:func:`~agentrl.learner.export.write_pretrained`).

The output appears whole or not at all: it is written into a temporary directory beside
``--out`` and renamed into place. A non-empty ``--out`` is refused unless ``--overwrite``, which
replaces only a model directory (one with ``config.json``). ``agentrl train`` calls
:func:`export_run` at the end of a run when ``train.export`` is on (``RUN_DIR/export``).

A run with ``learner.lora`` checkpoints only its adapters: the export rebuilds the base (the
run's ``model.path``, or the tiny preset from the run's ``seed``), writes the merged model
(``W + alpha/rank * B @ A``) and the adapter alone in peft's layout under ``OUT/adapter``
(``adapter_config.json``, ``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained``
and SGLang's ``--lora-paths`` read it).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from agentrl.config import ModelConfig
from agentrl.errors import ConfigError, TrainingError
from agentrl.loop.atomic import disk_errors, fsync_dir, fsync_file
from agentrl.loop.checkpoints import committed, name_of, step_of, verify

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_CONFIG_BYTES = 1 << 20  # a run's config.yaml is a few KiB
_SHARD_SIZE = re.compile(r"^[1-9]\d{0,5}(KB|MB|GB|KiB|MiB|GiB)$")  # transformers' notation


@dataclass
class Exported:
    """What :func:`export_run` wrote."""

    path: Path
    step: int
    dtype: str
    skipped: list[str] = field(default_factory=list)  # checkpoints passed over, one line each


def find_checkpoint(run_dir: Path, step: int | None) -> tuple[Path, int, list[str]]:
    """The checkpoint of ``step`` (``None``: the newest that verifies) and the skipped ones.

    Raises:
        ConfigError: no such step, or no checkpoint at all.
        TrainingError: the checkpoint asked for (or every one) fails its manifest check.
    """
    root = run_dir / "checkpoints"
    found = committed(root)
    have = ", ".join(str(step_of(p.name)) for p in reversed(found)) or "none"
    if step is not None:
        path = root / name_of(step)
        if path not in found:
            raise ConfigError(
                f"--step {step}: {run_dir} has no checkpoint of that step (has: {have})"
            )
        if (why := verify(path)) is not None:
            raise TrainingError(f"checkpoint {path} is corrupt: {why}")
        return path, step, []
    if not found:
        raise ConfigError(f"{run_dir} has no checkpoint (a run writes one at its end)")
    skipped: list[str] = []
    for path in found:
        if (why := verify(path)) is None:
            return path, int(step_of(path.name) or 0), skipped
        skipped.append(f"export: skipping checkpoint {path}: {why}")
    raise TrainingError(f"no checkpoint of {run_dir} verifies ({skipped[0].split(': ', 2)[2]})")


def run_model_config(run_dir: Path) -> ModelConfig:
    """The ``model`` section of the run's ``config.yaml``.

    Raises:
        ConfigError: ``run_dir`` is not a run directory, or its config is unreadable.
    """
    return _run_config(run_dir)[0]


def _run_config(run_dir: Path) -> tuple[ModelConfig, int]:
    """The ``model`` section and the ``seed`` of the run's ``config.yaml``."""
    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR: no such directory {run_dir}")
    if not path.is_file():
        raise ConfigError(f"RUN_DIR: {run_dir} holds no run (no config.yaml)")
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ConfigError(f"RUN_DIR: {path} is over {_MAX_CONFIG_BYTES} bytes")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return ModelConfig.model_validate(raw.get("model") or {}), int(raw.get("seed") or 0)
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"RUN_DIR: cannot read the model of {path}: {first}") from None


def model_skeleton(model: ModelConfig) -> tuple[Any, Any]:
    """``(model on the meta device, tokenizer)`` as the run's :func:`load_policy` built them."""
    from agentrl.tiny import PRESETS, build_preset

    if model.path in PRESETS:
        with torch.device("meta"):  # the architecture only: no memory, no initialisation
            return build_preset(model.path, **model.tiny)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(model.path)
        tokenizer = AutoTokenizer.from_pretrained(model.path)
    except (OSError, ValueError) as e:  # moved, deleted, or a hub id offline
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.path of the run: cannot load {model.path!r}: {first}") from None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    try:
        skeleton.generation_config = GenerationConfig.from_pretrained(model.path)
    except OSError:  # the source has none: keep the one derived from its config
        pass
    return skeleton, tokenizer


def base_weights(model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The run's initial (base) weights, as :func:`load_policy` built them, on the CPU."""
    from agentrl.tiny import PRESETS, build_preset

    if model.path in PRESETS:
        return build_preset(model.path, seed=seed, **model.tiny)[0].state_dict()
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model.path).state_dict()
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.path of the run: cannot load {model.path!r}: {first}") from None


def merge_lora(
    weights: dict[str, torch.Tensor], lora: dict[str, Any], model: ModelConfig, seed: int
) -> dict[str, torch.Tensor]:
    """The merged full weights of a LoRA checkpoint's adapters (``weights``) on the run's base.

    Raises:
        ValueError: the checkpoint holds more than adapters, or they do not fit the base.
    """
    from agentrl.learner.lora import merge_adapter_into

    if not all(".lora_A." in k or ".lora_B." in k for k in weights):
        raise ValueError("a LoRA checkpoint holds weights other than adapters")
    scaling = float(lora["alpha"]) / int(lora["rank"])
    return merge_adapter_into(base_weights(model, seed), weights, scaling)


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is not a directory, or not empty without ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(f"--out: {out} is not empty; pass --overwrite to replace it")
        if out.is_symlink() or not (out / "config.json").is_file():
            raise ConfigError(
                f"--out: --overwrite replaces only a model directory (with config.json), not {out}"
            )


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an old ``out`` goes aside first, then is removed."""
    mask = os.umask(0)
    os.umask(mask)
    for p in sorted(tmp.rglob("*"), reverse=True):  # safetensors writes 0600; others read it
        if p.is_dir():
            p.chmod(0o777 & ~mask)
            fsync_dir(p)
        else:
            p.chmod(0o666 & ~mask)
            fsync_file(p)
    fsync_dir(tmp)
    aside = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.is_dir():
        os.replace(out, aside)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(aside, ignore_errors=True)


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_size: str = "5GB",
) -> Exported:
    """Write checkpoint ``step`` of ``run_dir`` (default: the newest good one) as a model, ``out``.

    ``run_dir`` may also be a checkpoint directory itself (``RUN/checkpoints/step-NNNNNN``).
    ``dtype``: ``float32``, ``bfloat16`` or ``float16`` (default: the run's ``model.dtype``).

    Raises:
        ConfigError: a bad ``run_dir``, ``step``, ``dtype`` or ``out``.
        TrainingError: the checkpoint is corrupt or does not hold the run's model.
        DiskFull: no space left (nothing is left at ``out``).
    """
    from agentrl.learner.config import LoraConfig
    from agentrl.learner.export import checkpoint_weights, read_lora_meta, write_pretrained
    from agentrl.learner.lora import save_peft_adapter

    run, out = Path(run_dir).expanduser(), Path(out).expanduser()
    if (n := step_of(run.name)) is not None and run.parent.name == "checkpoints":
        if step is not None and step != n:
            raise ConfigError(f"--step {step}: {run_dir} is the checkpoint of step {n}")
        run, step = run.parent.parent, n
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if not _SHARD_SIZE.match(max_shard_size):
        raise ConfigError(
            f"--max-shard-size: expected a size like 5GB or 500MB, got {max_shard_size!r}"
        )
    model_config, seed = _run_config(run)
    check_out(out, overwrite)  # before any work
    path, step, skipped = find_checkpoint(run, step)
    dtype = dtype or model_config.dtype
    skeleton, tokenizer = model_skeleton(model_config)
    try:
        weights = checkpoint_weights(path / "learner")
        lora = read_lora_meta(path / "learner")
    except Exception as e:  # any read error: the checkpoint is not usable
        first = (f"{type(e).__name__}: {e}".strip().splitlines() or [""])[0][:200]
        raise TrainingError(f"checkpoint {path} cannot be read ({first})") from None
    adapter: dict[str, torch.Tensor] = {}
    if lora is not None:
        adapter = weights
        try:
            weights = merge_lora(adapter, lora, model_config, seed)
        except ValueError as e:
            raise TrainingError(f"checkpoint {path}: {e}") from None
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with disk_errors(out):
            for kind in ("tmp", "old"):  # what a killed writer left
                for stale in out.parent.glob(f".{out.name}.{kind}-*"):
                    shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                write_pretrained(
                    skeleton,
                    weights,
                    tmp,
                    dtype=DTYPES[dtype],
                    tokenizer=tokenizer,
                    max_shard_size=max_shard_size,
                )
            except ValueError as e:
                raise TrainingError(f"checkpoint {path}: {e}") from None
            if lora is not None:
                save_peft_adapter(
                    adapter,
                    tmp / "adapter",
                    LoraConfig.model_validate(lora),
                    base_model=model_config.path,
                    dtype=DTYPES[dtype],
                )
            _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, step, dtype, skipped)


def export_final(run_dir: Path, step: int) -> Path | None:
    """``agentrl train``'s end (``train.export``): checkpoint ``step`` as ``run_dir/export``.

    A failure is one warning line, never the run's: its checkpoint is there to export again.
    """
    try:
        return export_run(run_dir, run_dir / "export", step=step, overwrite=True).path
    except Exception as e:
        first = (f"{type(e).__name__}: {e}".strip().splitlines() or [""])[0][:300]
        log.warning("export: %s (retry with `agentrl export %s --out DIR`)", first, run_dir)
        return None


def add_export(subparsers: Any) -> None:
    """Declare ``agentrl export RUN_DIR [--step N] --out DIR [--dtype D] [--overwrite]``."""
    p = subparsers.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model directory",
        description="Write a checkpoint of RUN_DIR (FSDP shards consolidated) as a Hugging Face "
        "model directory: config, safetensors, tokenizer, chat template, generation config. It "
        "loads with transformers' from_pretrained, serves with `agentrl serve --model DIR` and "
        "is SGLang's --model-path. RUN_DIR may also be RUN_DIR/checkpoints/step-NNNNNN. A LoRA "
        "run's export is the merged model plus its adapter in peft's layout under OUT/adapter.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or one of its checkpoints)")
    p.add_argument("--out", required=True, help="the model directory to write (made whole)")
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="the checkpoint's step (default: newest that verifies)",
    )
    p.add_argument(
        "--dtype", choices=list(DTYPES), default=None,
        help="dtype of the weights (default: the run's model.dtype)",
    )  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace a model directory at --out")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    done = export_run(
        args.run_dir,
        args.out,
        step=args.step,
        dtype=args.dtype,
        overwrite=args.overwrite,
        max_shard_size=args.max_shard_size,
    )
    for line in done.skipped:  # checkpoints that failed their manifest check
        print(line, file=sys.stderr)
    print(f"exported step {done.step} of {args.run_dir} ({done.dtype}) to {done.path}")
    return 0
