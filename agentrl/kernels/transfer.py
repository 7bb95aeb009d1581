"""Host/device copies that make no thread wait for the GPU needlessly or stall the others."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor ``t`` on ``device``, without making the host wait for the GPU.

    A plain host-to-GPU copy synchronises the stream: the host would wait for every queued
    kernel before it can queue the next, and the GPU then idles. A copy from pinned memory is
    queued like a kernel.
    """
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host; on CUDA, after waiting on an event rather than inside the copy.

    Reading a CUDA tensor on the host (``.tolist()``, ``.item()``, ``.cpu()``) waits for the GPU
    inside a device-to-host copy into pageable memory. On the legacy default stream, where the
    embedded engine replays its graphs, that copy stalls every other thread's kernel launches
    until it is done (``benchmarks/launch_stall.py``, H100: another thread's 2,000 launches took
    72.8 ms, the slowest 47.9 ms, against 23.3 and 0.14 ms after an event wait; a read on a
    stream of its own stalled nothing). In the overlapped loop the learner's launch calls were
    blocked 1.7 s in 4 steps of 1.1 s. An event wait stalls nothing, and the copy after it is
    immediate.
    """
    if t.device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))
        done.synchronize()
    return t.cpu()


def device_context(device: torch.device) -> AbstractContextManager[Any]:
    """Make ``device`` the current CUDA device (a no-op off CUDA).

    A worker thread starts on card 0 whatever its process uses: streams, CUDA graphs and
    collectives it creates would land there, not on the rank's card.
    """
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
