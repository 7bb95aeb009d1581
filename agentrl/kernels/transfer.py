"""Host-to-device copies that do not make the host wait for the GPU."""

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


def device_context(device: torch.device) -> AbstractContextManager[Any]:
    """Make ``device`` the current CUDA device (a no-op off CUDA).

    A worker thread starts on card 0 whatever its process uses: streams, CUDA graphs and
    collectives it creates would land there, not on the rank's card.
    """
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
