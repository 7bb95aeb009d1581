"""The embedded engine behind SGLang's native HTTP API: what ``agentrl serve`` runs.

It speaks the subset of SGLang 0.5.23's native API that :class:`SGLangClient` and RL
frameworks use, with SGLang's request/response shapes and status codes (the endpoints are listed
in ``docs/architecture.md``), so the HTTP path is tested on CPU and SGLang's own clients
work against it. Every ``/generate`` call (single or batch) becomes one request per prompt to a
shared :class:`LocalEngine`, so concurrent HTTP requests are batched together.

Differences from SGLang, all deliberate: no streaming (``stream: true`` is a 400 that says so);
sampling features the engine lacks (stop strings, penalties, grammars, ``n > 1``, top-logprobs)
are a 400 naming the field rather than being ignored; ``/health`` answers 503 at once while
generation is paused (SGLang's answers 503 once its probe generation times out);
``/abort_request`` matches ``rid`` by prefix, as SGLang's scheduler does. Weight
version labels are strings on the wire and ints in the engine (``parse_weight_version``);
the server keeps the label of every int it has seen, so spans report the labels clients sent.
``return_routed_experts`` needs ``--enable-return-routed-experts`` (and an MoE model), as in
SGLang; ``/model_info`` adds ``routed_experts_shape`` (``[layers, top_k]``, ``null`` when dense)
so that clients can shape ``meta_info.routed_experts``.

Who may call what (keys, ``Host``, ``Origin``, JSON-only state changes) is
:mod:`~agentrl.inference.server.guard`'s; which directories ``/update_weights_from_disk`` reads
is :mod:`~agentrl.inference.server.weight_files`'s; LoRA adapters (``/load_lora_adapter``,
``/unload_lora_adapter``, ``/generate``'s ``lora_path``) are
:mod:`~agentrl.inference.server.lora_routes`'s.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, cast

from aiohttp import web

from agentrl import fast_json
from agentrl.errors import ServerError
from agentrl.inference.base import GenerateOutput, SamplingParams
from agentrl.inference.engine import PAUSE_MODES, LocalEngine, PauseMode
from agentrl.inference.routing_records import to_wire
from agentrl.inference.server.guard import Guard, allowed_hosts, warn_if_open
from agentrl.inference.server.info_routes import InfoRoutes
from agentrl.inference.server.lora_routes import LoraRoutes
from agentrl.inference.server.requests import GenerateItem, json_body, parse_generate
from agentrl.inference.server.weight_files import (
    WeightPathError,
    max_weight_bytes,
    read_weights,
    resolve_dirs,
)
from agentrl.inference.server.weight_receive import WeightReceiver
from agentrl.inference.sglang_api import (
    ContractError,
    RequestError,
    finish_reason_json,
    parse_weight_version,
    version_spans,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024**2
"""Default request body limit: a full-context prompt as JSON ids is a few MB at most."""

_FLOAT32_MIN = -3.4028234663852886e38  # SGLang clamps log-probs here (JSON has no -inf)
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _plain(exc: Exception) -> str:
    """The message of ``exc`` without the ``[endpoint=... rid=...]`` that ServerError appends."""
    return exc.message if isinstance(exc, ServerError) else str(exc)


def _json(data: Any) -> web.Response:
    """``data`` as a JSON response (:func:`agentrl.fast_json.dumps`: off the stdlib's slow path)."""
    return web.Response(body=fast_json.dumps(data), content_type="application/json")


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class EngineServer(InfoRoutes, LoraRoutes):
    """The aiohttp application around one :class:`LocalEngine`.

    Args:
        engine: the engine that serves every request.
        model_path: reported by ``/model_info``; changes with ``/update_weights_from_disk``.
        served_model_name: the model id of ``/v1/models`` (default: ``model_path``).
        weight_version: the label of the engine's current weights (SGLang's ``"default"``).
        max_body_bytes: the largest request body accepted (larger ones get a 413).
        guard: keys and allowed hosts (:class:`~agentrl.inference.server.guard.Guard`;
            default: no keys, loopback names only).
        weights_dirs: the directories ``/update_weights_from_disk`` may read (and their
            subdirectories); none: that route refuses every path.
        weights_timeout_s: the longest a ``/update_weights_from_disk`` read may take.
    """

    def __init__(
        self,
        engine: LocalEngine,
        *,
        model_path: str,
        served_model_name: str | None = None,
        weight_version: str = "default",
        max_body_bytes: int = MAX_BODY_BYTES,
        guard: Guard | None = None,
        weights_dirs: Iterable[str | Path] = (),
        weights_timeout_s: float = 300.0,
    ) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.guard = guard or Guard()
        self.weights_dirs = resolve_dirs(weights_dirs)
        self.weights_timeout_s = weights_timeout_s
        self._max_weight_bytes = max_weight_bytes(engine.model)
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self._labels = {engine.weight_version: weight_version}
        self._startup_label = weight_version
        self._startup_time = time.time()
        self.host, self.port = "", 0
        self.weights = WeightReceiver(engine, self._labels.__setitem__)
        """The distributed weight push's receiving side (``/init_weights_update_group``, ...)."""

    def label_of(self, version: int) -> str:
        """The wire label of an engine version."""
        return self._labels.get(version, str(version))

    def app(self) -> web.Application:
        """The routes of SGLang's native API that this server implements."""
        app = web.Application(
            client_max_size=self.max_body_bytes,
            middlewares=[self.guard.middleware, _errors_as_json],
        )
        get, post = web.get, web.post
        app.add_routes(
            [
                post("/generate", self.generate),
                web.put("/generate", self.generate),
                post("/abort_request", self.abort_request),
                post("/pause_generation", self.pause_generation),
                post("/continue_generation", self.continue_generation),
                post("/update_weights_from_disk", self.update_weights_from_disk),
                post("/load_lora_adapter", self.load_lora_adapter),
                post("/unload_lora_adapter", self.unload_lora_adapter),
                get("/flush_cache", self.flush_cache),
                post("/flush_cache", self.flush_cache),
                get("/health", self.health),
                get("/health_generate", self.health),
                get("/ready", self.ready),
                get("/model_info", self.model_info),
                get("/get_model_info", self.model_info),
                get("/server_info", self.server_info),
                get("/get_server_info", self.server_info),
                get("/v1/models", self.models),
                get("/v1/loads", self.loads),
                *self.weights.routes(),
            ]
        )
        return app

    # ---- /generate ----------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        """``/generate``: single form → one object, batch form → a list in input order."""
        try:
            items, batch = await parse_generate(
                await json_body(request),
                vocab_size=self.engine.vocab_size,
                tokenizer=self.engine.tokenizer,
                max_model_len=self.engine.max_model_len,
            )
            if len({item.rid for item in items}) < len(items):
                raise RequestError("Duplicate request ID detected: rids repeat within the batch")
            for item in items:  # reject before anything of this call starts running
                self.engine.check_request(item.input_ids, item.params, item.rid, routed=item.routed)
                self.engine.check_lora(item.lora_path, item.rid)
        except ContractError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        except (RequestError, ServerError) as exc:
            return _error(_plain(exc))
        tasks = [asyncio.ensure_future(self._run(item)) for item in items]
        try:
            results = await asyncio.gather(*tasks)
        except ServerError as exc:
            return _error(_plain(exc), exc.status or 500)
        finally:
            for task in tasks:  # the client went away: abort what is still running
                task.cancel()
        return _json(results if batch else results[0])

    async def _run(self, item: GenerateItem) -> dict[str, Any]:
        prompt_entries: list[list[Any]] = []
        if item.return_logprob and item.logprob_start_len >= 0:
            # SGLang's input logprobs are untempered log_softmax(logits); position 0 has none.
            scores = await self.engine.prompt_logprobs(item.input_ids, temperature=1.0)
            values: list[float | None] = [None, *scores]
            texts = self._texts(item.input_ids, item.return_text_in_logprobs)
            prompt_entries = [
                [_clamp(values[i]), item.input_ids[i], texts[i]]
                for i in range(item.logprob_start_len, len(item.input_ids))
            ]
        out = await self.engine.generate(
            item.input_ids,
            item.params,
            rid=item.rid,
            return_routed_experts=item.return_routed_experts,
            routed_experts_start_len=item.routed_experts_start_len,
            lora_path=item.lora_path,
        )
        return self._response(item, out, prompt_entries)

    def _texts(self, ids: list[int], enabled: bool) -> list[str | None]:
        if not enabled:
            return [None] * len(ids)
        return [self.engine.tokenizer.decode([t]) for t in ids]

    def _response(
        self, item: GenerateItem, out: GenerateOutput, prompt_entries: list[list[Any]]
    ) -> dict[str, Any]:
        shown = out.output_ids
        if out.finish_reason == "stop" and not item.text_options.no_stop_trim:
            shown = shown[:-1]  # SGLang trims the matched stop token from `text` only
        text = self.engine.tokenizer.decode(
            shown, skip_special_tokens=item.text_options.skip_special_tokens
        )
        meta: dict[str, Any] = {
            "id": out.rid,
            "finish_reason": finish_reason_json(out, item.params.max_new_tokens),
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(out.output_ids),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "num_retractions": out.meta.get("num_retractions", 0),
            "weight_version": self.label_of(self.engine.weight_version),
            "weight_versions": version_spans(out.versions, self.label_of),
            "e2e_latency": out.meta.get("e2e_latency"),
        }
        if item.return_logprob:
            texts = self._texts(out.output_ids, item.return_text_in_logprobs)
            meta["input_token_logprobs"] = prompt_entries
            meta["output_token_logprobs"] = [
                [_clamp(lp), t, s]
                for lp, t, s in zip(out.logprobs, out.output_ids, texts, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(out.output_ids)
        if item.routed >= 0 and out.routed_experts is not None:  # SGLang's: base64 int32
            meta["routed_experts"] = to_wire(out.routed_experts[item.routed :])
        response: dict[str, Any] = {"text": text, "output_ids": out.output_ids, "meta_info": meta}
        if item.return_prompt_token_ids:
            response["prompt_token_ids"] = item.input_ids
        return response

    # ---- control routes -----------------------------------------------------------------------

    async def abort_request(self, request: web.Request) -> web.Response:
        """``{"rid": str, "abort_all": bool}`` → 200 with an empty body, matched or not."""
        body = await json_body(request, default={})
        if body.get("abort_all") is True:
            await self.engine.abort(None)
        elif isinstance(body.get("rid"), str) and body["rid"]:
            await self.engine.abort(body["rid"], prefix=True)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``{"mode": "abort" | "retract" | "in_place"}`` (default ``"abort"``)."""
        mode = (await json_body(request, default={})).get("mode") or "abort"
        if mode not in PAUSE_MODES:
            return _error(f"mode: expected one of {list(PAUSE_MODES)}, got {mode!r}")
        await self.engine.pause(cast(PauseMode, mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """Resume after ``/pause_generation``."""
        await json_body(request, default={})
        await self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load an HF directory under an allowed one; ``weight_version`` becomes the live label.

        The directory and its files are checked before anything is opened, and read within
        ``weights_timeout_s`` (:func:`~agentrl.inference.server.weight_files.read_weights`).
        """
        body = await json_body(request, default={})
        path, label = body.get("model_path"), body.get("weight_version")
        if not isinstance(path, str) or not path:
            return _error("model_path: expected a non-empty string")
        if label is not None and not isinstance(label, (str, int)):
            return _error(f"weight_version: expected a string, got {label!r}")
        num_paused = self._num_open() if self.engine.paused else 0

        def result(success: bool, message: str) -> web.Response:
            payload = {"success": success, "message": message, "num_paused_requests": num_paused}
            return web.json_response(payload, status=200 if success else 400)

        if body.get("load_format") not in (None, "auto", "safetensors"):
            return result(False, f"load_format {body['load_format']!r} is not supported")
        if body.get("abort_all_requests") is True:
            await self.engine.abort(None)
        try:
            state_dict = await read_weights(
                path, self.weights_dirs, self._max_weight_bytes, self.weights_timeout_s
            )
        except WeightPathError as exc:
            return result(False, str(exc))
        version = None if label is None else parse_weight_version(label)
        try:
            await self.engine.update_weights_from_state_dict(state_dict, version)
        except ServerError as exc:
            return result(False, _plain(exc))
        if version is not None:
            self._labels[version] = str(label)
        self.model_path = path
        return result(True, "Succeeded to update model weights.")

    def _num_open(self) -> int:
        stats = self.engine.stats()
        return stats["num_running_reqs"] + stats["num_waiting_reqs"]

    async def flush_cache(self, request: web.Request) -> web.Response:
        """No prefix cache: 200 when idle, 400 while requests are open (as SGLang)."""
        if request.method == "POST":
            await json_body(request, default={})  # ignored, but a bad one is a 400
        if await self.engine.flush_cache():
            return web.Response(text=_FLUSHED)
        return web.Response(
            text="Flush cache failed: requests are running or waiting.\n", status=400
        )

    async def health(self, request: web.Request) -> web.Response:
        """200 if the engine generates one token (or is busy), else 503 (paused included)."""
        if self.engine.paused:
            return _error("generation is paused (/continue_generation resumes it)", 503)
        if not await self.engine.health():
            return web.Response(status=503)
        if self._num_open():
            return web.Response(status=200)
        probe = self.engine.generate(
            [0],
            SamplingParams(max_new_tokens=1, temperature=0.0),
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        )
        try:
            await asyncio.wait_for(probe, timeout=20.0)
        except (TimeoutError, ServerError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        """503 while paused."""
        return web.Response(status=503 if self.engine.paused else 200)


def _clamp(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, _FLOAT32_MIN)


@web.middleware
async def _errors_as_json(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn stray errors into SGLang's error body instead of aiohttp's HTML pages."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        return _error(exc.text or exc.reason, exc.status)
    except (RequestError, ContractError) as exc:
        return _error(str(exc))
    except Exception as exc:
        logger.exception("unhandled error on %s", request.path)
        return _error(f"internal error: {exc!r}", 500)


async def serve(
    engine: LocalEngine,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    model_path: str = "",
    served_model_name: str | None = None,
    weight_version: str = "default",
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    extra_hosts: Iterable[str] = (),
    weights_dirs: Iterable[str | Path] = (),
) -> None:
    """Serve ``engine`` over HTTP until ``stop`` is set (or the task is cancelled).

    ``port=0`` picks a free port; ``on_ready`` gets the base URL once the socket listens.
    Client disconnects cancel their handlers, which aborts their requests in the engine.
    ``api_key`` / ``admin_api_key`` are SGLang's (:mod:`~agentrl.inference.api_keys`);
    ``extra_hosts`` are more ``Host`` names to answer (``*``: any); ``weights_dirs`` are the
    directories ``/update_weights_from_disk`` may read.
    """
    warn_if_open(host, api_key, admin_api_key)
    server = EngineServer(
        engine,
        model_path=model_path,
        served_model_name=served_model_name,
        weight_version=weight_version,
        guard=Guard(api_key, admin_api_key, allowed_hosts(host, extra_hosts)),
        weights_dirs=weights_dirs,
    )
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        server.host, server.port = host, int(runner.addresses[0][1])
        url = f"http://{host}:{server.port}"
        logger.info(
            "serving %s on %s (weight_version=%s, keys: %s)", model_path, url, weight_version,
            "admin+api" if admin_api_key and api_key else "admin" if admin_api_key
            else "api" if api_key else "none",
        )  # fmt: skip
        if on_ready is not None:
            on_ready(url)
        await (stop or asyncio.Event()).wait()
    finally:
        await engine.aclose()
        await runner.cleanup()
        server.weights.close()
        logger.info("server on port %d stopped", server.port)


def run_engine_server(
    engine: LocalEngine,
    *,
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    weight_version: str = "default",
    served_model_name: str | None = None,
    on_ready: Callable[[str], None] | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    extra_hosts: Iterable[str] = (),
    weights_dirs: Iterable[str | Path] = (),
) -> None:
    """Serve ``engine`` until SIGINT or SIGTERM, then shut down cleanly (see :func:`serve`)."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(
            engine,
            host=host,
            port=port,
            model_path=model_path,
            served_model_name=served_model_name,
            weight_version=weight_version,
            on_ready=on_ready,
            stop=stop,
            api_key=api_key,
            admin_api_key=admin_api_key,
            extra_hosts=extra_hosts,
            weights_dirs=weights_dirs,
        )

    asyncio.run(main())
