"""Where the parts of a run live: the policy, learner, cold start and embedded engine's card.

:func:`agentrl.loop.assemble.assemble` makes a run's parts in order, with the makers here
(:func:`load_policy`, :func:`make_local_engine`, :func:`make_remote_client`,
:func:`make_weight_push`); the CLI's ``eval`` and ``serve`` call them too.

``model.device`` decides for everything that holds weights. ``auto`` is the GPU when there is
one (under ``torchrun`` the rank's ``LOCAL_RANK`` card), else the CPU, so a CPU host runs as it
always did. With no endpoint the embedded engine shares the learner's card: weight pushes copy
device to device in process, and ``inference.kv_cache_gib`` / ``kv_cache_frac`` bound the memory
its KV cache may take so that both fit. In the overlapped loop the update runs in a worker thread
on its own CUDA stream, so its kernels and the engine's (on the default stream) overlap.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from agentrl.config import TrainConfig
from agentrl.errors import ConfigError, ServerError
from agentrl.kernels.transfer import device_context

log = logging.getLogger(__name__)

T = TypeVar("T")

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
"""Values ``model.device`` accepts."""


def resolve_device(
    setting: str = "auto",
    *,
    cuda_available: bool | None = None,
    environ: Mapping[str, str] | None = None,
) -> torch.device:
    """The device a ``model.device`` setting names on this host.

    Args:
        setting: ``auto`` (the GPU when there is one, else the CPU), ``cpu``, ``cuda`` (this
            rank's card) or ``cuda:N``.
        cuda_available: whether CUDA can be used (default: ``torch.cuda.is_available()``).
        environ: the environment to read ``LOCAL_RANK`` from (default: ``os.environ``).

    Returns:
        ``cpu`` or ``cuda:N``; under ``torchrun`` ``auto`` and ``cuda`` give ``cuda:LOCAL_RANK``.

    Raises:
        ConfigError: an unknown setting, or a CUDA device on a host without CUDA.
    """
    if not DEVICE_PATTERN.match(setting):
        raise ConfigError(f"model.device: expected auto, cpu, cuda or cuda:N, got {setting!r}")
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    env = os.environ if environ is None else environ
    if setting == "cpu" or (setting == "auto" and not available):
        return torch.device("cpu")
    if not available:
        raise ConfigError(f"model.device: {setting!r} needs CUDA, and this host has none")
    if setting.startswith("cuda:"):
        return torch.device(setting)
    return torch.device("cuda", int(env.get("LOCAL_RANK", "0")))


DEFAULT_KV_SHARE = 0.5  # of the free memory, as the paged engine's own default


def kv_bytes_per_token(model_config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes in every layer (keys and values)."""
    cfg = model_config.get_text_config()
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * int(cfg.num_hidden_layers) * heads * head_dim * element


def kv_budget_bytes(
    kv_cache_gib: float | None,
    kv_cache_frac: float | None,
    device: torch.device,
    *,
    free_bytes: int | None = None,
) -> int | None:
    """The engine's KV-cache budget in bytes (``None``: no budget was set).

    ``kv_cache_frac`` is a fraction of the card's free memory now, after the learner is built
    (``free_bytes`` overrides the measurement). On the CPU only ``kv_cache_gib`` applies.
    """
    if kv_cache_gib is not None:
        return int(kv_cache_gib * 2**30)
    if kv_cache_frac is None:
        return None
    if free_bytes is None:
        if device.type != "cuda":
            return None
        free_bytes = int(torch.cuda.mem_get_info(device)[0])
    return int(kv_cache_frac * free_bytes)


def engine_batch_size(
    max_batch_size: int, max_total_tokens: int, per_token: int, budget: int | None
) -> int:
    """The most rows whose full-length KV cache fits ``budget`` (at most ``max_batch_size``).

    Raises:
        ConfigError: the budget does not hold even one row of ``max_total_tokens``.
    """
    if budget is None:
        return max_batch_size
    rows = budget // (per_token * max_total_tokens)
    if rows < 1:
        need = per_token * max_total_tokens / 2**30
        raise ConfigError(
            f"inference.kv_cache_gib: one row of {max_total_tokens} tokens needs {need:.3f} GiB "
            f"of KV cache; the budget is {budget / 2**30:.3f} GiB"
        )
    return min(max_batch_size, int(rows))


def load_policy(config: TrainConfig) -> tuple[Any, Any]:
    """The policy model and tokenizer named by ``config.model``, on ``model.device``."""
    model: Any
    tok: Any
    from agentrl.tiny import PRESETS, build_preset

    if config.model.path in PRESETS:
        model, tok = build_preset(config.model.path, seed=config.seed, **config.model.tiny)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(config.model.path)
            model = AutoModelForCausalLM.from_pretrained(config.model.path)
        except OSError as e:  # a missing directory or an unknown hub id: one line, no traceback
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"model.path: cannot load {config.model.path!r}: {first}") from None
    dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
    return model.to(device=resolve_device(config.model.device), dtype=dtype), tok


def make_remote_client(model: Any, config: TrainConfig) -> Any:
    """The SGLang client of ``inference.endpoints``; for an MoE policy it knows the routing shape.

    SGLang returns ``routed_experts`` as a flat array, so the client needs ``(layers, top_k)``,
    which only the policy (the same architecture the servers run) can tell.
    """
    from agentrl.inference.client.sglang_client import SGLangClient
    from agentrl.routing import is_moe, routing_shape

    options = config.inference.client_options()
    if is_moe(model):
        options["routed_experts_shape"] = routing_shape(model)[:2]
    return SGLangClient(config.inference.endpoints, **options)


def learner_state_bytes(model: Any) -> int:
    """Bytes a learner's first step adds for ``model``'s trainable parameters.

    The gradients and AdamW's two moments, in the parameters' dtype. Both are allocated lazily,
    after the engine has sized its cache; a cache sized on the free memory alone took them (a
    Qwen3-4B shape ran out of memory at its first update on an H200).
    """
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def make_local_engine(
    model: Any,
    tokenizer: Any,
    config: TrainConfig,
    *,
    copy_model: bool = True,
    reserve_bytes: int = 0,
) -> Any:
    """The embedded engine on the policy's card, with its own copy of the weights.

    On a card the KV budget sizes the paged engine's cache; on the CPU path (whose cache grows
    per row) it caps the rows decoded together, so that their full-length caches fit it.
    ``copy_model=False`` hands the engine ``model`` itself (a copy the caller made earlier).
    ``reserve_bytes``: memory the card must keep for a colocated learner beyond what it holds
    now (:func:`learner_state_bytes`); with no ``kv_cache_gib``/``kv_cache_frac`` the cache then
    takes half of the free memory less it.
    """
    from agentrl.inference.engine import LocalEngine

    inf = config.inference
    params = inspect.signature(LocalEngine.__init__).parameters
    kwargs: dict[str, Any] = {"max_batch_size": inf.max_batch_size}
    kwargs["decode_steps"] = inf.decode_steps  # used on the paged path (a card) only
    device = next(model.parameters()).device
    dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
    if device.type == "cuda" and "kv_cache_gib" in params:  # the paged engine sizes its cache
        frac = None if inf.kv_cache_gib is not None else inf.kv_cache_frac  # GiB wins
        kwargs.update(kv_cache_gib=inf.kv_cache_gib, kv_cache_frac=frac)
        if inf.kv_cache_gib is None and frac is None and reserve_bytes:
            free = int(torch.cuda.mem_get_info(device)[0])
            gib = DEFAULT_KV_SHARE * max(free - reserve_bytes, 0) / 2**30
            log.info("engine: KV cache %.1f GiB (half of %.1f GiB free less %.1f GiB kept for "
                     "the learner's gradients and optimizer state)", gib, free / 2**30,
                     reserve_bytes / 2**30)  # fmt: skip
            kwargs["kv_cache_gib"] = max(gib, 1 / 1024)  # too small: the engine says so
    else:
        budget = kv_budget_bytes(inf.kv_cache_gib, inf.kv_cache_frac, device)
        per_token = kv_bytes_per_token(model.config, dtype)
        rows = engine_batch_size(
            inf.max_batch_size, config.rollout.max_total_tokens, per_token, budget
        )
        if rows < inf.max_batch_size:
            log.info("engine: %d rows fit the KV budget (max_batch_size %d)", rows, rows)
        kwargs["max_batch_size"] = rows
    # a copy made on the card (no host round trip), in the policy's dtype (the learner keeps
    # float32 master weights)
    if config.learner.batch_invariant:  # the engine computes what the exact learner does
        kwargs.update(batch_invariant=True, compute_dtype=torch.bfloat16)
    own = copy.deepcopy(model) if copy_model else model
    return LocalEngine(own, tokenizer, device=device, dtype=dtype, **kwargs)


def make_weight_push(config: TrainConfig, device: torch.device) -> Any:
    """The weight push to ``inference.endpoints``, or ``None`` (the disk path).

    ``distributed``: NCCL when the learner is on a card, gloo otherwise; the group forms at the
    first push. ``tensor``: by handle, to servers on this host.
    """
    inf = config.inference
    if not inf.endpoints or inf.weight_sync == "disk":
        return None
    api_key, admin_key = inf.keys()
    if inf.weight_sync == "tensor":
        from agentrl.inference.client.weight_push import TensorWeightPush

        return TensorWeightPush(
            inf.endpoints, timeout_s=inf.timeout_s, api_key=api_key, admin_key=admin_key
        )
    from agentrl.inference.client.weight_push import DistributedWeightPush

    port = inf.weight_sync_port
    if port == 0:
        with socket.socket() as s:  # a free port now; the store binds it at the first push
            s.bind((inf.weight_sync_address, 0))
            port = int(s.getsockname()[1])
    return DistributedWeightPush(
        inf.endpoints,
        master_address=inf.weight_sync_address,
        master_port=port,
        backend="nccl" if device.type == "cuda" else "gloo",
        device=device,
        bucket_mb=inf.weight_sync_bucket_mb,
        timeout_s=inf.timeout_s,
        admin_key=admin_key or api_key,
    )


async def push_weights(
    learner: Any,
    client: Any,
    version: int,
    remote_dir: Path | None,
    tokenizer: Any,
    distributed: Any = None,
) -> dict[str, float]:
    """Push the learner's weights to the engine as ``version``; returns the push's timings.

    In process (``remote_dir`` is ``None``) the state dict stays on the learner's card and the
    engine copies it device to device. Remote, with ``distributed`` (a
    :class:`~agentrl.inference.client.weight_push.DistributedWeightPush`) the weights are broadcast
    to the servers; else the learner writes a safetensors checkpoint in the export dtype (bf16 for
    a bf16 policy) that ``/update_weights_from_disk`` loads.

    Returns:
        ``time/sync_s`` (the whole push) and, remote from disk, ``time/weight_write_s``.
    """
    t = time.perf_counter()
    out: dict[str, float] = {}
    if distributed is not None:
        await distributed.push(learner.state_dict_for_inference(), version)
    elif remote_dir is not None:
        learner.save_pretrained(remote_dir, tokenizer=tokenizer)
        out["time/weight_write_s"] = time.perf_counter() - t
        await client.update_weights_from_disk(str(remote_dir.resolve()), version)
    else:
        # the learner's own (float32) tensors: the engine casts them as it copies them in
        await client.update_weights_from_state_dict(learner.live_weights(), version)
        if learner.device.type == "cuda":
            torch.cuda.synchronize(learner.device)  # the copy is done when the time is taken
    out["time/sync_s"] = time.perf_counter() - t
    return out


async def push_adapter(
    learner: Any,
    client: Any,
    version: int,
    run_dir: Path,
    *,
    remote: bool,
    is_main: bool = True,
    barrier: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Push the learner's LoRA adapters as ``version``, named ``{run}-v{version}``.

    Only the adapters move; the engines keep serving their base. In process the engine
    merges the adapter tensors into its copy of the base (``load_lora_adapter_tensors``).
    Remote, the adapter is written in peft's layout to ``run_dir/adapters/v{version}`` (every
    rank calls; rank 0 writes), loaded by name on every endpoint (SGLang's
    ``/load_lora_adapter``) and used by later requests; the directories older than the
    previous version's are removed (the previous one may still serve requests).

    Returns:
        ``time/sync_s`` (the whole push) and, remote, ``time/weight_write_s``.
    """
    t = time.perf_counter()
    out: dict[str, float] = {}
    name = f"{run_dir.name}-v{version}"
    scaling = learner.lora.alpha / learner.lora.rank
    if not remote and not hasattr(client, "load_lora_adapter_tensors"):
        # a client of its own that takes full weights only: the merged ones
        await client.update_weights_from_state_dict(learner.live_weights(), version)
    elif not remote:
        adapter = learner.adapter_state()  # every rank gathers its shards
        loaded = list(client.loaded_lora_adapters)  # the engine keeps each until unloaded
        name = _fresh(name, set(loaded))
        await client.load_lora_adapter_tensors(name, adapter, scaling, weight_version=version)
        for old in loaded:  # inactive now: gone at once, nothing to drain
            await client.unload_lora_adapter(old)
        if learner.device.type == "cuda":
            torch.cuda.synchronize(learner.device)
    else:
        root = run_dir / "adapters"
        path = learner.save_adapter(root / f"v{version}")
        out["time/weight_write_s"] = time.perf_counter() - t
        if is_main:
            name = _fresh(name, client.lora_names)
            try:
                await client.load_lora_adapter(name, str(path.resolve()))
            except ServerError as exc:  # left by this run before a resume: replace it
                if "already loaded" not in exc.message:
                    raise
                with contextlib.suppress(ServerError):  # (endpoints without it refuse)
                    await client.unload_lora_adapter(name)
                await client.load_lora_adapter(name, str(path.resolve()))
            await client.use_lora_adapter(name, version)
            _drop_old_adapters(root, version)
        if barrier is not None:
            barrier()  # no rank rolls out before the endpoints serve the new version
    out["time/sync_s"] = time.perf_counter() - t
    return out


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name-2``, ``name-3``... (a version pushed again: the cold start's checks)."""
    k = 1
    while (candidate := name if k == 1 else f"{name}-{k}") in taken:
        k += 1
    return candidate


def _drop_old_adapters(root: Path, version: int) -> None:
    """Remove ``root/v{k}`` for every ``k`` older than the newest one before ``version``."""
    found = sorted(int(d.name[1:]) for d in root.glob("v*") if d.name[1:].isdigit() and d.is_dir())
    older = [k for k in found if k < version]
    for k in older[:-1]:
        shutil.rmtree(root / f"v{k}", ignore_errors=True)


@contextmanager
def gil_switch_interval(ms: float | None) -> Iterator[None]:
    """Python's thread switch interval set to ``ms`` for a block (``None``: left as it is).

    The learner, the embedded engine and the event loop are threads of one process; every torch
    call releases the GIL, and getting it back from a thread running pure Python can take a
    whole interval (5 ms by default).
    """
    before = sys.getswitchinterval()
    if ms is not None:
        sys.setswitchinterval(ms / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


_streams: dict[torch.device, torch.cuda.Stream] = {}


def on_side_stream(device: torch.device, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` (in a worker thread) on a CUDA stream of its own on ``device``.

    The engine decodes on the default stream meanwhile; a non-default stream lets the two
    threads' kernels run at the same time instead of one after the other. Waits for the
    stream before returning, so the caller may read the results on any stream. Off CUDA it
    just calls ``fn``.
    """
    if device.type != "cuda":
        return fn(*args)
    stream = _streams.get(device)
    if stream is None:  # one per card: updates never run two at a time
        stream = _streams[device] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.default_stream(device))  # inputs queued before the call
    with device_context(device), torch.cuda.stream(stream):  # a worker thread starts on card 0
        out = fn(*args)
    stream.synchronize()
    return out
