"""The client side: SGLang's native HTTP API as the rollout and the trainer call it.

:class:`SGLangClient` (``sglang_client.py``; its calls to every endpoint in ``control.py``, the
rotation of endpoints in ``endpoints.py``) and the trainer's weight push to servers
(``weight_push.py``). ``SGLangClient`` is importable from here; it is loaded on first use, so
``agentrl.config`` can read ``endpoints`` without aiohttp or torch.

Imports the shared protocol modules of :mod:`agentrl.inference`; must never import
``agentrl.inference.engine`` or ``agentrl.inference.server``: it talks to any SGLang server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.inference.client.sglang_client import SGLangClient

__all__ = ["SGLangClient"]


def __getattr__(name: str) -> Any:
    if name == "SGLangClient":
        from agentrl.inference.client.sglang_client import SGLangClient

        return SGLangClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
