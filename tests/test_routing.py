"""``agentrl.routing``: capture, replay, overlap and volatility on the tiny MoE model (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.routing import (
    RoutingCapture,
    RoutingReplay,
    expert_overlap,
    is_moe,
    replaying,
    routers,
    routing_shape,
    volatility,
)
from agentrl.tiny import build_tiny, build_tiny_moe

IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13]])


@pytest.fixture(scope="module")
def moe() -> torch.nn.Module:
    torch.set_num_threads(1)
    return build_tiny_moe(seed=0)[0]


def forward(model: torch.nn.Module, ids: torch.Tensor = IDS) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and the experts every token chose."""
    with RoutingCapture(model) as cap, torch.no_grad():
        logits = model(input_ids=ids).logits
    return logits, cap.pop()


def test_routers_and_shape(moe) -> None:
    assert len(routers(moe)) == 3 and is_moe(moe)
    assert routing_shape(moe) == (3, 2, 8)
    dense = build_tiny()[0]
    assert routers(dense) == [] and not is_moe(dense)
    with pytest.raises(ValueError, match="no MoE router"):
        routing_shape(dense)
    with pytest.raises(ValueError, match="no MoE router to capture"):
        RoutingCapture(dense)


def test_capture_layout(moe) -> None:
    with RoutingCapture(moe) as cap:
        assert cap.pop().shape == (0, 3, 2)  # nothing ran yet
        with torch.no_grad():
            moe(input_ids=IDS)
            moe(input_ids=IDS[:, :4])
        experts = cap.pop()
    assert experts.shape == (10 + 4, 3, 2) and experts.dtype == torch.int32
    assert experts.min() >= 0 and experts.max() < 8
    torch.testing.assert_close(experts[10:], experts[:4], rtol=0, atol=0)  # causal: same prefix
    assert (experts[..., 0] != experts[..., 1]).all()  # top-k picks distinct experts
    with torch.no_grad():
        moe(input_ids=IDS)  # the context is closed: nothing is recorded
    assert cap.pop().shape == (0, 3, 2)


def test_overlap_with_itself_is_one_and_volatility_zero(moe) -> None:
    _, experts = forward(moe)
    assert expert_overlap(experts, experts).tolist() == [1.0, 1.0, 1.0]
    shuffled = experts.flip(-1)  # slot order does not matter
    assert expert_overlap(experts, shuffled).tolist() == [1.0, 1.0, 1.0]
    assert volatility(experts, shuffled) == ([0.0, 0.0, 0.0], 0.0)


def test_overlap_and_volatility_by_hand() -> None:
    # 3 tokens, 2 layers, top-2
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[-1, -1], [1, 2]]])
    b = torch.tensor([[[1, 0], [2, 5]], [[6, 7], [7, 6]], [[3, 4], [2, 0]]])
    # layer 0: token 0 agrees on both (1), token 1 on none (0), token 2 unknown in `a`
    # layer 1: token 0 on one of two (0.5), token 1 on both (1), token 2 on one (0.5)
    assert expert_overlap(a, b).tolist() == [0.5, pytest.approx(2 / 3)]
    per_layer, overall = volatility(a, b)
    assert per_layer == [0.5, pytest.approx(1 / 3)]
    assert overall == pytest.approx((0 + 1 + 0.5 + 0 + 0.5) / 5)  # 5 valid (token, layer)
    nothing = torch.full_like(a, -1)
    assert all(math.isnan(x) for x in expert_overlap(a, nothing).tolist())
    with pytest.raises(ValueError, match="differ in shape"):
        expert_overlap(a, b[:2])


def test_replay_of_the_captured_routing_reproduces_the_logits(moe) -> None:
    logits, experts = forward(moe)
    with RoutingReplay(moe) as replay, torch.no_grad():
        replay.set(experts)
        replayed = moe(input_ids=IDS).logits
    assert torch.equal(replayed, logits)
    with replaying(moe, torch.full_like(experts, -1)), torch.no_grad():
        free = moe(input_ids=IDS).logits  # -1 rows keep the router's own choice
    assert torch.equal(free, logits)


def test_replay_forces_experts_and_gates_from_the_router(moe) -> None:
    logits, experts = forward(moe)
    forced = (experts + 3) % 8  # other experts everywhere ...
    forced[:4] = -1  # ... but the first four tokens route freely
    with replaying(moe, forced):
        replayed, seen = forward(moe)
    assert torch.equal(seen[4:], forced[4:])  # the routers used the recorded experts
    assert torch.equal(seen[:4], experts[:4])  # causal: the free prefix is unchanged
    # (to float rounding: each expert's matmul now batches other tokens)
    torch.testing.assert_close(replayed[0, :4], logits[0, :4], rtol=0, atol=1e-5)
    assert not torch.allclose(replayed[0, 4:], logits[0, 4:])

    # Gate weights are the router's softmax at the forced experts, renormalised (top-k norm).
    router = routers(moe)[0]
    hidden = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    pick = torch.tensor([[0, 7], [1, 2], [3, 4], [5, 6], [7, 0]])
    rows = torch.stack([pick, pick, pick], dim=1)  # (tokens, layers, top_k)
    with replaying(moe, rows), torch.no_grad():
        router_logits, weights, idx = router(hidden)
    assert torch.equal(idx, pick)
    probs = torch.softmax(hidden @ router.weight.T, dim=-1).gather(1, pick)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))


def test_replay_checks_shapes(moe) -> None:
    with RoutingReplay(moe) as replay:
        with pytest.raises(ValueError, match=r"expected shape \(tokens, 3, 2\)"):
            replay.set(torch.zeros(10, 3, 3, dtype=torch.long))
        replay.set(torch.zeros(9, 3, 2, dtype=torch.long))
        with pytest.raises(ValueError, match="9 recorded tokens for a forward of 10"):
            with torch.no_grad():
                moe(input_ids=IDS)
