"""A packed-row forward for Llama-family decoders that shares the transformers model's weights.

transformers' forward of a packed row pays for its generality: a mask (or a mask function) per
micro-batch, one kernel per elementwise op (norms, rotary embeddings, SwiGLU, residual adds,
casts), attention kernels that see padding or a dense block mask. :class:`PackedBody` runs the
same math on one packed row of sequences (``position_ids`` restarting at 0 per sequence) with:

* **variable-length attention** over cumulative sequence offsets: FlashAttention-2 through
  ``torch.nn.attention.varlen`` on CUDA (or, with ``attention="triton"``, this project's
  kernel, :mod:`agentrl.kernels.attention`), one causal ``sdpa`` per sequence elsewhere; no mask
  is built and no padded position is computed;
* **each decoder layer as two functions** around the attention call (norm + projections +
  q/k-norm + rotary before it; output projection + residual + norm + SwiGLU MLP + residual after
  it) that ``torch.compile`` fuses into a few kernels (``compile=True``); on CUDA the whole
  layer, varlen attention included (a traceable custom op), is one graph, so a layer costs one
  compiled call forward and one backward;
* **activation checkpointing per layer**: the first ``checkpoint_layers`` layers recompute their
  activations in the backward (a memory budget picks a number, not all-or-nothing);
* **selective recomputation** (``selective=True``): every other layer keeps only the outputs of
  its matmuls and of attention, and recomputes the rest in the backward — norms, rotary, the
  activation, and the bf16 copies of the weights that autocast makes (about a third of a
  layer's activation memory for a few percent of time).

The parameters are the model's own (nothing is copied), so the optimizer, checkpoints and weight
export see one set of weights whichever body runs (LoRA adapters on the modules add their term
beside the fused matmuls: :mod:`agentrl.kernels.low_rank`). The numerics follow transformers'
modules op for op (float32 norms, the dtype promotions under autocast), so a float32 run equals
the transformers forward to rounding (tested on a CPU for Qwen3, Qwen2 and Llama configs).

Supported: ``Qwen3ForCausalLM``, ``Qwen2ForCausalLM``, ``LlamaForCausalLM`` with SiLU MLPs, no
MLP bias, no sliding window and no attention dropout, and ``Qwen3MoeForCausalLM`` (its sparse
layers through :mod:`agentrl.kernels.moe`: the model's router module, then grouped expert
matmuls; its dense layers as above); :func:`unsupported_reason` says why not.

Under FSDP2 (several ranks), :meth:`PackedBody.shard_ready` makes each sharded decoder layer
run as an FSDP2 forward method of its module: FSDP2's hooks gather the layer's parameters before
it, free them after it and reduce its gradients in the backward, as around transformers'
forward, and every lever above works as in one process (the same results to rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from agentrl.kernels import compile_guard, invariant
from agentrl.kernels.fused_layer import _rms_norm, _rotate_half, exact_layer
from agentrl.kernels.low_rank import LayerLora, Lora, layer_adapters, plus_each, plus_low_rank
from agentrl.kernels.moe import is_sparse, moe_mlp, moe_unsupported_reason, selective_moe_mlp
from agentrl.kernels.recompute import recompute_selectively, selective_context
from agentrl.kernels.transfer import to_device
from agentrl.kernels.varlen import varlen_attention, varlen_kwargs

__all__ = ["PackedBody", "unsupported_reason"]

_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def unsupported_reason(model: nn.Module, *, moe: bool = False) -> str | None:
    """Why :class:`PackedBody` cannot run ``model``, or ``None`` when it can.

    Args:
        model: a transformers causal LM.
        moe: accept the MoE architectures too. The packed body runs them; callers that reuse
            this check for dense-only code (the paged engine) leave it off.
    """
    name = type(model).__name__
    supported = _ARCHITECTURES + (_MOE_ARCHITECTURES if moe else ())
    if name not in supported:
        return f"architecture {name} (supported: {', '.join(supported)})"
    cfg: Any = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only 'silu')"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias=True"
    if getattr(cfg, "attention_dropout", 0.0):
        return f"attention_dropout {cfg.attention_dropout}"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    return moe_unsupported_reason(model) if name in _MOE_ARCHITECTURES else None


def _pre_attention(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ln: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    bq: torch.Tensor | None,
    bk: torch.Tensor | None,
    bv: torch.Tensor | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    head_dim: int,
    *,
    lora: tuple[Lora | None, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, q/k/v projections (+ ``lora``), q/k norms, rotary: ``(N, heads, head_dim)``."""
    h = _rms_norm(x, ln, eps)
    n = h.shape[0]
    # one matmul for q, k and v (wider is faster; compiled, the concatenation fuses with the cast)
    biases = [(b, w) for b, w in ((bq, wq), (bk, wk), (bv, wv))]
    bias = None
    if any(b is not None for b, _ in biases):
        bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b for b, w in biases])
    qkv = F.linear(h, torch.cat([wq, wk, wv]), bias)
    q, k, v = qkv.split([wq.shape[0], wk.shape[0], wv.shape[0]], dim=-1)
    q, k, v = plus_each((q, k, v), h, lora)
    q, k, v = (t.reshape(n, -1, head_dim) for t in (q, k, v))
    if q_norm is not None and k_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    c, s = cos[:, None, :], sin[:, None, :]  # (N, 1, D)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    return q, k, v


def _post_attention(
    x: torch.Tensor,
    attn: torch.Tensor,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    ln: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    eps: float,
    *,
    lora: tuple[Lora | None, ...] | None = None,
) -> torch.Tensor:
    """Output projection, residual, post-attention norm, SwiGLU MLP, residual (+ ``lora``)."""
    lo = lora or (None, None, None, None)  # without adapters: the same ops as ever
    a = attn.flatten(1)
    x = x + plus_low_rank(F.linear(a, wo, bo), a, lo[0])
    h = _rms_norm(x, ln, eps)
    gate, up = F.linear(h, torch.cat([w_gate, w_up])).chunk(2, dim=-1)
    m = F.silu(plus_low_rank(gate, h, lo[1])) * plus_low_rank(up, h, lo[2])
    return x + plus_low_rank(F.linear(m, w_down), m, lo[3])


def attention_out(
    x: torch.Tensor,
    attn: torch.Tensor,
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    ln: torch.Tensor,
    eps: float,
    *,
    lora: tuple[Lora | None, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output projection (+ ``lora``), residual, post-attention norm: ``(x, h)`` (MoE layers)."""
    a = attn.flatten(1)
    x = x + plus_low_rank(F.linear(a, wo, bo), a, None if lora is None else lora[0])
    return x, _rms_norm(x, ln, eps)


def _varlen_layer(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    options: dict[str, Any],
    pre: tuple[Any, ...],
    post: tuple[Any, ...],
    lora: LayerLora | None = None,
) -> torch.Tensor:
    """A whole decoder layer with varlen attention: one graph for ``torch.compile``."""
    q, k, v = _pre_attention(x, cos, sin, *pre, lora=lora and lora[0])
    head_dim = pre[-1]
    attn = varlen_attention(q, k, v, cu, max_len, head_dim**-0.5, options)
    return _post_attention(x, attn, *post, lora=lora and lora[1])


def _varlen_half(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    options: dict[str, Any],
    pre: tuple[Any, ...],
    post: tuple[Any, ...],
    lora: LayerLora | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE layer up to its router: attention, residual, post-attention norm; ``(x, h)``."""
    q, k, v = _pre_attention(x, cos, sin, *pre, lora=lora and lora[0])
    attn = varlen_attention(q, k, v, cu, max_len, pre[-1] ** -0.5, options)
    return attention_out(x, attn, *post, lora=lora and lora[1])


def _selective_varlen_layer(*args: Any) -> torch.Tensor:
    """:func:`_varlen_layer` keeping only matmul and attention outputs for the backward."""
    out = recompute_selectively(_varlen_layer, *args)
    assert isinstance(out, torch.Tensor)
    return out


def _selective_varlen_half(*args: Any) -> Any:
    """:func:`_varlen_half` keeping only matmul and attention outputs for the backward."""
    return recompute_selectively(_varlen_half, *args)


class PackedBody:
    """Runs a causal LM's decoder on one packed row; see the module docstring.

    Args:
        model: a supported transformers causal LM (:func:`unsupported_reason`).
        compile: ``torch.compile`` the per-layer functions (fused elementwise kernels).
        tuned: with ``compile``, let inductor tune each kernel's block sizes by coordinate
            descent (a slower first compile, faster kernels).
        checkpoint_layers: recompute the activations of this many layers (the first ones) in
            the backward.
        selective: in the other layers, keep only matmul and attention outputs and recompute
            the rest in the backward.
        attention: ``"varlen"`` (FlashAttention-2, CUDA), ``"triton"`` (this project's Triton
            kernel, :mod:`agentrl.kernels.attention`; CUDA with Triton), ``"sdpa"`` (one call per
            sequence) or ``"auto"`` (varlen on CUDA, sdpa elsewhere).
        batch_invariant: the exact mode (:mod:`agentrl.kernels.invariant`): every layer and the
            final norm run through batch-invariant kernels, the paged engine's attention kernel
            included, so the log-probs equal the exact-mode engine's bit for bit. Dense models
            on CUDA; layers run uncompiled (``compile``, ``selective`` and ``attention`` do not
            apply), ``checkpoint_layers`` still does.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        compile: bool = False,
        checkpoint_layers: int = 0,
        attention: str = "auto",
        selective: bool = False,
        tuned: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        reason = unsupported_reason(model, moe=True)
        if reason is not None:
            raise ValueError(f"model: the packed body does not support {reason}")
        self.exact = batch_invariant
        if attention not in ("auto", "varlen", "triton", "sdpa"):
            raise ValueError(f"attention: expected auto, varlen, triton or sdpa, got {attention!r}")
        self.model = model
        base: Any = model.base_model  # transformers modules, untyped
        self.base = base
        cfg: Any = model.config
        self.eps = float(cfg.rms_norm_eps)
        head_dim = getattr(cfg, "head_dim", None)
        self.head_dim = int(head_dim or cfg.hidden_size // cfg.num_attention_heads)
        self.num_layers = len(base.layers)
        if not 0 <= checkpoint_layers <= self.num_layers:
            raise ValueError(
                f"checkpoint_layers: expected 0..{self.num_layers}, got {checkpoint_layers}"
            )
        self.checkpoint_layers = checkpoint_layers
        self.attention = attention
        self._varlen: dict[str, Any] | None = None
        self._pre: Callable[..., Any] = _pre_attention
        self._post: Callable[..., Any] = _post_attention
        self.selective = selective
        layer_fn = _selective_varlen_layer if selective else _varlen_layer
        self._varlen_layer: Callable[..., Any] = layer_fn
        # MoE layers: two graphs around the model's router module, which runs eagerly
        self._sparse = [is_sparse(layer.mlp) for layer in base.layers]
        if batch_invariant and any(self._sparse):
            raise ValueError("batch_invariant: dense models only (this one has expert layers)")
        self._out: Callable[..., Any] = attention_out
        self._half: Callable[..., Any] = _selective_varlen_half if selective else _varlen_half
        self._experts: Callable[..., Any] = selective_moe_mlp if selective else moe_mlp
        # what runs layer i: _block itself, or an FSDP2 forward method around it (shard_ready)
        self._calls: list[Callable[..., torch.Tensor]] = [
            partial(self._block, i) for i in range(self.num_layers)
        ]
        if compile:  # one graph per layer with varlen attention (it is a traceable custom op)
            options: dict[str, Any] | None = {"coordinate_descent_tuning": True} if tuned else None
            self._pre = compile_guard.compiled(_pre_attention, dynamic=True, options=options)
            self._post = compile_guard.compiled(_post_attention, dynamic=True, options=options)
            self._varlen_layer = compile_guard.compiled(layer_fn, dynamic=True, options=options)
            if any(self._sparse):
                self._out = compile_guard.compiled(attention_out, dynamic=True, options=options)
                self._half = compile_guard.compiled(self._half, dynamic=True, options=options)
                self._experts = compile_guard.compiled(self._experts, dynamic=True, options=options)

    def _sdpa_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        dtype = v.dtype  # under autocast: the projections' low precision
        q, k = q.to(dtype), k.to(dtype)
        outs, start = [], 0
        for n in lengths:
            sl = slice(start, start + n)
            start += n
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1),
                k[sl].transpose(0, 1),
                v[sl].transpose(0, 1),
                is_causal=True,
                scale=self.head_dim**-0.5,
                enable_gqa=True,
            )
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    def _weights(self, i: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Layer ``i``'s arguments of :func:`_pre_attention` and :func:`_post_attention`."""
        layer = self.base.layers[i]
        att, mlp = layer.self_attn, layer.mlp
        q_norm = getattr(att, "q_norm", None)
        k_norm = getattr(att, "k_norm", None)
        pre = (
            layer.input_layernorm.weight,
            att.q_proj.weight,
            att.k_proj.weight,
            att.v_proj.weight,
            att.q_proj.bias,
            att.k_proj.bias,
            att.v_proj.bias,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            self.eps,
            self.head_dim,
        )
        post: tuple[Any, ...] = (att.o_proj.weight, att.o_proj.bias)
        post += (layer.post_attention_layernorm.weight,)
        if self._sparse[i]:  # the MLP runs apart (see _moe_layer)
            return pre, (*post, self.eps)
        return pre, (
            *post,
            mlp.gate_proj.weight,
            mlp.up_proj.weight,
            mlp.down_proj.weight,
            self.eps,
        )

    def shard_ready(self) -> None:
        """Run each layer that FSDP2 shards inside its module's FSDP2 forward hooks.

        Call once ``fully_shard`` has wrapped the decoder layers. FSDP2 gathers a module's
        parameters (and puts them on the module) in its pre-forward hook, then frees them and
        registers the backward hooks in its post-forward hook; by default both fire around
        ``forward`` only, which this body does not call. :func:`register_fsdp_forward_method`
        puts the same hooks around another method of the module: here ``packed_forward``, this
        body's computation of the layer, which reads the gathered parameters from the module.
        Recomputation (``checkpoint_layers``, ``selective``) happens inside the layer's backward,
        after FSDP2's pre-backward hook has gathered its parameters again, into the same
        parameter objects.
        """
        from torch.distributed.fsdp import register_fsdp_forward_method

        for i, layer in enumerate(self.base.layers):
            layer.packed_forward = partial(self._block, i)
            register_fsdp_forward_method(layer, "packed_forward")  # no-op where not sharded
            self._calls[i] = layer.packed_forward

    def _block(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu: torch.Tensor,
        lengths: list[int],
    ) -> torch.Tensor:
        """Layer ``i``, its activations recomputed in the backward if it is checkpointed."""
        if i < self.checkpoint_layers and torch.is_grad_enabled() and not self._sparse[i]:
            out = checkpoint(self._layer, i, x, cos, sin, cu, lengths, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            return out
        return self._layer(i, x, cos, sin, cu, lengths)

    def _layer(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu: torch.Tensor,
        lengths: list[int],
    ) -> torch.Tensor:
        pre, post = self._weights(i)
        lora = layer_adapters(self.base.layers[i], self._sparse[i], self.model.training)
        if self.exact:
            assert lora is None, "batch_invariant: no LoRA adapters"  # LearnerConfig checks
            return exact_layer(x, cos, sin, cu, lengths, pre, post)
        if self.attention in ("varlen", "triton") or (self.attention == "auto" and x.is_cuda):
            if self._varlen is None and self.attention == "triton":
                self._varlen = {"kernel": "triton"}  # shares KV heads itself
            elif self._varlen is None:
                cfg: Any = self.model.config
                heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
                self._varlen = varlen_kwargs(heads, kv)
            # a power of two: FlashAttention only sizes its grid by it, and few distinct
            # values keep the compiled layer from recompiling for every batch
            max_len = max(1024, 1 << (max(lengths) - 1).bit_length())
            if self._sparse[i]:
                args = (x, cos, sin, cu, max_len, self._varlen, pre, post, lora)
                return self._moe_layer(i, self._half, args)
            return self._varlen_layer(x, cos, sin, cu, max_len, self._varlen, pre, post, lora)
        if self._sparse[i]:
            return self._moe_layer(i, self._sdpa_half, (x, cos, sin, lengths, pre, post, lora))
        if self.selective and torch.is_grad_enabled():
            return checkpoint(
                self._sdpa_layer,
                x,
                cos,
                sin,
                lengths,
                pre,
                post,
                lora,
                use_reentrant=False,
                context_fn=selective_context,
            )
        return self._sdpa_layer(x, cos, sin, lengths, pre, post, lora)

    def _sdpa_layer(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lengths: list[int],
        pre: tuple[Any, ...],
        post: tuple[Any, ...],
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        q, k, v = self._pre(x, cos, sin, *pre, lora=lora and lora[0])
        return self._post(x, self._sdpa_attention(q, k, v, lengths), *post, lora=lora and lora[1])

    def _sdpa_half(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lengths: list[int],
        pre: tuple[Any, ...],
        post: tuple[Any, ...],
        lora: LayerLora | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self._pre(x, cos, sin, *pre, lora=lora and lora[0])
        return self._out(x, self._sdpa_attention(q, k, v, lengths), *post, lora=lora and lora[1])

    def _moe_layer(self, i: int, half: Callable[..., Any], args: tuple[Any, ...]) -> torch.Tensor:
        """Layer ``i`` (sparse): ``half`` (attention + norm), the router module, the experts.

        Checkpointing wraps the two halves apart and never the router, so a recomputation in
        the backward does not call the router (and the routing hooks on it) again.
        """
        grad = torch.is_grad_enabled()
        ckpt = grad and i < self.checkpoint_layers
        if ckpt:
            x, h = checkpoint(half, *args, use_reentrant=False)
        elif grad and self.selective and half == self._sdpa_half:
            x, h = checkpoint(half, *args, use_reentrant=False, context_fn=selective_context)
        else:
            x, h = half(*args)
        mlp = self.base.layers[i].mlp
        _, weights, experts = mlp.gate(h)  # the module: forward hooks see and may replace it
        device = x.device.type
        on = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if on else mlp.experts.gate_up_proj.dtype
        args = (x, h, weights, experts, mlp.experts.gate_up_proj, mlp.experts.down_proj, dtype)
        if ckpt:
            return checkpoint(self._experts, *args, use_reentrant=False)
        return self._experts(*args)

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """Final hidden states ``(N, hidden)`` of a packed row.

        Args:
            input_ids: ``(1, N)`` or ``(N,)`` token ids, sequences back to back.
            position_ids: the same shape, restarting at 0 for every sequence.
            lengths: token count of each sequence, summing to ``N``.
        """
        ids = input_ids.reshape(-1)
        pos = position_ids.reshape(1, -1)
        if sum(lengths) != ids.shape[0]:
            raise ValueError(f"lengths: expected them to sum to {ids.shape[0]}, got {sum(lengths)}")
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        cu = to_device(torch.tensor(offsets, dtype=torch.int32), ids.device)
        x = self.base.embed_tokens(ids)  # (N, H), the parameters' dtype
        cos, sin = self.base.rotary_emb(x[None], pos)  # (1, N, D) in x's dtype
        cos, sin = cos[0], sin[0]
        for call in self._calls:
            x = call(x, cos, sin, cu, lengths)
        norm = invariant.rms_norm if self.exact else _rms_norm
        return norm(x, self.base.norm.weight, self.eps)
