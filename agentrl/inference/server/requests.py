"""Reading requests in ``agentrl serve``: bodies, ``/generate``'s single and batch forms.

Large bodies are parsed, and text prompts tokenised, in a worker thread, so that one 10 MB
request never stalls ``/health`` or the requests being decoded; the body size itself is capped
by the server (``max_body_bytes``). Every input is bounded before work that grows with it: JSON
nested deeper than the parser's limit (~200 levels) or holding a lone UTF-16 surrogate is a 400
(as is invalid JSON); a prompt of more ids than the context holds is a 400 before its ids are
checked one by one, and a text prompt of more than ``MAX_CHARS_PER_TOKEN`` characters per token
of context a 400 before it is tokenised (a tokeniser's memory grows with its input: a 1 MB text
took +400 MB). Contract violations raise :class:`ContractError` (SGLang's
``{"error": "<serde text>"}``), refused requests :class:`RequestError`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic_core import from_json

from agentrl.inference.base import SamplingParams
from agentrl.inference.sglang_api import (
    ContractError,
    RequestError,
    TextOptions,
    parse_sampling_params,
    serde_unexpected,
)

OFFLOAD_BYTES = 256 * 1024
"""Bodies (and text prompts, in characters) at least this large are parsed off the event loop."""

MAX_CHARS_PER_TOKEN = 8
"""A text prompt longer than this many characters per token of context is refused untokenised
(English runs ~4 characters a token); send ``input_ids`` for anything else."""

UNSUPPORTED_TOP_LEVEL = (
    "image_data", "video_data", "audio_data", "session_params",
    "custom_logit_processor", "token_ids_logprob", "input_embeds",
)  # fmt: skip


@dataclass
class GenerateItem:
    """One prompt of a ``/generate`` call, normalised from the single or batch form."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    text_options: TextOptions
    return_logprob: bool
    logprob_start_len: int
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    lora_path: str | None = None  # a loaded adapter's name (SGLang's); None: what is served

    @property
    def routed(self) -> int:
        """The first row of routed experts to return; -1 when not asked for."""
        return self.routed_experts_start_len if self.return_routed_experts else -1


def parse_json(raw: bytes) -> Any:
    """``raw`` parsed (pydantic-core's parser: fast, and bounded in depth), or a clear 400.

    Raises:
        RequestError: invalid JSON, nesting past the parser's limit (~200), or a lone surrogate.
    """
    try:
        return from_json(raw)
    except ValueError as exc:
        message = str(exc)
    if "recursion limit" in message:
        raise RequestError(f"invalid JSON body: nested too deeply ({message})")
    try:  # the stdlib takes what pydantic-core refuses only for lone surrogates
        json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError(f"invalid JSON body: {message}") from None
    raise RequestError(
        "invalid JSON body: a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), "
        "which is not Unicode text"
    )


async def json_body(request: web.Request, default: Any = None) -> Any:
    """The parsed JSON body (``default`` when empty); invalid JSON is a 400.

    Raises:
        web.HTTPRequestEntityTooLarge: the body is over the app's ``client_max_size``.
        RequestError: see :func:`parse_json`; or not an object where ``default`` is one.
    """
    raw = await request.read()
    if not raw.strip():
        if default is None:
            raise RequestError("expected a JSON body")
        return default
    if len(raw) >= OFFLOAD_BYTES:
        body = await asyncio.to_thread(parse_json, raw)
    else:
        body = parse_json(raw)
    if default is not None and not isinstance(body, dict):
        raise RequestError("expected a JSON object")
    return body


def per_prompt(body: dict[str, Any], key: str, default: Any, n: int, batch: bool) -> list[Any]:
    """A field that is one value for every prompt or, in batch form, a list of n values."""
    value = body.get(key)
    if value is None:
        return [default] * n
    if batch and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{key}: expected {n} values (one per prompt), got {len(value)}")
        return [default if v is None else v for v in value]
    return [value] * n


def expect(values: list[Any], kind: type, expected: str) -> None:
    """Raise SGLang's contract error unless every value is a ``kind`` (bools are not ints)."""
    for value in values:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ContractError(f"invalid type: {serde_unexpected(value)}, expected {expected}")


def _too_long(count: int, max_model_len: int) -> RequestError:
    return RequestError(
        f"Requested token count exceeds the model's maximum context length of {max_model_len} "
        f"tokens: {count} input tokens."
    )


def _prompt_sources(body: dict[str, Any], max_model_len: int) -> tuple[list[Any], bool, bool]:
    """Every prompt's ids or text (``input_ids`` wins over ``text``), the batch and text flags.

    Over-long prompts are refused here, before any per-token work.
    """
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None:
        if not isinstance(ids, list):
            raise ContractError(f"invalid type: {serde_unexpected(ids)}, expected a sequence")
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        for prompt in prompts:
            if not isinstance(prompt, list):
                raise ContractError(
                    f"invalid type: {serde_unexpected(prompt)}, expected a sequence"
                )
            if len(prompt) >= max_model_len:
                raise _too_long(len(prompt), max_model_len)
            expect(prompt, int, "i64")
        return prompts, batch, False
    if text is not None:
        batch = isinstance(text, list)
        texts = text if batch else [text]
        expect(texts, str, "a string")
        limit = MAX_CHARS_PER_TOKEN * max_model_len
        for t in texts:
            if len(t) > limit:
                raise RequestError(
                    f"text: {len(t)} characters cannot fit the model's maximum context length of "
                    f"{max_model_len} tokens (text prompts are refused past {limit} characters, "
                    f"{MAX_CHARS_PER_TOKEN} per token, before tokenising; send input_ids)"
                )
        return texts, batch, True
    raise RequestError("Either text or input_ids should be provided.")


async def tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of ``texts`` as SGLang makes them (HF defaults: special tokens added)."""

    def run() -> list[list[int]]:
        return [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]

    if sum(len(t) for t in texts) >= OFFLOAD_BYTES:
        return await asyncio.to_thread(run)
    return run()


async def parse_generate(
    body: Any, *, vocab_size: int, tokenizer: Any, max_model_len: int
) -> tuple[list[GenerateItem], bool]:
    """Validate a ``/generate`` body; its prompts (tokenised) and whether it is a batch."""
    if not isinstance(body, dict):
        raise ContractError(
            f"invalid type: {serde_unexpected(body)}, expected struct GenerateRequest"
        )
    if body.get("stream"):
        raise RequestError("stream=true is not supported by agentrl's embedded server")
    for key in UNSUPPORTED_TOP_LEVEL:
        if body.get(key) not in (None, [], ""):
            raise RequestError(f"{key} is not supported by agentrl's embedded server")
    if body.get("top_logprobs_num") not in (None, 0) or body.get("return_hidden_states"):
        raise RequestError("top_logprobs_num / return_hidden_states are not supported here")
    sources, batch, is_text = _prompt_sources(body, max_model_len)
    n = len(sources)
    rid = body.get("rid")
    if isinstance(rid, str) and batch:
        rids = [f"{rid}_{i}" for i in range(n)]
    else:
        rids = [r or uuid.uuid4().hex for r in per_prompt(body, "rid", None, n, batch)]
    expect(rids, str, "a string")
    sampling = [
        parse_sampling_params(raw, vocab_size=vocab_size)
        for raw in per_prompt(body, "sampling_params", {}, n, batch)
    ]
    logprob = per_prompt(body, "return_logprob", False, n, batch)
    starts = per_prompt(body, "logprob_start_len", -1, n, batch)
    expect(logprob, bool, "a boolean")
    expect(starts, int, "i64")
    flags = [body.get("return_text_in_logprobs"), body.get("return_prompt_token_ids")]
    flags.append(body.get("return_routed_experts"))  # top-level, not a sampling param
    expect([f for f in flags if f is not None], bool, "a boolean")
    routed_start = body.get("routed_experts_start_len") or 0
    expect([routed_start], int, "i64")
    if routed_start < 0 and flags[-1]:
        raise RequestError(
            f"routed_experts_start_len={routed_start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    loras = per_prompt(body, "lora_path", None, n, batch)  # a name, or a list: one per prompt
    expect([name for name in loras if name is not None], str, "a string")
    prompts = await tokenize(tokenizer, sources) if is_text else sources
    if not prompts or any(len(p) == 0 for p in prompts):
        raise RequestError("input_ids: expected a non-empty prompt, got an empty one")
    items = []
    for i, prompt in enumerate(prompts):
        if not -1 <= starts[i] <= len(prompt):
            raise RequestError(
                f"logprob_start_len ({starts[i]}) must be -1 or in [0, {len(prompt)}]"
            )
        params, options = sampling[i]
        text, prompt_ids, routed = map(bool, flags)
        item = GenerateItem(
            rids[i], prompt, params, options, logprob[i], starts[i], text, prompt_ids, routed
        )
        item.routed_experts_start_len, item.lora_path = routed_start, loras[i]
        items.append(item)
    return items, batch
