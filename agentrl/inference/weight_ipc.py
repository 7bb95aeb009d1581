"""Tensors by handle for SGLang's ``/update_weights_from_tensor``: a trainer on the same host.

The payload's ``serialized_named_tensors`` holds, per tensor-parallel rank, the base64 of a
``multiprocessing`` pickle of ``[(name, tensor), ...]`` (SGLang's ``MultiprocessingSerializer``).
Such a pickle carries handles, not data: a CUDA tensor travels as a CUDA IPC handle (the server
maps the trainer's memory and copies device to device), a CPU tensor as the name of a
shared-memory file. So the push costs one copy on the receiving side and no serialisation of the
weights, but only works between processes of one host that can see each other's devices.

Unpickling runs code named in the pickle, so the server's side (:func:`load_named_tensors`)
accepts only the rebuild functions of shared tensors, each wrapped to check its arguments against
:class:`PayloadLimits` before it maps or allocates anything; classes come back as inert tokens the
pickle cannot call (``torch.Tensor(2**28)`` from a 2 KB payload once allocated 1 GB).
"""

from __future__ import annotations

import base64
import io
import math
import pickle
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions

_STRATEGY_LOCK = threading.Lock()
_MAX_DIMS = 8


@dataclass(frozen=True)
class PayloadLimits:
    """Bounds a tensor payload is checked against before anything is mapped or allocated.

    Attributes:
        max_numel: elements of one tensor (the model's largest parameter).
        max_bytes: bytes of one storage and of all storages together (the whole model as
            float64: a flattened bucket is one storage).
    """

    max_numel: int
    max_bytes: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> PayloadLimits:
        """The limits of pushes to ``model``."""
        sizes = [t.numel() for t in model.state_dict().values()]
        return cls(max(sizes, default=0), sum(sizes) * 8)


@dataclass(frozen=True)
class _Class:
    """An allowed class as a pickle names it: an argument of a rebuild function, not callable."""

    cls: type


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


def _int(value: Any, low: int, high: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise pickle.UnpicklingError(f"{what}: expected an int in [{low}, {high}], got {value!r}")
    return value


def _dims(value: Any, what: str, high: int) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > _MAX_DIMS:
        raise pickle.UnpicklingError(f"{what}: expected at most {_MAX_DIMS} dims, got {value!r}")
    return tuple(_int(v, 0, high, what) for v in value)


def _unwrap(token: Any, allowed: tuple[type, ...]) -> type:
    if not isinstance(token, _Class) or not issubclass(token.cls, allowed):
        raise pickle.UnpicklingError(f"expected one of {allowed}, got {token!r}")
    return token.cls


_TENSOR_CLASSES = (torch.Tensor,)
_STORAGE_CLASSES = (torch.UntypedStorage, torch.TypedStorage)
_CLASSES = {
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
}


class _TensorUnpickler(pickle.Unpickler):
    """Rebuilds shared tensors only, each checked against ``limits`` first."""

    def __init__(self, data: bytes, limits: PayloadLimits) -> None:
        super().__init__(io.BytesIO(data))
        self.limits = limits
        self.mapped = 0  # storage bytes mapped so far

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions":
            checked = getattr(self, f"_{name}", None)
            if name.startswith("rebuild_") and checked is not None:
                return checked
        if (module, name) in _CLASSES:
            return _Class(_CLASSES[module, name])
        if (module, name) == ("torch", "Size"):
            return self._size
        if (module, name) == ("torch", "device"):
            return self._device
        dtype = getattr(torch, name, None) if module == "torch" else None
        if isinstance(dtype, torch.dtype):
            return dtype
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a tensor payload")

    def _size(self, dims: Any) -> torch.Size:
        return torch.Size(_dims(dims, "size", self.limits.max_numel))

    def _device(self, *args: Any) -> torch.device:
        if not all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args):
            raise pickle.UnpicklingError(f"device: unexpected arguments {args!r}")
        return torch.device(*args)

    def _storage_bytes(self, nbytes: Any) -> int:
        nbytes = _int(nbytes, 0, self.limits.max_bytes, "storage bytes")
        self.mapped += nbytes
        if self.mapped > self.limits.max_bytes:
            raise pickle.UnpicklingError(
                f"the payload maps more than {self.limits.max_bytes} bytes (the model's size)"
            )
        return nbytes

    def _extent(self, size: Any, stride: Any, offset: Any, capacity: int) -> None:
        """Refuse a view that reaches past its storage or is larger than any parameter."""
        dims = _dims(tuple(size), "size", self.limits.max_numel)
        steps = _dims(tuple(stride), "stride", capacity)
        if len(steps) != len(dims):
            raise pickle.UnpicklingError("size and stride differ in length")
        numel = math.prod(dims)
        if numel > self.limits.max_numel:
            raise pickle.UnpicklingError(
                f"a tensor of {numel} elements; the largest parameter has {self.limits.max_numel}"
            )
        start = _int(offset, 0, capacity, "storage offset")
        last = start + sum((d - 1) * s for d, s in zip(dims, steps, strict=True))
        if numel and last >= capacity:
            raise pickle.UnpicklingError("a tensor reaches past the end of its storage")

    def _rebuild_storage_filename(
        self, cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None
    ) -> Any:
        real = _unwrap(cls, _STORAGE_CLASSES)
        if not (isinstance(manager, bytes) and isinstance(handle, bytes)):
            raise pickle.UnpicklingError("shared-memory names: expected bytes")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"expected a dtype, got {dtype!r}")
        item = 1 if dtype is None else torch._utils._element_size(dtype)
        self._storage_bytes(_int(size, 0, self.limits.max_bytes, "storage size") * item)
        return reductions.rebuild_storage_filename(real, manager, handle, size, dtype)

    def _rebuild_storage_empty(self, cls: Any) -> Any:
        return reductions.rebuild_storage_empty(_unwrap(cls, _STORAGE_CLASSES))

    def _rebuild_typed_storage(self, storage: Any, dtype: Any) -> Any:
        if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("typed storage: expected a storage and a dtype")
        return reductions.rebuild_typed_storage(storage, dtype)

    def _rebuild_tensor(self, cls: Any, storage: Any, metadata: Any) -> Any:
        real = _unwrap(cls, _TENSOR_CLASSES)
        if not isinstance(storage, torch.TypedStorage):
            raise pickle.UnpicklingError("tensor: expected a typed storage")
        if not (isinstance(metadata, tuple) and len(metadata) == 4):
            raise pickle.UnpicklingError("tensor: malformed metadata")
        offset, size, stride, requires_grad = metadata
        self._extent(size, stride, offset, storage._size())
        return reductions.rebuild_tensor(real, storage, (offset, size, stride, False))

    def _rebuild_cuda_tensor(
        self,
        tensor_cls: Any,
        tensor_size: Any,
        tensor_stride: Any,
        tensor_offset: Any,
        storage_cls: Any,
        dtype: Any,
        *rest: Any,
    ) -> Any:
        # rest: storage_device, storage_handle, storage_size_bytes, storage_offset_bytes,
        # requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required
        real = _unwrap(tensor_cls, _TENSOR_CLASSES)
        storage_real = _unwrap(storage_cls, _STORAGE_CLASSES)
        if not isinstance(dtype, torch.dtype) or len(rest) != 9:
            raise pickle.UnpicklingError("CUDA tensor: malformed arguments")
        nbytes = self._storage_bytes(rest[2])
        self._extent(tensor_size, tensor_stride, tensor_offset, nbytes // max(dtype.itemsize, 1))
        _int(rest[0], 0, max(torch.cuda.device_count() - 1, 0), "device")
        return reductions.rebuild_cuda_tensor(
            real, tensor_size, tensor_stride, tensor_offset, storage_real, dtype, *rest
        )


def load_named_tensors(
    entry: str, limits: PayloadLimits | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one ``serialized_named_tensors`` entry.

    Args:
        entry: the base64 text.
        limits: bounds checked before anything is mapped (default: none, a trusted payload).

    Raises:
        ValueError: not base64, not a list of ``(str, tensor)`` pairs, a pickle that names
            anything but tensor-rebuilding globals, or a tensor or storage over ``limits``.
    """
    bounds = limits or PayloadLimits(2**62, 2**62)
    try:
        data = base64.b64decode(entry, validate=True)
        items = _TensorUnpickler(data, bounds).load()
    except (ValueError, TypeError, pickle.UnpicklingError, EOFError) as exc:
        raise ValueError(f"unreadable tensor payload: {exc}") from exc
    except (RuntimeError, OSError) as exc:  # a handle this process cannot open
        raise ValueError(f"cannot open the tensors' handles (same host only): {exc}") from exc
    if not isinstance(items, list) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor) for p in items
    ):  # fmt: skip
        raise ValueError("expected a list of (name, tensor) pairs")
    return items
