"""Learner on the tiny Qwen3 model: packing, chunked log-probs, the update, export, resume."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from agentrl.errors import ConfigError
from agentrl.learner import Learner, LearnerConfig, TrainSample, samples_from_trajectories
from agentrl.learner.logprobs import LogprobModel, chunked_token_logprobs
from agentrl.learner.packing import build_packed_batch, pack_sequences
from agentrl.tiny import build_tiny
from agentrl.types import Trajectory


def teacher_forced(
    model: torch.nn.Module, tokens: list[int], temperature: float = 1.0
) -> list[float]:
    """Log-prob of each token given its prefix, one unpacked sequence at a time (the reference)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float() / (temperature or 1.0)
    lp = torch.log_softmax(logits, -1)
    return [0.0] + [lp[t - 1, tokens[t]].item() for t in range(1, len(tokens))]


def make_samples(
    model: torch.nn.Module, n: int = 8, seed: int = 0, noise: float = 0.0
) -> list[TrainSample]:
    """Ragged prompt+response sequences; engine log-probs = teacher-forced ones (+ noise)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(3, 10, (1,), generator=g))
        r = int(torch.randint(2, 20, (1,), generator=g))
        tokens = torch.randint(3, 100, (p + r,), generator=g).tolist()
        mask = [0] * p + [1] * r
        eps = (noise * torch.randn(p + r, generator=g)).tolist()
        tf = teacher_forced(model, tokens)
        lp = [v + e if m else 0.0 for v, e, m in zip(tf, eps, mask, strict=True)]
        a = float(torch.randn(1, generator=g))
        out.append(TrainSample(tokens, mask, lp, [0 if m else -1 for m in mask], [a] * (p + r)))
    return out


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def step_with_grads(
    config: LearnerConfig, noise: float = 0.0, n: int = 10
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One step on a fresh tiny model; also the gradients the first optimizer step saw."""
    model, _ = build_tiny()
    learner = Learner(model, config)
    grads: list[torch.Tensor] = []

    def keep(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if not grads:
            grads.extend(p.grad.clone() for p in opt.param_groups[0]["params"])

    learner.optimizer.register_step_pre_hook(keep)
    return learner.step(make_samples(model, n=n, noise=noise)), grads


def assert_same_grads(g1: list[torch.Tensor], g2: list[torch.Tensor]) -> None:
    assert len(g1) == len(g2) == len(list(build_tiny()[0].parameters()))
    assert max(g.abs().max().item() for g in g1) > 1e-3
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------- packing


def test_pack_sequences_respects_budget_and_covers_every_sequence() -> None:
    lengths = [5, 30, 12, 7, 50, 1, 20]
    bins = pack_sequences(lengths, 32)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 32 or b == [4]  # 50 > 32 goes alone
    assert len(bins) == 4  # first-fit decreasing: [4], [1, 5], [6, 2], [3, 0] (123 tokens)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_micro_batch_gives_the_same_logprobs_as_separate_sequences(attn: str) -> None:
    model, _ = build_tiny()
    model.config._attn_implementation = attn
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (9, 1, 17, 4, 30)]
    masks = [[0] + [1] * (len(s) - 1) for s in seqs]
    batch = build_packed_batch(seqs, masks, attn_implementation=attn, device=torch.device("cpu"))
    assert batch.input_ids.shape == (1, 61)  # no padding
    assert batch.position_ids[0, 9:11].tolist() == [0, 0]  # restarts at every sequence
    module = LogprobModel(model, temperature=0.8, chunk_size=7)
    with torch.no_grad():
        packed, _ = module.run(batch)
    padded = batch.to_padded(packed)  # (5, 29): one row per sequence, its trained tokens
    for s, tokens in enumerate(seqs):
        ref = torch.tensor(teacher_forced(model, tokens, temperature=0.8)[1:])
        torch.testing.assert_close(padded[s, : len(ref)], ref, atol=1e-5, rtol=0)
    # without the mask, sequences would attend across borders and differ
    plain = LogprobModel(model, temperature=0.8, chunk_size=7)
    with torch.no_grad():
        leaky, _ = plain(
            batch.input_ids, torch.arange(61)[None], None, batch.pred_index, batch.targets
        )
    assert (leaky - packed).abs().max() > 1e-3


def test_chunked_logprobs_equal_full_logits_in_value_and_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    up = torch.randn(37, generator=g)
    for temperature in (1.0, 0.6, 0.0):
        full = torch.log_softmax(hidden @ weight.T / (temperature or 1.0), -1)
        full = full.gather(1, targets[:, None]).squeeze(1)
        gh, gw = torch.autograd.grad((full * up).sum(), (hidden, weight))
        chunked = chunked_token_logprobs(
            hidden, weight, targets, temperature=temperature, chunk_size=8
        )
        ch, cw = torch.autograd.grad((chunked * up).sum(), (hidden, weight))
        torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)
        torch.testing.assert_close(ch, gh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cw, gw, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- the update


def test_sanity_mode_lr_zero_keeps_ratios_at_one() -> None:
    model, _ = build_tiny()
    samples = make_samples(model, n=12)
    before = params(model)
    learner = Learner(model, LearnerConfig(lr=0.0, micro_batch_tokens=40))
    m = learner.step(samples)
    assert max_diff(before, params(model)) == 0.0
    assert m["loss/clip_frac_tokens"] == 0.0 and m["loss/clip_frac_seqs"] == 0.0
    assert m["mismatch/mean_abs"] < 2e-6 and m["mismatch/max_abs"] < 1e-5
    assert abs(m["mismatch/seq_log_ratio_mean"]) < 1e-6
    assert abs(m["loss/ratio_min"] - 1) < 1e-5 and abs(m["loss/ratio_max"] - 1) < 1e-5
    assert m["loss/num_tokens"] == sum(s.num_loss_tokens for s in samples)
    assert m["perf/minibatches"] == 4 and m["perf/tokens_per_s"] > 0
    # first mini-batch (3 samples): trainer log-probs recorded, 0.0 off the mask; others None
    lps = learner.last_trainer_logprobs
    assert [x is not None for x in lps] == [True] * 12  # every mini-batch records what it saw
    for s, lp in zip(samples[:3], lps[:3], strict=True):
        assert lp is not None
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(s.logprobs), atol=1e-5, rtol=0)


def test_micro_batching_accumulates_the_same_gradient() -> None:
    # one mini-batch in one micro-batch vs the same mini-batch in many micro-batches
    m1, g1 = step_with_grads(LearnerConfig(num_minibatches=1, micro_batch_tokens=10_000))
    m2, g2 = step_with_grads(LearnerConfig(num_minibatches=1, micro_batch_tokens=30))
    assert_same_grads(g1, g2)
    # activation checkpointing and a tiny head chunk change memory, not the gradient
    config = LearnerConfig(
        num_minibatches=1, micro_batch_tokens=30, logprob_chunk_size=3, gradient_checkpointing=True
    )
    assert_same_grads(g1, step_with_grads(config)[1])
    assert m1["loss/policy"] == pytest.approx(m2["loss/policy"], abs=1e-6)
    assert m1["loss/grad_norm"] == pytest.approx(m2["loss/grad_norm"], rel=1e-5)


def test_gspo_token_with_sequence_advantages_equals_gspo() -> None:
    out = [
        step_with_grads(
            LearnerConfig(loss=loss, num_minibatches=1, micro_batch_tokens=30), noise=1e-3
        )
        for loss in ("gspo_token", "gspo")
    ]
    assert_same_grads(out[0][1], out[1][1])
    for key in ("loss/policy", "loss/clip_frac_tokens", "loss/clip_frac_seqs", "loss/ratio_mean"):
        assert out[0][0][key] == pytest.approx(out[1][0][key], abs=1e-6), key
    assert out[0][0]["loss/clip_frac_seqs"] > 0  # the noise put some sequences out of range


def test_update_follows_the_advantage_sign() -> None:
    model, _ = build_tiny()
    good, bad = make_samples(model, n=2, seed=5)
    good = TrainSample(
        good.tokens, good.loss_mask, good.logprobs, good.versions, [1.0] * len(good.tokens)
    )
    bad = TrainSample(
        bad.tokens, bad.loss_mask, bad.logprobs, bad.versions, [-1.0] * len(bad.tokens)
    )
    learner = Learner(model, LearnerConfig(lr=1e-4, loss="grpo", num_minibatches=1))
    learner.step([good, bad])

    def gain(s: TrainSample) -> float:  # change of the response's log-prob
        now = teacher_forced(model, s.tokens)
        return sum(a - b for a, b, m in zip(now, s.logprobs, s.loss_mask, strict=True) if m)

    assert gain(good) > 0.05 and gain(bad) < -0.05


def test_recompute_and_token_tis_weights() -> None:
    model, _ = build_tiny()
    samples = make_samples(model, n=6)
    # engine log-probs off by -1 on every other trained token: weight e^1 > C=2 is capped;
    # off by +0.1 elsewhere: weight e^-0.1 is kept
    shifted, capped = [], 0
    for s in samples:
        lp, k = list(s.logprobs), 0
        for t, m in enumerate(s.loss_mask):
            if m:
                lp[t] += -1.0 if k % 2 == 0 else 0.1
                capped += k % 2 == 0
                k += 1
        shifted.append(TrainSample(s.tokens, s.loss_mask, lp, s.versions, s.advantages))
    total = sum(s.num_loss_tokens for s in samples)
    config = LearnerConfig(lr=0.0, recompute_old_logprobs=True, tis="token", tis_cap=2.0)
    m = Learner(model, config).step(shifted)
    assert m["tis/capped_frac"] == pytest.approx(capped / total)
    expected_w = (2.0 * capped + torch.exp(torch.tensor(-0.1)).item() * (total - capped)) / total
    assert m["tis/weight_mean"] == pytest.approx(expected_w, rel=1e-5)
    # old log-probs are the trainer's: ratios are 1 although the engine's are far off
    assert m["loss/clip_frac_tokens"] == 0.0
    assert m["mismatch/max_abs"] == pytest.approx(1.0, abs=1e-5)
    # trainer - engine is +1 on even and -0.1 on odd trained tokens (trainer = unshifted engine),
    # measured on the first mini-batch (6 samples / 4 mini-batches: the first 2)
    ns = [s.num_loss_tokens for s in samples[:2]]
    seq_means = [((n + 1) // 2 - 0.1 * (n // 2)) / n for n in ns]
    abs_sum = sum((n + 1) // 2 + 0.1 * (n // 2) for n in ns)
    assert m["mismatch/mean_abs"] == pytest.approx(abs_sum / sum(ns), abs=1e-5)
    assert m["mismatch/seq_log_ratio_mean"] == pytest.approx(sum(seq_means) / len(ns), abs=1e-5)
    assert m["mismatch/seq_log_ratio_abs_max"] == pytest.approx(max(seq_means), abs=1e-5)
    learner = Learner(build_tiny()[0], LearnerConfig(lr=0.0, recompute_old_logprobs=True))
    learner.step(shifted)
    for s, full in zip(samples, learner.last_trainer_logprobs, strict=True):  # every sample
        assert full is not None and len(full) == len(s.tokens)
        torch.testing.assert_close(torch.tensor(full), torch.tensor(s.logprobs), atol=1e-5, rtol=0)


def test_sequence_tis_uses_the_mean_log_ratio() -> None:
    model, _ = build_tiny()
    samples = make_samples(model, n=4)
    # sequence 0: mean log-ratio 1.0 > log 2 -> capped; the others: 0.1 -> kept
    shifted = []
    for i, s in enumerate(samples):
        d = 1.0 if i == 0 else 0.1
        lp = [v - d if m else 0.0 for v, m in zip(s.logprobs, s.loss_mask, strict=True)]
        shifted.append(TrainSample(s.tokens, s.loss_mask, lp, s.versions, s.advantages))
    config = LearnerConfig(lr=0.0, recompute_old_logprobs=True, tis="sequence", tis_cap=2.0)
    m = Learner(model, config).step(shifted)
    total = sum(s.num_loss_tokens for s in samples)
    assert m["tis/capped_frac"] == pytest.approx(samples[0].num_loss_tokens / total)


def test_kl_to_reference() -> None:
    with pytest.raises(ConfigError, match="ref_model"):
        Learner(build_tiny()[0], LearnerConfig(kl_coef=0.1))
    model, _ = build_tiny()
    same = Learner(model, LearnerConfig(lr=0.0, kl_coef=0.1), ref_model=copy.deepcopy(model))
    m = same.step(make_samples(model))
    assert abs(m["loss/kl"]) < 1e-6
    model, _ = build_tiny()
    other = Learner(model, LearnerConfig(lr=0.0, kl_coef=0.1), ref_model=build_tiny(seed=1)[0])
    m = other.step(make_samples(model))
    assert m["loss/kl"] > 0.01 and m["kl/token_max"] >= m["kl/token_mean"] > 0


def test_bf16_autocast_keeps_float32_master_weights_and_reports_the_mismatch() -> None:
    model, _ = build_tiny()
    samples = make_samples(model)
    m = Learner(model, LearnerConfig(lr=1e-4, dtype="bfloat16")).step(samples)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert 1e-4 < m["mismatch/mean_abs"] < 0.5  # bf16 body vs float32 engine log-probs
    assert torch.isfinite(torch.tensor(m["loss/policy"]))


# ---------------------------------------------------------------------------------- config, data


def test_config_is_strict() -> None:
    with pytest.raises(ValidationError):
        LearnerConfig(learning_rate=1e-5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="recompute_old_logprobs"):
        LearnerConfig(tis="token")
    with pytest.raises(ValidationError):
        LearnerConfig(loss="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="needs dtype='bfloat16'"):
        LearnerConfig(fsdp_gather_dtype="bfloat16")
    with pytest.raises(ValidationError, match="fsdp_unit='model'"):  # the blocks have no unit
        LearnerConfig(dtype="bfloat16", fsdp_gather_dtype="bfloat16", fsdp_unit="model")
    LearnerConfig(dtype="bfloat16", fsdp_gather_dtype="bfloat16", fsdp_unit="block")


def test_samples_from_trajectories() -> None:
    traj = Trajectory(
        task_id="t",
        env_id="e",
        tokens=[5, 6, 7, 8],
        loss_mask=[0, 0, 1, 1],
        logprobs=[0.0, 0.0, -0.5, -0.2],
        versions=[-1, -1, 3, 3],
    )
    (s,) = samples_from_trajectories([traj], [torch.tensor([0.0, 0.0, 1.5, 1.5])])
    assert s.tokens == [5, 6, 7, 8] and s.advantages == [0.0, 0.0, 1.5, 1.5]
    assert s.num_loss_tokens == 2
    with pytest.raises(ValueError, match="advantages: expected 4"):
        samples_from_trajectories([traj], [[1.0, 2.0]])
    with pytest.raises(ValueError, match="first token"):
        TrainSample([1, 2], [1, 1], [0.0, 0.0], [0, 0], [0.0, 0.0])


# ---------------------------------------------------------------------------------- export, resume


def test_save_pretrained_loads_back_with_hf(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, tokenizer = build_tiny()
    learner = Learner(model, LearnerConfig(lr=1e-3))
    learner.step(make_samples(model))
    sd = learner.state_dict_for_inference()
    assert set(sd) == set(model.state_dict())
    learner.save_pretrained(tmp_path / "w", tokenizer=tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "w")
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert (tmp_path / "w" / "tokenizer.json").exists()


def test_live_weights_are_the_weights_until_their_storage_changes() -> None:
    model, _ = build_tiny()
    learner = Learner(model, LearnerConfig(lr=1e-3, dtype="bfloat16"))  # float32 masters
    first = learner.live_weights()
    name = "model.norm.weight"
    assert first[name].data_ptr() == model.model.norm.weight.data_ptr()  # no copy, no cast
    assert first[name].dtype == torch.float32 and first.keys() == model.state_dict().keys()
    learner.step(make_samples(model))
    again = learner.live_weights()
    assert again is not first and all(again[k] is first[k] for k in first)  # no walk again
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in again.items())  # updated
    model.model.norm.weight.data = model.model.norm.weight.data.clone() + 1  # new storage
    fresh = learner.live_weights()
    assert fresh[name].data_ptr() == model.model.norm.weight.data_ptr()
    assert torch.equal(fresh[name], model.model.norm.weight)


def test_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    model, _ = build_tiny()
    b1, b2 = make_samples(model, seed=1), make_samples(model, seed=2)
    config = LearnerConfig(lr=1e-3, weight_decay=0.01, micro_batch_tokens=40)
    learner = Learner(model, config)
    learner.step(b1)
    learner.save_checkpoint(tmp_path)
    snapshot = learner.state()
    m_straight = learner.step(b2)
    p_straight = params(model)

    fresh_model, _ = build_tiny(seed=7)  # different weights: all must come from the checkpoint
    fresh = Learner(fresh_model, config)
    fresh.load_checkpoint(tmp_path)
    assert fresh.num_steps == 4
    m_resumed = fresh.step(b2)
    assert max_diff(p_straight, params(fresh_model)) == 0.0
    for key in ("loss/policy", "loss/grad_norm", "mismatch/mean_abs"):
        assert m_resumed[key] == m_straight[key], key

    learner.load_state(snapshot)  # in memory, same thing
    learner.step(b2)
    assert max_diff(p_straight, params(model)) == 0.0
