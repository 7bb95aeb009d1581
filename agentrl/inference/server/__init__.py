"""The server side: the embedded engine behind SGLang's native HTTP API (``agentrl serve``).

The app and its routes (``engine_server.py``: :func:`serve`, :func:`run_engine_server`), reading
requests (``requests.py``), the read-only routes (``info_routes.py``), who may call
(``guard.py``), the weights it may read from disk (``weight_files.py``) and receive from a
trainer (``weight_receive.py``). ``serve`` and ``run_engine_server`` are importable from here,
loaded on first use.

Imports the shared protocol modules of :mod:`agentrl.inference` and hosts the engine through
``agentrl.inference.engine`` alone (``LocalEngine``, ``PAUSE_MODES``, ``PauseMode``), never a
module inside it; must never import ``agentrl.inference.client``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.inference.server.engine_server import run_engine_server, serve

__all__ = ["run_engine_server", "serve"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from agentrl.inference.server import engine_server

        return getattr(engine_server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
