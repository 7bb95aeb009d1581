"""Variable-length causal attention for the packed body: FlashAttention-2 or the Triton kernel.

:func:`varlen_kwargs` finds how this torch's ``torch.nn.attention.varlen.varlen_attn`` takes a
causal mask and shared KV heads; :func:`varlen_attention` attends over the sequences that
cumulative offsets delimit, with FlashAttention-2 or this project's kernel
(:mod:`agentrl.kernels.attention`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["varlen_attention", "varlen_kwargs"]


def varlen_kwargs(num_heads: int, num_kv_heads: int) -> dict[str, Any]:
    """Keyword arguments for this torch's ``varlen_attn``: causal, and KV-head sharing.

    ``repeat`` is 1 when it takes fewer KV heads than query heads as they are (FlashAttention
    shares them itself), else how many times to repeat each KV head.
    """
    from torch.nn.attention.varlen import varlen_attn

    attend: Any = varlen_attn  # its keywords differ between torch versions
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {}
    if not kwargs:
        kwargs["window_size"] = (-1, 0)
    repeat = num_heads // num_kv_heads
    if "enable_gqa" in params:
        kwargs["enable_gqa"], repeat = True, 1
    elif repeat > 1:  # FlashAttention itself shares KV heads; check that this wrapper lets it
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(96, num_heads, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(2, 96, num_kv_heads, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        cu = torch.tensor([0, 40, 96], dtype=torch.int32, device="cuda")
        full = [t.repeat_interleave(repeat, dim=1) for t in kv]
        try:
            native = attend(q, kv[0], kv[1], cu, cu, 56, 56, **kwargs)
            ok = torch.allclose(native, attend(q, *full, cu, cu, 56, 56, **kwargs), atol=1e-2)
        except RuntimeError:
            ok = False
        repeat = 1 if ok else repeat
    kwargs["repeat"] = repeat
    return kwargs


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scale: float,
    options: dict[str, Any],
) -> torch.Tensor:
    """Causal attention over the sequences that ``cu`` (cumulative offsets) delimits.

    FlashAttention-2 (torch's ``varlen_attn``), or this project's Triton kernel where
    ``options`` says ``kernel="triton"`` (:mod:`agentrl.kernels.attention`).
    """
    dtype = v.dtype  # under autocast: the projections' low precision
    q, k = q.to(dtype), k.to(dtype)
    if options.get("kernel") == "triton":
        from agentrl.kernels.attention import varlen_attention as triton_attention

        return triton_attention(q, k, v, cu, max_len, scale, check_offsets=False)
    from torch.nn.attention.varlen import varlen_attn

    attend: Any = varlen_attn  # its keywords differ between torch versions
    kwargs = dict(options)
    repeat = kwargs.pop("repeat")
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = attend(q, k, v, cu, cu, max_len, max_len, scale=scale, **kwargs)
    assert isinstance(out, torch.Tensor)
    return out
