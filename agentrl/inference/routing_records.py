"""Routing records: the experts each token of a request was routed to (``return_routed_experts``).

A request that asks gets ``GenerateOutput.routed_experts``, an int16 array
``(prompt_tokens + len(output_ids) - 1, layers, top_k)``: one row per token that went through
the model (the last sampled token is never fed back), the experts each MoE layer chose for it,
in the router's top-k order. On the wire (``meta_info.routed_experts``) it is SGLang's layout:
base64 of the int32 array, flattened by token, layer, top-k slot.
``layers`` counts the model's routers (every decoder layer of Qwen3-MoE; SGLang sizes it by
``num_hidden_layers``, the same there). A request may ask only for the rows from
``routed_experts_start_len`` on (SGLang's; a multi-turn episode knows the earlier ones): the rows
before it are -1 in ``GenerateOutput`` and not sent on the wire.

How the embedded engine fills it (:class:`RoutingRecorder`, :class:`RequestRouting`; the paged
path reads each step's rows from the routing it keeps by KV slot instead of hooks, with the same
rules: :mod:`~agentrl.inference.engine.paged_moe`):

- A step that carries at least one request which asked runs under
  :class:`~agentrl.routing.RoutingCapture`; the router rows are split per request: a decode step
  gives one row per running request (the token it feeds), a prefill gives each newcomer the rows
  of its real tokens (the left padding is dropped).
- **The first computation of a row wins.** A retracted request is prefilled again at resume
  (prompt and output so far); it keeps the rows it had and only gains the new ones. So the row
  that predicted a sampled token is the routing of the forward that sampled it, the one its
  behaviour log-prob came from, even when the weights changed in between.
- Rows never computed (a request aborted in the queue, ``max_new_tokens`` 0) are -1, which
  :class:`~agentrl.routing.RoutingReplay` reads as "route freely".
- Only requests that asked hold rows (int16, growing as they decode), so memory stays bounded.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from agentrl.errors import ConfigError
from agentrl.inference.base import SamplingParams
from agentrl.routing import RoutingCapture, is_moe, routing_shape

StepRows = list[tuple["RequestRouting", int, np.ndarray]]
"""What one step captured: ``(record, start position, rows)`` per request that asked."""

FLAG = "--enable-return-routed-experts"
"""The server flag that turns routing records on (SGLang's name)."""


def refusal(model: Any, enabled: bool, start: int = 0, prompt_len: int = 0) -> str | None:
    """Why a request for routed experts from row ``start`` is refused (``None``: served).

    ``start < 0``: the request does not ask (nothing to refuse). SGLang accepts a
    ``routed_experts_start_len`` in ``[0, prompt_tokens]``.
    """
    if start < 0:
        return None
    if not is_moe(model):
        name = type(model).__name__
        return f"return_routed_experts: {name} is a dense model (no MoE router): no experts"
    if not enabled:
        return (
            "return_routed_experts requested, but this server was started without "
            f"{FLAG} (the embedded engine: LocalEngine(..., return_routed_experts=True))"
        )
    if start > prompt_len:
        return (
            f"routed_experts_start_len={start} is higher than the number of input tokens "
            f"{prompt_len}. Please use a smaller routed_experts_start_len."
        )
    return None


def records_routing(model: Any, requested: bool | None) -> bool:
    """Whether an engine records routing: ``requested``, or by default for an MoE model.

    Raises:
        ConfigError: recording was requested for a dense model.
    """
    if requested is None:
        return is_moe(model)
    dense = None if is_moe(model) else refusal(model, enabled=True)
    if requested and dense:
        raise ConfigError(dense)
    return requested


class RequestRouting:
    """One request's rows ``(positions, layers, top_k)`` int16, in position order; grows."""

    def __init__(self, layers: int, top_k: int, capacity: int, start: int = 0) -> None:
        """Room for ``capacity`` rows to begin with (it doubles when full).

        ``start``: :meth:`array` leaves the rows before it at -1 (not asked for).
        """
        self._buf = np.full((max(capacity, 1), layers, top_k), -1, dtype=np.int16)
        self.count = 0
        """Rows recorded: positions ``[0, count)``."""
        self.start = start

    def record(self, start: int, rows: np.ndarray) -> None:
        """The rows of positions ``start, start + 1, ...``; positions recorded already keep theirs.

        Raises:
            ValueError: ``start`` leaves a gap after the rows recorded so far.
        """
        end = start + len(rows)
        if end <= self.count:
            return
        if start > self.count:
            raise ValueError(f"routing rows from position {start}, but only {self.count} recorded")
        if end > len(self._buf):
            grown = np.full((max(end, 2 * len(self._buf)), *self._buf.shape[1:]), -1, np.int16)
            grown[: self.count] = self._buf[: self.count]
            self._buf = grown
        self._buf[self.count : end] = rows[self.count - start :]
        self.count = end

    def array(self, rows: int) -> np.ndarray:
        """The first ``rows`` positions (a copy); any never computed, or before start, is -1."""
        out = np.full((max(rows, 0), *self._buf.shape[1:]), -1, dtype=np.int16)
        n = min(rows, self.count)
        out[self.start : n] = self._buf[self.start : n]
        return out


class RoutingRecorder:
    """Captures the engine's router outputs in a step and hands each request its rows."""

    def __init__(self, model: Any) -> None:
        """Record ``model``'s routers (an MoE model)."""
        self.layers, self.top_k, _ = routing_shape(model)
        self._model = model
        self._capture = RoutingCapture(model)

    def new_request(self, prompt_len: int, params: SamplingParams, start: int) -> RequestRouting:
        """An empty record for a request that wants the rows from ``start`` on."""
        room = prompt_len + min(params.max_new_tokens, 256)  # (it grows as needed)
        return RequestRouting(self.layers, self.top_k, room, start)

    @contextmanager
    def step(
        self,
        decode: list[tuple[RequestRouting | None, int]],
        prefill: list[tuple[RequestRouting | None, int]],
    ) -> Iterator[StepRows]:
        """Capture one engine step (a decode forward, then a prefill forward, either optional).

        ``decode`` has one ``(record, position of the token fed)`` per decode row and
        ``prefill`` one ``(record, sequence length)`` per newcomer, both in batch order; a
        record is ``None`` for a request that did not ask. The yielded list is filled at exit
        with ``(record, start position, rows)`` entries: record them on the event loop, with
        :meth:`RequestRouting.record`, before the step's outputs are built.
        """
        found: StepRows = []
        if all(r is None for r, _ in decode + prefill):
            yield found
            return
        try:
            with self._capture:
                yield found
        except BaseException:
            self._capture = RoutingCapture(self._model)  # drop a partial forward's rows
            raise
        rows = self._capture.pop().to(torch.int16).numpy()
        for i, (rec, position) in enumerate(decode):
            if rec is not None:
                found.append((rec, position, rows[i : i + 1]))
        if prefill:
            rest = rows[len(decode) :]
            per_row = rest.reshape(len(prefill), -1, self.layers, self.top_k)  # (B, width, L, K)
            for j, (rec, length) in enumerate(prefill):
                if rec is not None:  # its real tokens are the last `length` (left padding)
                    found.append((rec, 0, per_row[j, per_row.shape[1] - length :]))


def to_wire(experts: np.ndarray) -> str:
    """SGLang's wire form: base64 of the int32 array, flattened (token, layer, top-k slot)."""
    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


def from_wire(text: str, rows: int, shape: tuple[int, int], *, start: int = 0) -> np.ndarray:
    """The ``(rows, layers, top_k)`` int16 array of a wire ``routed_experts`` string.

    The string holds the rows from ``start`` on (SGLang's ``routed_experts_start_len``); the
    rows before it are -1.

    Raises:
        ValueError: not base64, or its length is not ``rows - start`` rows of ``shape``.
    """
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not base64 ({exc})") from None
    flat = np.frombuffer(raw, dtype="<i4") if len(raw) % 4 == 0 else None
    layers, top_k = shape
    sent = max(rows - start, 0)
    if flat is None or len(flat) != sent * layers * top_k:
        raise ValueError(
            f"{len(raw)} bytes do not hold {sent} rows x {layers} layers x {top_k} experts of int32"
        )
    if len(flat) and (flat.min() < -1 or flat.max() > np.iinfo(np.int16).max):
        raise ValueError(f"expert ids out of range [{flat.min()}, {flat.max()}]")
    out = np.full((max(rows, 0), layers, top_k), -1, dtype=np.int16)
    out[len(out) - sent :] = flat.reshape(sent, layers, top_k)
    return out
