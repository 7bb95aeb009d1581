"""The learner on Mixture-of-Experts models (CPU, float32): routing replay, metrics, aux loss.

Engine routing records are made here the way the engine makes them: a forward of the
sequence's first ``n - 1`` tokens on the same weights, recorded with :class:`RoutingCapture`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.learner import Learner, LearnerConfig, TrainSample, samples_from_trajectories
from agentrl.learner.routing_stats import packed_experts, router_aux_loss
from agentrl.routing import RoutingCapture, routers
from agentrl.tiny import build_tiny, build_tiny_moe

PROMPT = 5


def cfg(**kw: Any) -> LearnerConfig:
    base: dict[str, Any] = {"lr": 0.0, "num_minibatches": 1, "micro_batch_tokens": 512}
    return LearnerConfig(**{**base, **kw})


@torch.no_grad()
def record(model: Any, tokens: list[int]) -> tuple[np.ndarray, list[float]]:
    """The engine's view of ``tokens``: routing of the first n-1 tokens, log-prob of each token."""
    ids = torch.tensor([tokens[:-1]])
    if not routers(model):  # a dense model: no routing to record
        logits = model(ids).logits[0].float()
        experts = np.zeros((0, 0, 0), np.int16)
    else:
        with RoutingCapture(model) as cap:
            logits = model(ids).logits[0].float()
        experts = cap.pop().numpy()
    lp = F.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    return experts, [0.0, *lp.tolist()]


def make_samples(
    model: Any, n: int = 6, resp: int = 8, seed: int = 0, routed: bool = True
) -> list[TrainSample]:
    """``n`` sequences of random tokens; prompts untrained, responses with +-1 advantages."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = []
    for i in range(n):
        length = PROMPT + resp - (i % 3)
        tokens = torch.randint(10, vocab, (length,), generator=g).tolist()
        experts, lp = record(model, tokens)
        mask = [0] * PROMPT + [1] * (length - PROMPT)
        adv = 1.0 if i % 2 == 0 else -1.0
        out.append(
            TrainSample(
                tokens=tokens,
                loss_mask=mask,
                logprobs=[v if m else 0.0 for v, m in zip(lp, mask, strict=True)],
                versions=[0 if m else -1 for m in mask],
                advantages=[adv * m for m in mask],
                routed_experts=experts if routed else None,
            )
        )
    return out


# ----------------------------------------------------------------------------- replay, by hand


def two_experts(seed: int = 0) -> Any:
    model, _ = build_tiny_moe(
        seed=seed, num_hidden_layers=1, num_experts=2, num_experts_per_tok=1, norm_topk_prob=False
    )
    return model


@torch.no_grad()
def hand_logprobs(model: Any, tokens: list[int], forced: torch.Tensor) -> torch.Tensor:
    """Log-prob of tokens[1:] of a one-layer, two-expert, top-1 model, through ``forced`` experts.

    Attention comes from the model's own module; the MoE block is written out: the gate weight
    is the router's softmax at the forced expert (no renormalisation), the expert a SwiGLU.
    """
    m = model.model
    ids = torch.tensor([tokens])
    h = m.embed_tokens(ids)
    pos = torch.arange(len(tokens))[None]
    layer = m.layers[0]
    attn, _ = layer.self_attn(
        hidden_states=layer.input_layernorm(h),
        position_embeddings=m.rotary_emb(h, pos),
        attention_mask=None,  # causal
    )
    h1 = (h + attn)[0]  # (T, H)
    y = layer.post_attention_layernorm(h1)
    probs = torch.softmax(y @ layer.mlp.gate.weight.T, dim=-1)  # (T, 2)
    e = forced.long()
    w = probs.gather(1, e[:, None]).squeeze(1)
    ex = layer.mlp.experts
    gate, up = torch.einsum("th,tih->ti", y, ex.gate_up_proj[e]).chunk(2, dim=-1)
    out = torch.einsum("ti,thi->th", F.silu(gate) * up, ex.down_proj[e]) * w[:, None]
    logits = model.lm_head(m.norm(h1 + out))
    lp = F.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])
    return lp.squeeze(1)


def test_replay_uses_the_recorded_experts_hand_built_two_expert_case() -> None:
    model = two_experts()
    tokens = torch.randint(10, model.config.vocab_size, (12,), generator=torch.Generator()).tolist()
    own, _ = record(model, tokens)  # (11, 1, 1)
    flipped = 1 - own  # the other expert everywhere
    n = len(tokens)
    mask = [0] * 4 + [1] * (n - 4)
    own_full = torch.tensor(own[:, 0, 0].tolist() + [0])  # the last token's choice is unused
    # the hand computation through the model's own choices reproduces transformers' forward
    expected_own = hand_logprobs(model, tokens, own_full)
    _, lp_fwd = record(model, tokens)
    assert torch.allclose(expected_own, torch.tensor(lp_fwd[1:]), atol=1e-5)
    expected_forced = hand_logprobs(model, tokens, torch.tensor(flipped[:, 0, 0].tolist() + [0]))
    assert (expected_forced - expected_own)[3:].abs().max() > 1e-3  # the case can tell them apart

    def learner_logprobs(replay: bool) -> torch.Tensor:
        sample = TrainSample(
            tokens, mask, [0.0] * n, [0] * n, [1.0 * m for m in mask], routed_experts=flipped
        )
        learner = Learner(two_experts(), cfg(routing_replay=replay))
        learner.step([sample])
        got = learner.last_trainer_logprobs[0]
        assert got is not None
        return torch.tensor(got[4:])

    replayed = learner_logprobs(True)
    assert torch.allclose(replayed, expected_forced[3:], atol=1e-5)
    free = learner_logprobs(False)
    assert torch.allclose(free, expected_own[3:], atol=1e-5)
    assert (replayed - free).abs().max() > 1e-3


def test_packed_experts_layout() -> None:
    model, _ = build_tiny_moe()
    a, b = make_samples(model, n=2)
    packed = packed_experts([a, b, a.__class__(**{**_fields(a), "routed_experts": None})], 3, 2)
    na, nb = len(a.tokens), len(b.tokens)
    assert packed.shape == (2 * na + nb, 3, 2)
    assert torch.equal(packed[: na - 1], torch.from_numpy(a.routed_experts).int())
    assert (packed[na - 1] == -1).all() and (packed[na + nb - 1] == -1).all()
    assert (packed[na + nb :] == -1).all()  # no record: route freely
    assert packed_experts([], 3, 2).shape == (1, 3, 2)


def _fields(s: TrainSample) -> dict[str, Any]:
    names = ("tokens", "loss_mask", "logprobs", "versions", "advantages", "routed_experts")
    return {k: getattr(s, k) for k in names}


def test_train_sample_validates_routing() -> None:
    with pytest.raises(ValueError, match="routed_experts"):
        TrainSample([1, 2, 3], [0, 1, 1], [0.0] * 3, [0] * 3, [0.0] * 3, np.zeros((3, 2, 2)))
    with pytest.raises(TypeError, match="integer"):
        TrainSample([1, 2, 3], [0, 1, 1], [0.0] * 3, [0] * 3, [0.0] * 3, np.zeros((2, 2, 2)))
    s = TrainSample([1, 2], [0, 1], [0.0] * 2, [0] * 2, [0.0] * 2, np.ones((1, 2, 2), np.int64))
    assert s.routed_experts is not None and s.routed_experts.dtype == np.int16


def test_samples_from_trajectories_reads_the_engine_routing() -> None:
    # the engine's Trajectory.routed_experts (RoutedExperts: ``.array()``), duck-typed here so
    # this runs before and after the engine side lands
    class Record:
        def __init__(self, rows: np.ndarray) -> None:
            self.rows = rows

        def array(self) -> np.ndarray:
            return self.rows

    rows = np.arange(2 * 3 * 2, dtype=np.int16).reshape(2, 3, 2) % 8
    traj = SimpleNamespace(
        tokens=[5, 6, 7], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -2.0], versions=[-1, 0, 0],
        routed_experts=Record(rows),
    )  # fmt: skip
    dense = SimpleNamespace(**{**vars(traj), "routed_experts": None})
    a, b = samples_from_trajectories([traj, dense], [[0.0, 1.0, 1.0]] * 2)
    assert a.routed_experts is not None and np.array_equal(a.routed_experts, rows)
    assert b.routed_experts is None


def test_replay_needs_routing_and_an_moe_model() -> None:
    dense, _ = build_tiny()
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        Learner(dense, cfg(routing_replay=True))
    with pytest.raises(ConfigError, match="Mixture-of-Experts"):
        Learner(build_tiny()[0], cfg(router_aux_loss_coef=0.01))
    model, _ = build_tiny_moe()
    samples = make_samples(model, n=2, routed=False)
    with pytest.raises(ConfigError, match="routed_experts"):
        Learner(model, cfg(routing_replay=True)).step(samples)


# ----------------------------------------------------------------------------- metrics


def test_engine_learner_agreement_is_one_on_the_same_weights() -> None:
    model, _ = build_tiny_moe()
    samples = make_samples(model, n=6)
    out = Learner(model, cfg(num_minibatches=2)).step(samples)
    assert out["routing/engine_learner_expert_agreement"] == 1.0
    for layer in range(3):
        assert out[f"routing/engine_learner_expert_agreement/layer_{layer}"] == 1.0


def test_engine_learner_agreement_counts_a_corrupted_layer() -> None:
    model, _ = build_tiny_moe()
    samples = make_samples(model, n=4)
    bad = samples[0].routed_experts.copy()
    for row in bad[:, 0]:  # layer 0: two experts the learner did not choose
        row[:] = [e for e in range(8) if e not in row][:2]
    samples[0] = TrainSample(**{**_fields(samples[0]), "routed_experts": bad})
    out = Learner(model, cfg()).step(samples)
    rows = sum(len(s.tokens) - 1 for s in samples)
    expected = 1.0 - bad.shape[0] / rows
    assert out["routing/engine_learner_expert_agreement/layer_0"] == pytest.approx(expected)
    assert out["routing/engine_learner_expert_agreement/layer_1"] == 1.0
    assert out["routing/engine_learner_expert_agreement"] == pytest.approx((expected + 2.0) / 3.0)


def volatility_at(lr: float) -> dict[str, float]:
    model, _ = build_tiny_moe()
    samples = make_samples(model, n=8)
    return Learner(model, cfg(lr=lr, loss="grpo", num_minibatches=2)).step(samples)


def test_volatility_is_zero_at_lr_zero_and_grows_with_lr() -> None:
    runs = {lr: volatility_at(lr) for lr in (0.0, 1e-5, 1e-4, 1e-2)}
    zero = runs[0.0]
    assert zero["routing/expert_volatility"] == 0.0
    assert all(zero[f"routing/expert_volatility/layer_{i}"] == 0.0 for i in range(3))
    assert zero["routing/token_ratio_var"] == 0.0 and zero["routing/seq_ratio_var"] == 0.0
    assert zero["routing/changed_token_frac"] == 0.0
    vol = [runs[lr]["routing/expert_volatility"] for lr in (1e-5, 1e-4, 1e-2)]
    assert 0.0 < vol[0] < vol[1] < vol[2]
    var = [runs[lr]["routing/token_ratio_var"] for lr in (1e-5, 1e-4, 1e-2)]
    assert var[0] < var[1] < var[2]
    mid = runs[1e-4]  # some tokens changed routing, some did not
    assert 0.0 < mid["routing/changed_token_frac"] < 1.0
    # tokens whose routing changed moved more than the others did
    assert mid["routing/ratio_var_changed"] > mid["routing/ratio_var_unchanged"]
    assert runs[1e-2]["routing/seq_ratio_var"] < runs[1e-2]["routing/token_ratio_var"]


def test_routing_metrics_sample_follows_the_first_micro_batches_only() -> None:
    """``routing_metrics_sample=0.25``: 2 of 8 micro-batches followed, no other extra forward."""

    def step(share: float) -> tuple[dict[str, float], int, dict[str, torch.Tensor]]:
        model, _ = build_tiny_moe()
        samples = make_samples(model, n=8)
        calls = [0]
        for r in routers(model):
            r.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        settings = cfg(lr=1e-2, loss="grpo", num_minibatches=2, micro_batch_tokens=16)
        learner = Learner(model, settings.model_copy(update={"routing_metrics_sample": share}))
        out = learner.step(samples)  # one sample per micro-batch: 2 mini-batches of 4
        return out, calls[0], learner.state_dict_for_inference()

    full, calls_full, weights_full = step(1.0)
    part, calls_part, weights_part = step(0.25)
    layers = 3
    # full: 8 training forwards + 4 pre-update probes (second mini-batch) + 8 after the update;
    # sampled: the 8 training forwards + 2 after it (the first mini-batch's routing is free)
    assert calls_full == layers * (8 + 4 + 8) and calls_part == layers * (8 + 2)
    for k, w in weights_full.items():  # the metrics never change the update
        assert torch.equal(weights_part[k], w), k
    assert part["loss/policy"] == full["loss/policy"]
    assert part["routing/engine_learner_expert_agreement"] == 1.0
    assert 0.0 < part["routing/expert_volatility"] <= 1.0
    assert part["routing/expert_volatility"] != full["routing/expert_volatility"]  # 2 of 8 rows


def test_routing_metrics_off_and_on_a_dense_model() -> None:
    model, _ = build_tiny_moe()
    out = Learner(model, cfg(routing_metrics=False)).step(make_samples(model, n=2))
    assert not any(k.startswith("routing/") for k in out)
    dense, _ = build_tiny()
    out = Learner(dense, cfg()).step(make_samples(dense, n=2, routed=False))
    assert not any(k.startswith("routing/") for k in out)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize(
    "loss, replay, recompute",
    [("gspo_token", False, False), ("grpo", False, True), ("grpo", True, False)],
)
def test_learner_trains_tiny_moe(loss: str, replay: bool, recompute: bool) -> None:
    model, _ = build_tiny_moe()
    samples = make_samples(model, n=6)
    before = [p.detach().clone() for p in model.parameters()]
    learner = Learner(
        model,
        cfg(
            lr=1e-3, loss=loss, num_minibatches=2, routing_replay=replay,
            recompute_old_logprobs=recompute,
        ),
    )  # fmt: skip
    for _ in range(3):
        out = learner.step(samples)
        assert np.isfinite(out["loss/policy"]) and np.isfinite(out["loss/grad_norm"])
    assert learner.num_steps == 6
    moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    assert all(moved)  # experts, routers, attention: everything trained
    assert out["routing/engine_learner_expert_agreement"] < 1.0  # the policy moved on
    assert out["routing/expert_volatility"] > 0.0


def test_aux_loss_is_positive_and_trains_the_router() -> None:
    model, _ = build_tiny_moe()
    logits = [torch.zeros(16, 8, requires_grad=True)]
    balanced = router_aux_loss(logits, [torch.arange(32).reshape(16, 2) % 8], 8)
    assert balanced.item() == pytest.approx(1.0)
    skewed = router_aux_loss(logits, [torch.zeros(16, 2, dtype=torch.long)], 8)
    assert skewed.item() == pytest.approx(1.0)  # uniform probabilities: f_e sums to 1
    skewed.backward()
    assert logits[0].grad is not None and logits[0].grad.abs().sum() > 0

    def router_moves(coef: float) -> tuple[dict[str, float], bool, bool]:
        m, _ = build_tiny_moe()
        samples = [  # zero advantages: the policy loss has no gradient at all
            TrainSample(**{**_fields(s), "advantages": [0.0] * len(s.tokens)})
            for s in make_samples(m, n=4)
        ]
        gate0 = [r.weight.detach().clone() for r in routers(m)]
        rest0 = m.model.layers[-1].mlp.experts.gate_up_proj.detach().clone()
        out = Learner(m, cfg(lr=1e-2, router_aux_loss_coef=coef)).step(samples)
        moved = any(not torch.equal(a, r.weight) for a, r in zip(gate0, routers(m), strict=True))
        experts_moved = not torch.equal(rest0, m.model.layers[-1].mlp.experts.gate_up_proj)
        return out, moved, experts_moved

    out, moved, experts_moved = router_moves(0.01)
    assert out["loss/router_aux"] > 0.9  # near-balanced random routers: about 1
    assert moved
    assert not experts_moved  # no router reads the last layer's experts
    out, moved, _ = router_moves(0.0)
    assert "loss/router_aux" not in out and not moved


def test_trainer_logs_routing_metrics_for_tiny_moe(tmp_path: Path) -> None:
    from agentrl.loop.trainer import Trainer

    tree = {
        "run_dir": str(tmp_path),
        "seed": 1,
        "model": {"path": "tiny-moe"},
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_train_tasks": 64,
                "num_eval_tasks": 8},
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "cold_start": {"steps": 40, "lr": 2e-3, "batch_size": 32},
        "learner": {"lr": 1e-3, "num_minibatches": 2},
        "train": {"steps": 2, "tasks_per_step": 8, "eval_every": 0, "max_staleness": 0,
                  "checkpoint_every": 0},
    }  # fmt: skip
    asyncio.run(Trainer(load_config(tree)).run())
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss/policy" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0.0 <= r["routing/expert_volatility"] <= 1.0
        assert "routing/expert_volatility/layer_2" in r and "routing/token_ratio_var" in r
