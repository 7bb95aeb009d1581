"""The trainer's side of SGLang's distributed weight push: broadcast weights to servers.

Instead of writing a checkpoint that every server reads back from a shared disk
(``/update_weights_from_disk``), the trainer's rank 0 and the servers form one process group
(:mod:`agentrl.inference.weight_group`) and the weights travel as broadcasts, bucket by bucket:
for each bucket the trainer posts ``/update_weights_from_distributed`` (names, dtypes, shapes)
to every server and broadcasts the bucket's tensors while those calls are pending; each server
receives them and loads them. This is SGLang's protocol (``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``); ``agentrl serve``
implements the receiving side, so the path is tested on CPUs with gloo. The version label goes
with the last bucket only, so a server's label changes once all of a version has arrived.

:class:`TensorWeightPush` is the same-host alternative: ``/update_weights_from_tensor`` with
handles to the tensors (:mod:`agentrl.inference.weight_ipc`), no process group.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import torch

from agentrl.errors import ServerError
from agentrl.inference.api_keys import bearer
from agentrl.inference.weight_group import (
    GROUP_NAME,
    WeightGroup,
    buckets,
    dtype_name,
    open_group,
)

log = logging.getLogger(__name__)


class DistributedWeightPush:
    """Pushes weights to SGLang-compatible servers over a process group of their own.

    Args:
        endpoints: the servers' base URLs; server ``i`` joins as rank ``i + 1`` (one GPU each:
            SGLang's tensor-parallel ranks beyond the first are not supported here).
        master_address: this host's address as the servers reach it (the group's store).
        master_port: a free port on it.
        backend: ``"nccl"`` (weights on CUDA; servers on other GPUs) or ``"gloo"`` (CPU).
        device: where the broadcast buffers live (``cuda`` for NCCL).
        bucket_mb: largest bucket; one HTTP call per server and bucket.
        timeout_s: group formation and per-collective timeout, and the HTTP calls' timeout.
        group_name: the group's name on the servers.
        admin_key: the key the servers' weight routes want (their admin key, or their API key
            where no admin key is set); sent as a Bearer header.
    """

    def __init__(
        self,
        endpoints: list[str],
        *,
        master_address: str,
        master_port: int,
        backend: str = "nccl",
        device: torch.device | str = "cuda",
        bucket_mb: float = 512.0,
        timeout_s: float = 120.0,
        group_name: str = GROUP_NAME,
        admin_key: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("endpoints: expected at least one server URL, got none")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb: expected > 0, got {bucket_mb}")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.device = backend, torch.device(device)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s, self.group_name = timeout_s, group_name
        self._headers = bearer(admin_key)
        self._group: WeightGroup | None = None
        self._session: aiohttp.ClientSession | None = None
        self.last_push_s = 0.0
        """Wall time of the last :meth:`push` (HTTP calls and broadcasts)."""

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session

    async def _post(self, url: str, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self._http().post(url + path, json=payload, headers=self._headers) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ServerError(f"{path}: {type(exc).__name__}: {exc}", endpoint=url) from exc
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"success": False, "message": raw.decode(errors="replace")[:300]}
        if status != 200 or not body.get("success", False):
            message = body.get("message") or body.get("error") or body
            raise ServerError(f"{path}: {message}", endpoint=url, status=status)
        return body

    async def connect(self) -> None:
        """Form the group: rank 0 here, every server at once (each call blocks until formed).

        Raises:
            ServerError: a server refused, or the group did not form within ``timeout_s``.
        """
        if self._group is not None:
            return
        world = 1 + len(self.endpoints)
        calls = [
            self._post(
                url,
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": self.master_port,
                    "rank_offset": 1 + i,
                    "world_size": world,
                    "group_name": self.group_name,
                    "backend": self.backend,
                },
            )
            for i, url in enumerate(self.endpoints)
        ]
        here = asyncio.to_thread(
            open_group,
            master_address=self.master_address,
            master_port=self.master_port,
            rank=0,
            world_size=world,
            backend=self.backend,
            device=self.device,
            timeout_s=self.timeout_s,
        )
        results = await asyncio.gather(here, *calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if isinstance(results[0], WeightGroup):
                results[0].close()
            err = errors[0]
            if isinstance(err, ServerError):
                raise err
            raise ServerError(f"weight-update group did not form: {err}", endpoint="trainer")
        assert isinstance(results[0], WeightGroup)
        self._group = results[0]
        log.info("weight-update group formed: %d servers, %s", len(self.endpoints), self.backend)

    async def push(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> float:
        """Broadcast ``weights`` (HF names) to every server as ``version``; returns seconds.

        Raises:
            ServerError: a server refused a bucket (names, shapes) or a broadcast failed; the
                servers keep serving the previous version.
        """
        await self.connect()
        group = self._group
        assert group is not None
        t0 = time.perf_counter()
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        parts = list(buckets(items, self.bucket_bytes))
        for k, part in enumerate(parts):
            payload: dict[str, Any] = {
                "names": [n for n, _ in part],
                "dtypes": [dtype_name(t.dtype) for _, t in part],
                "shapes": [list(t.shape) for _, t in part],
                "group_name": self.group_name,
                "flush_cache": k == len(parts) - 1,
            }
            if k == len(parts) - 1:
                payload["weight_version"] = str(version)
            tensors = [t.detach().to(self.device).contiguous() for _, t in part]
            path = "/update_weights_from_distributed"
            calls = [self._post(u, path, payload) for u in self.endpoints]

            def send(tensors: list[torch.Tensor] = tensors) -> None:
                for t in tensors:
                    group.broadcast(t)
                group.synchronize()  # the bucket has left: its buffers may be freed or reused

            results = await asyncio.gather(asyncio.to_thread(send), *calls, return_exceptions=True)
            if any(isinstance(r, BaseException) for r in results):
                raise _push_error(results, self.endpoints, version, k, len(parts))
        self.last_push_s = time.perf_counter() - t0
        return self.last_push_s

    async def aclose(self) -> None:
        """Tear the group down on the servers and here (errors are logged, not raised)."""
        if self._group is not None:
            for url in self.endpoints:
                try:
                    await self._post(
                        url, "/destroy_weights_update_group", {"group_name": self.group_name}
                    )
                except ServerError as exc:
                    log.warning("destroying the weight-update group on %s: %s", url, exc)
            self._group.close()
            self._group = None
        if self._session is not None:
            await self._session.close()
            self._session = None


def _push_error(
    results: list[Any], endpoints: list[str], version: int, bucket: int, buckets: int
) -> ServerError:
    """One error for a failed bucket, naming the version and the bucket.

    The server's own error comes first (it names the endpoint); the broadcast's follows (a dead
    server shows up there as a closed connection).
    """
    where = f"weight push of version {version} failed at bucket {bucket + 1}/{buckets}"
    send, calls = results[0], results[1:]
    for url, r in zip(endpoints, calls, strict=True):
        if isinstance(r, BaseException):
            extra = f"; the broadcast: {send}" if isinstance(send, BaseException) else ""
            if isinstance(r, ServerError):
                return ServerError(f"{where}: {r.message}{extra}", endpoint=url, status=r.status)
            return ServerError(f"{where}: {r}{extra}", endpoint=url)
    return ServerError(f"{where}: the broadcast: {send}", endpoint="trainer")


class TensorWeightPush:
    """``inference.weight_sync="tensor"``: each version to every endpoint by handle.

    The same interface as :class:`DistributedWeightPush`, for a trainer whose servers run on its
    own host (a colocated server on the learner's card).

    Args:
        endpoints: the servers' URLs.
        timeout_s: HTTP timeout of an update call.
        api_key: the servers' API key, if they have one.
        admin_key: their admin key (weight routes), if set apart from the API key.
    """

    def __init__(
        self,
        endpoints: list[str],
        timeout_s: float = 120.0,
        api_key: str | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.api_key, self.admin_key = api_key, admin_key
        self.last_push_s = 0.0
        self._client: Any = None

    async def push(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """Load ``weights`` on every endpoint as ``version``; returns the seconds it took.

        Raises:
            ServerError: an endpoint refused the update, or none answered.
        """
        from agentrl.inference.client.sglang_client import SGLangClient

        t0 = time.perf_counter()
        if self._client is None:
            self._client = SGLangClient(
                self.endpoints,
                timeout_s=self.timeout_s,
                api_key=self.api_key,
                admin_api_key=self.admin_key,
            )
        if any(t.device.type == "cuda" for t in weights.values()):
            torch.cuda.synchronize()  # the server reads the memory on its own streams
        await self._client.update_weights_from_tensor(weights, version)
        self.last_push_s = time.perf_counter() - t0
        return self.last_push_s

    async def aclose(self) -> None:
        """Close the HTTP session."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
