"""The read-only routes of ``agentrl serve``: model identity, startup configuration, load.

A mixin of :class:`~agentrl.inference.server.engine_server.EngineServer` (``/model_info``,
``/server_info``, ``/v1/models``, ``/v1/loads``), in SGLang's shapes. Nothing here reports a key.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from agentrl import __version__
from agentrl.routing import is_moe, routing_shape

if TYPE_CHECKING:
    from agentrl.inference.engine import LocalEngine


class InfoRoutes:
    """``/model_info``, ``/server_info``, ``/v1/models`` and ``/v1/loads``."""

    engine: LocalEngine
    model_path: str
    served_model_name: str
    host: str
    port: int
    _startup_label: str
    _startup_time: float

    if TYPE_CHECKING:

        def label_of(self, version: int) -> str:
            """The wire label of an engine version (the server's)."""
            ...

    async def model_info(self, request: web.Request) -> web.Response:
        """Live model identity and ``weight_version`` label."""
        config = self.engine.model.config
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.label_of(self.engine.weight_version),
                "load_format": None,
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
                "routed_experts_shape": routing_shape(self.engine.model)[:2]
                if is_moe(self.engine.model)
                else None,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        """Startup configuration (the live weight label is in ``/model_info``)."""
        limit = self.engine.max_model_len
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "tokenizer_path": self.model_path,
                "host": self.host,
                "port": self.port,
                "context_length": limit,
                "max_context_length": limit,
                "max_req_input_len": limit - 1,
                "max_total_num_tokens": limit * self.engine.max_batch_size,
                "max_running_requests": self.engine.max_batch_size,
                "tp_size": 1,
                "dp_size": 1,
                "page_size": 1,
                "weight_version": self._startup_label,
                "device": str(self.engine.device),
                "incremental_streaming_output": False,
                "disaggregation_mode": "null",
                "internal_states": [{"paused": self.engine.paused}],
                "enable_return_routed_experts": self.engine.return_routed_experts,
                "loaded_lora_adapters": self.engine.loaded_lora_adapters,
                "startup_time": self._startup_time,
                "version": f"agentrl-{__version__}",
                "frontend": "agentrl",
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI-style model list; ``max_model_len`` is the context length."""
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": int(self._startup_time),
            "owned_by": "sglang",
            "root": self.served_model_name,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def loads(self, request: web.Request) -> web.Response:
        """``/v1/loads``: one DP rank's request counts (the drain check slime uses)."""
        load = {"dp_rank": 0, **self.engine.stats(), "timestamp": time.time()}
        return web.json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": f"agentrl-{__version__}",
                "accelerator": str(self.engine.device),
                "num_accelerators": 1,
                "loads": [load],
            }
        )
