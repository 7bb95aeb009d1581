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
so.

Every request is checked before anything is allocated, mapped or connected: a group's address,
port, ranks and ``timeout_s`` (at most :data:`MAX_TIMEOUT_S`); a bucket's names, dtypes and
shapes and its total size (no more elements than the model has); a tensor payload's storages
and views (:class:`~agentrl.inference.weight_ipc.PayloadLimits`), then its names and shapes,
before a byte is copied. Blocking work (the rendezvous, broadcasts, opening handles) runs in
threads of its own, never the engine's, and only one group forms at a time: a peer that never
comes costs one thread until ``timeout_s``, not generation. A bucket of the model's size with an
unknown name or a wrong shape is received one tensor at a time into scratch memory and refused
(400), so the group stays in step with the trainer; the staging area is then dropped. A bucket
that no trainer of this model could send (larger than the model) is refused unreceived, and the
server leaves the group so that the sender's broadcast fails rather than waits.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web

from agentrl.errors import ServerError
from agentrl.inference.engine import LocalEngine
from agentrl.inference.server.requests import json_body
from agentrl.inference.server.weight_files import in_thread
from agentrl.inference.sglang_api import RequestError, parse_weight_version
from agentrl.inference.weight_group import GROUP_NAME, WeightGroup, open_group, parse_dtype
from agentrl.inference.weight_ipc import PayloadLimits, load_named_tensors

log = logging.getLogger(__name__)


MAX_TIMEOUT_S = 600.0
"""The longest ``timeout_s`` a group may ask for (its rendezvous and every collective)."""
MAX_WORLD_SIZE = 4096
_MAX_DIMS = 8


def _result(success: bool, message: str) -> web.Response:
    payload = {"success": success, "message": message}
    return web.json_response(payload, status=200 if success else 400)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await json_body(request, default={})
    except RequestError as exc:
        raise ValueError(str(exc)) from None
    return dict(body)


def _int(body: dict[str, Any], key: str, low: int, high: int, default: int | None = None) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{key}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _text(body: dict[str, Any], key: str, default: str, limit: int = 256) -> str:
    value = body.get(key) or default
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{key}: expected a string of at most {limit} characters")
    return value


def _timeout(body: dict[str, Any]) -> float:
    value = body.get("timeout_s", 120.0)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s: expected a number in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
    return float(value)


class BucketTooLarge(ValueError):
    """A bucket no trainer of this model could send."""


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
        self._limits = PayloadLimits.of(engine.model)
        self._numel = sum(math.prod(shape) for shape, _ in self._own.values())
        self._forming = False  # one group rendezvous at a time
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
            name = _text(body, "group_name", GROUP_NAME)
            address = _text(body, "master_address", "")
            if not address:
                raise ValueError("master_address: expected a host name or address")
            port = _int(body, "master_port", 1, 65535)
            world = _int(body, "world_size", 2, MAX_WORLD_SIZE)
            rank = _int(body, "rank_offset", 1, world - 1, default=1)
            backend = _text(body, "backend", "nccl")
            if backend not in ("nccl", "gloo"):
                raise ValueError(f"backend: expected 'nccl' or 'gloo', got {backend!r}")
            if backend == "nccl" and self.engine.device.type != "cuda":
                backend = "gloo"  # a CPU engine can only take part over gloo
            timeout_s = _timeout(body)
        except ValueError as exc:
            return _result(False, f"bad request: {exc}")
        if name in self._groups:
            return _result(False, f"group {name!r} already exists; destroy it first")
        if self._forming:
            return _result(False, "a weight-update group is already forming; retry after it")
        self._forming = True
        try:
            group = await in_thread(
                lambda: open_group(
                    master_address=address,
                    master_port=port,
                    rank=rank,
                    world_size=world,
                    backend=backend,
                    device=self.engine.device if backend == "nccl" else "cpu",
                    timeout_s=timeout_s,
                ),
                name="weight-group-open",
            )
        except Exception as exc:  # the rendezvous's errors are the caller's: no peer, timeout
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return _result(False, f"could not join the weight-update group: {first}")
        finally:
            self._forming = False
        self._groups[name] = group
        log.info("joined weight-update group %r as rank %d of %d (%s)", name, rank, world, backend)
        return _result(True, f"joined group {name!r} as rank {rank}")

    def _bucket(self, body: dict[str, Any]) -> tuple[list[str], list[Any], list[tuple[int, ...]]]:
        """A bucket's names, dtypes and shapes, checked in form and total size.

        Raises:
            ValueError: malformed.
            BucketTooLarge: more tensors or elements than the model has.
        """
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not all(isinstance(v, list) for v in (names, dtypes, shapes)):
            raise ValueError("names, dtypes and shapes: expected lists")
        assert isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        if len(names) > len(self._own) or len(set(map(str, names))) < len(names):
            raise BucketTooLarge(f"{len(names)} names, repeated or more than the model has")
        if not all(isinstance(x, str) for x in names + dtypes):
            raise ValueError("names and dtypes: expected strings")
        dims = []
        for shape in shapes:
            ok = isinstance(shape, list) and len(shape) <= _MAX_DIMS
            if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
                raise ValueError(f"shapes: expected lists of at most {_MAX_DIMS} ints, got {shape}")
            if any(x < 0 or x > self._numel for x in shape):
                raise BucketTooLarge(f"shape {shape} is larger than the model")
            dims.append(tuple(shape))
        total = sum(math.prod(d) for d in dims)
        if total > self._numel:
            raise BucketTooLarge(f"{total} elements; the model has {self._numel}")
        return names, [parse_dtype(d) for d in dtypes], dims

    def _mismatch(self, names: list[str], shapes: list[tuple[int, ...]]) -> list[str]:
        """Why the model cannot take these tensors (unknown names, wrong shapes), if it cannot."""
        return [
            f"{n}: expected {self._own[n][0]}, got {s}" if n in self._own else f"{n}: unknown"
            for n, s in zip(names, shapes, strict=True)
            if n not in self._own or self._own[n][0] != s
        ]

    async def _leave(self, name: str) -> None:
        group = self._groups.pop(name, None)
        self._staged.clear()
        if group is not None:
            await in_thread(group.close, name="weight-group-close")

    async def update(self, request: web.Request) -> web.Response:
        """Receive one bucket; load the staged version once every parameter has arrived."""
        try:
            body = await _body(request)
            name = _text(body, "group_name", GROUP_NAME)
            group = self._groups.get(name)
            if group is None:
                return _result(False, f"bad request: no such group {name!r}: init it first")
            names, dtypes, shapes = self._bucket(body)
            label = body.get("weight_version")
            last = label is not None or bool(body.get("flush_cache", True))
        except BucketTooLarge as exc:
            await self._leave(name)
            return _result(False, f"bucket refused, weight-update group {name!r} left: {exc}")
        except ValueError as exc:
            return _result(False, f"bad request: {exc}")
        bad = self._mismatch(names, shapes)
        async with self._lock:

            def receive() -> list[torch.Tensor]:
                kept = []
                for s, d in zip(shapes, dtypes, strict=True):
                    t = torch.empty(s, dtype=d, device=group.device)
                    group.broadcast(t)
                    if not bad:  # else scratch: received to stay in step, then dropped
                        kept.append(t)
                group.synchronize()  # arrived: the engine may load them on any stream
                return kept

            try:
                buffers = await in_thread(receive, name="weight-group-receive")
            except RuntimeError as exc:
                self._staged.clear()
                return _result(False, f"receiving the bucket failed: {exc}")
            if bad:
                self._staged.clear()
                return _result(False, f"weights refused ({len(bad)} names): {bad[:3]}")
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
            named = await in_thread(
                load_named_tensors, entries[0], self._limits, name="weights-ipc-open"
            )
        except KeyError as exc:
            return _result(False, f"bad request: missing {exc}")
        except (TypeError, ValueError) as exc:
            return _result(False, f"bad request: {exc}")
        names = [n for n, _ in named]
        bad = self._mismatch(names, [tuple(t.shape) for _, t in named])
        if len(set(names)) < len(names):
            bad.append("a name repeats")
        if bad:  # before a byte is copied
            self._staged.clear()
            return _result(False, f"weights refused ({len(bad)} names): {bad[:3]}")
        if body.get("abort_all_requests") is True:
            await self.engine.abort(None)
        async with self._lock:
            # copies on the engine's device: the sender may free its memory once this returns
            device = self.engine.device
            tensors = await in_thread(
                lambda: [t.to(device, copy=True) for _, t in named], name="weights-ipc-copy"
            )
            return await self._stage(names, tensors, label, last)

    async def _stage(
        self, names: list[str], tensors: list[torch.Tensor], label: Any, last: bool
    ) -> web.Response:
        """Stage a checked bucket; load the version once it is complete (under ``self._lock``)."""
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
        name = body.get("group_name") or GROUP_NAME
        if not isinstance(name, str) or name not in self._groups:
            return _result(False, "no such weight-update group")
        await self._leave(name)
        return _result(True, "weight-update group destroyed")

    def close(self) -> None:
        """Leave every group (at server shutdown)."""
        for group in self._groups.values():
            group.close()
        self._groups.clear()
