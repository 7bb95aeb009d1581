"""Tiny models and tokenizers built locally, with no download.

Tests, CPU demos and ``agentrl serve --model tiny`` use a Qwen3-architecture model built from a
config and a character-level tokenizer made here, with a Qwen-style chat template. Random
initialisation is seeded, so the same call gives the same weights on every machine.
"""

from __future__ import annotations

import string
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
# As in Qwen3's tokenizer, only the first three are special (dropped by ``skip_special_tokens``);
# the thinking and tool markers are ordinary added tokens, so a decoded tool call keeps its
# ``<tool_call>`` tags and reaches the env's parser.
_SPECIAL = 3

# Qwen-style ChatML: every message is "<|im_start|>role\ncontent<|im_end|>\n".
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

# Like Qwen3's thinking template: earlier assistant turns lose their <think>...</think> block, so
# re-rendering a conversation rewrites past turns (the case append-only tokenisation avoids).
THINKING_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in c %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


# Qwen3-0.6B's architecture (596M parameters), for GPU benchmarks built from config with random
# weights: no download.
QWEN3_0_6B_SHAPE: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)

# Qwen3-30B-A3B's architecture (48 layers, 128 experts, 8 routed per token), for GPU figures built
# from config with random weights; pass ``num_hidden_layers`` to fit one card.
QWEN3_30B_A3B_SHAPE: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=False,
)


def _char_vocab() -> list[str]:
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    return SPECIAL_TOKENS + chars + ["<unk>"]


def build_tiny_tokenizer(chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (printable ASCII + ChatML specials) with a chat template.

    The markers ``<think>``, ``<tool_call>``, ``<tool_response>`` (and their closing tags) are
    one token each but not special, like Qwen3's: decoding keeps them.
    """
    vocab = {tok: i for i, tok in enumerate(_char_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL_TOKENS[1:_SPECIAL],
    )
    # already in the vocabulary, so their ids do not change
    fast.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS[_SPECIAL:]]
    )
    fast.chat_template = chat_template
    return fast


def tiny_config(vocab_size: int, **overrides: Any) -> Qwen3Config:
    """A Qwen3 config a few layers deep; ``overrides`` change any field."""
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast | None = None, *, seed: int = 0, **overrides: Any
) -> Qwen3ForCausalLM:
    """A float32 Qwen3 model with seeded random weights sized for ``tokenizer``."""
    tokenizer = tokenizer or build_tiny_tokenizer()
    return _seeded(Qwen3ForCausalLM, tiny_config(len(tokenizer), **overrides), tokenizer, seed)


def _seeded(cls: Any, config: Any, tokenizer: PreTrainedTokenizerFast, seed: int) -> Any:
    """``cls(config)`` in float32 eval mode, weights drawn from ``seed``, ids from ``tokenizer``."""
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        # transformers leaves an MoE router at zeros (every expert ties); a small random router
        # makes the choice depend on the token, as in a trained model.
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                torch.nn.init.normal_(gate.weight, std=config.initializer_range)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.float().eval()


def build_tiny(seed: int = 0, **overrides: Any) -> tuple[Qwen3ForCausalLM, PreTrainedTokenizerFast]:
    """The tiny model and its tokenizer together."""
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(tokenizer, seed=seed, **overrides), tokenizer


def tiny_moe_config(vocab_size: int, **overrides: Any) -> Qwen3MoeConfig:
    """A Qwen3-MoE config a few layers deep (8 experts, 2 routed per token); ``overrides`` win."""
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=0.0,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


def build_tiny_moe(
    seed: int = 0, **overrides: Any
) -> tuple[Qwen3MoeForCausalLM, PreTrainedTokenizerFast]:
    """A float32 Qwen3-MoE model with seeded random weights, and the tiny tokenizer."""
    tokenizer = build_tiny_tokenizer()
    config = tiny_moe_config(len(tokenizer), **overrides)
    return _seeded(Qwen3MoeForCausalLM, config, tokenizer, seed), tokenizer


PRESETS = ("tiny", "tiny-moe")
"""Model names built here from config, with no download: dense Qwen3 and Qwen3-MoE."""


def build_preset(
    name: str, seed: int = 0, **overrides: Any
) -> tuple[Qwen3ForCausalLM | Qwen3MoeForCausalLM, PreTrainedTokenizerFast]:
    """The preset model ``name`` (one of :data:`PRESETS`) and its tokenizer."""
    if name == "tiny":
        return build_tiny(seed=seed, **overrides)
    if name == "tiny-moe":
        return build_tiny_moe(seed=seed, **overrides)
    raise ValueError(f"unknown model preset {name!r}; expected one of {PRESETS}")
