"""Stand-in models: a real model's shape and Qwen's real BPE, saved as a loadable HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.errors import ConfigError
from agentrl.standin import QWEN_VOCAB, build_standin, standin_config

# Narrow and one layer deep, so a test writes ~40 MB instead of the real 3.4 GB.
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32)  # fmt: skip


def test_shapes_have_the_published_sizes() -> None:
    c = standin_config("qwen3-1.7b")
    assert (c.model_type, c.hidden_size, c.num_hidden_layers, c.num_key_value_heads) == (
        "qwen3",
        2048,
        28,
        8,
    )
    assert c.vocab_size == QWEN_VOCAB and c.tie_word_embeddings
    with torch.device("meta"):  # counts parameters without allocating them
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(c).parameters())
    assert 1.70e9 < n < 1.73e9, n  # Qwen3-1.7B: 1.72B with the tied embedding
    assert standin_config("llama-3.2-1b").rope_scaling["rope_type"] == "llama3"
    with pytest.raises(ConfigError, match="unknown stand-in shape"):
        standin_config("qwen3-1000b")


def test_a_qwen3_standin_loads_with_qwens_tokenizer_and_template(tmp_path: Path) -> None:
    out = build_standin("qwen3-1.7b", tmp_path / "m", dtype="float32", **SMALL)
    assert json.loads((out / "standin.json").read_text())["standin"] == "qwen3-1.7b"
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]  # Qwen's ids
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == QWEN_VOCAB
    assert sorted(model.generation_config.eos_token_id) == [151643, 151645]
    ids = torch.tensor([tok.encode("2+2=")])
    assert model(ids).logits.shape == (1, 4, QWEN_VOCAB)
    again = build_standin("qwen3-1.7b", tmp_path / "n", dtype="float32", **SMALL)
    a, b = (AutoModelForCausalLM.from_pretrained(d).model.embed_tokens.weight for d in (out, again))
    assert torch.equal(a, b)  # seeded: the same directory twice
    with pytest.raises(ConfigError, match="not empty"):
        build_standin("qwen3-1.7b", out, **SMALL)


def test_a_llama_standin_keeps_llamas_template_and_stop_token(tmp_path: Path) -> None:
    small = {**SMALL, "head_dim": 32}
    out = build_standin("llama-3.2-1b", tmp_path / "l", dtype="bfloat16", **small)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|eot_id|>" and tok.bos_token == "<|begin_of_text|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
        date_string="1 Jan 2026",
    )
    assert text.startswith("<|begin_of_text|><|start_header_id|>system")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama" and model.dtype == torch.bfloat16
