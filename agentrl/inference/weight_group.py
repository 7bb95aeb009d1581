"""A process group that carries weights from a trainer to inference servers.

SGLang's disaggregated weight push (``/init_weights_update_group`` then, per bucket,
``/update_weights_from_distributed``) puts the trainer's rank 0 and every server in one process
group of their own, apart from any group the trainer trains in (FSDP): rank 0 broadcasts each
tensor, the servers receive it. This module holds what both sides share: opening such a group
(NCCL on GPUs, gloo on CPUs, so the path is tested without a GPU), the wire names of dtypes, and
the split of a state dict into buckets of bounded size.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

GROUP_NAME = "weight_update_group"
"""SGLang's default ``group_name``."""

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The dtype a wire name stands for (``"bfloat16"`` or ``"torch.bfloat16"``).

    Raises:
        ValueError: not a dtype weights come in.
    """
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[key]


@dataclass(slots=True)
class WeightGroup:
    """One rank's membership of a weight-update group.

    Attributes:
        group: the collective backend (gloo or NCCL; never torch's default group).
        rank: this member's rank (0: the trainer, which broadcasts).
        world_size: members, the trainer included.
        device: where this member's tensors live for the collectives.
        store: the rendezvous store (kept alive for the group's lifetime).
    """

    group: Any  # ProcessGroupGloo | ProcessGroupNCCL (torch types them apart)
    rank: int
    world_size: int
    device: torch.device
    store: dist.Store

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 in place (send at rank 0, receive elsewhere).

        Callable from any thread: the group's device is made current for the call (a CUDA
        device is per thread, and worker threads start on device 0).
        """
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        with _on(self.device):
            self.group.broadcast([tensor], opts).wait()

    def synchronize(self) -> None:
        """Block until this thread's broadcasts have completed on the device.

        NCCL's ``wait`` only orders the current stream; after this, any stream or thread may
        read the tensors.
        """
        if self.device.type == "cuda":
            with _on(self.device):
                torch.cuda.current_stream(self.device).synchronize()

    def close(self, timeout_s: float = 30.0) -> None:
        """Leave the group (idempotent enough: a second call is harmless).

        NCCL's teardown waits for the peers; one that is gone or stuck must not hang the
        caller, so past ``timeout_s`` the group is abandoned with a warning.
        """
        shutdown = getattr(self.group, "shutdown", None)
        if not callable(shutdown):
            return

        def run() -> None:
            try:
                shutdown()
            except RuntimeError:  # already torn down
                pass

        worker = threading.Thread(target=run, name="weight-group-close", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            log.warning("weight-update group (rank %d) did not shut down in %.0f s; abandoned",
                        self.rank, timeout_s)  # fmt: skip


def open_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    device: torch.device | str,
    timeout_s: float = 120.0,
) -> WeightGroup:
    """Join (or, at rank 0, host) a weight-update group; blocks until every member has joined.

    Args:
        master_address: host of rank 0's rendezvous store.
        master_port: its port.
        rank: this member's rank; 0 hosts the store and broadcasts.
        world_size: 1 trainer rank + every server rank.
        backend: ``"nccl"`` (tensors on CUDA) or ``"gloo"`` (tensors on the CPU).
        device: where this member's tensors are (a CUDA device for NCCL).
        timeout_s: rendezvous and per-collective timeout: a member that never joins or a push
            that stalls ends in an error rather than a hang.

    Raises:
        ValueError: an unknown backend, or a device the backend cannot use.
        RuntimeError: the group could not form within ``timeout_s``.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    dev = torch.device(device)
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"backend 'nccl' needs a CUDA device, got {dev}")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: expected 'nccl' or 'gloo', got {backend!r}")
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    group: Any
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        torch.cuda.set_device(dev)
        group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        # connect now, while every member is inside this call, rather than lazily inside the
        # first broadcast: a member that cannot connect fails here, with the group's timeout
        group.eager_connect_single_device(dev)
    return WeightGroup(group, rank, world_size, dev, store)


def _on(device: torch.device) -> Any:
    """``device`` made current for a block (no-op off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``named`` of at most ``bucket_bytes`` each (a larger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
