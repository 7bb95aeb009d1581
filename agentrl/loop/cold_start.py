"""Supervised cold start: fine-tune on scripted demonstrations before RL.

The GSPO paper starts RL from a cold-start model; on CPU a tiny model built from scratch needs the
same, or every reward is 0 and no group carries a signal. A demonstration is the env's first
prompt (tokenised exactly as rollouts tokenise it) followed by the reference answer and the stop
token; the loss covers the answer tokens only.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence

import torch
import torch.nn.functional as F

from agentrl.env import Env
from agentrl.rollout.chat import ChatTokenizer
from agentrl.types import Task

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]  # (token ids, loss mask)


async def build_demonstrations(
    make_env: Callable[[], Env], chat: ChatTokenizer, tasks: Sequence[Task], stop_id: int
) -> list[Example]:
    """One (ids, mask) example per task with an answer: the env's prompt + answer + stop."""
    out: list[Example] = []
    for task in tasks:
        if task.answer is None:
            continue
        env = make_env()
        try:
            messages, _ = await env.reset(task)
        finally:
            await env.close()
        prompt = chat.prompt_ids(messages)
        answer = chat.encode(task.answer) + [stop_id]
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def _batch(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(m)] = torch.tensor(m)
        attn[i, : len(x)] = 1
    return ids, mask, attn


async def sft(
    model: torch.nn.Module,
    examples: Sequence[Example],
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    pad_id: int = 0,
    check: Callable[[], Awaitable[float]] | None = None,
    check_every: int = 50,
    target: float | None = None,
) -> dict[str, float]:
    """Fine-tune ``model`` in place on ``examples``; returns the last loss and steps run.

    With ``check`` (a held-out success function) and ``target``, stops early once reached.
    """
    if not examples:
        raise ValueError("sft: expected at least one demonstration, got none")
    rng = random.Random(seed)
    fused = next(model.parameters()).device.type == "cuda" or None  # one kernel per step
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=fused)
    model.train()
    loss_value, done = float("nan"), 0
    device = next(model.parameters()).device  # the policy's card (``model.device``)
    for step in range(steps):
        batch = _batch(rng.sample(list(examples), min(batch_size, len(examples))), pad_id)
        ids, mask, attn = (t.to(device, non_blocking=True) for t in batch)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        target_mask = mask[:, 1:].float()
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * target_mask).sum() / target_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value, done = loss.item(), step + 1
        if check is not None and target is not None and done % check_every == 0:
            model.eval()
            success = await check()
            model.train()
            log.info(
                "cold start step %d: loss %.4f, held-out success %.3f", done, loss_value, success
            )
            if success >= target:
                break
    model.eval()
    return {"sft/loss": loss_value, "sft/steps": float(done)}
