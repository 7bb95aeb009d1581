"""Selective activation recomputation: keep what matmuls and attention computed, redo the rest.

Under :func:`recompute_selectively` a function's forward saves, for the backward, only the
outputs of matmuls (dense and grouped) and of attention kernels; norms, rotary embeddings,
activations, casts (autocast's bf16 copies of the weights among them) and gathers are
recomputed in the backward: about a third less activation memory for a few percent of time.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["recompute_selectively", "selective_context"]


def _saved_ops() -> set[Any]:
    """Operators whose outputs selective recomputation keeps: matmuls and attention."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    if hasattr(aten, "_grouped_mm"):
        ops.add(aten._grouped_mm.default)
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        ops.add(getattr(aten, name).default)
    if torch.cuda.is_available():
        importlib.import_module("torch.nn.attention.varlen")  # registers the torch_attn ops
        ops.add(torch.ops.torch_attn._varlen_attn.default)
        if importlib.util.find_spec("triton") is not None:
            importlib.import_module("agentrl.kernels.attention")  # registers agentrl's ops
            ops.add(torch.ops.agentrl.varlen_attn_fwd.default)
    return ops


_SAVED_OPS: set[Any] = set()


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if not _SAVED_OPS:
        _SAVED_OPS.update(_saved_ops())
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """The ``context_fn`` of :func:`torch.utils.checkpoint.checkpoint` for this policy."""
    return create_selective_checkpoint_contexts(_keep_matmuls)


def recompute_selectively(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, keeping only matmul and attention outputs for the backward."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=selective_context)
