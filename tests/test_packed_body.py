"""The learner's packed body: same numbers as transformers' forward, per sequence and in grads."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from agentrl.errors import ConfigError
from agentrl.kernels.packed_body import PackedBody, unsupported_reason
from agentrl.learner import Learner, LearnerConfig, TrainSample
from agentrl.learner.logprobs import LogprobModel, chunked_token_logprobs
from agentrl.learner.packing import build_packed_batch
from agentrl.tiny import build_tiny_model

SMALL = dict(
    vocab_size=107,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _model(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    if arch == "qwen3":
        return build_tiny_model(num_hidden_layers=2)
    if arch == "qwen2":  # q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**SMALL)).float()
    # llama3-style rope scaling exercises transformers' own rotary module
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope.update(original_max_position_embeddings=64, rope_theta=500000.0)
    config = LlamaConfig(**SMALL, rope_parameters=rope, attention_bias=True)  # o_proj bias too
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # transformers zero-initialises biases: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def _seqs(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 107, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_packed_row_equals_each_sequence_alone(arch: str) -> None:
    model = _model(arch).eval()
    lengths = [37, 5, 90, 1, 18]
    seqs = _seqs(lengths)
    body = PackedBody(model)
    ids = torch.tensor([t for s in seqs for t in s])[None]
    pos = torch.tensor([p for n in lengths for p in range(n)])[None]
    with torch.no_grad():
        packed = body(ids, pos, lengths)  # (N, H)
        alone = [model.base_model(input_ids=torch.tensor([s])).last_hidden_state[0] for s in seqs]
    torch.testing.assert_close(packed, torch.cat(alone), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_packed_logprobs_and_gradients_equal_transformers(arch: str) -> None:
    lengths = [40, 12, 64]
    seqs = _seqs(lengths, seed=1)
    masks = [[0] * 4 + [1] * (n - 4) for n in lengths]
    results = []
    for use_body in (False, True):
        model = _model(arch)
        body = PackedBody(model) if use_body else None
        attn = "packed" if use_body else "sdpa"
        module = LogprobModel(model, temperature=0.7, chunk_size=16, body=body)
        batch = build_packed_batch(
            seqs, masks, attn_implementation=attn, device=torch.device("cpu")
        )
        if use_body:
            assert batch.attention_mask is None
        logprobs, zero = module.run(batch)
        (logprobs * torch.linspace(-1, 1, logprobs.numel())).sum().add(zero).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logprobs.detach(), grads))
    (lp_hf, g_hf), (lp_packed, g_packed) = results
    torch.testing.assert_close(lp_packed, lp_hf, atol=2e-5, rtol=1e-5)
    assert g_packed.keys() == g_hf.keys() and len(g_hf) > 10
    for name in g_hf:
        torch.testing.assert_close(g_packed[name], g_hf[name], atol=2e-5, rtol=1e-4, msg=name)


def test_checkpointing_some_layers_gives_the_same_gradients() -> None:
    lengths = [30, 50]
    seqs = _seqs(lengths, seed=2)
    grads = []
    for k, selective in ((0, False), (1, False), (2, False), (0, True), (1, True)):
        model = _model("qwen3")
        body = PackedBody(model, checkpoint_layers=k, selective=selective)
        ids = torch.tensor([t for s in seqs for t in s])[None]
        pos = torch.tensor([p for n in lengths for p in range(n)])[None]
        body(ids, pos, lengths).pow(2).mean().backward()
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    assert grads[0].abs().sum() > 0
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="checkpoint_layers"):
        PackedBody(_model("qwen3"), checkpoint_layers=3)


HEAD_CASES = [("cpu", False)] + [
    pytest.param(
        "cuda", fused, marks=pytest.mark.gpu
    )
    for fused in (False, True)
]


@pytest.mark.parametrize(("device", "fused"), HEAD_CASES)
def test_bf16_head_stays_within_bf16_tolerance_of_float64(device: str, fused: bool) -> None:
    torch.manual_seed(3)
    hidden = torch.randn(50, 64, dtype=torch.float64, device=device)
    weight = torch.randn(300, 64, dtype=torch.float64, device=device) * 0.2
    targets = torch.randint(0, 300, (50,), device=device)
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = torch.log_softmax(h64 @ w64.t() / 0.8, -1).gather(1, targets[:, None]).squeeze(1)
    (ref * torch.arange(50, device=device)).sum().backward()
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    lp = chunked_token_logprobs(
        h, w, targets, temperature=0.8, chunk_size=16, head_dtype=torch.bfloat16, fused=fused
    )
    assert lp.dtype == torch.float32
    (lp * torch.arange(50, device=device)).sum().backward()
    pairs = ((lp, ref), (h.grad, h64.grad), (w.grad, w64.grad))
    for low, exact in pairs:
        err = (low.double() - exact.detach()).abs().max() / exact.abs().max()
        assert 1e-6 < err < 2e-2  # rounded like bf16 inputs, nowhere near broken


def _samples(n: int, seed: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 40, (1,), generator=g))
        tokens = torch.randint(3, 107, (length,), generator=g).tolist()
        mask = [0] * 3 + [1] * (length - 3)
        adv = float(torch.randn(1, generator=g))
        lp = [-4.6 * m for m in mask]
        out.append(TrainSample(tokens, mask, lp, [0 if m else -1 for m in mask], [adv] * length))
    return out


def test_learner_with_the_packed_body_matches_transformers() -> None:
    samples = _samples(12, seed=4)
    metrics, weights = [], []
    for body in ("transformers", "packed"):
        config = LearnerConfig(lr=1e-3, num_minibatches=2, micro_batch_tokens=64, body=body)
        learner = Learner(build_tiny_model(num_hidden_layers=2), config)
        assert learner.body == body
        metrics.append(learner.step(samples))
        weights.append(torch.cat([p.detach().flatten() for p in learner.model.parameters()]))
    for key in ("loss/policy", "loss/grad_norm", "loss/ratio_mean", "mismatch/mean_abs"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-4, abs=1e-6), key
    # Adam divides by sqrt(v): where a gradient is ~0, rounding can flip an update's sign
    diff = (weights[1] - weights[0]).abs()
    assert (diff < 1e-6).float().mean() > 0.999 and diff.max() <= 2 * 2 * 1e-3


def test_body_choice_and_errors() -> None:
    assert Learner(build_tiny_model(), LearnerConfig()).body == "transformers"  # auto on CPU
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "GPT2LMHeadModel" in (unsupported_reason(gpt2) or "")
    with pytest.raises(ConfigError, match="packed"):
        Learner(gpt2, LearnerConfig(body="packed"))
    with pytest.raises(ConfigError, match="checkpoint_layers"):
        Learner(build_tiny_model(), LearnerConfig(body="transformers", checkpoint_layers=1))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="triton"):
            Learner(build_tiny_model(), LearnerConfig(body="packed", attention_kernel="triton"))
    learner = Learner(build_tiny_model(), LearnerConfig(body="packed", gradient_checkpointing=True))
    assert learner.module.body is not None and learner.module.body.checkpoint_layers == 3


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["auto", "triton"])
def test_compiled_varlen_bf16_body_is_close_to_float32_on_gpu(attention: str) -> None:
    if attention == "triton":
        pytest.importorskip("triton")
    lengths = [300, 17, 900, 64]
    seqs = _seqs(lengths, seed=5)
    masks = [[0] * 8 + [1] * (n - 8) for n in lengths]
    out = []
    for fast in (False, True):
        model = build_tiny_model(num_hidden_layers=2).cuda()
        body = (
            PackedBody(
                model, compile=True, checkpoint_layers=1, selective=True, attention=attention
            )
            if fast
            else None
        )
        module = LogprobModel(
            model,
            temperature=1.0,
            chunk_size=256,
            autocast_dtype=torch.bfloat16 if fast else None,
            head_dtype=torch.bfloat16 if fast else torch.float32,
            body=body,
        )
        attn = "packed" if fast else "sdpa"
        batch = build_packed_batch(
            seqs, masks, attn_implementation=attn, device=torch.device("cuda")
        )
        lp, zero = module.run(batch)
        (lp.sum() + zero).backward()
        norm = torch.cat(
            [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        ).norm()
        out.append((lp.detach(), float(norm)))
    (ref, ref_norm), (fast_lp, fast_norm) = out
    assert (fast_lp - ref).abs().max() < 5e-2
    assert fast_norm == pytest.approx(ref_norm, rel=2e-2)
