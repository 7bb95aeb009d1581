"""The packed body under FSDP2 (2 ranks) equals the packed body in one process.

CPU: gloo, float32, the packed body's sdpa attention, with ``checkpoint_layers`` and
``selective_recompute`` on, for the tiny Qwen3 and the tiny Qwen3-MoE. The CPU tests run this
file once under ``torch.distributed.run`` (every case in turn); each rank builds the same model
and batch, and rank 0 saves what the ranks computed together:

* the log-probs before any update (``recompute_old_logprobs``: a forward of every sample);
* the gradient of one mini-batch: the learner's optimizer swapped for SGD with ``lr=1`` (no
  clipping), so the weights move by exactly minus the gradient that FSDP2 reduced;
* the weights and metrics after a whole step (AdamW, two mini-batches); on the CPU without
  recomputation, so that the plain path (activations kept across FSDP2's free and re-gather
  of the parameters) is checked too.

The single-process run (in the test process) must match to float32 rounding.

GPU (``gpu``, two cards): NCCL, bf16 autocast, compiled layers, one checkpointed layer and
selective recompute in the others, Triton attention and the bf16 head; the 2-rank log-probs,
loss and gradient must equal a single-GPU run's within bf16 tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from agentrl.learner import Learner, LearnerConfig, TrainSample
from agentrl.tiny import build_tiny, build_tiny_moe

# (prompt, response) lengths: ragged, one sequence with no sampled token. In the two-mini-batch
# step, rank 0 has one micro-batch of the first mini-batch and rank 1 two: rank 0 runs an empty
# one, which must keep FSDP2's collectives paired.
SHAPES = [(10, 50), (8, 22), (6, 20), (9, 15), (5, 30), (40, 0), (7, 13), (12, 27)]
CPU = dict(
    body="packed",
    checkpoint_layers=1,
    selective_recompute=True,
    recompute_old_logprobs=True,
    micro_batch_tokens=64,
)
GPU = dict(
    body="packed",
    dtype="bfloat16",
    compile=True,
    checkpoint_layers=1,
    selective_recompute=True,
    attention_kernel="triton",
    head_dtype="bfloat16",
    recompute_old_logprobs=True,
    micro_batch_tokens=4096,
    # no clipping: bf16 rounding must not move a sequence across the clip range's edge
    eps_low=0.99,
    eps_high=10.0,
)
PLAIN = dict(checkpoint_layers=0, selective_recompute=False)
# bf16 autocast with the blocks' parameters all-gathered in bf16 (half the traffic)
CPU_BF16 = dict(CPU, dtype="bfloat16", fsdp_gather_dtype="bfloat16", eps_low=0.99, eps_high=10.0)


def settings(kind: str, mode: str) -> dict[str, Any]:
    """The learner settings of a run: the MoE runs reduce gradients once per mini-batch, and
    ``moe-model`` shards the whole model as one FSDP2 unit; on a card, the default layout."""
    base = {"cpu": CPU, "cuda": GPU, "cpu-bf16": CPU_BF16}[mode]
    if kind == "moe-model":
        return {**base, "fsdp_reduce": "mini_batch", "fsdp_unit": "model"}
    if kind == "moe":
        return {**base, "fsdp_reduce": "mini_batch", "fsdp_unit": "block"}
    # dense on the CPU: the sharded-memory layout (``auto``, the default, picks model +
    # mini_batch for a model this small; ``moe-model`` and the multi-process train tests run it)
    return base if mode == "cuda" else {**base, "fsdp_reduce": "micro_batch", "fsdp_unit": "block"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def build(kind: str, device: str) -> torch.nn.Module:
    """The same seeded tiny model in every process."""
    model = (build_tiny_moe if kind.startswith("moe") else build_tiny)(seed=3)[0]
    return model.to(device)


def make_samples(vocab: int, scale: int = 1) -> list[TrainSample]:
    """Seeded ragged samples; engine log-probs near the model's so some ratios clip."""
    g = torch.Generator().manual_seed(1)
    out = []
    for p, r in SHAPES:
        p, r = p * scale, r * scale
        tokens = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        mask = [0] * p + [1] * r
        old = (-4.6 + 0.2 * torch.randn(p + r, generator=g)).tolist()
        adv = (torch.randn(1, generator=g) + 0.3 * torch.randn(p + r, generator=g)).tolist()
        old = [o if m else 0.0 for o, m in zip(old, mask, strict=True)]
        out.append(TrainSample(tokens, mask, old, [0 if m else -1 for m in mask], adv))
    return out


def run(kind: str, device: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Log-probs, one mini-batch's gradient, and a whole step: in this process's world."""
    samples = make_samples(100, scale=8 if device == "cuda" else 1)
    model = build(kind, device)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    one = Learner(model, LearnerConfig(**settings, num_minibatches=1, grad_clip=None))
    assert one.body == "packed"
    params = [p for p in one.module.parameters() if p.requires_grad]
    one.optimizer = torch.optim.SGD(params, lr=1.0)  # the step is minus the gradient
    metrics = one.step(samples)
    moved = one.state_dict_for_inference()
    grads = {k: (initial[k] - v.float().cpu()) for k, v in moved.items()}
    step = {**settings, **(PLAIN if device == "cpu" else {}), "lr": 1e-4, "num_minibatches": 2}
    two = Learner(build(kind, device), LearnerConfig(**step))
    return {
        "sharded": [isinstance(layer, FSDPModule) for layer in one.model.base_model.layers],
        "root_sharded": isinstance(one.module, FSDPModule),
        "logprobs": one.last_trainer_logprobs,
        "grads": grads,
        "metrics": metrics,
        "step": two.step(samples),
        "weights": {k: v.float().cpu() for k, v in two.state_dict_for_inference().items()},
    }


def _worker(out_dir: Path, runs: list[tuple[str, str]]) -> None:
    """Each ``(kind, device)`` run in turn on one process group; rank 0 saves each result."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    devices = {device for _, device in runs}
    if "cuda" in devices:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if "cuda" in devices else "gloo")
    for kind, device in runs:
        result = run(kind, device.removesuffix("-bf16"), settings(kind, device))
        if dist.get_rank() == 0:
            torch.save(result, out_dir / f"result-{kind}-{device}.pt")
    dist.destroy_process_group()


def two_ranks(tmp_path: Path, runs: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    """``runs`` on two ranks, in one torchrun launch (a launch costs seconds of imports)."""
    tmp_path.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [__file__, str(tmp_path), *(f"{kind}:{device}" for kind, device in runs)]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        (kind, device): torch.load(tmp_path / f"result-{kind}-{device}.pt", weights_only=False)
        for kind, device in runs
    }


CPU_RUNS = [("dense", "cpu"), ("moe", "cpu"), ("moe-model", "cpu"), ("dense", "cpu-bf16")]


@pytest.fixture(scope="module")
def cpu_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """The CPU tests' two-rank results, all from one launch."""
    return two_ranks(tmp_path_factory.mktemp("packed_fsdp"), CPU_RUNS)


def flat_logprobs(result: dict[str, Any]) -> torch.Tensor:
    rows = result["logprobs"]
    assert all(r is not None for r in rows)
    return torch.tensor([x for r in rows for x in r])


@pytest.mark.parametrize("kind", ["dense", "moe", "moe-model"])
def test_packed_body_under_fsdp_matches_one_process(cpu_ranks: dict, kind: str) -> None:
    dist = cpu_ranks[kind, "cpu"]
    torch.set_num_threads(1)
    one = run(kind, "cpu", settings(kind, "cpu"))

    assert not any(one["sharded"])
    if kind == "moe-model":  # one unit: the root alone, its layers plain modules inside it
        assert dist["root_sharded"] and not any(dist["sharded"])
    else:
        assert all(dist["sharded"])  # each layer its own FSDP2 unit
    lp, lp_dist = flat_logprobs(one), flat_logprobs(dist)
    assert lp.abs().max() > 1  # real log-probs, not zeros
    torch.testing.assert_close(lp_dist, lp, atol=2e-6, rtol=0)  # a few float32 ulps
    norm = max(g.abs().max().item() for g in one["grads"].values())
    assert norm > 1e-3  # a gradient reached the weights
    for k, g in one["grads"].items():
        if k.endswith("mlp.gate.weight") or "experts" in k or "layers.0." in k:
            assert g.abs().max() > 0, k  # router, experts, the checkpointed layer: trained
        torch.testing.assert_close(dist["grads"][k], g, atol=1e-5 * norm, rtol=0, msg=k)
    for key in ("loss/policy", "loss/grad_norm", "loss/num_tokens", "loss/clip_frac_tokens"):
        assert dist["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
        assert dist["step"][key] == pytest.approx(one["step"][key], rel=1e-5, abs=1e-7), key
    assert one["step"]["loss/clip_frac_tokens"] > 0  # some ratios out of the clip range
    for k, w in one["weights"].items():
        torch.testing.assert_close(dist["weights"][k], w, atol=1e-5, rtol=0, msg=k)


def test_bf16_gathers_under_fsdp_stay_within_bf16_rounding(cpu_ranks: dict) -> None:
    """``fsdp_gather_dtype="bfloat16"``: the blocks compute with bf16-rounded weights (norms
    included), so the update moves off the float32-gathered one by bf16 rounding, not more."""
    dist = cpu_ranks["dense", "cpu-bf16"]
    torch.set_num_threads(1)
    one = run("dense", "cpu", CPU_BF16)  # one process gathers nothing: float32 weights
    lp, lp_dist = flat_logprobs(one), flat_logprobs(dist)
    mask = lp != 0
    assert (lp_dist[mask] - lp[mask]).abs().max() < 5e-2
    g = torch.cat([v.flatten() for v in one["grads"].values()])
    g_dist = torch.cat([dist["grads"][k].flatten() for k in one["grads"]])
    rel = ((g_dist - g).norm() / g.norm()).item()
    assert 1e-6 < rel < 0.05  # rounded (the option took effect), and only by rounding
    for key in ("loss/policy", "loss/grad_norm"):
        assert dist["metrics"][key] == pytest.approx(one["metrics"][key], rel=2e-2, abs=5e-3), key


@pytest.mark.gpu
def test_packed_body_under_fsdp_matches_one_gpu(tmp_path: Path) -> None:
    """NCCL, bf16, compile + selective recompute + Triton attention + bf16 head, two cards."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    pytest.importorskip("triton")
    one_dir = tmp_path / "one"  # a process of its own: this one holds no card memory
    one_dir.mkdir()
    cmd = [sys.executable, __file__, str(one_dir), "dense", "cuda-single"]
    # beside the two ranks (each process compiles first, for about a minute)
    log = tmp_path / "one.log"  # a file, not a pipe that nobody reads while the ranks run
    with log.open("w") as out:
        single = subprocess.Popen(cmd, env={**ENV, "CUDA_VISIBLE_DEVICES": "0"}, stdout=out,
                                  stderr=subprocess.STDOUT)  # fmt: skip
        try:
            dist = two_ranks(tmp_path / "two", [("dense", "cuda")])["dense", "cuda"]
            single.wait(timeout=600)
        finally:
            single.kill()
    assert single.returncode == 0, log.read_text()[-4000:]
    one = torch.load(one_dir / "result.pt", weights_only=False)
    lp, lp_dist = flat_logprobs(one), flat_logprobs(dist)
    mask = lp != 0
    # bf16 body: each rank packs other sequences together, so the matmuls round differently;
    # a sharding bug (a layer on wrong or partial weights) moves log-probs by far more
    assert (lp_dist[mask] - lp[mask]).abs().max() < 5e-2
    assert (lp_dist[mask] - lp[mask]).abs().mean() < 5e-3
    for key in ("loss/policy", "loss/grad_norm"):
        assert dist["metrics"][key] == pytest.approx(one["metrics"][key], rel=2e-2, abs=5e-3), key
    # a gradient missing a rank's share (or summed instead of averaged) is off by about half
    g = torch.cat([v.flatten() for v in one["grads"].values()])
    g_dist = torch.cat([dist["grads"][k].flatten() for k in one["grads"]])
    assert g.norm() > 0 and (g_dist - g).norm() / g.norm() < 0.1


if __name__ == "__main__":
    if sys.argv[3:] == ["cuda-single"]:  # the single-GPU reference, in a process of its own
        torch.save(run(sys.argv[2], "cuda", settings(sys.argv[2], "cuda")),
                   Path(sys.argv[1]) / "result.pt")  # fmt: skip
    else:  # OUT_DIR KIND:DEVICE ...
        _worker(Path(sys.argv[1]), [(k, d) for k, d in (a.split(":") for a in sys.argv[2:])])
