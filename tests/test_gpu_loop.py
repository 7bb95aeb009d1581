"""The training loop on a GPU (marked ``gpu``): placement, in-process pushes, gpu-small steps."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.config import load_config
from agentrl.learner import TrainSample
from agentrl.loop.trainer import Trainer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).parents[1]
GPU_SMALL = ROOT / "recipes" / "configs" / "arith-gpu-small.toml"
# an untrained model never answers right; penalising answers without a number gives every step a
# signal, so the learner really trains in these short runs
SIGNAL = "advantages.shapers=[{name: format, penalty: 0.1}]"


def small_config(run_dir: Path, *overrides: str) -> object:
    return load_config(
        GPU_SMALL,
        [f"run_dir={run_dir}", "train.steps=1", "cold_start.steps=0", SIGNAL, *overrides],
    )


def test_every_part_is_on_the_card(tmp_path: Path) -> None:
    """auto: policy, learner, reference-free learner optimizer state and engine on cuda:0."""
    trainer = Trainer(small_config(tmp_path))  # type: ignore[arg-type]
    try:
        card = torch.device("cuda", 0)
        engine = trainer.client
        assert next(trainer.model.parameters()).device == card
        assert trainer.learner.device == card
        assert engine.device == card  # type: ignore[attr-defined]
        assert next(engine.model.parameters()).device == card  # type: ignore[attr-defined]
        assert engine._batcher.decode_steps == 64  # type: ignore[attr-defined]  # the default
        summary = asyncio.run(trainer.run())
        assert summary["steps"] == 1
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert any("perf/tokens" in json.loads(ln) for ln in lines)  # the learner trained
        states = [s for st in trainer.learner.optimizer.state.values() for s in st.values()]
        assert all(s.device == card for s in states if isinstance(s, torch.Tensor) and s.dim())
        assert torch.cuda.max_memory_allocated(card) > 0
    finally:
        asyncio.run(trainer.client.aclose())


def test_engine_logprobs_after_a_push_equal_the_learners(tmp_path: Path) -> None:
    """bf16 policy: after an in-process push the engine scores a batch as the learner does."""
    trainer = Trainer(
        small_config(tmp_path, "model.dtype=bfloat16", "learner.dtype=bfloat16")  # type: ignore[arg-type]
    )

    async def run() -> tuple[list[list[float]], list[list[float]]]:
        await trainer.sync_weights()
        gen = torch.Generator().manual_seed(0)
        rows = [torch.randint(20, 100, (24,), generator=gen).tolist() for _ in range(8)]
        engine: list[list[float]] = [
            await trainer.client.prompt_logprobs(r, temperature=1.0)  # type: ignore[attr-defined]
            for r in rows
        ]
        # one update moves the weights; the push must bring the engine to the new ones
        samples = [
            TrainSample(
                tokens=r,
                loss_mask=[0] * 8 + [1] * 16,
                logprobs=[0.0] * 8 + lp[7:],
                versions=[-1] * 8 + [0] * 16,
                advantages=[1.0 if i % 2 else -1.0] * 24,
            )
            for i, (r, lp) in enumerate(zip(rows, engine, strict=True))
        ]
        trainer.learner.step(samples)
        trainer.step = 1
        await trainer.sync_weights()
        assert trainer.client.weight_version == 1  # type: ignore[attr-defined]
        after = [
            (await trainer.client.prompt_logprobs(r, temperature=1.0))[7:]  # type: ignore[attr-defined]
            for r in rows
        ]
        assert (
            max(
                abs(x - y)
                for a, b in zip(after, engine, strict=True)
                for x, y in zip(a, b[7:], strict=True)
            )
            > 1e-3
        )  # the weights did change
        # the learner's own log-probs: its float32 master weights under bf16 autocast
        ids = torch.tensor(rows, device=trainer.learner.device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = trainer.model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        return after, lp[:, 7:].tolist()

    try:
        engine, learner = asyncio.run(run())
    finally:
        asyncio.run(trainer.client.aclose())
    a, b = torch.tensor(engine), torch.tensor(learner)
    assert a.shape == b.shape == (8, 16)
    # bf16 engine vs bf16-autocast learner: per-token log-probs agree to bf16 precision
    assert (a - b).abs().max().item() < 0.1, (a - b).abs().max().item()
    assert (a - b).abs().mean().item() < 0.02


def test_three_steps_of_gpu_small_through_agentrl_train(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "agentrl.cli",
        "train",
        str(GPU_SMALL),
        f"--run_dir={tmp_path}",
        "--train.steps=3",
        "--train.eval_every=0",
        "--cold_start.steps=50",
        "--env.num_eval_tasks=64",
        f"--{SIGNAL}",
    ]
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "time/train_s" in r]
    assert len(steps) == 3
    assert all(r["time/sync_s"] > 0 for r in steps)
    assert sum("perf/tokens" in r for r in steps) >= 2  # the learner trained on the card
