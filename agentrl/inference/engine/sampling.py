"""Vectorised sampling for the paged engine: one pass over the logits, no per-row Python.

Gumbel-max: a row samples ``argmax(logits / T + g)`` with ``g = -log(-log(u))`` and ``u`` uniform
noise drawn from a counter-based hash of ``(row key, token id)``. A row's key mixes its
request's seed with the index of the token being sampled, so a seeded request draws the same
tokens whatever else shares the batch, without any RNG state on the device (which is also what
lets a CUDA graph or a fused kernel draw it). Unseeded requests get a random seed at submission.

The returned log-prob follows SGLang's convention, ``log_softmax(logits / T)`` over the full
vocabulary (``T == 0``: greedy, ``argmax``, plain ``log_softmax``), not renormalised by
top-k/top-p. ``logits * (1 / T)`` is computed as the learner's head does (float32 ``1 / T``).

- CUDA without truncation: one Triton program per (row, 8k-token chunk of the vocabulary): online
  log-sum-exp, noise and argmax in one read; a second small kernel merges a row's chunks. (One
  program per row took ~0.25 ms whatever the batch, about a tenth of a decode step.)
- Otherwise (CPU, or some row truncates with top-k/top-p): the same math in torch ops.
"""

from __future__ import annotations

import torch

from agentrl.kernels.paged_attention import HAS_TRITON

_M32 = 0xFFFFFFFF


def _mix_int(x: int) -> int:
    """A 32-bit integer finaliser (lowbias32) on a Python int."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_key(seed: int, step: int) -> int:
    """The noise key of the ``step``-th token of a request seeded with ``seed`` (32 bits)."""
    return _mix_int(_mix_int(seed) ^ _mix_int((seed >> 32) + 0x9E3779B9 * (step + 1)))


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """:func:`row_key` of int64 tensors ``seeds`` and ``steps``, elementwise (no per-row Python).

    Products wrap in int64 but keep their low 32 bits, which is all the masked mix reads.
    """
    hi = ((seeds >> 32) + 0x9E3779B9 * (steps + 1)) & _M32
    return _mix_tensor(_mix_tensor(seeds & _M32) ^ _mix_tensor(hi))


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix_int` on an int64 tensor of 32-bit values (products wrap, then are masked)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(B, vocab)`` float32 Gumbel noise of the rows' ``keys`` (torch reference)."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    x = _mix_tensor(keys[:, None] ^ _mix_tensor(idx)[None, :])
    u = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def _truncate(lp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k / top-p set of log-probs ``lp``."""
    vocab = lp.shape[-1]
    sorted_lp, order = lp.sort(dim=-1, descending=True)
    probs = sorted_lp.exp()
    ranks = torch.arange(vocab, device=lp.device)
    k = torch.where(top_k > 0, top_k, vocab)
    # top-p keeps tokens until the mass *before* them exceeds p, so the first always stays.
    remove = (ranks[None, :] >= k[:, None]) | ((probs.cumsum(-1) - probs) > top_p[:, None])
    sorted_lp = sorted_lp.masked_fill(remove, float("-inf"))
    return torch.full_like(lp, float("-inf")).scatter(1, order, sorted_lp)


def sample_reference(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    greedy: torch.Tensor,
    keys: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(B,)`` and their log-probs ``(B,)`` in torch ops; see the module docstring."""
    z = logits.float() * inv_t[:, None]
    lse = torch.logsumexp(z, dim=-1)
    scores = z
    if top_k is not None and top_p is not None:
        scores = _truncate(z - lse[:, None], top_k, top_p)
    scores = torch.where(greedy[:, None], z, scores + gumbel_noise(keys, z.shape[1]))
    tokens = scores.argmax(dim=-1)
    return tokens, z.gather(1, tokens[:, None])[:, 0] - lse


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _mix(x):  # int64 holding 32-bit values, as _mix_tensor
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _sample_split_kernel(
        L, stride_l, INV_T, GREEDY, KEY, PART, V, CHUNK: tl.constexpr, BLOCK: tl.constexpr
    ):
        # one (row, vocabulary chunk): its max, sum of exp, best noisy score, its index and z
        r = tl.program_id(0)
        c = tl.program_id(1)
        inv_t = tl.load(INV_T + r)
        noisy = 1.0 - tl.load(GREEDY + r).to(tl.float32)
        key = tl.load(KEY + r).to(tl.int64)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.zeros([], tl.int64)
        best_z = tl.zeros([], tl.float32)
        for start in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            inb = idx < V
            z = tl.load(L + r * stride_l + idx, mask=inb, other=float("-inf")) * inv_t
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe), axis=0)
            m = m_new
            x = _mix(key ^ _mix(idx.to(tl.int64)))
            u = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = tl.where(inb, z - tl.log(-tl.log(u)) * noisy, float("-inf"))
            bv = tl.max(score, axis=0)
            bi = tl.argmax(score, axis=0)
            if bv > best:
                best = bv
                best_i = (start + bi).to(tl.int64)
                best_z = tl.sum(tl.where(idx == start + bi, z, 0.0), axis=0)
        out = PART + (r * tl.num_programs(1) + c) * 5
        tl.store(out, m)
        tl.store(out + 1, s)
        tl.store(out + 2, best)
        tl.store(out + 3, best_i.to(tl.float32))  # < 2**24: exact in float32
        tl.store(out + 4, best_z)

    @triton.jit
    def _sample_merge_kernel(PART, TOK, LP, NSPLIT, SPLITS: tl.constexpr):
        # the row's chunks: log-sum-exp over all, the best score's token (first on ties)
        r = tl.program_id(0)
        c = tl.arange(0, SPLITS)
        ok = c < NSPLIT
        base = PART + (r * NSPLIT + c) * 5
        m = tl.load(base, mask=ok, other=float("-inf"))
        s = tl.load(base + 1, mask=ok, other=0.0)
        best = tl.load(base + 2, mask=ok, other=float("-inf"))
        mm = tl.max(m, axis=0)
        lse = mm + tl.log(tl.sum(s * tl.exp(m - mm), axis=0))
        j = tl.argmax(best, axis=0)
        tok = tl.sum(tl.where(c == j, tl.load(base + 3, mask=ok, other=0.0), 0.0), axis=0)
        z = tl.sum(tl.where(c == j, tl.load(base + 4, mask=ok, other=0.0), 0.0), axis=0)
        tl.store(TOK + r, tok.to(tl.int64))
        tl.store(LP + r, z - lse)


SAMPLE_CHUNK = 8192
"""Vocabulary entries per program of the CUDA sampler (rows are split so a step is short)."""


def sample(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    greedy: torch.Tensor,
    keys: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` ``(B, V)``; returns ``(tokens, logprobs)``.

    Args:
        logits: ``(B, V)`` next-token logits (float32).
        inv_t: ``(B,)`` float32 ``1 / T`` (1 for greedy rows).
        greedy: ``(B,)`` bool, ``T == 0``: take the argmax.
        keys: ``(B,)`` int64 noise keys (:func:`row_key`).
        top_k: ``(B,)`` int64, -1 for the whole vocabulary; ``None``: no row truncates.
        top_p: ``(B,)`` float32; given together with ``top_k``.
    """
    if logits.is_cuda and HAS_TRITON and top_k is None:
        b, vocab = logits.shape
        tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
        logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
        logits = logits.float()
        splits = triton.cdiv(vocab, SAMPLE_CHUNK)
        part = torch.empty(b, splits, 5, dtype=torch.float32, device=logits.device)
        _sample_split_kernel[(b, splits)](
            logits, logits.stride(0), inv_t, greedy, keys, part, vocab,
            CHUNK=SAMPLE_CHUNK, BLOCK=2048,
        )  # fmt: skip
        splits_p2 = triton.next_power_of_2(splits)
        _sample_merge_kernel[(b,)](part, tokens, logprobs, splits, SPLITS=splits_p2)
        return tokens, logprobs
    return sample_reference(logits, inv_t, greedy, keys, top_k, top_p)
