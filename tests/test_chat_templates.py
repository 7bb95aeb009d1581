"""Append-only tokenisation with real families' chat templates, on Qwen's real BPE vocabulary.

For every family and mode (tests/fixtures/chat_templates.py): a multi-turn tool episode whose
replies are tokenised the way a policy may sample them (not canonically); after each turn the
appended ids must decode to exactly the template's own continuation of the real conversation,
and the first prompt must be the template's rendering.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from fixtures.chat_templates import DEEPSEEK_R1_FIRST_ROUND_ONLY, FAMILIES, QWEN3
from fixtures.qwen_bpe import qwen_tokenizer

from agentrl.errors import ConfigError
from agentrl.rollout.chat import ChatTokenizer
from agentrl.types import Message

CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'

# (reasoning, answer, observation after the turn) of a four-turn tool episode: one call, two
# calls answered by two consecutive tool messages, an answer, a user follow-up, a final answer.
EPISODE: list[tuple[str, str, list[Message]]] = [
    ("I should add 3 and 4 first.", CALL.format("3+4"), [Message(role="tool", content="7")]),
    (
        "Now 12 times 7; check it twice.",
        CALL.format("12*7") + "\n" + CALL.format("7*12"),
        [Message(role="tool", content="84"), Message(role="tool", content="84")],
    ),
    ("Both agree.", "The answer is 84.", [Message(role="user", content="Sure? Number only.")]),
    ("Yes, 84.", "84", []),
]
FIRST = [
    Message(role="system", content="You are a careful assistant with a calculator."),
    Message(role="user", content="What is 12*(3+4)? Use the calculator."),
]
CASES = [(f, mode) for f, spec in FAMILIES.items() for mode, _ in spec[4]]


@functools.cache
def shared_tokenizer() -> Any:
    return qwen_tokenizer()  # (seconds to build: one for the module; templates are per call)


def tokenizer(family: str) -> Any:
    """The shared tokenizer with ``family``'s template, stop and BOS tokens."""
    template, stop, bos, _, _ = FAMILIES[family]
    tok = shared_tokenizer()
    tok.chat_template, tok.eos_token = template, stop
    tok.bos_token = bos or "<|endoftext|>"
    return tok


def render(tok: Any, messages: list[Message], kwargs: dict[str, Any]) -> str:
    dicts = [m.model_dump() for m in messages]
    text = tok.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True, **kwargs)
    assert isinstance(text, str)
    return text


def reply_text(family: str, kwargs: dict[str, Any], reasoning: str, answer: str) -> str:
    """What the model writes: R1 starts inside the prompt's <think>; Qwen3 opens its own."""
    if family == "deepseek-r1":
        return f"{reasoning}\n</think>\n\n{answer}"
    if family == "qwen3" and kwargs.get("enable_thinking") is not False:
        return f"<think>\n{reasoning}\n</think>\n\n{answer}"
    return answer


def sampled_ids(tok: Any, text: str) -> list[int]:
    """A legal, non-canonical tokenisation: the first 12 characters one by one, then the rest."""
    ids = [i for ch in text[:12] for i in tok.encode(ch, add_special_tokens=False)]
    return ids + tok.encode(text[12:], add_special_tokens=False)


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_tool_episode_appends_the_templates_continuation(family: str, mode: str) -> None:
    _, stop, _, thinks, modes = FAMILIES[family]
    kwargs = dict(modes)[mode]
    tok = tokenizer(family)
    chat = ChatTokenizer(tok, template_kwargs=kwargs)
    thinking = thinks and kwargs.get("enable_thinking") is not False
    ids = chat.prompt_ids(FIRST)
    assert tok.decode(ids) == render(tok, FIRST, kwargs)
    assert ids == tok.encode(render(tok, FIRST, kwargs), add_special_tokens=False)
    conv = list(FIRST)
    stop_id = tok.convert_tokens_to_ids(stop)
    for turn, (reasoning, answer, obs) in enumerate(EPISODE):
        text = reply_text(family, kwargs, reasoning, answer)
        sampled = sampled_ids(tok, text) + [stop_id]
        if len(text) > 12:  # really non-canonical
            assert sampled[:-1] != tok.encode(text, add_special_tokens=False)
        before = ids + sampled
        appended = chat.observation_ids(obs, last_token_text=stop)
        ids = before + appended
        conv += [Message(role="assistant", content=text), *obs]
        # The template's continuation of the real conversation: what follows this reply's
        # answer (templates may rewrite what precedes it), less the sampled stop token.
        full = render(tok, conv, kwargs)
        end = full.rindex(answer) + len(answer)
        assert full[end:].startswith(stop)
        expected = full[end + len(stop) :]
        assert tok.decode(appended) == expected, (family, mode, turn)
        assert appended == tok.encode(expected, add_special_tokens=False)
        assert chat.decode_reply(sampled[:-1]) == (answer, reasoning if thinking else None)
        if turn < 2:  # tool rounds of one query: the history is re-rendered as sampled, except
            # by DeepSeek-R1 (drops reasoning) and Qwen3 without thinking (drops empty blocks)
            rewrites = family == "deepseek-r1" or (family == "qwen3" and not thinking)
            assert (tok.decode(ids) == full) != rewrites, (family, mode, turn)
    transcript = tok.decode(ids)
    if thinking:
        assert "I should add 3 and 4 first." in transcript  # the trajectory keeps what was sampled
        assert "I should add 3 and 4 first." not in render(tok, conv, kwargs)  # the template not


def test_template_with_history_dependent_tool_rounds_is_refused() -> None:
    tok = tokenizer("deepseek-r1")
    chat = ChatTokenizer(tok, chat_template=DEEPSEEK_R1_FIRST_ROUND_ONLY)  # user turns are fine ...
    assert chat.observation_ids([Message(role="user", content="hi")], last_token_text=None)
    with pytest.raises(ConfigError, match="depends on earlier turns"):  # ... tool rounds are not
        chat.observation_ids([Message(role="tool", content="7")], last_token_text=None)


def test_merges_across_the_turn_border_are_kept_as_sampled() -> None:
    # Qwen3 without thinking: the prompt ends "</think>\n\n"; a reply that starts with "\n"
    # would merge into one "\n\n\n" token if the conversation were re-tokenised.
    tok = tokenizer("qwen3")
    chat = ChatTokenizer(tok, template_kwargs={"enable_thinking": False})
    prompt = chat.prompt_ids(FIRST)
    newline = tok.encode("\n", add_special_tokens=False)
    sampled = newline + tok.encode("84", add_special_tokens=False) + [tok.eos_token_id]
    ids = prompt + sampled
    obs = [Message(role="user", content="thanks")]
    ids += chat.observation_ids(obs, last_token_text="<|im_end|>")
    conv = [*FIRST, Message(role="assistant", content="\n84"), *obs]
    full = render(tok, conv, {"enable_thinking": False})
    retokenised = tok.encode(full, add_special_tokens=False)
    assert tok.decode(ids) != full  # the template drops the empty think block from history ...
    assert ids[len(prompt) : len(prompt) + len(sampled)] == sampled  # ... ids stay as sampled
    border = tok.encode("</think>\n\n\n84", add_special_tokens=False)
    assert len(border) < len(tok.encode("</think>\n\n", add_special_tokens=False)) + 3
    assert retokenised != ids


def test_qwen3_thinking_reply_is_split_for_the_env() -> None:
    tok = tokenizer("qwen3")
    chat = ChatTokenizer(tok)
    ids = tok.encode("<think>\nadd them\n</think>\n\n42", add_special_tokens=False)
    assert chat.decode_reply(ids) == ("42", "add them")
    cut = tok.encode("<think>\nstill thinking", add_special_tokens=False)  # length stop
    assert chat.decode_reply(cut) == ("", "still thinking")
    plain = ChatTokenizer(tok, chat_template=QWEN3, template_kwargs={"enable_thinking": False})
    assert plain.decode_reply(tok.encode("42", add_special_tokens=False)) == ("42", None)
