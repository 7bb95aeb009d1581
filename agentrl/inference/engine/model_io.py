"""Models and weights for the embedded engine: loading a model, reading and loading weights.

- :func:`load_model`: an HF model directory, or a no-download ``agentrl.tiny`` preset.
- :func:`read_safetensors_dir` and :func:`load_state_dict_strict`: HF safetensors weights into a
  live model, all or nothing (names and shapes are checked before anything is copied).
- :class:`WeightLoader`: the same, with a repeated push (same names, shapes, dtypes and devices)
  done as one multi-tensor copy without checking again.
- :func:`eos_token_ids`: every id that ends a generation (model, generation config, tokenizer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from agentrl.kernels.transfer import device_context


def load_model(path_or_preset: str, device: str, dtype: torch.dtype | None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from an HF model directory or an ``agentrl.tiny`` preset.

    A model directory loads in bfloat16 on CUDA and float32 elsewhere unless ``dtype`` says
    otherwise; a preset is built in float32 (the engine casts it to ``dtype`` if given).
    """
    from agentrl.tiny import PRESETS, build_preset

    if path_or_preset in PRESETS:
        return build_preset(path_or_preset)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.errors import ConfigError
    from agentrl.model_dirs import not_a_model_reason

    if (why := not_a_model_reason(path_or_preset)) is not None:  # a run's checkpoint
        raise ConfigError(why)
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path_or_preset, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(path_or_preset)


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` file of an HF-format model directory into one state dict.

    Raises:
        FileNotFoundError: ``path`` is not a directory or holds no safetensors file.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model_path: expected a local HF model directory, got {path!r}")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path: no *.safetensors file in {str(folder)!r}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def load_state_dict_strict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model`` after checking names and shapes (all or nothing).

    A sharded value (a ``DTensor``, from an FSDP learner) is gathered as it is copied, one at a
    time: every rank of its mesh must load the same names in the same order.
    """
    own = model.state_dict()
    unknown = sorted(set(state_dict) - set(own))
    if unknown:
        raise ValueError(f"weights: unexpected parameter names {unknown[:5]}")
    given_ptrs = {own[k].data_ptr() for k in state_dict}
    missing = [k for k in own if k not in state_dict and own[k].data_ptr() not in given_ptrs]
    if missing:  # a tied weight (lm_head = embed_tokens) is covered by its twin
        raise ValueError(f"weights: missing parameters {missing[:5]}")
    for name, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            want, got = tuple(own[name].shape), tuple(tensor.shape)
            raise ValueError(f"weights: {name} expected shape {want}, got {got}")
    device = next(iter(own.values())).device if own else torch.device("cpu")
    dst: list[torch.Tensor] = []  # same device and dtype: one multi-tensor copy, not a launch
    src: list[torch.Tensor] = []  # per tensor (the in-process push is host-bound)
    with torch.no_grad(), device_context(device):  # gathers run on this model's card
        for name, tensor in state_dict.items():
            if hasattr(tensor, "full_tensor"):
                own[name].copy_(tensor.full_tensor())
            elif (tensor.device, tensor.dtype) == (own[name].device, own[name].dtype):
                dst.append(own[name])
                src.append(tensor)
            else:
                own[name].copy_(tensor)
        if dst:
            torch._foreach_copy_(dst, src)


class WeightLoader:
    """Loads pushed state dicts into ``model``; a repeat of the last layout is one copy.

    The in-process push hands over the learner's weights at every step under the same names,
    shapes, dtypes and devices. The first push of a layout is checked and loaded by
    :func:`load_state_dict_strict`; a later one with that layout (:meth:`repeats`) is a single
    ``torch._foreach_copy_`` into the targets found then (casting where the dtypes differ).
    That matters because the push is host-bound: each torch call of a per-tensor load gives up
    the GIL, which the event loop's and the learner's threads then hold (a push of the 0.6B
    shape took 23-98 ms on an H100, with the card idle).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._key: tuple[tuple[Any, ...], ...] | None = None
        self._targets: list[torch.Tensor] = []

    @staticmethod
    def _layout(state_dict: dict[str, torch.Tensor]) -> tuple[tuple[Any, ...], ...]:
        return tuple((k, type(v), v.shape, v.dtype, v.device) for k, v in state_dict.items())

    def repeats(self, state_dict: dict[str, torch.Tensor]) -> bool:
        """Whether ``state_dict`` has the layout of the last load that can be one copy."""
        return self._key is not None and self._layout(state_dict) == self._key

    def load(self, state_dict: dict[str, torch.Tensor], repeat: bool | None = None) -> None:
        """Copy ``state_dict`` into the model (see :func:`load_state_dict_strict`).

        ``repeat``: what :meth:`repeats` just said of it (``None``: find out here).

        Raises:
            ValueError: names or shapes do not match the model (nothing is changed then).
        """
        if repeat is None:
            repeat = self.repeats(state_dict)
        if repeat:
            with torch.no_grad():
                torch._foreach_copy_(self._targets, list(state_dict.values()))
            return
        self._key = None
        load_state_dict_strict(self.model, state_dict)
        if not any(hasattr(v, "full_tensor") for v in state_dict.values()):  # no gather
            own = self.model.state_dict()
            self._key, self._targets = self._layout(state_dict), [own[k] for k in state_dict]


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a generation (the model's, its generation config's, the tokenizer's)."""
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for value in (
        getattr(gen_cfg, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
