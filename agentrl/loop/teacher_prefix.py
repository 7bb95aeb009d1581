"""Teacher forwards that run a shared prompt once: a group's prefix, then its members' suffixes.

A group's episodes share their prompt (in ``cpu-tiny-distill`` 25 of ~29 tokens, 4 episodes a
group), so a forward over each whole sequence runs the prompt ``group_size`` times. Here
sequences that share a long prefix are clustered; each cluster's prefix runs once (right-padded,
its keys and values kept), those rows are repeated for the members, and only the suffixes run on
top of them (their own positions, the prefix's padding masked). The log-probs are those of a
forward over each whole sequence within float rounding (other matmul shapes); the tokens run
drop to ``prefixes + suffixes`` (a cpu-tiny-distill step, in batches of 16: 1,187 of 3,653).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

MIN_SHARED_FRAC = 0.25
"""Take this path only when the prefixes it runs once would save at least this fraction of the
tokens: it runs two forwards where the plain path runs one."""

Logprobs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(float logits [B, T, V], targets [B, T]) -> log-probs [B, T]`` at the teacher's tau."""


def cache_kw(model: Any) -> str | None:
    """The forward's cache argument, or ``None`` when its cache is not full attention throughout.

    A sliding-window layer's cache may drop the prefix it was given, so such models take the
    plain path (as :class:`~agentrl.inference.engine.dense_runner.ModelRunner` refuses them).
    """
    from transformers import DynamicCache

    layers = getattr(DynamicCache(config=model.config), "layers", None)
    if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return None
    # transformers 5 renamed `past_key_values` to `cache`
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def clusters(seqs: list[list[int]]) -> list[tuple[int, list[int]]]:
    """``(prefix length, members)`` covering every sequence once; each member's suffix is >= 1.

    Sorted sequences next to each other share the longest prefixes, and the common prefix of a
    sorted run is that of its first and last. A run grows while that stays at least half of the
    next sequence and of the run's prefix so far (a prompt shared by a group's episodes); a lone
    sequence is its own cluster (prefix: all but its last token).
    """
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    out: list[tuple[int, list[int]]] = []
    for i in order:
        if out:
            p, members = out[-1]
            shared = min(p, _lcp(seqs[members[0]], seqs[i]), len(seqs[i]) - 1)
            # at least half of both: a short common start (a chat header) would lengthen every
            # member's suffix, and the suffixes are padded to the longest
            if shared >= 1 and 2 * shared >= max(len(seqs[i]), p):
                out[-1] = (shared, [*members, i])
                continue
        out.append((len(seqs[i]) - 1, [i]))
    return out


def saved_frac(seqs: list[list[int]], found: list[tuple[int, list[int]]]) -> float:
    """The fraction of the plain forward's tokens that running each prefix once saves."""
    total = sum(map(len, seqs))
    return sum(p * (len(m) - 1) for p, m in found) / max(total, 1)


def chunks(
    seqs: list[list[int]], found: list[tuple[int, list[int]]], budget: int
) -> list[list[tuple[int, list[int]]]]:
    """Clusters in forwards of at most ``budget`` (padded) key positions, one member at least.

    A cluster too big for one forward is split (each piece runs the prefix again): the members'
    repeated keys and values are as many as a plain forward's.
    """
    out: list[list[tuple[int, list[int]]]] = []
    rows = width = 0
    pieces: list[tuple[int, list[int]]] = []
    for p, members in found:
        n = max(1, budget // max(len(seqs[i]) for i in members))
        pieces += [(p, members[k : k + n]) for k in range(0, len(members), n)]
    for c in sorted(pieces, key=lambda c: max(len(seqs[i]) for i in c[1])):
        w = max(len(seqs[i]) for i in c[1])
        if out and (rows + len(c[1])) * max(width, w) <= budget:
            out[-1].append(c)
            rows, width = rows + len(c[1]), max(width, w)
        else:
            out.append([c])
            rows, width = len(c[1]), w
    return out


@torch.inference_mode()
def score_shared(
    model: Any,
    kw: str,
    seqs: list[list[int]],
    part: list[tuple[int, list[int]]],
    logprobs: Logprobs,
) -> dict[int, list[float]]:
    """Log-probs (position 0 is 0.0) of the clusters' sequences, by index into ``seqs``.

    ``kw``: :func:`cache_kw` of the model. Every sequence has at least 2 tokens.
    """
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    plen = [p for p, _ in part]
    width = max(plen)
    pre = torch.zeros(len(part), width, dtype=torch.long, device=dev)
    pre_mask = torch.zeros_like(pre)
    for r, (p, members) in enumerate(part):
        pre[r, :p] = torch.tensor(seqs[members[0]][:p], device=dev)
        pre_mask[r, :p] = 1
    # right padding: each prefix row's causal attention never sees its padding
    cache = DynamicCache(config=model.config)
    pre_logits = model(input_ids=pre, attention_mask=pre_mask, use_cache=True, **{kw: cache})
    pre_logits = pre_logits.logits.float()
    rows = [(c, i) for c, (_, members) in enumerate(part) for i in members]
    sw = max(len(seqs[i]) - plen[c] for c, i in rows)
    suf = torch.zeros(len(rows), sw, dtype=torch.long, device=dev)
    suf_mask = torch.zeros_like(suf)
    for r, (c, i) in enumerate(rows):
        tail = seqs[i][plen[c] :]
        suf[r, : len(tail)] = torch.tensor(tail, device=dev)
        suf_mask[r, : len(tail)] = 1
    which = torch.tensor([c for c, _ in rows], device=dev)
    cache.batch_select_indices(which)  # each member gets its prefix's keys and values
    starts = torch.tensor([plen[c] for c, _ in rows], device=dev)
    # a suffix token's position continues its own prefix (not the padded width); the key mask
    # hides the prefix's padding, the cache's causal offset keeps the suffix causal
    pos = starts[:, None] + torch.arange(sw, device=dev)[None, :]
    mask = torch.cat([pre_mask[which], suf_mask], 1)
    suf_logits = model(
        input_ids=suf, attention_mask=mask, position_ids=pos, use_cache=True, **{kw: cache}
    ).logits.float()
    # prefix positions predict the prefix's next tokens and the suffix's first; the suffix's
    # positions the rest
    pre_lp = logprobs(pre_logits[:, :-1], pre[:, 1:]) if width > 1 else None
    first = suf[:, :1]
    last = pre_logits[which, (starts - 1)][:, None]
    first_lp = logprobs(last, first)[:, 0]
    suf_lp = logprobs(suf_logits[:, :-1], suf[:, 1:]) if sw > 1 else None
    result: dict[int, list[float]] = {}
    for r, (c, i) in enumerate(rows):
        p, n = plen[c], len(seqs[i]) - plen[c]
        head = pre_lp[c, : p - 1].tolist() if pre_lp is not None else []
        tail = suf_lp[r, : n - 1].tolist() if suf_lp is not None else []
        result[i] = [0.0, *head, float(first_lp[r]), *tail]
    return result
