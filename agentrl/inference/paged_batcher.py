"""Continuous batching over the paged KV cache (the engine's fast path).

The request lifecycle, aborts, pauses and versions are :class:`~agentrl.inference._engine_ops.
Batcher`'s; this subclass changes where the cache lives and how a step is computed:

- **Pages, not a batch tensor.** A running request owns pages and a block-table row; joining
  and leaving never touch other rows. Page bookkeeping happens in :meth:`plan` (event loop,
  model lock held): finished rows give their pages back (full pages registered for prefix
  reuse), running rows get the page their next token needs, joining requests take their cached
  prefix and fresh pages. When pages run out the newest running request goes back to the queue
  head (its full pages stay cached, so it resumes with little recomputation).
- **A step** is one captured decode of the running rows plus one packed prefill of the joining
  requests' uncached tokens, then one vectorised sampling call for all rows.
"""

from __future__ import annotations

import math
import random
from typing import Any, cast

import torch

from agentrl.errors import ServerError
from agentrl.inference._engine_ops import Batcher, Request, StepPlan
from agentrl.inference.kv_cache import page_bytes
from agentrl.inference.paged_runner import PagedRunner
from agentrl.inference.sampling import row_key, sample

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
        **kwargs: :class:`Batcher`'s keyword arguments.
    """

    def __init__(
        self, runner: PagedRunner, rng: random.Random, *, prefix_cache: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(cast(Any, runner), cast(Any, None), **kwargs)
        self.paged = runner
        self.rng = rng
        self.prefix_cache = prefix_cache
        self.epoch = 0
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
        for req in self.running:
            if req.done:
                self._release(req, register=True)
        decode = [r for r in self.running if not r.done]
        i = 0
        while i < len(decode):
            req = decode[i]
            if req.kv_len // size < len(req.pages):
                i += 1
                continue
            page = cache.allocate(1)
            if page is None:  # out of pages: the newest row waits (its prefix stays cached)
                self._preempt(decode.pop())
                continue
            req.pages += page
            self._table.append((req.row, len(req.pages) - 1, page[0]))
            i += 1
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
        return StepPlan(None, decode, joining, self.version())

    def fail(self, plan: StepPlan, exc: Exception) -> None:
        """Free the failed step's pages (nothing registered), then fail its requests."""
        for req in plan.decode + plan.admit:
            self._release(req, register=False)
        super().fail(plan, exc)

    # ---- the step (worker thread) ----------------------------------------------------------

    def compute(self, plan: StepPlan) -> tuple[list[int], list[float]]:
        """Decode the running rows, prefill the joining ones, sample every row."""
        runner, size = self.paged, self.paged.page_size
        with torch.inference_mode():
            if self._table:
                rows, cols, pages = zip(*self._table, strict=True)
                index = torch.tensor([rows, cols], dtype=torch.int64).to(runner.device)
                value = torch.tensor(pages, dtype=torch.int32).to(runner.device)
                runner.block_table[index[0], index[1]] = value
                self._table = []
            logits = []
            if plan.decode:
                pos = [r.kv_len for r in plan.decode]
                logits.append(
                    runner.decode(
                        [r.output_ids[-1] for r in plan.decode],  # sampled, not yet fed
                        pos,
                        [
                            r.pages[p // size] * size + p % size
                            for r, p in zip(plan.decode, pos, strict=True)
                        ],
                        [r.row for r in plan.decode],
                    )
                )
            if plan.admit:
                seqs = [r.prompt + r.output_ids for r in plan.admit]
                logits.append(
                    runner.prefill(
                        [r.row for r in plan.admit],
                        [r.kv_len for r in plan.admit],
                        seqs,
                        [r.pages for r in plan.admit],
                    )
                )
            reqs = plan.decode + plan.admit
            temps = [r.params.temperature for r in reqs]
            floats = torch.tensor(
                [[1.0 / t if t > 0 else 1.0 for t in temps], [float(t <= 0) for t in temps]],
                dtype=torch.float32,
            ).to(runner.device)
            keys = torch.tensor(
                [row_key(r.seed, len(r.output_ids)) for r in reqs], dtype=torch.int64
            ).to(runner.device)
            top_k = top_p = None
            if any(r.params.truncates for r in reqs):
                top_k = torch.tensor([r.params.top_k for r in reqs], device=runner.device)
                top_p = torch.tensor(
                    [r.params.top_p for r in reqs], dtype=torch.float32, device=runner.device
                )
            all_logits = logits[0] if len(logits) == 1 else torch.cat(logits)
            tokens, logprobs = sample(all_logits, floats[0], floats[1].bool(), keys, top_k, top_p)
            for req in plan.decode:
                req.kv_len += 1
            for req, seq in zip(plan.admit, seqs if plan.admit else [], strict=True):
                req.kv_len = len(seq)
            out = torch.stack([tokens.double(), logprobs.double()]).tolist()
            return [int(t) for t in out[0]], out[1]


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
    max_model_len: int,
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
        prefix_cache: reuse cached prefixes across requests and turns.
        max_batch_size: most sequences decoded together.
        max_model_len: longest sequence.
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
    )
    batcher = PagedBatcher(
        runner,
        rng,
        prefix_cache=prefix_cache,
        max_batch_size=max_batch_size,
        max_model_len=max_model_len,
        **kwargs,
    )
    return runner, batcher
