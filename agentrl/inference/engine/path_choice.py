"""Which path the embedded engine takes for a model, and why (said in its log line and API)."""

from __future__ import annotations

from typing import Any, Literal

from agentrl.kernels.packed_body import unsupported_reason

Path = Literal["paged", "transformers"]


def choose_path(model: Any, paged: bool | None, cuda: bool) -> tuple[Path, str]:
    """``(path, reason)``: the paged path by default on CUDA for the models it supports."""
    unsupported = unsupported_reason(model, moe=True)
    if paged is None:
        paged = cuda and unsupported is None
    name = type(model).__name__
    if paged:
        graphs = "" if cuda else ", no CUDA graphs off CUDA"
        return "paged", f"{name}: paged KV cache, the learner's layer math{graphs}"
    if unsupported is not None:
        return "transformers", f"the paged engine does not support {unsupported}"
    why = "paged=False" if cuda else "not on CUDA (the paged path is the default on CUDA only)"
    return "transformers", why
