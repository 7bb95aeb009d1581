"""The embedded teacher runs a group's shared prompt once: the same log-probs as whole forwards."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from agentrl.config import load_config
from agentrl.loop import teacher_prefix as prefix
from agentrl.loop.teacher import make_teacher
from agentrl.tiny import build_tiny


def test_clusters_are_groups_sharing_long_prefixes() -> None:
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9]
    c, lone, short = [1, 2, 3, 4, 5, 6, 7, 2], [1, 2, 8, 8, 8, 8, 8, 8], [5, 5]
    found = prefix.clusters([a, b, c, lone, short])
    # c, a, b sorted; a lone sequence (only a short start shared) runs all but its last token
    assert found == [(6, [2, 0, 1]), (7, [3]), (1, [4])]
    assert prefix.saved_frac([a, b, c, lone, short], found) == pytest.approx(12 / 33)
    # a cluster too big for one forward is split; clusters share forwards up to the budget
    assert prefix.chunks([a, b, c, lone, short], found, 16) == [
        [(1, [4]), (6, [1])], [(6, [2, 0])], [(7, [3])]
    ]  # fmt: skip


def group_sequences(tok, groups: int, size: int, seed: int) -> list[list[int]]:
    """Addition prompts, ``size`` sampled-like answers each (of different lengths)."""
    rng = random.Random(seed)
    seqs = []
    for _ in range(groups):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        prompt = tok(f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n")
        for _ in range(size):
            seqs.append(prompt["input_ids"] + tok(f"{rng.randint(0, 2000)}<|im_end|>")["input_ids"])
    return seqs


@pytest.mark.parametrize("tau", [0.25, 1.0])
def test_shared_prefix_scores_equal_whole_sequence_forwards(tau: float) -> None:
    # a sharp random teacher (large logits), as in test_distill_temperature.py
    model, tok = build_tiny(seed=7, initializer_range=0.2)
    seqs = group_sequences(tok, 6, 4, seed=0) + [tok("<|im_start|>user\n9=")["input_ids"]]
    config = load_config(None, ["teacher.model=tiny", "teacher.seed=7",
                                f"teacher.temperature={tau}",
                                'teacher.tiny={"initializer_range": 0.2}'])  # fmt: skip
    teacher = make_teacher(config, tok)
    assert teacher is not None
    scorer = teacher.scorer
    kw = scorer.cache_kw  # type: ignore[union-attr]
    assert kw is not None
    found = prefix.clusters(seqs)
    assert len(found) == 7 and prefix.saved_frac(seqs, found) > 0.6  # the shared path is taken
    got = asyncio.run(scorer.score(seqs))
    scorer.cache_kw = None  # type: ignore[union-attr]  # the plain path: whole padded sequences
    plain = asyncio.run(scorer.score(seqs))
    for ids, row, whole in zip(seqs, got, plain, strict=True):
        with torch.no_grad():  # one sequence alone, no padding, in float64
            z = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
        want = torch.log_softmax(z / tau, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert len(row) == len(ids) and row[0] == 0.0
        for scores in (row, whole):
            err = (torch.tensor(scores[1:], dtype=torch.float64) - want).abs().max()
            assert err < 1e-4, float(err)  # float32 rounding of other matmul shapes
        assert max(abs(x - y) for x, y in zip(row, whole, strict=True)) < 1e-4
    # several forwards (a small budget) give the same numbers as one
    few: dict[int, list[float]] = {}
    parts = prefix.chunks(seqs, found, 64)
    for part in parts:
        few |= prefix.score_shared(model, kw, seqs, part, scorer._logprobs)  # type: ignore[union-attr]
    assert len(parts) > 3
    for i, row in enumerate(got):
        assert max(abs(x - y) for x, y in zip(row, few[i], strict=True)) < 1e-4
