"""LoRA under torchrun with FSDP2 on CPU (gloo, 2 ranks): both bodies match one process.

One launch runs the transformers body and the packed body in turn: each rank builds the same
tiny model with adapters, trains on its half of every mini-batch, saves a checkpoint and the peft
adapter, takes a second step, resumes from the checkpoint and takes it again. Rank 0 writes the
gathered adapters; they must equal a single-process update, and the resumed step the straight one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_learner_fsdp import make_samples

from agentrl.learner import Learner, LearnerConfig, TrainSample
from agentrl.learner.config import LoraConfig

CONFIG = dict(lr=1e-3, num_minibatches=2, micro_batch_tokens=48, fsdp_unit="block")
LORA = LoraConfig(rank=4, alpha=8.0)
BODIES = ("transformers", "packed")


def _learner(body: str) -> tuple[Learner, list[TrainSample]]:
    """A LoRA learner on the tiny model and the batch (made before FSDP shards the model)."""
    from agentrl.tiny import build_tiny

    model, _ = build_tiny(seed=3)
    samples = make_samples(model)
    return Learner(model, LearnerConfig(**CONFIG, body=body, lora=LORA)), samples


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = {}
    for body in BODIES:
        learner, samples = _learner(body)
        learner.step(samples)
        first = learner.adapter_state()
        merged = learner.state_dict_for_inference()
        learner.save_checkpoint(out_dir / body)
        learner.save_adapter(out_dir / body / "adapter")
        second = learner.step(samples)
        after = learner.adapter_state()
        learner.load_checkpoint(out_dir / body)
        resumed = learner.step(samples)
        result[body] = {
            "first": first,
            "merged": merged,
            "after": after,
            "resumed": learner.adapter_state(),
            "losses": (second["loss/policy"], resumed["loss/policy"]),
        }
    if dist.get_rank() == 0:
        torch.save(result, out_dir / "result.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_adapters_under_fsdp_match_one_process(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    tests = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    dist_out = torch.load(tmp_path / "result.pt", weights_only=False)
    for body in BODIES:
        learner, samples = _learner(body)
        learner.step(samples)
        ours, theirs = learner.adapter_state(), dist_out[body]["first"]
        assert ours.keys() == theirs.keys() and len(ours) == 42
        moved = max(v.abs().max().item() for k, v in ours.items() if ".lora_B." in k)
        assert moved > 1e-3  # B left zero by two AdamW steps of lr 1e-3 each
        for k, v in ours.items():  # AdamW turns rounding in tiny gradients into ~lr / 100
            torch.testing.assert_close(theirs[k], v, atol=2e-5, rtol=0)
        merged = learner.state_dict_for_inference()
        for k, v in merged.items():
            torch.testing.assert_close(dist_out[body]["merged"][k], v, atol=1e-5, rtol=0)
        after, resumed = dist_out[body]["after"], dist_out[body]["resumed"]
        assert all(torch.equal(after[k], resumed[k]) for k in after), body
        second, again = dist_out[body]["losses"]
        assert second == again
        saved = load_file(tmp_path / body / "adapter" / "adapter_model.safetensors")
        assert all(torch.equal(saved[k], dist_out[body]["first"][k]) for k in saved)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
