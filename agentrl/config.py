"""One typed config for a training run, from TOML or YAML plus dotted CLI overrides.

Every section is a pydantic model that forbids unknown keys, so a typo is an error naming the
field rather than a silently ignored setting. ``load_config("run.toml", ["learner.lr=1e-5"])``
reads the file, applies the overrides (values parsed as YAML scalars) and validates once.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentrl.errors import ConfigError
from agentrl.rollout.engine import RolloutConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ModelConfig(_Section):
    """The policy model."""

    path: str = "tiny"
    """``tiny`` (a Qwen3 model built from config, no download) or an HF directory / hub id."""
    tiny: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the tiny model's config (``num_hidden_layers``, ``hidden_size``, ...)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights' dtype; keep float32 on CPU (GSPO's clip range is below bf16 precision)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Variables for the chat template, e.g. ``{enable_thinking: false}`` for Qwen3."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the policy, learner, reference model, cold start and embedded engine run: ``auto``
    (the GPU when there is one; under ``torchrun`` the rank's ``LOCAL_RANK`` card), ``cpu``,
    ``cuda`` or ``cuda:N``."""


class InferenceConfig(_Section):
    """Where rollouts are generated."""

    endpoints: list[str] = Field(default_factory=list)
    """SGLang base URLs; empty means the embedded engine in this process."""
    max_batch_size: int = Field(64, ge=1)
    """Requests decoded together by the embedded engine."""
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

    def client_options(self) -> dict[str, Any]:
        """The :class:`~agentrl.inference.client.SGLangClient` keyword arguments set here."""
        return {"timeout_s": self.timeout_s, "retry_s": self.retry_s, "stall_s": self.stall_s}


class EnvConfig(_Section):
    """The environment and its tasks."""

    id: str = "arith-v0"
    """A registered env id."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments of the env."""
    train_tasks: str | None = None
    """A JSONL/Parquet file of training tasks; ``None`` uses the env's own generator."""
    eval_tasks: str | None = None
    """A file of held-out tasks; ``None`` uses the generator's test split."""
    prompt_field: str = "question"
    """Field of a task file that holds the question."""
    answer_field: str | None = "answer"
    """Field of a task file that holds the reference answer (``None``: tasks have none)."""
    task_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the env's ``sample_tasks`` generator."""
    num_train_tasks: int = Field(4096, ge=1)
    """Tasks drawn from the generator for training."""
    num_eval_tasks: int = Field(128, ge=1)
    """Held-out tasks used by evaluation."""


class AdvantageConfig(_Section):
    """How rewards become per-token advantages."""

    eps: float = 1e-6
    """Added to the group's reward std."""
    shapers: list[dict[str, Any]] = Field(default_factory=list)
    """Per-token shaping steps, e.g. ``[{"name": "overlong", "max_tokens": 512}]``."""
    shuffle_rewards: bool = False
    """Control experiment: shuffle rewards within each batch (learning should then stall)."""


class ColdStartConfig(_Section):
    """Supervised fine-tuning on scripted demonstrations before RL (as GSPO starts from one)."""

    steps: int = Field(0, ge=0)
    """SFT steps; 0 skips the cold start."""
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    target_success: float | None = None
    """Stop early once greedy held-out success reaches this (checked every ``check_every``)."""
    check_every: int = Field(50, ge=1)


class TrainLoopConfig(_Section):
    """The RL loop."""

    steps: int = Field(100, ge=0)
    tasks_per_step: int = Field(32, ge=1)
    """Tasks per rollout batch; each gets ``rollout.group_size`` episodes."""
    eval_every: int = Field(10, ge=0)
    """Evaluate every N steps (0: only at start and end)."""
    eval_samples: int = Field(1, ge=1)
    """Samples per held-out task; success is averaged over them (pass@1)."""
    eval_temperature: float = Field(0.0, ge=0)
    """0 evaluates greedily."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a resumable checkpoint every N steps (0: only at the end)."""
    max_wall_s: float | None = None
    """Stop after this much wall time (then evaluate and summarise)."""
    max_staleness: int = Field(1, ge=0)
    """Overlap rollouts with training (:mod:`agentrl.loop.pipeline`): a token sampled by weight
    version u may train the learner at version v only if ``v - u <= max_staleness``; a step
    waits for a group that would otherwise outlive that bound, so none is dropped. 0 is the
    synchronous loop: reproducible bit for bit from the seed (the overlapped loop's version
    interleaving depends on timing) and resumable exactly from a checkpoint."""
    tokens_per_step: int | None = Field(None, ge=1)
    """Overlapped loop: a step starts once complete groups hold this many response tokens
    (``None``: once ``tasks_per_step`` groups are complete)."""
    max_inflight_groups: int | None = Field(None, ge=1)
    """Overlapped loop: groups generated at once (``None``: ``tasks_per_step``)."""

    @model_validator(mode="after")
    def _overlap_settings(self) -> TrainLoopConfig:
        if self.max_staleness == 0:
            for name in ("tokens_per_step", "max_inflight_groups"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}: only the overlapped loop uses it; expected max_staleness >= 1, "
                        "got 0"
                    )
        return self


class TrainConfig(_Section):
    """Everything a training run needs."""

    name: str = "run"
    """Run name; the run directory is ``<out_dir>/<name>-<timestamp>``."""
    out_dir: str = "runs"
    run_dir: str | None = None
    """Write exactly here instead (resume uses it)."""
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)
    learner: dict[str, Any] = Field(default_factory=dict)
    """Fields of :class:`agentrl.learner.LearnerConfig` (validated by it)."""
    cold_start: ColdStartConfig = Field(default_factory=ColdStartConfig)
    train: TrainLoopConfig = Field(default_factory=TrainLoopConfig)
    tensorboard: bool = False
    """Also write TensorBoard scalars (needs the ``tensorboard`` package)."""


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    """``["a.b=1", "--c=x"]`` -> ``[("a.b", 1), ("c", "x")]`` (values parsed as YAML scalars)."""
    out = []
    for item in items:
        key, sep, raw = item.removeprefix("--").partition("=")
        if not sep or not key:
            raise ConfigError(f"override: expected key=value, got {item!r}")
        out.append((key, yaml.safe_load(raw) if raw else ""))
    return out


def read_file(path: str | Path) -> dict[str, Any]:
    """A TOML or YAML file as a dict."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config: no such file {p}")
    text = p.read_text(encoding="utf-8")
    data = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ConfigError(f"config: {p} must hold a mapping at top level")
    return data


def load_config(
    source: str | Path | dict[str, Any] | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    """Read, override and validate a :class:`TrainConfig`; errors name the offending field."""
    tree: dict[str, Any] = (
        {} if source is None else (dict(source) if isinstance(source, dict) else read_file(source))
    )
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"{field}: {first['msg']} (got {first.get('input')!r})") from None


def dump_config(config: TrainConfig, path: str | Path) -> None:
    """Write the resolved config as YAML."""
    Path(path).write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
