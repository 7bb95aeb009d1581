"""The control plane of :class:`~agentrl.inference.client.SGLangClient`: calls to every endpoint.

Pausing, continuing, weight updates and cache flushes go to every endpoint in rotation
(:meth:`ControlPlane._broadcast`); an endpoint that fails leaves the rotation, and one that was out
of it gets the last weights pushed when its health check passes (the client's ``_probe``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from agentrl.errors import ServerError
from agentrl.inference.client.endpoints import Endpoint
from agentrl.inference.sglang_api import check_update_response
from agentrl.inference.weight_ipc import dump_named_tensors

logger = logging.getLogger(__name__)


class ControlPlane:
    """Broadcast calls of SGLang's control API, mixed into :class:`SGLangClient`."""

    _endpoints: list[Endpoint]
    _last_update: tuple[str, str] | None  # (model_path, label) of the last weights pushed

    if TYPE_CHECKING:  # the client's transport

        @property
        def endpoints(self) -> list[str]:
            """Every endpoint URL."""
            ...

        async def _call(
            self, ep: Endpoint, method: str, path: str, payload: dict[str, Any] | None = None
        ) -> bytes: ...

    async def _broadcast(
        self, path: str, payload: dict[str, Any] | None, *, method: str = "POST"
    ) -> dict[str, bytes]:
        """Call ``path`` on every endpoint in rotation; endpoints that fail leave the rotation.

        Raises:
            ServerError: a 4xx from any endpoint, or no endpoint answered.
        """
        eps = [ep for ep in self._endpoints if ep.healthy]
        results = await asyncio.gather(
            *(self._call(ep, method, path, payload) for ep in eps), return_exceptions=True
        )
        bodies: dict[str, bytes] = {}
        for ep, result in zip(eps, results, strict=True):
            if isinstance(result, ServerError) and result.status is not None:
                raise result
            if isinstance(result, BaseException):
                logger.warning("%s on %s failed: %s", path, ep.url, result)
                continue
            bodies[ep.url] = result
        if not bodies:
            raise ServerError(f"{path}: no endpoint answered", endpoint=", ".join(self.endpoints))
        return bodies

    async def pause(self, mode: str = "abort") -> None:
        """``/pause_generation`` on every endpoint (``"abort"``, ``"retract"``, ``"in_place"``)."""
        await self._broadcast("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """``/continue_generation`` on every endpoint."""
        await self._broadcast("/continue_generation", {})

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        """Load ``model_path`` (visible to the servers) on every endpoint as ``weight_version``.

        An endpoint that is out of rotation, or drops out during the call, gets the same
        weights when its health check passes.

        Raises:
            ServerError: an endpoint refused the update (``success: false``), or none took it.
        """
        label = str(weight_version)
        eps = [ep for ep in self._endpoints if ep.healthy]
        results = await asyncio.gather(
            *(self._update_one(ep, model_path, label) for ep in eps), return_exceptions=True
        )
        if any(result is None for result in results):
            self._last_update = (model_path, label)
        refused = [r for r in results if isinstance(r, ServerError) and r.status is not None]
        if refused:
            raise ServerError(
                f"weight update to {model_path!r} failed: {refused[0]}",
                endpoint=refused[0].endpoint,
            )
        if not any(result is None for result in results):
            raise ServerError(
                f"weight update to {model_path!r}: no endpoint answered ({results})",
                endpoint=", ".join(self.endpoints),
            )

    async def _update_one(self, ep: Endpoint, model_path: str, label: str) -> None:
        payload = {"model_path": model_path, "weight_version": label}
        check_update_response(
            await self._call(ep, "POST", "/update_weights_from_disk", payload), ep.url
        )

    async def update_weights_from_tensor(
        self, named_tensors: Mapping[str, torch.Tensor], weight_version: int
    ) -> None:
        """Load ``named_tensors`` on every endpoint as ``weight_version``, by handle.

        SGLang's ``/update_weights_from_tensor``: the servers must run on this host and see its
        devices under the same numbering (CUDA IPC handles; shared-memory file names for CPU
        tensors), so nothing but handles crosses the socket. The tensors must stay unchanged
        until this returns. Unlike :meth:`update_weights_from_disk`, an endpoint out of rotation
        does not get these weights later.

        Raises:
            ServerError: an endpoint refused the update (``success: false``), or none took it.
        """
        entry = await asyncio.to_thread(dump_named_tensors, named_tensors.items())
        payload = {"serialized_named_tensors": [entry], "weight_version": str(weight_version)}
        bodies = await self._broadcast("/update_weights_from_tensor", payload)
        for url, body in bodies.items():
            check_update_response(body, url)

    async def flush_cache(self) -> bool:
        """``/flush_cache`` on every endpoint; False if one refused (busy: requests open)."""
        try:
            await self._broadcast("/flush_cache", None)
        except ServerError as exc:
            if exc.status == 400:
                return False
            raise
        return True
