"""The learner's weights going out and coming back: inference export and exact checkpoints.

:class:`LearnerWeights` is the part of :class:`~agentrl.learner.Learner` that writes the policy
for an engine (a state dict in memory, or a Hugging Face directory for SGLang's
``update_weights_from_disk``) and saves/restores the full training state (model, optimizer, RNG,
step count) so that a resumed run continues exactly. Under FSDP every rank calls each method.

With no learner and no process group, :func:`checkpoint_weights` consolidates the model of a
saved checkpoint (the FSDP shards of any number of ranks) under Hugging Face names and
:func:`write_pretrained` writes it as a model directory through transformers' own
``save_pretrained`` (shards, tied weights, MoE experts in the checkpoint layout SGLang reads):
what ``agentrl export`` does (:mod:`agentrl.loop.export_run`).

With LoRA (``learner.lora``) the inference weights are the merged ones (``W + scaling * B @ A``,
under the base's names), :meth:`LearnerWeights.adapter_state` and
:meth:`LearnerWeights.save_adapter` give the adapter alone in peft's layout, and checkpoints hold
the adapters and their optimizer state only (``meta.json`` records the adapter config).
"""

from __future__ import annotations

import json
import warnings
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import PreTrainedModel

from agentrl.learner import lora as lora_mod
from agentrl.learner.checkpoint import (
    full_state_dict,
    load_training_state,
    load_training_state_from,
    save_hf_checkpoint,
    save_training_state,
    training_state,
)
from agentrl.learner.config import LoraConfig
from agentrl.learner.logprobs import LogprobModel


class LearnerWeights(ABC):
    """Export and checkpoints of a learner's model (a base of :class:`~agentrl.learner.Learner`).

    Uses the learner's ``model`` (the transformers module), ``module`` (what trains: the
    log-prob wrapper), ``optimizer``, ``num_steps``, ``rank``, ``world_size``, ``architecture``
    and ``export_dtype``, and its ``reset_optimizer()``.
    """

    model: PreTrainedModel
    module: LogprobModel
    optimizer: torch.optim.Optimizer
    num_steps: int
    rank: int
    world_size: int
    architecture: str
    export_dtype: torch.dtype
    lora: LoraConfig | None = None
    _live: tuple[tuple[int, ...], dict[str, torch.Tensor]] | None = None

    @abstractmethod
    def reset_optimizer(self) -> None:
        """Start the optimizer afresh (the learner's own; a restore begins with it)."""

    def state_dict_for_inference(self) -> dict[str, torch.Tensor]:
        """Full weights under the model's Hugging Face names, in the dtype it came in.

        Under FSDP every rank must call this (the shards are gathered). With LoRA: the
        adapters merged into the base weights.
        """
        if self.lora is not None:
            return lora_mod.merged_state(self.model, self.export_dtype)
        return full_state_dict(self.model, self.export_dtype)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters alone under peft's names, in their own dtype (every rank calls)."""
        if self.lora is None:
            raise RuntimeError("adapter_state: the learner trains no adapters (learner.lora)")
        return lora_mod.adapter_state(self.model)

    def save_adapter(self, path: str | Path, base_model: str = "") -> Path:
        """Write the adapters as a peft adapter directory (every rank calls; rank 0 writes)."""
        adapter = self.adapter_state()
        if self.rank != 0 or self.lora is None:
            return Path(path)
        return lora_mod.save_peft_adapter(adapter, path, self.lora, base_model=base_model)

    def live_weights(self) -> dict[str, torch.Tensor]:
        """The weights themselves under their Hugging Face names, in the learner's own dtype.

        What an engine in this process copies from, casting as it copies (one multi-tensor
        copy): :meth:`state_dict_for_inference` walks the model and casts each float32 master
        weight to a new tensor, ~620 torch calls that each give up the GIL, which made the
        in-process push of the 0.6B shape take 14-35 ms on an H100, the card idle. While no
        parameter's storage changes, the tensors come back without walking the model again
        (read them before the next update changes them). Unsharded learners only. With LoRA:
        the merged weights, new tensors at every call.
        """
        if self.world_size > 1:
            raise RuntimeError("live_weights: a sharded learner has no full weights to lend")
        if self.lora is not None:
            return lora_mod.merged_state(self.model, torch.float32)
        live = tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))
        if self._live is None or self._live[0] != live:
            self._live = (live, self.model.state_dict())
        return dict(self._live[1])

    def save_pretrained(self, path: str | Path, tokenizer: Any | None = None) -> Path:
        """Write a Hugging Face checkpoint (config + ``model.safetensors``) for the engine.

        What SGLang's ``update_weights_from_disk`` loads. Under FSDP every rank must call it;
        rank 0 writes.

        Args:
            path: output directory (created).
            tokenizer: optionally saved alongside.

        Returns:
            The directory.
        """
        weights = self.state_dict_for_inference()
        if self.rank != 0:
            return Path(path)
        return save_hf_checkpoint(
            self.model,
            weights,
            path,
            architecture=self.architecture,
            dtype=self.export_dtype,
            tokenizer=tokenizer,
        )

    def state(self) -> dict[str, Any]:
        """A snapshot of model, optimizer, RNG and step count (this rank's shards under FSDP)."""
        adapter = self.lora is not None
        snap = training_state(self.module, self.optimizer, adapter_only=adapter)
        return {**snap, "num_steps": self.num_steps}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state` snapshot taken on the same model and number of ranks."""
        self.reset_optimizer()
        load_training_state(self.module, self.optimizer, state, adapter_only=self.lora is not None)
        self.num_steps = int(state["num_steps"])

    def save_checkpoint(self, path: str | Path) -> None:
        """Write model, optimizer, RNG and step count under ``path/learner`` (every rank calls)."""
        save_training_state(
            self.module,
            self.optimizer,
            Path(path) / "learner",
            rank=self.rank,
            world_size=self.world_size,
            meta={"num_steps": self.num_steps, "lora": self._lora_meta()},
            adapter_only=self.lora is not None,
        )

    def _lora_meta(self) -> dict[str, Any] | None:
        return None if self.lora is None else self.lora.model_dump(mode="json")

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same model, adapters, rank count).

        Raises:
            ValueError: the checkpoint's adapter config (``learner.lora``) is not this one's.
        """
        root = Path(path) / "learner"
        saved = read_lora_meta(root)
        if saved != self._lora_meta():
            raise ValueError(
                f"checkpoint {path}: trained with learner.lora={saved}, this learner has "
                f"{self._lora_meta()}"
            )
        self.reset_optimizer()
        meta = load_training_state_from(
            self.module,
            self.optimizer,
            root,
            rank=self.rank,
            world_size=self.world_size,
            adapter_only=self.lora is not None,
        )
        self.num_steps = int(meta["num_steps"])


def read_lora_meta(learner_dir: str | Path) -> dict[str, Any] | None:
    """The adapter config a training state was saved with (``None``: full fine-tuning)."""
    meta = json.loads((Path(learner_dir) / "meta.json").read_text())
    value = meta.get("lora")
    return value if isinstance(value, dict) else None


# What training state files hold the model under: the top-level ``model`` entry of
# :func:`~agentrl.learner.checkpoint.save_training_state`, then the log-prob wrapper's ``model``.
_PREFIX = "model.model."


def checkpoint_weights(learner_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of a saved training state under Hugging Face names, full size.

    ``learner_dir`` is what :meth:`LearnerWeights.save_checkpoint` wrote (``CKPT/learner``),
    from one process or many: ``torch.distributed.checkpoint`` reads the shards of every rank
    into whole tensors in this process (``no_dist``). Tensors keep their saved dtype (the
    learner's float32 master weights). The optimizer state is not read.

    Raises:
        ValueError: the checkpoint holds no model, or its metadata claims more bytes than its
            files hold (read before anything is allocated).
    """
    root = Path(learner_dir)
    meta = FileSystemReader(str(root)).read_metadata()
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, value in meta.state_dict_metadata.items():
        if key.startswith(_PREFIX) and isinstance(value, TensorStorageMetadata):
            shapes[key] = (value.size, value.properties.dtype)
    if not shapes:
        raise ValueError(f"{root} holds no model weights")
    need = sum(s.numel() * torch.empty((), dtype=d).element_size() for s, d in shapes.values())
    have = sum(f.stat().st_size for f in root.glob("*.distcp"))
    if need > have:  # bounded before allocating: the data must be on disk
        raise ValueError(
            f"{root}: its metadata claims {need} bytes of weights, its files hold {have}"
        )
    template = {k[len("model.") :]: torch.empty(s, dtype=d) for k, (s, d) in shapes.items()}
    with warnings.catch_warnings():  # one process is the intended case here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": template}, checkpoint_id=str(root), no_dist=True)
    return {k[len("model.") :]: v for k, v in template.items()}


def write_pretrained(
    skeleton: PreTrainedModel,
    weights: dict[str, torch.Tensor],
    out: str | Path,
    *,
    dtype: torch.dtype,
    tokenizer: Any | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """Write ``weights`` as a Hugging Face model directory of ``skeleton``'s architecture.

    Args:
        skeleton: the model built from the run's config, typically on the ``meta`` device (its
            weights are replaced, never read; its generation config is saved).
        weights: full tensors under ``skeleton``'s own names (:func:`checkpoint_weights`).
        out: the directory (created; files in it are overwritten).
        dtype: the dtype of the written tensors and of ``config.dtype``.
        tokenizer: saved alongside (its chat template included).
        max_shard_size: the largest safetensors file (more files and an index past it).

    Raises:
        ValueError: the names or shapes of ``weights`` are not the model's.
    """
    from transformers.utils import logging as hf_logging

    own = skeleton.state_dict()
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    if missing or extra:
        raise ValueError(
            "the checkpoint does not hold this model's weights "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); was it written by another model?"
        )
    for name, value in own.items():
        if tuple(weights[name].shape) != tuple(value.shape):
            raise ValueError(
                f"{name}: the checkpoint has shape {tuple(weights[name].shape)}, the model "
                f"{tuple(value.shape)}"
            )
    cast = {k: v.to(dtype) for k, v in weights.items()}
    skeleton.load_state_dict(cast, strict=True, assign=True)
    skeleton.tie_weights()  # assign gave the tied head a tensor of its own
    skeleton.config.dtype = dtype
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # library code prints nothing
    try:
        skeleton.save_pretrained(out, max_shard_size=max_shard_size)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return Path(out)
