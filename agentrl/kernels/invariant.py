"""Batch-invariant kernels: the exact mode, where the engine's log-probs equal the learner's.

A row's result from a cuBLAS matmul, a torch reduction or an attention kernel tuned per shape
depends on the batch around it: tile sizes, split-K and reduction trees are chosen by shape. So
the engine, decoding one token per row over a KV cache, and the learner, scoring whole packed
sequences, round differently, and 28 layers amplify the one-ulp bf16 flips to about 2e-2 in
log-prob on the Qwen3-0.6B shape. Here every reduction runs in one fixed order whatever the
batch, so the same row gives the same bits on both sides:

- :func:`linear`: a Triton matmul with one tile configuration and no split-K (each output
  element sums its ``K`` blocks in order);
- :func:`rms_norm`: the mean of squares by one program per row over the whole row;
- :func:`packed_attention` (learner) and the paged engine: the same paged-attention kernel
  (:mod:`agentrl.kernels.paged_attention`) with one tile height (:data:`TILE_ROWS`): a query
  at position ``p`` folds key blocks ``0, 64, 128, ...`` into its online softmax in order,
  whichever tile it sits in (blocks past ``p`` are fully masked and change nothing);
- :func:`token_logprobs`: ``log_softmax(logits * inv_t)[target]`` by one program per row in
  two passes over fixed vocabulary blocks.

Elementwise ops (residual adds, rotary, SiLU, casts) are per element and need nothing. The
backward passes use the ordinary kernels: only the forward's values have to match. CUDA with
Triton only; low-precision (bf16/fp16) matmul inputs.
"""

from __future__ import annotations

from typing import Any

import torch

from agentrl.kernels.paged_attention import HAS_TRITON, QueryBlocks, paged_attention

__all__ = [
    "TILE_ROWS",
    "tiles",
    "available",
    "linear",
    "matmul",
    "packed_attention",
    "rms_norm",
    "token_logprobs",
]

TILE_ROWS = 64
"""Query-tile height of exact-mode attention (query heads x tokens), engine and learner alike."""
PAGE = 16
"""Tokens per page of the learner's keys in exact-mode attention (addressing only)."""
_MM = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
_LSE_BLOCK = 1024


def available(device: torch.device) -> str | None:
    """Why the exact mode cannot run on ``device``, or ``None`` when it can."""
    if device.type != "cuda":
        return f"it needs a CUDA device (got {device.type})"
    if not HAS_TRITON:
        return "it needs Triton"
    return None


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _mm_kernel(
        A, B, C, Bias, M, N, K,
        stride_am, stride_bn, stride_cm,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # C = A @ B.T: one (BLOCK_M, BLOCK_N) tile, K blocks summed in order, never split
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(
                A + rm[:, None].to(tl.int64) * stride_am + kk[None, :],
                mask=(rm[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                B + rn[None, :].to(tl.int64) * stride_bn + kk[:, None],
                mask=(rn[None, :] < N) & (kk[:, None] < K),
                other=0.0,
            )
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            C + rm[:, None].to(tl.int64) * stride_cm + rn[None, :],
            acc.to(C.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )

    @triton.jit
    def _mean_sq_kernel(X, Out, n, stride, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        x = tl.load(X + r.to(tl.int64) * stride + i, mask=i < n, other=0.0)
        tl.store(Out + r, tl.sum(x * x, axis=0) / n)

    @triton.jit
    def _logprob_kernel(L, INV_T, TGT, LP, LSE, V, stride, BLOCK: tl.constexpr):
        # one row: max, then sum of exp in BLOCK lanes (each lane in vocabulary order)
        r = tl.program_id(0)
        row = L + r.to(tl.int64) * stride
        inv_t = tl.load(INV_T + r)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            m = tl.maximum(m, tl.load(row + idx, mask=idx < V, other=float("-inf")) * inv_t)
        top = tl.max(m, axis=0)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            z = tl.load(row + idx, mask=idx < V, other=float("-inf")) * inv_t
            s += tl.exp(z - top)
        lse = top + tl.log(tl.sum(s, axis=0))
        tl.store(LSE + r, lse)
        tl.store(LP + r, tl.load(row + tl.load(TGT + r)) * inv_t - lse)


def _need_cuda(t: torch.Tensor) -> None:
    reason = available(t.device)
    if reason is not None:
        raise RuntimeError(f"batch-invariant kernels: {reason}")


def matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *, out_dtype: Any = None
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for ``a`` ``(M, K)``, ``b`` ``(N, K)``; float32 accumulation.

    The result of row ``i`` depends on ``a[i]`` and ``b`` only, never on ``M``. The output is
    ``out_dtype`` (default ``a``'s dtype), rounded once from the float32 accumulator.
    """
    _need_cuda(a)
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"matmul: expected two bf16/fp16 inputs, got {a.dtype} and {b.dtype}")
    a, b = a.contiguous(), b.contiguous()
    (m, k), n = a.shape, b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, _MM["BLOCK_M"]), triton.cdiv(n, _MM["BLOCK_N"]))
    _mm_kernel[grid](
        a, b, out, a if bias is None else bias, m, n, k,
        a.stride(0), b.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, **_MM,
    )  # fmt: skip
    return out


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Any:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return matmul(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        grad = grad.to(x.dtype)
        gx = grad @ w if ctx.needs_input_grad[0] else None
        gw = grad.t() @ x if ctx.needs_input_grad[1] else None
        gb = grad.float().sum(0).to(w.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with :func:`matmul`'s batch invariance; differentiable (ordinary backward).

    ``x`` ``(..., K)`` and ``w`` ``(N, K)`` in one low-precision dtype; ``b`` ``(N,)`` or ``None``.
    """
    lead = x.shape[:-1]
    out = _Linear.apply(x.reshape(-1, x.shape[-1]), w, b)
    return out.reshape(*lead, w.shape[0])


class _MeanSq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _need_cuda(x)
        x = x.contiguous()
        rows, n = x.shape
        out = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            block = triton.next_power_of_2(n)
            _mean_sq_kernel[(rows,)](x, out, n, x.stride(0), BLOCK=block, num_warps=4)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad[:, None] * x * (2.0 / x.shape[1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`~agentrl.kernels.packed_body._rms_norm` (transformers' RMSNorm), batch-invariant."""
    x32 = x.float()
    ms = _MeanSq.apply(x32.reshape(-1, x32.shape[-1])).reshape(*x32.shape[:-1], 1)
    return weight * (x32 * torch.rsqrt(ms + eps)).to(x.dtype)


def token_logprobs(
    logits: torch.Tensor, inv_t: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits * inv_t)[target]`` and the log-sum-exp per row (not differentiable).

    Args:
        logits: ``(B, V)`` float32.
        inv_t: ``(B,)`` float32 ``1 / T`` per row.
        targets: ``(B,)`` token ids.
    """
    _need_cuda(logits)
    logits = logits.float().contiguous()
    b, vocab = logits.shape
    lp = torch.empty(b, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(lp)
    if b:
        _logprob_kernel[(b,)](
            logits, inv_t.float().contiguous(), targets.long().contiguous(), lp, lse,
            vocab, logits.stride(0), BLOCK=_LSE_BLOCK, num_warps=4,
        )  # fmt: skip
    return lp, lse


def tiles(group: int) -> tuple[int, int]:
    """``(tile rows, tokens per tile)`` of exact-mode attention, ``group`` q heads per KV head.

    One tile height for prefill, decode and the learner.
    """
    if group > TILE_ROWS:
        raise ValueError(f"exact attention: at most {TILE_ROWS} query heads per KV head")
    return TILE_ROWS, TILE_ROWS // group


_Layout = tuple[torch.Tensor, torch.Tensor, QueryBlocks, torch.Tensor, int]
_layout_cache: dict[tuple[Any, ...], _Layout] = {}


def _paged_layout(lengths: tuple[int, ...], per: int, rows: int, device: torch.device) -> _Layout:
    """Packed sequences laid out as the engine's cache holds them, for every layer of a forward.

    Returns each token's slot and position, the query blocks (``per`` tokens of one sequence
    each), the block table, and the slot count. Sequence ``i`` starts on a page boundary.
    The last layout is kept: the layers of a forward (and its recomputations) share it.
    """
    key = (lengths, per, rows, device)
    if key in _layout_cache:
        return _layout_cache[key]
    first_page, slots, pos = [0], list[int](), list[int]()
    b_row, b_tok, b_n, start = list[int](), list[int](), list[int](), 0
    for i, n in enumerate(lengths):
        slots += range(first_page[-1] * PAGE, first_page[-1] * PAGE + n)
        pos += range(n)
        first_page.append(first_page[-1] - (-n // PAGE))
        for j in range(0, n, per):
            b_row.append(i)
            b_tok.append(start + j)
            b_n.append(min(per, n - j))
        start += n
    width = max((-(-n // PAGE) for n in lengths), default=1)
    table = [[f + j for j in range(width)] for f in first_page[:-1]]
    meta = torch.tensor([b_row, b_tok, b_n], dtype=torch.int64).to(device)
    tokens = torch.tensor([slots, pos], dtype=torch.int64).to(device)
    bt = torch.tensor(table, dtype=torch.int32).to(device)
    layout = (tokens[0], tokens[1], QueryBlocks(meta[0], meta[1], meta[2], rows), bt,
              first_page[-1] * PAGE)  # fmt: skip
    _layout_cache.clear()
    _layout_cache[key] = layout
    return layout


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu: torch.Tensor,
        lengths: list[int],
        scale: float,
    ) -> torch.Tensor:
        _need_cuda(q)
        rows, per = tiles(q.shape[1] // k.shape[1])
        slots, pos, blocks, bt, n_slots = _paged_layout(tuple(lengths), per, rows, q.device)
        shape = (n_slots, *k.shape[1:])
        kp = k.new_zeros(shape).index_copy_(0, slots, k)
        vp = v.new_zeros(shape).index_copy_(0, slots, v)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        out = paged_attention(q, kp, vp, bt, blocks, pos, page_size=PAGE, scale=scale, lse=lse)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_len, ctx.scale = max(lengths, default=1), scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        from agentrl.kernels.attention import varlen_attn_bwd

        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = varlen_attn_bwd(grad, q, k, v, out, lse, cu, ctx.max_len, ctx.scale)
        return dq, dk, dv, None, None, None


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    lengths: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed sequences through the engine's exact-mode attention kernel.

    ``q`` ``(N, Hq, D)``, ``k``/``v`` ``(N, Hkv, D)`` in one low-precision dtype; ``cu`` the
    int32 cumulative offsets of ``lengths``. Differentiable (the backward is the Triton varlen
    kernels' of :mod:`agentrl.kernels.attention`).
    """
    out = _PackedAttention.apply(q, k, v, cu, lengths, scale)
    assert isinstance(out, torch.Tensor)
    return out
