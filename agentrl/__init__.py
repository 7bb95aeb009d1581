"""agentrl: train LLM agents with reinforcement learning over multi-turn interactions.

The public surface is small on purpose; everything else is imported from its submodule.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# NCCL's cuMem allocations hung the weight push between a trainer and an inference server in
# separate processes (two H100s, two H200s: the pushes arrived, then the trainer never finished;
# with cuMem off the 0.6B shape pushes in 0.037 s). SGLang and vLLM turn it off at start-up too.
# It must be set before NCCL's first communicator in this process; a value the user set is kept.
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
