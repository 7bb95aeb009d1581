"""Mixture-of-Experts routing: which experts each token used, recorded, compared and replayed.

GSPO's case for sequence-level ratios rests on MoE routing (arXiv:2507.18071, section 5.3):
after an update, about a tenth of the experts a token activates change, so token-level ratios
swing; GRPO then needs *Routing Replay* (the new policy reuses the old policy's experts), GSPO
does not. This module is the one place that knows how a router is found and driven:

- :func:`routers` lists a model's top-k routers in layer order (Qwen3-MoE and the other
  transformers models whose router is a ``*TopKRouter`` returning ``(logits, weights, indices)``).
- :class:`RoutingCapture` records, for every forward pass, the experts each token chose:
  an ``int`` tensor ``(tokens, layers, top_k)`` in the order the router saw the tokens
  (``batch * seq``, row-major), the layout of SGLang's ``routed_experts``.
- :class:`RoutingReplay` makes the routers use given experts instead of their own top-k; the
  gate weights are still the router's softmax at those experts (renormalised as the model
  says), so gradients reach the router. Rows of ``-1`` keep the router's own choice.
- :func:`expert_overlap` compares two recordings of the same tokens, per layer: the share of
  activated experts they agree on. Engine vs learner agreement is that overlap; the paper's
  *expert-activation volatility* is one minus it, before vs after an update.

Routing records cover every token that went through the model: for a trajectory of ``n``
tokens, the engine records ``n - 1`` rows (the last sampled token is never fed back), as
SGLang does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _top_k(router: nn.Module) -> int:
    k: Any = router.top_k
    return int(k)


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` routes tokens to experts."""
    return bool(routers(model))


def routing_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(layers, top_k, num_experts)`` of an MoE model's routing.

    Raises:
        ValueError: ``model`` has no router.
    """
    found = routers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE router")
    r: Any = found[0]
    return len(found), int(r.top_k), int(r.num_experts)


class RoutingCapture:
    """Records the experts every forward pass chose, while the context is open.

    Usage::

        with RoutingCapture(model) as cap:
            model(input_ids)
        experts = cap.pop()  # (tokens, layers, top_k), int32, on the CPU
    """

    def __init__(self, model: nn.Module, *, device: torch.device | str = "cpu") -> None:
        """Hook every router of ``model``; records are moved to ``device``."""
        self._routers = routers(model)
        if not self._routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to capture")
        self._device = torch.device(device)
        self._layers: list[list[torch.Tensor]] = [[] for _ in self._routers]
        self._handles: list[Any] = []

    def __enter__(self) -> RoutingCapture:
        for i, r in enumerate(self._routers):
            self._handles.append(r.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            self._layers[layer].append(output[2].detach())

        return hook

    def pop(self) -> torch.Tensor:
        """The experts chosen since the last ``pop``, ``(tokens, layers, top_k)`` int32.

        Several forward passes are concatenated along ``tokens`` in call order.

        Raises:
            RuntimeError: the routers ran a different number of times (a partial forward).
        """
        counts = {len(x) for x in self._layers}
        if len(counts) != 1:
            raise RuntimeError(f"routers ran unequal numbers of times: {sorted(counts)}")
        if counts == {0}:
            k = _top_k(self._routers[0])
            return torch.empty(0, len(self._routers), k, dtype=torch.int32)
        per_layer = [torch.cat(x) for x in self._layers]
        for x in self._layers:
            x.clear()
        return torch.stack(per_layer, dim=1).to(self._device, torch.int32)


class RoutingReplay:
    """Makes the routers use recorded experts: the next forward passes read ``experts``.

    Usage::

        with RoutingReplay(model) as replay:
            replay.set(experts)  # (tokens, layers, top_k); rows of -1 route freely
            model(input_ids)

    ``experts`` must have one row per token of the next forward pass, in the router's order.
    """

    def __init__(self, model: nn.Module) -> None:
        """Prepare to drive every router of ``model``."""
        self._routers = routers(model)
        if not self._routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to replay")
        self._experts: torch.Tensor | None = None
        self._handles: list[Any] = []

    def set(self, experts: torch.Tensor | None) -> None:
        """Experts for the next forward passes (``None``: route freely)."""
        if experts is not None:
            layers, k = len(self._routers), _top_k(self._routers[0])
            if experts.dim() != 3 or experts.shape[1:] != (layers, k):
                raise ValueError(
                    f"experts: expected shape (tokens, {layers}, {k}), got {tuple(experts.shape)}"
                )
        self._experts = experts

    def __enter__(self) -> RoutingReplay:
        for i, r in enumerate(self._routers):
            self._handles.append(r.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._experts = None

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, _inputs: Any, output: Any) -> Any:
            if self._experts is None:
                return None
            logits, _, own = output
            forced = self._experts[:, layer].to(own.device, torch.long)
            if forced.shape[0] != own.shape[0]:
                raise ValueError(
                    f"routing replay: {forced.shape[0]} recorded tokens for a forward of "
                    f"{own.shape[0]}"
                )
            free = (forced < 0).any(dim=-1, keepdim=True)
            idx = torch.where(free, own, forced)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, idx)
            if getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), idx

        return hook


@contextmanager
def replaying(model: nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
    """Forward passes inside use ``experts`` (see :class:`RoutingReplay`); ``None`` is a no-op."""
    if experts is None:
        yield
        return
    with RoutingReplay(model) as replay:
        replay.set(experts)
        yield


def expert_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per layer, the share of activated experts two recordings of the same tokens agree on.

    ``a`` and ``b`` are ``(tokens, layers, top_k)``; rows where either holds ``-1`` are left
    out. Returns a float64 ``(layers,)`` tensor in [0, 1] (NaN for a layer with no rows). For a
    token, the overlap is ``|set(a) & set(b)| / top_k``: slot order does not matter.
    """
    if a.shape != b.shape:
        raise ValueError(f"recordings differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.long(), b.long()
    valid = (a >= 0).all(dim=-1) & (b >= 0).all(dim=-1)  # (tokens, layers)
    same = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(dim=-1).sum(dim=-1)  # (tokens, layers)
    k = a.shape[-1]
    share = same.double() / k
    count = valid.sum(dim=0).double()
    total = (share * valid).sum(dim=0)
    return torch.where(count > 0, total / count.clamp(min=1), torch.nan)


def volatility(before: torch.Tensor, after: torch.Tensor) -> tuple[list[float], float]:
    """The paper's expert-activation volatility: per layer and overall.

    The share of activated experts that differ between two recordings of the same tokens
    (``1 - expert_overlap``); overall is the mean over every valid (token, layer).
    """
    per_layer = 1.0 - expert_overlap(before, after)
    valid = ((before >= 0).all(dim=-1) & (after >= 0).all(dim=-1)).sum(dim=0).double()
    overall = float((per_layer.nan_to_num(0.0) * valid).sum() / valid.sum().clamp(min=1))
    return [float(x) for x in per_layer], overall
