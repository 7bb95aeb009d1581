"""Host/device copies that do not make a thread hold the CUDA driver while it waits for the GPU."""

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


def wait_for(device: torch.device) -> None:
    """Block this thread until the work queued so far on ``device``'s current stream has run.

    Reading a CUDA tensor on the host (``.tolist()``, ``.item()``, ``.cpu()``) waits for the
    GPU inside a device-to-host copy into pageable memory, and the CUDA driver stalls the kernel
    launches of every other thread of the process meanwhile. In the overlapped loop, where the
    engine and the learner are threads of one process, each waited ~16 ms (one decode run) on
    the other's reads: on an H100, the learner's launch calls were blocked for 2.2 s in 4 steps
    of 1 s. Waiting on an event first does not stall them, and the copy after it is immediate.
    Off CUDA it returns at once.
    """
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host, waiting for the GPU without stalling other threads (:func:`wait_for`)."""
    wait_for(t.device)
    return t.cpu()


def device_context(device: torch.device) -> AbstractContextManager[Any]:
    """Make ``device`` the current CUDA device (a no-op off CUDA).

    A worker thread starts on card 0 whatever its process uses: streams, CUDA graphs and
    collectives it creates would land there, not on the rank's card.
    """
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
