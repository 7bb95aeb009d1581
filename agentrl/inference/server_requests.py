"""Reading requests in ``agentrl serve``: bodies, ``/generate``'s single and batch forms.

Large bodies are parsed, and text prompts tokenised, in a worker thread, so that one 10 MB
request never stalls ``/health`` or the requests being decoded; the body size itself is capped
by the server (``max_body_bytes``). Contract violations raise :class:`ContractError` (SGLang's
``{"error": "<serde text>"}``), refused requests :class:`RequestError`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

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

UNSUPPORTED_TOP_LEVEL = (
    "image_data", "video_data", "audio_data", "lora_path", "session_params",
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

    @property
    def routed(self) -> int:
        """The first row of routed experts to return; -1 when not asked for."""
        return self.routed_experts_start_len if self.return_routed_experts else -1


async def json_body(request: web.Request, default: Any = None) -> Any:
    """The parsed JSON body (``default`` when empty); invalid JSON is a 400.

    Raises:
        web.HTTPRequestEntityTooLarge: the body is over the app's ``client_max_size``.
    """
    raw = await request.read()
    if not raw.strip():
        if default is None:
            raise RequestError("expected a JSON body")
        return default
    try:
        body = (
            await asyncio.to_thread(json.loads, raw)
            if len(raw) >= OFFLOAD_BYTES
            else json.loads(raw)
        )
    except ValueError as exc:
        raise RequestError(f"invalid JSON body: {exc}") from exc
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


def _prompt_sources(body: dict[str, Any]) -> tuple[list[Any], bool, bool]:
    """Every prompt's ids or text (``input_ids`` wins over ``text``), the batch and text flags."""
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
            expect(prompt, int, "i64")
        return prompts, batch, False
    if text is not None:
        batch = isinstance(text, list)
        texts = text if batch else [text]
        expect(texts, str, "a string")
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
    body: Any, *, vocab_size: int, tokenizer: Any
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
    sources, batch, is_text = _prompt_sources(body)
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
        item = GenerateItem(
            rids[i], prompt, params, options, logprob[i], starts[i], *map(bool, flags)
        )
        item.routed_experts_start_len = routed_start
        items.append(item)
    return items, batch
