"""The embedded engine: a transformers causal LM that serves tokens in this process.

:class:`LocalEngine` (``local_engine.py``) implements
:class:`~agentrl.inference.base.InferenceClient` and is this side's one interface: the server and
the loop use it (and ``PAUSE_MODES`` / ``PauseMode``) through this package, never a module inside
it. Inside: the request lifecycle
(``batcher.py``), the transformers path's runner (``dense_runner.py``), which path a model takes
(``path_choice.py``), weight updates (``weight_updates.py``) and LoRA adapters merged one at a
time (``adapters.py``), on a GPU the paged path (``paged_batcher.py``, ``paged_runner.py``,
``paged_moe.py``, ``kv_cache.py``, ``prefill_graphs.py``, ``sampling.py``), model and weight
loading (``model_io.py``) and the engine's own threads (``worker.py``).

Imports the shared protocol modules of :mod:`agentrl.inference`, ``agentrl.kernels``,
``agentrl.routing`` and torch/transformers; must never import ``agentrl.inference.client`` or
``agentrl.inference.server``: an engine serves tokens, whoever asks.
"""

from agentrl.inference.engine.local_engine import PAUSE_MODES, LocalEngine, PauseMode

__all__ = ["PAUSE_MODES", "LocalEngine", "PauseMode"]
