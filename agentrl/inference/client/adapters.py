"""LoRA adapters on SGLang's native API, mixed into :class:`SGLangClient`.

SGLang serves adapters by name: ``/load_lora_adapter`` (``lora_name``, ``lora_path``: a peft
directory on the server's disk) and ``/unload_lora_adapter`` (``lora_name``), both answering
``{"success", "error_message", "loaded_adapters"}``; a ``/generate`` body's ``lora_path`` names
the adapter that serves it. The trainer pushes each version as a new adapter:
:meth:`AdapterPlane.load_lora_adapter` on every endpoint, then
:meth:`AdapterPlane.use_lora_adapter`, from which on every ``/generate`` carries that name and
its output is labelled with that version (the server's own label is the base model's). The
previous adapter stays loaded while requests sent with it are in flight (counted per adapter)
and is unloaded when the last of them finishes. An endpoint that answers a request with "not
loaded" (a restarted server) gets the active adapter loaded again, and the request once more.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from agentrl.errors import ServerError
from agentrl.inference.api_keys import bearer, key_for
from agentrl.inference.base import GenerateOutput
from agentrl.inference.client.endpoints import Endpoint
from agentrl.inference.sglang_api import error_text

logger = logging.getLogger(__name__)

MAX_NAME = 256  # agentrl serve's bound on lora_name


@dataclass
class AdapterState:
    """Which adapter new requests use, and how many requests each adapter has in flight."""

    active: tuple[str, int] | None = None  # (name, weight version); None: the base model
    in_flight: dict[str, int] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)  # to unload once no request uses them
    paths: dict[str, str] = field(default_factory=dict)  # name -> path, to reload a restart


def _check_lora_response(raw: bytes, path: str, name: str, url: str) -> dict[str, Any]:
    """The parsed response, or :class:`ServerError` naming the adapter and the server's reason."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        raise ServerError(f"{path} {name!r}: malformed response {raw[:200]!r}", endpoint=url)
    if data.get("success") is not True:
        why = data.get("error_message") or data.get("message") or data.get("error") or data
        raise ServerError(f"{path} {name!r} failed: {str(why)[:500]}", endpoint=url, status=400)
    return data


class AdapterPlane:
    """SGLang's adapter calls, and the per-adapter accounting of ``/generate`` requests."""

    _endpoints: list[Endpoint]
    _lora: AdapterState

    if TYPE_CHECKING:  # the client's transport
        _keys: tuple[str | None, str | None]

        def _http(self) -> aiohttp.ClientSession: ...

        def _spawn(self, coro: Any) -> None: ...

    @property
    def lora_adapter(self) -> tuple[str, int] | None:
        """``(name, weight_version)`` of the adapter new requests use; ``None``: the base."""
        return self._lora.active

    @property
    def lora_names(self) -> set[str]:
        """The adapters this client loaded and has not unloaded yet (active and retired)."""
        active = self._lora.active
        return self._lora.retired | ({active[0]} if active else set())

    async def _lora_call(
        self, path: str, name: str, payload: dict[str, Any], eps: list[Endpoint] | None = None
    ) -> None:
        """``path`` on ``eps`` (default: every endpoint in rotation), each answer checked.

        A refusal comes back as HTTP 400 with SGLang's body; it is re-read here so that the
        error names the adapter and carries ``error_message``.
        """
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise ValueError(f"lora_name: expected 1-{MAX_NAME} characters, got {name!r:.80}")
        eps = [ep for ep in self._endpoints if ep.healthy] if eps is None else eps
        if not eps:
            raise ServerError(f"{path} {name!r}: no healthy endpoint", endpoint="client")

        async def one(ep: Endpoint) -> None:
            # not _request: a refusal is HTTP 400 whose body (error_message) names the reason
            try:
                async with self._http().post(
                    ep.url + path, json=payload, headers=bearer(key_for(path, *self._keys))
                ) as resp:
                    status, raw = resp.status, await resp.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise ServerError(
                    f"{path} {name!r}: {type(exc).__name__}: {exc}", endpoint=ep.url
                ) from exc
            if status >= 500:
                raise ServerError(
                    f"{path} {name!r}: HTTP {status}: {error_text(raw)}", endpoint=ep.url,
                    status=status,
                )  # fmt: skip
            _check_lora_response(raw, path, name, ep.url)

        results = await asyncio.gather(*(one(ep) for ep in eps), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """``/load_lora_adapter`` on every endpoint in rotation: the peft dir ``path`` as ``name``.

        ``path`` is read by the servers (a disk they share with the trainer, or their own).

        Raises:
            ServerError: an endpoint refused it (its ``error_message``), or none answered.
        """
        await self._lora_call("/load_lora_adapter", name, {"lora_name": name, "lora_path": path})
        self._lora.paths[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        """``/unload_lora_adapter`` on every endpoint.

        Raises:
            ServerError: an endpoint refused it (an unknown name), or none answered.
        """
        await self._lora_call("/unload_lora_adapter", name, {"lora_name": name})

    async def use_lora_adapter(self, name: str | None, weight_version: int) -> None:
        """Serve later requests with the loaded adapter ``name`` (``None``: the base model).

        Their outputs are labelled ``weight_version``. The previous adapter is unloaded now if
        no request sent with it is in flight, else when the last of them finishes.
        """
        previous = self._lora.active
        if name is not None:
            self._lora.retired.discard(name)
        self._lora.active = None if name is None else (name, weight_version)
        if previous is not None and previous[0] != name:
            self._lora.retired.add(previous[0])
            if not self._lora.in_flight.get(previous[0]):
                await self._unload_retired(previous[0])

    async def _unload_retired(self, name: str) -> None:
        """Unload a retired adapter (a failure is logged: the server keeps a stale adapter)."""
        self._lora.retired.discard(name)
        self._lora.paths.pop(name, None)
        try:
            await self.unload_lora_adapter(name)
        except (ServerError, ValueError) as exc:
            logger.warning("unloading the old adapter %r: %s", name, exc)

    async def _reload(self, name: str, path: str, url: str) -> None:
        """Load adapter ``name`` again on the endpoint at ``url`` only."""
        logger.info("endpoint %s lost adapter %r: loading it again", url, name)
        eps = [ep for ep in self._endpoints if ep.url == url]
        await self._lora_call(
            "/load_lora_adapter", name, {"lora_name": name, "lora_path": path}, eps
        )

    async def _adapted(
        self, body: dict[str, Any], send: Callable[[], Awaitable[GenerateOutput]]
    ) -> GenerateOutput:
        """``send()`` with the active adapter named in ``body``; its output gets its version.

        The request counts as in flight for that adapter until it returns.
        """
        active = self._lora.active
        if active is None:
            return await send()
        name, version = active
        body["lora_path"] = name
        counts = self._lora.in_flight
        counts[name] = counts.get(name, 0) + 1
        try:
            try:
                out = await send()
            except ServerError as exc:  # a restarted endpoint lost it: load it there, once
                path = self._lora.paths.get(name)
                if exc.status != 400 or "not loaded" not in exc.message or path is None:
                    raise
                await self._reload(name, path, exc.endpoint)
                out = await send()
        finally:
            counts[name] -= 1
            if not counts[name]:
                del counts[name]
                if name in self._lora.retired:
                    self._spawn(self._unload_retired(name))
        if out.weight_version != -1 or out.output_ids:  # (not an abort between tries)
            out.versions = [version] * len(out.output_ids)
            out.weight_version = version
        return out
