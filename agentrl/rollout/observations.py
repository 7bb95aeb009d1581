"""Bounds on the text an env hands the engine, applied before anything is tokenised.

Tokenising a 10 MB observation whole took a training process from 0.5 to 4.4 GB. So a step's
observation is first cut to :data:`CHARS_PER_TOKEN` characters per token of
``rollout.max_observation_tokens`` (no tokenizer packs more into a token on average; the cut
text is what the trajectory keeps), and only then tokenised and counted. An observation over
either bound ends the episode as truncated, finish reason ``observation_too_long``: it is what
the policy's own action produced (a tool that printed a whole file), not a broken env, so the
episode is data, not a failure. A first prompt (``reset``) longer than ``CHARS_PER_TOKEN``
characters per token of ``rollout.max_total_tokens`` fails the episode instead: the task or
the env is wrong.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from agentrl.env import StepResult
from agentrl.errors import EnvError
from agentrl.types import Message

CHARS_PER_TOKEN = 8
"""Characters per token at which an observation is cut before tokenisation."""

FINISH_REASON = "observation_too_long"


def _content(message: Any) -> str | None:
    got = message.get("content") if isinstance(message, dict) else getattr(message, "content", 0)
    return got if isinstance(got, str) else None


def bounded_step(result: Any, max_chars: int) -> tuple[Any, int]:
    """``result`` with its observation cut to ``max_chars`` characters in all, and its size.

    Returns:
        ``(result, chars)``: ``chars`` is the observation's length before any cut; when it is over
        ``max_chars`` the returned result keeps the messages up to the cut, the last one ending
        with a note. Anything malformed is returned as is (``checked_step`` reports it).
    """
    if not isinstance(result, StepResult) or not isinstance(result.observation, (list, tuple)):
        return result, 0
    chars = sum(len(c) for c in map(_content, result.observation) if c is not None)
    if chars <= max_chars:
        return result, chars
    kept: list[Any] = []
    left = max_chars
    for m in result.observation:
        content = _content(m)
        if content is None:
            kept.append(m)
            continue
        if len(content) > left:
            cut = f"{content[:left]}\n[... cut: the observation has {chars} characters]"
            kept.append({**m, "content": cut} if isinstance(m, dict) else _with(m, cut))
            break
        kept.append(m)
        left -= len(content)
    return replace(result, observation=kept), chars


def _with(message: Any, content: str) -> Any:
    if isinstance(message, Message):
        return message.model_copy(update={"content": content})
    return message  # not a Message: checked_step rejects it anyway


def check_prompt_size(messages: list[Message], max_total_tokens: int) -> None:
    """Refuse a first prompt that cannot fit the context budget, before it is tokenised.

    Raises:
        EnvError: longer than ``CHARS_PER_TOKEN`` characters per token of the budget.
    """
    chars = sum(len(m.content) for m in messages)
    if chars > CHARS_PER_TOKEN * max_total_tokens:
        raise EnvError(
            f"reset() returned a prompt of {chars} characters; rollout.max_total_tokens="
            f"{max_total_tokens} allows at most {CHARS_PER_TOKEN * max_total_tokens} "
            f"({CHARS_PER_TOKEN} per token)"
        )


def too_long(env: str, chars: int, tokens: int | None, max_tokens: int) -> str:
    """The message of an observation over ``rollout.max_observation_tokens``."""
    size = f"{chars} characters" if tokens is None else f"{tokens} tokens"
    return (
        f"env {env} returned an observation of {size}, over rollout.max_observation_tokens="
        f"{max_tokens}; the episode is truncated (finish reason {FINISH_REASON})"
    )
