"""The ``[inference]`` section of a run's config: where rollouts are generated.

The SGLang endpoints and their keys, how weights reach them (``weight_sync``), the embedded
engine's batch and KV budget, and the dedicated engines ``agentrl train`` starts itself
(``engine_gpus``). :mod:`agentrl.config` holds the other sections and reads the whole config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentrl.errors import ConfigError


class InferenceConfig(BaseModel):
    """Where rollouts are generated."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    endpoints: list[str] = Field(default_factory=list)
    """SGLang base URLs (``http://host:30000``): a list, one URL, a comma list or a JSON list;
    empty means the embedded engine in this process."""
    max_batch_size: int = Field(64, ge=1)
    """Requests decoded together by the embedded engine."""
    decode_steps: int = Field(64, ge=1)
    """Embedded engine on a card: most decode steps it runs back to back without the host. A run
    ends early after the step where a row stops, a queued request could take a free row, or a
    weight push pauses the engine (the host reads the steps 8 at a time, a chunk behind the
    card), so long runs cost little latency; each run's end costs the card ~3 ms of idle time."""
    timeout_s: float = Field(300.0, gt=0)
    """Per-request HTTP timeout."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """Embedded engine: GiB its KV cache may take on the card it shares with the learner."""
    kv_cache_frac: float | None = Field(None, gt=0, le=1)
    """Embedded engine: the KV-cache budget as a fraction of the card's free memory once the
    learner is built (``kv_cache_gib`` wins when both are set; neither: no budget)."""
    retry_s: float = Field(60.0, ge=0)
    """How long a request keeps retrying (with backoff) while no endpoint can take it, e.g. while
    the only server restarts, before its episode fails (CLI ``--retry-s``)."""
    stall_s: float | None = Field(30.0, gt=0)
    """A request in flight this long triggers a health probe of its endpoint; if the endpoint
    does not answer, the request is aborted there first, then resubmitted to a healthy endpoint.
    ``None`` disables the check."""
    weight_sync: Literal["disk", "distributed", "tensor"] = "disk"
    """How new weights reach remote servers: ``disk`` (a safetensors checkpoint that
    ``/update_weights_from_disk`` loads: the servers must see the run directory),
    ``distributed`` (broadcast over a process group with SGLang's ``/init_weights_update_group``
    and ``/update_weights_from_distributed``: NCCL from a learner on a GPU, gloo from a CPU) or
    ``tensor`` (SGLang's ``/update_weights_from_tensor``: handles to the learner's tensors, CUDA
    IPC on a card, shared memory on the CPU; servers on this host only, seeing its devices under
    the same numbering)."""
    weight_sync_address: str = "127.0.0.1"
    """``distributed``: this host's address as the servers reach it (the group's store)."""
    weight_sync_port: int = Field(0, ge=0, le=65535)
    """``distributed``: the group's port on that address (0: a free one)."""
    weight_sync_bucket_mb: float = Field(512.0, gt=0)
    """``distributed``: the largest bucket of tensors sent per HTTP call."""
    api_key: str | None = None
    """The key sent as ``Authorization: Bearer`` on every call to ``endpoints`` (SGLang's and
    ``agentrl serve``'s ``--api-key``), given as ``env:NAME`` (an environment variable) or
    ``file:PATH`` (a file's text), never the key itself: configs are saved in the run
    directory. ``agentrl serve --config`` serves with it when ``--api-key`` is not given."""
    admin_api_key: str | None = None
    """The key of the control calls (pause, continue, abort, weight updates, flush:
    ``--admin-api-key``), as ``env:NAME`` or ``file:PATH``; unset: ``api_key``."""
    engine_gpus: int | None = Field(None, ge=1)
    """Dedicated inference: ``agentrl train`` starts K ``agentrl serve`` processes on the cards
    after the learner's (N cards: ``torchrun --nproc-per-node N-K``; CPU: K on the CPU), used as
    ``endpoints`` with ``weight_sync = "distributed"`` (:mod:`agentrl.loop.engine_procs`)."""

    @field_validator("endpoints", mode="before")
    @classmethod
    def _endpoint_urls(cls, value: Any) -> list[str]:
        from agentrl.inference.client.endpoints import parse_endpoints

        return parse_endpoints(value)

    @model_validator(mode="after")
    def _engines_or_endpoints(self) -> InferenceConfig:
        if self.engine_gpus is None:
            return self
        if self.endpoints:
            raise ValueError("engine_gpus starts servers of its own: set it or endpoints")
        if "weight_sync" not in self.model_fields_set:  # the saved config.yaml says so too
            self.weight_sync = "distributed"
        elif self.weight_sync != "distributed":
            raise ValueError(f'engine_gpus needs weight_sync "distributed": {self.weight_sync!r}')
        return self

    @field_validator("api_key", "admin_api_key")
    @classmethod
    def _key_is_a_reference(cls, spec: str | None) -> str | None:
        if spec is not None and not spec.startswith(("env:", "file:")):
            raise ValueError("expected env:NAME or file:PATH (a key itself would be saved)")
        return spec

    def keys(self) -> tuple[str | None, str | None]:
        """``(api_key, admin_api_key)`` read from their variables or files.

        Raises:
            ConfigError: a variable unset or a file unreadable (named; the key never is).
        """
        from agentrl.inference.api_keys import read_key

        try:
            return (
                read_key(self.api_key, "inference.api_key"),
                read_key(self.admin_api_key, "inference.admin_api_key"),
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def client_options(self) -> dict[str, Any]:
        """The :class:`~agentrl.inference.client.SGLangClient` keyword arguments set here."""
        api_key, admin_api_key = self.keys()
        return {"timeout_s": self.timeout_s, "retry_s": self.retry_s, "stall_s": self.stall_s,
                "api_key": api_key, "admin_api_key": admin_api_key}  # fmt: skip
