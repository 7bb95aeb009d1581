"""The server's side of SGLang's distributed weight push, for ``agentrl serve``.

``POST /init_weights_update_group`` joins the trainer's weight-update group (it blocks until the
group forms, as SGLang's does); each ``POST /update_weights_from_distributed`` receives one
bucket of broadcast tensors (names, dtypes and shapes in the JSON body) into a staging area;
``POST /destroy_weights_update_group`` leaves the group. ``POST /update_weights_from_tensor``
takes a bucket by handle instead (CUDA IPC or shared memory: a trainer on the same host). Unlike
SGLang, which loads every bucket into the live model as it arrives, the engine here swaps in a
version at once: buckets are staged until they cover every parameter, then loaded in one engine
update (between decode steps), labelled with the ``weight_version`` the buckets carried. A
version is complete at a bucket that carries ``weight_version`` or ``flush_cache: true`` once
every parameter (one of each tied pair) has arrived; agentrl's sender marks only its last bucket
so. A bucket with an unknown name or a wrong shape is refused (400) after its tensors were
received, so the group stays in step with the trainer; the staging area is then dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web

from agentrl.errors import ServerError
from agentrl.inference.engine import LocalEngine
from agentrl.inference.sglang_api import parse_weight_version
from agentrl.inference.weight_group import GROUP_NAME, WeightGroup, open_group, parse_dtype
from agentrl.inference.weight_ipc import load_named_tensors

log = logging.getLogger(__name__)


def _result(success: bool, message: str) -> web.Response:
    payload = {"success": success, "message": message}
    return web.json_response(payload, status=200 if success else 400)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError as exc:
        raise ValueError(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("expected a JSON object")
    return body


def _required_names(model: torch.nn.Module) -> list[set[str]]:
    """Groups of parameter names that share storage (tied weights): one of each must arrive."""
    by_ptr: dict[int, set[str]] = {}
    for name, tensor in model.state_dict().items():
        by_ptr.setdefault(tensor.data_ptr(), set()).add(name)
    return list(by_ptr.values())


class WeightReceiver:
    """Receives distributed weight pushes into a :class:`LocalEngine`.

    Args:
        engine: the engine whose weights are replaced.
        on_version: called with ``(engine version, wire label)`` after a version is loaded.
    """

    def __init__(self, engine: LocalEngine, on_version: Callable[[int, str], None]) -> None:
        self.engine = engine
        self.on_version = on_version
        self._groups: dict[str, WeightGroup] = {}
        self._own = {k: (tuple(v.shape), v.dtype) for k, v in engine.model.state_dict().items()}
        self._required = _required_names(engine.model)
        self._staged: dict[str, torch.Tensor] = {}
        self._label: str | None = None
        self._lock = asyncio.Lock()  # buckets arrive one at a time, in the trainer's order

    def routes(self) -> list[web.RouteDef]:
        """The routes, for the server's application."""
        return [
            web.post("/init_weights_update_group", self.init_group),
            web.post("/update_weights_from_distributed", self.update),
            web.post("/destroy_weights_update_group", self.destroy),
            web.post("/update_weights_from_tensor", self.update_from_tensor),
        ]

    async def init_group(self, request: web.Request) -> web.Response:
        """Join the trainer's group as rank ``rank_offset``; returns once the group formed."""
        try:
            body = await _body(request)
            name = str(body.get("group_name") or GROUP_NAME)
            if name in self._groups:
                return _result(False, f"group {name!r} already exists; destroy it first")
            address, port = body["master_address"], int(body["master_port"])
            rank, world = int(body.get("rank_offset", 1)), int(body["world_size"])
            if not 0 < rank < world:
                return _result(False, f"rank_offset: expected 1..{world - 1}, got {rank}")
            backend = str(body.get("backend") or "nccl")
            if backend == "nccl" and self.engine.device.type != "cuda":
                backend = "gloo"  # a CPU engine can only take part over gloo
            timeout_s = float(body.get("timeout_s", 120.0))
        except (KeyError, TypeError, ValueError) as exc:
            return _result(False, f"bad request: {exc}")
        try:
            group = await asyncio.to_thread(
                open_group,
                master_address=address,
                master_port=port,
                rank=rank,
                world_size=world,
                backend=backend,
                device=self.engine.device if backend == "nccl" else "cpu",
                timeout_s=timeout_s,
            )
        except (RuntimeError, ValueError) as exc:
            return _result(False, f"could not join the weight-update group: {exc}")
        self._groups[name] = group
        log.info("joined weight-update group %r as rank %d of %d (%s)", name, rank, world, backend)
        return _result(True, f"joined group {name!r} as rank {rank}")

    async def update(self, request: web.Request) -> web.Response:
        """Receive one bucket; load the staged version once every parameter has arrived."""
        try:
            body = await _body(request)
            group = self._groups[str(body.get("group_name") or GROUP_NAME)]
            names = [str(n) for n in body["names"]]
            dtypes = [parse_dtype(str(d)) for d in body["dtypes"]]
            shapes = [tuple(int(x) for x in s) for s in body["shapes"]]
            if not len(names) == len(dtypes) == len(shapes):
                raise ValueError("names, dtypes and shapes must have the same length")
            label = body.get("weight_version")
            last = label is not None or bool(body.get("flush_cache", True))
        except KeyError as exc:
            return _result(False, f"bad request: missing {exc} (or no such group: init it first)")
        except (TypeError, ValueError) as exc:
            return _result(False, f"bad request: {exc}")
        async with self._lock:
            buffers = [
                torch.empty(s, dtype=d, device=group.device)
                for s, d in zip(shapes, dtypes, strict=True)
            ]

            def receive() -> None:
                for t in buffers:
                    group.broadcast(t)
                group.synchronize()  # arrived: the engine may load them on any stream

            try:
                await asyncio.to_thread(receive)
            except RuntimeError as exc:
                self._staged.clear()
                return _result(False, f"receiving the bucket failed: {exc}")
            return await self._stage(names, buffers, label, last)

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's ``/update_weights_from_tensor``: tensors by handle, from this host.

        The handles (:mod:`agentrl.inference.weight_ipc`) are opened, copied to the engine's
        device, and staged and loaded as a bucket of the distributed push is.
        """
        try:
            body = await _body(request)
            entries = body["serialized_named_tensors"]
            if not (
                isinstance(entries, list) and len(entries) == 1 and isinstance(entries[0], str)
            ):
                raise ValueError(
                    "serialized_named_tensors: expected one string (no tensor parallelism)"
                )
            if body.get("load_format") not in (None, "direct"):
                return _result(False, f"load_format {body['load_format']!r} is not supported")
            label = body.get("weight_version")
            last = label is not None or bool(body.get("flush_cache", True))
            named = await asyncio.to_thread(load_named_tensors, entries[0])
        except KeyError as exc:
            return _result(False, f"bad request: missing {exc}")
        except (TypeError, ValueError) as exc:
            return _result(False, f"bad request: {exc}")
        if body.get("abort_all_requests") is True:
            await self.engine.abort(None)
        async with self._lock:
            # copies on the engine's device: the sender may free its memory once this returns
            device = self.engine.device
            tensors = await asyncio.to_thread(lambda: [t.to(device, copy=True) for _, t in named])
            return await self._stage([n for n, _ in named], tensors, label, last)

    async def _stage(
        self, names: list[str], tensors: list[torch.Tensor], label: Any, last: bool
    ) -> web.Response:
        """Stage a bucket; load the version once it is complete (under ``self._lock``)."""
        bad = [
            f"{n}: expected {self._own[n][0]}, got {tuple(t.shape)}" if n in self._own
            else f"{n}: unknown"
            for n, t in zip(names, tensors, strict=True)
            if n not in self._own or self._own[n][0] != tuple(t.shape)
        ]  # fmt: skip
        if bad:
            self._staged.clear()
            return _result(False, f"weights refused ({len(bad)} names): {bad[:3]}")
        for n, t in zip(names, tensors, strict=True):
            self._staged[n] = t
        if label is not None:
            self._label = str(label)
        covered = all(tied & self._staged.keys() for tied in self._required)
        if not (last and covered):
            return _result(True, f"staged {len(names)} tensors")
        return await self._load()

    async def _load(self) -> web.Response:
        staged, label = self._staged, self._label
        self._staged, self._label = {}, None
        version = None if label is None else parse_weight_version(label)
        weights = {n: t.to(self._own[n][1]) for n, t in staged.items()}
        try:
            await self.engine.update_weights_from_state_dict(weights, version)
        except ServerError as exc:
            return _result(False, exc.message)
        if version is not None and label is not None:
            self.on_version(version, label)
        return _result(True, "Succeeded to update model weights.")

    async def destroy(self, request: web.Request) -> web.Response:
        """Leave the group named in the body."""
        try:
            body = await _body(request)
        except ValueError as exc:
            return _result(False, str(exc))
        group = self._groups.pop(str(body.get("group_name") or GROUP_NAME), None)
        if group is None:
            return _result(False, "no such weight-update group")
        await asyncio.to_thread(group.close)
        self._staged.clear()
        return _result(True, "weight-update group destroyed")

    def close(self) -> None:
        """Leave every group (at server shutdown)."""
        for group in self._groups.values():
            group.close()
        self._groups.clear()
