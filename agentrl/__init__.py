"""agentrl: train LLM agents with reinforcement learning over multi-turn interactions.

The public surface is small on purpose; everything else is imported from its submodule.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# NCCL's cuMem allocations hang process groups that span separate processes, such as the trainer
# and an inference server exchanging weights (measured on two H100s and two H200s: every push
# arrived, then the trainer never returned; with cuMem off, 0.037 s). SGLang and vLLM turn it off
# at start-up too. It must be set before NCCL's first communicator in this process; a value the
# user set is kept.
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")

import agentrl.envs  # noqa: F401 - registers the built-in envs (ids only; classes load on use)
from agentrl.env import Env, StepResult, Tool, ToolEnv, make, register
from agentrl.types import Group, Message, Task, Trajectory

if TYPE_CHECKING:
    from agentrl.config import load_config
    from agentrl.loop.trainer import Trainer
    from agentrl.rollout.engine import RolloutConfig, RolloutEngine

__version__ = "0.1.0"

__all__ = [
    "Env",
    "Group",
    "Message",
    "RolloutConfig",
    "RolloutEngine",
    "StepResult",
    "Task",
    "Tool",
    "ToolEnv",
    "Trainer",
    "Trajectory",
    "load_config",
    "make",
    "register",
]

_LAZY = {
    "RolloutConfig": "agentrl.rollout.engine",
    "RolloutEngine": "agentrl.rollout.engine",
    "Trainer": "agentrl.loop.trainer",
    "load_config": "agentrl.config",
}


def __getattr__(name: str) -> Any:
    # torch-heavy modules load on first use, so `import agentrl` stays light.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentrl' has no attribute {name!r}")
