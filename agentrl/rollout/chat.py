r"""Append-only tokenisation of a conversation with a chat template.

Re-tokenising a whole conversation after every turn is wrong for RL: BPE can merge across turn
borders, a sampled token sequence need not be the canonical encoding of its own text, and some
templates rewrite past turns (thinking models strip earlier ``<think>`` blocks). The ids a
trajectory trains on must be exactly those the engine was conditioned on and sampled, so the
sequence only grows:

* the first prompt is the template rendered with the generation prompt;
* after each assistant turn, the env's observation is appended as the template's *delta*: the
  text that closes the assistant turn (what follows the sampled stop token, e.g. ``"\n"``),
  the new messages, and the next generation prompt. The delta is found by rendering a fixed
  dummy conversation with and without the new messages, so past turns are never re-rendered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrl.errors import ConfigError
from agentrl.types import Message

_DUMMY = [{"role": "user", "content": "\x00u"}, {"role": "assistant", "content": "\x00a"}]


class ChatTokenizer:
    """Turns messages into token ids, append-only, with a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (or pass ``chat_template``).
        chat_template: overrides the tokenizer's template.
        template_kwargs: extra variables for the template (e.g. ``enable_thinking``).
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
        self._closing = self._find_closing()
        self._base = self._render(_DUMMY, add_generation_prompt=False)

    def _render(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        assert isinstance(text, str)
        return text

    def _find_closing(self) -> str:
        r"""The template text after an assistant message's content (e.g. ``<|im_end|>\n``)."""
        prompt = self._render(_DUMMY[:1], add_generation_prompt=True)
        full = self._render(_DUMMY, add_generation_prompt=False)
        content = _DUMMY[1]["content"]
        if not full.startswith(prompt + content):
            raise ConfigError(
                "chat_template: rendering an assistant turn does not extend the generation prompt"
                " with the message content; append-only tokenisation needs a template that does"
            )
        return full[len(prompt) + len(content) :]

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (no special tokens added: the template has them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Ids of the first prompt: ``messages`` rendered with the generation prompt."""
        dicts = [m.model_dump() for m in messages]
        return self.encode(self._render(dicts, add_generation_prompt=True))

    def closing_text(self, last_token_text: str | None) -> str:
        """The part of the assistant turn's closing that the sampled output did not contain.

        Args:
            last_token_text: the text of the stop token the engine sampled last (it is part of
                the output), or ``None`` when generation stopped without one (length, abort).
        """
        if last_token_text and self._closing.startswith(last_token_text):
            return self._closing[len(last_token_text) :]
        return self._closing

    def observation_ids(
        self, observation: Sequence[Message], *, last_token_text: str | None
    ) -> list[int]:
        """Ids to append after an assistant turn: its closing, ``observation``, the next prompt.

        ``observation`` may be empty (then only the closing and the generation prompt follow).
        """
        dicts = [m.model_dump() for m in observation]
        extended = self._render(_DUMMY + dicts, add_generation_prompt=True)
        if not extended.startswith(self._base):
            raise ConfigError(
                "chat_template: appending messages changed earlier text of the conversation;"
                " this template cannot be tokenised append-only"
            )
        delta = extended[len(self._base) :]
        return self.encode(self.closing_text(last_token_text) + delta)
