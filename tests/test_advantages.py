"""Tests of agentrl.learner.advantages: group normalisation and per-token shaping."""

from __future__ import annotations

import math
from typing import Any, Literal

import pytest
import torch
from pydantic import BaseModel

from agentrl.errors import ConfigError
from agentrl.learner.advantages import (
    SHAPERS,
    FormatPenalty,
    OutcomeDiscount,
    OverlongPenalty,
    ShaperSpec,
    TurnRewardAdvantage,
    build_shapers,
    compute_token_advantages,
    group_advantages,
)
from agentrl.learner.losses import gspo_loss, gspo_token_loss
from agentrl.types import Group, Task, Trajectory, TurnSpan

torch.set_num_threads(1)


TurnSpec = tuple[Literal["assistant", "observation"], int, float | None, dict[str, Any]]


def make_traj(
    prompt_len: int,
    turns: list[TurnSpec],
    reward: float,
    index: int = 0,
) -> Trajectory:
    """A trajectory laid out as: prompt, then turns (kind, length, turn reward, info)."""
    tokens = list(range(prompt_len))
    mask = [0] * prompt_len
    spans = []
    for kind, n, turn_reward, info in turns:
        start = len(tokens)
        tokens += [7] * n
        mask += [1 if kind == "assistant" else 0] * n
        spans.append(TurnSpan(kind=kind, start=start, end=start + n, reward=turn_reward, info=info))
    return Trajectory(
        task_id="t",
        env_id="e",
        group_index=index,
        prompt_len=prompt_len,
        tokens=tokens,
        loss_mask=mask,
        logprobs=[-1.0 if m else 0.0 for m in mask],
        versions=[0 if m else -1 for m in mask],
        turns=spans,
        reward=reward,
    )


def make_group(trajs: list[Trajectory]) -> Group:
    return Group(task=Task(id="t", prompt="p"), trajectories=trajs)


def two_turn_group() -> Group:
    # episode 0: prompt 2 | assistant 3 (turn reward 1) | obs 2 | assistant 2 (None) ; reward 1
    # episode 1: prompt 2 | assistant 2 (turn reward 0, format error) | obs 1 | assistant 4 (1) ; 0
    return make_group(
        [
            make_traj(
                2, [("assistant", 3, 1.0, {}), ("observation", 2, None, {}),
                    ("assistant", 2, None, {})], 1.0, 0,
            ),
            make_traj(
                2, [("assistant", 2, 0.0, {"format_error": True}), ("observation", 1, None, {}),
                    ("assistant", 4, 1.0, {})], 0.0, 1,
            ),
        ]
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# group_advantages


def test_group_advantages_hand_computed() -> None:
    # [1, 0, 0, 1]: mean 0.5, population std 0.5 -> ±1 exactly with eps = 0
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    assert adv.tolist() == [1.0, -1.0, -1.0, 1.0]
    # [0, 0, 0, 1]: mean 0.25, std sqrt(0.25 * 0.75) = 0.4330127
    #   -> [-0.25, -0.25, -0.25, 0.75] / 0.4330127 = [-0.5773503, ..., 1.7320508]
    adv, _ = group_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64), eps=0.0)
    want = [-1 / math.sqrt(3)] * 3 + [math.sqrt(3)]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64))
    # the default eps shrinks them by std / (std + eps)
    adv, _ = group_advantages(torch.tensor([1.0, 0.0]))
    assert adv[0].item() == pytest.approx(0.5 / (0.5 + 1e-6), rel=1e-7)


def test_population_std_gives_unit_rms_for_every_group_size() -> None:
    g = torch.Generator().manual_seed(0)
    for size in (2, 3, 8, 64):
        adv, _ = group_advantages(torch.rand(size, generator=g, dtype=torch.float64), eps=0.0)
        assert adv.pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=1e-12)
        assert adv.sum().item() == pytest.approx(0.0, abs=1e-12)


def test_equal_rewards_give_exact_zeros_and_are_counted() -> None:
    rewards = torch.tensor([[0.1] * 7, [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3], [0.0] * 6 + [1.0]])
    adv, stats = group_advantages(rewards)
    assert torch.equal(adv[:2], torch.zeros(2, 7))
    assert adv[2].abs().sum() > 0
    assert (stats.num_groups, stats.zero_signal_groups) == (3, 2)
    # in float64, mean([0.1] * 7) misses 0.1 by 1.4e-17 and the std is 1.4e-17, not 0: without
    # the explicit check, eps = 0 would turn rounding noise into advantages of ±1
    flat = torch.full((7,), 0.1, dtype=torch.float64)
    for eps in (0.0, 1e-6):
        assert torch.equal(group_advantages(flat, eps=eps)[0], torch.zeros(7, dtype=torch.float64))
    metrics = stats.to_metrics()
    assert metrics["adv/zero_signal_groups"] == 2.0
    assert metrics["adv/zero_signal_frac"] == pytest.approx(2 / 3)


def test_batched_equals_per_group_and_single_member_group_is_zero() -> None:
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 3, (5, 4), generator=g).float()
    batched, _ = group_advantages(rewards)
    for row, out in zip(rewards, batched, strict=True):
        torch.testing.assert_close(group_advantages(row)[0], out)
    assert batched.dtype == torch.float32
    single, stats = group_advantages(torch.tensor([0.7]))
    assert single.tolist() == [0.0] and stats.zero_signal_groups == 1
    ints, _ = group_advantages(torch.tensor([0, 1]))
    assert ints.dtype == torch.float32


def test_group_advantages_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match=r"\(G,\) or \(N, G\)"):
        group_advantages(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match=r"\(G,\) or \(N, G\)"):
        group_advantages(torch.zeros(3, 0))


# ---------------------------------------------------------------------------------------------
# compute_token_advantages and the shapers


def test_outcome_advantage_on_sampled_tokens_only() -> None:
    group = two_turn_group()
    advs = compute_token_advantages(group)
    a = 0.5 / (0.5 + 1e-6)  # rewards [1, 0] -> ±0.999998
    for traj, adv, sign in zip(group.trajectories, advs, (1, -1), strict=True):
        assert adv.dtype == torch.float32 and len(adv) == len(traj.tokens)
        want = torch.tensor(traj.loss_mask, dtype=torch.float32) * sign * a
        torch.testing.assert_close(adv, want)


def test_discount_scales_earlier_turns() -> None:
    # three assistant turns, gamma 0.5: factors [0.25, 0.5, 1] on A_i = ±1 (eps 0)
    turn: TurnSpec = ("assistant", 2, None, {})
    obs: TurnSpec = ("observation", 1, None, {})
    turns = [turn, obs, turn, obs, ("assistant", 3, None, {})]
    group = make_group([make_traj(1, turns, 1.0, 0), make_traj(1, turns, 0.0, 1)])
    advs = compute_token_advantages(group, [OutcomeDiscount(gamma=0.5)], eps=0.0)
    # layout: prompt 1 | a 2 | o 1 | a 2 | o 1 | a 3
    want = torch.tensor([0, 0.25, 0.25, 0, 0.5, 0.5, 0, 1, 1, 1])
    torch.testing.assert_close(advs[0], want)
    torch.testing.assert_close(advs[1], -want)
    # no turn spans recorded: every sampled token keeps A_i
    bare = make_traj(0, [("assistant", 3, None, {})], 1.0).model_copy(update={"turns": []})
    other = bare.model_copy(update={"reward": 0.0})
    advs = compute_token_advantages(make_group([bare, other]), [OutcomeDiscount(gamma=0.5)], eps=0)
    torch.testing.assert_close(advs[0], torch.ones(3))


def test_turn_rewards_hand_computed() -> None:
    group = two_turn_group()
    # gamma 0: turn returns [1, 0 (None)] and [0, 1] -> mean 0.5, std 0.5 -> [1, -1, -1, 1]
    advs = compute_token_advantages(
        group, [TurnRewardAdvantage(coef=0.5, eps=0.0)], eps=0.0
    )  # outcome ±1 plus 0.5 * turn advantage
    torch.testing.assert_close(advs[0], torch.tensor([0, 0, 1.5, 1.5, 1.5, 0, 0, 0.5, 0.5]))
    torch.testing.assert_close(advs[1], torch.tensor([0, 0, -1.5, -1.5, 0, -0.5, -0.5, -0.5, -0.5]))
    # gamma 0.5: returns [1 + 0.5 * 0, 0] = [1, 0] and [0 + 0.5 * 1, 1] = [0.5, 1]
    #   mean 0.625, population std sqrt(0.171875) = 0.4145781
    #   -> [0.904534, -1.507557, -0.301511, 0.904534]
    shaped = TurnRewardAdvantage(gamma=0.5, eps=0.0)(group, torch.zeros(2))
    assert shaped[0][2].item() == pytest.approx(0.904534, abs=1e-6)
    assert shaped[0][7].item() == pytest.approx(-1.507557, abs=1e-6)
    assert shaped[1][2].item() == pytest.approx(-0.301511, abs=1e-6)
    assert shaped[1][5].item() == pytest.approx(0.904534, abs=1e-6)


def test_turn_rewards_without_any_turn_reward_add_nothing() -> None:
    turns: list[TurnSpec] = [
        ("assistant", 2, None, {}),
        ("observation", 1, None, {}),
        ("assistant", 1, None, {}),
    ]
    group = make_group([make_traj(1, turns, 1.0, 0), make_traj(1, turns, 0.0, 1)])
    shaped = TurnRewardAdvantage()(group, torch.zeros(2))
    assert all(torch.equal(s, torch.zeros_like(s)) for s in shaped)


def test_overlong_penalty_is_dapo_soft_punishment() -> None:
    shaper = OverlongPenalty(max_tokens=10, cache=4, penalty=2.0)
    # 0 up to 6 tokens, then linear: 8 -> -2 * (8 - 6) / 4 = -1, 10 and beyond -> -2
    assert [shaper.penalty_for(n) for n in (1, 6, 7, 8, 10, 12)] == [0, 0, -0.5, -1, -2, -2]
    hard = OverlongPenalty(max_tokens=10, cache=0)
    assert [hard.penalty_for(n) for n in (9, 10, 11)] == [0, 0, -1]  # cache 0: only past budget
    # episode 0 samples 5 tokens, episode 1 samples 6 (prompt 2, obs 2 / 1 not counted)
    group = two_turn_group()
    soft = OverlongPenalty(max_tokens=6, cache=2, penalty=1.0)
    shaped = soft(group, torch.zeros(2))
    assert shaped[0].unique().tolist() == [-0.5] and shaped[1].unique().tolist() == [-1.0]
    # counting every token, both episodes are 9 long: -(9 - 8) / 2 = -0.5; responses alone: 0
    total = OverlongPenalty(max_tokens=10, cache=2, length="total")(group, torch.zeros(2))
    assert total[0][0].item() == -0.5 and total[1][0].item() == -0.5
    response = OverlongPenalty(max_tokens=10, cache=2)(group, torch.zeros(2))
    assert response[0][0].item() == 0.0 and response[1][0].item() == 0.0


def test_format_penalty_hits_only_the_malformed_turn() -> None:
    group = two_turn_group()
    shaped = FormatPenalty(penalty=0.3)(group, torch.zeros(2))
    assert torch.equal(shaped[0], torch.zeros(9, dtype=torch.float64))
    want = torch.tensor([0, 0, -0.3, -0.3, 0, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(shaped[1], want)


def test_shapers_compose_additively_in_any_order_and_respect_the_mask() -> None:
    group = two_turn_group()
    shapers = [
        OutcomeDiscount(gamma=0.8),
        TurnRewardAdvantage(coef=0.2),
        OverlongPenalty(max_tokens=6, cache=2),
        FormatPenalty(penalty=0.5),
    ]
    combined = compute_token_advantages(group, shapers)
    reverse = compute_token_advantages(group, shapers[::-1])
    base = compute_token_advantages(group)
    outcome = torch.tensor([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)], dtype=torch.float64)
    for i, traj in enumerate(group.trajectories):
        mask = torch.tensor(traj.loss_mask, dtype=torch.float64)
        parts = sum(s(group, outcome)[i] for s in shapers)
        torch.testing.assert_close(combined[i], (base[i].double() + parts * mask).float())
        assert torch.equal(combined[i], reverse[i])
        assert torch.equal(combined[i][mask == 0], torch.zeros(int((mask == 0).sum())))


def test_specs_from_config_build_the_same_shapers() -> None:
    specs: list[dict[str, Any]] = [
        {"name": "overlong", "max_tokens": 6, "cache": 2, "penalty": 1.0},
        {"name": "format", "penalty": 0.5},
        {"name": "discount", "gamma": 0.9},
        {"name": "turn_rewards", "coef": 0.1, "gamma": 0.5},
    ]
    built = build_shapers(specs)
    assert [type(s) for s in built] == [SHAPERS[s["name"]] for s in specs]
    group = two_turn_group()
    from_specs = compute_token_advantages(group, specs, eps=1e-3)
    from_objects = compute_token_advantages(group, built, eps=1e-3)
    for a, b in zip(from_specs, from_objects, strict=True):
        assert torch.equal(a, b)

    class Config(BaseModel):
        shapers: list[ShaperSpec]

    cfg = Config.model_validate({"shapers": specs})
    assert list(cfg.shapers) == built


def test_bad_specs_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="expected one of"):
        build_shapers([{"name": "lengthy"}])
    with pytest.raises(ConfigError, match="penalty"):
        build_shapers([{"name": "format", "penalty": -1}])
    with pytest.raises(ConfigError, match="typo"):
        build_shapers([{"name": "format", "typo": 1}])
    with pytest.raises(ConfigError, match="cache"):
        build_shapers([{"name": "overlong", "max_tokens": 4, "cache": 8}])


def test_custom_shaper_function_and_shape_checks() -> None:
    group = two_turn_group()

    def bonus(g: Group, adv: torch.Tensor) -> list[torch.Tensor]:  # +1 on every token
        return [torch.ones(len(t.tokens)) for t in g.trajectories]

    out = compute_token_advantages(group, [bonus], eps=0.0)
    torch.testing.assert_close(out[0], 2.0 * torch.tensor(group.trajectories[0].loss_mask).float())

    def short(g: Group, adv: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ones(1) for _ in g.trajectories]

    with pytest.raises(ValueError, match="expected shape"):
        compute_token_advantages(group, [short])
    with pytest.raises(ValueError, match="expected 2 tensors"):
        compute_token_advantages(group, [lambda g, a: [torch.ones(9)]])
    assert compute_token_advantages(make_group([])) == []


def test_token_advantages_feed_gspo_token_like_gspo() -> None:
    # without shapers, per-token advantages are A_i on sampled tokens: GSPO-token == GSPO
    group = two_turn_group()
    advs = compute_token_advantages(group)
    mask = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(t.loss_mask) for t in group.trajectories], batch_first=True
    )
    adv_bt = torch.nn.utils.rnn.pad_sequence(advs, batch_first=True)  # (B, T)
    old = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(t.logprobs) for t in group.trajectories], batch_first=True
    )
    shift = torch.tensor([[2e-4], [-1e-4]])  # ratios 1.0002 and 0.9999, inside the clip range
    tok, tok_grad = value_and_grad(gspo_token_loss, old + shift * mask, old, adv_bt, mask)
    adv_seq, _ = group_advantages(torch.tensor(group.rewards))
    seq, seq_grad = value_and_grad(gspo_loss, old + shift * mask, old, adv_seq, mask)
    torch.testing.assert_close(tok, seq)
    torch.testing.assert_close(tok_grad, seq_grad)
    assert tok.item() != 0.0 and (tok_grad != 0).sum() == mask.sum()


def value_and_grad(fn, lp, *args):
    leaf = lp.detach().clone().requires_grad_()
    loss, _ = fn(leaf, *args)
    loss.backward()
    return loss.detach(), leaf.grad
