"""Tensors by handle for SGLang's ``/update_weights_from_tensor``: a trainer on the same host.

The payload's ``serialized_named_tensors`` holds, per tensor-parallel rank, the base64 of a
``multiprocessing`` pickle of ``[(name, tensor), ...]`` (SGLang's ``MultiprocessingSerializer``).
Such a pickle carries handles, not data: a CUDA tensor travels as a CUDA IPC handle (the server
maps the trainer's memory and copies device to device), a CPU tensor as the name of a
shared-memory file. So the push costs one copy on the receiving side and no serialisation of the
weights, but only works between processes of one host that can see each other's devices.

Unpickling runs code named in the pickle, so the server's side (:func:`load_named_tensors`)
accepts only the few globals that rebuild shared tensors; anything else is refused.
"""

from __future__ import annotations

import base64
import io
import pickle
import threading
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp

_STRATEGY_LOCK = threading.Lock()
# what a multiprocessing pickle of tensors names: torch's rebuild functions, storage classes,
# dtypes, and the tensor and size types
_ALLOWED_MODULES = {"torch.multiprocessing.reductions"}
_ALLOWED_NAMES = {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "UntypedStorage"),
    ("torch", "device"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.nn.parameter", "Parameter"),
}


def dump_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One entry of ``serialized_named_tensors``: base64 of the handles of ``named``.

    The tensors must stay alive until the server has loaded them (the update call returns).
    CPU tensors are copied into shared memory first (the caller's tensors stay as they are).
    """
    items = []
    for name, tensor in named:
        t = tensor.detach()
        if t.device.type == "cpu" and not t.is_shared():
            t = t.clone()  # sharing moves a storage into shared memory in place
        items.append((str(name), t))
    buf = io.BytesIO()
    with _STRATEGY_LOCK:  # CPU storages by file name: another process can open it by name
        before = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(items)
        finally:
            torch_mp.set_sharing_strategy(before)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        dtype = getattr(torch, name, None) if module == "torch" else None
        if module in _ALLOWED_MODULES and name.startswith("rebuild_"):
            return super().find_class(module, name)
        if (module, name) in _ALLOWED_NAMES or isinstance(dtype, torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a tensor payload")


def load_named_tensors(entry: str) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one ``serialized_named_tensors`` entry.

    Raises:
        ValueError: not base64, not a list of ``(str, tensor)`` pairs, or a pickle that names
            anything but tensor-rebuilding globals.
    """
    try:
        data = base64.b64decode(entry, validate=True)
        items = _TensorUnpickler(io.BytesIO(data)).load()
    except (ValueError, pickle.UnpicklingError, EOFError) as exc:
        raise ValueError(f"unreadable tensor payload: {exc}") from exc
    except (RuntimeError, OSError) as exc:  # a handle this process cannot open
        raise ValueError(f"cannot open the tensors' handles (same host only): {exc}") from exc
    if not isinstance(items, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor) for p in items
    ):  # fmt: skip
        raise ValueError("expected a list of (name, tensor) pairs")
    return items
