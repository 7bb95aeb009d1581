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
from agentrl.inference.paged_runner import PagedRunner
from agentrl.inference.sampling import row_key, sample


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
