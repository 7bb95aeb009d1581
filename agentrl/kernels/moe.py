"""Mixture-of-Experts MLPs for the packed body: the model's router, then grouped expert matmuls.

A Qwen3-MoE sparse block is a router (``mlp.gate``, a transformers ``*TopKRouter`` returning
``(logits, weights, indices)``) and experts stored as two stacked weights, ``gate_up_proj``
``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``. :class:`~agentrl.kernels.packed_body.PackedBody`
runs such a layer in three parts:

* the attention half of the layer and the post-attention norm (compiled like a dense layer);
* the **router module itself**, called eagerly, so forward hooks on it keep working:
  :class:`agentrl.routing.RoutingCapture` records what it chose and
  :class:`agentrl.routing.RoutingReplay` replaces its choice; it stays outside checkpointed
  regions, so a recomputation in the backward never calls it (and its hooks) a second time;
* :func:`moe_mlp`: the experts as **grouped matmuls** over the token copies sorted by expert
  (one ``grouped_mm`` for gate + up, one for down, on CUDA in bf16), then the weighted combine
  and the residual add. No Python loop over experts and no host synchronisation on that path;
  elsewhere (CPU, float32) :func:`grouped_linear` loops over the experts with ``F.linear``, the
  op transformers' eager experts use, so float32 results equal theirs to rounding.

Sorting and un-sorting are permutation gathers whose backward is the inverse gather
(:class:`_Dispatch`, :class:`_Permute`, :class:`_Combine`): no scatter-add with atomics, so the
backward is deterministic. Each copy is scaled by its router weight before the down projection
(linear, so the same sum; the multiply fuses into SwiGLU). The combine, and the dispatch's
backward, add each token's ``top_k`` rows in float32 as ``top_k`` gathers (one pointwise kernel
compiled, rather than a gather and then a reduction over a length-``top_k`` axis).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.kernels.recompute import recompute_selectively

__all__ = ["grouped_linear", "is_sparse", "moe_mlp", "moe_unsupported_reason", "selective_moe_mlp"]

_GROUPED_MM: Any = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def is_sparse(mlp: nn.Module) -> bool:
    """Whether a decoder layer's ``mlp`` is a routed sparse block (router + experts)."""
    return hasattr(mlp, "gate") and hasattr(mlp, "experts")


def moe_unsupported_reason(model: nn.Module) -> str | None:
    """Why the packed body cannot run ``model``'s sparse blocks, or ``None`` when it can."""
    for layer in getattr(model.base_model, "layers", []):
        mlp = layer.mlp
        if not is_sparse(mlp):
            continue
        if any(hasattr(mlp, n) for n in ("shared_expert", "shared_experts")):
            return "a shared expert"
        experts = mlp.experts
        for flag, bad in (("has_bias", True), ("is_transposed", True), ("has_gate", False)):
            if getattr(experts, flag, not bad) == bad:
                return f"experts with {flag}={bad}"
        if not getattr(experts, "is_concatenated", True):
            return "interleaved gate/up expert weights"
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            return f"experts without stacked gate_up_proj/down_proj ({type(experts).__name__})"
        if not type(mlp.gate).__name__.endswith("TopKRouter"):
            return f"router {type(mlp.gate).__name__} (expected a *TopKRouter)"
    return None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``F.linear(x[rows of e], weight[e])`` for every expert ``e``, rows grouped by expert.

    Args:
        x: ``(S, K)`` rows sorted by expert.
        weight: ``(E, N, K)`` one weight per expert, in ``F.linear``'s layout.
        offsets: ``(E,)`` int32, the end of each expert's rows (the last is ``S``).

    On CUDA in bf16 one ``grouped_mm`` does all experts (no host sync); elsewhere a loop over
    the experts that have rows (reads ``offsets`` on the host).
    """
    if x.is_cuda and x.dtype == torch.bfloat16 and _GROUPED_MM is not None:
        out = _GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)
        assert isinstance(out, torch.Tensor)
        return out
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    parts = [
        F.linear(x[a:b], weight[e])
        for e, (a, b) in enumerate(zip(starts, ends, strict=True))
        if b > a
    ]
    return torch.cat(parts)


def _gather_sum(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``sum_j y[index[:, j]]`` in float32, ``(n, H)`` for ``index`` ``(n, k)``.

    Written as ``k`` gathers added in order (not a gather then a reduction over a length-``k``
    axis): compiled, it is one pointwise kernel with ``k`` row loads per output element.
    """
    out = y[index[:, 0]].float()
    for j in range(1, index.shape[1]):
        out = out + y[index[:, j]].float()
    return out


class _Dispatch(torch.autograd.Function):
    """``h[perm // k]``: each token's ``k`` copies, in sorted order; backward by the inverse."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor, k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return h[perm // k]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (inverse,) = ctx.saved_tensors
        # each token's k copies (rows inverse[t * k + j]) summed: no scatter-add
        per_token = _gather_sum(grad, inverse.view(-1, ctx.k))
        return per_token.to(grad.dtype), None, None, None


class _Permute(torch.autograd.Function):
    """``y[index]`` for a permutation ``index``; backward by its inverse, ``inverse_index``."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, index: torch.Tensor, inverse_index: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse_index)
        return y[index]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (inverse_index,) = ctx.saved_tensors
        return grad[inverse_index], None, None


class _Combine(torch.autograd.Function):
    """Each token's ``k`` sorted rows summed in float32, ``(n, H)``; backward gathers by token."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, inverse: torch.Tensor, perm: torch.Tensor, k: int
    ) -> torch.Tensor:
        ctx.save_for_backward(perm)
        ctx.k, ctx.dtype = k, y.dtype
        return _gather_sum(y, inverse.view(-1, k))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (perm,) = ctx.saved_tensors
        return grad[perm // ctx.k].to(ctx.dtype), None, None, None


def moe_mlp(
    x: torch.Tensor,
    h: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``x`` plus the routed experts' SwiGLU MLPs of ``h``, weighted: one sparse block.

    Args:
        x: ``(N, H)`` the residual stream.
        h: ``(N, H)`` the post-attention-norm hidden states the router saw.
        weights: ``(N, k)`` the router's weights of the chosen experts (carry its gradient).
        experts: ``(N, k)`` the chosen experts' ids.
        gate_up: ``(E, 2I, H)`` the experts' stacked gate and up projections.
        down: ``(E, H, I)`` the experts' down projections.
        dtype: the matmuls' input dtype (autocast's, under autocast; the weights' otherwise).
    """
    n, k = experts.shape
    num_experts = gate_up.shape[0]
    flat = experts.reshape(-1)
    sorted_ids, perm = torch.sort(flat, stable=True)  # expert-major, token order within
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds).to(torch.int32)  # end of each expert
    inverse = torch.empty_like(perm).scatter_(
        0, perm, torch.arange(perm.numel(), device=perm.device)
    )
    rows = _Dispatch.apply(h.to(dtype), perm, inverse, k)  # (N * k, H)
    gate, up = grouped_linear(rows, gate_up.to(dtype), offsets).chunk(2, dim=-1)
    # the router's weight scales each copy before the (linear) down projection, so the multiply
    # fuses into SwiGLU over I columns instead of a pass over H columns after the matmul;
    # (N * k, 1) in sorted order: a gather by ``perm`` whose backward gathers by ``inverse``
    scale = _Permute.apply(weights.reshape(-1, 1).to(dtype), perm, inverse)
    out = grouped_linear(F.silu(gate) * up * scale, down.to(dtype), offsets)  # (N * k, H)
    mixed = _Combine.apply(out, inverse, perm, k)  # (N, H) float32
    return x + mixed.to(x.dtype)


def selective_moe_mlp(*args: Any) -> Any:
    """:func:`moe_mlp` keeping only the grouped matmuls' outputs for the backward."""
    return recompute_selectively(moe_mlp, *args)
