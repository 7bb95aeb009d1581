"""The RL loop: rollouts -> advantages -> update -> weight sync, with its schedules and jobs.

Owns the :class:`~agentrl.loop.trainer.Trainer` (one training step and one after-step schedule
of evaluation, logging and checkpoints), the overlapped batch source with bounded staleness
(:mod:`~agentrl.loop.pipeline`), the supervised cold start (:mod:`~agentrl.loop.cold_start`) and
the CLI jobs (:mod:`~agentrl.loop.jobs`). See ``docs/architecture.md``.

The top of the dependency graph: it may import every other ``agentrl`` package, and every
other package must never import it (only ``agentrl.cli`` launches its jobs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.loop.trainer import Trainer

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    # the trainer pulls in torch and transformers: load it on first use
    if name == "Trainer":
        from agentrl.loop.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'agentrl.loop' has no attribute {name!r}")
