"""``teacher.temperature``: the embedded teacher's log-probs of its distribution at tau."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.loop.teacher import make_teacher
from agentrl.tiny import build_tiny


def scores(tok, seqs: list[list[int]], **teacher: object) -> list[list[float]]:
    config = load_config(None, [f"teacher.{k}={v}" for k, v in teacher.items()])
    t = make_teacher(config, tok)
    assert t is not None

    async def go() -> list[list[float]]:
        try:
            return await t.scorer.score(seqs)
        finally:
            await t.aclose()

    return asyncio.run(go())


def sequences(tok) -> list[list[int]]:
    texts = ["<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n46<|im_end|>",
             "<|im_start|>user\n7+8=<|im_end|>\n<|im_start|>assistant\n15"]  # fmt: skip
    return [tok(x)["input_ids"] for x in texts]  # two lengths: one row is right-padded


@pytest.mark.parametrize("tau", [0.3, 0.5, 0.8, 1.7])
def test_tempered_teacher_is_log_softmax_of_logits_over_tau(tau: float) -> None:
    # a sharp random teacher (large logits), so tempering moves its log-probs by nats
    model, tok = build_tiny(seed=7, initializer_range=0.2)
    seqs = sequences(tok)
    got = scores(tok, seqs, model="tiny", seed=7, temperature=tau,
                 tiny='{"initializer_range": 0.2}')  # fmt: skip
    base = scores(tok, seqs, model="tiny", seed=7, tiny='{"initializer_range": 0.2}')
    for ids, row, untempered in zip(seqs, got, base, strict=True):
        with torch.no_grad():
            z = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
        want = torch.log_softmax(z / tau, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert len(row) == len(ids) and row[0] == 0.0  # aligned: nothing predicts token 0
        err = (torch.tensor(row[1:], dtype=torch.float64) - want).abs().max()
        assert err < 1e-6, float(err)
        moved = (torch.tensor(row[1:]) - torch.tensor(untempered[1:])).abs().max()
        assert moved > 0.1, float(moved)  # tempering changed the numbers


def test_temperature_one_leaves_the_scores_bit_identical() -> None:
    # the untempered computation as it was: one padded forward, float32 log_softmax, gather
    model, tok = build_tiny(seed=7)
    seqs = sequences(tok)
    got = scores(tok, seqs, model="tiny", seed=7)
    assert got == scores(tok, seqs, model="tiny", seed=7, temperature=1.0)
    width = max(map(len, seqs))
    order = sorted(range(2), key=lambda i: -len(seqs[i]))  # the scorer's row order
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, i in enumerate(order):
        ids[r, : len(seqs[i])], mask[r, : len(seqs[i])] = torch.tensor(seqs[i]), 1
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        lps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    for r, i in enumerate(order):
        assert got[i] == [0.0, *lps[r, : len(seqs[i]) - 1].tolist()]  # exactly


def test_temperature_is_positive_and_refused_for_an_endpoint() -> None:
    assert load_config(None).teacher.temperature == 1.0
    for bad in ("0", "-0.5"):
        with pytest.raises(ConfigError, match="teacher.temperature: Input should be greater"):
            load_config(None, ["teacher.model=tiny", f"teacher.temperature={bad}"])
    with pytest.raises(ConfigError) as err:
        load_config(None, ["teacher.endpoint=http://127.0.0.1:9", "teacher.temperature=0.5"])
    assert "temperature: expected 1.0 with an endpoint" in str(err.value)
    assert "got 0.5" in str(err.value) and "\n" not in str(err.value)
    ok = load_config(None, ["teacher.endpoint=http://127.0.0.1:9", "teacher.temperature=1"])
    assert ok.teacher.endpoint == "http://127.0.0.1:9" and ok.teacher.temperature == 1.0
    assert load_config(None, ["teacher.model=tiny", "teacher.temperature=0.5"]).teacher.enabled
