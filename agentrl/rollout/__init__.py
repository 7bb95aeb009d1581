"""Rollouts: many multi-turn episodes in flight at once, token-in/token-out.

Owns the episode loop (env ``reset``/``step`` against an inference client), groups of G
episodes per task, failure isolation, the JSONL sink (:mod:`~agentrl.rollout.engine`), partial
rollouts across weight updates (:mod:`~agentrl.rollout.partial_rollouts`) and the append-only
tokenisation of a conversation with a chat template (:mod:`~agentrl.rollout.chat`). See
``docs/architecture.md``.

Imports ``agentrl.env``, ``agentrl.types`` and the inference protocol
(``agentrl.inference.base``); must never import ``agentrl.learner``, ``agentrl.kernels`` or
``agentrl.loop``: rollouts know nothing of training.
"""

from agentrl.rollout.chat import ChatTokenizer
from agentrl.rollout.engine import JsonlSink, RolloutConfig, RolloutEngine, rollout_metrics

__all__ = ["ChatTokenizer", "JsonlSink", "RolloutConfig", "RolloutEngine", "rollout_metrics"]
