"""Rollout-correction presets and the per-turn / per-position mismatch split, on known ratios."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.learner.config import LearnerConfig
from agentrl.learner.distributed import StepStats
from agentrl.learner.mismatch import (
    Correction,
    apply_correction,
    correction_weights,
    record_turn_position_split,
    resolve_correction,
)
from agentrl.learner.packing import TrainSample

# two sequences: tokens 0-3 are sequence 0, tokens 4-5 sequence 1; ratios ρ = trainer/engine
RHO = torch.tensor([0.3, 1.0, 3.0, 6.0, 0.9, 1.2])
SEQ = torch.tensor([0, 0, 0, 0, 1, 1])
ENGINE = torch.log(torch.tensor([0.5, 0.2, 0.1, 0.05, 0.4, 0.3]))
TRAINER = ENGINE + RHO.log()
RHO_SEQ0 = math.exp(RHO[:4].log().mean().item())  # geometric mean: (0.3·1·3·6)^(1/4) ≈ 1.524


def weights(preset: str, low: float, high: float) -> tuple[list[float], list[bool], list[bool]]:
    w, capped, masked = correction_weights(TRAINER, ENGINE, SEQ, 2, Correction(preset, low, high))
    return w.tolist(), capped.tolist(), masked.tolist()


def test_token_tis_truncates_each_token() -> None:
    w, capped, masked = weights("token_tis", 0.0, 2.0)
    assert w == pytest.approx([0.3, 1.0, 2.0, 2.0, 0.9, 1.2], rel=1e-6)
    assert capped == [False, False, True, True, False, False] and not any(masked)


def test_seq_tis_uses_the_geometric_mean() -> None:
    w, capped, _ = weights("seq_tis", 0.0, 1.5)
    assert w == pytest.approx([1.5] * 4 + [math.sqrt(0.9 * 1.2)] * 2, rel=1e-6)
    assert capped == [True] * 4 + [False] * 2


def test_token_mis_drops_tokens_outside_the_band() -> None:
    w, capped, masked = weights("token_mis", 0.5, 2.0)
    assert w == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0] and not any(capped)
    assert masked == [True, False, True, True, False, False]


def test_seq_mis_drops_whole_sequences() -> None:
    assert RHO_SEQ0 == pytest.approx(1.5244, abs=1e-4)
    w, _, masked = weights("seq_mis", 0.5, 1.5)  # ρ_seq 1.524 (out), 1.04 (in)
    assert w == [0.0] * 4 + [1.0] * 2 and masked == [True] * 4 + [False] * 2


def test_icepop_reweights_inside_and_masks_outside() -> None:
    w, _, masked = weights("icepop", 0.5, 5.0)
    assert w == pytest.approx([0.0, 1.0, 3.0, 0.0, 0.9, 1.2], rel=1e-6)
    assert masked == [True, False, False, True, False, False]


def test_logged_fractions() -> None:
    stats = StepStats()
    apply_correction(TRAINER, ENGINE, SEQ, 2, Correction("icepop", 0.5, 5.0), stats)
    out = stats.merged()[0].result()
    assert out["mismatch/masked_token_frac"] == pytest.approx(2 / 6)
    assert out["mismatch/masked_seq_frac"] == pytest.approx(1 / 2)
    assert out["mismatch/correction_weight_mean"] == pytest.approx(6.1 / 6, rel=1e-6)
    assert "tis/capped_frac" not in out
    stats = StepStats()
    apply_correction(TRAINER, ENGINE, SEQ, 2, Correction("token_tis", 0.0, 2.0), stats)
    out = stats.merged()[0].result()
    assert out["tis/capped_frac"] == pytest.approx(2 / 6)
    assert out["mismatch/masked_token_frac"] == 0.0 and out["mismatch/masked_seq_frac"] == 0.0


def test_config_presets_defaults_and_the_old_tis_spelling() -> None:
    rc = dict(recompute_old_logprobs=True)
    assert resolve_correction(LearnerConfig()) is None
    assert resolve_correction(LearnerConfig(rollout_correction="icepop", **rc)) == Correction(
        "icepop", 0.5, 5.0
    )
    assert resolve_correction(LearnerConfig(tis="sequence", tis_cap=3.0, **rc)) == Correction(
        "seq_tis", 0.0, 3.0
    )
    c = LearnerConfig(rollout_correction="token_mis", rollout_correction_high=4.0, **rc)
    assert resolve_correction(c) == Correction("token_mis", 0.5, 4.0)
    with pytest.raises(ValueError, match="recompute_old_logprobs"):
        LearnerConfig(rollout_correction="seq_mis")
    with pytest.raises(ValueError, match="one of them"):
        LearnerConfig(tis="token", rollout_correction="token_tis", **rc)
    with pytest.raises(ValueError, match="low <= high"):
        LearnerConfig(rollout_correction_low=3.0, rollout_correction_high=2.0)


def _sample(mask: list[int]) -> TrainSample:
    n = len(mask)
    return TrainSample([1] * n, mask, [0.0] * n, [0] * n, [0.0] * n)


def test_mismatch_by_turn_and_position() -> None:
    # sample 0: turns at positions 1-2, 4, 6, 8, 9 (5 runs: the 4th and 5th share "4plus");
    # sample 1: one turn at positions 510-513, across the 512 boundary
    m0 = [0, 1, 1, 0, 1, 0, 1, 0, 1, 1]
    m1 = [0] * 510 + [1] * 4
    samples = [_sample(m0), _sample(m1)]
    diff = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0] + [10.0, 20.0, 30.0, 40.0])
    engine = torch.zeros(10)
    stats = StepStats()
    record_turn_position_split(samples, engine - diff, engine, stats)
    out = stats.merged()[0].result()
    assert out["mismatch/turn_1_mean_abs"] == pytest.approx((1 + 2 + 10 + 20 + 30 + 40) / 6)
    assert out["mismatch/turn_2_mean_abs"] == pytest.approx(3.0)
    assert out["mismatch/turn_3_mean_abs"] == pytest.approx(4.0)
    assert out["mismatch/turn_4plus_mean_abs"] == pytest.approx((5 + 6) / 2)
    assert out["mismatch/pos_0_512_mean_abs"] == pytest.approx((21 + 10 + 20) / 8)
    assert out["mismatch/pos_512_2k_mean_abs"] == pytest.approx(35.0)
    assert "mismatch/pos_2k_8k_mean_abs" not in out


def test_learner_step_with_icepop_and_the_new_losses() -> None:
    # the real Learner on the tiny model: engine log-probs shifted by -2 on every third trained
    # token (ρ = e^2 ≈ 7.4 > β = 5: IcePop masks exactly those), the rest exact
    from agentrl.learner import Learner
    from agentrl.tiny import build_tiny

    model, _ = build_tiny()
    g = torch.Generator().manual_seed(0)
    samples, masked, total = [], 0, 0
    for i in range(4):
        tokens = torch.randint(3, 100, (12,), generator=g).tolist()
        mask = [0] * 4 + [1] * 3 + [0] * 2 + [1] * 3  # two assistant turns
        with torch.no_grad():
            lp_all = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
        lp = [0.0] * 12
        for t in range(12):
            if mask[t]:
                lp[t] = lp_all[t - 1, tokens[t]].item() - (2.0 if total % 3 == 0 else 0.0)
                masked += total % 3 == 0
                total += 1
        adv = [1.0 if i % 2 else -1.0] * 12
        samples.append(TrainSample(tokens, mask, lp, [0 if m else -1 for m in mask], adv))
    for loss in ("cispo", "dppo"):  # lr 0: the same weights for both
        config = LearnerConfig(
            lr=0.0, loss=loss, recompute_old_logprobs=True, rollout_correction="icepop"
        )
        learner = Learner(model, config)
        learner.weight_version = 0
        m = learner.step(samples)
        assert m["mismatch/masked_token_frac"] == pytest.approx(masked / total)
        assert m["mismatch/masked_seq_frac"] == pytest.approx(1.0)
        assert m["mismatch/turn_1_mean_abs"] > 0 and m["mismatch/turn_2_mean_abs"] > 0
        assert m["mismatch/pos_0_512_mean_abs"] == pytest.approx(2.0 * masked / total, abs=1e-4)
        assert math.isfinite(m["loss/policy"]) and 0.0 <= m["loss/clip_frac_tokens"] <= 1.0
