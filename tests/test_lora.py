"""LoRA on the learner (``learner.lora``): adapters on the tiny Qwen3 model, on CPU in float32.

Only adapters train; both bodies compute the same adapted model; a checkpoint holds the
adapters and resumes exactly; the adapter in peft's layout loads with peft itself and gives
the learner's logits, and so do the merged weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_learner import make_samples
from torch import nn

from agentrl.errors import ConfigError
from agentrl.learner import Learner, LearnerConfig
from agentrl.learner.config import LoraConfig
from agentrl.learner.export import checkpoint_weights
from agentrl.learner.lora import (
    LoraLinear,
    adapter_state,
    inject_adapters,
    merge_adapter_into,
)
from agentrl.learner.packing import build_packed_batch
from agentrl.tiny import build_tiny

IDS = [1, 39, 37, 23, 36, 2, 1, 19, 37, 37, 27, 38, 19, 32, 58, 21, 37]
LORA = LoraConfig(rank=4, alpha=8.0)


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([IDS])).logits[0].float()


def perturb(model: nn.Module, seed: int = 5) -> None:
    """Non-zero ``B`` (peft starts it at zero): the adapters then change the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoraLinear):
                m.lora_B.weight.copy_(0.05 * torch.randn(m.lora_B.weight.shape, generator=g))


def test_adapters_start_as_the_base_and_only_they_train() -> None:
    model, _ = build_tiny()
    before = logits(model)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    learner = Learner(model, LearnerConfig(lr=1e-2, lora=LORA))
    assert torch.equal(logits(model), before)  # B = 0: the adapted model is the base
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * 7 * model.config.num_hidden_layers  # 7 projections a layer
    opt = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert opt == {id(p) for p in model.parameters() if p.requires_grad}
    learner.step(make_samples(model, n=6))
    after = model.state_dict()
    for k, v in base.items():
        assert torch.equal(after[k], v), k  # the base, bit for bit
    assert all(not torch.equal(after[n], torch.zeros_like(after[n])) for n in trained)
    assert not torch.equal(logits(model), before)
    assert len(learner.optimizer.state) == len(trained)


def test_inject_is_seeded_and_matches_targets() -> None:
    a, b = build_tiny()[0], build_tiny()[0]
    names = inject_adapters(a, LoraConfig(target_modules=["q_proj", "self_attn.o_proj"]), seed=1)
    assert names == [
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1, 2) for p in ("q_proj", "o_proj")
    ]
    inject_adapters(b, LoraConfig(target_modules=["q_proj", "self_attn.o_proj"]), seed=1)
    sa, sb = adapter_state(a), adapter_state(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    a_q = sa["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    fan_in = a.config.hidden_size
    bound = 1 / fan_in**0.5  # kaiming-uniform(a=sqrt 5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert a_q.shape == (16, fan_in) and 0.9 * bound < a_q.abs().max() <= bound
    with pytest.raises(ConfigError, match="no linear layer"):
        Learner(build_tiny()[0], LearnerConfig(lora=LoraConfig(target_modules=["nope"])))


def test_packed_body_equals_transformers_with_adapters() -> None:
    samples = make_samples(build_tiny()[0], n=5)
    out = {}
    for body in ("transformers", "packed"):
        model, _ = build_tiny()
        learner = Learner(model, LearnerConfig(lora=LORA, body=body))
        assert learner.body == body
        perturb(model)
        batch = build_packed_batch(
            [s.tokens for s in samples],
            [s.loss_mask for s in samples],
            attn_implementation=learner._attn,
            device=torch.device("cpu"),
        )
        logprobs, zero = learner.module.run(batch)
        (logprobs.sum() + zero).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[body] = (logprobs.detach(), grads)
    (lp_t, g_t), (lp_p, g_p) = out["transformers"], out["packed"]
    torch.testing.assert_close(lp_p, lp_t, atol=1e-5, rtol=0)
    assert g_t.keys() == g_p.keys() and len(g_t) == 42
    for k in g_t:
        torch.testing.assert_close(g_p[k], g_t[k], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("body", ["transformers", "packed"])
def test_resume_with_adapters_is_exact(tmp_path: Path, body: str) -> None:
    batches = [make_samples(build_tiny()[0], n=6, seed=s) for s in (1, 2, 3)]
    config = LearnerConfig(lr=1e-2, num_minibatches=2, body=body, lora=LORA.model_copy(
        update={"dropout": 0.1}))  # fmt: skip
    model, _ = build_tiny()
    learner = Learner(model, config)
    for b in batches[:2]:
        learner.step(b)
    learner.save_checkpoint(tmp_path)
    straight = learner.step(batches[2])
    expect = adapter_state(model)

    saved = checkpoint_weights(tmp_path / "learner")  # the adapters alone, not the base
    assert len(saved) == 42 and all(".lora_" in k for k in saved)
    meta = json.loads((tmp_path / "learner" / "meta.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["num_steps"] == 4

    fresh_model, _ = build_tiny()  # the base comes from the model, the adapters from disk
    fresh = Learner(fresh_model, config.model_copy(update={"seed": 9}))
    fresh.load_checkpoint(tmp_path)
    resumed = fresh.step(batches[2])
    got = adapter_state(fresh_model)
    assert all(torch.equal(got[k], expect[k]) for k in expect)
    assert resumed["loss/policy"] == straight["loss/policy"]
    assert resumed["loss/grad_norm"] == straight["loss/grad_norm"]

    full = Learner(build_tiny()[0], LearnerConfig(lr=1e-2))  # no adapters: refused, one line
    with pytest.raises(ValueError, match="trained with learner.lora="):
        full.load_checkpoint(tmp_path)


def test_peft_layout_and_merged_weights_give_the_learners_logits(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    model, _ = build_tiny()
    learner = Learner(model, LearnerConfig(lr=1e-2, lora=LORA))
    learner.step(make_samples(model, n=6))
    perturb(model)  # larger adapters than one step makes: the comparison bites
    ours = logits(model.eval())
    assert (ours - logits(build_tiny()[0])).abs().max() > 1e-2

    path = learner.save_adapter(tmp_path / "adapter", base_model="tiny")
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
    loaded = peft.PeftModel.from_pretrained(build_tiny()[0], path).eval()
    torch.testing.assert_close(logits(loaded), ours, atol=1e-5, rtol=0)

    merged = learner.state_dict_for_inference()
    plain = build_tiny()[0]
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(logits(plain.eval()), ours, atol=1e-5, rtol=0)
    again = merge_adapter_into(build_tiny()[0].state_dict(), learner.adapter_state(), 2.0)
    assert all(torch.equal(again[k], merged[k]) for k in merged)  # the same merge, by hand
    live = learner.live_weights()
    assert all(torch.equal(live[k], merged[k]) for k in merged)


def test_merge_refuses_a_mismatched_adapter() -> None:
    weights = build_tiny()[0].state_dict()
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    out_f, in_f = weights["model.layers.0.self_attn.q_proj.weight"].shape
    a, b = torch.zeros(4, in_f), torch.zeros(out_f, 4)
    with pytest.raises(ValueError, match="lacks lora_A or lora_B"):
        merge_adapter_into(dict(weights), {f"{key}.lora_A.weight": a}, 1.0)
    with pytest.raises(ValueError, match="has A"):
        merge_adapter_into(
            dict(weights), {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b[:3]}, 1.0
        )
    with pytest.raises(ValueError, match="base has no"):
        merge_adapter_into({}, {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}, 1.0)


def test_export_run_writes_the_merged_model_and_the_peft_adapter(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from agentrl.loop.checkpoints import begin, commit
    from agentrl.loop.export_run import export_run

    run = tmp_path / "run"
    run.mkdir()
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    config = f"seed: 3\nmodel:\n  path: tiny\nlearner:\n  lora: {json.dumps(lora)}\n"
    (run / "config.yaml").write_text(config)
    model, _ = build_tiny(seed=3)  # the run's base, as load_policy builds it
    learner = Learner(model, LearnerConfig(lr=1e-2, lora=LoraConfig.model_validate(lora)))
    learner.step(make_samples(model, n=6))
    perturb(model)
    ours = logits(model.eval())
    tmp = begin(run / "checkpoints", 1)
    learner.save_checkpoint(tmp)
    commit(tmp, 1, keep=None)

    done = export_run(run, tmp_path / "out", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(done.path).eval()
    torch.testing.assert_close(logits(merged), ours, atol=1e-5, rtol=0)
    adapter = done.path / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert cfg["base_model_name_or_path"] == "tiny"
    loaded = peft.PeftModel.from_pretrained(build_tiny(seed=3)[0], adapter).eval()
    torch.testing.assert_close(logits(loaded), ours, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_packed_body_with_adapters_on_cuda_matches_transformers(compile: bool) -> None:
    """CUDA, bf16 autocast: varlen attention (compiled layers or not) with adapters."""
    samples = make_samples(build_tiny()[0], n=6)
    out = {}
    for body in ("transformers", "packed"):
        model = build_tiny()[0].cuda()
        config = LearnerConfig(lora=LORA, body=body, dtype="bfloat16", compile=compile)
        learner = Learner(model, config)
        perturb(model)
        batch = build_packed_batch(
            [s.tokens for s in samples],
            [s.loss_mask for s in samples],
            attn_implementation=learner._attn,
            device=torch.device("cuda"),
        )
        logprobs, zero = learner.module.run(batch)
        (logprobs.sum() + zero).backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        out[body] = (logprobs.detach().float(), grads)
        metrics = learner.step(samples)  # a whole update runs too
        assert metrics["loss/grad_norm"] > 0
    (lp_t, g_t), (lp_p, g_p) = out["transformers"], out["packed"]
    torch.testing.assert_close(lp_p, lp_t, atol=0.05, rtol=0)  # bf16 matmuls, two orders
    assert g_t.keys() == g_p.keys() and len(g_t) == 42
    for k in g_t:
        cos = torch.nn.functional.cosine_similarity(g_p[k].flatten(), g_t[k].flatten(), dim=0)
        assert cos > 0.99, k
