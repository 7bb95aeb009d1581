"""Continuous batching over the paged KV cache (the engine's fast path).

The request lifecycle, aborts, pauses and versions are :class:`~agentrl.inference.engine.batcher.
Batcher`'s; this subclass changes where the cache lives and how a step is computed:

- **Pages, not a batch tensor.** A running request owns pages and a block-table row; joining
  and leaving never touch other rows. Page bookkeeping happens in :meth:`plan` (event loop,
  model lock held): finished rows give their pages back (full pages registered for prefix
  reuse), running rows get the page their next token needs, joining requests take their cached
  prefix and fresh pages. When pages run out the newest running request goes back to the queue
  head (its full pages stay cached, so it resumes with little recomputation).
- **A step** is one captured decode of the running rows plus one packed prefill of the joining
  requests' uncached tokens, then one vectorised sampling call for all rows.
- **Runs of steps.** When nothing can join (the queue is empty or every row is taken), a plan
  may hold up to ``decode_steps`` decode steps that the device runs back to back
  (:meth:`PagedRunner.decode_many`): pages for every step are given up front, and the run is
  cut to the fewest tokens any row may still sample. The host reads the steps as they land
  (on a card 8 at a time, a chunk behind it) and launches no more after the step where a row
  sampled a stop token or was aborted, a queued request could take a free row, or the engine
  wants the model (``cut_run``: a pause); so a long run costs little latency, and its end (the
  host's round trip: ~3 ms of an idle card on an H100) is paid rarely. A row that stops inside
  a run keeps the tokens up to its stop; the rest are dropped (at most ``2 * RUN_CHUNK - 1``
  wasted positions on a card). Sampling keys depend only on (seed, token index), so a run
  samples exactly what single steps would.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any, cast

import torch

from agentrl.errors import ServerError
from agentrl.inference.engine import prefill_graphs
from agentrl.inference.engine.batcher import Batcher, Request, StepPlan
from agentrl.inference.engine.kv_cache import page_bytes
from agentrl.inference.engine.paged_moe import slots_of
from agentrl.inference.engine.paged_runner import PagedRunner, RunCut
from agentrl.inference.engine.sampling import row_keys
from agentrl.inference.routing_records import StepRows
from agentrl.kernels.transfer import device_context, to_device, to_host

DEFAULT_KV_CACHE_FRAC = 0.5
"""Paged path on CUDA: share of the free GPU memory the KV cache takes by default."""
DEFAULT_KV_CACHE_GIB_CPU = 0.25
"""Paged path on CPU (tests): KV cache size by default."""


def kv_cache_pages(
    device: torch.device,
    page: int,
    *,
    kv_cache_gib: float | None,
    kv_cache_frac: float | None,
    most: int,
) -> int:
    """Pages of ``page`` bytes that the KV cache budget allows (at most ``most``, + scratch)."""
    if kv_cache_gib is not None and kv_cache_frac is not None:
        raise ValueError("kv_cache_gib and kv_cache_frac: give at most one")
    if kv_cache_gib is not None:
        budget = kv_cache_gib * 2**30
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * (kv_cache_frac if kv_cache_frac is not None else DEFAULT_KV_CACHE_FRAC)
    else:
        budget = DEFAULT_KV_CACHE_GIB_CPU * 2**30 * (kv_cache_frac or 1.0)
    pages = min(int(budget // page), most) + 1
    if pages < 2:
        raise ValueError(f"KV cache budget: {budget / 2**30:.3f} GiB holds no page of {page} bytes")
    return pages


class PagedBatcher(Batcher):
    """:class:`Batcher` over a :class:`PagedRunner`; see the module docstring.

    Args:
        runner: the paged model runner (owns the KV cache and the block table).
        rng: draws the sampling seed of requests that do not bring one.
        prefix_cache: register released pages for reuse (``False``: every prompt is prefilled).
        decode_steps: most decode steps in one plan when nothing can join.
        **kwargs: :class:`Batcher`'s keyword arguments.
    """

    def __init__(
        self,
        runner: PagedRunner,
        rng: random.Random,
        *,
        prefix_cache: bool = True,
        decode_steps: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(cast(Any, runner), cast(Any, None), **kwargs)
        if decode_steps < 1:
            raise ValueError(f"decode_steps: expected >= 1, got {decode_steps}")
        self.paged = runner
        self.rng = rng
        self.prefix_cache = prefix_cache
        self.decode_steps = decode_steps
        self.epoch = 0
        self._admitting = False  # the plan in flight was made with admission on
        self._free_rows = list(range(runner.max_batch_size - 1, -1, -1))
        self._table: list[tuple[int, int, int]] = []  # pending block-table writes (row, i, page)

    # ---- page bookkeeping (event loop) -----------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue ``req`` with its sampling seed (a fresh random one if it brings none)."""
        seed = req.params.seed
        req.seed = seed if seed is not None else self.rng.getrandbits(63)
        super().submit(req)

    def _release(self, req: Request, *, register: bool) -> None:
        if req.row < 0:
            return
        keep = register and self.prefix_cache and req.epoch == self.epoch
        tokens = req.prompt + req.output_ids if keep else None
        self.paged.cache.release(req.pages, tokens, req.kv_len)
        self._free_rows.append(req.row)
        req.pages, req.kv_len, req.row = [], 0, -1

    def _preempt(self, req: Request) -> None:
        self._release(req, register=True)
        req.running = False
        req.num_retractions += 1
        self.waiting.appendleft(req)

    def weights_changed(self) -> None:
        """Cached prefixes were computed by the old weights: forget them."""
        self.epoch += 1
        self.paged.cache.clear_prefixes()

    def reset(self) -> None:
        """Drop every request and free every page (their event loop is gone)."""
        self.paged.cache.reset()
        self._free_rows = list(range(self.paged.max_batch_size - 1, -1, -1))
        self._table = []
        super().reset()

    def retract(self) -> None:
        """Release the running requests' pages (full ones stay cached), then requeue them."""
        for req in self.running:
            self._release(req, register=not req.done)
        super().retract()

    def plan(self, *, admit: bool) -> StepPlan | None:
        """Free finished rows, give running rows their next page, admit what fits."""
        cache, size = self.paged.cache, self.paged.page_size
        self.cut_run, self._admitting = False, admit
        for req in self.running:
            if req.done:
                self._release(req, register=True)
        decode = [r for r in self.running if not r.done]
        steps = self._run_length(decode, admit)
        i = 0
        while i < len(decode):
            req = decode[i]
            if (req.kv_len + steps - 1) // size < len(req.pages):
                i += 1
                continue
            page = cache.allocate(1)
            if page is None:  # out of pages: the newest row waits (its prefix stays cached)
                self._preempt(decode.pop())
                continue
            req.pages += page
            self._table.append((req.row, len(req.pages) - 1, page[0]))
        joining: list[Request] = []
        budget, cached = self.max_prefill_tokens, 0
        while admit and self.waiting and len(decode) + len(joining) < self.max_batch_size:
            req = self.waiting[0]
            tokens = req.prompt + req.output_ids  # retracted: with its output so far
            shared = cache.match(tokens)
            start = len(shared) * size
            need = math.ceil(len(tokens) / size) - len(shared)
            reserve = len(decode) + len(joining)  # a page each for the next steps' growth
            too_big = joining and len(tokens) - start > budget
            if too_big or cache.available() - need < reserve:
                cache.release(shared)
                if not decode and not joining and not too_big:  # can never fit
                    self.waiting.popleft()
                    self.forget(req)
                    message = f"KV cache too small: {len(tokens)} tokens need {need} pages"
                    req.future.set_exception(ServerError(message, endpoint="local", status=400))
                    continue
                break
            pages = cache.allocate(need)
            assert pages is not None
            self.waiting.popleft()
            req.pages, req.kv_len, req.epoch = shared + pages, start, self.epoch
            req.row = self._free_rows.pop()
            self._table += [(req.row, j, p) for j, p in enumerate(req.pages)]
            joining.append(req)
            budget -= len(tokens) - start
            cached += start
        if not decode and not joining:
            self.running = []
            return None
        self.stepping = {id(r) for r in decode + joining}
        if joining:
            self.prefills.add(joining)
            self.prefills.cached_tokens += cached
        return StepPlan(None, decode, joining, self.version(), steps if not joining else 1)

    def _run_length(self, decode: list[Request], admit: bool) -> int:
        """Decode steps the next plan may run back to back (1 when anything needs the host).

        A waiting request cuts the run to one step only when it could join now: with every
        row taken it waits for a row to stop anyway, and the run ends at the first step a row
        may stop by length (in a loop whose admission outruns the batch, the queue is never
        empty, and single steps would cost a host round trip per token).
        """
        joinable = admit and self.waiting and len(decode) < self.max_batch_size
        if self.decode_steps == 1 or not decode or joinable:
            return 1
        if any(r.params.truncates or r.aborted is not None for r in decode):
            return 1
        steps = min(
            self.decode_steps,
            *(r.params.max_new_tokens - len(r.output_ids) for r in decode),
            *(self.max_model_len - len(r.prompt) - len(r.output_ids) for r in decode),
        )
        size = self.paged.page_size
        need = sum(max(0, (r.kv_len + steps - 1) // size + 1 - len(r.pages)) for r in decode)
        return steps if steps > 1 and need <= self.paged.cache.available() else 1

    def apply(self, plan: StepPlan, tokens: list[int], logprobs: list[float]) -> None:
        """Record the plan's steps (step-major); rows that stopped ignore the later tokens.

        A run's rows are recorded a row at a time (:meth:`Batcher.record`). An aborted row keeps
        every token the run sampled for it: the run ends soon after the host sees the abort, and
        those tokens are the old weights' samples, as a partial rollout wants them (keeping one,
        as a single step would, threw away up to a whole run: 64 rows x ~60 tokens at every
        other push on an H100).
        """
        for record, start, rows in self.step_rows:  # (a run records no rows in super().apply)
            record.record(start, rows)
        self.step_rows = []
        n = len(plan.decode) + len(plan.admit)
        steps = len(tokens) // n
        if steps == 1:
            super().apply(plan, tokens, logprobs)
            return
        self.running, self.stepping = list(plan.decode), set()  # a run has no joining rows
        for j, req in enumerate(self.running):
            self.record(req, tokens[j::n], logprobs[j::n], plan.version)
            # the cache past its last kept token holds the run's dropped steps: not its own
            req.kv_len = min(req.kv_len, len(req.prompt) + len(req.output_ids))

    def _cut(self, plan: StepPlan) -> RunCut:
        """When a run of decode steps ends early.

        After the step where a row sampled a stop token or was aborted, a queued request could
        take a free row, or the engine wants the model (``cut_run``).
        """
        rows, joinable = plan.decode, self._admitting and len(plan.decode) < self.max_batch_size

        def cut(step: int, sampled: list[list[float]]) -> bool:
            if self.cut_run or (joinable and self.waiting):
                return True
            return any(
                int(t) in r.stop_ids or r.aborted is not None
                for r, t in zip(rows, sampled[0], strict=True)
            )

        return cut

    def fail(self, plan: StepPlan, exc: Exception) -> None:
        """Free the failed step's pages (nothing registered), then fail its requests."""
        for req in plan.decode + plan.admit:
            self._release(req, register=False)
        super().fail(plan, exc)

    # ---- the step (worker thread) ----------------------------------------------------------

    def compute(
        self, plan: StepPlan, launched: Callable[[], None] | None = None
    ) -> tuple[list[int], list[float]]:
        """Decode the running rows, prefill the joining ones, sample every row.

        ``launched`` is called once the device has work queued: on a GPU after the step's
        kernels (a run's first chunk) are launched, on a CPU at once.
        """
        runner, size = self.paged, self.paged.page_size
        if launched is not None and runner.device.type != "cuda":
            launched()  # a CPU computes as it goes: nothing to queue first
            launched = None
        with torch.inference_mode(), device_context(runner.device):  # a worker thread's device
            if self._table:
                table = to_device(torch.tensor(self._table, dtype=torch.int64).t(), runner.device)
                runner.block_table[table[0], table[1]] = table[2].int()  # (row, i, page)
                self._table = []
            reqs = plan.decode + plan.admit
            meta = step_meta(reqs, len(plan.decode), size)
            sampled = []
            if plan.steps > 1:
                runs = runner.decode_many(meta, plan.steps, self._cut(plan), launched)
                for req in plan.decode:
                    req.kv_len += runs.shape[0]
                self.step_rows = self._routing_rows(plan.decode)
                flat = to_host(runs.transpose(0, 1).reshape(2, -1)).tolist()
                return [int(t) for t in flat[0]], flat[1]
            if plan.decode:
                logits, out = runner.decode(meta[:, : len(plan.decode)])
                if any(r.params.truncates for r in plan.decode):  # the graph does not truncate
                    out = _sample(runner, logits, meta[:, : len(plan.decode)], plan.decode)
                sampled.append(out)
            if plan.admit:
                seqs = [r.prompt + r.output_ids for r in plan.admit]
                logits = runner.prefill(
                    [r.row for r in plan.admit],
                    [r.kv_len for r in plan.admit],
                    seqs,
                    [r.pages for r in plan.admit],
                )
                sampled.append(_sample(runner, logits, meta[:, len(plan.decode) :], plan.admit))
            if launched is not None:
                launched()
            for req in plan.decode:
                req.kv_len += 1
            for req in plan.admit:
                req.kv_len = len(req.prompt) + len(req.output_ids)
            self.step_rows = self._routing_rows(reqs)
            both = to_host(sampled[0] if len(sampled) == 1 else torch.cat(sampled, dim=1)).tolist()
            return [int(t) for t in both[0]], both[1]

    def _routing_rows(self, reqs: list[Request]) -> StepRows:
        """The routing rows the requests that asked lack, up to their ``kv_len`` (MoE models).

        Positions recorded already keep their rows (the first computation wins): a retracted
        request reads only what it had not recorded, a reused prefix the rows its pages hold.
        """
        slots_rows = self.paged.routing
        want = [
            (r.routing, r.routing.count, r)
            for r in reqs
            if r.routing is not None and r.kv_len > r.routing.count
        ]
        if slots_rows is None or self.routing is None or not want:
            return []
        size = self.paged.page_size
        slots = torch.cat([slots_of(r.pages, size, start, r.kv_len) for _, start, r in want])
        rows = slots_rows.rows(slots).numpy()
        found: StepRows = []
        i = 0
        for record, start, r in want:
            found.append((record, start, rows[i : i + r.kv_len - start]))
            i += r.kv_len - start
        return found


def step_meta(reqs: list[Request], n_decode: int, page_size: int) -> torch.Tensor:
    """``(9, len(reqs))`` int64 ``DECODE_META`` (:mod:`~agentrl.inference.engine.paged_runner`).

    The first ``n_decode`` requests decode (they feed their last sampled token at position
    ``kv_len``); the others join (only their sampling columns are read).
    """
    cols = []
    for i, r in enumerate(reqs):
        if i < n_decode:
            p = r.kv_len
            slot = r.pages[p // page_size] * page_size + p % page_size
            cols.append((r.output_ids[-1], p, slot, r.row, r.seed, len(r.output_ids)))
        else:
            cols.append((0, 0, 0, r.row, r.seed, len(r.output_ids)))
    meta = torch.tensor(cols, dtype=torch.int64).t()  # seeds and counts are rows 4 and 5 here
    temps = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float64)
    greedy = temps <= 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temps).float()  # float32(1 / T), as the head's
    sampling = torch.stack(
        [row_keys(meta[4], meta[5]), inv_t.view(torch.int32).long(), greedy.long()]
    )
    return torch.cat([meta[:4], sampling, meta[4:6]])


def _sample(
    runner: PagedRunner, logits: torch.Tensor, meta: torch.Tensor, reqs: list[Request]
) -> torch.Tensor:
    """Sample ``logits`` eagerly with the sampling rows of ``meta``: ``(2, B)`` float64."""
    m = to_device(meta[4:7], logits.device)
    inv_t = m[1].to(torch.int32).view(torch.float32)
    top_k = top_p = None
    if any(r.params.truncates for r in reqs):
        top_k = to_device(torch.tensor([r.params.top_k for r in reqs]), logits.device)
        top_p = to_device(
            torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32), logits.device
        )
    tokens, logprobs = runner.sample(logits, inv_t, m[2].bool(), m[0], top_k, top_p)
    return torch.stack([tokens.double(), logprobs.double()])


def build_paged(
    model: Any,
    rng: random.Random,
    *,
    kv_cache_gib: float | None,
    kv_cache_frac: float | None,
    page_size: int,
    compute_dtype: torch.dtype | None,
    cuda_graphs: bool,
    compile: bool,
    prefix_cache: bool,
    max_batch_size: int,
    decode_steps: int = 1,
    max_model_len: int,
    max_prefill_tokens: int,
    emulate_precision_casts: bool = False,
    batch_invariant: bool = False,
    **kwargs: Any,
) -> tuple[PagedRunner, PagedBatcher]:
    """The paged runner (KV cache sized by the budget) and its batcher, for ``LocalEngine``.

    Args:
        model: a supported causal LM on its device (a CUDA model stays where it is).
        rng: draws the sampling seeds of requests that bring none.
        kv_cache_gib: KV cache size in GiB, allocated once here (never more than
            ``max_batch_size`` full-length sequences need) ...
        kv_cache_frac: ... or this share of the device's free memory now (default
            ``DEFAULT_KV_CACHE_FRAC`` on CUDA, ``DEFAULT_KV_CACHE_GIB_CPU`` on CPU); at most one.
        page_size: tokens per KV page (the granularity of prefix reuse).
        compute_dtype: matmul inputs and KV cache (default: the model's dtype); ``bfloat16``
            over float32 weights computes what the learner computes under bf16 autocast.
        cuda_graphs: capture decode steps as CUDA graphs (CUDA only).
        compile: ``torch.compile`` the layer functions (~1.7x decode throughput on an H100).
        emulate_precision_casts: compiled layers keep eager's bf16 roundings between fused
            ops, as the (eager) learner rounds (:class:`PagedRunner`).
        batch_invariant: the exact mode (:class:`PagedRunner`): log-probs equal to the
            learner's exact mode bit for bit.
        prefix_cache: reuse cached prefixes across requests and turns.
        decode_steps: most decode steps run back to back when nothing can join.
        max_batch_size: most sequences decoded together.
        max_model_len: longest sequence.
        max_prefill_tokens: most new tokens prefilled in one step (also the largest prefill
            graph's bucket, with prefill graphs on).
        **kwargs: the rest of :class:`Batcher`'s keyword arguments.
    """
    cfg = model.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    per_page = page_bytes(
        num_layers=int(cfg.num_hidden_layers),
        num_kv_heads=int(cfg.num_key_value_heads),
        head_dim=head_dim,
        page_size=page_size,
        dtype=compute_dtype or model.get_input_embeddings().weight.dtype,
    )
    device = next(model.parameters()).device
    pages = kv_cache_pages(
        device,
        per_page,
        kv_cache_gib=kv_cache_gib,
        kv_cache_frac=kv_cache_frac,
        most=max_batch_size * math.ceil(max_model_len / page_size),
    )
    runner = PagedRunner(
        model,
        num_pages=pages,
        page_size=page_size,
        max_batch_size=max_batch_size,
        max_model_len=max_model_len,
        compute_dtype=compute_dtype,
        cuda_graphs=cuda_graphs,
        compile=compile,
        emulate_precision_casts=emulate_precision_casts,
        batch_invariant=batch_invariant,
        prefill_graph_tokens=max_prefill_tokens if prefill_graphs.PREFILL_GRAPHS else 0,
    )
    batcher = PagedBatcher(
        runner,
        rng,
        prefix_cache=prefix_cache,
        decode_steps=decode_steps,
        max_batch_size=max_batch_size,
        max_model_len=max_model_len,
        max_prefill_tokens=max_prefill_tokens,
        **kwargs,
    )
    return runner, batcher
