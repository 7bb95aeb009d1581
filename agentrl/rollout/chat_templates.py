r"""Probing a chat template for append-only tokenisation (used by :mod:`agentrl.chat`).

Templates of real models rewrite the conversation as it grows: Qwen3 renders the latest assistant
turn after the last user query with its ``<think>`` block and drops the block from earlier ones;
DeepSeek-R1 drops it always; Llama 3 trims contents and writes a dated system header. None of
that touches the text *after* an assistant message's content: the turn's closing, the next
messages, the next generation prompt. So the continuation of a turn is read off a canonical
dummy conversation that ends with an assistant message whose content is a sentinel: render it
with the new messages and keep what follows the sentinel's last occurrence. The sampled history
is never rendered.

That continuation must not depend on the earlier turns, or a canonical history cannot stand in
for the real one. Each observation shape (the tuple of its roles) is therefore probed once
against several different histories (a system message, thinking, earlier tool rounds, several
queries); a template whose continuation differs between them is refused with the rule it breaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrl.errors import ConfigError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

SENTINEL = "\x00agentrl-reply\x00"
"""Content of the dummy history's last assistant message (no whitespace: survives ``trim``)."""

Dicts = list[dict[str, str]]


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CANONICAL: Dicts = [_msg("user", "\x00u"), _msg("assistant", SENTINEL)]
"""The history every continuation is computed on."""

_THOUGHT = f"{THINK_OPEN}\n\x00r\n{THINK_CLOSE}\n\n"
_CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
PROBE_HISTORIES: list[Dicts] = [
    CANONICAL,
    [_msg("system", "\x00s"), _msg("user", "\x00u"), _msg("assistant", _THOUGHT + SENTINEL)],
    [
        _msg("system", "\x00s"),
        _msg("user", "\x00u"),
        _msg("assistant", _THOUGHT + _CALL),
        _msg("tool", "\x00t"),
        _msg("tool", "\x00t2"),
        _msg("assistant", _THOUGHT + _CALL),
        _msg("tool", "\x00t3"),
        _msg("assistant", _THOUGHT + SENTINEL),
    ],
    [
        _msg("user", "\x00u"),
        _msg("assistant", _THOUGHT + "\x00a"),
        _msg("user", "\x00u2"),
        _msg("assistant", SENTINEL),
    ],
]
"""Histories that must all give the same continuation (the first is :data:`CANONICAL`)."""


class TemplateProbe:
    """Renders a chat template and computes continuations after an assistant turn.

    Args:
        tokenizer: anything with Hugging Face's ``apply_chat_template``.
        chat_template: the Jinja template.
        template_kwargs: extra template variables (``enable_thinking``, ``tools``, ...).

    Raises:
        ConfigError: the template does not render an assistant's content verbatim, or the text
            after a user turn depends on earlier turns.
    """

    def __init__(self, tokenizer: Any, chat_template: str, template_kwargs: dict[str, Any]):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        self._checked: dict[tuple[str, ...], None] = {}
        ended = self.render(CANONICAL, add_generation_prompt=False)
        if SENTINEL not in ended:
            raise ConfigError(
                "chat_template: an assistant message's content must appear verbatim in the"
                " rendering (after any <think> block), or the text that closes a sampled turn"
                " cannot be found; this template drops or rewrites it"
            )
        self.closing = ended[ended.rindex(SENTINEL) + len(SENTINEL) :]
        """The template's text after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        self.check_roles(())
        self.check_roles(("user",))
        prompt = self.continuation([_msg("user", "\x00o")])
        self.opens_thinking = prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)
        """The generation prompt opens a ``<think>`` block the model is to close (DeepSeek-R1)."""

    def render(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool) -> str:
        """The template's text for ``messages``."""
        text = self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        assert isinstance(text, str)
        return text

    def continuation(self, observation: Dicts, history: Dicts = CANONICAL) -> str:
        """What follows the last assistant content of ``history`` once ``observation`` is added.

        That is the turn's closing, ``observation``'s rendering and the generation prompt.
        """
        text = self.render(history + observation, add_generation_prompt=True)
        at = text.rfind(SENTINEL)
        if at < 0:
            roles = [m["role"] for m in observation]
            raise ConfigError(
                f"chat_template: appending {roles} messages dropped the assistant turn before"
                " them from the rendering; append-only tokenisation needs it kept"
            )
        return text[at + len(SENTINEL) :]

    def check_roles(self, roles: tuple[str, ...]) -> None:
        """Check once per observation shape that its continuation ignores earlier turns.

        Raises:
            ConfigError: the template cannot render these roles after an assistant turn, or
                renders them differently depending on the conversation before that turn.
        """
        if roles in self._checked:
            return
        probe = [_msg(role, f"\x00o{i}") for i, role in enumerate(roles)]
        try:
            expected = self.continuation(probe)
        except ConfigError:
            raise
        except Exception as e:  # jinja's raise_exception, a missing variable, ...
            raise ConfigError(
                f"chat_template: cannot render {list(roles)} messages after an assistant turn: {e}"
            ) from None
        for history in PROBE_HISTORIES[1:]:
            try:
                got = self.continuation(probe, history)
            except ConfigError:
                raise
            except Exception:
                continue  # a history this template refuses (e.g. no tool role): not a conflict
            if got != expected:
                raise ConfigError(
                    f"chat_template: the text after an assistant turn followed by"
                    f" {list(roles)} messages depends on earlier turns ({expected!r} after"
                    f" {_roles(CANONICAL)}, {got!r} after {_roles(history)}); append-only"
                    " tokenisation needs the continuation of a turn to depend only on it"
                )
        self._checked[roles] = None


def _roles(messages: Dicts) -> list[str]:
    return [m["role"] for m in messages]


def split_reasoning(text: str, *, opened: bool) -> tuple[str, str | None]:
    """``(answer, reasoning)`` of a decoded reply; ``reasoning`` is ``None`` without thinking.

    The reasoning is what precedes the last ``</think>`` (after any ``<think>``); the answer is
    what follows it. A reply that opened the block (or whose prompt did: ``opened``) but has no
    ``</think>`` is all reasoning, cut off before its answer.
    """
    if THINK_CLOSE not in text:
        if opened or text.lstrip().startswith(THINK_OPEN):
            return "", text.split(THINK_OPEN)[-1].strip()
        return text, None
    before, _, answer = text.rpartition(THINK_CLOSE)
    return answer.lstrip(), before.split(THINK_OPEN)[-1].strip()
