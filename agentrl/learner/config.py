"""Settings of the :class:`~agentrl.learner.Learner` (its module docstring explains them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["LearnerConfig", "LoraConfig"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(BaseModel):
    """Low-rank adapters on the policy (:mod:`agentrl.learner.lora`).

    The base weights are frozen; only the adapters train, get optimizer state and go into
    checkpoints.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    rank: int = Field(16, ge=1, le=4096)
    """The adapters' rank ``r`` (peft's ``r``)."""
    alpha: float = Field(32.0, gt=0)
    """The low-rank term is scaled by ``alpha / rank`` (peft's ``lora_alpha``)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (peft's ``lora_dropout``)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Linear layers that get an adapter, by name as peft matches a list: a module whose name
    is one of these or ends with ``.`` + one of these (``q_proj``, ``self_attn.o_proj``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The adapters' parameter (and AdamW state) dtype; the frozen base stays float32."""


class LearnerConfig(BaseModel):
    """Optimisation settings of the :class:`Learner`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    lr: float = Field(1e-6, ge=0)
    """AdamW learning rate; 0 is the sanity mode (ratios stay 1 up to numerics)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay, on every parameter."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; ``None`` only measures it."""
    num_minibatches: int = Field(4, ge=1)
    """Optimizer steps per rollout batch (split in order; fewer if it has fewer sequences)."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """Token budget of one packed micro-batch (a longer sequence gets a micro-batch alone)."""
    loss: Literal["gspo_token", "gspo", "grpo", "cispo", "dppo"] = "gspo_token"
    """Policy loss; ``gspo`` uses each sequence's mean per-token advantage; ``cispo``
    (MiniMax-M1: REINFORCE weighted by the clipped, stop-gradient ratio) and ``dppo`` (prime-rl's
    default: tokens whose probability moved past the trust region are masked, plus
    ``dppo_kl_coef * (log ratio)^2``) are in :mod:`agentrl.learner.weighted_losses`."""
    eps_low: float | None = Field(None, ge=0)
    """Lower clip range; ``None`` takes the loss's default (3e-4 for GSPO, 0.2 for GRPO, 1.0 for
    CISPO: no lower bound on its weight). DPPO: the probability drop ``δ_low`` (default 0.2)."""
    eps_high: float | None = Field(None, ge=0)
    """Upper clip range; ``None`` takes the loss's default (4e-4 for GSPO, 0.28 for GRPO and
    CISPO). DPPO: the probability rise ``δ_high`` (default 0.2)."""
    dppo_kl_coef: float = Field(1e-3, ge=0)
    """``loss="dppo"``: weight of the squared engine-vs-trainer log-ratio (prime-rl's
    ``kl_tau``)."""
    temperature: float = Field(1.0, ge=0)
    """The engine's sampling temperature (must match it); 0, greedy, counts as 1."""
    logprob_chunk_size: int = Field(1024, ge=1)
    """Tokens per chunk of the head + log-softmax (peak memory grows with it)."""
    recompute_old_logprobs: bool = False
    """Recompute old log-probs with this model before the update instead of the engine's."""
    tis: Literal["token", "sequence"] | None = None
    """Truncated importance sampling against engine/trainer mismatch (needs recompute); the
    same as ``rollout_correction="token_tis"`` / ``"seq_tis"`` with ``tis_cap`` as the cap."""
    tis_cap: float = Field(2.0, gt=0)
    """The cap C of the truncated importance weights of ``tis``."""
    rollout_correction: Literal[
        "none", "token_tis", "seq_tis", "token_mis", "seq_mis", "icepop"
    ] = "none"
    """Correction of the engine-vs-trainer mismatch (needs recompute): with
    ``ρ = exp(old_trainer - old_engine)`` per token and ``ρ_seq`` its geometric mean over a
    sequence, each token's advantage is multiplied by ``min(ρ, high)`` (``token_tis``),
    ``min(ρ_seq, high)`` (``seq_tis``), ``1[low <= ρ <= high]`` (``token_mis``: masked),
    ``1[low <= ρ_seq <= high]`` (``seq_mis``) or ``ρ 1[low <= ρ <= high]`` (``icepop``,
    Ring-1T). :mod:`agentrl.learner.mismatch`."""
    rollout_correction_low: float | None = Field(None, ge=0)
    """The lower bound ``low`` of ``rollout_correction``; ``None``: 0.5 (MIS, IcePop)."""
    rollout_correction_high: float | None = Field(None, gt=0)
    """The upper bound ``high``; ``None``: 2.0 (TIS, MIS), 5.0 (IcePop, Ring-1T's β)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL-to-reference term; 0 needs no reference model."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the model body (``bfloat16``: autocast, float32 master weights)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory)."""
    checkpoint_layers: int | None = Field(None, ge=0)
    """Packed body only: recompute the activations of this many decoder layers (the first
    ones), trading speed for memory layer by layer; ``None`` follows ``gradient_checkpointing``
    (all layers or none)."""
    selective_recompute: bool = False
    """Packed body only: layers that are not checkpointed keep just their matmul and attention
    outputs and recompute norms, rotary, the activation and autocast's weight copies in the
    backward (about a third less activation memory for a few percent of time)."""
    body: Literal["auto", "transformers", "packed"] = "auto"
    """How the model body runs on a packed micro-batch: ``transformers`` (its own forward),
    ``packed`` (:mod:`agentrl.kernels.packed_body`: varlen attention, fusable layers; Qwen3, Qwen2,
    Llama, Qwen3-MoE; one process or FSDP2 ranks) or ``auto`` (packed on CUDA where supported,
    else transformers)."""
    compile: bool = False
    """``torch.compile`` the packed body's per-layer functions (fused norms, rotary, SwiGLU,
    residual adds) and the head's log-softmax and its gradient (one pass over the logits); the
    first micro-batches pay the compile time."""
    compile_tuning: bool = False
    """With ``compile``: let inductor tune each fused kernel's block sizes by coordinate descent
    (a slower first compile, faster steps)."""
    attention_kernel: Literal["flash", "triton"] = "flash"
    """Packed body on CUDA: FlashAttention-2 (torch's varlen attention) or this project's
    Triton kernel (:mod:`agentrl.kernels.attention`: about 1.3x faster forward + backward on an
    H100 for GQA heads of 128; needs Triton)."""
    batch_invariant: bool = False
    """The exact mode (:mod:`agentrl.kernels.invariant`): the packed body and the head run
    batch-invariant kernels (one reduction order whatever the batch), and so does the embedded
    engine, so the log-prob the engine returns for a token equals the learner's bit for bit on
    the same weights (``mismatch/numeric_*`` is 0). CUDA, dense models, the packed body, a bf16
    ``dtype``; ``compile`` and ``attention_kernel`` do not apply to it. Costs speed on both
    sides (``benchmarks/engine_throughput.py --batch-invariant``). Remote SGLang servers are
    not affected."""
    head_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Input dtype of the head matmuls (accumulation, logits and log-softmax stay float32);
    ``auto`` follows ``dtype``."""
    routing_replay: bool = False
    """MoE models: every forward of the update (old-log-prob recompute included) uses the experts
    the engine recorded for each token (``TrainSample.routed_experts``) instead of its own
    top-k: the paper's *Routing Replay*, the GRPO baseline's crutch on MoE models."""
    routing_metrics: bool = True
    """MoE models: report routing every step (``routing/*``: engine vs learner expert agreement,
    expert volatility across the update, ratio statistics split by changed routing); costs a
    no-grad forward after the update (and one before it for mini-batches whose pre-update
    routing no forward already saw). No effect on dense models."""
    routing_metrics_sample: float = Field(1.0, gt=0, le=1)
    """MoE models, with ``routing_metrics``: the share of each step's micro-batches the routing
    metrics follow, taken from the first (those of the first mini-batch, whose pre-update
    routing the update's own forward records for free); the same count on every rank. Each
    followed micro-batch costs one no-grad forward after the update, so ``0.25`` cuts that cost
    to a quarter and measures the metrics on a quarter of the tokens."""
    router_aux_loss_coef: float = Field(0.0, ge=0)
    """MoE models: weight of the switch-style load-balancing loss added to the policy loss
    (``E * sum_e f_e P_e`` per layer, averaged over layers; 1 when balanced)."""
    fsdp_reduce: Literal["auto", "micro_batch", "mini_batch"] = "auto"
    """Several ranks (FSDP2): reduce-scatter the gradients after every micro-batch (memory stays
    sharded) or once per mini-batch (``mini_batch``: the micro-batches accumulate unsharded
    gradients and keep the parameters gathered from the first forward to the last; two
    all-gathers and one reduce-scatter per mini-batch instead of two and one per micro-batch, at
    the memory of one unsharded model copy plus its gradients). ``auto``: ``mini_batch`` when
    that copy fits (:func:`~agentrl.learner.distributed.fsdp_layout`), else ``micro_batch``. No
    effect in one process."""
    fsdp_gather_dtype: Literal["float32", "bfloat16"] = "float32"
    """Several ranks (FSDP2), ``dtype="bfloat16"``, ``fsdp_unit="block"``: the dtype the decoder
    blocks' parameters are all-gathered in (``bfloat16``: half the all-gather traffic; their
    matmuls round them to bf16 anyway, but the norm weights are rounded too). Master weights,
    gradient reduction, and the embedding and head stay float32."""
    fsdp_unit: Literal["auto", "block", "model"] = "auto"
    """Several ranks (FSDP2): shard each decoder block as its own unit (``block``: its parameters
    gathered only around its own forward and backward, overlapped with the neighbours' compute)
    or the whole model as one (``model``: FSDP2's per-unit host work, its hooks around every
    forward and backward, done once per micro-batch instead of once per block; the whole model
    is unsharded while a micro-batch runs). ``auto``: ``model`` with ``fsdp_reduce`` resolving to
    ``mini_batch`` (the parameters stay gathered through the mini-batch anyway), else ``block``.
    Learner scaling with ``model`` + ``mini_batch`` on H200s: 96% on 2 GPUs and 94% on 4
    (Qwen3-0.6B shape), 99% / 97% (1.7B); with ``block`` + ``mini_batch`` + a bf16 gather: 81%
    / 81% (``benchmarks/scaling_gpu.py``)."""
    seed: int = 0
    """Seeds torch's global RNG when the learner is built (dropout, if the model has any)."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of the full weights (``[learner.lora]``); ``None``: full
    fine-tuning."""

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if self.fsdp_gather_dtype == "bfloat16" and self.dtype != "bfloat16":
            raise ValueError(
                "fsdp_gather_dtype: 'bfloat16' needs dtype='bfloat16' (a float32 body would "
                f"compute with rounded weights), got dtype={self.dtype!r}"
            )
        if self.fsdp_gather_dtype == "bfloat16" and self.fsdp_unit == "model":
            raise ValueError(
                "fsdp_gather_dtype: 'bfloat16' applies to the blocks' own units; with "
                "fsdp_unit='model' the one unit holds the float32 head too (use 'float32')"
            )
        if self.batch_invariant and (self.dtype != "bfloat16" or self.body == "transformers"):
            raise ValueError(
                "batch_invariant: needs dtype='bfloat16' and the packed body, got "
                f"dtype={self.dtype!r}, body={self.body!r}"
            )
        if self.lora is not None and self.batch_invariant:
            raise ValueError("lora: the exact mode (batch_invariant) runs no adapters; drop one")
        if self.tis is not None and self.rollout_correction != "none":
            raise ValueError(
                f"tis, rollout_correction: expected one of them, got tis={self.tis!r} and "
                f"rollout_correction={self.rollout_correction!r}"
            )
        if self.rollout_correction != "none" and not self.recompute_old_logprobs:
            raise ValueError(
                "rollout_correction: expected recompute_old_logprobs=True (the correction "
                "compares the trainer's old log-probs with the engine's), got False"
            )
        low, high = self.rollout_correction_low, self.rollout_correction_high
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"rollout_correction_low, rollout_correction_high: expected low <= high, "
                f"got {low}, {high}"
            )
        if self.tis is not None and not self.recompute_old_logprobs:
            raise ValueError(
                "tis: expected recompute_old_logprobs=True (the importance weight compares the "
                "trainer's old log-probs with the engine's), got recompute_old_logprobs=False"
            )
        return self
