"""agentrl.learner.losses against float64 references written from the GSPO paper's equations."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from agentrl.errors import ConfigError
from agentrl.learner.losses import (
    LOSSES,
    MAX_LOG_RATIO,
    cispo_loss,
    count_sequences,
    dppo_loss,
    get_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    kl_to_reference,
)

torch.set_num_threads(1)

EPS_GSPO = (3e-4, 4e-4)
EPS_GRPO = (0.2, 0.28)


# ---------------------------------------------------------------------------------------------
# random ragged batches with multi-turn masks


def ragged_batch(
    seed: int, batch: int = 12, max_len: int = 2000, offset: float = 1e-3, noise: float = 1e-3
) -> dict[str, torch.Tensor]:
    """Rows of random length in [1, max_len], padded; mask = prompt, then turns with gaps.

    ``logprobs - old_logprobs`` = a per-row offset U(-offset, offset) + N(0, noise) per token, so
    that GSPO's sequence ratios land on both sides of its clip range. Padding holds garbage.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=g)
    lengths[0], lengths[1] = 1, max_len  # the extremes, always
    width = int(lengths.max())
    mask = torch.zeros(batch, width, dtype=torch.int64)
    for i, n in enumerate(lengths.tolist()):
        p = int(torch.randint(0, max(1, n // 4), (1,), generator=g)) if n > 1 else 0  # prompt
        while p < n:
            turn = int(torch.randint(1, 300, (1,), generator=g))
            mask[i, p : min(n, p + turn)] = 1  # an assistant turn
            p += turn + int(torch.randint(0, 120, (1,), generator=g))  # an observation gap
    old = -3.0 * torch.rand(batch, width, generator=g, dtype=torch.float64)
    shift = offset * (2 * torch.rand(batch, 1, generator=g, dtype=torch.float64) - 1)
    logprobs = old + shift + noise * torch.randn(batch, width, generator=g, dtype=torch.float64)
    pad = torch.arange(width)[None, :] >= lengths[:, None]
    logprobs = logprobs.masked_fill(pad, 123.0)  # garbage where there are no tokens
    adv_seq = torch.randn(batch, generator=g, dtype=torch.float64)
    adv_tok = torch.randn(batch, width, generator=g, dtype=torch.float64)
    return {"lp": logprobs, "old": old, "mask": mask, "adv": adv_seq, "adv_tok": adv_tok}


# ---------------------------------------------------------------------------------------------
# float64 references, one sequence at a time, straight from the equations


def ref_gspo(lp, old, adv, mask, eps_low, eps_high):
    terms = []
    for i, row in enumerate(mask):
        idx = row.nonzero().squeeze(-1)
        if len(idx) == 0:
            continue
        s = torch.exp((lp[i, idx] - old[i, idx]).mean())  # eq. 7
        terms.append(torch.minimum(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i]))
    return -torch.stack(terms).mean()  # eq. 5, negated


def ref_gspo_token(lp, old, adv_tok, mask, eps_low, eps_high):
    terms = []
    for i, row in enumerate(mask):
        idx = row.nonzero().squeeze(-1)
        if len(idx) == 0:
            continue
        s = torch.exp((lp[i, idx] - old[i, idx]).mean()).detach()
        s_t = s * torch.exp(lp[i, idx] - lp[i, idx].detach())  # sg(s_i) * π/sg(π)
        a = adv_tok[i, idx]
        terms.append(torch.minimum(s_t * a, s_t.clamp(1 - eps_low, 1 + eps_high) * a).mean())
    return -torch.stack(terms).mean()


def ref_grpo(lp, old, adv_tok, mask, eps_low, eps_high):
    terms = []
    for i, row in enumerate(mask):
        idx = row.nonzero().squeeze(-1)
        if len(idx) == 0:
            continue
        r = torch.exp(lp[i, idx] - old[i, idx])
        a = adv_tok[i, idx]
        terms.append(torch.minimum(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a).mean())
    return -torch.stack(terms).mean()


def ref_kl(lp, ref, mask):
    terms = []
    for i, row in enumerate(mask):
        idx = row.nonzero().squeeze(-1)
        if len(idx) == 0:
            continue
        d = ref[i, idx] - lp[i, idx]
        terms.append((d.exp() - d - 1).mean())
    return torch.stack(terms).mean()


def value_and_grad(fn: Callable, lp: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = lp.detach().clone().requires_grad_()
    out = fn(leaf, *args)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    assert leaf.grad is not None
    return loss.detach(), leaf.grad


# ---------------------------------------------------------------------------------------------
# against the float64 reference


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_matches_reference(dtype: torch.dtype, seed: int) -> None:
    b = ragged_batch(seed)
    lp = b["lp"].to(dtype).double()  # the reference sees exactly the values the loss sees
    args = (b["old"].to(dtype), b["adv"].to(dtype), b["mask"], *EPS_GSPO)
    ref_args = (args[0].double(), args[1].double(), b["mask"], *EPS_GSPO)
    want, want_grad = value_and_grad(ref_gspo, lp, *ref_args)
    got, got_grad = value_and_grad(gspo_loss, lp.to(dtype), *args)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got_grad.double(), want_grad, **tol)
    _, stats = gspo_loss(lp.to(dtype), *args)
    assert 0 < stats.clip_frac_seqs < 1  # the batch exercises both branches


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gspo_token_matches_reference(dtype: torch.dtype) -> None:
    b = ragged_batch(2)
    lp = b["lp"].to(dtype).double()
    old, adv = b["old"].to(dtype), b["adv_tok"].to(dtype)
    want, want_grad = value_and_grad(
        ref_gspo_token, lp, old.double(), adv.double(), b["mask"], *EPS_GSPO
    )
    got, got_grad = value_and_grad(gspo_token_loss, lp.to(dtype), old, adv, b["mask"], *EPS_GSPO)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got_grad.double(), want_grad, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("per_token", [False, True])
def test_grpo_matches_reference(dtype: torch.dtype, per_token: bool) -> None:
    b = ragged_batch(3, offset=0.1, noise=0.3)  # token ratios on both sides of 0.8 / 1.28
    lp = b["lp"].to(dtype).double()
    old = b["old"].to(dtype)
    adv = (b["adv_tok"] if per_token else b["adv"]).to(dtype)
    adv_tok = adv.double() if per_token else adv.double()[:, None].expand_as(lp)
    want, want_grad = value_and_grad(ref_grpo, lp, old.double(), adv_tok, b["mask"], *EPS_GRPO)
    got, got_grad = value_and_grad(grpo_loss, lp.to(dtype), old, adv, b["mask"], *EPS_GRPO)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got_grad.double(), want_grad, **tol)
    _, stats = grpo_loss(lp.to(dtype), old, adv, b["mask"], *EPS_GRPO)
    assert 0 < stats.clip_frac_tokens < 1


def test_kl_to_reference_matches_reference() -> None:
    b = ragged_batch(4, offset=0.2, noise=0.5)
    want, want_grad = value_and_grad(ref_kl, b["lp"], b["old"], b["mask"])
    got, got_grad = value_and_grad(kl_to_reference, b["lp"], b["old"], b["mask"])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# the paper's claims


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gspo_token_with_sequence_advantages_equals_gspo(dtype: torch.dtype) -> None:
    b = ragged_batch(5)
    lp, old, mask = b["lp"].to(dtype), b["old"].to(dtype), b["mask"]
    adv = b["adv"].to(dtype)
    seq, seq_grad = value_and_grad(gspo_loss, lp, old, adv, mask)
    tok, tok_grad = value_and_grad(gspo_token_loss, lp, old, adv[:, None].expand_as(lp), mask)
    torch.testing.assert_close(tok, seq, rtol=0, atol=1e-6)
    torch.testing.assert_close(tok_grad, seq_grad, rtol=0, atol=1e-6)
    _, seq_stats = gspo_loss(lp, old, adv, mask)
    _, tok_stats = gspo_token_loss(lp, old, adv[:, None].expand_as(lp), mask)
    assert tok_stats == seq_stats  # same clipping, same ratios, same counts
    assert 0 < seq_stats.clip_frac_seqs < 1


def test_gspo_gradient_is_equation_11() -> None:
    # d(-J)/d logp[i,t] = -(1/B) s_i A_i / |y_i| on row i's loss tokens where the clip is
    # inactive, and 0 on a clipped row (s_i > 1+ε_high with A_i > 0, s_i < 1-ε_low with A_i < 0).
    b = ragged_batch(6, batch=16)
    lp, old, mask, adv = b["lp"], b["old"], b["mask"], b["adv"]
    _, grad = value_and_grad(gspo_loss, lp, old, adv, mask)
    m = mask.double()
    n = m.sum(-1)
    s = torch.exp(((lp - old) * m).sum(-1) / n)
    clipped = ((s > 1 + 4e-4) & (adv > 0)) | ((s < 1 - 3e-4) & (adv < 0))
    weight = torch.where(clipped, 0.0, s * adv / n)  # eq. 11: equal weight per token of a row
    expected = -(weight[:, None] * m) / len(n)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-14)
    assert clipped.any() and (~clipped).any()
    for i in range(len(n)):  # tokens of one row share one weight
        assert grad[i][mask[i] == 1].unique().numel() == 1


@pytest.mark.parametrize(
    ("log_ratio", "adv", "gets_grad"),
    [
        (1e-3, 1.0, False),  # s > 1+ε_high, A > 0: pushing s further up is clipped
        (1e-3, -1.0, True),  # s > 1+ε_high, A < 0: the gradient pulls s back down
        (-1e-3, -1.0, False),  # s < 1-ε_low, A < 0: pushing s further down is clipped
        (-1e-3, 1.0, True),  # s < 1-ε_low, A > 0: the gradient pulls s back up
        (1e-4, 1.0, True),  # inside the range: always a gradient
    ],
)
def test_gspo_clipping_by_sign(log_ratio: float, adv: float, gets_grad: bool) -> None:
    old = torch.full((1, 4), -2.0, dtype=torch.float64)
    lp = old + log_ratio
    mask = torch.ones(1, 4)
    for fn in (gspo_loss, gspo_token_loss):
        a = torch.tensor([adv], dtype=torch.float64)
        a = a if fn is gspo_loss else a[:, None].expand(1, 4)
        _, grad = value_and_grad(fn, lp, old, a, mask)
        s = math.exp(log_ratio)
        if gets_grad:  # d(-s A)/d logp_t = -s A / |y|, pushing s back toward the range
            torch.testing.assert_close(grad, torch.full_like(grad, -s * adv / 4))
        else:
            assert torch.equal(grad, torch.zeros_like(grad))


def test_grpo_clips_per_token() -> None:
    # log-ratios [0.5, 0, -0.5, 0.1], A = +1, ε = 0.2 / 0.28:
    #   r = [e^0.5 = 1.648721, 1, e^-0.5 = 0.606531, e^0.1 = 1.105171]
    #   token 0: r > 1.28 and A > 0 -> clipped: objective 1.28, no gradient
    #   token 2: r < 0.8 but A > 0 -> min(rA, 0.8A) = rA, not clipped
    #   loss = -(1.28 + 1 + 0.606531 + 1.105171) / 4 = -0.997926
    #   grad_t = -r_t / 4 on tokens 1..3
    old = torch.zeros(1, 4, dtype=torch.float64)
    lp = torch.tensor([[0.5, 0.0, -0.5, 0.1]], dtype=torch.float64)
    adv = torch.ones(1, dtype=torch.float64)
    loss, grad = value_and_grad(grpo_loss, lp, old, adv, torch.ones(1, 4))
    assert loss.item() == pytest.approx(-(1.28 + 1 + math.exp(-0.5) + math.exp(0.1)) / 4, 1e-12)
    assert loss.item() == pytest.approx(-0.997926, abs=1e-6)
    r = torch.exp(lp)
    torch.testing.assert_close(grad, torch.where(r > 1.28, 0.0, -r / 4))
    _, stats = grpo_loss(lp, old, adv, torch.ones(1, 4))
    assert stats.clip_frac_tokens == 0.25 and stats.clip_frac_seqs == 1.0
    assert stats.ratio_max == pytest.approx(math.exp(0.5)) and stats.ratio_min == pytest.approx(
        math.exp(-0.5)
    )


# ---------------------------------------------------------------------------------------------
# hand-computed tiny cases


def test_gspo_tiny_hand_computed() -> None:
    # row 0: mask [1, 1, 0, 1], log-ratios [2e-4, 4e-4, (5.0, masked), 0]
    #   log s0 = (2e-4 + 4e-4 + 0) / 3 = 2e-4, s0 = e^2e-4 = 1.00020002, inside [0.9997, 1.0004]
    #   A0 = +1 -> objective 1.00020002
    # row 1: mask [1, 1, 1, 1], log-ratios all -1e-3 -> s1 = e^-1e-3 = 0.99900050 < 0.9997
    #   A1 = -1 -> min(-0.99900050, -0.9997) = -0.9997 (clipped, no gradient)
    # loss = -(1.00020002 - 0.9997) / 2 = -2.5001e-4
    # grad row 0 = -(1/2) * s0 * A0 / 3 = -0.16670000 on its 3 loss tokens; row 1 = 0
    old = torch.zeros(2, 4, dtype=torch.float64)
    lp = torch.tensor([[2e-4, 4e-4, 5.0, 0.0], [-1e-3] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, grad = value_and_grad(gspo_loss, lp, old, adv, mask)
    s0 = math.exp(2e-4)
    assert loss.item() == pytest.approx(-(s0 - 0.9997) / 2, rel=1e-12)
    assert loss.item() == pytest.approx(-2.5001e-4, abs=1e-9)
    expected = torch.tensor([[-s0 / 6, -s0 / 6, 0, -s0 / 6], [0, 0, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    _, stats = gspo_loss(lp, old, adv, mask)
    assert stats.clip_frac_seqs == 0.5
    assert stats.clip_frac_tokens == pytest.approx(4 / 7)  # row 1's 4 of 7 loss tokens
    assert (stats.num_tokens, stats.num_seqs) == (7, 2)
    assert stats.ratio_min == pytest.approx(math.exp(-1e-3))
    assert stats.ratio_max == pytest.approx(s0)
    assert stats.ratio_mean == pytest.approx((s0 + math.exp(-1e-3)) / 2)
    # approx_kl: token mean of e^d - 1 - d over the 7 loss tokens
    k3 = [math.exp(d) - 1 - d for d in (2e-4, 4e-4, 0.0, *[-1e-3] * 4)]
    assert stats.approx_kl == pytest.approx(sum(k3) / 7, rel=1e-9)
    metrics = stats.to_metrics()
    assert metrics["loss/clip_frac_seqs"] == 0.5 and metrics["loss/num_tokens"] == 7.0


def test_kl_tiny_hand_computed() -> None:
    # d = ref - logp = [-0.5, 0]; k3 = e^d - d - 1 = [0.10653066, 0]; mean over the row 0.05326533
    # d k3 / d logp = 1 - e^d = [0.39346934, 0], divided by |y| = 2 -> [0.19673467, 0]
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)
    kl, grad = value_and_grad(kl_to_reference, lp, ref, torch.ones(1, 2))
    assert kl.item() == pytest.approx(0.05326533, abs=1e-8)
    torch.testing.assert_close(grad, torch.tensor([[0.19673467, 0.0]], dtype=torch.float64))
    _, stats = kl_to_reference(lp, ref, torch.ones(1, 2))
    assert stats.kl_token_max == pytest.approx(0.10653066, abs=1e-8)
    assert stats.to_metrics()["kl/num_tokens"] == 2.0


# ---------------------------------------------------------------------------------------------
# stability, empty rows, micro-batches


ALL = [
    ("gspo", lambda lp, old, a, m: gspo_loss(lp, old, a, m)),
    ("gspo_token", lambda lp, old, a, m: gspo_token_loss(lp, old, a[:, None].expand_as(lp), m)),
    ("grpo", lambda lp, old, a, m: grpo_loss(lp, old, a, m)),
    ("cispo", lambda lp, old, a, m: cispo_loss(lp, old, a, m)),
    ("dppo", lambda lp, old, a, m: dppo_loss(lp, old, a, m)),
    ("kl", lambda lp, old, a, m: kl_to_reference(lp, old, m)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("name", "fn"), ALL)
def test_32k_tokens_and_huge_log_ratios_stay_finite(name: str, fn: Callable, dtype) -> None:
    T = 32_768
    g = torch.Generator().manual_seed(7)
    old = (-4 * torch.rand(6, T, generator=g)).to(dtype)
    gap = torch.tensor([50.0, -50.0, 50.0, -50.0, 0.0, 0.0])[:, None].expand(6, T).clone()
    gap[4] = torch.where(torch.arange(T) % 2 == 0, 50.0, -50.0)  # ±50 alternating in one row
    gap[5] = 1e-5 * torch.randn(T, generator=g)  # an ordinary row
    lp = (old.float() + gap).to(dtype)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0])
    loss, grad = value_and_grad(fn, lp, old, adv, torch.ones(6, T))
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.isfinite(loss) and torch.isfinite(grad.float()).all()
    if name != "kl":  # the ordinary row still learns
        assert grad[5].float().abs().sum() > 0


def test_log_ratio_is_capped() -> None:
    # past ±MAX_LOG_RATIO the value is capped and the gradient is zero, in GSPO and GSPO-token
    # alike (A < 0 selects the unclipped branch, which alone would still carry a gradient)
    lp, old, mask = torch.full((1, 3), 60.0), torch.zeros(1, 3), torch.ones(1, 3)
    loss, stats = gspo_loss(lp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(math.exp(MAX_LOG_RATIO), rel=1e-6)
    assert stats.ratio_max == pytest.approx(math.exp(MAX_LOG_RATIO), rel=1e-6)
    _, seq_grad = value_and_grad(gspo_loss, lp, old, torch.tensor([-1.0]), mask)
    _, tok_grad = value_and_grad(gspo_token_loss, lp, old, -torch.ones(1, 3), mask)
    assert torch.equal(seq_grad, torch.zeros(1, 3)) and torch.equal(tok_grad, seq_grad)
    _, below = value_and_grad(gspo_token_loss, lp - 45.0, old, -torch.ones(1, 3), mask)
    assert (below > 0).all()  # log-ratio 15: inside the cap, the gradient pulls s down


@pytest.mark.parametrize(("name", "fn"), ALL)
def test_all_masked_row_contributes_nothing(name: str, fn: Callable) -> None:
    b = ragged_batch(8, batch=5, max_len=300, offset=0.05, noise=0.1)
    lp, old, mask, adv = b["lp"], b["old"], b["mask"].clone(), b["adv"]
    lp, old = lp.clone(), old.clone()
    mask[2] = 0
    lp[2, ::2], lp[2, 1::2], old[2, :] = float("nan"), -float("inf"), -float("inf")
    adv = adv.clone()
    adv[2] = float("nan")  # even the empty row's advantage is garbage
    loss, grad = value_and_grad(fn, lp, old, adv, mask)
    keep = [0, 1, 3, 4]
    loss_without, grad_without = value_and_grad(fn, lp[keep], old[keep], adv[keep], mask[keep])
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, loss_without, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad[keep], grad_without, rtol=1e-12, atol=1e-14)
    assert torch.equal(grad[2], torch.zeros_like(grad[2]))


@pytest.mark.parametrize(("name", "fn"), ALL)
def test_all_rows_masked_gives_zero_not_nan(name: str, fn: Callable) -> None:
    lp = torch.randn(3, 5, requires_grad=True)
    loss, stats = fn(lp, torch.randn(3, 5), torch.ones(3), torch.zeros(3, 5))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(3, 5))
    assert stats.num_tokens == 0


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo", "cispo", "dppo", "kl"])
def test_micro_batches_accumulate_to_the_full_batch(name: str) -> None:
    # a mini-batch of 10 rows (one empty) split into micro-batches of 3, 4 and 3 rows, each
    # trimmed to its own width; with num_sequences = count_sequences(whole mask) the summed
    # losses and accumulated gradients equal one call on the whole mini-batch.
    b = ragged_batch(9, batch=10, max_len=400, offset=1e-3, noise=1e-3)
    lp, old, mask, adv = b["lp"], b["old"], b["mask"].clone(), b["adv_tok"]
    mask[6] = 0

    def call(lp_, old_, adv_, mask_, **kw):
        if name == "kl":
            return kl_to_reference(lp_, old_, mask_, **kw)[0]
        return LOSSES[name](lp_, old_, adv_[:, 0] if name == "gspo" else adv_, mask_, **kw)[0]

    full, full_grad = value_and_grad(call, lp, old, adv, mask)
    n = count_sequences(mask)
    assert n == 9
    leaf = lp.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for lo, hi in [(0, 3), (3, 7), (7, 10)]:
        width = int(mask[lo:hi].nonzero()[:, 1].max()) + 1
        part = call(
            leaf[lo:hi, :width],
            old[lo:hi, :width],
            adv[lo:hi, :width],
            mask[lo:hi, :width],
            num_sequences=n,
        )
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(leaf.grad, full_grad, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# memory, registry, validation


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        self.ops += 1
        return out


@pytest.mark.parametrize(("name", "fn"), ALL)
def test_nothing_larger_than_batch_by_tokens(name: str, fn: Callable) -> None:
    B, T = 8, 257
    lp = torch.randn(B, T, requires_grad=True)
    with _LargestTensor() as rec:
        loss, _ = fn(lp, torch.randn(B, T), torch.randn(B), torch.rand(B, T) > 0.3)
        loss.backward()
    assert rec.ops > 20 and lp.grad is not None
    assert rec.largest == B * T


def test_registry_and_validation() -> None:
    assert set(LOSSES) == {"gspo_token", "gspo", "grpo", "cispo", "dppo"}
    assert get_loss("cispo") is cispo_loss and get_loss("dppo") is dppo_loss
    assert get_loss("gspo") is gspo_loss
    with pytest.raises(ConfigError, match="expected one of"):
        get_loss("ppo")
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="old_logprobs: expected shape"):
        gspo_loss(lp, torch.zeros(2, 4), torch.zeros(2), mask)
    with pytest.raises(ValueError, match="advantages: expected shape"):
        gspo_loss(lp, lp, torch.zeros(2, 3), mask)  # GSPO takes one advantage per sequence
    with pytest.raises(ValueError, match="num_sequences"):
        grpo_loss(lp, lp, torch.zeros(2), mask, num_sequences=0)
    with pytest.raises(ValueError, match="eps_low"):
        gspo_token_loss(lp, lp, torch.zeros(2), mask, eps_low=1.5)
    with pytest.raises(TypeError, match="floating-point"):
        grpo_loss(lp.long(), lp, torch.zeros(2), mask)
    with pytest.raises(ValueError, match="eps_low"):
        cispo_loss(lp, lp, torch.zeros(2), mask, eps_low=1.5)
    with pytest.raises(ValueError, match="kl_coef"):
        dppo_loss(lp, lp, torch.zeros(2), mask, kl_coef=-1.0)


# ---------------------------------------------------------------------------------------------
# CISPO (MiniMax-M1, eqs. 4-5) and DPPO (prime-rl's default loss), against float64 references


def ref_cispo(lp, old, adv_tok, mask, eps_low, eps_high):
    terms, clipped = [], []
    for i, row in enumerate(mask):
        idx = row.nonzero().squeeze(-1)
        if len(idx) == 0:
            continue
        r = torch.exp(lp[i, idx] - old[i, idx]).detach()
        w = r.clamp(1 - eps_low, 1 + eps_high)  # sg(r̂)
        terms.append((w * adv_tok[i, idx] * lp[i, idx]).mean())
        clipped.append((r > 1 + eps_high) | (r < 1 - eps_low))
    return -torch.stack(terms).mean(), clipped


def ref_dppo(lp, old, adv_tok, mask, d_low, d_high, tau):
    terms, clipped = [], []
    for i, row in enumerate(mask):
        idx = row.nonzero().squeeze(-1)
        if len(idx) == 0:
            continue
        log_r = lp[i, idx] - old[i, idx]
        a = adv_tok[i, idx]
        dp = (lp[i, idx].exp() - old[i, idx].exp()).detach()
        drop = torch.tensor(
            [(x > 0 and p > d_high) or (x < 0 and p < -d_low) for x, p in zip(a, dp, strict=True)]
        )
        pg = torch.where(drop, 0.0, a * log_r.exp())
        terms.append((-pg + tau * log_r**2).mean())
        clipped.append(drop)
    return torch.stack(terms).mean(), clipped


def _fractions(clipped: list[torch.Tensor]) -> tuple[float, float]:
    tokens = torch.cat(clipped)
    return tokens.double().mean().item(), sum(bool(c.any()) for c in clipped) / len(clipped)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("eps", [(1.0, 0.28), (0.2, 0.28)])
def test_cispo_matches_reference(dtype: torch.dtype, eps: tuple[float, float]) -> None:
    b = ragged_batch(3, batch=8, max_len=600, offset=0.4, noise=0.2)
    lp = b["lp"].to(dtype).double()
    old, adv = b["old"].to(dtype), b["adv_tok"].to(dtype)
    ref = lambda x: ref_cispo(x, old.double(), adv.double(), b["mask"], *eps)[0]  # noqa: E731
    want, want_grad = value_and_grad(ref, lp)
    got, got_grad = value_and_grad(cispo_loss, lp.to(dtype), old, adv, b["mask"], *eps)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got_grad.double(), want_grad, **tol)
    _, clipped = ref_cispo(lp, old.double(), adv.double(), b["mask"], *eps)
    tok, seq = _fractions(clipped)
    _, stats = cispo_loss(lp.to(dtype), old, adv, b["mask"], *eps)
    assert 0.05 < tok < 0.95  # the data reach both sides of the clip
    assert stats.clip_frac_tokens == pytest.approx(tok, abs=1e-6)
    assert stats.clip_frac_seqs == pytest.approx(seq, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kl_coef", [0.0, 1e-3, 0.5])
def test_dppo_matches_reference(dtype: torch.dtype, kl_coef: float) -> None:
    b = ragged_batch(4, batch=8, max_len=600, offset=0.3, noise=0.3)
    old = (b["old"] / 3.0).to(dtype)  # probabilities in [0.37, 1]: differences past 0.2 happen
    lp = (b["lp"] - b["old"] + old.double()).to(dtype).double()
    adv = b["adv_tok"].to(dtype)
    args = (old.double(), adv.double(), b["mask"], 0.2, 0.15, kl_coef)
    want, want_grad = value_and_grad(lambda x: ref_dppo(x, *args)[0], lp)
    fn = lambda x: dppo_loss(x, old, adv, b["mask"], 0.2, 0.15, kl_coef=kl_coef)  # noqa: E731
    got, got_grad = value_and_grad(fn, lp.to(dtype))
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(got_grad.double(), want_grad, **tol)
    tok, seq = _fractions(ref_dppo(lp, *args)[1])
    _, stats = fn(lp.to(dtype))
    assert 0.01 < tok < 0.9
    assert stats.clip_frac_tokens == pytest.approx(tok, abs=1e-6)
    assert stats.clip_frac_seqs == pytest.approx(seq, abs=1e-6)


def test_cispo_tiny_hand_computed() -> None:
    # one row of 3 loss tokens (a gap between two turns), ratios 2, 1, 0.5; ε_high = 0.28, no
    # lower bound: weights 1.28, 1, 0.5; the clipped token keeps a gradient (PPO's would not)
    old = torch.log(torch.tensor([[0.2, 0.3, 0.9, 0.4]], dtype=torch.float64))
    lp = old + torch.log(torch.tensor([[2.0, 1.0, 7.0, 0.5]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 0, 1]])
    loss, grad = value_and_grad(cispo_loss, lp, old, torch.tensor([2.0]), mask)
    w = torch.tensor([1.28, 1.0, 0.0, 0.5], dtype=torch.float64)
    assert loss.item() == pytest.approx(-(w * 2.0 * lp[0]).sum().item() / 3, rel=1e-12)
    torch.testing.assert_close(grad[0], -w * 2.0 / 3, rtol=1e-12, atol=1e-15)
    _, stats = cispo_loss(lp, old, torch.tensor([2.0]), mask)
    assert stats.clip_frac_tokens == pytest.approx(1 / 3) and stats.clip_frac_seqs == 1.0


def test_dppo_masks_by_advantage_sign_and_probability_difference() -> None:
    # probabilities old -> new: 0.1 -> 0.5 (+0.4), 0.5 -> 0.1 (-0.4), 0.3 -> 0.35 (+0.05)
    old = torch.log(torch.tensor([[0.1, 0.5, 0.3]] * 2, dtype=torch.float64))
    lp = torch.log(torch.tensor([[0.5, 0.1, 0.35]] * 2, dtype=torch.float64))
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 3)
    loss, grad = value_and_grad(dppo_loss, lp, old, adv, mask, 0.2, 0.2)
    r = (lp - old).exp()
    # A > 0 masks the +0.4 rise only; A < 0 masks the -0.4 drop only
    keep = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]], dtype=torch.float64)
    tau = 1e-3
    want_grad = (-keep * adv[:, None].double() * r + 2 * tau * (lp - old)) / (3 * 2)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    _, stats = dppo_loss(lp, old, adv, mask, 0.2, 0.2)
    assert stats.clip_frac_tokens == pytest.approx(2 / 6) and stats.clip_frac_seqs == 1.0
