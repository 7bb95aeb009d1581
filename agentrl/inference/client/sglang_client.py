"""``SGLangClient``: SGLang's native HTTP API from the rollout side.

Design:

- **Token-in, token-out.** ``/generate`` gets ``input_ids`` and ``return_logprob: true`` and the
  output is read from ``output_ids`` and ``meta_info.output_token_logprobs``, never from text.
  ``max_new_tokens`` is always sent (SGLang's default is 128).
- **One aiohttp session per client** (lazily or in ``__aenter__``), with a ``ClientTimeout``.
- **Several endpoints.** The turns of one ``session_id`` stick to one endpoint (its prefix cache
  is reused); a new session goes to the healthy endpoint with the fewest requests in flight.
  Connection errors, timeouts and 5xx are retried with exponential backoff (``max_retries``
  per endpoint); then the endpoint leaves the rotation until a health check (lazy, at most every
  ``health_interval_s``) passes again, and the request moves, whole and with a new ``rid``, to
  another healthy endpoint. A 4xx or a malformed response is a :class:`ServerError` at once.
- **Faults.** While no endpoint can take a request (a restart), it waits with backoff for up to
  ``retry_s``. A request in flight for ``stall_s`` probes its endpoint; if that does not answer
  (a frozen process), the request is aborted there first, then resubmitted elsewhere. A server
  that answers the probe with 503 (paused for a weight update) is alive: the request waits.
- **Keys.** ``api_key`` goes out as ``Authorization: Bearer`` on every call but the health
  probes, ``admin_api_key`` (when set) instead on the control calls, as SGLang's
  ``--api-key`` / ``--admin-api-key`` want them (:mod:`~agentrl.inference.api_keys`).
- **Weight versions are ints here, labels in SGLang** (``sglang_api.parse_weight_version``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import aiohttp

from agentrl import fast_json
from agentrl.errors import ServerError
from agentrl.inference.api_keys import bearer, key_for
from agentrl.inference.base import GenerateOutput, SamplingParams
from agentrl.inference.client.adapters import AdapterPlane, AdapterState
from agentrl.inference.client.control import ControlPlane
from agentrl.inference.client.endpoints import (
    Active,
    Endpoint,
    EndpointPool,
    Retryable,
    Stalled,
    backoff_delay,
)
from agentrl.inference.routing_records import FLAG, from_wire
from agentrl.inference.sglang_api import (
    aborted_output,
    error_text,
    parse_generate_response,
    warn_if_truncating,
)

logger = logging.getLogger(__name__)


class SGLangClient(ControlPlane, AdapterPlane):
    """An :class:`~agentrl.inference.base.InferenceClient` for one or more SGLang servers.

    Args:
        endpoints: base URLs (``http://host:port``) of SGLang servers or ``agentrl serve``.
        timeout_s: total time one HTTP call may take (a whole generation).
        connect_timeout_s: time to open a connection.
        max_retries: retries per endpoint after a connection error, timeout or 5xx.
        retry_s: how long a request waits (with backoff) while no endpoint can take it.
        stall_s: a request in flight this long probes its endpoint; one that does not answer
            is aborted there and resubmitted to another endpoint (``None``: never).
        backoff_s: first retry delay; it doubles per retry (with jitter), capped at 5 s.
        health_interval_s: least time between health probes of an endpoint out of rotation.
        health_timeout_s: time a health probe may take.
        max_connections: connection pool size (0: unlimited).
        max_sessions: sticky session ids remembered (least recently used are forgotten).
        routed_experts_shape: ``(layers, top_k)`` of the served MoE model, to shape
            ``meta_info.routed_experts``; default: read from the endpoint's ``/model_info``
            (``agentrl serve`` reports it; SGLang does not, so pass it there).
        api_key: the servers' ``--api-key`` (the key itself, never logged).
        admin_api_key: their ``--admin-api-key``, for the control calls (default: ``api_key``).
    """

    def __init__(
        self,
        endpoints: list[str] | str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 2,
        retry_s: float = 60.0,
        stall_s: float | None = 30.0,
        backoff_s: float = 0.25,
        health_interval_s: float = 5.0,
        health_timeout_s: float = 5.0,
        max_connections: int = 1024,
        max_sessions: int = 100_000,
        routed_experts_shape: tuple[int, int] | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
    ) -> None:
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not urls:
            raise ValueError("endpoints: expected at least one URL, got none")
        if max_retries < 0:
            raise ValueError(f"max_retries: expected >= 0, got {max_retries}")
        self._pool = EndpointPool(urls, max_sessions)
        self._endpoints = self._pool.endpoints
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        self.max_retries = max_retries
        self.retry_s = retry_s
        self.stall_s = stall_s
        self.backoff_s = backoff_s
        self.health_interval_s = health_interval_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._active: dict[str, Active] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_update: tuple[str, str] | None = None
        self._routed_shape = routed_experts_shape
        self._routed_shapes: dict[str, tuple[int, int]] = {}  # read from each /model_info
        self._keys = (api_key, admin_api_key)
        self._lora = AdapterState()  # the adapter requests use (agentrl.inference.client.adapters)

    @property
    def endpoints(self) -> list[str]:
        """Every endpoint URL, in rotation or not."""
        return [ep.url for ep in self._endpoints]

    @property
    def healthy_endpoints(self) -> list[str]:
        """The endpoints in rotation now."""
        return [ep.url for ep in self._endpoints if ep.healthy]

    async def __aenter__(self) -> SGLangClient:
        self._http()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def aclose(self) -> None:
        """Stop health probes and close the HTTP session (idempotent)."""
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- transport ----------------------------------------------------------------------------

    async def _request(
        self,
        ep: Endpoint,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> bytes:
        """One HTTP call: the body on 2xx, :class:`Retryable` or :class:`ServerError` otherwise."""
        try:
            async with self._http().request(
                method,
                ep.url + path,
                json=payload,
                timeout=timeout or self._timeout,
                headers=bearer(key_for(path, *self._keys)),
            ) as resp:
                status, body = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise Retryable(f"{type(exc).__name__}: {exc}") from exc
        if status >= 500:
            raise Retryable(f"HTTP {status}: {error_text(body)}", status=status)
        if status >= 400:
            raise ServerError(
                f"{path} rejected with HTTP {status}: {error_text(body)}",
                endpoint=ep.url,
                rid=rid,
                status=status,
            )
        return body

    async def _call(
        self, ep: Endpoint, method: str, path: str, payload: dict[str, Any] | None = None
    ) -> bytes:
        """``_request`` with retries and backoff; marks the endpoint down when they run out."""
        for attempt in range(self.max_retries + 1):
            try:
                return await self._request(ep, method, path, payload)
            except Retryable as exc:
                if attempt == self.max_retries:
                    self._pool.mark_down(ep, str(exc))
                    raise ServerError(
                        f"{path} failed after {attempt + 1} tries: {exc}", endpoint=ep.url
                    ) from exc
                await asyncio.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int) -> float:
        return backoff_delay(self.backoff_s, attempt)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- endpoint health and placement ----------------------------------------------------------

    async def _probe(self, ep: Endpoint) -> bool:
        """Health-check ``ep``; bring it back (synced to the last weights pushed) if it passes."""
        ep.checking, ep.last_check = True, time.monotonic()
        try:
            await self._request(ep, "GET", "/health", timeout=self._health_timeout)
            if self._last_update is not None:
                path, label = self._last_update
                info = fast_json.loads(await self._request(ep, "GET", "/model_info"))
                if str(info.get("weight_version")) != label:
                    logger.info("endpoint %s is on old weights; pushing version %s", ep.url, label)
                    await self._update_one(ep, path, label)
        except (Retryable, ServerError, ValueError, RecursionError, AttributeError) as exc:
            logger.debug("endpoint %s still unhealthy: %s", ep.url, exc)
            return False
        finally:
            ep.checking = False
        if not ep.healthy:
            logger.info("endpoint %s back in rotation", ep.url)
        ep.healthy = True
        return True

    async def _pick(self, session_id: str | None, exclude: set[str]) -> Endpoint | None:
        """Place a request; probe endpoints out of rotation (lazily, or now if none is left)."""
        for ep in self._pool.due_for_probe(self.health_interval_s):
            self._spawn(self._probe(ep))
        best = self._pool.choose(session_id, exclude)
        if best is None:
            down = [ep for ep in self._pool.down(exclude) if not ep.checking]
            await asyncio.gather(*(self._probe(ep) for ep in down))
            best = self._pool.choose(session_id, exclude)
        return best

    # ---- InferenceClient ----------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> GenerateOutput:
        """``/generate`` with ``input_ids``; returns new ids, log-probs, per-token versions.

        ``return_routed_experts`` asks for ``routed_experts`` from row
        ``routed_experts_start_len`` on (the rows before it are -1; the server needs SGLang's
        ``--enable-return-routed-experts``); they are decoded whenever the server sends them.

        Raises:
            ServerError: a 4xx or malformed response (no retry), or no endpoint could serve the
                request within the retry budget; the message names the endpoint(s) and rid.
        """
        rid = rid if rid is not None else uuid.uuid4().hex
        if rid in self._active:
            raise ServerError(f"Duplicate request ID detected: {rid}", endpoint="client", rid=rid)
        warn_if_truncating(params)
        body = {
            "input_ids": list(input_ids),
            "sampling_params": params.to_sglang(),
            "return_logprob": True,
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
            if routed_experts_start_len:
                body["routed_experts_start_len"] = routed_experts_start_len
        active = self._active[rid] = Active(server_rid=rid)
        try:
            return await self._adapted(body, lambda: self._generate(body, rid, session_id, active))
        finally:
            del self._active[rid]

    async def _generate(
        self, body: dict[str, Any], rid: str, session_id: str | None, active: Active
    ) -> GenerateOutput:
        tried: set[str] = set()
        errors: list[str] = []
        attempt = waits = 0
        deadline: float | None = None  # the retry window opens when no endpoint is left
        while True:
            ep = await self._pick(session_id, tried)
            if ep is None:
                now = time.monotonic()
                deadline = now + self.retry_s if deadline is None else deadline
                if now >= deadline or active.aborted:
                    if active.aborted:
                        return aborted_output(rid)
                    raise ServerError(
                        f"generate failed: no healthy endpoint within retry_s={self.retry_s}"
                        + (f" ({'; '.join(errors[-3:])})" if errors else ""),
                        endpoint=", ".join(sorted(tried)) or ", ".join(self.endpoints),
                        rid=rid,
                    )
                await asyncio.sleep(min(self._backoff(waits), deadline - now))
                waits += 1
                tried.clear()  # every endpoint may be back: probe them all again
                continue
            for retry in range(self.max_retries + 1):
                if active.aborted:
                    return aborted_output(rid)
                # A re-sent request gets a new rid: the old one may still be open on the server.
                active.server_rid = rid if attempt == 0 else f"{rid}-retry{attempt}"
                attempt += 1
                active.endpoint = ep
                ep.in_flight += 1
                try:
                    raw = await self._post_generate(ep, {**body, "rid": active.server_rid})
                except Stalled as exc:
                    errors.append(f"{ep.url} rid={active.server_rid}: {exc}")
                    break  # aborted there already; the endpoint is out of rotation
                except Retryable as exc:
                    errors.append(f"{ep.url} rid={active.server_rid}: {exc}")
                    self._spawn(self._abort_quietly(ep, active.server_rid))
                    if retry < self.max_retries:
                        await asyncio.sleep(self._backoff(retry))
                    continue
                finally:
                    ep.in_flight -= 1
                    active.endpoint = None
                try:
                    data = fast_json.loads(raw)
                except (ValueError, RecursionError):
                    raise ServerError(
                        f"malformed /generate response: not JSON: {raw[:200]!r}",
                        endpoint=ep.url,
                        rid=active.server_rid,
                        status=200,
                    ) from None
                out = parse_generate_response(
                    data, endpoint=ep.url, server_rid=active.server_rid, rid=rid
                )
                return await self._routed(ep, data["meta_info"], out, body)
            self._pool.mark_down(ep, errors[-1])
            tried.add(ep.url)

    async def _routed(
        self, ep: Endpoint, meta: dict[str, Any], out: GenerateOutput, body: dict[str, Any]
    ) -> GenerateOutput:
        """``out`` with ``meta_info.routed_experts`` decoded (the rows ``body`` asked for).

        A response to a request that asked, without them, is malformed (unless aborted).
        """
        asked = body.get("return_routed_experts", False)
        start = body.get("routed_experts_start_len", 0) if asked else None
        text = meta.get("routed_experts")
        if text is None and (start is None or out.finish_reason == "abort"):
            return out  # (an aborted request may come back without them)
        shape = self._routed_shape or self._routed_shapes.get(ep.url)
        if shape is None and isinstance(text, str):
            try:  # agentrl serve reports the shape; SGLang does not (pass it to the client)
                info = json.loads(await self._request(ep, "GET", "/model_info"))
                layers, top_k = info["routed_experts_shape"]
                shape = self._routed_shapes[ep.url] = (int(layers), int(top_k))
            except (Retryable, ServerError, ValueError, TypeError, KeyError, RecursionError):
                pass
        try:
            if not isinstance(text, str):
                raise ValueError(f"expected base64 text (is the server started with {FLAG}?)")
            if shape is None:
                raise ValueError("(layers, top_k) unknown: pass SGLangClient(routed_experts_shape)")
            rows = out.prompt_tokens + len(out.output_ids) - 1
            out.routed_experts = from_wire(text, rows, shape, start=start or 0)
        except ValueError as exc:
            raise ServerError(
                f"malformed /generate response: meta_info.routed_experts: {exc}",
                endpoint=ep.url,
                rid=out.meta.get("server_rid"),
                status=200,
            ) from None
        return out

    async def _post_generate(self, ep: Endpoint, payload: dict[str, Any]) -> bytes:
        """``/generate`` on ``ep``, watched for stalls (see the module docstring).

        Raises:
            Stalled: ``ep`` stopped answering; the request was aborted there first.
        """
        rid = payload["rid"]
        call = self._request(ep, "POST", "/generate", payload, rid=rid)
        if self.stall_s is None:
            return await call
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.stall_s)
                if done:
                    return task.result()
                if await self._answers(ep):
                    continue  # busy, not stalled: a long generation is fine
                self._pool.mark_down(ep, f"no answer for {self.stall_s} s")
                await self._abort_quietly(ep, rid)
                raise Stalled(f"no progress for {self.stall_s} s and the endpoint does not answer")
        finally:
            if not task.done():
                task.cancel()  # (closing the connection makes the server abort it too)
                await asyncio.gather(task, return_exceptions=True)

    async def _answers(self, ep: Endpoint) -> bool:  # within the health timeout
        try:
            await self._request(ep, "GET", "/health", timeout=self._health_timeout)
        except Retryable as exc:
            return exc.status == 503  # up, but paused (a weight update): not stalled
        except ServerError:
            return False
        return True

    async def _abort_quietly(self, ep: Endpoint, server_rid: str) -> None:
        """Best effort: a request that timed out may still run on the server."""
        try:
            await self._request(
                ep, "POST", "/abort_request", {"rid": server_rid}, timeout=self._health_timeout
            )
        except (Retryable, ServerError):
            pass

    async def abort(self, rid: str | None = None) -> None:
        """Abort ``rid`` (wherever it runs now), or every request on every endpoint.

        The aborted ``generate`` returns its partial output with ``finish_reason == "abort"``;
        it may also finish normally first (the race SGLang has too).
        """
        if rid is None:
            for active in self._active.values():
                active.aborted = True
            try:
                await self._broadcast("/abort_request", {"abort_all": True})
            except ServerError as exc:
                if exc.status is not None:
                    raise
                logger.warning("abort_all reached no endpoint: %s", exc)  # nothing runs there
            return
        target = self._active.get(rid)
        if target is None:
            return
        target.aborted = True
        if target.endpoint is not None:
            try:
                await self._call(
                    target.endpoint, "POST", "/abort_request", {"rid": target.server_rid}
                )
            except ServerError as exc:  # a dead endpoint fails the generate itself
                logger.debug("abort of %s not delivered: %s", rid, exc)

    async def health(self) -> bool:
        """Probe every endpoint now; True if at least one is in rotation afterwards."""
        results = await asyncio.gather(*(self._probe(ep) for ep in self._endpoints))
        for ep, ok in zip(self._endpoints, results, strict=True):
            if not ok:
                self._pool.mark_down(ep, "health check failed")
        return any(results)

    async def _get_json(self, path: str) -> Any:
        ep = await self._pick(None, set())
        if ep is None:
            raise ServerError(f"{path}: no healthy endpoint", endpoint=", ".join(self.endpoints))
        raw = await self._call(ep, "GET", path)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise ServerError(
                f"malformed {path} response: {raw[:200]!r}", endpoint=ep.url
            ) from None

    async def model_info(self) -> dict[str, Any]:
        """``/model_info`` of a healthy endpoint (includes the live ``weight_version``)."""
        info = await self._get_json("/model_info")
        if not isinstance(info, dict):
            raise ServerError(f"malformed /model_info response: {info!r}", endpoint="")
        return info

    async def max_model_len(self) -> int:
        """The context length from ``/v1/models``."""
        models = await self._get_json("/v1/models")
        try:
            return int(models["data"][0]["max_model_len"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise ServerError(f"malformed /v1/models response: {models!r}", endpoint="") from None
