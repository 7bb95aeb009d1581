"""Matrix products with float32 results from low-precision inputs (the log-prob head's).

Shared by the learner's head and the embedded engine's, so both round the same way.
"""

from __future__ import annotations

import torch

_MM_OUT_DTYPE: bool | None = None  # does this torch/device have mm(..., out_dtype=float32)?


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as float32: inputs in their own dtype, float32 accumulation and output.

    Low-precision inputs go through ``torch.mm(..., out_dtype=torch.float32)`` where the backend
    has it (CUDA), so the logits are not rounded to bf16 on the way out; elsewhere the inputs are
    upcast first (same result, float32 speed).
    """
    global _MM_OUT_DTYPE
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if _MM_OUT_DTYPE is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
            return out
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE = False
    return a.float() @ b.float()


def addmm32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into float32 ``acc``; low-precision ``a``, ``b`` accumulate in float32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _MM_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += mm32(a, b)
