"""MoE routing in the learner: Routing Replay, routing metrics and the load-balancing loss.

One :class:`StepRouting` lives for one :meth:`Learner.step <agentrl.learner.Learner.step>` of an
MoE model. The learner packs a micro-batch's sequences into one row, so the routers see the
concatenation of the sequences' tokens; :func:`packed_experts` lays the engine's records out the
same way (each sample's ``n - 1`` rows, then a ``-1`` row for its last token, which the engine
never fed back).

* **Routing Replay** (``learner.routing_replay``): :meth:`StepRouting.replay` wraps a
  micro-batch's forward *and* backward (a checkpointed layer recomputes its router in the
  backward) in :func:`agentrl.routing.replaying` with the packed records.
* **Metrics** (``learner.routing_metrics``), all from forwards with the learner's own routing:
  the *before* routing and log-probs of every rollout token under the policy that sampled
  (captured during a pre-update forward the step runs anyway when there is one: the recompute
  pass, or the first mini-batch's forward; otherwise an extra no-grad forward), and the *after*
  routing and log-probs (one no-grad forward after the last optimizer step). Keys:

  - ``routing/engine_learner_expert_agreement`` (and ``.../layer_{l}``): share of activated
    experts the engine's record and the learner's before-routing agree on, over the samples the
    learner's current weight version sampled (stale ones were routed by other weights);
  - ``routing/expert_volatility`` (and ``.../layer_{l}``): the paper's expert-activation
    volatility, the share of activated experts that differ before vs after the update, over
    every token of the packed rows;
  - ratios of the update, ``r = exp(logp_after - logp_before)`` per trained token, both from the
    learner's own routing (so engine/trainer mismatch is not in them):
    ``routing/token_ratio_var`` and ``routing/seq_ratio_var`` (variance of the token ratios and
    of the sequence ratios ``exp(mean_t log r)``, GSPO's); ``routing/changed_token_frac``,
    ``routing/ratio_mean_changed|unchanged`` and ``routing/ratio_var_changed|unchanged``,
    split by whether the routing (any layer) of the position that predicts the token changed
    between before and after the update.
* **Load balancing** (``learner.router_aux_loss_coef``): :func:`router_aux_loss`, from the
  router logits of the training forward (``loss/router_aux``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from agentrl.errors import ConfigError
from agentrl.learner.config import LearnerConfig
from agentrl.learner.distributed import StepStats
from agentrl.learner.packing import PackedBatch, TrainSample
from agentrl.routing import (
    RoutingCapture,
    expert_overlap,
    is_moe,
    replaying,
    routers,
    routing_shape,
)

__all__ = [
    "StepRouting",
    "check_routing_config",
    "finish_metrics",
    "packed_experts",
    "router_aux_loss",
]

T = TypeVar("T")
_P = "routing/"
_MOMENTS = ("tok", "seq", "changed", "unchanged")  # ratio groups whose variance is reported


def check_routing_config(model: nn.Module, config: LearnerConfig) -> tuple[int, int, int] | None:
    """``(layers, top_k, num_experts)`` of an MoE model, ``None`` for a dense one.

    Raises:
        ConfigError: an MoE-only option is on for a dense model.
    """
    if is_moe(model):
        return routing_shape(model)
    for name in ("routing_replay", "router_aux_loss_coef"):
        if getattr(config, name):
            raise ConfigError(
                f"learner.{name}: needs a Mixture-of-Experts model (a router per layer), "
                f"got {type(model).__name__}, which has none"
            )
    return None


def packed_experts(samples: Sequence[TrainSample], layers: int, top_k: int) -> torch.Tensor:
    """The engine's routing of a packed row of ``samples``: ``(N, layers, top_k)`` int32.

    Each sample gives its ``n - 1`` recorded rows and a ``-1`` row for its last token; a sample
    without a record gives ``-1`` rows (route freely). An empty list is the one-token row a
    rank with nothing left runs.
    """
    parts = []
    for s in samples:
        rows = np.full((len(s.tokens), layers, top_k), -1, dtype=np.int32)
        if s.routed_experts is not None:
            if s.routed_experts.shape[1:] != (layers, top_k):
                raise ValueError(
                    f"routed_experts: expected (tokens, {layers}, {top_k}) for this model, "
                    f"got {s.routed_experts.shape}"
                )
            rows[:-1] = s.routed_experts
        parts.append(rows)
    if not parts:
        parts.append(np.full((1, layers, top_k), -1, dtype=np.int32))
    return torch.from_numpy(np.concatenate(parts))


def router_aux_loss(
    logits: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], num_experts: int
) -> torch.Tensor:
    """Switch-style load-balancing loss, averaged over layers.

    Per layer, ``E * sum_e f_e P_e``: ``f_e`` the share of the ``tokens * top_k`` assignments
    that went to expert ``e`` (a constant), ``P_e`` the mean router probability of ``e``
    (differentiable). 1 when both are uniform; ``E`` when every token goes to one expert.

    Args:
        logits: per layer, the router logits ``(tokens, E)``.
        indices: per layer, the experts used ``(tokens, top_k)``.
        num_experts: ``E``.
    """
    if not logits:
        raise ValueError("logits: expected one tensor per layer, got none")
    per_layer = []
    for lg, idx in zip(logits, indices, strict=True):
        probs = torch.softmax(lg.float(), dim=-1).mean(dim=0)  # (E,)
        counts = torch.zeros(num_experts, device=lg.device).index_add_(
            0, idx.reshape(-1).long(), torch.ones(idx.numel(), device=lg.device)
        )
        per_layer.append(num_experts * (counts / max(idx.numel(), 1) * probs).sum())
    return torch.stack(per_layer).mean()


class _RouterTap:
    """Keeps each router's logits (with their graph) and used experts during a forward."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = routers(model)
        self.logits: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.indices: list[list[torch.Tensor]] = [[] for _ in self.routers]

    @contextmanager
    def tapping(self) -> Iterator[_RouterTap]:
        def hook(layer: int) -> Any:
            def record(_m: nn.Module, _i: Any, out: Any) -> None:
                self.logits[layer].append(out[0])
                self.indices[layer].append(out[2].detach())

            return record

        handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def loss(self, num_experts: int) -> torch.Tensor:
        return router_aux_loss(
            [torch.cat(x) for x in self.logits], [torch.cat(x) for x in self.indices], num_experts
        )


def _moments(stats: StepStats, key: str, d: torch.Tensor) -> None:
    """Add ``d`` (float64, ratio - 1) to the running moments ``key`` (read at merge time)."""
    n, s1, s2 = d.numel(), d.sum(), (d * d).sum()

    def record(st: StepStats) -> None:
        if n:
            st.mean(f"{_P}_{key}_d", s1.item() / n, n)
            st.mean(f"{_P}_{key}_d2", s2.item() / n, n)

    stats.later(record)


def _per_layer(stats: StepStats, name: str, share: torch.Tensor, count: torch.Tensor) -> None:
    """Weighted means of a per-layer share (NaN where ``count`` is 0), per layer and overall."""

    def record(st: StepStats) -> None:
        shares, counts = share.nan_to_num(0.0).tolist(), count.tolist()
        for layer, (v, c) in enumerate(zip(shares, counts, strict=True)):
            if c:
                st.mean(f"{_P}{name}/layer_{layer}", v, c)
                st.mean(f"{_P}{name}", v, c)

    stats.later(record)


def _valid_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a >= 0).all(dim=-1) & (b >= 0).all(dim=-1)).sum(dim=0)  # (layers,)


def finish_metrics(out: dict[str, float]) -> None:
    """Turn the step's ratio moments into ``routing/*_var`` and ``*_mean`` keys, in place."""
    names = {"tok": "token_ratio", "seq": "seq_ratio"}
    for group in _MOMENTS:
        d1 = out.pop(f"{_P}_{group}_d", None)
        d2 = out.pop(f"{_P}_{group}_d2", None)
        if d1 is None or d2 is None:
            continue
        var = max(d2 - d1 * d1, 0.0)
        if group in names:
            out[f"{_P}{names[group]}_var"] = var
        else:
            out[f"{_P}ratio_mean_{group}"] = 1.0 + d1
            out[f"{_P}ratio_var_{group}"] = var


class StepRouting:
    """Routing replay, metrics and the aux loss of one learner step on an MoE model.

    Args:
        model: the policy (its routers are hooked).
        config: the learner's settings.
        shape: ``(layers, top_k, num_experts)`` (:func:`check_routing_config`).
        samples: the step's batch.
        device: the learner's device.

    Raises:
        ConfigError: ``routing_replay`` is on and a sample carries no routing record.
    """

    def __init__(
        self,
        model: nn.Module,
        config: LearnerConfig,
        shape: tuple[int, int, int],
        samples: Sequence[TrainSample],
        device: torch.device,
        version: int | None = None,
    ) -> None:
        self.model, self.config, self.samples, self.device = model, config, samples, device
        self.version = version  # the learner's weights: agreement compares only what they sampled
        self.layers, self.top_k, self.num_experts = shape
        self.replaying = config.routing_replay
        self.metrics = config.routing_metrics
        self.has_records = any(s.routed_experts is not None for s in samples)
        if self.replaying:
            missing = [i for i, s in enumerate(samples) if s.routed_experts is None]
            if missing:
                raise ConfigError(
                    f"learner.routing_replay: needs the engine's routing of every sample "
                    f"(TrainSample.routed_experts); {len(missing)} of {len(samples)} have none "
                    f"(first: sample {missing[0]}); ask the engine for routed experts"
                )
        self._experts: dict[tuple[int, ...], torch.Tensor] = {}
        self.before: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._followed: set[tuple[int, ...]] = set()

    def follow(self, flat: Sequence[list[int]]) -> list[list[int]]:
        """The micro-batches the metrics follow, called once per step before any forward.

        The first ``routing_metrics_sample`` share of the step's, in order: every rank's list is
        equally long, so ranks agree on the count and keep their collectives in step.
        """
        share = self.config.routing_metrics_sample if self.metrics else 0.0
        chosen = list(flat[: math.ceil(share * len(flat))])
        self._followed = {tuple(m) for m in chosen if m}
        return chosen

    def experts(self, micro: list[int]) -> torch.Tensor:
        """The engine's routing of micro-batch ``micro``'s packed row, on the device."""
        key = tuple(micro)
        if key not in self._experts:
            sel = [self.samples[i] for i in micro]
            packed = packed_experts(sel, self.layers, self.top_k)
            self._experts[key] = packed.to(self.device, non_blocking=True)
        return self._experts[key]

    def replay(self, micro: list[int]) -> AbstractContextManager[None]:
        """Around a micro-batch's forward and backward: replay its records if asked to."""
        if not self.replaying:
            return nullcontext()
        return self._replaying(self.experts(micro))

    @contextmanager
    def _replaying(self, experts: torch.Tensor) -> Iterator[None]:
        calls = [0]

        def count(*_: Any) -> None:
            calls[0] += 1

        handles = [r.register_forward_pre_hook(count) for r in routers(self.model)]
        try:
            with replaying(self.model, experts):
                yield
        finally:
            for h in handles:
                h.remove()
        if not calls[0]:  # a body that bypasses the router modules would train unreplayed
            raise RuntimeError(
                "learner.routing_replay: the model's routers never ran in this forward; the "
                "learner's body must call them (transformers' forward does)"
            )

    def _wants_before(self, micro: list[int]) -> bool:
        key = tuple(micro)
        return self.metrics and key in self._followed and key not in self.before

    def run(
        self,
        micro: list[int],
        forward: Callable[[], tuple[T, torch.Tensor, torch.Tensor]],
        batch: PackedBatch,
        stats: StepStats,
        *,
        pre_update: bool,
        train: bool,
    ) -> tuple[T, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run a learner forward with the hooks it needs; returns its outputs and the aux loss.

        Args:
            micro: the micro-batch's sample indices.
            forward: the forward, returning ``(anything, logprobs, zero)``.
            batch: its packed batch.
            stats: the step's statistics.
            pre_update: no optimizer step has run yet: keep its routing as the *before* one
                (unless replay drives the routers: that is not the learner's own routing).
            train: a training forward: tap the router logits for the aux loss when asked.
        """
        capture = pre_update and not self.replaying and self._wants_before(micro)
        coef = self.config.router_aux_loss_coef
        tap = _RouterTap(self.model) if train and coef > 0 else None
        with (
            RoutingCapture(self.model, device=self.device) if capture else nullcontext() as cap,
            tap.tapping() if tap is not None else nullcontext(),
        ):
            out, logprobs, zero = forward()
        if cap is not None:
            self._keep_before(micro, cap.pop(), logprobs, stats)
        aux = None
        if tap is not None and batch.targets.numel():
            aux = tap.loss(self.num_experts)
            value = aux.detach()
            stats.later(lambda s: s.mean("loss/router_aux", value.item(), 1.0))
        return out, logprobs, zero, aux

    def _check_rows(self, micro: list[int], routing: torch.Tensor) -> None:
        tokens = sum(len(self.samples[i].tokens) for i in micro)
        if routing.shape[0] != tokens:
            raise RuntimeError(
                f"routing metrics: the routers saw {routing.shape[0]} tokens of a packed row of "
                f"{tokens}; the learner's body must call the model's routers once per token"
            )

    def _keep_before(
        self, micro: list[int], routing: torch.Tensor, logprobs: torch.Tensor, stats: StepStats
    ) -> None:
        self._check_rows(micro, routing)
        self.before[tuple(micro)] = (routing, logprobs.detach())
        if self.has_records:  # (a): engine vs learner on the weights that sampled
            engine = self._same_weights(micro, self.experts(micro))
            _per_layer(
                stats,
                "engine_learner_expert_agreement",
                expert_overlap(engine, routing),
                _valid_rows(engine, routing),
            )

    def _same_weights(self, micro: list[int], engine: torch.Tensor) -> torch.Tensor:
        """``engine`` with the rows of samples another weight version sampled set to -1.

        A stale sample (the overlapped loop trains on rollouts one version old) was routed by
        other weights: comparing it would measure the update, not the engine.
        """
        if self.version is None:
            return engine
        keep = []
        for i in micro:
            s = self.samples[i]
            same = all(v == self.version for v, m in zip(s.versions, s.loss_mask, strict=True) if m)
            keep += [same] * len(s.tokens)
        mask = torch.tensor(keep, device=engine.device)[:, None, None]
        return torch.where(mask, engine, torch.full_like(engine, -1))

    def capture_missing(
        self,
        micro: Sequence[list[int]],
        run: Callable[[list[int]], tuple[PackedBatch, torch.Tensor]],
        stats: StepStats,
    ) -> None:
        """Before any optimizer step: the before-routing of ``micro`` not yet captured.

        ``micro``: followed micro-batches (:meth:`follow`) at the same positions on every rank.
        ``run(m)`` is a no-grad forward of micro-batch ``m`` returning ``(batch, logprobs)``;
        empty micro-batches still run (ranks keep their collectives in step).
        """
        if not self.metrics:
            return
        for m in micro:
            if not self._wants_before(m):
                if not m:
                    run(m)
                continue
            with RoutingCapture(self.model, device=self.device) as cap:
                _, logprobs = run(m)
            self._keep_before(m, cap.pop(), logprobs, stats)

    def after_update(
        self,
        micro: Sequence[list[int]],
        run: Callable[[list[int]], tuple[PackedBatch, torch.Tensor]],
        stats: StepStats,
    ) -> None:
        """After the last optimizer step: volatility and ratio statistics of the update.

        ``micro``: the followed micro-batches (:meth:`follow`).
        """
        if not self.metrics:
            return
        for m in micro:
            if not m:
                run(m)
                continue
            with RoutingCapture(self.model, device=self.device) as cap:
                batch, after_lp = run(m)
            after = cap.pop()
            self._check_rows(m, after)
            before, before_lp = self.before[tuple(m)]
            overlap = expert_overlap(before, after)
            _per_layer(stats, "expert_volatility", 1.0 - overlap, _valid_rows(before, after))
            self._ratios(batch, before, after, before_lp, after_lp, stats)

    def _ratios(
        self,
        batch: PackedBatch,
        before: torch.Tensor,
        after: torch.Tensor,
        before_lp: torch.Tensor,
        after_lp: torch.Tensor,
        stats: StepStats,
    ) -> None:
        if batch.targets.numel() == 0:
            return
        log_r = after_lp.detach().double() - before_lp.double()  # (n,)
        d_tok = torch.expm1(log_r)
        same = (before.unsqueeze(-1) == after.unsqueeze(-2)).any(dim=-1).sum(dim=-1)  # (N, L)
        changed = (same < self.top_k).any(dim=-1)[batch.pred_index]  # (n,)
        seq_mean, counts = batch.sequence_means(log_r)
        _moments(stats, "tok", d_tok)
        _moments(stats, "seq", torch.expm1(seq_mean[counts > 0]))
        _moments(stats, "changed", d_tok[changed])
        _moments(stats, "unchanged", d_tok[~changed])
        frac, n = changed.double().mean(), changed.numel()
        stats.later(lambda s: s.mean(f"{_P}changed_token_frac", frac.item(), n))
