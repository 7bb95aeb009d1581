"""The internals of :class:`~agentrl.inference.engine.LocalEngine`.

- ``Batcher``: the open requests and one continuous-batching step (plan which rows decode and
  which queued requests join, compute in the worker thread, apply the sampled tokens).
- ``ModelRunner`` and ``BatchCache``: batched prefill and decode over one left-padded KV cache
  (select rows, merge newcomers), and teacher-forced scoring.
- ``sample``: per-row sampling with SGLang's log-prob convention.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from agentrl.errors import ServerError
from agentrl.inference.base import FinishType, GenerateOutput, SamplingParams
from agentrl.inference.routing_records import RequestRouting, RoutingRecorder, StepRows

logger = logging.getLogger(__name__)


class BatchCache:
    """The running batch's left-padded KV cache, attention mask and next position per row."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask  # (B, T) 1 = real token, 0 = left padding
        self.positions = positions  # (B,) position id of the next token fed

    def _layers(self) -> list[Any]:
        return list(self.cache.layers)

    def select(self, rows: list[int]) -> BatchCache:
        """Keep ``rows`` and drop the leading columns that are padding in every kept row."""
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask[index]
        real_cols = mask.sum(0).nonzero()
        start = int(real_cols[0]) if len(real_cols) else mask.shape[1]
        for layer in self._layers():
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        return BatchCache(self.cache, mask[:, start:], self.positions[index])

    def pad_left(self, width: int) -> None:
        """Grow every row by ``width`` masked columns on the left."""
        if width <= 0:
            return
        for layer in self._layers():
            b, h, _, d = layer.keys.shape
            zeros = layer.keys.new_zeros(b, h, width, d)
            layer.keys = torch.cat([zeros, layer.keys], dim=2)
            layer.values = torch.cat([zeros.to(layer.values.dtype), layer.values], dim=2)
        self.mask = torch.cat([self.mask.new_zeros(self.mask.shape[0], width), self.mask], dim=1)

    def merge(self, other: BatchCache) -> BatchCache:
        """Append ``other``'s rows after this batch's rows (both left-padded to one width)."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.pad_left(width - self.mask.shape[1])
        other.pad_left(width - other.mask.shape[1])
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask = torch.cat([self.mask, other.mask], dim=0)
        self.positions = torch.cat([self.positions, other.positions], dim=0)
        return self


class ModelRunner:
    """Runs the model for the engine: batched prefill, one decode step, teacher-forced scoring."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        args = inspect.signature(model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`.
        self._cache_kw = "cache" if "cache" in args else "past_key_values"
        self._last_only = "logits_to_keep" in args
        layers = getattr(self._new_cache(), "layers", None)
        if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers or []})
            raise ValueError(
                f"LocalEngine needs a model whose KV cache is full attention (DynamicLayer), "
                f"got cache layers {kinds or 'unknown'}"
            )

    def _new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._last_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        return out.logits[:, -1]  # (B, V)

    def prefill(self, seqs: list[list[int]]) -> tuple[torch.Tensor, BatchCache]:
        """Left-pad ``seqs`` into one batch; return next-token logits and the batch's cache."""
        width = max(len(s) for s in seqs)
        ids = [[self.pad_id] * (width - len(s)) + s for s in seqs]
        mask_rows = [[0] * (width - len(s)) + [1] * len(s) for s in seqs]
        input_ids = torch.tensor(ids, device=self.device)  # (B, T)
        mask = torch.tensor(mask_rows, device=self.device)  # (B, T)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T) real positions per row
        cache = self._new_cache()
        logits = self._forward(input_ids, mask, positions, cache)
        return logits, BatchCache(cache, mask, mask.sum(-1))

    def decode(self, batch: BatchCache, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; return the next-token logits (B, V)."""
        ids = torch.tensor(tokens, device=self.device)[:, None]  # (B, 1)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(tokens), 1)], dim=1)
        logits = self._forward(ids, batch.mask, batch.positions[:, None], batch.cache)
        batch.positions = batch.positions + 1
        return logits

    @torch.inference_mode()
    def score(self, ids: list[int], temperature: float) -> list[float]:
        """Teacher-forced ``log_softmax(logits / T)`` of ``ids[1:]`` (one forward pass)."""
        input_ids = torch.tensor([ids], device=self.device)  # (1, T)
        logits = self.model(input_ids=input_ids).logits[0, :-1].float()  # (T-1, V)
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        return logprobs.gather(1, input_ids[0, 1:, None])[:, 0].tolist()


def _truncate(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k / top-p set; rows stay unnormalised."""
    vocab = logprobs.shape[-1]
    device = logprobs.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logprobs.dtype)
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_lp.exp()
    ranks = torch.arange(vocab, device=device)
    # top-p keeps tokens until the mass *before* them exceeds p, so the first always stays.
    remove = (ranks[None, :] >= top_k[:, None]) | ((probs.cumsum(-1) - probs) > top_p[:, None])
    sorted_lp = sorted_lp.masked_fill(remove, float("-inf"))
    return torch.full_like(logprobs, float("-inf")).scatter(1, order, sorted_lp)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Sample one token per row; return the tokens and their SGLang-convention log-probs.

    The log-prob is ``log_softmax(logits / T)`` over the full vocabulary (plain
    ``log_softmax(logits)`` for greedy rows, ``T == 0``), not renormalised by top-k/top-p.
    Rows with their own generator (a per-request seed) draw from it alone, so their samples do
    not depend on which other requests share the batch; the others share ``shared``.
    """
    logits = logits.float()  # (B, V)
    temps = [p.temperature for p in params]
    scale = torch.tensor([t if t > 0 else 1.0 for t in temps], device=logits.device)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)  # (B, V)
    tokens = logits.argmax(dim=-1)  # (B,) greedy rows keep this
    rows = [i for i, t in enumerate(temps) if t > 0]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        scores = logprobs[index]  # (n, V)
        row_params = [params[i] for i in rows]
        if any(p.truncates for p in row_params):
            scores = _truncate(scores, row_params)
        probs = torch.softmax(scores, dim=-1)  # (n, V)
        picks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        common = [j for j, i in enumerate(rows) if generators[i] is None]
        if common:
            at = torch.tensor(common, device=logits.device)
            picks[at] = torch.multinomial(probs[at], 1, generator=shared)[:, 0]
        for j, i in enumerate(rows):
            own = generators[i]
            if own is not None:
                picks[j] = torch.multinomial(probs[j], 1, generator=own)[0]
        tokens[index] = picks
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # (B,)
    return tokens.tolist(), chosen.tolist()


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerateOutput]
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    running: bool = False
    num_retractions: int = 0
    aborted: str | None = None  # abort message, pending until the step in flight is applied
    start: float = field(default_factory=time.perf_counter)
    # paged engine only (agentrl.inference.paged_batcher)
    seed: int = 0  # sampling noise seed
    pages: list[int] = field(default_factory=list)  # KV cache pages, in order
    kv_len: int = 0  # tokens whose keys and values are in ``pages``
    row: int = -1  # block-table row while it holds pages
    epoch: int = 0  # weights epoch its cache was computed with
    routing: RequestRouting | None = None  # its routed experts, when it asked for them
    ended: bool = False  # finished; its result may still wait for ``Batcher.deliver``

    @property
    def done(self) -> bool:
        return self.ended or self.future.done()


@dataclass
class PrefillStats:
    """Counts of prefill forwards: how well arrivals are batched."""

    steps: int = 0
    requests: int = 0
    tokens: int = 0
    cached_tokens: int = 0  # of ``tokens``, those a reused prefix held (paged engine)

    def add(self, joining: list[Request]) -> None:
        self.steps += 1
        self.requests += len(joining)
        self.tokens += sum(len(r.prompt) + len(r.output_ids) for r in joining)


@dataclass
class StepPlan:
    keep: list[int] | None  # rows of the running batch to keep (None: all)
    decode: list[Request]  # rows that feed their last sampled token
    admit: list[Request]  # requests to prefill (prompt + output so far)
    version: int
    steps: int = 1  # decode steps run back to back (paged engine; no joining rows then)


class Batcher:
    """The requests' state and one scheduling step (event loop and worker thread, never both).

    Holds the open requests (``requests``), the queue (``waiting``), the rows of the running
    batch (``running``, aligned with the KV cache ``batch``). ``plan``/``apply``/``finish`` run
    on the event loop; ``compute`` runs in the worker thread while the loop awaits it under the
    engine's model lock, so the two never touch the batch at the same time.
    """

    def __init__(
        self,
        runner: ModelRunner,
        generator: torch.Generator,
        *,
        max_batch_size: int,
        max_prefill_tokens: int,
        max_model_len: int,
        version: Callable[[], int],
    ) -> None:
        self.runner = runner
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_len = max_model_len
        self.version = version
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.batch: BatchCache | None = None
        self.stepping: set[int] = set()  # ids of the requests in the step being computed
        self.prefills = PrefillStats()
        self.routing: RoutingRecorder | None = None  # set by an engine that records routing
        self.step_rows: StepRows = []  # routing rows of the step computed, recorded at apply
        self.cut_run = False  # the engine wants the model: a run of steps in flight ends soon
        # requests that ``apply`` finished, with how: their results wait for ``deliver``
        self.undelivered: list[tuple[Request, FinishType, int | None, str]] = []

    def weights_changed(self) -> None:
        """New weights are loaded (the paged batcher drops its cached prefixes)."""

    def reset(self) -> None:
        """Drop every request and the cache (their event loop is gone)."""
        self.requests.clear()
        self.waiting.clear()
        self.running, self.batch = [], None
        self.stepping = set()
        self.undelivered = []

    def submit(self, req: Request) -> None:
        self.requests[req.rid] = req
        self.waiting.append(req)

    def has_running(self) -> bool:
        return any(not r.done for r in self.running)

    def output(
        self, req: Request, reason: FinishType, matched: int | None, message: str
    ) -> GenerateOutput:
        return GenerateOutput(
            rid=req.rid,
            output_ids=list(req.output_ids),
            logprobs=list(req.logprobs),
            versions=list(req.versions),
            finish_reason=reason,
            weight_version=self.version(),
            prompt_tokens=len(req.prompt),
            matched_stop=matched,
            routed_experts=None
            if req.routing is None
            else req.routing.array(len(req.prompt) + len(req.output_ids) - 1),
            meta={
                "e2e_latency": time.perf_counter() - req.start,
                "num_retractions": req.num_retractions,
                "finish_message": message,
            },
        )

    def forget(self, req: Request) -> None:
        if self.requests.get(req.rid) is req:
            del self.requests[req.rid]
        if not req.running and req in self.waiting:
            self.waiting.remove(req)

    def finish(
        self,
        req: Request,
        reason: FinishType,
        matched: int | None = None,
        message: str = "",
        *,
        hold: bool = False,
    ) -> None:
        """End ``req``; its caller gets the result now, or at :meth:`deliver` with ``hold``."""
        if req.done:
            return
        req.ended = True
        self.forget(req)
        if hold:
            self.undelivered.append((req, reason, matched, message))
        else:
            req.future.set_result(self.output(req, reason, matched, message))

    def deliver(self) -> int:
        """Hand the requests that ``apply`` finished their results; returns how many."""
        held, self.undelivered = self.undelivered, []
        for req, reason, matched, message in held:
            if not req.future.done():  # (a caller that gave up cancelled it)
                req.future.set_result(self.output(req, reason, matched, message))
        return len(held)

    def abort_matching(self, rid: str | None, *, prefix: bool, defer: bool = True) -> int:
        """Abort the open requests matching ``rid`` (all for ``None``); returns how many.

        A request in the step being computed finishes when that step is applied, with the token
        it samples there (SGLang stops a running request after at most one more decode step and
        returns every token); ``defer=False`` finishes it now and drops that token.
        """
        if rid == "":
            return 0  # SGLang ignores an empty rid without abort_all
        targets = [
            req
            for key, req in list(self.requests.items())
            if rid is None or key == rid or (prefix and key.startswith(rid))
        ]
        for req in targets:
            message = "Aborted" if req.running else "Abort in waiting queue"
            if defer and id(req) in self.stepping:
                req.aborted = "Aborted"
            else:
                self.finish(req, "abort", message=message)
        return len(targets)

    def retract(self) -> None:
        """Move the running requests back to the queue head; their cache is rebuilt on admit."""
        for req in reversed([r for r in self.running if not r.done]):
            req.running = False
            req.num_retractions += 1
            self.waiting.appendleft(req)
        self.running, self.batch = [], None

    def plan(self, *, admit: bool) -> StepPlan | None:
        """Which rows decode and which queued requests join this step (``None``: idle)."""
        keep = [i for i, r in enumerate(self.running) if not r.done]
        decode = [self.running[i] for i in keep]
        joining: list[Request] = []
        budget = self.max_prefill_tokens
        while admit and self.waiting and len(decode) + len(joining) < self.max_batch_size:
            size = len(self.waiting[0].prompt) + len(self.waiting[0].output_ids)
            if joining and size > budget:
                break
            joining.append(self.waiting.popleft())
            budget -= size
        if not decode and not joining:
            self.running, self.batch = [], None  # free the cache of finished rows
            return None
        kept = keep if len(keep) < len(self.running) else None
        self.stepping = {id(r) for r in decode + joining}
        if joining:
            self.prefills.add(joining)
        return StepPlan(kept, decode, joining, self.version())

    def compute(
        self, plan: StepPlan, launched: Callable[[], None] | None = None
    ) -> tuple[list[int], list[float]]:
        """One step in the worker thread: drop finished rows, decode, prefill newcomers, sample.

        ``launched`` is called once the step's work is queued (on this path: at once).
        """
        if launched is not None:
            launched()
        with torch.inference_mode(), self._routing_step(plan) as self.step_rows:
            if plan.keep is not None:
                self.batch = self.batch.select(plan.keep) if plan.keep and self.batch else None
            logits = []
            if plan.decode:
                assert self.batch is not None
                pending = [r.output_ids[-1] for r in plan.decode]  # sampled, not yet fed
                logits.append(self.runner.decode(self.batch, pending))
            if plan.admit:
                seqs = [r.prompt + r.output_ids for r in plan.admit]  # retracted: with output
                new_logits, new_batch = self.runner.prefill(seqs)
                logits.append(new_logits)
                self.batch = new_batch if self.batch is None else self.batch.merge(new_batch)
            reqs = plan.decode + plan.admit
            params, generators = [r.params for r in reqs], [r.generator for r in reqs]
            return sample(torch.cat(logits), params, generators, self.generator)

    def _routing_step(self, plan: StepPlan) -> AbstractContextManager[StepRows]:
        """Capture the step's routing if a request in it asked (rows in the batch's order)."""
        if self.routing is None:
            return nullcontext([])
        fed = [(r.routing, len(r.prompt) + len(r.output_ids) - 1) for r in plan.decode]
        seqs = [(r.routing, len(r.prompt) + len(r.output_ids)) for r in plan.admit]
        return self.routing.step(fed, seqs)

    def apply(self, plan: StepPlan, tokens: list[int], logprobs: list[float]) -> None:
        """Record one token per row and finish the requests that stop or reach their length.

        Their results wait for :meth:`deliver`: the engine hands them over once the next step
        is queued, so that their callers' work does not delay its launch.
        """
        for record, start, rows in self.step_rows:  # before any output is built
            record.record(start, rows)
        self.step_rows = []
        self.running = plan.decode + plan.admit  # the batch's row order
        self.stepping = set()
        for req, token, logprob in zip(self.running, tokens, logprobs, strict=True):
            self.record(req, [token], [logprob], plan.version)

    def record(self, req: Request, tokens: list[int], logprobs: list[float], version: int) -> None:
        """Append a row's sampled tokens up to its first stop token or length cap, then finish it.

        A stop token beats the length cap (as in SGLang), which beats an abort (a row aborted
        while its step ran keeps the step's tokens).
        """
        req.running = True
        if req.done:  # cancelled (or force-aborted) while the step ran
            return
        out = req.output_ids
        cap = min(
            req.params.max_new_tokens - len(out), self.max_model_len - len(req.prompt) - len(out)
        )
        most = min(len(tokens), cap)
        stop = next((k for k in range(most) if tokens[k] in req.stop_ids), None)
        end = most if stop is None else stop + 1
        out += tokens[:end]
        req.logprobs += logprobs[:end]
        req.versions += [version] * end
        if stop is not None:
            self.finish(req, "stop", matched=tokens[stop], hold=True)
        elif end == cap:
            self.finish(req, "length", hold=True)
        elif req.aborted is not None:
            self.finish(req, "abort", message=req.aborted, hold=True)

    def fail(self, plan: StepPlan, exc: Exception) -> None:
        """A step raised: fail its requests with a 500 and drop the (maybe inconsistent) cache."""
        reqs = plan.decode + plan.admit
        self.stepping, self.step_rows = set(), []
        logger.exception("engine step failed; failing its %d requests", len(reqs))
        for req in reqs:
            if req.aborted is not None:  # its caller wanted it stopped anyway
                self.finish(req, "abort", message=req.aborted)
            elif not req.done:
                self.forget(req)
                error = f"engine step failed: {exc!r}"
                req.future.set_exception(
                    ServerError(error, endpoint="local", rid=req.rid, status=500)
                )
        self.running, self.batch = [], None
