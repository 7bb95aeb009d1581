"""The embedded inference engine: a transformers causal LM behind the ``InferenceClient`` protocol.

- **One scheduler.** An asyncio task owns every request's state (``batcher.Batcher``); each
  step's torch work runs on the engine's own threads (``worker.py``) while the event loop stays
  free. State changes on the event loop only, between steps. The requests a step finishes get
  their results once the next step is launched: their callers' Python held the GIL while the
  worker launched it (on an H100, idle card at a finishing cohort: 37-45 ms, now 18-25 ms).
- **Continuous batching.** New requests join between decode steps (prefilled together),
  finished ones leave; each row computes what it would alone, to float tolerance.
- **SGLang's log-prob convention.** ``log_softmax(logits / temperature)`` over the whole
  vocabulary (no top-p/top-k renormalisation; greedy: plain ``log_softmax``); outputs include
  the matched stop token.
- **Versions.** Every token records the weight version that sampled it. A weight update takes
  the model lock between steps: paused, it applies at once and the open requests continue on
  the new weights after ``resume`` (``pause`` says how: abort, retract, in place); otherwise it
  first drains the running batch (SGLang's behaviour). Aborted requests keep the tokens the
  step in flight sampled (SGLang's do too).
- **Routing records** of MoE models, per request: :mod:`~agentrl.inference.routing_records`.
- **Two paths** (:attr:`LocalEngine.path` says which and why). On CUDA (Qwen3, Qwen2, Llama,
  Qwen3-MoE) the *paged* path: paged KV cache with prefix reuse, CUDA-graph decode, the learner's
  layer math (MoE: :mod:`~agentrl.inference.engine.paged_moe`); its exact mode
  (``batch_invariant``) returns the learner's exact-mode log-probs bit for bit. Elsewhere
  transformers' forward over one left-padded ``DynamicCache`` (float32 on CPU: ~1e-6 from
  teacher forcing).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import uuid
from typing import Any, Literal

import torch

from agentrl.errors import ServerError
from agentrl.inference.base import GenerateOutput, SamplingParams
from agentrl.inference.engine import model_io
from agentrl.inference.engine.adapters import AdapterSet, LoraServing
from agentrl.inference.engine.batcher import Batcher, Request
from agentrl.inference.engine.dense_runner import ModelRunner
from agentrl.inference.engine.paged_batcher import build_paged
from agentrl.inference.engine.paged_runner import PagedRunner
from agentrl.inference.engine.path_choice import choose_path
from agentrl.inference.engine.weight_updates import WeightUpdates
from agentrl.inference.engine.worker import in_worker
from agentrl.inference.routing_records import RoutingRecorder, records_routing, refusal
from agentrl.inference.sglang_api import request_problem, warn_if_truncating

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")
RESUME_SETTLE_S = 0.002  # after resume, the first step waits until no request arrived for
RESUME_SETTLE_MAX_S = 0.05  # this long, or this long in all


class LocalEngine(WeightUpdates, LoraServing):
    """An in-process engine: continuous batching, KV cache, SGLang-convention log-probs.

    Implements :class:`~agentrl.inference.base.InferenceClient`, plus the control surface of
    SGLang's server (``pause``/``resume``, weight updates: :class:`WeightUpdates`, LoRA adapters:
    :class:`LoraServing`, ``prompt_logprobs`` for scoring). Call it from one event loop at a
    time. The engine owns ``model`` (eval mode, new weights loaded into it): give it its own copy.

    Args:
        model: a transformers causal LM whose KV cache layers are full attention.
        tokenizer: its tokenizer (used for EOS ids and by the HTTP server for text).
        max_batch_size: most requests decoded together; the rest wait in a queue.
        device: where the model runs (default: where it already is).
        dtype: the model's dtype (default: unchanged); keep float32 on CPU.
        weight_version: the version of the loaded weights.
        max_prefill_tokens: prompt tokens prefilled together in one step (at least one request).
        seed: seed of the shared sampling stream (requests with ``seed`` use their own).
        paged: run the paged path (default: on CUDA when the model supports it); its options
            (``kv_cache_gib``/``kv_cache_frac``: GiB or a share of free memory, ``page_size``,
            ``compute_dtype``, ``cuda_graphs``, ``compile``, ``prefix_cache``, ``decode_steps``:
            64 on CUDA, ``emulate_precision_casts``, ``batch_invariant``) are ``build_paged``'s.
        return_routed_experts: record the experts of requests that ask for them (SGLang's
            ``--enable-return-routed-experts``); default: on for an MoE model.
    """

    queues_while_paused = True  # a request sent while paused waits for resume (rollout's gate)

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch_size: int = 64,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        weight_version: int = 0,
        max_prefill_tokens: int = 16384,
        seed: int | None = None,
        paged: bool | None = None,
        kv_cache_gib: float | None = None,
        kv_cache_frac: float | None = None,
        page_size: int = 16,
        compute_dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,
        compile: bool | None = None,
        prefix_cache: bool = True,
        decode_steps: int | None = None,
        emulate_precision_casts: bool = False,
        batch_invariant: bool = False,
        return_routed_experts: bool | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected >= 1, got {max_batch_size}")
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
        self.model, self._loader = model.eval(), model_io.WeightLoader(model)
        self._adapters = AdapterSet(model)
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self._version = int(weight_version)
        self._eos = model_io.eos_token_ids(model, tokenizer)
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        self._runner = ModelRunner(model, pad_id=int(getattr(tokenizer, "pad_token_id", None) or 0))
        # Unseeded: fresh entropy, without reseeding torch's global generator.
        seed = seed if seed is not None else secrets.randbits(63)
        batching: dict[str, Any] = dict(
            max_batch_size=max_batch_size, version=lambda: self._version
        )
        batching |= dict(max_prefill_tokens=max_prefill_tokens, max_model_len=self.max_model_len)
        cuda = self.device.type == "cuda"
        self.path, self.path_reason = choose_path(model, paged, cuda)
        """The engine's path: ``paged`` or ``transformers``; :attr:`path_reason` says why."""
        paged = self.path == "paged"
        self._paged: PagedRunner | None = None
        self._batcher: Batcher
        if paged:
            opts: dict[str, Any] = dict(kv_cache_gib=kv_cache_gib, kv_cache_frac=kv_cache_frac)
            opts |= dict(page_size=page_size, compute_dtype=compute_dtype)
            opts |= dict(compile=cuda if compile is None else compile, prefix_cache=prefix_cache)
            opts |= dict(cuda_graphs=cuda_graphs, emulate_precision_casts=emulate_precision_casts)
            opts |= dict(
                batch_invariant=batch_invariant, decode_steps=decode_steps or (64 * cuda or 1)
            )
            self._paged, self._batcher = build_paged(model, random.Random(seed), **opts, **batching)
            if self._paged.graphs_off is not None:
                self.path_reason += f"; CUDA graphs off: {self._paged.graphs_off}"
        elif batch_invariant:
            raise ValueError("batch_invariant: needs the paged engine (a dense model on CUDA)")
        else:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._batcher = Batcher(self._runner, generator, **batching)
        if records_routing(model, return_routed_experts):
            self._batcher.routing = RoutingRecorder(model)
        logger.info("engine path: %s (%s)", self.path, self.path_reason)
        self._requests = self._batcher.requests  # open requests by rid
        self._paused = False
        self._settle = False  # the next step first waits for arrivals to stop (after resume)
        self._draining = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()
        self._wake = asyncio.Event()

    @classmethod
    def from_pretrained(
        cls,
        path_or_preset: str,
        *,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        max_batch_size: int = 64,
        weight_version: int = 0,
        return_routed_experts: bool | None = None,
        kv_cache_gib: float | None = None,
    ) -> LocalEngine:
        """Build an engine from an HF model directory or a no-download ``agentrl.tiny`` preset.

        On CUDA a model directory loads in bfloat16 unless ``dtype`` says otherwise; on CPU in
        float32, so that sampled and recomputed log-probs agree to float tolerance.
        ``kv_cache_gib``: the paged KV cache's size (default: a share of the free memory).
        """
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = model_io.load_model(path_or_preset, device, dtype)
        return cls(model, tokenizer, max_batch_size=max_batch_size, device=device, dtype=dtype,
                   weight_version=weight_version, kv_cache_gib=kv_cache_gib,
                   return_routed_experts=return_routed_experts)  # fmt: skip

    @property
    def weight_version(self) -> int:
        """The version of the weights loaded now."""
        return self._version

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding: valid token ids are ``[0, vocab_size)``."""
        return self._vocab

    @property
    def max_model_len(self) -> int:
        """The context length: prompt plus new tokens may not exceed it."""
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 32768)

    @property
    def paused(self) -> bool:
        """Whether generation is paused (new requests queue until ``resume``)."""
        return self._paused

    def stats(self) -> dict[str, int]:
        """Open requests by state, for load reports."""
        running = sum(1 for r in self._batcher.running if not r.done)
        waiting = len(self._requests) - running
        return {"num_running_reqs": running, "num_waiting_reqs": waiting,
                "max_running_requests": self.max_batch_size}  # fmt: skip

    def prefill_stats(self) -> dict[str, int]:
        """Cumulative prefill steps, requests, tokens (cached + computed: prefix reuse)."""
        st = self._batcher.prefills
        return {"steps": st.steps, "requests": st.requests, "tokens": st.tokens} | {
            "cached_tokens": st.cached_tokens, "computed_tokens": st.tokens - st.cached_tokens
        }  # fmt: skip

    @property
    def return_routed_experts(self) -> bool:
        """Whether requests may ask for their routed experts (an MoE model, recording on)."""
        return self._batcher.routing is not None

    @property
    def paged(self) -> bool:
        """Whether the engine runs the paged path."""
        return self._paged is not None

    def num_output_tokens(self, rid: str) -> int | None:
        """Tokens generated so far by the open request ``rid`` (``None`` if not open)."""
        req = self._requests.get(rid)
        return None if req is None else len(req.output_ids)

    # ---- InferenceClient ----------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
        lora_path: str | None = None,
    ) -> GenerateOutput:
        """Continue ``input_ids``; returns the new tokens, their log-probs and versions.

        ``session_id`` is accepted for protocol compatibility (there is one engine).
        ``return_routed_experts``: fill ``routed_experts`` (see :attr:`return_routed_experts`)
        from row ``routed_experts_start_len`` on (SGLang's; the rows before it are -1).
        ``lora_path``: a loaded adapter's name (SGLang's); ``None`` or the active one is served.

        Raises:
            ServerError: with status 400 for an empty or over-long prompt, an out-of-vocabulary
                id, a duplicate in-flight ``rid`` or routed experts it does not record; 500 when
                the engine step failed.
        """
        self._ensure_started()
        rid = rid if rid is not None else uuid.uuid4().hex
        routed = routed_experts_start_len if return_routed_experts else -1
        self.check_request(input_ids, params, rid, routed=routed)
        self.check_lora(lora_path, rid)
        warn_if_truncating(params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos)
        future: asyncio.Future[GenerateOutput] = asyncio.get_running_loop().create_future()
        req = Request(rid, list(input_ids), params, future, stop, generator)
        if routed >= 0 and self._batcher.routing is not None:
            req.routing = self._batcher.routing.new_request(len(input_ids), params, routed)
        if params.max_new_tokens == 0:  # prefill-only in SGLang: nothing to sample
            return self._batcher.output(req, "length", None, "")
        self._batcher.submit(req)
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._batcher.forget(req)
            raise

    async def abort(self, rid: str | None = None, *, prefix: bool = False) -> None:
        """Abort ``rid`` (or every open request when ``None``); callers get partial outputs.

        As in SGLang, a request in the step (or run of steps) being computed stops after it and
        keeps the tokens sampled there (with log-probs and versions); the others stop now.

        Args:
            rid: the request id (``None``: every open request).
            prefix: match every id starting with ``rid`` (as SGLang's scheduler does).
        """
        self._batcher.abort_matching(rid, prefix=prefix)

    async def health(self) -> bool:
        """Whether the engine can generate (open and its scheduler alive)."""
        return not self._closed and (self._task is None or not self._task.done())

    async def aclose(self) -> None:
        """Abort open requests and stop the scheduler (idempotent)."""
        self._closed = True
        self._batcher.deliver()
        self._batcher.abort_matching(None, prefix=False, defer=False)  # no step will apply
        task, self._task = self._task, None
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    # ---- control surface ----------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "abort") -> int:
        """Stop generating; returns the number of requests left open (paused).

        ``abort`` aborts every open request (those in the step in flight keep the token it
        samples; the call returns once they have it); ``retract`` keeps them open and
        recomputes their KV cache at ``resume`` (with whatever weights are loaded then);
        ``in_place`` freezes the running batch with its cache. New requests queue until
        ``resume``.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: expected one of {PAUSE_MODES}, got {mode!r}")
        self._ensure_started()
        self._paused = self._batcher.cut_run = True  # a run of decode steps in flight ends soon
        if mode == "abort":
            self._batcher.abort_matching(None, prefix=False)
        async with self._lock:  # the step in flight, if any, completes first
            self._batcher.deliver()
            if mode == "retract":
                self._batcher.retract()
        return len(self._requests)

    async def resume(self) -> None:
        """Continue generating after ``pause`` (SGLang's ``continue_generation``).

        The first step waits until requests stop arriving (``RESUME_SETTLE_S`` without a new
        one, ``RESUME_SETTLE_MAX_S`` at most): after a weight update the interrupted requests
        are re-sent together, and one batched prefill of them all is much cheaper than
        prefilling whichever arrived first alone and the rest a step later.
        """
        self._ensure_started()
        self._paused = False
        self._settle = True
        self._wake.set()

    continue_generation = resume

    async def flush_cache(self) -> bool:
        """Forget cached prefixes; like SGLang, refuse (False) while requests are open."""
        if self._requests:
            return False
        self._batcher.weights_changed()  # the same effect: no cached prefix serves again
        return True

    async def prompt_logprobs(
        self, input_ids: list[int], *, temperature: float = 1.0
    ) -> list[float]:
        """Teacher-forced log-probs of ``input_ids[1:]``, ``log_softmax(logits / T)``.

        ``temperature`` 0 means 1 (greedy convention). One forward pass over the whole
        sequence, under the model lock, with the weights loaded now.
        """
        self._ensure_started()
        self.check_request(input_ids, SamplingParams(max_new_tokens=0), rid=None)
        async with self._lock:
            return await in_worker(self._runner.score, list(input_ids), temperature or 1.0)

    # ---- request bookkeeping (event loop only) ------------------------------------------------

    def _ensure_started(self) -> None:
        """Bind to the running event loop and start the scheduler task if needed."""
        loop = asyncio.get_running_loop()
        if self._closed:
            raise ServerError("the engine is closed", endpoint="local")
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not None and self._loop is not loop:
            if self._requests and not self._loop.is_closed():
                raise RuntimeError("LocalEngine has open requests on another event loop")
            self._batcher.reset()  # requests of a closed loop can never be answered
        self._loop = loop
        self._lock, self._update_lock, self._wake = asyncio.Lock(), asyncio.Lock(), asyncio.Event()
        self._task = loop.create_task(self._scheduler(), name="agentrl-local-engine")
        if self._batcher.waiting:
            self._wake.set()

    def check_request(
        self, input_ids: list[int], params: SamplingParams, rid: str | None, *, routed: int = -1
    ) -> None:
        """Raise the 400 ``ServerError`` that ``generate`` would raise for this request, if any.

        ``routed >= 0``: it asks for routed experts from that row on (``routed_experts_start_len``).
        """
        why = refusal(self.model, self.return_routed_experts, routed, len(input_ids))
        why = why or request_problem(
            input_ids, params, rid, self._vocab, self.max_model_len, self._requests
        )
        if why is not None:
            raise ServerError(why, endpoint="local", rid=rid, status=400)

    async def _drain(self) -> None:
        """Stop admitting and wait until the running batch is empty (or generation is paused)."""
        self._draining = True
        while not self._paused and self._batcher.has_running():
            await asyncio.sleep(0.005)

    def _has_work(self) -> bool:
        busy = self._batcher.has_running() or (not self._draining and bool(self._batcher.waiting))
        return not self._paused and busy

    async def _settle_arrivals(self) -> None:
        """Wait while requests keep arriving (see :meth:`resume`)."""
        self._settle = False
        deadline = asyncio.get_running_loop().time() + RESUME_SETTLE_MAX_S
        seen = -1
        while len(self._batcher.waiting) != seen and asyncio.get_running_loop().time() < deadline:
            seen = len(self._batcher.waiting)
            await asyncio.sleep(RESUME_SETTLE_S)

    def _launched(self) -> None:  # (worker thread) a step is queued: deliver the last results
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._batcher.deliver)

    async def _scheduler(self) -> None:
        batcher, launched = self._batcher, self._launched
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._settle and self._has_work():
                await self._settle_arrivals()
            while self._has_work():
                async with self._lock:
                    plan = None if self._paused else batcher.plan(admit=not self._draining)
                    if plan is None:
                        break
                    try:
                        tokens, logprobs = await in_worker(batcher.compute, plan, launched)
                        batcher.deliver()  # if the step never said it launched
                        batcher.apply(plan, tokens, logprobs)
                    except Exception as exc:  # a failed step fails its requests, not the engine
                        batcher.deliver()
                        batcher.fail(plan, exc)
                    if not self._has_work():  # no next step to wait for
                        batcher.deliver()
                # no yield here (aborts and pauses get in at the step's await; the lock is fair)
            batcher.deliver()
