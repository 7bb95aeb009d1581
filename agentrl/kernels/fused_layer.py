"""A decoder layer's two halves around attention, over pre-fused low-precision weights.

The paged engine's layer (and, in the exact mode, the learner's too): the math of
:mod:`agentrl.kernels.packed_body`'s ``_pre_attention`` / ``_post_attention`` with the q/k/v and
gate/up weights concatenated and cast to the compute dtype once, and the matmul inputs cast
exactly where the learner's ``torch.autocast`` casts them (residual stream and norms in float32).
``exact=True`` runs the matmuls and norms through :mod:`agentrl.kernels.invariant`'s
batch-invariant kernels.

The engine cuts its layers at attention, not between layers: :func:`layer_first` (layer 0's
half before attention), :func:`layer_mid` (layer ``i``'s half after attention, then layer
``i + 1``'s before) and :func:`layer_last` (the last layer's half after, then the final norm),
each writing the new keys and values into the paged cache itself. Compiled, one function is
one fused graph: the residual add meets the next layer's norm and the cache write meets the
rotary in the same kernels, instead of a kernel boundary (and a launch) at each seam.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from agentrl.kernels import invariant

__all__ = ["exact_layer", "layer_first", "layer_last", "layer_mid", "layer_post", "layer_pre"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' RMSNorm: normalise in float32, cast back, then scale (which promotes)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def layer_pre(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ln: torch.Tensor,
    w_qkv: torch.Tensor,
    b_qkv: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    sizes: tuple[int, int, int],
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, fused q/k/v projection, q/k norms, rotary: ``(N, heads, head_dim)`` each."""
    norm = invariant.rms_norm if exact else _rms_norm
    linear = invariant.linear if exact else F.linear
    hq, hkv, hd = sizes
    h = norm(x, ln, eps)
    qkv = linear(h.to(w_qkv.dtype), w_qkv, b_qkv)
    q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
    n = x.shape[0]
    q, k, v = q.reshape(n, hq, hd), k.reshape(n, hkv, hd), v.reshape(n, hkv, hd)
    if q_norm is not None and k_norm is not None:
        q, k = norm(q, q_norm, eps), norm(k, k_norm, eps)
    c, s = cos[:, None, :], sin[:, None, :]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    return q.to(v.dtype), k.to(v.dtype), v


def layer_post(
    x: torch.Tensor,
    attn: torch.Tensor,
    w_o: torch.Tensor,
    b_o: torch.Tensor | None,
    ln: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    eps: float,
    exact: bool = False,
) -> torch.Tensor:
    """Output projection, residual, post-attention norm, fused gate/up SwiGLU MLP, residual."""
    norm = invariant.rms_norm if exact else _rms_norm
    linear = invariant.linear if exact else F.linear
    x = x + linear(attn.flatten(1), w_o, b_o)
    h = norm(x, ln, eps)
    gate, up = linear(h.to(w_gate_up.dtype), w_gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w_down)


def _post(x: torch.Tensor, attn: torch.Tensor, post: tuple[Any, ...], exact: bool) -> torch.Tensor:
    w_o, b_o, ln, w_gate_up, w_down, eps = post
    return layer_post(x, attn, w_o, b_o, ln, w_gate_up, w_down, eps, exact)


def layer_first(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    pre: tuple[Any, ...],
    exact: bool = False,
) -> torch.Tensor:
    """A layer's half before attention (:func:`layer_pre`) and its cache write: ``q``.

    Its keys and values go into ``k_cache``/``v_cache`` at ``slots``. The engine runs it for the
    first layer; :func:`layer_mid` runs it for the next one.
    """
    ln, w_qkv, b_qkv, q_norm, k_norm, eps, sizes = pre
    q, k, v = layer_pre(x, cos, sin, ln, w_qkv, b_qkv, q_norm, k_norm, eps, sizes, exact)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)
    return q


def layer_mid(
    x: torch.Tensor,
    attn: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    post: tuple[Any, ...],
    pre: tuple[Any, ...],
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`layer_post` of a layer, then :func:`layer_pre` of the next: ``(x, q)``.

    The next layer's keys and values go into ``k_cache``/``v_cache`` (its cache) at ``slots``.
    """
    x = _post(x, attn, post, exact)
    return x, layer_first(x, cos, sin, k_cache, v_cache, slots, pre, exact)


def layer_last(
    x: torch.Tensor,
    attn: torch.Tensor,
    post: tuple[Any, ...],
    norm: torch.Tensor,
    eps: float,
    exact: bool = False,
) -> torch.Tensor:
    """:func:`layer_post` of the last layer, then the model's final norm."""
    x = _post(x, attn, post, exact)
    return (invariant.rms_norm if exact else _rms_norm)(x, norm, eps)


def exact_layer(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cu: torch.Tensor,
    lengths: list[int],
    pre: tuple[Any, ...],
    post: tuple[Any, ...],
) -> torch.Tensor:
    """A packed-body layer (its ``pre``/``post`` weight tuples) through the exact-mode code.

    The engine's layer math with fused, cast weights and batch-invariant kernels, outside
    autocast (the dtype autocast would cast to is read first).
    """
    ln, wq, wk, wv, bq, bk, bv, q_norm, k_norm, eps, head_dim = pre
    w_o, b_o, ln2, w_gate, w_up, w_down, _ = post
    on = torch.is_autocast_enabled(x.device.type)
    low = torch.get_autocast_dtype(x.device.type) if on else wq.dtype
    b_qkv = None
    if any(b is not None for b in (bq, bk, bv)):
        parts = [
            w.new_zeros(w.shape[0]) if b is None else b for b, w in ((bq, wq), (bk, wk), (bv, wv))
        ]
        b_qkv = torch.cat(parts).to(low)
    sizes = (wq.shape[0] // head_dim, wk.shape[0] // head_dim, head_dim)
    with torch.autocast(x.device.type, enabled=False):
        w_qkv = torch.cat([wq, wk, wv]).to(low)
        q, k, v = layer_pre(x, cos, sin, ln, w_qkv, b_qkv, q_norm, k_norm, eps, sizes, True)
        attn = invariant.packed_attention(q, k, v, cu, lengths, head_dim**-0.5)
        w_gate_up = torch.cat([w_gate, w_up]).to(low)
        b_o = None if b_o is None else b_o.to(low)
        args = (w_o.to(low), b_o, ln2, w_gate_up, w_down.to(low), eps)
        return layer_post(x, attn, *args, exact=True)
