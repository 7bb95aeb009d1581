"""Mixture-of-Experts layers on the paged engine: the learner's router math and grouped experts.

A Qwen3-MoE decoder layer runs here as the dense layer's half before attention
(:func:`~agentrl.kernels.fused_layer.layer_pre`, with its paged KV write), paged attention, then
the learner's ``attention_out`` (output projection, residual, post-attention norm), :func:`route`
and the learner's :func:`~agentrl.kernels.moe.moe_mlp` (tokens sorted by expert, one grouped
matmul for gate + up and one for down on CUDA in bf16, the weighted float32 combine).

- **Same numerics as the learner.** :func:`route` is transformers' ``*TopKRouter`` forward with
  its matmul inputs in the compute dtype, where the learner's ``torch.autocast`` casts them
  (float32 softmax, top-k, renormalised as the model says); the experts are ``moe_mlp`` itself
  over ``compute_dtype`` copies of the stacked expert weights (the learner casts the same
  weights to the same dtype at each call).
- **No host synchronisation**, so a decode step (or a prefill bucket) with expert layers is
  captured as a CUDA graph like a dense one, on CUDA in bf16 (``grouped_mm``). Elsewhere the
  experts loop on the host (:func:`~agentrl.kernels.moe.grouped_linear`): no graphs there
  (:func:`graphs_unavailable`).
- **Routing records without hooks.** Every forward writes the experts each token chose into
  :class:`RoutingSlots`, a buffer indexed like the KV cache (one int16 row per KV slot and
  expert layer): a token's routing lives where its keys do, so a reused prefix has its rows and
  a run of graph-replayed decode steps leaves every step's rows behind. The batcher reads the
  rows of requests that asked after each step (:meth:`RoutingSlots.rows`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from agentrl.kernels.moe import _GROUPED_MM, is_sparse, moe_mlp
from agentrl.kernels.packed_body import attention_out

__all__ = ["RoutingSlots", "attention_out", "graphs_unavailable", "moe_post", "route"]


def route(
    h: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``*TopKRouter``'s choice for ``h``: ``(weights, experts)``, each ``(N, top_k)``.

    ``weight`` is the router's in the compute dtype: its logits are what the router computes
    under the learner's autocast (or without it, in float32).
    """
    logits = F.linear(h.to(weight.dtype), weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), experts


def moe_post(mlp: Any, fused: Any) -> tuple[Any, ...]:
    """The MoE half of a layer's weights, after the attention output's: router and experts.

    ``fused(t)`` gives ``t`` in the compute dtype (refreshed in place on a weight update).
    """
    gate: Any = mlp.gate
    return (
        fused(gate.weight),
        fused(mlp.experts.gate_up_proj),
        fused(mlp.experts.down_proj),
        int(gate.top_k),
        bool(gate.norm_topk_prob),
    )


def moe_block(
    x: torch.Tensor,
    h: torch.Tensor,
    experts_post: tuple[Any, ...],
    routing: RoutingSlots | None,
    layer: int,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Route ``h``, record the choice at ``slots`` (expert layer ``layer``), add the experts."""
    w_router, gate_up, down, top_k, norm_topk_prob = experts_post
    weights, experts = route(h, w_router, top_k, norm_topk_prob)
    if routing is not None:
        routing.buf[layer].index_copy_(0, slots, experts.to(routing.buf.dtype))
    return moe_mlp(x, h, weights, experts, gate_up, down, gate_up.dtype)


def graphs_unavailable(model: Any, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why decode steps with ``model``'s expert layers cannot be CUDA graphs (``None``: they can).

    The grouped matmul runs without the host only on CUDA in bf16; elsewhere the experts'
    loop reads the expert offsets on the host.
    """
    if not any(is_sparse(layer.mlp) for layer in model.base_model.layers):
        return None
    if device.type != "cuda" or dtype != torch.bfloat16 or _GROUPED_MM is None:
        return f"expert layers in {dtype} on {device.type} (grouped_mm needs CUDA and bfloat16)"
    return None


class RoutingSlots:
    """The experts every computed token chose, one int16 row per KV slot and expert layer.

    Args:
        layers: expert layers (routers) of the model.
        top_k: experts per token.
        num_slots: KV slots (pages x page size, the scratch page included).
        device: the KV cache's device.
    """

    def __init__(self, layers: int, top_k: int, num_slots: int, device: torch.device) -> None:
        self.buf = torch.full((layers, num_slots, top_k), -1, dtype=torch.int16, device=device)

    @classmethod
    def of(cls, model: Any, num_slots: int, device: torch.device) -> RoutingSlots | None:
        """The buffer for ``model``'s expert layers (``None`` for a dense model)."""
        sparse = [layer.mlp for layer in model.base_model.layers if is_sparse(layer.mlp)]
        return cls(len(sparse), int(sparse[0].gate.top_k), num_slots, device) if sparse else None

    def layer(self, i: int) -> torch.Tensor:
        """Expert layer ``i``'s rows ``(num_slots, top_k)`` (written in place by a forward)."""
        return self.buf[i]

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of ``slots`` (a CPU int64 vector) on the host: ``(n, layers, top_k)``."""
        picked = self.buf.index_select(1, slots.to(self.buf.device, non_blocking=True))
        return picked.transpose(0, 1).cpu()


def slots_of(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """KV slots of positions ``[start, end)`` of a sequence on ``pages``: an int64 vector."""
    pos = torch.arange(start, end)
    table = torch.tensor(pages, dtype=torch.int64)
    return table[pos // page_size] * page_size + pos % page_size
