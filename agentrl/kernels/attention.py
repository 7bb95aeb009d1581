"""Packed (varlen) causal attention with grouped-query heads: Triton forward and backward kernels.

The learner packs several sequences into one row: ``q`` is ``(total, Hq, D)``, ``k`` and ``v`` are
``(total, Hkv, D)`` with ``Hq % Hkv == 0``, and ``cu`` (int32, ``(num_seqs + 1,)``) holds the
cumulative sequence offsets, ``cu[0] == 0`` and ``cu[-1] == total``. Attention is causal inside
each sequence and never crosses sequences. :func:`varlen_attention` is the entry point.

Operators (``torch.library``; ``torch.compile`` sees each as one opaque node):

* ``torch.ops.agentrl.varlen_attn_fwd`` (the Python object :data:`varlen_attn_fwd`):
  ``(q, k, v, cu, max_len, scale) -> (out, lse)``, ``lse`` float32 ``(Hq, total)``, the natural
  log of each query row's softmax normaliser. It carries the autograd formula, so it is the
  unit that a selective-recompute policy keeps (its outputs are all the backward needs besides
  the inputs).
* ``torch.ops.agentrl.varlen_attn_bwd`` (:data:`varlen_attn_bwd`):
  ``(dout, q, k, v, out, lse, cu, max_len, scale) -> (dq, dk, dv)``.

Kernels (FlashAttention-2's algorithm; the code is this project's own):

* **forward**: one program per (Q tile, query head, sequence), grid
  ``(cdiv(max_len, BLOCK_M), Hq, num_seqs)``. The Q-tile axis is the fastest and runs in reverse,
  so the programs of one sequence and head group, which share K/V tiles in L2, run side by side
  and the longest (most causal work) tile of each starts first. Programs past the end of a short
  sequence return at once. Online softmax in fp32 with ``exp2`` and ``scale * log2(e)``; the K/V
  tiles strictly below the diagonal run unmasked, only the diagonal tiles are masked (the causal
  mask also covers the sequence tail for real rows; rows past the tail are never stored).
* **backward, dQ** (runs first): one program per (Q tile, query head, sequence), same grid and
  order as the forward. It also computes ``delta = rowsum(dO * O)`` for its rows and stores it
  (fp32), so no separate preprocessing pass reads dO and O. P is recomputed from q, k and lse.
* **backward, dK/dV**: one program per (K/V tile, KV head, sequence), grid
  ``(cdiv(max_len, BLOCK_N), Hkv, num_seqs)``, tiles in natural order (tile 0 has the most work).
  It loops over the ``Hq // Hkv`` query heads of its group and over the Q tiles from the diagonal
  to the sequence end, accumulating dK and dV in fp32 registers: no atomics, no fp32 scratch, no
  reduction over the head group afterwards, and the result is deterministic.

Splitting dQ from dK/dV recomputes ``QK^T`` and ``dO V^T`` once more (7 matmul passes instead of
5) but needs no atomic adds into an fp32 dQ buffer (FlashAttention-2's way: about
``BLOCK_M * D * 4`` bytes of atomics per tile pair, a conversion pass, and run-to-run rounding
differences).

Block sizes: :data:`CONFIG` holds one :class:`KernelConfig` (or ``None``) per kernel. ``None``
means a small ``triton.autotune`` over Hopper-minded configs keyed on the head dimension, the
group size and a power-of-two bucket of ``max_len`` on a GPU, and a fixed tiny config under the
Triton interpreter (``TRITON_INTERPRET=1``), where autotuning never runs.

Measured once on an H100 (Qwen3-0.6B heads 16/8/128, bf16, 15,325 tokens in 9 sequences of
850-2,497): forward 0.333 ms (345 TFLOP/s causal), backward 1.10 ms (262 TFLOP/s counted as 2.5x
the forward), against torch's FlashAttention-2 at 0.461 ms and 1.465 ms on the same card.

Supported: head dims 16, 32, 64 and 128; float16, bfloat16 and float32 (float32 dots use IEEE
precision); CUDA tensors, or CPU tensors under the interpreter. Triton is imported at the top of
this module: import it only where Triton is installed (CUDA machines).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton

from agentrl.kernels._attention_kernels import _attn_bwd_dkdv, _attn_bwd_dq, _attn_fwd

__all__ = [
    "CONFIG",
    "KernelConfig",
    "varlen_attention",
    "varlen_attn_bwd",
    "varlen_attn_fwd",
]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = math.log2(math.e)
_MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters of one kernel.

    ``block_m`` is the query tile and ``block_n`` the key/value tile. The forward and dQ kernels
    need ``block_m % block_n == 0``; the dK/dV kernel needs ``block_n % block_m == 0``. Both are
    powers of two, at least 16.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# Per kernel ("fwd", "dq", "dkdv"): a fixed config, or None for the default (autotune on a GPU,
# a tiny fixed config under the interpreter). Tests and benchmarks may assign entries.
CONFIG: dict[str, KernelConfig | None] = {"fwd": None, "dq": None, "dkdv": None}

_INTERPRET_CONFIG = {
    "fwd": KernelConfig(16, 16, 1, 1),
    "dq": KernelConfig(16, 16, 1, 1),
    "dkdv": KernelConfig(16, 16, 1, 1),
}


# ----------------------------------------------------------------------------------------------
# Autotuning (GPU only)
# ----------------------------------------------------------------------------------------------


def _configs(shapes: list[tuple[int, int, int, int]]) -> list[Any]:
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in shapes
    ]


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Autotune filter: drops configs whose tiles are longer than the sequences."""
    bucket = kwargs.get("len_bucket", named_args.get("len_bucket", 1 << 30))
    short = [c for c in configs if max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) <= bucket]
    return short or configs[:1]


_KEY = ["HEAD_DIM", "GROUP", "len_bucket"]
# (BLOCK_M, BLOCK_N, num_warps, num_stages). The first of each list was the fastest on an H100
# for Qwen3-0.6B's heads (16/8/128, bf16, ~15k tokens in sequences of 850-2,500).
_FWD_SHAPES = [
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 32, 8, 3),
    (64, 32, 4, 3),
    (64, 64, 4, 3),
    (128, 128, 8, 2),
]
_DQ_SHAPES = [
    (64, 32, 4, 3),
    (64, 32, 4, 4),
    (128, 32, 8, 4),
    (128, 64, 8, 2),
    (64, 64, 4, 3),
]
_DKDV_SHAPES = [
    (32, 64, 4, 2),
    (32, 64, 4, 3),
    (16, 64, 4, 3),
    (64, 64, 4, 3),
    (32, 128, 8, 2),
]

_fwd_tuned: Any = None
_dq_tuned: Any = None
_dkdv_tuned: Any = None
if not INTERPRET:
    _fwd_tuned = triton.autotune(
        _configs(_FWD_SHAPES),
        key=_KEY,
        prune_configs_by={"early_config_prune": _prune},
    )(_attn_fwd)
    _dq_tuned = triton.autotune(
        _configs(_DQ_SHAPES),
        key=_KEY,
        prune_configs_by={"early_config_prune": _prune},
    )(_attn_bwd_dq)
    _dkdv_tuned = triton.autotune(
        _configs(_DKDV_SHAPES),
        key=_KEY,
        prune_configs_by={"early_config_prune": _prune},
    )(_attn_bwd_dkdv)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _outer(name: str) -> str:
    """The tile that the grid's first axis counts: K/V tiles for dK/dV, Q tiles otherwise."""
    return "BLOCK_N" if name == "dkdv" else "BLOCK_M"


def _config(name: str) -> KernelConfig | None:
    cfg = CONFIG.get(name)
    if cfg is None and INTERPRET:
        cfg = _INTERPRET_CONFIG[name]
    if cfg is not None:
        outer, inner = (cfg.block_n, cfg.block_m) if name == "dkdv" else (cfg.block_m, cfg.block_n)
        pow2 = all(b >= 16 and b & (b - 1) == 0 for b in (outer, inner))
        if not pow2 or outer % inner:
            raise ValueError(f"CONFIG[{name!r}] = {cfg}: bad tile shape for this kernel")
    return cfg


def _launch(
    name: str,
    kernel: Any,
    tuned: Any,
    max_len: int,
    grid_rest: tuple[int, int],
    args: tuple[Any, ...],
    constexprs: dict[str, Any],
) -> None:
    """Runs ``kernel`` with the fixed config of ``name``, or ``tuned`` (its autotuned twin)."""
    cfg = _config(name)
    if cfg is None:
        outer = _outer(name)
        tuned[lambda meta: (cdiv(max_len, meta[outer]), *grid_rest)](*args, **constexprs)
        return
    tile = cfg.block_n if name == "dkdv" else cfg.block_m
    kernel[(cdiv(max_len, tile), *grid_rest)](
        *args,
        **constexprs,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _len_bucket(max_len: int) -> int:
    return 1 << max(4, (max_len - 1).bit_length())


def _device_guard(t: torch.Tensor) -> Any:
    return torch.cuda.device(t.device) if t.is_cuda else _NullContext()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> None:
    """Raises ValueError for inputs the kernels don't take (metadata only, never syncs)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            "q, k, v: expected (total, heads, head_dim) tensors, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)}: token counts or head dims differ"
        )
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {d} not supported (expected one of {SUPPORTED_HEAD_DIMS})")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}: expected one of "
            "float16, bfloat16, float32, the same for all three"
        )
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"cu: expected a 1-D int32 tensor of num_seqs + 1 >= 2 offsets, got {cu.dtype} "
            f"of shape {tuple(cu.shape)}"
        )
    if cu.numel() - 1 > _MAX_GRID_YZ:
        raise ValueError(f"at most {_MAX_GRID_YZ} sequences per call, got {cu.numel() - 1}")
    if not (q.device == k.device == v.device == cu.device):
        raise ValueError("q, k, v and cu must be on one device")
    if not q.is_cuda and not INTERPRET:
        raise ValueError("varlen_attention runs on CUDA tensors (CPU only with TRITON_INTERPRET=1)")
    if max_len < 1:
        raise ValueError(f"max_len must be a positive sequence length, got {max_len}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")


def _check_offsets(cu: torch.Tensor, total: int, max_len: int) -> None:
    """Raises ValueError unless ``cu`` starts at 0, ends at ``total`` and never decreases.

    Reads ``cu`` on the host: one device synchronisation.
    """
    offsets = cu.tolist()
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    if offsets[0] != 0 or offsets[-1] != total or min(lengths) < 0:
        raise ValueError(
            f"cu must rise from 0 to the token count {total}, got {offsets[:4]}...{offsets[-1]}"
        )
    if max(lengths) > max_len:
        raise ValueError(f"max_len {max_len} is shorter than a sequence ({max(lengths)} tokens)")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    total, hq, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((hq, total), dtype=torch.float32, device=q.device)
    if total == 0:
        return out, lse
    num_seqs = cu.numel() - 1
    args = (
        q, k, v, out, lse, cu, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), _len_bucket(max_len),
    )  # fmt: skip
    constexprs = {"GROUP": hq // k.shape[1], "HEAD_DIM": d, "PRECISION": _precision(q.dtype)}
    with _device_guard(q):
        _launch(
            "fwd",
            _attn_fwd,
            _fwd_tuned,
            max_len,
            (hq, num_seqs),
            args,
            constexprs,
        )
    return out, lse


def _backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout, q, k, v = dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous()
    out, lse = out.contiguous(), lse.contiguous()
    total, hq, d = q.shape
    hkv = k.shape[1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if total == 0:
        return dq, dk, dv
    num_seqs = cu.numel() - 1
    delta = torch.empty_like(lse)
    qk_scale = scale * _LOG2E
    bucket = _len_bucket(max_len)
    constexprs = {"GROUP": hq // hkv, "HEAD_DIM": d, "PRECISION": _precision(q.dtype)}
    dq_args = (
        q, k, v, out, dout, dq, lse, delta, cu, qk_scale, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        lse.stride(0), bucket,
    )  # fmt: skip
    dkdv_args = (
        q, k, v, dout, dk, dv, lse, delta, cu, qk_scale, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        lse.stride(0), bucket,
    )  # fmt: skip
    with _device_guard(q):
        # dQ first: it also writes delta, which the dK/dV kernel reads.
        _launch(
            "dq",
            _attn_bwd_dq,
            _dq_tuned,
            max_len,
            (hq, num_seqs),
            dq_args,
            constexprs,
        )
        _launch(
            "dkdv",
            _attn_bwd_dkdv,
            _dkdv_tuned,
            max_len,
            (hkv, num_seqs),
            dkdv_args,
            constexprs,
        )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("agentrl::varlen_attn_fwd", mutates_args=())
def varlen_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal varlen attention forward: ``(out, lse)``, ``lse`` float32 ``(Hq, total)``.

    Args:
        q: Queries, ``(total, Hq, D)``.
        k: Keys, ``(total, Hkv, D)``.
        v: Values, ``(total, Hkv, D)``.
        cu: Cumulative sequence offsets, int32 ``(num_seqs + 1,)``.
        max_len: The longest sequence's length (an upper bound suffices).
        scale: Softmax scale applied to ``q @ k^T``.

    Returns:
        The attention output (q's dtype and shape) and the natural-log softmax normaliser.
    """
    _check_shapes(q, k, v, cu, max_len, scale)
    return _forward(q, k, v, cu, max_len, scale)


@varlen_attn_fwd.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("agentrl::varlen_attn_bwd", mutates_args=())
def varlen_attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of causal varlen attention, given the forward's out and lse.

    Args:
        dout: Upstream gradient of ``out``, ``(total, Hq, D)``.
        q: Queries of the forward.
        k: Keys of the forward.
        v: Values of the forward.
        out: The forward's output.
        lse: The forward's float32 ``(Hq, total)`` log-normaliser.
        cu: Cumulative sequence offsets, int32.
        max_len: The forward's ``max_len``.
        scale: The forward's softmax scale.

    Returns:
        ``dq``, ``dk`` and ``dv``, in the dtypes and shapes of q, k and v.
    """
    _check_shapes(q, k, v, cu, max_len, scale)
    if dout.shape != q.shape or out.shape != q.shape or lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError("dout, out or lse shape does not match q")
    return _backward(dout.to(q.dtype), q, k, v, out, lse, cu, max_len, scale)


@varlen_attn_bwd.register_fake
def _(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fmt = torch.contiguous_format
    return (
        torch.empty_like(q, memory_format=fmt),
        torch.empty_like(k, memory_format=fmt),
        torch.empty_like(v, memory_format=fmt),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    q, k, v, cu, max_len, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu)
    ctx.max_len = max_len
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _backward_formula(
    ctx: Any, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    q, k, v, out, lse, cu = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None
    dq, dk, dv = varlen_attn_bwd(grad_out, q, k, v, out, lse, cu, ctx.max_len, ctx.scale)
    return dq, dk, dv, None, None, None


varlen_attn_fwd.register_autograd(_backward_formula, setup_context=_setup_context)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
    *,
    check_offsets: bool = True,
) -> torch.Tensor:
    """Causal attention over the packed sequences that ``cu`` delimits, with GQA.

    Differentiable with respect to ``q``, ``k`` and ``v`` (through :data:`varlen_attn_fwd`).

    Args:
        q: Queries, ``(total, Hq, D)``, float16/bfloat16/float32, D in 16, 32, 64, 128.
        k: Keys, ``(total, Hkv, D)`` with ``Hq % Hkv == 0``, q's dtype.
        v: Values, k's shape, q's dtype.
        cu: Cumulative sequence offsets, int32 ``(num_seqs + 1,)``, from 0 to ``total``.
        max_len: Length of the longest sequence (an upper bound suffices; it sets the grid).
        scale: Softmax scale, usually ``D ** -0.5``.
        check_offsets: Also check ``cu``'s values (0 first, ``total`` last, non-decreasing,
            no sequence longer than ``max_len``). That reads ``cu`` on the host, one device
            synchronisation; it is skipped while ``torch.compile`` traces.

    Returns:
        The attention output, ``(total, Hq, D)`` in q's dtype.

    Raises:
        ValueError: On shapes, dtypes, devices, head dims or offsets the kernels don't take.
    """
    _check_shapes(q, k, v, cu, max_len, scale)
    if check_offsets and not torch.compiler.is_compiling():
        _check_offsets(cu, q.shape[0], max_len)
    out, _ = varlen_attn_fwd(q, k, v, cu, max_len, scale)
    return out
