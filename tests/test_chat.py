"""Append-only tokenisation: ids never change, and re-tokenising can differ (shown here)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agentrl.errors import ConfigError
from agentrl.rollout.chat import ChatTokenizer
from agentrl.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, THINKING_CHAT_TEMPLATE, build_tiny_tokenizer
from agentrl.types import Message


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on arithmetic chat text, so "46" is one token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        f"user\n{a}+{b}=\nassistant\n{a + b} tool\nok" for a in range(10, 60) for b in range(30)
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def full_ids(tok, messages, template=CHAT_TEMPLATE) -> list[int]:
    text = tok.apply_chat_template(
        [m.model_dump() for m in messages],
        chat_template=template,
        add_generation_prompt=True,
        tokenize=False,
    )
    return tok.encode(text, add_special_tokens=False)


def test_prompt_ids_match_template() -> None:
    tok = build_tiny_tokenizer()
    chat = ChatTokenizer(tok)
    msgs = [Message(role="system", content="be brief"), Message(role="user", content="1+2")]
    assert chat.prompt_ids(msgs) == full_ids(tok, msgs)
    assert tok.decode(chat.prompt_ids(msgs)).endswith("<|im_start|>assistant\n")


def test_prompt_ids_render_a_repeated_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import agentrl.rollout.chat as chat_module

    tok = build_tiny_tokenizer()
    chat = ChatTokenizer(tok)
    renders: list[str] = []
    render = chat._render
    monkeypatch.setattr(
        chat, "_render", lambda m, **k: renders.append(m[-1]["content"]) or render(m, **k)
    )
    monkeypatch.setattr(chat_module, "PROMPT_CACHE_SIZE", 2)
    q = [[Message(role="user", content=f"{i}+1")] for i in range(3)]
    first = chat.prompt_ids(q[0])
    first.append(-1)  # the caller's list is its own
    assert chat.prompt_ids(q[0]) == full_ids(tok, q[0])  # a group's other episodes: no render
    assert renders == ["0+1"]
    chat.prompt_ids(q[1])
    chat.prompt_ids(q[0])  # used last: kept when a third prompt comes
    chat.prompt_ids(q[2])
    chat.prompt_ids(q[0])
    chat.prompt_ids(q[1])  # the least recently used one was dropped
    assert renders == ["0+1", "1+1", "2+1", "1+1"]
    other = [Message(role="system", content="0+1"), Message(role="user", content="0+1")]
    assert chat.prompt_ids(other) == full_ids(tok, other)  # roles are part of the key


def test_append_only_equals_full_render_for_canonical_tokens() -> None:
    # With a char tokenizer every sampled sequence is canonical, so both ways agree exactly.
    tok = build_tiny_tokenizer()
    chat = ChatTokenizer(tok)
    user = [Message(role="user", content="guess")]
    ids = chat.prompt_ids(user)
    sampled = tok.encode("50", add_special_tokens=False) + [tok.eos_token_id]
    ids += sampled
    obs = [Message(role="user", content="higher")]
    ids += chat.observation_ids(obs, last_token_text="<|im_end|>")
    conv = user + [Message(role="assistant", content="50")] + obs
    assert ids == full_ids(tok, conv)


def test_observation_after_length_stop_closes_the_turn() -> None:
    tok = build_tiny_tokenizer()
    chat = ChatTokenizer(tok)
    delta = chat.observation_ids([Message(role="tool", content="x")], last_token_text=None)
    assert tok.decode(delta) == "<|im_end|>\n<|im_start|>tool\nx<|im_end|>\n<|im_start|>assistant\n"


def test_retokenising_changes_bpe_ids_but_append_only_keeps_them() -> None:
    tok = bpe_tokenizer()
    chat = ChatTokenizer(tok)
    user = [Message(role="user", content="12+34=")]
    ids = chat.prompt_ids(user)
    canonical = tok.encode("46", add_special_tokens=False)
    assert len(canonical) == 1, "the BPE should have merged '46'"
    # The policy sampled '4' then '6' (legal, non-canonical): same text, different ids.
    sampled = tok.encode("4", add_special_tokens=False) + tok.encode("6", add_special_tokens=False)
    sampled.append(tok.eos_token_id)
    ids += sampled
    obs = [Message(role="tool", content="ok")]
    ids += chat.observation_ids(obs, last_token_text="<|im_end|>")
    full = full_ids(tok, user + [Message(role="assistant", content="46")] + obs)
    assert tok.decode(ids) == tok.decode(full)  # the same text ...
    assert ids != full  # ... but re-tokenising would train on tokens the policy never sampled
    start = len(chat.prompt_ids(user))
    assert ids[start : start + 3] == sampled


def test_thinking_template_rewrites_past_turns_append_only_does_not() -> None:
    tok = build_tiny_tokenizer(THINKING_CHAT_TEMPLATE)
    chat = ChatTokenizer(tok)
    user = [Message(role="user", content="2+2")]
    ids = chat.prompt_ids(user)
    answer = "<think>two and two</think>4"
    sampled = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
    ids += sampled
    obs = [Message(role="user", content="sure?")]
    ids += chat.observation_ids(obs, last_token_text="<|im_end|>")
    full = full_ids(
        tok, user + [Message(role="assistant", content=answer)] + obs, THINKING_CHAT_TEMPLATE
    )
    assert "two and two" not in tok.decode(full)  # the template stripped the earlier thinking
    assert "two and two" in tok.decode(ids)  # the trajectory keeps what was sampled
    assert ids[: len(chat.prompt_ids(user)) + len(sampled)][-len(sampled) :] == sampled


def test_template_without_extension_is_rejected() -> None:
    tok = build_tiny_tokenizer("{{ 'fixed' }}")
    with pytest.raises(ConfigError, match="chat_template"):
        ChatTokenizer(tok)


def test_reply_with_special_think_tokens_is_split_on_the_token() -> None:
    # The tiny tokenizer marks <think> and </think> special: decoding drops them, so the split
    # happens on the </think> id; the answer goes to the env, the reasoning to the turn's info.
    tok = build_tiny_tokenizer(THINKING_CHAT_TEMPLATE)
    chat = ChatTokenizer(tok)
    ids = tok.encode("<think>two and two</think>4", add_special_tokens=False)
    assert chat.decode_reply(ids) == ("4", "two and two")
    assert chat.decode_reply(tok.encode("4", add_special_tokens=False)) == ("4", None)


def test_template_that_drops_the_reply_names_the_rule() -> None:
    dropping = (
        "{%- for m in messages %}{%- if m['role'] != 'assistant' %}{{ m['content'] }}"
        "{%- endif %}{%- endfor %}"
    )
    with pytest.raises(ConfigError, match="content must appear verbatim"):
        ChatTokenizer(build_tiny_tokenizer(dropping))
