"""The transformers path's model runner: batched prefill and decode, scoring, per-row sampling.

- ``ModelRunner`` and ``BatchCache``: batched prefill and decode over one left-padded KV cache
  (select rows, merge newcomers), and teacher-forced scoring, for models the paged path does not
  take (:mod:`~agentrl.inference.engine.path_choice`).
- ``sample``: per-row sampling with SGLang's log-prob convention.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache

from agentrl.inference.base import SamplingParams


class BatchCache:
    """The running batch's left-padded KV cache, attention mask and next position per row."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask  # (B, T) 1 = real token, 0 = left padding
        self.positions = positions  # (B,) position id of the next token fed

    def _layers(self) -> list[Any]:
        return list(self.cache.layers)

    def select(self, rows: list[int]) -> BatchCache:
        """Keep ``rows`` and drop the leading columns that are padding in every kept row."""
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask[index]
        real_cols = mask.sum(0).nonzero()
        start = int(real_cols[0]) if len(real_cols) else mask.shape[1]
        for layer in self._layers():
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        return BatchCache(self.cache, mask[:, start:], self.positions[index])

    def pad_left(self, width: int) -> None:
        """Grow every row by ``width`` masked columns on the left."""
        if width <= 0:
            return
        for layer in self._layers():
            b, h, _, d = layer.keys.shape
            zeros = layer.keys.new_zeros(b, h, width, d)
            layer.keys = torch.cat([zeros, layer.keys], dim=2)
            layer.values = torch.cat([zeros.to(layer.values.dtype), layer.values], dim=2)
        self.mask = torch.cat([self.mask.new_zeros(self.mask.shape[0], width), self.mask], dim=1)

    def merge(self, other: BatchCache) -> BatchCache:
        """Append ``other``'s rows after this batch's rows (both left-padded to one width)."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.pad_left(width - self.mask.shape[1])
        other.pad_left(width - other.mask.shape[1])
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask = torch.cat([self.mask, other.mask], dim=0)
        self.positions = torch.cat([self.positions, other.positions], dim=0)
        return self


class ModelRunner:
    """Runs the model for the engine: batched prefill, one decode step, teacher-forced scoring."""

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        args = inspect.signature(model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`.
        self._cache_kw = "cache" if "cache" in args else "past_key_values"
        self._last_only = "logits_to_keep" in args
        layers = getattr(self._new_cache(), "layers", None)
        if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers or []})
            raise ValueError(
                f"LocalEngine needs a model whose KV cache is full attention (DynamicLayer), "
                f"got cache layers {kinds or 'unknown'}"
            )

    def _new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._last_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs)
        return out.logits[:, -1]  # (B, V)

    def prefill(self, seqs: list[list[int]]) -> tuple[torch.Tensor, BatchCache]:
        """Left-pad ``seqs`` into one batch; return next-token logits and the batch's cache."""
        width = max(len(s) for s in seqs)
        ids = [[self.pad_id] * (width - len(s)) + s for s in seqs]
        mask_rows = [[0] * (width - len(s)) + [1] * len(s) for s in seqs]
        input_ids = torch.tensor(ids, device=self.device)  # (B, T)
        mask = torch.tensor(mask_rows, device=self.device)  # (B, T)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T) real positions per row
        cache = self._new_cache()
        logits = self._forward(input_ids, mask, positions, cache)
        return logits, BatchCache(cache, mask, mask.sum(-1))

    def decode(self, batch: BatchCache, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; return the next-token logits (B, V)."""
        ids = torch.tensor(tokens, device=self.device)[:, None]  # (B, 1)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(tokens), 1)], dim=1)
        logits = self._forward(ids, batch.mask, batch.positions[:, None], batch.cache)
        batch.positions = batch.positions + 1
        return logits

    @torch.inference_mode()
    def score(self, ids: list[int], temperature: float) -> list[float]:
        """Teacher-forced ``log_softmax(logits / T)`` of ``ids[1:]`` (one forward pass)."""
        input_ids = torch.tensor([ids], device=self.device)  # (1, T)
        logits = self.model(input_ids=input_ids).logits[0, :-1].float()  # (T-1, V)
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        return logprobs.gather(1, input_ids[0, 1:, None])[:, 0].tolist()


def _truncate(logprobs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k / top-p set; rows stay unnormalised."""
    vocab = logprobs.shape[-1]
    device = logprobs.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logprobs.dtype)
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_lp.exp()
    ranks = torch.arange(vocab, device=device)
    # top-p keeps tokens until the mass *before* them exceeds p, so the first always stays.
    remove = (ranks[None, :] >= top_k[:, None]) | ((probs.cumsum(-1) - probs) > top_p[:, None])
    sorted_lp = sorted_lp.masked_fill(remove, float("-inf"))
    return torch.full_like(logprobs, float("-inf")).scatter(1, order, sorted_lp)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    shared: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Sample one token per row; return the tokens and their SGLang-convention log-probs.

    The log-prob is ``log_softmax(logits / T)`` over the full vocabulary (plain
    ``log_softmax(logits)`` for greedy rows, ``T == 0``), not renormalised by top-k/top-p.
    Rows with their own generator (a per-request seed) draw from it alone, so their samples do
    not depend on which other requests share the batch; the others share ``shared``.
    """
    logits = logits.float()  # (B, V)
    temps = [p.temperature for p in params]
    scale = torch.tensor([t if t > 0 else 1.0 for t in temps], device=logits.device)
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)  # (B, V)
    tokens = logits.argmax(dim=-1)  # (B,) greedy rows keep this
    rows = [i for i, t in enumerate(temps) if t > 0]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        scores = logprobs[index]  # (n, V)
        row_params = [params[i] for i in rows]
        if any(p.truncates for p in row_params):
            scores = _truncate(scores, row_params)
        probs = torch.softmax(scores, dim=-1)  # (n, V)
        picks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        common = [j for j, i in enumerate(rows) if generators[i] is None]
        if common:
            at = torch.tensor(common, device=logits.device)
            picks[at] = torch.multinomial(probs[at], 1, generator=shared)[:, 0]
        for j, i in enumerate(rows):
            own = generators[i]
            if own is not None:
                picks[j] = torch.multinomial(probs[j], 1, generator=own)[0]
        tokens[index] = picks
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # (B,)
    return tokens.tolist(), chosen.tolist()
