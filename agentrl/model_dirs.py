"""Telling a model directory from a run or checkpoint directory (for one-line errors)."""

from __future__ import annotations

from pathlib import Path


def not_a_model_reason(path: str | Path) -> str | None:
    """Why the directory ``path`` is a training checkpoint or run, not a model (``None``: neither).

    A run's checkpoint (``MANIFEST``, ``learner/``) or run directory (``config.yaml``,
    ``checkpoints/``) has no ``config.json``; transformers would fail on it with "Unrecognized
    model", so callers say this instead.
    """
    p = Path(path).expanduser()
    if not p.is_dir() or (p / "config.json").exists():
        return None
    if (p / "learner").is_dir() or (p / "MANIFEST").exists():
        what = "a training checkpoint"
    elif (p / "config.yaml").exists() and (p / "checkpoints").is_dir():
        what = "a run directory"
    else:
        return None
    return (
        f"{path} is {what}, not a Hugging Face model directory; write one with "
        f"`agentrl export {path} --out DIR` and use DIR"
    )
