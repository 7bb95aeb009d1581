"""Causal attention of packed query tokens over a paged KV cache (prefill and decode alike).

The query tokens of several sequences are packed, ``q`` ``(N, Hq, D)``; sequence ``r``'s keys
and values sit in the pages ``block_table[r]`` of the cache (``(slots, Hkv, D)``, slot =
``page * page_size + offset``), and include the query tokens' own (written before the call). A
query token at position ``p`` attends to its sequence's keys ``0..p``. Work is cut into *query
blocks* (``QueryBlocks``): each covers up to ``tokens_per_block`` consecutive query tokens of one
sequence; decode has one block of one token per sequence.

- CUDA: one Triton program per (query block, KV head). The ``Hq // Hkv`` query heads that share a
  KV head are stacked into the rows of one tile, so each key block is read once per group;
  online softmax in float32 (FlashAttention's algorithm), keys gathered page by page.
- Decode with few rows (``QueryBlocks.splits`` > 1, flash-decoding): a third grid dimension cuts
  each row's keys into ``splits`` ranges; each program writes its range's normalised output and
  base-2 log-sum-exp to float32 scratch, and a second kernel combines them. Why: the tail of a
  batch of long agent episodes decodes 1-8 rows of ~10k-token contexts; with Qwen3-0.6B's 8 KV
  heads that is 8-64 programs, each scanning the whole context alone, on a card of 132 SMs
  (H200). :func:`decode_splits` picks ``splits`` on the host from the row count alone (a decode
  step is a CUDA graph replayed at every context length), the kernel cuts the ranges from the
  row's positions. Checked under Triton's interpreter only: the paged engine keeps one split
  until a card has run ``tests/test_paged_attention_split.py`` and the long-history A/B.
- Elsewhere: a plain torch reference (gather each sequence's keys, ``sdpa`` with a causal offset
  mask), used by the CPU tests of the paged engine.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass
class QueryBlocks:
    """Where each query block's tokens are: ``row`` (block-table row), first token, count."""

    row: torch.Tensor  # (nb,) int64 row of block_table
    tok: torch.Tensor  # (nb,) int64 index of the first query token in q
    n: torch.Tensor  # (nb,) int64 query tokens in the block
    block_m: int  # tile rows: tokens_per_block * group, at least 16
    splits: int = 1  # key ranges per block (flash-decoding; 1: one program scans all keys)

    @classmethod
    def decode(cls, rows: torch.Tensor, block_m: int, splits: int = 1) -> QueryBlocks:
        """Decode's blocks: one block of one token per row (token ``i`` is ``rows[i]``'s)."""
        arange = torch.arange(rows.shape[0], device=rows.device)
        return cls(rows, arange, torch.ones_like(arange), block_m, splits)


MAX_SPLITS = 16
"""Most key ranges per decode row (a heuristic cap: more ranges add scratch traffic and short
programs for little gain once the card is full)."""


def decode_splits(
    rows: int, kv_heads: int, device: torch.device | str, sms: int | None = None
) -> int:
    """Key ranges per decode row so that ``rows * kv_heads * splits`` is about twice the SMs.

    1 off CUDA and when ``rows * kv_heads`` programs already fill the card; at most
    :data:`MAX_SPLITS`. ``sms``: the device's SM count (default: asked of the device).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    if sms is None:
        sms = _sm_count(torch.cuda.current_device() if device.index is None else device.index)
    programs = max(1, rows * kv_heads)
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, 2 * sms // programs))


@lru_cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def tile_rows(group: int, tokens: int) -> int:
    """Rows of the query tile for ``tokens`` tokens per block (a power of two, >= 16)."""
    return max(16, 1 << (group * tokens - 1).bit_length())


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_attn_kernel(
        Q,
        K,
        V,
        Out,
        Lse,
        BT,
        QB_ROW,
        QB_TOK,
        QB_N,
        QPOS,
        qk_scale,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_ot,
        stride_oh,
        stride_bt,
        stride_lt,
        stride_lh,
        G: tl.constexpr,
        D: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        HAS_LSE: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        # program (block, KV head[, split]); SPLIT: Out and Lse are the float32 scratch
        # (N, Hq, splits, D) and (N, Hq, splits) that _combine_kernel reads
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.load(QB_ROW + b)
        tok0 = tl.load(QB_TOK + b)
        n = tl.load(QB_N + b)
        m = tl.arange(0, BLOCK_M)
        t = m // G
        head = kvh * G + m % G
        valid = t < n
        tok = tok0 + t
        pos = tl.load(QPOS + tok, mask=valid, other=-1)
        d = tl.arange(0, D)
        q = tl.load(
            Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        end = tl.max(pos, axis=0) + 1
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        lo = 0
        hi = end
        split = 0
        if SPLIT:  # keys [lo, hi): this split's whole key blocks, cut from the row's own length
            split = tl.program_id(2)
            chunk = tl.cdiv(tl.cdiv(end, tl.num_programs(2)), BLOCK_N) * BLOCK_N
            lo = split * chunk
            hi = tl.minimum(end, lo + chunk)
        for start in range(lo, hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            kin = kpos < hi
            page = tl.load(BT + row * stride_bt + kpos // PAGE, mask=kin, other=0)
            slot = page.to(tl.int64) * PAGE + kpos % PAGE
            offs = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
            k = tl.load(K + offs, mask=kin[:, None], other=0.0)
            v = tl.load(V + offs, mask=kin[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale
            s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + split * D + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=valid[:, None],
        )
        lse_at = Lse + tok * stride_lt + head * stride_lh + split
        if SPLIT:  # base-2 log-sum-exp of the scaled scores; -inf: no key in the range
            lse2 = m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))
            tl.store(lse_at, tl.where(l_i == 0.0, float("-inf"), lse2), mask=valid)
        elif HAS_LSE:  # natural-log normaliser per (head, token), for a backward pass
            lse = (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453
            tl.store(lse_at, lse, mask=valid)

    @triton.jit
    def _combine_kernel(
        Part,
        PLse,
        Out,
        stride_ot,
        stride_oh,
        SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        D: tl.constexpr,
    ):
        """Program (token, query head): merge the ``SPLITS`` partial outputs into ``Out``.

        Split ``s`` holds ``o_s = sum_j 2^(x_j - m_s) v_j / l_s`` over its keys (``x``: scores
        times ``log2 e``) and ``L_s = m_s + log2 l_s`` (-inf when empty). With ``M = max_s L_s``
        and ``w_s = 2^(L_s - M)``: ``out = sum_s w_s o_s / sum_s w_s``, the softmax over all
        keys (``w_s`` is split ``s``'s share of the normaliser, rescaled by ``2^-M``).
        """
        t = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        ok = s < SPLITS
        base = (t * tl.num_programs(1) + h) * SPLITS  # scratch rows of (t, h): contiguous
        lse = tl.load(PLse + base + s, mask=ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
        d = tl.arange(0, D)
        part = tl.load(Part + (base + s)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        den = tl.sum(w, axis=0)
        out = tl.sum(w[:, None] * part, axis=0) / tl.where(den == 0.0, 1.0, den)
        tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    blocks: QueryBlocks,
    q_pos: torch.Tensor,
    *,
    page_size: int,
    scale: float,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``(N, Hq, D)`` in ``q``'s dtype; see the module docstring.

    Args:
        q: ``(N, Hq, D)`` packed query tokens.
        k_cache: ``(slots, Hkv, D)`` one layer's keys (the query tokens' own already written).
        v_cache: the same for values.
        block_table: ``(rows, max_pages)`` page ids per sequence.
        blocks: the query blocks.
        q_pos: ``(N,)`` position of each query token in its sequence.
        page_size: tokens per page.
        scale: softmax scale (``head_dim ** -0.5``).
        lse: CUDA only: a float32 ``(Hq, N)`` buffer that receives each query's natural-log
            softmax normaliser (what a backward pass needs).
    """
    if lse is not None and blocks.splits > 1:
        raise ValueError("paged_attention: lse needs splits=1 (it is a decode-only option)")
    if q.is_cuda and HAS_TRITON:
        return _launch(q, k_cache, v_cache, block_table, blocks, q_pos, page_size, scale, lse)
    return _reference(q, k_cache, v_cache, block_table, blocks, q_pos, page_size, scale)


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    blocks: QueryBlocks,
    q_pos: torch.Tensor,
    page_size: int,
    scale: float,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernels on any device Triton runs on (the CPU too, under its interpreter)."""
    out = torch.empty_like(q)
    splits = blocks.splits
    hq, d = q.shape[1], q.shape[2]
    grid: tuple[int, ...] = (blocks.row.shape[0], k_cache.shape[1])
    dest, lse_out = out, lse
    if splits > 1:  # scratch: under CUDA graph capture it comes from the graph's pool
        grid = (*grid, splits)
        dest = torch.empty(q.shape[0], hq, splits, d, dtype=torch.float32, device=q.device)
        lse_out = torch.empty(q.shape[0], hq, splits, dtype=torch.float32, device=q.device)
    # lse strides (token, head): the caller's (Hq, N) buffer, or the (N, Hq, splits) scratch
    if lse_out is None:
        lse_strides = (0, 0)
    elif splits > 1:
        lse_strides = (lse_out.stride(0), lse_out.stride(1))
    else:
        lse_strides = (lse_out.stride(1), lse_out.stride(0))
    _paged_attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        dest,
        dest if lse_out is None else lse_out,
        block_table,
        blocks.row,
        blocks.tok,
        blocks.n,
        q_pos,
        scale * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        dest.stride(0),
        dest.stride(1),
        block_table.stride(0),
        *lse_strides,
        G=hq // k_cache.shape[1],
        D=d,
        PAGE=page_size,
        BLOCK_M=blocks.block_m,
        BLOCK_N=64,
        IEEE=q.dtype == torch.float32,
        HAS_LSE=lse is not None,
        SPLIT=splits > 1,
        num_warps=4,
    )
    if splits > 1:
        assert lse_out is not None
        _combine_kernel[(q.shape[0], hq)](
            dest,
            lse_out,
            out,
            out.stride(0),
            out.stride(1),
            SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            D=d,
            num_warps=1,
        )
    return out


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    blocks: QueryBlocks,
    q_pos: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for row, tok, n in zip(
        blocks.row.tolist(), blocks.tok.tolist(), blocks.n.tolist(), strict=True
    ):
        if n == 0:  # a padded block (a prefill graph's bucket): no query token
            continue
        pos = q_pos[tok : tok + n]
        end = int(pos.max()) + 1
        kpos = torch.arange(end, device=q.device)
        slots = block_table[row, kpos // page_size].long() * page_size + kpos % page_size
        k, v = k_cache[slots], v_cache[slots]  # (end, Hkv, D)
        mask = kpos[None, :] <= pos[:, None]  # (n, end)
        o: Any = F.scaled_dot_product_attention(
            q[tok : tok + n].transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[tok : tok + n] = o.transpose(0, 1)
    return out
