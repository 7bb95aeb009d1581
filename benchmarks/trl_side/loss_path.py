"""TRL's loss path for ``learner_gpu.py`` and ``learner_moe_gpu.py``: GSPO updates through
``trl.GRPOTrainer``'s code.

``trl_update`` builds a real ``GRPOTrainer`` (TRL 1.16) in the GSPO paper's settings and times
updates of the given model. Only generation is replaced: a subclass's
``_generate_and_score_completions`` returns the batch built from the given ids, padded as TRL pads
a generation (prompts left, completions right, TRL's own ``pad``), with the given advantages and no
old log-probs (on-policy: TRL drops them when ``gradient_accumulation_steps`` is a multiple of
``steps_per_generation``). The rest is TRL's and transformers' code, called as ``Trainer``'s inner
loop calls it: ``GRPOTrainer.training_step`` -> ``_prepare_inputs`` (shuffles and splits the
generation batch into micro-batches) -> ``compute_loss`` -> ``_compute_loss`` (fused chunked LM
head, sequence-level ratio, clipped objective) -> ``accelerator.backward``; then
``Trainer._clip_grad_norm``, the prepared AdamW's ``step``, the scheduler's ``step``, ``zero_grad``.

TRL pads the whole generation batch (all sequences of one update) to its longest prompt and
completion before splitting it; ``pad_scope="micro_batch"`` generates one micro-batch at a time
instead (``steps_per_generation=1``, also a TRL setting), so each is padded to its own longest.

Side effects on ``model``: its weights take the optimizer steps and TRL sets its config's pad
token; the forward patches (TRL's fused head, accelerate's autocast) and the checkpointing turned
on here are undone before returning. ``GRPOTrainer.__init__`` reseeds the global RNGs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PadScope = Literal["generation_batch", "micro_batch"]


@dataclass
class TrlResult:
    """What ``trl_update`` measured."""

    step_s: list[float]
    """Wall seconds of each timed update (after warm-up), between ``torch.cuda.synchronize()``s."""
    tokens_per_step: int
    """Real (non-padding) prompt + completion tokens in one update."""
    peak_mem_gib: float
    """``torch.cuda.max_memory_allocated`` over the timed updates, in GiB (0.0 on CPU)."""
    first_loss: float
    """First update's loss: the sum of TRL's micro-batch losses, each divided by their count."""
    first_grad_norm: float
    """Global gradient norm before clipping, of the first update."""
    settings: dict[str, Any]
    """What was used: dtype, checkpointing, micro-batch, epsilons, versions, padding, ..."""


def _trainer_class() -> type:
    """``GRPOTrainer`` fed given batches instead of generating, with no telemetry ping."""
    from trl import GRPOTrainer

    class FedGRPOTrainer(GRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.fed_batches: deque[dict[str, Any]] = deque()
            super().__init__(*args, **kwargs)

        def _send_telemetry(self) -> None:
            # Benchmark hosts have no network; TRL pings the Hub from __init__ otherwise.
            return

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            return self.fed_batches.popleft()

    return FedGRPOTrainer


def _generation_batch(
    prompts: list[list[int]],
    completions: list[list[int]],
    advantages: list[float],
    pad_id: int,
    pad_to_multiple_of: int | None,
    device: torch.device,
) -> dict[str, Any]:
    """The dict ``GRPOTrainer._generate_and_score_completions`` returns, for given ids (no vLLM)."""
    from trl.trainer.utils import pad

    def padded(seqs: list[list[int]], value: int, side: str, mask: bool) -> torch.Tensor:
        tensors = [torch.tensor(s) for s in seqs]
        if mask:
            tensors = [torch.ones_like(t, dtype=torch.long) for t in tensors]
        out = pad(
            tensors, padding_value=value, padding_side=side, pad_to_multiple_of=pad_to_multiple_of
        )
        return out.to(device=device)

    completion_mask = padded(completions, 0, "right", True)  # (B, C)
    return {
        "prompt_ids": padded(prompts, pad_id, "left", False),  # (B, P)
        "prompt_mask": padded(prompts, 0, "left", True),  # (B, P)
        "completion_ids": padded(completions, pad_id, "right", False),  # (B, C)
        "completion_mask": completion_mask,
        "advantages": torch.tensor(advantages, dtype=torch.float32, device=device),  # (B,)
        "num_items_in_batch": completion_mask.sum(),
    }


def _checkpointing(model: PreTrainedModel, on: bool) -> None:
    """Turn activation checkpointing on or off as ``Trainer`` does (newer name first)."""
    if on:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()
    elif hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def _is_checkpointing(model: PreTrainedModel) -> bool:
    name = "is_activation_checkpointing"
    return bool(getattr(model, name) if hasattr(model, name) else model.is_gradient_checkpointing)


def _build_trainer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    n_seqs: int,
    micro_batch_seqs: int,
    pad_scope: PadScope,
    gradient_checkpointing: bool,
    bf16: bool,
    lr: float,
    output_dir: str,
) -> Any:
    """A ``GRPOTrainer`` in GSPO settings, optimizer and scheduler prepared as ``train()`` does."""
    from datasets import Dataset
    from trl import GRPOConfig

    n_micro = n_seqs // micro_batch_seqs
    # Generation-batch padding: one generation per update (TRL's default steps_per_generation =
    # gradient_accumulation_steps). Micro-batch padding: one generation per micro-batch.
    steps_per_generation = n_micro if pad_scope == "generation_batch" else 1
    generation_batch = micro_batch_seqs * steps_per_generation
    args = GRPOConfig(
        output_dir=output_dir,
        importance_sampling_level="sequence",
        loss_type="grpo",
        epsilon=3e-4,
        epsilon_high=4e-4,
        beta=0.0,
        bf16=bf16,
        fp16=False,
        gradient_checkpointing=gradient_checkpointing,
        per_device_train_batch_size=micro_batch_seqs,
        gradient_accumulation_steps=n_micro,
        steps_per_generation=steps_per_generation,
        # Must divide the generation batch; groups are never formed here (advantages are given).
        num_generations=generation_batch,
        num_iterations=1,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        use_vllm=False,
        use_cpu=next(model.parameters()).device.type == "cpu",
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        log_completions=False,
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": ["unused"] * generation_batch})
    trainer = _trainer_class()(
        model=model,
        reward_funcs=_zero_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    if gradient_checkpointing:
        _checkpointing(model, True)
    trainer.create_optimizer()
    wrapped, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    trainer.create_scheduler(num_training_steps=1_000_000, optimizer=trainer.optimizer)
    trainer.model_wrapped = wrapped
    return trainer


def _zero_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward function for the config check; never called (no generation)."""
    return [0.0] * len(completions)


def _update(
    trainer: Any, batches: list[dict[str, Any]], n_micro: int, micro: int
) -> tuple[float, float]:
    """One optimizer step as ``Trainer._inner_training_loop`` runs it; returns (loss, grad norm)."""
    model = trainer.model_wrapped
    trainer.fed_batches.extend(batches)
    trainer.current_gradient_accumulation_steps = n_micro
    rows = [{"prompt": "unused"}] * micro  # what the dataloader would yield; TRL only passes it on
    loss = torch.zeros((), device=trainer.accelerator.device)
    for i in range(n_micro):
        last = i == n_micro - 1
        trainer.accelerator.gradient_state._set_sync_gradients(last)
        sync = contextlib.nullcontext() if last else trainer.accelerator.no_sync(model=model)
        with sync:
            loss += trainer.training_step(model, rows, None)
    grad_norm = trainer._clip_grad_norm(model)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()
    trainer.state.global_step += 1
    assert not trainer.fed_batches, "TRL consumed fewer generation batches than fed"
    return float(loss), float(grad_norm)


def _restore(model: PreTrainedModel, saved_forward: Any, gradient_checkpointing: bool) -> None:
    """Undo the forward patches (TRL's fused head, accelerate's autocast) and checkpointing."""
    model.__dict__.pop("forward", None)
    model.__dict__.pop("_original_forward", None)
    if saved_forward is not None:
        model.forward = saved_forward
    if gradient_checkpointing:
        _checkpointing(model, False)


_ARG_KEYS = (
    "bf16",
    "gradient_checkpointing",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "importance_sampling_level",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "beta",
    "max_grad_norm",
    "learning_rate",
)


def _settings(
    trainer: Any, model: PreTrainedModel, pad_scope: PadScope, padded: int
) -> dict[str, Any]:
    """The GRPOConfig fields that matter here, plus versions, device and what padding cost."""
    import transformers
    import trl
    from trl.kernels.chunked_logprob import _TRITON_AVAILABLE

    device = trainer.accelerator.device
    return {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "attn_implementation": model.config._attn_implementation,
        "checkpointing_active": _is_checkpointing(model),
        "pad_scope": pad_scope,
        "padded_tokens_per_step": padded,
        "optimizer": f"{type(trainer.optimizer.optimizer).__name__} ({trainer.args.optim})",
        "fused_lm_head_triton": device.type == "cuda" and bool(_TRITON_AVAILABLE),
        **{k: getattr(trainer.args, k) for k in _ARG_KEYS},
    }


def _padded_tokens(
    prompts: list[list[int]], completions: list[list[int]], groups: list[range]
) -> int:
    """Tokens the model runs on: each group padded to its longest prompt and completion."""
    return sum(
        len(g) * (max(len(prompts[i]) for i in g) + max(len(completions[i]) for i in g))
        for g in groups
    )


def trl_update(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    completions: list[list[int]],
    advantages: list[float],
    *,
    micro_batch_seqs: int = 4,
    gradient_checkpointing: bool = False,
    bf16: bool = True,
    lr: float = 1e-6,
    warmup: int = 1,
    repeats: int = 3,
    pad_scope: PadScope = "generation_batch",
) -> TrlResult:
    """Time GSPO updates of ``model`` through ``trl.GRPOTrainer``'s loss path and optimizer step.

    Args:
        model: The policy, already on its device and in its dtype; its weights are updated in place.
        tokenizer: Any tokenizer with a pad token (ids are given, never tokenised).
        prompts: Prompt ids, one list per sequence.
        completions: Completion ids, one list per sequence.
        advantages: One advantage per sequence.
        micro_batch_seqs: Sequences per micro-batch (``per_device_train_batch_size``).
        gradient_checkpointing: Activation checkpointing of every layer, as TRL's config does it.
        bf16: TRL's ``bf16`` (accelerate's bf16 autocast around the forward).
        lr: AdamW learning rate (constant schedule).
        warmup: Untimed updates first.
        repeats: Timed updates.
        pad_scope: ``"generation_batch"`` pads all sequences of an update together as TRL does by
            default; ``"micro_batch"`` generates (so pads) one micro-batch at a time.

    Returns:
        The timings, token count, peak memory and first-update loss and gradient norm.

    Raises:
        ValueError: If the lists differ in length, are empty, or the sequence count is not a
            multiple of ``micro_batch_seqs``.
    """
    n = len(prompts)
    if not n or len(completions) != n or len(advantages) != n:
        raise ValueError(
            f"expected equal non-empty prompts/completions/advantages, got {n}, "
            f"{len(completions)}, {len(advantages)}"
        )
    if n % micro_batch_seqs:
        raise ValueError(
            f"expected a multiple of micro_batch_seqs={micro_batch_seqs} sequences, got {n}"
        )
    if warmup + repeats < 1:
        raise ValueError(f"expected at least one update, got warmup={warmup}, repeats={repeats}")
    n_micro = n // micro_batch_seqs
    groups = (
        [range(n)]
        if pad_scope == "generation_batch"
        else [range(i, i + micro_batch_seqs) for i in range(0, n, micro_batch_seqs)]
    )
    saved_forward = model.__dict__.get("forward")
    cuda = next(model.parameters()).device.type == "cuda"
    trainer = None
    with tempfile.TemporaryDirectory(prefix="trl_side_") as out_dir:
        try:
            trainer = _build_trainer(
                model,
                tokenizer,
                n,
                micro_batch_seqs,
                pad_scope,
                gradient_checkpointing,
                bf16,
                lr,
                out_dir,
            )
            step_s, first, peak = _run(
                trainer, prompts, completions, advantages, groups, n_micro, warmup, repeats, cuda
            )
            padded = _padded_tokens(prompts, completions, groups)
            settings = _settings(trainer, model, pad_scope, padded)
        finally:
            if trainer is not None:
                trainer.accelerator.free_memory()
            del trainer
            _restore(model, saved_forward, gradient_checkpointing)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    return TrlResult(step_s, tokens, peak, first[0], first[1], settings)


def _run(
    trainer: Any,
    prompts: list[list[int]],
    completions: list[list[int]],
    advantages: list[float],
    groups: list[range],
    n_micro: int,
    warmup: int,
    repeats: int,
    cuda: bool,
) -> tuple[list[float], tuple[float, float], float]:
    """Warm-up then timed updates; returns (step seconds, first (loss, grad norm), peak GiB)."""
    pad_id = trainer.processing_class.pad_token_id
    device = trainer.accelerator.device
    micro = trainer.args.per_device_train_batch_size
    step_s: list[float] = []
    first = (float("nan"), float("nan"))
    for k in range(warmup + repeats):
        if k == warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        # Built inside the timed region: TRL's generation step pads and moves the batch itself.
        batches = [
            _generation_batch(
                [prompts[i] for i in g],
                [completions[i] for i in g],
                [advantages[i] for i in g],
                pad_id,
                trainer.pad_to_multiple_of,
                device,
            )
            for g in groups
        ]
        loss, grad_norm = _update(trainer, batches, n_micro, micro)
        if cuda:
            torch.cuda.synchronize()
        if k >= warmup:
            step_s.append(time.perf_counter() - t0)
        if k == 0:
            first = (loss, grad_norm)
        logger.info("trl update %d: loss %.6f grad norm %.6f", k, loss, grad_norm)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda and repeats else 0.0
    return step_s, first, peak


def trl_figures(
    build: Callable[[], PreTrainedModel],
    batch: tuple[list[list[int]], list[list[int]], list[float]],
    device: torch.device,
    checkpointing: bool,
    warmup: int,
    repeats: int,
) -> dict[str, Any]:
    """``trl_update`` as the learner benchmarks run it: ``build()``'s model (the shared initial
    weights, float32) in bf16 on a card, micro-batches of 4, lr 1e-6; the median update's
    figures. The model is freed before returning, so the next run starts from an empty card."""
    from agentrl.tiny import build_tiny_tokenizer

    model = build()
    bf16 = device.type == "cuda"
    if bf16:
        model = model.to(torch.bfloat16)
    prompts, completions, advantages = batch
    result = trl_update(
        model,
        build_tiny_tokenizer(),
        prompts,
        completions,
        advantages,
        micro_batch_seqs=4,
        gradient_checkpointing=checkpointing,
        bf16=bf16,
        lr=1e-6,
        warmup=warmup,
        repeats=repeats,
    )
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step_s = statistics.median(result.step_s)
    return dict(
        step_s=step_s,
        tokens_per_s=result.tokens_per_step / step_s,
        peak_gib=result.peak_mem_gib,
        first_loss=result.first_loss,
        first_grad_norm=result.first_grad_norm,
        settings=result.settings,
    )
