"""The learner's weights going out and coming back: inference export and exact checkpoints.

:class:`LearnerWeights` is the part of :class:`~agentrl.learner.Learner` that writes the policy
for an engine (a state dict in memory, or a Hugging Face directory for SGLang's
``update_weights_from_disk``) and saves/restores the full training state (model, optimizer, RNG,
step count) so that a resumed run continues exactly. Under FSDP every rank calls each method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from agentrl.learner.checkpoint import (
    full_state_dict,
    load_training_state,
    load_training_state_from,
    save_hf_checkpoint,
    save_training_state,
    training_state,
)
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
    _live: tuple[tuple[int, ...], dict[str, torch.Tensor]] | None = None

    @abstractmethod
    def reset_optimizer(self) -> None:
        """Start the optimizer afresh (the learner's own; a restore begins with it)."""

    def state_dict_for_inference(self) -> dict[str, torch.Tensor]:
        """Full weights under the model's Hugging Face names, in the dtype it came in.

        Under FSDP every rank must call this (the shards are gathered).
        """
        return full_state_dict(self.model, self.export_dtype)

    def live_weights(self) -> dict[str, torch.Tensor]:
        """The weights themselves under their Hugging Face names, in the learner's own dtype.

        What an engine in this process copies from, casting as it copies (one multi-tensor
        copy): :meth:`state_dict_for_inference` walks the model and casts each float32 master
        weight to a new tensor, ~620 torch calls that each give up the GIL, which made the
        in-process push of the 0.6B shape take 14-35 ms on an H100, the card idle. While no
        parameter's storage changes, the tensors come back without walking the model again
        (read them before the next update changes them). Unsharded learners only.
        """
        if self.world_size > 1:
            raise RuntimeError("live_weights: a sharded learner has no full weights to lend")
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
        return {**training_state(self.module, self.optimizer), "num_steps": self.num_steps}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state` snapshot taken on the same model and number of ranks."""
        self.reset_optimizer()
        load_training_state(self.module, self.optimizer, state)
        self.num_steps = int(state["num_steps"])

    def save_checkpoint(self, path: str | Path) -> None:
        """Write model, optimizer, RNG and step count under ``path/learner`` (every rank calls)."""
        save_training_state(
            self.module,
            self.optimizer,
            Path(path) / "learner",
            rank=self.rank,
            world_size=self.world_size,
            meta={"num_steps": self.num_steps},
        )

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same model and number of ranks)."""
        self.reset_optimizer()
        meta = load_training_state_from(
            self.module,
            self.optimizer,
            Path(path) / "learner",
            rank=self.rank,
            world_size=self.world_size,
        )
        self.num_steps = int(meta["num_steps"])
