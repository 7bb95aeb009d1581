"""Low-rank adapters (LoRA) on the learner's policy, and the adapter in peft's layout.

``learner.lora`` (:class:`~agentrl.learner.config.LoraConfig`) makes the learner train
adapters: :func:`inject_adapters` replaces each target ``nn.Linear`` by a :class:`LoraLinear`
that keeps the very same ``weight`` and ``bias`` parameters (frozen) and adds
``lora_A`` (``r x in``, kaiming-uniform as peft initialises it, from a seeded generator) and
``lora_B`` (``out x r``, zeros), so that the layer computes::

    W x + b + (alpha / r) * B(A(dropout(x)))

and equals the base model at initialisation. Every other parameter (embeddings, norms, head)
is frozen too: only adapters get gradients and AdamW state. The transformers forward calls
:meth:`LoraLinear.forward`; the packed body (:mod:`agentrl.kernels.packed_body`) reads the same
adapters off the modules (``lora_A``, ``lora_B``, ``scaling``, ``dropout``) and adds the
low-rank term beside its fused projections. Under FSDP2 the adapters are parameters of their
decoder block like the base weights, sharded and gathered with them.

State dict names: the base keeps its Hugging Face names (``...q_proj.weight``) and an adapter
adds ``...q_proj.lora_A.weight`` and ``...q_proj.lora_B.weight``; peft's names put
``base_model.model.`` in front (:func:`peft_name`).

For the weight push and export (every function takes whole tensors or gathers shards):

* :func:`adapter_state` ``(model) -> {peft name: tensor}``: the adapter alone, what an engine
  that serves adapters loads (SGLang's ``/load_lora_adapter`` reads it from
  :func:`save_peft_adapter`'s directory);
* :func:`merge_adapter_into` ``(weights, adapter, scaling)``: ``W + scaling * B @ A`` written
  into a base state dict (Hugging Face names), for engines that take full weights;
* :func:`merged_state` ``(model, dtype)``: the merged full weights of a LoRA model, what
  ``Learner.state_dict_for_inference`` returns with LoRA on;
* :func:`save_peft_adapter` ``(adapter, path, config, targets)``: ``adapter_config.json`` +
  ``adapter_model.safetensors``, loadable by ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from agentrl.kernels.low_rank import low_rank
from agentrl.learner.config import LoraConfig

__all__ = [
    "LoraLinear",
    "adapter_state",
    "has_adapters",
    "inject_adapters",
    "merge_adapter_into",
    "merged_state",
    "peft_adapter_config",
    "peft_name",
    "save_peft_adapter",
]

PEFT_PREFIX = "base_model.model."
_MAX_LINEARS = 100_000  # a model with more target layers than this is not a decoder we know


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank adapter beside its (frozen) weight; module docstring."""

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float,
        dtype: torch.dtype,
        generator: torch.Generator,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the weight is base's, not a new one
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.scaling, self.dropout = rank, alpha / rank, dropout
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=dtype)
        with torch.no_grad():  # peft's init: A kaiming-uniform(a=sqrt 5), B zero (a no-op)
            a = torch.empty(rank, self.in_features, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    def delta(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The low-rank term ``scaling * B(A(dropout(x)))`` in ``out_dtype``."""
        p = self.dropout if self.training else 0.0
        return low_rank(x, self.lora_A.weight, self.lora_B.weight, self.scaling, p, out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``W x + b`` plus the low-rank term."""
        out = F.linear(x, self.weight, self.bias)
        return out + self.delta(x, out.dtype)


def _targets(names: Iterable[str], patterns: Iterable[str]) -> bool:
    return any(n == p or n.endswith("." + p) for n in names for p in patterns)


def inject_adapters(model: nn.Module, config: LoraConfig, *, seed: int = 0) -> list[str]:
    """Put a :class:`LoraLinear` on every target linear layer of ``model``; freeze the rest.

    Adapters are created in module order from one generator seeded with ``seed`` (every rank
    of a sharded learner makes the same ones). Returns the wrapped modules' names.

    Raises:
        ValueError: no linear layer matches ``config.target_modules``, or the model has
            adapters already.
    """
    if has_adapters(model):
        raise ValueError("model: it has adapters already")
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None  # the LM head is not an adapter target
    found: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module is not head:
            if _targets([name], config.target_modules):
                found.append((name, module))
                if len(found) > _MAX_LINEARS:
                    raise ValueError(f"model: over {_MAX_LINEARS} target layers")
    if not found:
        raise ValueError(
            f"lora.target_modules: no linear layer of {type(model).__name__} matches "
            f"{list(config.target_modules)}"
        )
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, config.dtype)
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        lora = LoraLinear(module, config.rank, config.alpha, config.dropout, dtype, gen)
        lora.train(module.training)
        setattr(parent, child, lora)
    return [name for name, _ in found]


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` has :class:`LoraLinear` layers."""
    return any(isinstance(m, LoraLinear) for m in model.modules())


def peft_name(name: str) -> str:
    """The peft key of a state-dict name of ours (``model.layers.0...lora_A.weight``)."""
    return PEFT_PREFIX + name


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor shard (FSDP2)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of ``model`` under peft's names, whole, detached, in their own dtype.

    Gathered under FSDP (every rank calls); the tensors are copies only where gathered.
    """
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            out[peft_name(f"{name}.lora_A.weight")] = _full(module.lora_A.weight).detach()
            out[peft_name(f"{name}.lora_B.weight")] = _full(module.lora_B.weight).detach()
    return out


def merge_adapter_into(
    weights: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """Replace each adapted ``...weight`` of ``weights`` by ``W + scaling * B @ A``, in place.

    Args:
        weights: a base state dict under Hugging Face names (``model.layers.0...q_proj.weight``).
        adapter: ``lora_A``/``lora_B`` tensors under peft's names or ours.
        scaling: ``alpha / rank``.

    Returns:
        ``weights`` itself; each merged tensor is new, in its base's dtype (merged in float32).

    Raises:
        ValueError: an adapter's pair is incomplete, or its base weight is missing or of
            another shape.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in adapter.items():
        name = key.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            if name.endswith(f".{part}.weight"):
                pairs.setdefault(name[: -len(f".{part}.weight")], {})[part] = value
                break
        else:
            raise ValueError(f"adapter: unexpected key {key!r}")
    for module, pair in pairs.items():
        target = f"{module}.weight"
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"adapter: {module} lacks lora_A or lora_B")
        if target not in weights:
            raise ValueError(f"adapter: the base has no {target}")
        base, a, b = weights[target], pair["lora_A"], pair["lora_B"]
        if (b.shape[0], a.shape[1]) != tuple(base.shape) or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"adapter: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}, base "
                f"{tuple(base.shape)}"
            )
        delta = scaling * (b.float().to(base.device) @ a.float().to(base.device))
        weights[target] = (base.float() + delta).to(base.dtype)
    return weights


def merged_state(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full weights of a LoRA ``model``, adapters merged, under Hugging Face names.

    Cast to ``dtype``; gathered under FSDP (every rank calls).
    """
    base: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if ".lora_A." not in name and ".lora_B." not in name:
            base[name] = _full(value).detach()
    scalings = {m.scaling for m in model.modules() if isinstance(m, LoraLinear)}
    if len(scalings) != 1:
        raise ValueError(f"model: expected adapters of one scaling, got {sorted(scalings)}")
    merge_adapter_into(base, adapter_state(model), scalings.pop())
    return {k: v.to(dtype) for k, v in base.items()}


def peft_adapter_config(
    config: LoraConfig, targets: Iterable[str], base_model: str = ""
) -> dict[str, object]:
    """The peft ``adapter_config.json`` of these adapters (``targets``: module names)."""
    short = sorted({t.rsplit(".", 1)[-1] for t in targets})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": short,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft_adapter(
    adapter: dict[str, torch.Tensor],
    path: str | Path,
    config: LoraConfig,
    *,
    base_model: str = "",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``adapter`` (:func:`adapter_state`) as a peft adapter directory.

    ``adapter_config.json`` and ``adapter_model.safetensors`` (tensors cast to ``dtype`` if
    given): what ``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    names = {k.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for k in adapter}
    tensors = {
        (k if k.startswith(PEFT_PREFIX) else peft_name(k)): (
            v if dtype is None else v.to(dtype)
        ).contiguous()
        for k, v in adapter.items()
    }
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = peft_adapter_config(config, names, base_model)
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
