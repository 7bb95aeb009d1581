"""Inference behind one protocol: the SGLang HTTP client, or the embedded engine.

Owns the protocol (:mod:`~agentrl.inference.base`: ``generate``, ``abort``, weight updates,
``health``), :class:`~agentrl.inference.client.SGLangClient` for SGLang's native HTTP API, the
embedded :class:`~agentrl.inference.engine.LocalEngine`, and the server that puts it behind that
API (``agentrl serve``). See ``docs/architecture.md``.

Imports ``agentrl.errors`` and torch/transformers; must never import ``agentrl.rollout``,
``agentrl.learner`` or ``agentrl.loop``: an engine serves tokens, whoever asks.
"""

from agentrl.inference.base import GenerateOutput, InferenceClient, SamplingParams

__all__ = ["GenerateOutput", "InferenceClient", "SamplingParams"]
