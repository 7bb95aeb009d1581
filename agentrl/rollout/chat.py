r"""Append-only tokenisation of a conversation with a chat template.

Re-tokenising a whole conversation after every turn is wrong for RL: BPE can merge across turn
borders, a sampled token sequence need not be the canonical encoding of its own text, and real
templates rewrite past turns (Qwen3 and DeepSeek-R1 strip earlier ``<think>`` blocks, Llama 3
trims contents). The ids a trajectory trains on must be exactly those the engine was
conditioned on and sampled, so the sequence only grows:

* the first prompt is the template rendered with the generation prompt;
* after each assistant turn, the env's observation is appended as the template's own
  continuation: the text that closes the assistant turn (what follows the sampled stop token,
  e.g. ``"\n"``), the new messages, and the next generation prompt. It is read off a canonical
  dummy conversation rendered with the new messages (:mod:`agentrl.rollout.chat_templates`), so the
  sampled history is never re-rendered; a template whose continuation depends on earlier turns
  is refused with a :class:`~agentrl.errors.ConfigError` that names the rule.

Thinking models' replies are split with :meth:`ChatTokenizer.decode_reply`: the env gets the
answer, the reasoning goes to the turn's info, and every sampled token stays in the trajectory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from agentrl.errors import ConfigError
from agentrl.rollout.chat_templates import THINK_CLOSE, TemplateProbe, split_reasoning
from agentrl.types import Message

PROMPT_CACHE_SIZE = 4096
"""First prompts :meth:`ChatTokenizer.prompt_ids` keeps (least recently used dropped first)."""


class ChatTokenizer:
    """Turns messages into token ids, append-only, with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (or pass ``chat_template``).
        chat_template: overrides the tokenizer's template.
        template_kwargs: extra variables for the template (e.g. ``enable_thinking``, ``tools``).

    Raises:
        ConfigError: no template, or one that cannot be extended append-only (the message names
            the rule it breaks).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ConfigError("chat_template: the tokenizer has none; pass chat_template=")
        self.template_kwargs = template_kwargs or {}
        self._probe = TemplateProbe(tokenizer, self.chat_template, self.template_kwargs)
        self._closing = self._probe.closing
        self._think_close_id = _single_token_id(tokenizer, THINK_CLOSE)
        # first prompts by messages: a group's G episodes (and a task's evaluations) start from
        # the same messages, and rendering plus encoding costs ~0.5 ms on the event loop
        self._prompts: OrderedDict[tuple[tuple[str, str], ...], list[int]] = OrderedDict()

    @property
    def opens_thinking(self) -> bool:
        """Whether the generation prompt opens a ``<think>`` block (DeepSeek-R1 style)."""
        return self._probe.opens_thinking

    def _render(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool) -> str:
        return self._probe.render(messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (no special tokens added: the template has them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Ids of the first prompt: ``messages`` rendered with the generation prompt.

        The last ``PROMPT_CACHE_SIZE`` distinct prompts are kept (a fresh list is returned).
        """
        key = tuple((m.role, m.content) for m in messages)
        ids = self._prompts.get(key)
        if ids is None:
            dicts = [m.model_dump() for m in messages]
            ids = self._prompts[key] = self.encode(self._render(dicts, add_generation_prompt=True))
            if len(self._prompts) > PROMPT_CACHE_SIZE:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return list(ids)

    def closing_text(self, last_token_text: str | None) -> str:
        """The part of the assistant turn's closing that the sampled output did not contain.

        Args:
            last_token_text: the text of the stop token the engine sampled last (it is part of
                the output), or ``None`` when generation stopped without one (length, abort).
        """
        if last_token_text and self._closing.startswith(last_token_text):
            return self._closing[len(last_token_text) :]
        return self._closing

    def continuation_text(
        self, observation: Sequence[Message], *, last_token_text: str | None
    ) -> str:
        """The template's text after a sampled assistant turn: closing, observation, prompt.

        Raises:
            ConfigError: the template renders these roles differently depending on the
                conversation before (checked once per tuple of roles).
        """
        dicts = [m.model_dump() for m in observation]
        self._probe.check_roles(tuple(m["role"] for m in dicts))
        text = self._probe.continuation(dicts)
        if last_token_text and text.startswith(last_token_text):
            text = text[len(last_token_text) :]
        return text

    def observation_ids(
        self, observation: Sequence[Message], *, last_token_text: str | None
    ) -> list[int]:
        """Ids to append after an assistant turn: its closing, ``observation``, the next prompt.

        ``observation`` may be empty (then only the closing and the generation prompt follow).
        """
        return self.encode(self.continuation_text(observation, last_token_text=last_token_text))

    def decode_reply(self, ids: Sequence[int]) -> tuple[str, str | None]:
        """``(answer, reasoning)`` of a sampled reply (stop token excluded).

        ``reasoning`` is the ``<think>`` block's text (``None`` when the reply has none); the
        answer is what follows ``</think>``, decoded without special tokens. Split on the
        ``</think>`` token where it is one, so that tokenizers that mark it special agree.
        """
        ids = list(ids)
        close = self._think_close_id
        if close is not None and close in ids:
            cut = len(ids) - ids[::-1].index(close)
            before = self.tokenizer.decode(ids[: cut - 1], skip_special_tokens=True)
            answer = self.tokenizer.decode(ids[cut:], skip_special_tokens=True)
            return split_reasoning(f"{before}{THINK_CLOSE}{answer}", opened=True)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return split_reasoning(text, opened=self.opens_thinking)


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` if the tokenizer has it as one token, else ``None``."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:
        return None
    return int(ids[0]) if len(ids) == 1 else None
