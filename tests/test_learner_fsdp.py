"""The learner under torchrun with FSDP2 on CPU (gloo, 2 ranks) matches one process.

The test runs this file under ``torch.distributed.run``: each rank builds the same tiny model and
batch, trains on its token-balanced half of every mini-batch, and rank 0 saves the gathered
weights and metrics. They must equal a single-process update on the whole batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from agentrl.learner import Learner, LearnerConfig, TrainSample
from agentrl.tiny import build_tiny

# gradients reduced once per mini-batch (``fsdp_reduce``) with per-block units, the blocks kept
# gathered through the mini-batch: still equal to one process
CONFIG = dict(
    lr=1e-4, num_minibatches=4, micro_batch_tokens=48, grad_clip=1.0, fsdp_reduce="mini_batch",
    fsdp_unit="block",
)
# (prompt, response) lengths. Mini-batches are [0, 1], [2, 3], [4], [5, 6]: in the third, rank 1
# has no sequence and runs an empty micro-batch; in the last, rank 0 gets sample 5 (the longer),
# which has no sampled token. Both paths must keep the FSDP collectives paired.
SHAPES = [(10, 50), (8, 22), (6, 20), (9, 15), (5, 30), (40, 0), (7, 13)]


def make_samples(model: torch.nn.Module) -> list[TrainSample]:
    """Ragged sequences; engine log-probs = teacher-forced ones plus noise (so some clip)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for p, r in SHAPES:
        tokens = torch.randint(3, 100, (p + r,), generator=g).tolist()
        mask = [0] * p + [1] * r
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
        noise = 1e-3 * torch.randn(p + r, generator=g)
        old = [
            lp[t - 1, tokens[t]].item() + noise[t].item() if mask[t] else 0.0 for t in range(p + r)
        ]
        adv = (torch.randn(1, generator=g) + 0.3 * torch.randn(p + r, generator=g)).tolist()
        out.append(TrainSample(tokens, mask, old, [0 if m else -1 for m in mask], adv))
    return out


def _clip_both_ways(module: torch.nn.Module) -> dict[str, object]:
    """The learner's clipping of sharded gradients vs torch's generic DTensor path."""
    from agentrl.learner.distributed import clip_grad_norm

    params = list(module.parameters())
    out: dict[str, object] = {}
    for name, clip in (("ours", clip_grad_norm), ("torch", torch.nn.utils.clip_grad_norm_)):
        for p in params:  # the same known gradients each time: 3x the weights
            p.grad = p.detach() * 3.0
        norm = clip(params, 0.5)
        out[name] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        out[name + "_grads"] = [p.grad.full_tensor() for p in params]
    out["sharded"] = all(hasattr(p.grad, "to_local") for p in params)
    return out


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, _ = build_tiny(seed=3)
    samples = make_samples(model)
    learner = Learner(model, LearnerConfig(**CONFIG))
    metrics = learner.step(samples)
    weights = learner.state_dict_for_inference()
    learner.save_pretrained(out_dir / "hf")
    learner.save_checkpoint(out_dir / "ckpt")
    second = learner.step(samples)
    after_second = learner.state_dict_for_inference()
    learner.load_checkpoint(out_dir / "ckpt")
    resumed = learner.step(samples)
    after_resumed = learner.state_dict_for_inference()
    clipped = _clip_both_ways(learner.module)
    if dist.get_rank() == 0:
        torch.save(
            {
                "metrics": metrics,
                "weights": weights,
                "second": second,
                "after_second": after_second,
                "resumed": resumed,
                "after_resumed": after_resumed,
                "trainer_logprobs": learner.last_trainer_logprobs,
                "clipped": clipped,
            },
            out_dir / "result.pt",
        )
    dist.destroy_process_group()


def test_fsdp_two_ranks_match_single_process(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    dist_out = torch.load(tmp_path / "result.pt", weights_only=False)

    model, _ = build_tiny(seed=3)
    samples = make_samples(model)
    learner = Learner(model, LearnerConfig(**CONFIG))
    metrics = learner.step(samples)
    weights = learner.state_dict_for_inference()
    initial = build_tiny(seed=3)[0].state_dict()

    moved = max((weights[k] - initial[k]).abs().max().item() for k in weights)
    assert moved > 1e-4  # 4 AdamW steps of lr 1e-4 moved the weights measurably
    for k, v in weights.items():
        torch.testing.assert_close(dist_out["weights"][k], v, atol=1e-5, rtol=0)
    for key in (
        "loss/policy",
        "loss/grad_norm",
        "loss/clip_frac_tokens",
        "loss/ratio_mean",
        "mismatch/mean_abs",
        "mismatch/max_abs",
        "loss/num_tokens",
    ):
        assert abs(dist_out["metrics"][key] - metrics[key]) < 1e-5, key
    assert metrics["loss/clip_frac_tokens"] > 0  # the noise put some sequences out of range
    assert len(dist_out["trainer_logprobs"]) == len(samples)

    # the clipping of sharded gradients (local norms, one all-reduce) equals torch's
    clipped = dist_out["clipped"]
    assert clipped["sharded"] and clipped["ours"] > 0.5  # the clip took effect
    assert abs(clipped["ours"] - clipped["torch"]) <= 1e-5 * clipped["torch"]
    for ours, theirs in zip(clipped["ours_grads"], clipped["torch_grads"], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=1e-5)

    # the checkpoint written under FSDP resumes exactly, and the HF export loads
    for k in weights:
        assert torch.equal(dist_out["after_resumed"][k], dist_out["after_second"][k]), k
    assert dist_out["resumed"]["loss/policy"] == dist_out["second"]["loss/policy"]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for k, v in exported.items():
        torch.testing.assert_close(v, dist_out["weights"][k], atol=0, rtol=0)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


def test_micro_batch_plans_agree_across_ranks_without_talking() -> None:
    """Every rank's plan has as many micro-batches (padded with empty ones), the ranks' shares
    partition the mini-batch, each micro-batch keeps to the budget and the loads balance."""
    from agentrl.learner.distributed import plan_micro_batches

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(10, 900, (61,), generator=g).tolist()
    indices = list(range(3, 58))
    for world in (1, 2, 3, 4):
        plans = [plan_micro_batches(indices, lengths, r, world, 1000) for r in range(world)]
        assert len({len(p) for p in plans}) == 1, [len(p) for p in plans]
        taken = [i for p in plans for m in p for i in m]
        assert sorted(taken) == indices
        assert all(sum(lengths[i] for i in m) <= 1000 for p in plans for m in p)
        loads = [sum(lengths[i] for m in p for i in m) for p in plans]
        assert max(loads) - min(loads) <= max(lengths[i] for i in indices)
    padded = [plan_micro_batches([0, 1, 2], [900, 600, 500], r, 2, 1000) for r in range(2)]
    assert padded == [[[0], []], [[1], [2]]]


def test_auto_fsdp_layout_keeps_large_models_sharded() -> None:
    """``auto``: one unit and one reduction per mini-batch while the unsharded float32 model and
    its gradients take at most a quarter of the memory; per-block units and per-micro-batch
    reductions beyond; explicit choices pass through; a bf16 gather keeps per-block units."""
    from agentrl.learner.distributed import fsdp_layout

    cpu = torch.device("cpu")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    small, large = int(total / 32) - 1, int(total / 32) + 1  # 8 bytes a parameter
    assert fsdp_layout("auto", "auto", False, small, cpu) == ("model", "mini_batch")
    assert fsdp_layout("auto", "auto", False, large, cpu) == ("block", "micro_batch")
    assert fsdp_layout("auto", "auto", True, small, cpu) == ("block", "mini_batch")
    assert fsdp_layout("auto", "micro_batch", False, small, cpu) == ("block", "micro_batch")
    assert fsdp_layout("block", "mini_batch", False, large, cpu) == ("block", "mini_batch")
    assert fsdp_layout("model", "auto", False, large, cpu) == ("model", "micro_batch")
