"""Triton kernels for the log-prob head's two passes over a chunk of float32 logits.

The head (:mod:`agentrl.learner.logprobs`) is memory-bound around its matmuls: a 1,024-token
chunk of a
152k vocabulary is 622 MB of float32 logits, read once in the forward (log-sum-exp and the
target's logit) and once in the backward (the softmax gradient, written in bf16).

* :func:`logprob_lse` reads each row once with an online log-sum-exp (a running max and a sum
  rescaled when the max grows), where the compiled ``torch.logsumexp`` reads it twice.
* :func:`dlogits` tiles rows and vocabulary in 2-D blocks, so no element pays an integer
  division to find its row (the compiled pointwise kernel of dynamic shape does).

Both need CUDA and Triton: :func:`available` says whether they can run here; the head falls back
to ``torch.compile``d code otherwise. Same results as
:func:`agentrl.learner.logprobs._logprob_lse` and
``_dlogits`` to float32 rounding.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["available", "dlogits", "logprob_lse"]


_TRITON = importlib.util.find_spec("triton") is not None


def available(t: torch.Tensor) -> bool:
    """Whether these kernels can run on ``t``'s device (CUDA, with Triton installed)."""
    return _TRITON and t.is_cuda


def _kernels() -> tuple[object, object]:
    import triton
    import triton.language as tl

    @triton.jit
    def lse_kernel(
        logits, targets, out, lse, stride, inv_t, vocab: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        scale = inv_t * 1.4426950408889634  # to base 2
        m = tl.full((), -float("inf"), tl.float32)  # running max (base-2 units)
        s = tl.zeros((), tl.float32)  # running sum of 2^(x - m)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=-float("inf")) * scale
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(x - m_new), axis=0)
            m = m_new
        total = (m + tl.log2(s)) / 1.4426950408889634  # natural log
        picked = tl.load(base + tl.load(targets + row)) * inv_t
        tl.store(lse + row, total)
        tl.store(out + row, picked - total)

    @triton.jit
    def grad_kernel(
        logits,
        lse,
        g,
        targets,
        grad,
        stride,
        out_stride,
        inv_t,
        vocab: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < vocab
        x = tl.load(logits + row * stride + cols, mask=keep, other=0.0)
        shift = tl.load(lse + row) * 1.4426950408889634
        p = tl.exp2(x * (inv_t * 1.4426950408889634) - shift)
        onehot = (cols == tl.load(targets + row)).to(tl.float32)
        value = tl.load(g + row) * inv_t * (onehot - p)
        tl.store(grad + row * out_stride + cols, value.to(grad.dtype.element_ty), mask=keep)

    return lse_kernel, grad_kernel


_CACHE: list[tuple[object, object]] = []


def _get() -> tuple[object, object]:
    if not _CACHE:
        _CACHE.append(_kernels())
    return _CACHE[0]


def logprob_lse(
    logits: torch.Tensor, targets: torch.Tensor, inv_t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each row's target and the row's log-sum-exp of ``logits * inv_t``.

    Args:
        logits: ``(c, V)`` float32, rows contiguous.
        targets: ``(c,)`` integer column of each row.
        inv_t: 1 / sampling temperature.

    Returns:
        ``(logprobs, lse)``, each ``(c,)`` float32.
    """
    _check(logits, targets)
    lse_kernel, _ = _get()
    c, vocab = logits.shape
    out = torch.empty(c, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(out)
    if c:
        lse_kernel[(c,)](  # type: ignore[index]
            logits, targets, out, lse, logits.stride(0), inv_t, vocab=vocab, BLOCK=4096, num_warps=8
        )
    return out, lse


def dlogits(
    logits: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    targets: torch.Tensor,
    inv_t: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``g · (onehot(target) - softmax(logits · inv_t)) · inv_t`` per row, in ``dtype``.

    Args:
        logits: ``(c, V)`` float32, rows contiguous.
        lse: ``(c,)`` log-sum-exps from :func:`logprob_lse`.
        g: ``(c,)`` upstream gradient of each row's log-prob.
        targets: ``(c,)`` integer column of each row.
        inv_t: 1 / sampling temperature.
        dtype: the output dtype (what the head matmuls take).

    Returns:
        ``(c, V)`` gradient of the log-probs with respect to the logits.
    """
    _check(logits, targets)
    _, grad_kernel = _get()
    c, vocab = logits.shape
    grad = torch.empty((c, vocab), dtype=dtype, device=logits.device)
    block = 2048
    if c:
        grid = (c, (vocab + block - 1) // block)
        grad_kernel[grid](  # type: ignore[index]
            logits,
            lse.float().contiguous(),
            g.float().contiguous(),
            targets,
            grad,
            logits.stride(0),
            grad.stride(0),
            inv_t,
            vocab=vocab,
            BLOCK=block,
            num_warps=8,
        )
    return grad


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("logits: expected a (c, V) float32 tensor with contiguous rows")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets: expected shape {tuple(logits.shape[:1])}, got {targets.shape}")
