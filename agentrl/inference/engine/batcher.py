"""The request lifecycle of :class:`~agentrl.inference.engine.LocalEngine` and one batching step.

``Batcher``: the open requests (queued, running, aborted, paused, weight versions) and one
continuous-batching step: plan which rows decode and which queued requests join, compute in the
worker thread (:class:`~agentrl.inference.engine.dense_runner.ModelRunner`'s left-padded cache
here; :class:`~agentrl.inference.engine.paged_batcher.PagedBatcher` swaps in the paged one),
apply the sampled tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from agentrl.errors import ServerError
from agentrl.inference.base import FinishType, GenerateOutput, SamplingParams
from agentrl.inference.engine.dense_runner import BatchCache, ModelRunner, sample
from agentrl.inference.routing_records import RequestRouting, RoutingRecorder, StepRows

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    """One generation request: its prompt, sampling, output so far and place in the engine."""

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
    # paged engine only (agentrl.inference.engine.paged_batcher)
    seed: int = 0  # sampling noise seed
    pages: list[int] = field(default_factory=list)  # KV cache pages, in order
    kv_len: int = 0  # tokens whose keys and values are in ``pages``
    row: int = -1  # block-table row while it holds pages
    epoch: int = 0  # weights epoch its cache was computed with
    routing: RequestRouting | None = None  # its routed experts, when it asked for them
    ended: bool = False  # finished; its result may still wait for ``Batcher.deliver``

    @property
    def done(self) -> bool:
        """Finished or cancelled: no step computes for it any more."""
        return self.ended or self.future.done()


@dataclass
class PrefillStats:
    """Counts of prefill forwards: how well arrivals are batched."""

    steps: int = 0
    requests: int = 0
    tokens: int = 0
    cached_tokens: int = 0  # of ``tokens``, those a reused prefix held (paged engine)

    def add(self, joining: list[Request]) -> None:
        """Count one prefill forward of ``joining``."""
        self.steps += 1
        self.requests += len(joining)
        self.tokens += sum(len(r.prompt) + len(r.output_ids) for r in joining)


@dataclass
class StepPlan:
    """What one step computes, decided on the event loop before the worker runs it."""

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
        """Queue ``req``; it joins the running batch at a later step."""
        self.requests[req.rid] = req
        self.waiting.append(req)

    def has_running(self) -> bool:
        """Whether a running row still decodes."""
        return any(not r.done for r in self.running)

    def output(
        self, req: Request, reason: FinishType, matched: int | None, message: str
    ) -> GenerateOutput:
        """``req``'s result as it stands, finished for ``reason``."""
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
        """Drop ``req`` from the engine's bookkeeping (not from the running batch)."""
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
