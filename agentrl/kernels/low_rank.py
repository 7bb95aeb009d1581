"""LoRA terms for the packed body: ``scaling * B(A(dropout(x)))`` beside a projection.

The learner's adapters (:mod:`agentrl.learner.lora`) live on the transformers modules as
``lora_A`` and ``lora_B`` with ``scaling`` and ``dropout``; :func:`layer_adapters` reads a
decoder layer's off them (as the packed body reads the weights) and :func:`low_rank` is the term
both bodies add, so the transformers forward and the packed body compute the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["LayerLora", "Lora", "layer_adapters", "low_rank", "plus_each", "plus_low_rank"]

# one projection's adapter: (A, B, scaling, dropout p)
Lora = tuple[torch.Tensor, torch.Tensor, float, float]
# a layer's: ((q, k, v), (o, gate, up, down)), each an adapter or None (MoE layers: (o,))
LayerLora = tuple[tuple[Lora | None, ...], tuple[Lora | None, ...]]


def low_rank(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
    p: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """A LoRA term ``scaling * B(A(dropout_p(x)))`` in ``out_dtype``, as peft computes it."""
    if p:
        x = F.dropout(x, p, True)
    return (F.linear(F.linear(x.to(a.dtype), a), b) * scaling).to(out_dtype)


def plus_low_rank(y: torch.Tensor, x: torch.Tensor, lora: Lora | None) -> torch.Tensor:
    """``y`` (a projection of ``x``) plus its adapter's term, if it has one."""
    return y if lora is None else y + low_rank(x, *lora, y.dtype)


def plus_each(
    ys: tuple[torch.Tensor, ...], x: torch.Tensor, loras: tuple[Lora | None, ...] | None
) -> tuple[torch.Tensor, ...]:
    """:func:`plus_low_rank` on each projection ``ys`` of ``x`` (``loras``: ``None``, none)."""
    if loras is None:
        return ys
    return tuple(plus_low_rank(y, x, lora) for y, lora in zip(ys, loras, strict=True))


def _one(module: Any, train: bool) -> Lora | None:
    a = getattr(module, "lora_A", None)
    if a is None:
        return None
    p = float(module.dropout) if train else 0.0
    return (a.weight, module.lora_B.weight, float(module.scaling), p)


def layer_adapters(layer: Any, sparse: bool, train: bool) -> LayerLora | None:
    """A decoder layer's adapters, or ``None`` when it has none.

    Args:
        layer: a transformers decoder layer (``self_attn``, ``mlp``).
        sparse: an MoE layer (its experts take no adapters; attention's do).
        train: dropout applies (the model is in training mode).
    """
    att, mlp = layer.self_attn, layer.mlp
    pre = tuple(_one(m, train) for m in (att.q_proj, att.k_proj, att.v_proj))
    post: tuple[Lora | None, ...] = (_one(att.o_proj, train),)
    if not sparse:
        post += tuple(_one(m, train) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    if all(t is None for t in pre + post):
        return None
    return pre, post
