"""Triton kernels of :mod:`agentrl.kernels.attention` (its docstring describes them).

FlashAttention-2's algorithm for packed causal attention with grouped-query heads: the forward
(``_attn_fwd``), and the backward as a dQ kernel (``_attn_bwd_dq``, which also computes
``delta = rowsum(dO * O)``) and a dK/dV kernel (``_attn_bwd_dkdv``, looping over its KV head's
query-head group). Launch, autotuning and the torch operators live in the public module.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fwd_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    offs_m,
    offs_n,
    lo,
    hi,
    seq_len,
    stride_kt,
    stride_vt,
    qk_scale,
    BLOCK_N: tl.constexpr,
    DIAGONAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Online softmax over the K/V tiles [lo, hi); DIAGONAL tiles get the causal and tail masks.
    for start_n in range(lo, hi, BLOCK_N):
        if DIAGONAL:
            col_ok = (start_n + offs_n) < seq_len
            k_t = tl.load(k_ptrs + start_n * stride_kt, mask=col_ok[None, :], other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vt, mask=col_ok[:, None], other=0.0)
        else:
            k_t = tl.load(k_ptrs + start_n * stride_kt)
            v = tl.load(v_ptrs + start_n * stride_vt)
        qk = tl.dot(q, k_t, input_precision=PRECISION)
        if DIAGONAL:
            causal = offs_m[:, None] >= (start_n + offs_n)[None, :]
            qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    Out,
    LSE,
    CU,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    len_bucket,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # len_bucket only keys the autotuner.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_start = tl.load(CU + seq)
    seq_len = tl.load(CU + seq + 1) - seq_start
    start_m = m_block * BLOCK_M
    if start_m >= seq_len:
        return
    seq_start = seq_start.to(tl.int64)
    kv_head = head // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len

    q_base = Q + seq_start * stride_qt + head * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None])
    k_ptrs = K + seq_start * stride_kt + kv_head * stride_kh
    k_ptrs += offs_n[None, :] * stride_kt + offs_d[:, None]
    v_ptrs = V + seq_start * stride_vt + kv_head * stride_vh
    v_ptrs += offs_n[:, None] * stride_vt + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Tiles strictly below the diagonal (BLOCK_M % BLOCK_N == 0): no mask.
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, 0, start_m, seq_len,
        stride_kt, stride_vt, qk_scale, BLOCK_N, False, PRECISION,
    )  # fmt: skip
    diag_end = tl.minimum(start_m + BLOCK_M, seq_len)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, start_m, diag_end, seq_len,
        stride_kt, stride_vt, qk_scale, BLOCK_N, True, PRECISION,
    )  # fmt: skip

    acc = acc / l_i[:, None]
    o_base = Out + seq_start * stride_ot + head * stride_oh
    o_ptrs = o_base + offs_m[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # log2 -> natural log
    tl.store(LSE + head * stride_lh + seq_start + offs_m, lse, mask=row_ok)


@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse2,
    delta,
    k_ptrs,
    v_ptrs,
    offs_m,
    offs_n,
    lo,
    hi,
    seq_len,
    stride_kt,
    stride_vt,
    qk_scale,
    BLOCK_N: tl.constexpr,
    DIAGONAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # dQ += dS K over the K/V tiles [lo, hi), P recomputed from q, k and lse (log2 domain).
    for start_n in range(lo, hi, BLOCK_N):
        if DIAGONAL:
            col_ok = (start_n + offs_n) < seq_len
            k_t = tl.load(k_ptrs + start_n * stride_kt, mask=col_ok[None, :], other=0.0)
            v_t = tl.load(v_ptrs + start_n * stride_vt, mask=col_ok[None, :], other=0.0)
        else:
            k_t = tl.load(k_ptrs + start_n * stride_kt)
            v_t = tl.load(v_ptrs + start_n * stride_vt)
        qk = tl.dot(q, k_t, input_precision=PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if DIAGONAL:
            causal = offs_m[:, None] >= (start_n + offs_n)[None, :]
            p = tl.where(causal, p, 0.0)
        dp = tl.dot(do, v_t, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    Out,
    DO,
    DQ,
    LSE,
    DELTA,
    CU,
    qk_scale,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lh,
    len_bucket,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Also stores delta = rowsum(dO * O) (fp32) for the dK/dV kernel that runs next.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_start = tl.load(CU + seq)
    seq_len = tl.load(CU + seq + 1) - seq_start
    start_m = m_block * BLOCK_M
    if start_m >= seq_len:
        return
    seq_start = seq_start.to(tl.int64)
    kv_head = head // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len

    q_base = Q + seq_start * stride_qt + head * stride_qh
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None])
    do_base = DO + seq_start * stride_dot + head * stride_doh
    do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None])
    o_base = Out + seq_start * stride_ot + head * stride_oh
    o = tl.load(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], mask=row_ok[:, None])
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    row_off = head * stride_lh + seq_start + offs_m
    tl.store(DELTA + row_off, delta, mask=row_ok)
    lse2 = tl.load(LSE + row_off, mask=row_ok, other=0.0) * 1.4426950408889634

    k_ptrs = K + seq_start * stride_kt + kv_head * stride_kh
    k_ptrs += offs_n[None, :] * stride_kt + offs_d[:, None]
    v_ptrs = V + seq_start * stride_vt + kv_head * stride_vh
    v_ptrs += offs_n[None, :] * stride_vt + offs_d[:, None]

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_ptrs, v_ptrs, offs_m, offs_n, 0, start_m, seq_len,
        stride_kt, stride_vt, qk_scale, BLOCK_N, False, PRECISION,
    )  # fmt: skip
    diag_end = tl.minimum(start_m + BLOCK_M, seq_len)
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_ptrs, v_ptrs, offs_m, offs_n, start_m, diag_end, seq_len,
        stride_kt, stride_vt, qk_scale, BLOCK_N, True, PRECISION,
    )  # fmt: skip

    dq_base = DQ + seq_start * stride_dqt + head * stride_dqh
    dq_ptrs = dq_base + offs_m[:, None] * stride_dqt + offs_d[None, :]
    tl.store(dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    q_ptrs,
    do_ptrs,
    lse_ptrs,
    delta_ptrs,
    offs_m,
    offs_n,
    lo,
    hi,
    seq_len,
    stride_qt,
    stride_dot,
    qk_scale,
    BLOCK_M: tl.constexpr,
    DIAGONAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # dV += P^T dO and dK += dS^T Q over the Q tiles [lo, hi) of one query head. Rows past the
    # sequence end load dO = 0 and delta = 0, so they add nothing (lse = +inf also zeroes P).
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < seq_len
        q_t = tl.load(q_ptrs + start_m * stride_qt, mask=row_ok[None, :], other=0.0)
        do = tl.load(do_ptrs + start_m * stride_dot, mask=row_ok[:, None], other=0.0)
        lse2 = tl.load(lse_ptrs + start_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
        delta = tl.load(delta_ptrs + start_m, mask=row_ok, other=0.0)
        qk_t = tl.dot(k, q_t, input_precision=PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        if DIAGONAL:
            p_t = tl.where(rows[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    CU,
    qk_scale,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_lh,
    len_bucket,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    n_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_start = tl.load(CU + seq)
    seq_len = tl.load(CU + seq + 1) - seq_start
    start_n = n_block * BLOCK_N
    if start_n >= seq_len:
        return
    seq_start = seq_start.to(tl.int64)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < seq_len

    k_base = K + seq_start * stride_kt + kv_head * stride_kh
    k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=col_ok[:, None])
    v_base = V + seq_start * stride_vt + kv_head * stride_vh
    v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=col_ok[:, None])

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    diag_end = tl.minimum(start_n + BLOCK_N, seq_len)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q_ptrs = Q + seq_start * stride_qt + head * stride_qh
        q_ptrs += offs_m[None, :] * stride_qt + offs_d[:, None]
        do_ptrs = DO + seq_start * stride_dot + head * stride_doh
        do_ptrs += offs_m[:, None] * stride_dot + offs_d[None, :]
        lse_ptrs = LSE + head * stride_lh + seq_start + offs_m
        delta_ptrs = DELTA + head * stride_lh + seq_start + offs_m
        # The Q tiles that cross this K/V tile's diagonal (BLOCK_N % BLOCK_M == 0), then the rest.
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, offs_m, offs_n, start_n,
            diag_end, seq_len, stride_qt, stride_dot, qk_scale, BLOCK_M, True, PRECISION,
        )  # fmt: skip
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, offs_m, offs_n, diag_end,
            seq_len, seq_len, stride_qt, stride_dot, qk_scale, BLOCK_M, False, PRECISION,
        )  # fmt: skip

    dk_base = DK + seq_start * stride_dkt + kv_head * stride_dkh
    dk_ptrs = dk_base + offs_n[:, None] * stride_dkt + offs_d[None, :]
    tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    dv_base = DV + seq_start * stride_dvt + kv_head * stride_dvh
    dv_ptrs = dv_base + offs_n[:, None] * stride_dvt + offs_d[None, :]
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])
