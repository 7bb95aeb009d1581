"""How the learner runs a model: the packed body or transformers' forward, and the log-prob head.

:func:`choose_body` picks the body from ``LearnerConfig.body`` and what this host can run;
:func:`wrap_model` puts the chunked log-prob head (and the packed body, with its compile and
recompute levers) around a causal LM.
"""

from __future__ import annotations

import importlib.util

import torch
from transformers import PreTrainedModel

from agentrl.errors import ConfigError
from agentrl.kernels import invariant
from agentrl.kernels.packed_body import PackedBody, unsupported_reason
from agentrl.learner.config import LearnerConfig
from agentrl.learner.logprobs import LogprobModel


def choose_body(config: LearnerConfig, model: PreTrainedModel, device: torch.device) -> str:
    """``packed`` or ``transformers``, from ``config.body`` and what can run here.

    The same with any number of ranks: under FSDP2 the packed body runs each sharded layer
    through the layer module's FSDP2 hooks (:meth:`PackedBody.shard_ready`).
    """
    wanted = config.body
    if wanted == "transformers":
        return wanted
    reason = unsupported_reason(model, moe=True)  # MoE: grouped experts (agentrl.kernels.moe)
    if wanted == "packed" and reason is not None:
        raise ConfigError(f"body: 'packed' does not support {reason}; use body='transformers'")
    if wanted == "auto" and (reason is not None or device.type != "cuda"):
        return "transformers"
    return "packed"


def wrap_model(
    model: PreTrainedModel, config: LearnerConfig, body_name: str, device: torch.device
) -> LogprobModel:
    """``model`` with the chunked log-prob head, on the packed body when ``body_name`` says so."""
    c = config
    autocast = torch.bfloat16 if c.dtype == "bfloat16" else None
    head = c.dtype if c.head_dtype == "auto" else c.head_dtype
    body = None
    if body_name == "packed":
        layers = c.checkpoint_layers
        if layers is None:
            layers = model.config.num_hidden_layers if c.gradient_checkpointing else 0
        attention = "auto"
        if c.attention_kernel == "triton":
            if device.type != "cuda" or importlib.util.find_spec("triton") is None:
                raise ConfigError("attention_kernel: 'triton' needs CUDA and Triton")
            attention = "triton"
        if c.batch_invariant and (why := invariant.available(device)) is not None:
            raise ConfigError(f"batch_invariant: {why}")
        body = PackedBody(
            model,
            batch_invariant=c.batch_invariant,
            attention=attention,
            compile=c.compile,
            checkpoint_layers=layers,
            selective=c.selective_recompute,
            tuned=c.compile_tuning,
        )
    if c.batch_invariant and body is None:
        raise ConfigError("batch_invariant: needs the packed body (body='packed' on CUDA)")
    return LogprobModel(
        model,
        temperature=c.temperature,
        chunk_size=c.logprob_chunk_size,
        autocast_dtype=autocast,
        head_dtype=getattr(torch, head),
        fused_head="tuned" if c.compile and c.compile_tuning else c.compile,
        body=body,
    )
