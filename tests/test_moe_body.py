"""The packed body on Qwen3-MoE: transformers' numbers, grouped experts, routing hooks intact."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from agentrl.kernels.moe import grouped_linear, moe_mlp
from agentrl.kernels.packed_body import PackedBody, unsupported_reason
from agentrl.learner import Learner, LearnerConfig, TrainSample
from agentrl.learner.config import LearnerConfig as Config
from agentrl.learner.logprobs import LogprobModel
from agentrl.learner.model import choose_body
from agentrl.learner.packing import PackedBatch, build_packed_batch
from agentrl.routing import RoutingCapture, RoutingReplay, routing_shape
from agentrl.tiny import build_tiny_moe

LENGTHS = [40, 7, 64, 1, 23]


def _moe(experts: str = "eager", **overrides: object) -> PreTrainedModel:
    """Tiny Qwen3-MoE, layer 1 dense (``mlp_only_layers``) so both kinds of layer run."""
    kw: dict[str, object] = dict(num_hidden_layers=3, mlp_only_layers=[1])
    kw.update(overrides)
    model, _ = build_tiny_moe(seed=0, **kw)
    model.set_experts_implementation(experts)
    return model


def _batch(lengths: list[int], attn: str, device: str = "cpu", seed: int = 1) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 100, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * min(3, n) + [1] * (n - min(3, n)) for n in lengths]
    return build_packed_batch(seqs, masks, attn_implementation=attn, device=torch.device(device))


def _run(
    model: PreTrainedModel, body: PackedBody | None, batch: PackedBatch, **kw: object
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module = LogprobModel(model, temperature=0.7, chunk_size=16, body=body, **kw)  # type: ignore[arg-type]
    logprobs, zero = module.run(batch)
    (logprobs * torch.linspace(-1, 1, logprobs.numel(), device=logprobs.device)).sum().add(
        zero
    ).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return logprobs.detach(), grads


@pytest.mark.parametrize("experts", ["eager", "grouped_mm"])
def test_packed_moe_logprobs_and_gradients_equal_transformers(experts: str) -> None:
    ref_lp, ref_g = _run(_moe(experts), None, _batch(LENGTHS, "sdpa"))
    model = _moe(experts)
    lp, g = _run(model, PackedBody(model), _batch(LENGTHS, "packed"))
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    assert g.keys() == ref_g.keys()
    assert {"model.layers.0.mlp.gate.weight", "model.layers.2.mlp.experts.down_proj"} <= g.keys()
    assert "model.layers.1.mlp.gate_proj.weight" in g  # the dense layer
    for name in ref_g:
        torch.testing.assert_close(g[name], ref_g[name], atol=1e-5, rtol=1e-4, msg=name)
    # the router learns through the weights of the experts it chose
    assert g["model.layers.0.mlp.gate.weight"].abs().sum() > 0


def test_routing_capture_and_replay_work_under_the_packed_body() -> None:
    captured = []
    for packed in (False, True):
        model = _moe()
        body = PackedBody(model) if packed else None
        with RoutingCapture(model) as cap:
            _run(model, body, _batch(LENGTHS, "packed" if packed else "sdpa"))
            captured.append(cap.pop())
    layers, k, num_experts = routing_shape(_moe())
    assert captured[0].shape == (sum(LENGTHS), layers, k) and layers == 2
    assert torch.equal(captured[1], captured[0])
    # replay: both bodies follow the given experts, and agree with each other
    g = torch.Generator().manual_seed(7)
    n = sum(LENGTHS)
    forced = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n * 2)])
    forced = forced.view(n, 2, k)
    forced[::5] = -1  # rows of -1 route freely
    out = []
    for packed in (False, True):
        model = _moe()
        body = PackedBody(model) if packed else None
        with RoutingReplay(model) as replay, RoutingCapture(model) as cap:
            replay.set(forced)
            lp, grads = _run(model, body, _batch(LENGTHS, "packed" if packed else "sdpa"))
            seen = cap.pop()
        free = (forced < 0).any(-1)  # (tokens, layers)
        assert torch.equal(seen[~free], forced[~free].int())
        # free rows of the first MoE layer route as without replay (its input is the same)
        assert torch.equal(seen[free[:, 0], 0], captured[0][free[:, 0], 0])
        out.append((lp, grads["model.layers.2.mlp.gate.weight"]))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1][1], out[0][1], atol=1e-5, rtol=1e-4)
    free_lp, _ = _run(_moe(), None, _batch(LENGTHS, "sdpa"))
    assert (out[0][0] - free_lp).abs().max() > 1e-3  # replay changed the computation


def test_checkpointing_and_selective_recompute_keep_gradients_and_route_once() -> None:
    batch = _batch([30, 50], "packed", seed=2)
    n = 80
    grads = []
    for layers, selective in ((0, False), (1, False), (3, False), (0, True), (2, True)):
        model = _moe()
        body = PackedBody(model, checkpoint_layers=layers, selective=selective)
        with RoutingCapture(model) as cap:
            _, g = _run(model, body, batch)
            # the backward's recomputation never calls the router again
            assert cap.pop().shape[0] == n
        grads.append(torch.cat([v.flatten() for v in g.values()]))
    assert grads[0].abs().sum() > 0
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], atol=1e-6, rtol=1e-5)


def test_grouped_linear_loop_equals_per_expert_linear_with_empty_experts() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 8, generator=g)
    w = torch.randn(4, 6, 8, generator=g)
    offsets = torch.tensor([3, 3, 10, 10], dtype=torch.int32)  # experts 1 and 3 get no rows
    out = grouped_linear(x, w, offsets)
    ref = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    torch.testing.assert_close(out, ref)


def test_moe_mlp_backward_matches_autograd_of_plain_indexing() -> None:
    """The permutation gathers' hand-written backward against autograd's own index backward."""
    g = torch.Generator().manual_seed(4)
    n, h, e, i, k = 13, 8, 5, 6, 2
    x, hid = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g, requires_grad=True)
    weights = torch.rand(n, k, generator=g, requires_grad=True)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    gate_up = torch.randn(e, 2 * i, h, generator=g, requires_grad=True)
    down = torch.randn(e, h, i, generator=g, requires_grad=True)
    leaves = (hid, weights, gate_up, down)
    out = moe_mlp(x, hid, weights, experts, gate_up, down, torch.float32)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    ref = x.clone()
    for t in range(n):
        for s in range(k):
            gate, up = (gate_up[experts[t, s]] @ hid[t]).chunk(2)
            ref[t] = ref[t] + weights[t, s] * (
                down[experts[t, s]] @ (torch.nn.functional.silu(gate) * up)
            )
    ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_unsupported_reason_and_body_choice_for_moe() -> None:
    model = _moe()
    assert unsupported_reason(model, moe=True) is None
    # dense-only users of the check (the paged engine) still see MoE as unsupported
    assert "Qwen3MoeForCausalLM" in (unsupported_reason(model) or "")
    assert choose_body(Config(), model, torch.device("cuda")) == "packed"
    assert choose_body(Config(), model, torch.device("cpu")) == "transformers"
    assert choose_body(Config(body="packed"), model, torch.device("cpu")) == "packed"


def _samples(n: int, seed: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 40, (1,), generator=g))
        tokens = torch.randint(3, 100, (length,), generator=g).tolist()
        mask = [0] * 3 + [1] * (length - 3)
        adv = float(torch.randn(1, generator=g))
        lp = [-4.6 * m for m in mask]
        out.append(TrainSample(tokens, mask, lp, [0 if m else -1 for m in mask], [adv] * length))
    return out


def test_learner_step_on_moe_with_the_packed_body_matches_transformers() -> None:
    samples = _samples(10, seed=5)
    metrics, weights = [], []
    for body in ("transformers", "packed"):
        config = LearnerConfig(lr=1e-3, num_minibatches=2, micro_batch_tokens=64, body=body)
        learner = Learner(_moe(), config)
        assert learner.body == body
        metrics.append(learner.step(samples))
        weights.append(torch.cat([p.detach().flatten() for p in learner.model.parameters()]))
    for key in ("loss/policy", "loss/grad_norm", "loss/ratio_mean"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-4, abs=1e-6), key
    diff = (weights[1] - weights[0]).abs()
    assert (diff < 1e-6).float().mean() > 0.999 and diff.max() <= 2 * 2 * 1e-3


@pytest.mark.gpu
def test_grouped_mm_experts_on_gpu_match_float32_and_leave_unused_experts_at_zero() -> None:
    g = torch.Generator().manual_seed(5)
    n, h, e, i, k = 300, 256, 16, 128, 4
    x, hid = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    weights = torch.rand(n, k, generator=g)
    experts = torch.stack([torch.randperm(e - 3, generator=g)[:k] for _ in range(n)])  # 3 unused
    gate_up, down = (
        torch.randn(e, 2 * i, h, generator=g) / 16,
        torch.randn(e, h, i, generator=g) / 11,
    )
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [t.cuda().requires_grad_() for t in (hid, weights, gate_up, down)]
        out = moe_mlp(x.cuda(), leaves[0], leaves[1], experts.cuda(), *leaves[2:], dtype)
        out.square().sum().backward()
        results.append((out.detach().float(), [t.grad.float() for t in leaves]))
    (ref, ref_g), (fast, fast_g) = results
    assert (fast - ref).abs().max() / ref.abs().max() < 2e-2
    for a, b in zip(fast_g, ref_g, strict=True):
        assert (a - b).abs().max() / b.abs().max() < 3e-2
    for grad in fast_g[2:]:  # experts no token chose: exactly zero gradients
        assert grad[-3:].abs().max() == 0 and grad[:-3].abs().max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["auto", "triton"])
def test_compiled_bf16_moe_body_is_close_to_float32_on_gpu(attention: str) -> None:
    if attention == "triton":
        pytest.importorskip("triton")
    lengths = [300, 17, 900, 64]
    ref_model = _moe().cuda()
    with RoutingCapture(ref_model) as cap:  # float32 transformers forward: the reference
        ref_lp, ref_g = _run(ref_model, None, _batch(lengths, "sdpa", "cuda"))
        experts = cap.pop()
    model = _moe().cuda()
    body = PackedBody(model, compile=True, checkpoint_layers=1, selective=True, attention=attention)
    # the same experts for both (bf16 can flip near-tied routing choices), hooks under compile
    with RoutingReplay(model) as replay, RoutingCapture(model) as cap:
        replay.set(experts)
        lp, grads = _run(
            model,
            body,
            _batch(lengths, "packed", "cuda"),
            autocast_dtype=torch.bfloat16,
            head_dtype=torch.bfloat16,
        )
        assert torch.equal(cap.pop(), experts)
    assert (lp - ref_lp).abs().max() < 5e-2
    norm = torch.cat([v.flatten() for v in grads.values()]).norm()
    ref_norm = torch.cat([v.flatten() for v in ref_g.values()]).norm()
    assert float(norm) == pytest.approx(float(ref_norm), rel=2e-2)
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.experts.gate_up_proj"):
        cos = torch.nn.functional.cosine_similarity(grads[name].flatten(), ref_g[name].flatten(), 0)
        assert cos > 0.99, name
