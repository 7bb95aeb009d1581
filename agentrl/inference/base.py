"""The one inference protocol everything above the client uses.

``generate / abort / update_weights_from_disk / health``: the SGLang HTTP client is the real
path; :class:`~agentrl.inference.engine.LocalEngine` implements the same protocol in process.
Log-probs follow SGLang's convention: ``log_softmax(logits / temperature)`` over the full
vocabulary, not renormalised by top-p/top-k (plain ``log_softmax(logits)`` when greedy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

FinishType = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling parameters agentrl sends (a subset of SGLang's ``sampling_params``).

    RL presets keep ``top_p=1`` and ``top_k=-1`` so the returned log-prob is the true
    behaviour log-prob of the sampled token.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k: expected -1 (whole vocabulary) or >= 1, got {self.top_k}")

    @property
    def truncates(self) -> bool:
        """Whether sampling is truncated, so returned log-probs are not the behaviour's."""
        return self.top_p < 1.0 or self.top_k != -1

    def to_sglang(self) -> dict[str, Any]:
        """The JSON ``sampling_params`` object of SGLang's ``/generate``."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass(slots=True)
class GenerateOutput:
    """What one generate call produced (possibly partial, when aborted).

    ``output_ids``, ``logprobs`` and ``versions`` have one entry per new token; ``versions``
    holds the weight version that sampled each token (one request can span an update).
    ``routed_experts`` (requests that asked, MoE models) is int16
    ``(prompt_tokens + len(output_ids) - 1, layers, top_k)``: the experts every token fed
    through the model was routed to (see :mod:`~agentrl.inference.routing_records`).
    """

    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishType
    weight_version: int
    prompt_tokens: int = 0
    matched_stop: int | None = None
    endpoint: str = "local"
    meta: dict[str, Any] = field(default_factory=dict)
    routed_experts: np.ndarray | None = None


@runtime_checkable
class InferenceClient(Protocol):
    """What the rollout engine and the trainer need from an inference backend."""

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> GenerateOutput:
        """Continue ``input_ids``; ``session_id`` keeps an episode's turns on one endpoint.

        ``return_routed_experts`` asks an MoE backend for ``GenerateOutput.routed_experts``;
        the rows before ``routed_experts_start_len`` (known already) are not sent, and are -1.
        """
        ...

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request by ``rid``, or every request when ``rid`` is ``None``."""
        ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        """Load HF-format weights from ``model_path`` and serve them as ``weight_version``."""
        ...

    async def health(self) -> bool:
        """Whether the backend can generate."""
        ...

    async def aclose(self) -> None:
        """Release connections and resources (idempotent)."""
        ...
