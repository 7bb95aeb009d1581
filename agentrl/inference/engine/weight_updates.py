"""Weight updates of the embedded engine: from disk or a state dict, between decode steps.

A mixin of :class:`~agentrl.inference.engine.local_engine.LocalEngine`. Every change of the
served weights (a full update here, a LoRA adapter's merge in
:mod:`~agentrl.inference.engine.adapters`) goes through :meth:`WeightUpdates._swap`: it takes
the model lock between steps (paused: at once; otherwise after the running batch drains, as
SGLang does), flushes the prefix cache and sets the weight version when one is given.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import torch

from agentrl.errors import ServerError
from agentrl.inference.engine import model_io
from agentrl.inference.engine.worker import in_worker

if TYPE_CHECKING:
    from agentrl.inference.engine.adapters import AdapterSet
    from agentrl.inference.engine.batcher import Batcher
    from agentrl.inference.engine.paged_runner import PagedRunner

logger = logging.getLogger(__name__)
_DONE = {  # log lines (scripts and tests read "weights updated; weight_version=N")
    "weight update": "weights updated",
    "load_lora_adapter": "LoRA adapter loaded",
    "unload_lora_adapter": "LoRA adapter unloaded",
}


class WeightUpdates:
    """``update_weights_from_disk`` / ``update_weights_from_state_dict`` and the swap they share."""

    if TYPE_CHECKING:
        _loader: model_io.WeightLoader
        _adapters: AdapterSet
        _paged: PagedRunner | None
        _batcher: Batcher
        _version: int
        _draining: bool
        _lock: asyncio.Lock
        _update_lock: asyncio.Lock
        _wake: asyncio.Event

        def _ensure_started(self) -> None: ...

        async def _drain(self) -> None: ...

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None
    ) -> None:
        """Load HF safetensors weights from ``model_path``; bump the version if one is given.

        Raises:
            ServerError: the directory is missing or its weights do not fit the model.
        """
        try:
            state_dict = await in_worker(model_io.read_safetensors_dir, model_path)
        except Exception as exc:  # missing dir, unreadable or corrupt files: the caller's input
            raise ServerError(f"weight update failed: {exc}", endpoint="local", status=400) from exc
        await self.update_weights_from_state_dict(state_dict, weight_version)

    async def update_weights_from_state_dict(
        self, state_dict: dict[str, torch.Tensor], weight_version: int | None = None
    ) -> None:
        """Copy ``state_dict`` into the model between steps; bump the version if one is given.

        Paused: applies at once and open requests continue on the new weights after ``resume``.
        Not paused: waits until the running batch has finished (new requests wait meanwhile).

        Raises:
            ServerError: names or shapes do not match the model (nothing is changed then).
        """

        async def apply() -> None:  # a repeated layout is two multi-tensor copies: no thread
            if repeat := self._loader.repeats(state_dict):
                self._load(state_dict, repeat)
            else:
                await in_worker(self._load, state_dict, repeat)

        await self._swap("weight update", weight_version, apply)

    async def _swap(
        self, what: str, weight_version: int | None, apply: Callable[[], Awaitable[None]]
    ) -> None:
        """Run ``apply`` (it changes weights) between steps, as a weight update does."""
        self._ensure_started()
        async with self._update_lock:
            try:
                await self._drain()
                async with self._lock:
                    self._batcher.deliver()
                    await apply()
                    self._batcher.weights_changed()
                    if weight_version is not None:
                        self._version = int(weight_version)
            except ValueError as exc:
                raise ServerError(f"{what} failed: {exc}", endpoint="local", status=400) from exc
            finally:
                self._draining = False
                self._wake.set()
        logger.info("engine %s; weight_version=%d", _DONE.get(what, what), self._version)

    def _load(self, state_dict: dict[str, torch.Tensor], repeat: bool | None = None) -> None:
        self._loader.load(state_dict, repeat)  # in place, device to device
        self._adapters.base_replaced()  # the full weights hold no adapter
        if self._paged is not None:
            self._paged.refresh_weights()
