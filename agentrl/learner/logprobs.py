"""Log-probs of sampled tokens without materialising the ``(tokens, vocab)`` logits.

:func:`chunked_token_logprobs` computes ``log_softmax(hidden @ W.T / T)[target]`` — the engine's
convention (:mod:`agentrl.inference.base`; temperature 0 means greedy and counts as 1) — in
float32, ``chunk_size`` tokens at a time, as one autograd function:

* forward, per chunk: logits into one ``(chunk, vocab)`` buffer, the target's logit picked, the
  log-sum-exp computed in place; only the ``(n,)`` log-sum-exps are kept for the backward;
* backward, per chunk: the logits are recomputed into one buffer and turned in place into the
  gradient ``g · (onehot(target) - softmax) / T``, then ``∂hidden = G @ W`` and ``∂W += Gᵀ @
  hidden``.

With ``fused``, each pass over a chunk's logits is one kernel: :mod:`agentrl.kernels.head`
(Triton) on CUDA, a ``torch.compile``d function elsewhere.

So peak memory is about one chunk of float32 logits in either pass, whatever the batch (a
``checkpoint``-per-chunk version keeps three or four such buffers alive in its backward). The
cost is one extra head matmul in the backward, as with activation checkpointing.

:class:`LogprobModel` runs a causal LM's body on a packed micro-batch
(:class:`~agentrl.learner.packing.PackedBatch`) and then this head on the trained tokens only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from agentrl.kernels import head as head_kernels
from agentrl.kernels import invariant
from agentrl.kernels.matmul import addmm32_, mm32
from agentrl.kernels.packed_body import PackedBody
from agentrl.learner.packing import PackedBatch


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = mm32(h, weight.t())  # (c, V) float32
    if bias is not None:
        out += bias
    return out


def _logprob_lse(
    logits: torch.Tensor, targets: torch.Tensor, inv_t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the log-sum-exp, per row of float32 ``logits`` (c, V)."""
    z = logits * inv_t
    lse = torch.logsumexp(z, dim=1)
    return z.gather(1, targets[:, None]).squeeze(1) - lse, lse


def _dlogits(
    logits: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    targets: torch.Tensor,
    inv_t: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``g · (onehot(target) - softmax) / T`` per row, in ``dtype`` (what the matmuls take)."""
    p = torch.exp(logits * inv_t - lse[:, None])
    vocab = torch.arange(logits.shape[1], device=logits.device)
    onehot = (vocab[None, :] == targets[:, None]).to(p.dtype)
    return (g[:, None] * inv_t * (onehot - p)).to(dtype)


_FUSED: dict[str, Any] = {}


def _fused(name: str, tuned: bool) -> Any:
    """The ``torch.compile``d :func:`_logprob_lse` / :func:`_dlogits`: one pass over the logits."""
    key = f"{name}-{tuned}"
    if key not in _FUSED:
        fn = _logprob_lse if name == "fwd" else _dlogits
        options: dict[str, Any] | None = {"coordinate_descent_tuning": True} if tuned else None
        _FUSED[key] = torch.compile(fn, dynamic=True, options=options)
    return _FUSED[key]


class _HeadLogprobs(torch.autograd.Function):
    """``log_softmax(h @ W.T (+ b)) / T)[target]`` per row, chunked; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        inv_t: float,
        chunk_size: int,
        head_dtype: torch.dtype,
        fused: bool | str,
        exact: bool,
    ) -> torch.Tensor:
        h_lo, w_lo = hidden.to(head_dtype), weight.to(head_dtype)
        b32 = None if bias is None else bias.float()
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for s in range(0, n, chunk_size):
            e = s + chunk_size
            if exact:  # the exact-mode engine's head, bit for bit
                logits = invariant.matmul(h_lo[s:e], w_lo, out_dtype=torch.float32)
                logits = logits if b32 is None else logits + b32
                inv = torch.full((logits.shape[0],), inv_t, device=logits.device)
                out[s:e], lse[s:e] = invariant.token_logprobs(logits, inv, targets[s:e])
                continue
            logits = _logits(h_lo[s:e], w_lo, b32)  # (c, V) float32
            if fused:
                lse_fn = _fused("fwd", fused == "tuned")
                if head_kernels.available(logits):
                    lse_fn = head_kernels.logprob_lse
                out[s:e], lse[s:e] = lse_fn(logits, targets[s:e], inv_t)
                continue
            if inv_t != 1.0:
                logits *= inv_t
            picked = logits.gather(1, targets[s:e, None]).squeeze(1)
            top = logits.amax(dim=1)
            lse_c = logits.sub_(top[:, None]).exp_().sum(dim=1).log_() + top  # destroys logits
            lse[s:e] = lse_c
            out[s:e] = picked - lse_c
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.inv_t, ctx.chunk_size, ctx.head_dtype = inv_t, chunk_size, head_dtype
        ctx.fused = fused
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        inv_t, chunk, low = ctx.inv_t, ctx.chunk_size, ctx.head_dtype
        h_lo, w_lo = hidden.to(low), weight.to(low)
        b32 = None if bias is None else bias.float()
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h_lo, dtype=torch.float32) if need_h else None
        grad_w = torch.zeros_like(w_lo, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(b32) if need_b and b32 is not None else None
        g = grad_out.float()
        for s in range(0, hidden.shape[0], chunk):
            e = s + chunk
            logits = _logits(h_lo[s:e], w_lo, b32)  # (c, V) float32
            if ctx.fused:
                grad_fn = _fused("bwd", ctx.fused == "tuned")
                if head_kernels.available(logits):
                    grad_fn = head_kernels.dlogits
                grad = grad_fn(logits, lse[s:e], g[s:e], targets[s:e], inv_t, low)
            else:  # dL/dlogits in place
                grad = logits
                if inv_t != 1.0:
                    grad.mul_(inv_t)
                grad.sub_(lse[s:e, None]).exp_().mul_(-g[s:e, None])  # -g * softmax
                grad.scatter_add_(1, targets[s:e, None], g[s:e, None])  # + g * onehot
                if inv_t != 1.0:
                    grad.mul_(inv_t)
            if grad_b is not None:
                grad_b += grad.float().sum(dim=0)
            grad_lo = grad.to(low)
            if grad_h is not None:
                grad_h[s:e] = mm32(grad_lo, w_lo)
            if grad_w is not None:
                addmm32_(grad_w, grad_lo.t(), h_lo[s:e])
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    head_dtype: torch.dtype = torch.float32,
    fused: bool | str = False,
    exact: bool = False,
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T / T)[target]`` per token, ``chunk_size`` tokens at a time.

    Args:
        hidden: ``(n, H)`` hidden states that predict the targets (any float dtype).
        weight: ``(V, H)`` output-embedding (head) weight.
        targets: ``(n,)`` token ids.
        bias: optional ``(V,)`` head bias.
        temperature: the engine's sampling temperature; 0 (greedy) counts as 1.
        chunk_size: tokens per chunk; peak memory is about ``chunk_size * V`` floats.
        head_dtype: dtype of the head matmuls' inputs (``bfloat16`` runs them at bf16 speed);
            accumulation, logits and the log-softmax stay float32 whatever it is.
        fused: run the per-chunk log-softmax and its gradient as ``torch.compile``d kernels
            (one pass over the float32 logits instead of several; needs a compiler backend);
            ``"tuned"`` also tunes their block sizes (coordinate descent).
        exact: the forward through :mod:`agentrl.kernels.invariant`'s batch-invariant head
            (the exact-mode engine's, bit for bit; CUDA, low-precision ``head_dtype``).

    Returns:
        ``(n,)`` float32 log-probs, differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"targets: expected {hidden.shape[0]} entries, got {targets.shape[0]}")
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    with torch.autocast(hidden.device.type, enabled=False):
        out = _HeadLogprobs.apply(
            hidden, weight, bias, targets, inv_t, chunk_size, head_dtype, fused, exact
        )
    return out


class LogprobModel(nn.Module):
    """A causal LM that returns the log-probs of the trained tokens of a :class:`PackedBatch`.

    Wrapping the whole computation (body and chunked head) in one module's ``forward`` is what
    lets FSDP2 shard it: ``fully_shard`` on this module gathers the root parameters (embedding,
    final norm, head) around the head computation too.

    Args:
        model: a transformers causal LM with a linear output embedding.
        temperature: the engine's sampling temperature.
        chunk_size: tokens per chunk of the head.
        autocast_dtype: run the body under ``torch.autocast`` in this dtype (the head's
            log-softmax stays float32); ``None`` runs it in the parameters' dtype.
        head_dtype: dtype of the head matmuls' inputs (float32 accumulation either way).
        fused_head: compile the head's per-chunk log-softmax and gradient (one pass each);
            ``"tuned"`` also tunes the kernels.
        body: a :class:`~agentrl.kernels.packed_body.PackedBody` over ``model`` to run instead of
            transformers' forward (it reads ``lengths`` instead of a mask).

    With a ``body`` built with ``batch_invariant=True``, the head runs the exact mode too.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        temperature: float,
        chunk_size: int,
        autocast_dtype: torch.dtype | None = None,
        head_dtype: torch.dtype = torch.float32,
        fused_head: bool | str = False,
        body: PackedBody | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.autocast_dtype = autocast_dtype
        self.head_dtype = head_dtype
        self.fused_head = fused_head
        self.body = body

    def run(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` on a packed micro-batch."""
        return self(
            batch.input_ids,
            batch.position_ids,
            batch.attention_mask,
            batch.pred_index,
            batch.targets,
            batch.lengths,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        pred_index: torch.Tensor,
        targets: torch.Tensor,
        lengths: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs ``(n,)`` of ``targets``, and a zero scalar tied to every layer.

        Adding the zero to a loss keeps every parameter in the backward graph even when the
        micro-batch has no trained token, which distributed backward hooks rely on.
        """
        head = self.model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise TypeError(f"output embeddings: expected nn.Linear, got {type(head).__name__}")
        enabled = self.autocast_dtype is not None
        dtype = self.autocast_dtype or torch.float32
        with torch.autocast(input_ids.device.type, dtype=dtype, enabled=enabled):
            if self.body is not None:
                hidden = self.body(input_ids, position_ids, list(lengths))[None]  # (1, N, H)
            else:
                hidden = self.model.base_model(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    attention_mask=attention_mask,
                    use_cache=False,
                ).last_hidden_state  # (1, N, H)
        zero = hidden.sum() * 0.0 + head.weight.sum() * 0.0
        picked = hidden[0].index_select(0, pred_index)  # (n, H)
        logprobs = chunked_token_logprobs(
            picked,
            head.weight,
            targets,
            bias=head.bias,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            head_dtype=self.head_dtype,
            fused=self.fused_head,
            exact=self.body is not None and self.body.exact,
        )
        return logprobs, zero
