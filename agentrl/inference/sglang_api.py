"""The JSON shapes of SGLang's native ``/generate`` API, both directions.

Shared by :class:`~agentrl.inference.client.SGLangClient` (parsing responses) and the embedded
server (validating requests, building responses), so both follow one reading of the contract
of SGLang 0.5.23's ``sglang/api/v1/api_types.py`` (``docs/architecture.md`` lists the endpoints):

- ``sampling_params`` is strict: an unknown key or a wrongly typed value is rejected with
  SGLang's serde-style text (``unknown field `x`, expected one of ...``,
  ``invalid type: floating point `4.0`, expected i64``).
- Log-prob entries are ``[logprob, token_id, text | null]``; ``finish_reason`` is an object;
  ``weight_versions`` are contiguous spans over output indices.
- Weight versions are ints in agentrl and string labels in SGLang (:func:`parse_weight_version`).
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from array import array
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from agentrl.errors import ServerError
from agentrl.inference.base import FinishType, GenerateOutput, SamplingParams

logger = logging.getLogger(__name__)

_truncation_warned = False


def warn_if_truncating(params: SamplingParams) -> None:
    """Log once per process when ``params`` truncate sampling (top-p < 1 or top-k set)."""
    global _truncation_warned
    if params.truncates and not _truncation_warned:
        _truncation_warned = True
        logger.warning(
            "sampling is truncated (top_p=%s, top_k=%s): tokens are drawn from the truncated "
            "distribution but the returned log-probs are full-vocabulary log_softmax(logits / T) "
            "(SGLang's convention), so they are not the behaviour policy's log-probs and "
            "importance ratios trained on them are biased; use top_p=1, top_k=-1 for RL rollouts",
            params.top_p,
            params.top_k,
        )


def parse_weight_version(label: str | int) -> int:
    """Map an SGLang weight-version label to agentrl's int version.

    An int, or a string that parses as one (``"17"``), is that int. SGLang's startup label
    ``"default"`` (and ``""``) is 0, the weights the server was launched with. Any other label
    maps to a stable negative int, ``-(crc32(label) & 0x7FFFFFFF) - 1``: the same label gives
    the same int in every process, and it never collides with agentrl's own versions (>= 0).
    """
    if isinstance(label, int):
        return label
    text = label.strip()
    try:
        return int(text)
    except ValueError:
        pass
    if text in ("", "default"):
        return 0
    return -(zlib.crc32(text.encode()) & 0x7FFFFFFF) - 1


def error_text(body: bytes) -> str:
    """The server's error message from SGLang's error shapes, or the raw text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(data, dict):
        err = data.get("error", data.get("message", data))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return text[:500]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _span_versions(spans: Any, n: int, label: Any) -> list[int] | None:
    """Per-token versions from ``weight_versions`` spans (contiguous over output indices)."""
    if not spans:  # some abort paths send no spans: every token has the server's label
        return (
            [parse_weight_version(label)] * n if isinstance(label, (str, int)) or n == 0 else None
        )
    versions: list[int] = []
    for span in spans:
        if not isinstance(span, dict) or not isinstance(span.get("version"), (str, int)):
            return None
        start, end = span.get("start"), span.get("end")
        if not (_is_int(start) and _is_int(end)) or start != len(versions) or end < start:
            return None
        versions += [parse_weight_version(span["version"])] * (end - start)
    return versions if len(versions) == n else None


def parse_generate_response(
    data: Any, *, endpoint: str, server_rid: str, rid: str
) -> GenerateOutput:
    """Turn one SGLang ``/generate`` response object into a :class:`GenerateOutput`.

    Raises:
        ServerError: the response lacks or garbles a field agentrl relies on.
    """

    def bad(why: str) -> ServerError:
        return ServerError(
            f"malformed /generate response: {why}", endpoint=endpoint, rid=server_rid, status=200
        )

    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise bad("expected an object with meta_info")
    ids, meta = data.get("output_ids"), data["meta_info"]
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise bad("output_ids: expected a list of ints")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise bad("output_token_logprobs: expected one entry per output id")
    logprobs: list[float] = []
    for i, entry in enumerate(entries):
        ok = isinstance(entry, list) and len(entry) >= 2 and entry[1] == ids[i]
        if not ok or not isinstance(entry[0], (int, float)) or isinstance(entry[0], bool):
            raise bad(
                f"output_token_logprobs[{i}]: expected [logprob, {ids[i]}, text], got {entry}"
            )
        logprobs.append(float(entry[0]))
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise bad(f"finish_reason: expected a stop/length/abort object, got {finish!r}")
    label = meta.get("weight_version")
    versions = _span_versions(meta.get("weight_versions"), len(ids), label)
    if versions is None:
        raise bad(f"weight_versions: spans do not cover the {len(ids)} output tokens")
    matched = finish.get("matched")
    reason: FinishType = finish["type"]
    return GenerateOutput(
        rid=rid,
        output_ids=ids,
        logprobs=logprobs,
        versions=versions,
        finish_reason=reason,
        weight_version=parse_weight_version(label) if isinstance(label, (str, int)) else -1,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        matched_stop=matched if _is_int(matched) else None,
        endpoint=endpoint,
        meta={
            "server_rid": server_rid,
            "e2e_latency": meta.get("e2e_latency"),
            "cached_tokens": meta.get("cached_tokens", 0),
            "finish_message": finish.get("message", ""),
        },
    )


def aborted_output(rid: str) -> GenerateOutput:
    """An abort that landed between two tries of a request: nothing was generated."""
    return GenerateOutput(rid, [], [], [], "abort", weight_version=-1, endpoint="client")


def check_update_response(raw: bytes, url: str) -> None:
    """Raise :class:`ServerError` unless ``raw`` is a successful weight update response."""
    try:
        result = json.loads(raw)
    except ValueError:
        raise ServerError(
            f"malformed weight update response: {raw[:200]!r}", endpoint=url, status=200
        ) from None
    if not isinstance(result, dict) or result.get("success") is not True:
        raise ServerError(f"weight update failed: {result!r}", endpoint=url, status=200)


# ---- server side: request validation --------------------------------------------------------


def _ids_in_range(ids: list[int], vocab_size: int) -> bool:
    """Whether every id is an int in ``[0, vocab_size)``, checked in C.

    A check per token in Python took ~9 ms (2-core CPU) for the 128 requests that a weight
    push re-sends, on the engine's event loop.
    """
    try:
        packed = array("q", ids)  # refuses what is not an integer
    except (TypeError, OverflowError):
        return False
    return 0 <= min(packed) and max(packed) < vocab_size


def request_problem(
    input_ids: list[int],
    params: SamplingParams,
    rid: str | None,
    vocab_size: int,
    max_model_len: int,
    open_rids: Collection[str],
) -> str | None:
    """Why an engine refuses a prompt (SGLang's wording where it has one), or ``None``."""
    if not input_ids:
        return "input_ids: expected a non-empty list of token ids, got []"
    if rid is not None and rid in open_rids:
        return f"Duplicate request ID detected: {rid}"
    if not _ids_in_range(input_ids, vocab_size):
        bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        return f"input_ids: expected ids in [0, {vocab_size}), got {bad[:3]}"
    if len(input_ids) >= max_model_len or len(input_ids) + params.max_new_tokens > max_model_len:
        return (
            f"Requested token count exceeds the model's maximum context length of "
            f"{max_model_len} tokens: {len(input_ids)} input + {params.max_new_tokens} new tokens."
        )
    return None


class ContractError(ValueError):
    """The body violates SGLang's JSON contract (HTTP 400 ``{"error": "<text>"}``)."""


class RequestError(ValueError):
    """A well-formed request the server refuses (HTTP 400 ``{"error": {"message": ...}}``)."""


# The complete key set of SGLang 0.5.23's `sampling_params`, in its schema order.
SAMPLING_PARAM_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
_INT_FIELDS = {"max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval"}
_INT_FIELDS |= {"sampling_seed", "beam_width"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"}
_FLOAT_FIELDS |= {"repetition_penalty"}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"}
_BOOL_FIELDS |= {"no_stop_trim"}
_STR_FIELDS = {"json_schema", "regex", "ebnf", "structural_tag"}
# Accepted only at their "off" values: the embedded engine does not implement them.
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "stop": (None, "", []), "stop_regex": (None, "", []), "min_p": (None, 0.0),
    "frequency_penalty": (None, 0.0), "presence_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0), "min_new_tokens": (None, 0), "n": (None, 1),
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
    "logit_bias": (None, {}), "custom_params": (None,), "beam_width": (None,),
    "watermark": (None,), "choice": (None, []),
}  # fmt: skip


def serde_unexpected(value: Any) -> str:
    """Serde's ``Unexpected`` wording, as SGLang's contract errors use it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


_I64 = (-(2**63), 2**63 - 1)
_SEED_RANGE = (0, 2**63 - 1)


def _check_type(key: str, value: Any) -> None:
    def wrong(expected: str) -> ContractError:
        return ContractError(f"invalid type: {serde_unexpected(value)}, expected {expected}")

    if value is None or key == "custom_params":
        return
    if key in _INT_FIELDS and not _is_int(value):
        raise wrong("i64")
    if key in _INT_FIELDS and not _I64[0] <= value <= _I64[1]:
        raise ContractError(f"invalid value: {serde_unexpected(value)}, expected i64")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in _FLOAT_FIELDS and not number:
        raise wrong("f64")
    if key in _FLOAT_FIELDS and not math.isfinite(value):
        raise RequestError(f"sampling_params.{key}: expected a finite number, got {value}")
    if key in _BOOL_FIELDS and not isinstance(value, bool):
        raise wrong("a boolean")
    if key in _STR_FIELDS and not isinstance(value, str):
        raise wrong("a string")
    if key in ("stop", "stop_regex") and not (
        isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(s, str) for s in value))
    ):
        raise wrong("a string or a sequence of strings")
    if key == "stop_token_ids":
        if not isinstance(value, list):
            raise wrong("a sequence")
        for item in value:
            if not _is_int(item):
                raise ContractError(f"invalid type: {serde_unexpected(item)}, expected i64")
    if key in ("logit_bias", "watermark") and not isinstance(value, dict):
        raise wrong("a map")
    if key == "choice" and not isinstance(value, list):
        raise wrong("a sequence")


@dataclass(frozen=True, slots=True)
class TextOptions:
    """The ``sampling_params`` keys that only shape the response ``text``."""

    skip_special_tokens: bool = True
    no_stop_trim: bool = False


def parse_sampling_params(raw: Any, *, vocab_size: int) -> tuple[SamplingParams, TextOptions]:
    """Validate one ``sampling_params`` object strictly, as SGLang does.

    Raises:
        ContractError: not an object, an unknown key, or a value of the wrong JSON type.
        RequestError: a value out of range, or a feature the embedded engine does not have.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ContractError(
            f"invalid type: {serde_unexpected(raw)}, expected struct SamplingParams"
        )
    for key, value in raw.items():
        if key not in SAMPLING_PARAM_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_PARAM_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        _check_type(key, value)
        if key in _UNSUPPORTED_DEFAULTS and value not in _UNSUPPORTED_DEFAULTS[key]:
            raise RequestError(
                f"sampling_params.{key}={value!r} is not supported by agentrl's embedded server"
            )
    get = {k: v for k, v in raw.items() if v is not None}.get
    seed = get("sampling_seed")
    if seed is not None and not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
        raise RequestError(f"sampling_params.sampling_seed: expected 0 <= seed < 2**63, got {seed}")
    stop_ids = get("stop_token_ids", ())
    outside = [t for t in stop_ids if not 0 <= t < vocab_size]
    if outside:
        raise RequestError(
            f"sampling_params.stop_token_ids: expected ids in [0, {vocab_size}), got {outside[:3]}"
        )
    top_k = get("top_k", -1)
    if top_k >= vocab_size:  # SGLang's "whole vocabulary" is 1 << 30
        top_k = -1
    try:
        params = SamplingParams(
            max_new_tokens=get("max_new_tokens", 128),
            temperature=float(get("temperature", 1.0)),
            top_p=float(get("top_p", 1.0)),
            top_k=top_k,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=get("ignore_eos", False),
            seed=seed,
        )
    except ValueError as exc:
        raise RequestError(str(exc)) from exc
    options = TextOptions(get("skip_special_tokens", True), get("no_stop_trim", False))
    return params, options


# ---- server side: response building -----------------------------------------------------------


def finish_reason_json(out: GenerateOutput, max_new_tokens: int) -> dict[str, Any]:
    """SGLang's ``finish_reason`` object for ``out``."""
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    if out.finish_reason == "length":
        return {"type": "length", "length": max_new_tokens}
    message = out.meta.get("finish_message") or "Aborted"
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def version_spans(versions: list[int], label_of: Callable[[int], str]) -> list[dict[str, Any]]:
    """Contiguous ``{"version", "start", "end"}`` spans over output token indices."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        label = label_of(version)
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans
