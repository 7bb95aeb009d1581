"""``agentrl serve``'s LoRA routes: SGLang's ``/load_lora_adapter`` and ``/unload_lora_adapter``.

A mixin of :class:`~agentrl.inference.server.engine_server.EngineServer`, with SGLang's bodies
(``{"lora_name", "lora_path", "pinned"}``, ``{"lora_name"}``) and responses (``{"success",
"error_message", "loaded_adapters": {name: path}}``; 400 on failure). Both are admin routes
(:data:`~agentrl.inference.api_keys.ADMIN_ROUTES`). Bodies are bounded (``MAX_LORA_BODY_BYTES``)
before they are read; ``lora_path`` must be a peft directory under an allowed weight directory
(``--weights-dir``, as ``/update_weights_from_disk``), its files regular files there; the engine
bounds their sizes and checks every tensor against the model before anything changes
(:class:`~agentrl.inference.engine.LocalEngine`'s ``load_lora_adapter``: it merges the adapter,
one active at a time). ``/generate``'s ``lora_path`` names a loaded adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentrl.errors import ServerError
from agentrl.inference.server.requests import json_body
from agentrl.inference.server.weight_files import WeightPathError, checked_adapter_dir

if TYPE_CHECKING:
    from agentrl.inference.engine import LocalEngine

MAX_LORA_BODY_BYTES = 64 * 1024
"""A name (<= 256 characters) and a path: far less than this."""
MAX_LORA_NAME_CHARS = 256


class LoraRoutes:
    """``/load_lora_adapter`` and ``/unload_lora_adapter``."""

    engine: LocalEngine
    weights_dirs: list[Path]

    def _lora_result(self, error: str = "") -> web.Response:
        payload = {
            "success": not error,
            "error_message": error,
            "loaded_adapters": self.engine.loaded_lora_adapters,
        }
        return web.json_response(payload, status=400 if error else 200)

    async def _lora_body(self, request: web.Request) -> tuple[dict[str, Any], str]:
        """The body and its ``lora_name``, or a ``ValueError`` saying what is wrong."""
        if (request.content_length or 0) > MAX_LORA_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(
                max_size=MAX_LORA_BODY_BYTES, actual_size=request.content_length or 0
            )
        body = await json_body(request)
        if not isinstance(body, dict):
            raise ValueError("expected a JSON object")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_name: expected a non-empty string, got {name!r:.80}")
        if len(name) > MAX_LORA_NAME_CHARS:
            raise ValueError(
                f"lora_name: at most {MAX_LORA_NAME_CHARS} characters, got {len(name)}"
            )
        return body, name

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """``{"lora_name", "lora_path", "pinned"?}``: load a peft directory and serve it."""
        try:
            body, name = await self._lora_body(request)
            path = body.get("lora_path")
            if not isinstance(path, str) or not path:
                raise ValueError(f"lora_path: expected a non-empty string, got {path!r:.80}")
            if not isinstance(body.get("pinned", False), bool):
                raise ValueError("pinned: expected a boolean")
            real = checked_adapter_dir(path, self.weights_dirs)
        except (ValueError, WeightPathError) as exc:
            return self._lora_result(str(exc))
        try:
            await self.engine.load_lora_adapter(name, str(real))
        except ServerError as exc:
            return self._lora_result(exc.message)
        return self._lora_result()

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """``{"lora_name"}``: forget an adapter (the base is served if it was the active one)."""
        try:
            _, name = await self._lora_body(request)
            await self.engine.unload_lora_adapter(name)
        except ValueError as exc:
            return self._lora_result(str(exc))
        except ServerError as exc:
            return self._lora_result(exc.message)
        return self._lora_result()
