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
- Elsewhere: a plain torch reference (gather each sequence's keys, ``sdpa`` with a causal offset
  mask), used by the CPU tests of the paged engine.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
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
        stride_lse,
        G: tl.constexpr,
        D: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        HAS_LSE: tl.constexpr,
    ):
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
        for start in range(0, end, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            kin = kpos < end
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
            Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=valid[:, None],
        )
        if HAS_LSE:  # natural-log normaliser per (head, token), for a backward pass
            lse = (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) * 0.6931471805599453
            tl.store(Lse + head * stride_lse + tok, lse, mask=valid)


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
    if q.is_cuda and HAS_TRITON:
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[1]
        grid = (blocks.row.shape[0], k_cache.shape[1])
        _paged_attn_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            out if lse is None else lse,
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
            out.stride(0),
            out.stride(1),
            block_table.stride(0),
            0 if lse is None else lse.stride(0),
            G=group,
            D=q.shape[2],
            PAGE=page_size,
            BLOCK_M=blocks.block_m,
            BLOCK_N=64,
            IEEE=q.dtype == torch.float32,
            HAS_LSE=lse is not None,
            num_warps=4,
        )
        return out
    return _reference(q, k_cache, v_cache, block_table, blocks, q_pos, page_size, scale)


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
