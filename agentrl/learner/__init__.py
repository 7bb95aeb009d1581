"""Learning: advantages from groups, the GSPO/GRPO losses, and the policy update.

Owns group advantages and per-token shapers (:mod:`~agentrl.learner.advantages`), the losses as
pure tensor functions (:mod:`~agentrl.learner.losses`), and the :class:`Learner` that turns a
rollout batch into optimizer steps on the engine's log-probs: packing
(:mod:`~agentrl.learner.packing`), chunked log-probs (:mod:`~agentrl.learner.logprobs`),
diagnostics (:mod:`~agentrl.learner.diagnostics`), FSDP2 plumbing
(:mod:`~agentrl.learner.distributed`), checkpoints and weight export
(:mod:`~agentrl.learner.checkpoint`, :mod:`~agentrl.learner.export`). See
``docs/architecture.md`` and the GSPO paper (Zheng et al., 2025, arXiv:2507.18071).

Imports ``agentrl.types``, ``agentrl.errors`` and ``agentrl.kernels``; must never import
``agentrl.rollout``, ``agentrl.inference`` or ``agentrl.loop``: the learner sees tensors and
trajectories, never servers or envs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentrl.learner.config import LearnerConfig

if TYPE_CHECKING:
    from agentrl.learner.packing import TrainSample, samples_from_trajectories
    from agentrl.learner.update import Learner

__all__ = ["Learner", "LearnerConfig", "TrainSample", "samples_from_trajectories"]

# loaded on first use: configs and `agentrl --help` need only LearnerConfig, not torch's stack
_LAZY = {
    "Learner": "agentrl.learner.update",
    "TrainSample": "agentrl.learner.packing",
    "samples_from_trajectories": "agentrl.learner.packing",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
