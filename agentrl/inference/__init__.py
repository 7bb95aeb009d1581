"""Inference behind one protocol: the SGLang HTTP client, or the embedded engine.

Three sides, one subpackage each (``tests/test_architecture.py`` checks what each may import):

- :mod:`~agentrl.inference.client`: :class:`~agentrl.inference.client.SGLangClient` for SGLang's
  native HTTP API, and the trainer's weight push to servers. Never imports ``engine``/``server``.
- :mod:`~agentrl.inference.engine`: the embedded
  :class:`~agentrl.inference.engine.LocalEngine`. Never imports ``client``/``server``.
- :mod:`~agentrl.inference.server`: the engine behind SGLang's API (``agentrl serve``). Hosts
  the engine through ``agentrl.inference.engine`` alone; never imports ``client``.

What the sides share stays here, and imports none of them: the protocol (:mod:`~agentrl.inference.
base`: ``generate``, ``abort``, weight updates, ``health``), the JSON shapes of SGLang's API
(``sglang_api``), routing records and their wire form (``routing_records``), API keys
(``api_keys``) and the weight-push transports (``weight_group``: the process group,
``weight_ipc``: tensors by handle). See ``docs/architecture.md``.

Imports ``agentrl.errors`` and torch/transformers; must never import ``agentrl.rollout``,
``agentrl.learner`` or ``agentrl.loop``: an engine serves tokens, whoever asks.
"""

from agentrl.inference.base import GenerateOutput, InferenceClient, SamplingParams

__all__ = ["GenerateOutput", "InferenceClient", "SamplingParams"]
