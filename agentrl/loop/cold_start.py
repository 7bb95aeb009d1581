"""Supervised cold start: fine-tune on demonstrated episodes before RL.

The GSPO paper starts RL from a cold-start model; on CPU a tiny model built from scratch needs the
same, or every reward is 0 and no group carries a signal. A demonstration is a whole episode: the
env's assistant turns for a task (:meth:`agentrl.env.Env.demonstration`; by default the reference
answer as one turn) replayed through the env, so that a tool call is followed by what the tool
really returns. It is tokenised exactly as a rollout is (the first prompt, then each assistant
turn and its stop token, then the observation as the chat template's delta), and the loss covers
every assistant turn; prompt, tool and env tokens are masked out, as in RL.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from agentrl.env import Env
from agentrl.errors import EnvError
from agentrl.rollout.chat import ChatTokenizer
from agentrl.types import Task

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]  # (token ids, loss mask)
Progress = Callable[[dict[str, float]], None]


async def demonstration_example(
    env: Env, task: Task, chat: ChatTokenizer, stop_id: int
) -> Example | None:
    """The (ids, mask) of one demonstrated episode of ``env`` on ``task``; ``None`` if it has none.

    Every assistant turn but the last is passed to ``env.step``; its observation is appended as
    a rollout would append it (loss mask 0). Assistant turns and their stop tokens get mask 1.

    Raises:
        EnvError: the env ended the episode before the demonstration's last turn.
    """
    turns = env.demonstration(task)
    if not turns:
        return None
    stop_text = chat.tokenizer.decode([stop_id], skip_special_tokens=False)
    messages, _ = await env.reset(task)
    ids = chat.prompt_ids(messages)
    mask = [0] * len(ids)
    for k, text in enumerate(turns):
        out = chat.encode(text) + [stop_id]
        ids += out
        mask += [1] * len(out)
        if k == len(turns) - 1:
            break  # the last turn's outcome adds no tokens; the env need not score it
        result = await env.step(text)
        if result.terminated or result.truncated:
            raise EnvError(
                f"task {task.id}: the env ended the demonstration after turn {k + 1} of "
                f"{len(turns)}; demonstration() must list the assistant turns of one episode"
            )
        obs = chat.observation_ids(result.observation, last_token_text=stop_text)
        ids += obs
        mask += [0] * len(obs)
    return ids, mask


async def build_demonstrations(
    make_env: Callable[[], Env], chat: ChatTokenizer, tasks: Sequence[Task], stop_id: int
) -> list[Example]:
    """One (ids, mask) example per task that has a demonstration (see the module doc)."""
    out: list[Example] = []
    for task in tasks:
        env = make_env()
        try:
            example = await demonstration_example(env, task, chat, stop_id)
        finally:
            await env.close()
        if example is not None:
            out.append(example)
    return out


def assistant_turns(mask: Sequence[int]) -> int:
    """Number of assistant turns in an example (runs of mask 1)."""
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


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


def masked_nll(model: torch.nn.Module, examples: Sequence[Example], pad_id: int) -> torch.Tensor:
    """Mean negative log-likelihood of the masked-in (assistant) tokens of ``examples``."""
    device = next(model.parameters()).device  # the policy's card (``model.device``)
    ids, mask, attn = (t.to(device, non_blocking=True) for t in _batch(examples, pad_id))
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    target_mask = mask[:, 1:].float()
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    return (nll * target_mask).sum() / target_mask.sum()


LOSS_EMA = 0.2
"""Weight of the newest step in the cold start's moving average of its loss."""
LOSS_DROP = 0.8
"""A check comes early once the averaged loss fell under this fraction of its last check's."""


def next_check(
    success: float, target: float, check_every: int, last: tuple[int, float], step: int
) -> int:
    """SFT steps until the next held-out check: fewer as success nears ``target``.

    ``check_every`` at 0 success, shrinking with the gap to the target (``check_every * gap /
    target``) or sooner when the rise since the last check (``last``: its step and success)
    would close the gap; within half of the target, every ``check_every // 10`` steps (at least
    1). A check costs one held-out evaluation; an overshoot costs RL its signal (issue 44: a
    0.30 target checked every 25 steps reached 0.74-0.88; a skill can form in a few steps).
    """
    fine = max(1, check_every // 10)
    gap = target - success
    if gap <= target / 2:
        return fine
    steps = check_every * gap / target
    rise = (success - last[1]) / max(1, step - last[0])  # per step, since the last check
    if rise > 0:
        steps = min(steps, gap / rise / 2)
    return max(fine, min(check_every, int(steps)))


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
    max_wall_s: float | None = None,
    on_progress: Progress | None = None,
) -> dict[str, float]:
    """Fine-tune ``model`` in place on ``examples``; returns the last loss and steps run.

    With ``check`` (a held-out success function) and ``target``, stops early once reached: the
    first check comes after ``check_every`` steps, later ones sooner as success nears the target
    (:func:`next_check`) or when the loss fell sharply (:data:`LOSS_DROP`), so a fast-learning
    model does not overshoot it by much. Stops, too,
    once ``max_wall_s`` seconds have passed. ``on_progress`` gets ``sft/step``, ``sft/steps``
    and ``sft/loss`` after every step, and ``sft/held_out_success`` with the step of each check.
    """
    if not examples:
        raise ValueError(
            "sft: expected at least one demonstration, got none (tasks need a reference answer, "
            "or the env a demonstration() for them)"
        )
    rng = random.Random(seed)
    fused = next(model.parameters()).device.type == "cuda" or None  # one kernel per step
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=fused)
    model.train()
    loss_value, done = float("nan"), 0
    t0 = time.perf_counter()
    due, last = check_every, (0, 0.0)  # the next check's step; the last check (step, success)
    smooth = checked_loss = float("inf")  # the loss's moving average, and its value at a check
    for step in range(steps):
        batch = rng.sample(list(examples), min(batch_size, len(examples)))
        loss = masked_nll(model, batch, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value, done = loss.item(), step + 1
        progress = {"sft/step": float(done), "sft/steps": float(steps), "sft/loss": loss_value}
        smooth = loss_value if done == 1 else (1 - LOSS_EMA) * smooth + LOSS_EMA * loss_value
        # a skill can form abruptly (held-out 0 for 200 steps, then up fast): a sharp fall of
        # the loss since the last check brings the next one forward
        sharp = (
            0 < last[0] <= done - max(1, check_every // 10) and smooth <= LOSS_DROP * checked_loss
        )
        if check is not None and target is not None and (done >= due or sharp):
            model.eval()
            success = await check()
            model.train()
            due = done + next_check(success, target, check_every, last, done)
            last, checked_loss = (done, success), smooth
            log.info(
                "cold start step %d: loss %.4f, held-out success %.3f", done, loss_value, success
            )
            progress["sft/held_out_success"] = success
            if on_progress is not None:
                on_progress(progress)
            if success >= target:
                break
        elif on_progress is not None:
            on_progress(progress)
        if max_wall_s is not None and time.perf_counter() - t0 > max_wall_s:
            log.info("cold start: stopping at step %d, cold_start.max_wall_s reached", done)
            break
    opt.zero_grad(set_to_none=True)  # else the RL learner's first update adds the last SFT grad
    model.eval()
    return {"sft/loss": loss_value, "sft/steps": float(done)}


async def cold_start(
    model: torch.nn.Module,
    make_env: Callable[[], Env],
    chat: ChatTokenizer,
    tasks: Sequence[Task],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    check: Callable[[], Awaitable[float]] | None = None,
    check_every: int = 50,
    target: float | None = None,
    max_wall_s: float | None = None,
    on_progress: Progress | None = None,
) -> dict[str, float]:
    """Build the demonstrations of ``tasks`` and fine-tune ``model`` on them (see :func:`sft`).

    ``on_progress`` first gets ``sft/demonstrations``, ``sft/assistant_turns_mean`` and
    ``sft/tokens_mean``, then :func:`sft`'s per-step figures; the returned stats hold both.
    """
    tok = chat.tokenizer
    demos = await build_demonstrations(make_env, chat, tasks, tok.eos_token_id)
    n = max(1, len(demos))
    stats = {
        "sft/demonstrations": float(len(demos)),
        "sft/assistant_turns_mean": sum(assistant_turns(m) for _, m in demos) / n,
        "sft/tokens_mean": sum(len(ids) for ids, _ in demos) / n,
    }
    if on_progress is not None:
        on_progress(dict(stats))
    stats |= await sft(
        model,
        demos,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        pad_id=tok.pad_token_id or 0,
        check=check,
        check_every=check_every,
        target=target,
        max_wall_s=max_wall_s,
        on_progress=on_progress,
    )
    return stats


async def of_trainer(trainer: Any) -> dict[str, float]:
    """The cold start of a :class:`~agentrl.loop.trainer.Trainer` (its ``cold_start`` section).

    Its held-out checks evaluate as the trainer does; its progress goes to ``trainer.on_step``
    (shown, not logged). A stop signal abandons it (:class:`~agentrl.loop.stop.Stopped`): a
    resume redoes it. Afterwards the learner takes the fine-tuned weights, a fresh optimizer,
    and the engine gets them.
    """
    from agentrl.loop import ranks as dist_ranks
    from agentrl.loop import stop

    cs = trainer.config.cold_start
    if cs.steps == 0:
        return {}
    model, push = dist_ranks.cold_start_model(trainer)  # several ranks: an unsharded replica

    async def check() -> float:
        await push()
        return float((await trainer.evaluate())["eval/success_rate"])

    def progress(m: dict[str, float]) -> None:
        if (signum := stop.requested()) is not None:
            raise stop.Stopped(trainer.step, signum, trainer.run_dir)
        if trainer.on_step is not None:
            trainer.on_step({"step": trainer.step, **m})

    stats = await cold_start(
        model, trainer.make_env, trainer.chat, trainer.train_tasks, steps=cs.steps,
        batch_size=cs.batch_size, lr=cs.lr, seed=trainer.config.seed, check=check,
        check_every=cs.check_every, target=cs.target_success, max_wall_s=cs.max_wall_s,
        on_progress=progress,
    )  # fmt: skip
    dist_ranks.adopt_cold_start(trainer.learner, model)
    trainer.learner.reset_optimizer()
    await trainer.sync_weights()
    return stats
