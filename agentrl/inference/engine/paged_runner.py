"""The paged engine's model runner: the learner's layer math over a paged KV cache.

- **Same numerics as the learner.** Each decoder layer repeats :mod:`agentrl.kernels.packed_body`'s
  ops (its RMSNorm and rotary helpers, fused q/k/v and gate/up matmuls, float32 norms) with the
  matmul inputs in ``compute_dtype`` exactly where the learner's ``torch.autocast`` casts them:
  a float32 model with ``compute_dtype=bfloat16`` computes what the learner computes under bf16
  autocast (residual stream in float32), a bf16 model what it computes in bf16. The head is the
  learner's too (``compute_dtype`` inputs, float32 accumulation and logits). Matmul weights are
  kept as fused ``compute_dtype`` copies, refreshed in place by :meth:`refresh_weights`.
- **CUDA graphs.** A decode step (embedding, every layer, KV write, paged attention, head) is
  captured once per batch-size bucket on first use and replayed: static input buffers, one
  (pinned) copy of the step's metadata to the device, one graph launch, which also samples the
  next tokens (:func:`~agentrl.inference.engine.sampling.sample`), so a step reads back ``(2, B)``
  numbers, not the logits. Rows of a bucket past the batch write to the scratch page.
- **Steps without the host.** The captured step ends by advancing its own inputs (the sampled
  token is fed next, at the next position and KV slot, with the next noise key), so
  :meth:`PagedRunner.decode_many` replays it several times from one metadata copy and reads
  the tokens back once: the host's planning, copies and synchronisation are paid once per run
  of steps instead of once per token.
- Prefill runs on the packed new tokens of every joining sequence (cached prefixes are not
  recomputed), keeping each one's last logits; with CUDA graphs, up to ``prefill_graph_tokens``
  tokens replay a graph of their bucket (:mod:`~agentrl.inference.engine.prefill_graphs`).
- **Expert layers** (Qwen3-MoE): :mod:`~agentrl.inference.engine.paged_moe`, routing by KV slot.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from agentrl.inference.engine import paged_moe
from agentrl.inference.engine.kv_cache import PagedKVCache
from agentrl.inference.engine.prefill_graphs import PrefillGraphs, pack_prefill
from agentrl.inference.engine.sampling import row_keys, sample
from agentrl.kernels import compile_guard, invariant
from agentrl.kernels.fused_layer import (
    _rms_norm,
    layer_first,
    layer_last,
    layer_mid,
    layer_post,
    layer_pre,
)
from agentrl.kernels.matmul import mm32
from agentrl.kernels.moe import is_sparse
from agentrl.kernels.packed_body import unsupported_reason
from agentrl.kernels.paged_attention import QueryBlocks, decode_splits, paged_attention, tile_rows
from agentrl.kernels.transfer import to_device

PREFILL_TOKENS_PER_BLOCK = 32
DECODE_META = ("ids", "pos", "slots", "rows", "keys", "inv_t_bits", "greedy", "seeds", "counts")
"""Rows of a decode step's metadata, one int64 column per sequence (one host-to-device copy);
``seeds`` and ``counts`` (tokens sampled so far) let a step derive the next step's keys."""
_ONE_BITS = int(torch.tensor(1.0).view(torch.int32))  # float32 1.0 as int bits (padded rows)
SPLIT_DECODE = False
"""Flash-decoding where a step's rows leave SMs idle (:func:`~agentrl.kernels.paged_attention.
decode_splits`; never in the exact mode), read when a runner is built. Off until measured on a
card: ``benchmarks/engine_throughput.py --split-decode on off``, tests/test_engine_paged.py."""
RUN_CHUNK = 8
"""In a run of decode steps on a GPU the host reads this many steps at a time, a chunk behind."""
RunCut = Callable[[int, list[list[float]]], bool]
"""``cut(step, [tokens, log-probs])``: whether a run of decode steps ends after that step."""


class PagedRunner:
    """Prefill and decode of a supported causal LM over a :class:`PagedKVCache`.

    Args:
        model: a model :func:`~agentrl.kernels.packed_body.unsupported_reason` accepts.
        num_pages: pages of the KV cache (the scratch page included).
        page_size: tokens per page.
        max_batch_size: most sequences decoded together.
        max_model_len: longest sequence (block-table width).
        compute_dtype: dtype of the matmul inputs and the KV cache (default: the parameters').
        cuda_graphs: capture decode steps as CUDA graphs (CUDA only).
        compile: ``torch.compile`` the per-layer functions (fused elementwise kernels).
        emulate_precision_casts: with ``compile``, keep eager's bf16 rounding between fused ops
            (inductor's option; off by default). Off, a fused SwiGLU or q/k norm rounds once where
            the eager learner rounds twice (one CPU layer: 9.7e-3 from the learner's log-probs,
            1e-6 with it on); fused float32 reductions still round differently now and then.
        batch_invariant: the exact mode (:mod:`agentrl.kernels.invariant`): matmuls, norms,
            attention tiles and the sampled tokens' log-probs through batch-invariant kernels,
            so a token's log-prob equals, bit for bit, what the learner's exact mode computes
            for it (CUDA, bf16 or fp16 ``compute_dtype``). Layers run uncompiled.
        fuse_seams: cut the layers at attention (:func:`~agentrl.kernels.fused_layer.layer_mid`:
            one layer's half after attention with the next one's before, KV write included), so
            a compiled layer boundary is no kernel boundary; off: one function per half-layer.
        prefill_graph_tokens: with ``cuda_graphs``, prefills of up to this many tokens replay
            CUDA graphs (0: every prefill runs eagerly).
    """

    def __init__(
        self,
        model: Any,
        *,
        num_pages: int,
        page_size: int,
        max_batch_size: int,
        max_model_len: int,
        compute_dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,
        compile: bool = False,
        emulate_precision_casts: bool = False,
        batch_invariant: bool = False,
        fuse_seams: bool = True,
        prefill_graph_tokens: int = 0,
    ) -> None:
        reason = unsupported_reason(model, moe=True)
        if reason is not None:
            raise ValueError(f"model: the paged engine does not support {reason}")
        self.exact = batch_invariant
        self.split_decode = SPLIT_DECODE and not batch_invariant
        cfg: Any = model.config
        self.model = model
        self.base: Any = model.base_model
        if batch_invariant and any(is_sparse(layer.mlp) for layer in self.base.layers):
            raise ValueError("batch_invariant: dense models only (this one has expert layers)")
        self.device = next(model.parameters()).device
        self.eps = float(cfg.rms_norm_eps)
        hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.sizes = (int(cfg.num_attention_heads), int(cfg.num_key_value_heads), hd)
        self.group = self.sizes[0] // self.sizes[1]
        self.dtype = compute_dtype or self.base.embed_tokens.weight.dtype
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.cache = PagedKVCache(
            num_layers=len(self.base.layers),
            num_kv_heads=self.sizes[1],
            head_dim=hd,
            num_pages=num_pages,
            page_size=page_size,
            dtype=self.dtype,
            device=self.device,
        )
        # one row per sequence slot, plus a scratch row (all scratch page) for padded rows
        max_pages = math.ceil(max_model_len / page_size)
        self.block_table = torch.zeros(
            max_batch_size + 1, max_pages, dtype=torch.int32, device=self.device
        )
        self.scratch_row = max_batch_size
        # MoE: the experts each token in the KV cache chose, by KV slot; no fused seams (an
        # expert layer's half after attention is no dense layer_post)
        self.routing = paged_moe.RoutingSlots.of(model, num_pages * page_size, self.device)
        fuse_seams = fuse_seams and self.routing is None
        self._experts: list[tuple[Any, ...] | None] = []  # expert layers' router and experts
        self._weights: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []
        self._head: torch.Tensor | None = None
        self._refresh: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self.refresh_weights()
        with torch.no_grad():  # the model's own rotary tables, looked up by position
            pos = torch.arange(max_model_len, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.base.embed_tokens.weight.dtype, device=self.device)
            cos, sin = self.base.rotary_emb(probe, pos)
        self.cos, self.sin = cos[0], sin[0]
        self.fuse_seams = fuse_seams
        fns: list[Any] = (
            [layer_first, layer_mid, layer_last] if fuse_seams else [layer_pre, layer_post]
        )
        self.prefill_tokens = PREFILL_TOKENS_PER_BLOCK
        self._tile: Callable[[int], int] = partial(tile_rows, self.group)  # tokens -> tile rows
        if batch_invariant:
            why = invariant.available(self.device)
            if why is None and self.dtype not in (torch.bfloat16, torch.float16):
                why = f"its compute dtype must be bfloat16 or float16, not {self.dtype}"
            if why is not None:
                raise ValueError(f"batch_invariant: {why}")
            rows, self.prefill_tokens = invariant.tiles(self.group)
            self._tile = lambda tokens: rows
            fns = [partial(f, exact=True) for f in fns]
        elif compile:
            options: dict[str, Any] = {"emulate_precision_casts": emulate_precision_casts}
            fns = [compile_guard.compiled(f, dynamic=True, options=options) for f in fns]
        self._fns = fns
        self._attn_out: Callable[..., Any] = paged_moe.attention_out
        if compile and not batch_invariant:
            self._attn_out = compile_guard.compiled(self._attn_out, dynamic=True, options=options)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        off = paged_moe.graphs_unavailable(model, self.dtype, self.device)
        self.graphs_off = off if self.cuda_graphs else None  # why asked-for graphs are off
        self.cuda_graphs = self.cuda_graphs and self.graphs_off is None
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < max_batch_size]
        self.buckets.append(max_batch_size)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._static: torch.Tensor | None = None  # (9, max_batch) int64: DECODE_META
        self._host = self._pad = torch.empty(0, dtype=torch.int64)
        self._seen: torch.Tensor | None = None  # pinned, flat: a run's sampled steps as they land
        # the decode graphs' memory pool (the prefill graphs have their own: prefill_graphs)
        self.graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        graphs = self.cuda_graphs and prefill_graph_tokens > 0
        self._prefill_graphs = PrefillGraphs(self, prefill_graph_tokens) if graphs else None
        if self._prefill_graphs is not None:  # every bucket now, not inside a run's first steps
            self._prefill_graphs.capture_all()

    # ---- weights ---------------------------------------------------------------------------

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """(Re)build the fused ``compute_dtype`` weights from the model's, in place if built.

        After the first build a refresh is one multi-tensor copy of each source into its part of
        the fused tensors (the graphs keep their pointers), not a concatenation and a copy each:
        the in-process weight push is host-bound.
        """
        if self._weights:
            if self._refresh[0]:
                torch._foreach_copy_(*self._refresh)
            return
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (part of a fused tensor, source)

        def fused(*parts: torch.Tensor | int) -> torch.Tensor:
            # parts (an int: that many zero rows) stacked on dim 0 in compute_dtype; the tensor
            # parts that are not the result's own storage are remembered for later refreshes
            full = [
                torch.zeros(p, dtype=self.dtype, device=self.device) if isinstance(p, int) else p
                for p in parts
            ]
            out = full[0].to(self.dtype) if len(full) == 1 else torch.cat(full).to(self.dtype)
            row = 0
            for p, f in zip(parts, full, strict=True):
                if not isinstance(p, int) and out.data_ptr() != p.data_ptr():
                    pairs.append((out[row : row + f.shape[0]], p))
                row += f.shape[0]
            return out

        for layer in self.base.layers:
            att, mlp = layer.self_attn, layer.mlp
            projs = (att.q_proj, att.k_proj, att.v_proj)
            bias = None
            if any(p.bias is not None for p in projs):
                bias = fused(*(p.weight.shape[0] if p.bias is None else p.bias for p in projs))
            q_norm, k_norm = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
            pre = (
                layer.input_layernorm.weight,
                fused(*(p.weight for p in projs)),
                bias,
                None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight,
                self.eps,
                self.sizes,
            )
            post: tuple[Any, ...] = (
                fused(att.o_proj.weight),
                None if att.o_proj.bias is None else fused(att.o_proj.bias),
                layer.post_attention_layernorm.weight,
            )
            sparse = is_sparse(mlp)  # (its post: attention_out's arguments; the experts apart)
            self._experts.append(paged_moe.moe_post(mlp, fused) if sparse else None)
            if not sparse:
                post += (
                    fused(mlp.gate_proj.weight, mlp.up_proj.weight),
                    fused(mlp.down_proj.weight),
                )
            post += (self.eps,)
            self._weights.append((pre, post))
        self._head = fused(self.model.get_output_embeddings().weight)
        self._refresh = ([d for d, _ in pairs], [s for _, s in pairs])

    # ---- forward ---------------------------------------------------------------------------

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        blocks: QueryBlocks,
    ) -> torch.Tensor:
        """Final-norm hidden states ``(N, H)`` of packed tokens; writes their KV at ``slots``."""
        x = torch.nn.functional.embedding(ids, self.base.embed_tokens.weight)
        cos, sin = self.cos[pos], self.sin[pos]
        k, v, w = self.cache.k, self.cache.v, self._weights
        scale = self.sizes[2] ** -0.5

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            return paged_attention(
                q, k[i], v[i], self.block_table, blocks, pos,
                page_size=self.page_size, scale=scale,
            )  # fmt: skip

        if self.fuse_seams:
            first, mid, last = self._fns
            q = first(x, cos, sin, k[0], v[0], slots, w[0][0])
            for i in range(len(w) - 1):
                x, q = mid(
                    x, attend(i, q), cos, sin, k[i + 1], v[i + 1], slots, w[i][1], w[i + 1][0]
                )
            return last(x, attend(len(w) - 1, q), w[-1][1], self.base.norm.weight, self.eps)
        pre_fn, post_fn = self._fns
        routed = 0  # expert layers so far (their routing records)
        for i, (pre, post) in enumerate(w):
            q, kk, vv = pre_fn(x, cos, sin, *pre)
            k[i].index_copy_(0, slots, kk)
            v[i].index_copy_(0, slots, vv)
            if (experts := self._experts[i]) is None:
                x = post_fn(x, attend(i, q), *post)
                continue
            x, h = self._attn_out(x, attend(i, q), *post)
            x = paged_moe.moe_block(x, h, experts, self.routing, routed, slots)
            routed += 1
        norm = invariant.rms_norm if self.exact else _rms_norm
        return norm(x, self.base.norm.weight, self.eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self._head is not None
        h = hidden.to(self._head.dtype)
        if self.exact:
            logits = invariant.matmul(h, self._head, out_dtype=torch.float32)
        else:
            logits = mm32(h, self._head.t())  # (B, V) float32
        bias = self.model.get_output_embeddings().bias
        return logits if bias is None else logits + bias.float()

    def sample(
        self,
        logits: torch.Tensor,
        inv_t: torch.Tensor,
        greedy: torch.Tensor,
        keys: torch.Tensor,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~agentrl.inference.engine.sampling.sample` (exact mode: exact log-probs).

        In the exact mode the log-probs come from
        :func:`~agentrl.kernels.invariant.token_logprobs`, as the learner's do.
        """
        tokens, logprobs = sample(logits, inv_t, greedy, keys, top_k, top_p)
        if self.exact:
            logprobs = invariant.token_logprobs(logits, inv_t, tokens)[0]
        return tokens, logprobs

    def prefill(
        self, rows: list[int], starts: list[int], tokens: list[list[int]], pages: list[list[int]]
    ) -> torch.Tensor:
        """Next-token logits ``(len(rows), V)`` after feeding each ``tokens[i][starts[i]:]``.

        Args:
            rows: each sequence's block-table row (already filled with its pages).
            starts: tokens of each sequence already in the cache (a reused prefix).
            tokens: each sequence's whole token list.
            pages: each sequence's pages.
        """
        columns, qbs, last = pack_prefill(
            rows, starts, tokens, pages, self.page_size, self.prefill_tokens
        )
        graphs = self._prefill_graphs
        t = None if graphs is None else graphs.bucket(columns.shape[1], len(rows))
        if graphs is not None and t is not None:
            hidden = graphs.run(t, graphs.inputs(t, columns, qbs, last))
            return self._logits(hidden[: len(rows)])
        meta, qb = to_device(columns, self.device), to_device(qbs, self.device)
        blocks = QueryBlocks(qb[0], qb[1], qb[2], self._tile(self.prefill_tokens))
        hidden = self._forward(meta[0], meta[1], meta[2], blocks)
        return self._logits(hidden[to_device(last, self.device)])

    def _decode_body(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(n, V)`` and sampled ``(2, n)`` float64 tokens and log-probs of the rows."""
        assert self._static is not None
        ids, pos, slots, rows, keys, inv_t, greedy = self._static[:7, :n]
        splits = decode_splits(n, self.sizes[1], self.device) if self.split_decode else 1
        blocks = QueryBlocks.decode(rows, self._tile(1), splits)
        logits = self._logits(self._forward(ids, pos, slots, blocks))
        inv_t = inv_t.to(torch.int32).view(torch.float32)  # float32 bits, carried as int64
        tokens, logprobs = self.sample(logits, inv_t, greedy.bool(), keys)
        self._advance(n, tokens)
        return logits, torch.stack([tokens.double(), logprobs.double()])

    def _advance(self, n: int, tokens: torch.Tensor) -> None:
        """Make the metadata of the first ``n`` rows the next step's: feed ``tokens``.

        Padded rows (the scratch row) keep theirs. The next slot is looked up in the block
        table, so it is right only where the batcher gave the row its next page.
        """
        assert self._static is not None
        ids, pos, slots, rows, keys, _, _, seeds, counts = self._static[:, :n]
        real = rows != self.scratch_row
        nxt = pos + 1
        col = torch.clamp(nxt // self.page_size, max=self.block_table.shape[1] - 1)
        slot = self.block_table[rows, col].long() * self.page_size + nxt % self.page_size
        fresh = torch.stack([tokens.long(), nxt, slot, row_keys(seeds, counts + 1), counts + 1])
        old = torch.stack([ids, pos, slots, keys, counts])
        new = torch.where(real, fresh, old)
        for i, j in enumerate((0, 1, 2, 4, 8)):
            self._static[j, :n].copy_(new[i])

    def decode(self, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed one token per sequence and sample the next: logits ``(B, V)``, sampled ``(2, B)``.

        Args:
            meta: ``(9, B)`` CPU int64 rows (:data:`DECODE_META`): the fed token, its position,
                its KV slot, the block-table row, the sampling noise key, ``1 / T`` as float32
                bits, the greedy flag, the sampling seed and the count of tokens sampled so
                far. Copied to the device in one transfer; the captured graph samples too.
        """
        n = meta.shape[1]
        if self._static is None:
            self._static = torch.zeros(
                len(DECODE_META), self.max_batch_size, dtype=torch.int64, device=self.device
            )
            self._host = torch.empty(
                self._static.shape, dtype=torch.int64, pin_memory=self.cuda_graphs
            )
            self._pad = torch.tensor(
                [[0], [0], [0], [self.scratch_row], [0], [_ONE_BITS], [1], [0], [0]],
                dtype=torch.int64,
            )
        bucket = next(b for b in self.buckets if b >= n) if self.cuda_graphs else n
        host = self._host[:, :bucket]
        host[:, :n] = meta
        host[:, n:] = self._pad
        self._static[:, :bucket].copy_(host, non_blocking=True)
        if not self.cuda_graphs:
            return self._decode_body(n)
        if bucket not in self._graphs:
            self._capture(bucket)
        graph, logits, sampled = self._graphs[bucket]
        graph.replay()
        return logits[:n], sampled[:, :n]

    def decode_many(
        self,
        meta: torch.Tensor,
        steps: int,
        cut: RunCut | None = None,
        launched: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Up to ``steps`` decode steps from one copy of ``meta``: sampled ``(k, 2, B)`` float64.

        Each step feeds the token the previous one sampled (see :meth:`_advance`); the caller
        must have given every row the pages its next ``steps`` positions need, and no row may
        truncate (top-k/top-p is sampled outside the graph). ``cut(i, sampled)`` sees each
        step's ``[tokens, log-probs]`` in order once they reach the host, and returning
        ``True`` launches no further step. On a GPU the host reads ``RUN_CHUNK`` steps at a
        time while the next chunk runs, so the card never waits for the host inside a run and
        up to ``2 * RUN_CHUNK - 1`` steps run (and are returned) after the one that ended it;
        on a CPU it reads each step before launching the next. ``launched()`` is called once
        the first chunk is launched.
        """
        n = meta.shape[1]
        out = torch.empty(steps, 2, n, dtype=torch.float64, device=self.device)
        cuda = self.device.type == "cuda"
        chunk = RUN_CHUNK if cuda else 1
        seen: torch.Tensor | None = None
        if cut is not None and cuda:
            if self._seen is None or self._seen.numel() < steps * 2 * n:
                size = max(steps, 64) * 2 * self.max_batch_size
                self._seen = torch.empty(size, dtype=torch.float64, pin_memory=True)
            # contiguous: a copy into a strided slice goes through a pageable buffer, a
            # synchronous read on the legacy default stream that stalls every thread's launches
            seen = self._seen[: steps * 2 * n].view(steps, 2, n)
        landed: list[torch.cuda.Event] = []  # one per chunk launched
        read = 0  # steps the host has read
        for i in range(steps):
            # one wake-up per chunk: the learner's thread, host-bound, shares the GIL with this
            # one, and a read per step (a GIL round trip each) slowed its update 3x on an H100
            while cut is not None and i % chunk == 0 and read < i - chunk * cuda:
                if seen is not None:
                    landed[read // chunk].synchronize()  # releases the GIL while it waits
                rows = (seen if seen is not None else out)[read : read + chunk].tolist()
                for k, step in enumerate(rows):
                    if cut(read + k, step):
                        return out[:i]
                read += chunk
            if i == 0:
                sampled = self.decode(meta)[1]
            elif self.cuda_graphs:
                bucket = next(b for b in self.buckets if b >= n)
                self._graphs[bucket][0].replay()
                sampled = self._graphs[bucket][2][:, :n]
            else:
                sampled = self._decode_body(n)[1]
            out[i].copy_(sampled)
            if seen is not None and (i + 1) % chunk == 0:
                seen[i + 1 - chunk : i + 1].copy_(out[i + 1 - chunk : i + 1], non_blocking=True)
                landed.append(torch.cuda.Event())
                landed[-1].record()
            if launched is not None and i == min(chunk, steps) - 1:
                launched()
        return out

    def _capture(self, bucket: int) -> None:
        """Capture the decode step of ``bucket`` rows (after warm-up runs on a side stream)."""
        assert self._static is not None
        saved = self._static[:, :bucket].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # warm-up with every row on the scratch page: no real sequence's cache is written
            self._static[:, :bucket] = self._pad.to(self.device)
            for _ in range(2):
                self._decode_body(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
            logits, sampled = self._decode_body(bucket)
        self._graphs[bucket] = (graph, logits, sampled)
        self._static[:, :bucket] = saved
