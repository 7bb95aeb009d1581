"""The learner: GSPO-token (or GSPO, GRPO) updates of a causal LM on rollout batches.

One :meth:`Learner.step` takes a rollout batch of :class:`TrainSample` and:

* splits it, in order, into ``num_minibatches`` mini-batches (one optimizer step each; only
  the first is on-policy, which is why the ratio is clipped), and each mini-batch into
  micro-batches of at most ``micro_batch_tokens`` tokens, sequences packed into one row
  (:mod:`agentrl.learner.packing`), gradients accumulated so that the update equals one pass
  over the
  whole mini-batch (the loss's ``num_sequences`` is the mini-batch's sequence count);
* uses the **engine's log-probs as old log-probs** (``recompute_old_logprobs`` computes them
  with this model before any update instead), and reports the engine/trainer mismatch on the
  first mini-batch, before any update (``mismatch/*``);
* optionally corrects that mismatch (``rollout_correction``: token or sequence TIS, masked IS,
  IcePop; ``tis`` is the older spelling of the TIS presets; needs the recomputed old log-probs):
  per-token advantages are multiplied by a weight of ``exp(old_trainer - old_engine)``
  (:mod:`agentrl.learner.mismatch`); ``tis/capped_frac``, ``mismatch/masked_token_frac``;
* optionally adds ``kl_coef * KL(π_θ || π_ref)`` against a frozen reference model;
* on a Mixture-of-Experts model, optionally replays the engine's routing in every forward
  (``routing_replay``), adds a load-balancing loss (``router_aux_loss_coef``) and reports routing
  metrics (``routing_metrics``): :mod:`agentrl.learner.routing_stats`.

Metrics: ``loss/policy`` (mean over mini-batches), ``loss/clip_frac_tokens``,
``loss/clip_frac_seqs``, ``loss/ratio_mean|min|max``, ``loss/approx_kl``, ``loss/grad_norm``
(before clipping, mean and ``_max`` over mini-batches), ``mismatch/mean_abs|max_abs`` (per token)
and ``mismatch/seq_log_ratio_mean|_abs_max`` (per sequence, the log of the ratio GSPO would see
at the first mini-batch from mismatch alone), ``tis/capped_frac|weight_mean``,
``loss/kl`` and ``kl/token_mean|token_max``, ``perf/train_s|tokens|tokens_per_s|recompute_s``;
MoE models: ``routing/*`` and ``loss/router_aux``.
The trainer's pre-update log-probs are kept in :attr:`Learner.last_trainer_logprobs`.

Precision: parameters, gradients and AdamW states stay float32 (the master weights). With
``dtype="bfloat16"`` the model body runs under ``torch.autocast`` in bf16; the head and the
log-softmax always run in float32 (the GSPO clip range of 3e-4 is below bf16's resolution).
CPU runs keep the default float32. Exported weights are cast back to the dtype the model came in.

Multi-GPU: when ``torch.distributed`` is initialised with more than one rank, the model is
sharded with FSDP2 (``fully_shard`` on every decoder layer and on the log-prob module). Every rank
is given the same whole batch; each mini-batch's sequences are spread over the ranks balanced by
tokens, ranks run the same number of micro-batches (empty ones where they have fewer), and the
averaged gradient equals the single-process one. A reference model is kept whole on every rank.

LoRA (``learner.lora``): adapters on the target linear layers (:mod:`agentrl.learner.lora`), on
either body and under FSDP2; every base parameter is frozen, so only the adapters get gradients,
AdamW state and a place in checkpoints; exported and pushed weights are the merged ones.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from agentrl.errors import ConfigError
from agentrl.learner.config import LearnerConfig
from agentrl.learner.diagnostics import mismatch_stats, trainer_logprobs_by_sample
from agentrl.learner.distributed import (
    StepStats,
    accumulate_locally,
    clip_grad_norm,
    fsdp_layout,
    plan_micro_batches,
    shard,
    world,
)
from agentrl.learner.export import LearnerWeights
from agentrl.learner.logprobs import LogprobModel
from agentrl.learner.lora import inject_adapters
from agentrl.learner.losses import get_loss, kl_to_reference
from agentrl.learner.mismatch import (
    apply_correction,
    record_turn_position_split,
    record_version_split,
    resolve_correction,
)
from agentrl.learner.model import choose_body, wrap_model
from agentrl.learner.packing import (
    PackedBatch,
    TrainSample,
    build_packed_batch,
    masked_values,
)
from agentrl.learner.routing_stats import StepRouting, check_routing_config, finish_metrics

__all__ = ["Learner"]

logger = logging.getLogger(__name__)

_EMPTY = TrainSample([0], [0], [0.0], [-1], [0.0])  # what a rank with no sequence left runs


@dataclass(frozen=True, slots=True)
class _Micro:
    """A micro-batch's device tensors: the packed row, engine log-probs and advantages."""

    batch: PackedBatch
    engine: torch.Tensor  # (n,) per trained token
    advantages: torch.Tensor  # (n,)


class _Prepared:
    """A lazy cache of one step's micro-batches (device tensors), built on first use.

    Built just before its forward, a micro-batch's host-side assembly overlaps the GPU's
    backward pass of the previous one (kernels are queued asynchronously); the recompute pass
    and the update share each build.
    """

    def __init__(
        self,
        build: Callable[[Sequence[TrainSample], list[int]], _Micro],
        samples: Sequence[TrainSample],
    ) -> None:
        self.build, self.samples = build, samples
        self.built: dict[tuple[int, ...], _Micro] = {}

    def get(self, micro: list[int]) -> _Micro:
        key = tuple(micro)
        if key not in self.built:
            self.built[key] = self.build(self.samples, micro)
        return self.built[key]


class Learner(LearnerWeights):
    """Trains a causal LM on rollout batches; see the module docstring.

    Args:
        model: a transformers causal LM, trained in place (its parameters become float32).
        config: optimisation settings.
        ref_model: frozen reference model, needed when ``config.kl_coef > 0``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: LearnerConfig,
        *,
        ref_model: PreTrainedModel | None = None,
    ) -> None:
        if config.kl_coef > 0 and ref_model is None:
            raise ConfigError("ref_model: expected a reference model when kl_coef > 0, got None")
        if getattr(model.config.get_text_config(), "final_logit_softcapping", None):
            raise ConfigError("model: logit soft-capping is not supported by the chunked head")
        torch.manual_seed(config.seed)
        self.config = config
        self.model = model
        self.rank, self.world_size = world()
        self.device = next(model.parameters()).device
        self.export_dtype = next(model.parameters()).dtype
        self.architecture = type(model).__name__  # before FSDP renames the class
        self._moe = check_routing_config(model, config)  # (layers, top_k, experts) or None
        self._routing: StepRouting | None = None  # the current step's, on an MoE model
        self._attn = str(model.config._attn_implementation)
        nn.Module.to(model, torch.float32)  # float32 master weights
        self.lora = config.lora
        if config.lora is not None:  # before sharding: adapters shard with their blocks
            try:
                inject_adapters(model, config.lora, seed=config.seed)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.body = choose_body(config, model, self.device)
        if self.body == "packed":
            self._attn = "packed"  # no mask: the packed body reads the sequence lengths
        elif config.checkpoint_layers or config.selective_recompute:
            raise ConfigError(
                "checkpoint_layers, selective_recompute: expected body='packed' (transformers "
                f"checkpoints all layers or none; use gradient_checkpointing), got {config.body!r}"
            )
        elif config.gradient_checkpointing:  # transformers 5 renamed it
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
        self.module = wrap_model(model, config, self.body, self.device)
        bf16_gather = config.fsdp_gather_dtype == "bfloat16"
        num_params = sum(p.numel() for p in model.parameters())
        self.fsdp_unit, self.fsdp_reduce = fsdp_layout(
            config.fsdp_unit, config.fsdp_reduce, bf16_gather, num_params, self.device
        )
        """The FSDP2 layout this learner uses (``auto`` resolved; no effect in one process)."""
        if self.world_size > 1:
            block_dtype = torch.bfloat16 if bf16_gather else None
            per_block = self.fsdp_unit == "block"
            shard(model, self.module, self.device, self.world_size, block_dtype, per_block)
        self.ref: LogprobModel | None = None
        if ref_model is not None:
            nn.Module.to(ref_model, device=self.device, dtype=torch.float32)
            ref_model.eval().requires_grad_(False)
            self.ref = wrap_model(ref_model, config, self.body, self.device)
        self._loss_fn = get_loss(config.loss)
        eps = {"eps_low": config.eps_low, "eps_high": config.eps_high}
        self._eps = {k: v for k, v in eps.items() if v is not None}
        if config.loss == "dppo":
            self._eps["kl_coef"] = config.dppo_kl_coef
        self._correction = resolve_correction(config)
        self.num_steps = 0
        """Optimizer steps taken."""
        self.weight_version: int | None = None  # set by the trainer: splits mismatch by version
        self.last_trainer_logprobs: list[list[float] | None] = []
        """Per sample of the last batch, the trainer's log-prob of each token as its own
        mini-batch saw it (0.0 where the mask is 0): before any update for the first
        mini-batch, after the earlier mini-batches' updates for the rest (before any update for
        all samples when old log-probs are recomputed)."""
        self.optimizer = self._make_optimizer()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        params = [p for p in self.module.parameters() if p.requires_grad]
        # one fused kernel per step on CUDA (same update as the foreach implementation); DTensor
        # shards (FSDP2) take it too
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(
            params, lr=c.lr, betas=c.betas, weight_decay=c.weight_decay, fused=fused or None
        )

    def reset_optimizer(self) -> None:
        """Start AdamW afresh (moments and step counts), e.g. after a supervised cold start."""
        self.optimizer = self._make_optimizer()

    # ------------------------------------------------------------------ the update

    def step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One update on a rollout batch: ``num_minibatches`` optimizer steps.

        Under ``torch.distributed`` every rank passes the same whole batch.

        Args:
            samples: the rollout batch.

        Returns:
            Metrics (``loss/*``, ``mismatch/*``, ``tis/*``, ``kl/*``, ``perf/*``).
        """
        if not samples:
            raise ValueError("samples: expected at least one sample, got none")
        t0 = time.perf_counter()
        minibatches, micro = self._plan(samples)
        prepared = _Prepared(self._build, samples)
        stats = StepStats()
        c, routing = self.config, None
        flat = [m for mk in micro for m in mk]
        followed: list[list[int]] = []  # the micro-batches the routing metrics follow
        if self._moe is not None:
            routing = StepRouting(
                self.model, c, self._moe, samples, self.device, self.weight_version
            )
            followed = routing.follow(flat)
        self._routing = routing
        old_trainer: dict[int, torch.Tensor] | None = None
        if c.recompute_old_logprobs:
            old_trainer = self._recompute(samples, micro, prepared, stats)
            stats.extreme("perf/recompute_s", time.perf_counter() - t0, high=True)
        if routing is not None:  # pre-update routing no pre-update forward below will see
            seen = len(flat) if c.recompute_old_logprobs else len(micro[0])
            probe = lambda m: self._probe(prepared, m)  # noqa: E731
            routing.capture_missing(followed[0 if routing.replaying else seen :], probe, stats)
        first: dict[int, torch.Tensor] = {}
        self.module.train()
        for k, (indices, micro_k) in enumerate(zip(minibatches, micro, strict=True)):
            num_seqs = max(1, sum(1 for i in indices if samples[i].num_loss_tokens))
            for j, m in enumerate(micro_k):  # mismatch metrics on the first mini-batch
                if self.world_size > 1 and self.fsdp_reduce == "mini_batch":  # ranks agree on
                    accumulate_locally(self.module, on=j < len(micro_k) - 1)  # the count
                with routing.replay(m) if routing is not None else nullcontext():
                    self._micro_step(
                        samples, m, prepared, num_seqs, old_trainer, stats, first, k == 0
                    )
            self._optimizer_step(stats)
        if routing is not None:
            routing.after_update(followed, lambda m: self._probe(prepared, m), stats)
            self._routing = None
        pre = old_trainer if old_trainer is not None else first
        merged, by_sample = stats.merged(trainer_logprobs_by_sample(samples, pre))
        self.last_trainer_logprobs = [
            by_sample[i].tolist() if i in by_sample else None for i in range(len(samples))
        ]
        out = merged.result()
        finish_metrics(out)
        for key in ("loss/policy", "loss/kl"):  # summed over micro-batches and ranks
            if key in out:
                out[key] /= len(minibatches)
        train_s = time.perf_counter() - t0
        tokens = float(sum(len(s.tokens) for s in samples))
        out["perf/train_s"], out["perf/tokens"] = train_s, tokens
        out["perf/tokens_per_s"], out["perf/minibatches"] = tokens / train_s, len(minibatches)
        if self.device.type == "cuda":  # the process's peak on the card: engine and learner
            out["perf/gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def _plan(
        self, samples: Sequence[TrainSample]
    ) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Mini-batches (sample indices) and, for each, this rank's packed micro-batches."""
        n = len(samples)
        m = min(self.config.num_minibatches, n)
        bounds = [round(k * n / m) for k in range(m + 1)]
        lengths = [len(s.tokens) for s in samples]
        minibatches = [list(range(bounds[k], bounds[k + 1])) for k in range(m)]
        budget = self.config.micro_batch_tokens
        micro = [
            plan_micro_batches(indices, lengths, self.rank, self.world_size, budget)
            for indices in minibatches
        ]
        return minibatches, micro

    def _build(self, samples: Sequence[TrainSample], micro: list[int]) -> _Micro:
        sel = [samples[i] for i in micro] or [_EMPTY]
        masks = [s.loss_mask for s in sel]
        batch = build_packed_batch(
            [s.tokens for s in sel], masks, attn_implementation=self._attn, device=self.device
        )
        engine = masked_values([s.logprobs for s in sel], masks, self.device)  # (n,)
        adv = masked_values([s.advantages for s in sel], masks, self.device)  # (n,)
        return _Micro(batch, engine, adv)

    @staticmethod
    def _forward(
        module: LogprobModel, prepared: _Prepared, micro: list[int]
    ) -> tuple[_Micro, torch.Tensor, torch.Tensor]:
        m = prepared.get(micro)
        logprobs, zero = module.run(m.batch)
        return m, logprobs, zero

    @staticmethod
    def _split(
        samples: Sequence[TrainSample], micro: list[int], flat: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        counts = [samples[i].num_loss_tokens for i in micro]
        return dict(zip(micro, flat.detach().split(counts), strict=True))

    def _forward_routed(
        self, prepared: _Prepared, micro: list[int], stats: StepStats, *, pre_update: bool
    ) -> tuple[_Micro, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`_forward` with the step's routing hooks; also returns the aux loss, if any."""
        if self._routing is None:
            return (*self._forward(self.module, prepared, micro), None)
        run = lambda: self._forward(self.module, prepared, micro)  # noqa: E731
        m = prepared.get(micro)
        train = torch.is_grad_enabled()
        return self._routing.run(micro, run, m.batch, stats, pre_update=pre_update, train=train)

    @torch.no_grad()
    def _probe(self, prepared: _Prepared, micro: list[int]) -> tuple[PackedBatch, torch.Tensor]:
        """A no-grad forward with the model's own routing (routing metrics)."""
        self.module.eval()
        m, logprobs, _ = self._forward(self.module, prepared, micro)
        return m.batch, logprobs

    @torch.no_grad()
    def _recompute(
        self,
        samples: Sequence[TrainSample],
        micro: list[list[list[int]]],
        prepared: _Prepared,
        stats: StepStats,
    ) -> dict[int, torch.Tensor]:
        """The trainer's log-probs of every sample this rank trains on, before any update."""
        self.module.eval()
        out: dict[int, torch.Tensor] = {}
        for m in (m for micro_k in micro for m in micro_k):
            with self._routing.replay(m) if self._routing is not None else nullcontext():
                _, logprobs, _, _ = self._forward_routed(prepared, m, stats, pre_update=True)
            out.update(self._split(samples, m, logprobs))
        return out

    def _micro_step(
        self,
        samples: Sequence[TrainSample],
        micro: list[int],
        prepared: _Prepared,
        num_seqs: int,
        old_trainer: dict[int, torch.Tensor] | None,
        stats: StepStats,
        first: dict[int, torch.Tensor] | None,
        mismatch: bool = False,
    ) -> None:
        m, logprobs, zero, aux = self._forward_routed(prepared, micro, stats, pre_update=mismatch)
        batch, engine, adv = m.batch, m.engine, m.advantages
        if batch.targets.numel() == 0:  # nothing trains here; keep the collectives in step
            zero.backward()
            return
        if first is not None:
            first.update(self._split(samples, micro, logprobs))
        old = torch.cat([old_trainer[i] for i in micro]) if old_trainer is not None else engine
        if mismatch:
            trainer = old if old_trainer is not None else logprobs.detach()
            mismatch_stats(batch, trainer, engine, stats)
            sel = [samples[i] for i in micro]
            record_version_split(sel, trainer, engine, self.weight_version, stats)
            record_turn_position_split(sel, trainer, engine, stats)
        if self._correction is not None:  # rollout correction: weights on the advantages
            c = self._correction
            adv = adv * apply_correction(old, engine, batch.seq_index, batch.num_seqs, c, stats)
        loss = self._policy_loss(batch, logprobs, old, adv, num_seqs, stats)
        if aux is not None:  # load balancing, this micro-batch's share of the mini-batch's
            loss = loss + self.config.router_aux_loss_coef * aux * (batch.num_seqs / num_seqs)
        if self.ref is not None and self.config.kl_coef > 0:
            loss = loss + self.config.kl_coef * self._kl(batch, logprobs, num_seqs, stats)
        # FSDP averages gradients over ranks; this loss is this rank's share summed / num_seqs
        (loss * self.world_size + zero).backward()

    def _policy_loss(
        self,
        batch: PackedBatch,
        logprobs: torch.Tensor,
        old: torch.Tensor,
        adv: torch.Tensor,
        num_seqs: int,
        stats: StepStats,
    ) -> torch.Tensor:
        mask = batch.padded_mask()  # (S, W)
        adv_pad = batch.to_padded(adv)  # (S, W)
        if self.config.loss == "gspo":  # one advantage per sequence: its tokens' mean
            adv_pad = adv_pad.sum(-1) / mask.sum(-1).clamp(min=1)  # (S,)
        loss, st = self._loss_fn(
            batch.to_padded(logprobs),
            batch.to_padded(old),
            adv_pad,
            mask,
            **self._eps,
            num_sequences=num_seqs,
        )
        value, per_token = loss.detach(), self.config.loss in ("grpo", "cispo", "dppo")

        def record(stats: StepStats) -> None:  # at the end of the step: no mid-step sync
            stats.add("loss/policy", value.item())
            stats.add("loss/num_tokens", float(st.num_tokens))
            stats.mean("loss/clip_frac_tokens", st.clip_frac_tokens, st.num_tokens)
            stats.mean("loss/approx_kl", st.approx_kl, st.num_tokens)
            stats.mean("loss/clip_frac_seqs", st.clip_frac_seqs, st.num_seqs)
            units = st.num_tokens if per_token else st.num_seqs
            stats.mean("loss/ratio_mean", st.ratio_mean, units)
            if st.num_tokens:
                stats.extreme("loss/ratio_min", st.ratio_min, high=False)
                stats.extreme("loss/ratio_max", st.ratio_max, high=True)

        stats.later(record)
        return loss

    def _kl(
        self, batch: PackedBatch, logprobs: torch.Tensor, num_seqs: int, stats: StepStats
    ) -> torch.Tensor:
        assert self.ref is not None
        with torch.no_grad():
            ref_lp, _ = self.ref.run(batch)
        kl, kst = kl_to_reference(
            batch.to_padded(logprobs),
            batch.to_padded(ref_lp),
            batch.padded_mask(),
            num_sequences=num_seqs,
        )
        value = kl.detach()

        def record(stats: StepStats) -> None:
            stats.add("loss/kl", value.item())
            stats.mean("kl/token_mean", kst.kl_token_mean, kst.num_tokens)
            stats.extreme("kl/token_max", kst.kl_token_max, high=True)

        stats.later(record)
        return kl

    def _optimizer_step(self, stats: StepStats) -> None:
        params = [p for p in self.module.parameters() if p.grad is not None]
        clip = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        value = float(clip_grad_norm(params, clip))
        if math.isfinite(value):
            self.optimizer.step()
            self.num_steps += 1
        else:
            logger.warning("non-finite gradient norm (%s): optimizer step skipped", value)
            stats.add("loss/skipped_steps", 1.0 / self.world_size)
        self.optimizer.zero_grad(set_to_none=True)
        stats.mean("loss/grad_norm", value, 1.0 / self.world_size)
        stats.extreme("loss/grad_norm_max", value, high=True)
