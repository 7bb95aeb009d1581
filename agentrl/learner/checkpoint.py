"""Weights and training state on disk, for the learner.

Two formats, two purposes:

* **Inference weights** (:func:`full_state_dict`, :func:`save_hf_checkpoint`): the model's own
  Hugging Face parameter names, the dtype it was loaded in, one ``model.safetensors`` plus
  ``config.json`` — what SGLang's ``update_weights_from_disk`` and ``from_pretrained`` read.
  Under FSDP the shards are gathered (a collective: every rank calls) and rank 0 writes.
* **Training state** (:func:`training_state`, :func:`save_training_state`): model, AdamW
  moments and step counts, RNG, for exact resume. The model and optimizer go through
  ``torch.distributed.checkpoint`` (sharded files under FSDP, the same code path in one
  process); optimizer state is keyed by parameter name, so it survives a rebuilt optimizer.
  An optimizer that has not stepped yet is saved as "no state" rather than letting
  ``get_state_dict`` initialise it (that would run a zero-learning-rate step and advance AdamW's
  step count, making a run that saved differ from one that did not).
  With ``adapter_only`` (LoRA) the frozen parameters are left out: the model part holds just
  the adapters (the base is rebuilt from the run's model on resume).
"""

from __future__ import annotations

import copy
import io
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from transformers import PreTrainedModel


def full_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All weights of ``model`` under its own names, gathered if sharded, cast to ``dtype``.

    Tied weights appear under both names, as ``model.state_dict()`` has them.
    """
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().to(dtype)
    return out


def save_hf_checkpoint(
    model: PreTrainedModel,
    weights: dict[str, torch.Tensor],
    path: str | Path,
    *,
    architecture: str,
    dtype: torch.dtype,
    tokenizer: Any | None = None,
) -> Path:
    """Write ``weights`` as a Hugging Face checkpoint of ``model``'s config.

    Args:
        model: the transformers model the weights belong to (its config is saved).
        weights: from :func:`full_state_dict`.
        path: output directory (created).
        architecture: the model class name for ``config.architectures`` (FSDP renames the
            class of a sharded model, so the caller records it before sharding).
        dtype: the dtype written into the config.
        tokenizer: optionally saved alongside.

    Returns:
        The directory.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    config.architectures = [architecture]
    config.dtype = dtype
    weights = dict(weights)
    if config.get_text_config().tie_word_embeddings:  # HF stores a tied head once
        head = model.get_output_embeddings()
        name = next(n for n, m in model.named_modules() if m is head)
        weights.pop(f"{name}.weight", None)
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def rng_state() -> dict[str, Any]:
    """Torch's CPU and CUDA RNG states."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    torch.set_rng_state(state["cpu"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _options(adapter_only: bool) -> StateDictOptions:
    # frozen parameters left out; loading then checks the keys itself (strict would want them)
    return StateDictOptions(ignore_frozen_params=adapter_only, strict=not adapter_only)


def _trainable(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without frozen entries torch keeps (a tied head: its name is the second)."""
    names = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def training_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, *, adapter_only: bool = False
) -> dict[str, Any]:
    """A detached copy of model and optimizer state (sharded under FSDP) and the RNG.

    ``optimizer`` is ``None`` in the result when the optimizer has not stepped yet.
    ``adapter_only``: the trainable parameters alone (LoRA).
    """
    has_optim = bool(optimizer.state)
    opts = _options(adapter_only)
    model_sd, optim_sd = get_state_dict(module, optimizer if has_optim else [], options=opts)
    if adapter_only:
        model_sd = _trainable(module, model_sd)
    snap = {"model": model_sd, "optimizer": optim_sd if has_optim else None, "rng": rng_state()}
    return _clone(snap)


def load_training_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    *,
    adapter_only: bool = False,
) -> None:
    """Load a :func:`training_state` into ``module`` and a *fresh* ``optimizer``.

    Raises:
        ValueError: ``adapter_only`` and the state's model keys are not the trainable ones.
    """
    optim = state["optimizer"]
    opts = _options(adapter_only)
    if adapter_only:
        want = set(_trainable(module, get_state_dict(module, [], options=opts)[0]))
        if set(state["model"]) != want:
            extra, missing = sorted(set(state["model"]) - want), sorted(want - set(state["model"]))
            raise ValueError(
                f"checkpoint: not this model's adapters (missing {missing[:2]}, "
                f"unexpected {extra[:2]})"
            )
    set_state_dict(
        module,
        optimizer if optim is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=optim or {},
        options=opts,
    )
    set_rng_state(state["rng"])


def save_training_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | Path,
    *,
    rank: int,
    world_size: int,
    meta: dict[str, Any],
    adapter_only: bool = False,
) -> None:
    """Write :func:`training_state` and a JSON ``meta`` under ``path`` (every rank calls)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    state = training_state(module, optimizer, adapter_only=adapter_only)
    tensors = {"model": state["model"], "optimizer": state["optimizer"] or {}}
    with warnings.catch_warnings():  # one process is the intended case, not a misconfiguration
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=str(root), no_dist=world_size == 1)
    buf = io.BytesIO()  # through memory: a full disk is then ENOSPC, not torch's RuntimeError
    torch.save(state["rng"], buf)
    (root / f"rng-rank{rank}.pt").write_bytes(buf.getbuffer())
    if rank == 0:
        meta = {**meta, "has_optimizer": state["optimizer"] is not None}
        (root / "meta.json").write_text(json.dumps(meta))


def load_training_state_from(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | Path,
    *,
    rank: int,
    world_size: int,
    adapter_only: bool = False,
) -> dict[str, Any]:
    """Restore what :func:`save_training_state` wrote into a fresh ``optimizer``; returns meta."""
    root = Path(path)
    meta = json.loads((root / "meta.json").read_text())
    optim: Any = optimizer if meta["has_optimizer"] else []
    opts = _options(adapter_only)  # templates dcp.load fills in place
    model_sd, optim_sd = get_state_dict(module, optim, options=opts)
    if adapter_only:
        model_sd = _trainable(module, model_sd)
    tensors = {"model": model_sd, "optimizer": optim_sd if meta["has_optimizer"] else {}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=str(root), no_dist=world_size == 1)
    rng = torch.load(root / f"rng-rank{rank}.pt", weights_only=False)
    state = {
        "model": tensors["model"],
        "optimizer": tensors["optimizer"] if meta["has_optimizer"] else None,
        "rng": rng,
    }
    load_training_state(module, optimizer, state, adapter_only=adapter_only)
    return meta


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return copy.deepcopy(value)
