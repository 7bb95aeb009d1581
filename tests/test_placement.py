"""Placement (``agentrl.loop.placement``): which device each setting names, the KV budget."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.loop.placement import (
    engine_batch_size,
    kv_budget_bytes,
    kv_bytes_per_token,
    resolve_device,
)
from agentrl.loop.trainer import Trainer
from agentrl.tiny import tiny_config


def test_auto_is_the_cpu_without_cuda() -> None:
    assert resolve_device("auto", cuda_available=False, environ={}) == torch.device("cpu")
    assert resolve_device("cpu", cuda_available=True, environ={}) == torch.device("cpu")


def test_auto_and_cuda_take_the_ranks_card() -> None:
    """Under torchrun ``LOCAL_RANK`` picks the card; alone it is card 0; cuda:N is as written."""
    assert resolve_device("auto", cuda_available=True, environ={}) == torch.device("cuda", 0)
    ranked = {"LOCAL_RANK": "3"}
    assert resolve_device("auto", cuda_available=True, environ=ranked) == torch.device("cuda", 3)
    assert resolve_device("cuda", cuda_available=True, environ=ranked) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", cuda_available=True, environ=ranked) == torch.device("cuda", 1)


def test_cuda_without_cuda_and_unknown_settings_are_errors() -> None:
    with pytest.raises(ConfigError, match="needs CUDA"):
        resolve_device("cuda", cuda_available=False, environ={})
    with pytest.raises(ConfigError, match="model.device"):
        resolve_device("gpu", cuda_available=True, environ={})
    with pytest.raises(ConfigError, match="model.device"):
        load_config(overrides=["model.device=gpu"])
    assert load_config().model.device == "auto"
    assert load_config(overrides=["model.device=cuda:2"]).model.device == "cuda:2"


def test_kv_budget_caps_the_engine_rows() -> None:
    """Qwen3-0.6B's shape: 28 layers x 8 KV heads x 128 dims x K and V x 2 bytes per token."""
    cfg = tiny_config(151936, num_hidden_layers=28, num_key_value_heads=8, head_dim=128)
    per_token = kv_bytes_per_token(cfg, torch.bfloat16)
    assert per_token == 2 * 28 * 8 * 128 * 2 == 114688
    budget = kv_budget_bytes(7.0, None, torch.device("cpu"))
    assert budget == 7 * 2**30
    # 7 GiB / (114688 B x 4096 tokens) = 16 rows of 4096 tokens
    assert engine_batch_size(64, 4096, per_token, budget) == 16
    assert engine_batch_size(8, 4096, per_token, budget) == 8  # never more than asked
    assert engine_batch_size(64, 4096, per_token, None) == 64  # no budget
    frac = kv_budget_bytes(None, 0.5, torch.device("cuda", 0), free_bytes=10 * 2**30)
    assert frac == 5 * 2**30
    assert kv_budget_bytes(2.0, 0.5, torch.device("cpu"), free_bytes=10 * 2**30) == 2 * 2**30
    assert kv_budget_bytes(None, 0.5, torch.device("cpu")) is None  # a fraction of a card only
    with pytest.raises(ConfigError, match="needs 0.438 GiB"):
        engine_batch_size(64, 4096, per_token, 2**20)


def test_cpu_host_places_everything_on_the_cpu(tmp_path: Path) -> None:
    """``auto`` on a CPU host: policy, learner and engine on the CPU, a budget caps the rows."""
    config = load_config(
        {
            "run_dir": str(tmp_path),
            "model": {"device": "cpu"},
            "inference": {"max_batch_size": 64, "kv_cache_gib": 0.001},
            "rollout": {"max_total_tokens": 64},
        }
    )
    trainer = Trainer(config)
    try:
        engine = trainer.client
        # tiny: 3 layers x 2 KV heads x 32 dims x K,V x 4 bytes = 1536 B/token; 64 tokens a row
        assert engine.max_batch_size == int(0.001 * 2**30) // (1536 * 64) == 10  # type: ignore[attr-defined]
        assert trainer.learner.device == torch.device("cpu")
        assert engine.device == torch.device("cpu")  # type: ignore[attr-defined]
        assert next(engine.model.parameters()) is not next(trainer.model.parameters())  # type: ignore[attr-defined]
        asyncio.run(trainer.sync_weights())
        assert set(trainer.last_push) == {"time/sync_s"}
    finally:
        asyncio.run(trainer.client.aclose())
