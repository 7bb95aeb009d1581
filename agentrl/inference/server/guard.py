"""Who may talk to ``agentrl serve``: keys, ``Host`` and ``Origin``, and JSON-only state changes.

One aiohttp middleware (:meth:`Guard.middleware`) answers every request before a handler runs,
in this order:

1. ``Host`` names a host this server does not answer to: 421. Allowed: ``localhost``,
   ``127.0.0.1``, ``[::1]``, the bind address, this machine's host names when bound beyond
   loopback, any IP literal, and ``--allowed-hosts``; ``--allowed-hosts '*'`` turns the check
   off (behind a reverse proxy). A web page can only send a *name* it controls (DNS rebinding),
   never another host's IP literal, which is why IP literals pass.
2. ``Origin`` present and foreign (a browser page of another site): 403.
3. Keys, as SGLang's (:mod:`agentrl.inference.api_keys`): a missing or wrong key is a 401.
4. A ``POST``/``PUT`` with a body must say ``Content-Type: application/json``: 415 (a
   ``text/plain`` form post needs no CORS preflight, so a browser could send one anywhere).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from aiohttp import web

from agentrl.inference.api_keys import key_for, matches, presented

logger = logging.getLogger(__name__)

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def hostname(value: str) -> str:
    """The host of a ``Host`` header value (``[::1]:80`` -> ``::1``), lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:  # host:port (a bare IPv6 address has several colons)
        value = value.partition(":")[0]
    return value.rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine."""
    name = hostname(host) if host else ""
    if name in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The host names a request's ``Host`` may carry; ``None`` when ``extra`` holds ``*``."""
    names = set(LOOPBACK_NAMES)
    for item in extra:
        for part in item.split(","):
            if part.strip() == "*":
                return None
            if part.strip():
                names.add(hostname(part))
    if bind_host not in _WILDCARDS:
        names.add(hostname(bind_host))
    if not is_loopback(bind_host):  # reachable from outside: by this machine's names too
        for name in (socket.gethostname(), socket.getfqdn()):
            names.add(name.lower().rstrip("."))
    return frozenset(names)


def warn_if_open(host: str, api_key: str | None, admin_api_key: str | None) -> None:
    """Warn when a server reachable from other machines takes state changes without a key."""
    if is_loopback(host) or api_key or admin_api_key:
        return
    logger.warning(
        "serving on %s without --api-key or --admin-api-key: anyone who can reach this port can "
        "generate, pause or abort requests and replace the weights; set keys (env:NAME or "
        "file:PATH keeps them out of argv) or bind 127.0.0.1",
        host or "every interface",
    )


@dataclass(frozen=True)
class Guard:
    """The checks every request passes before a handler runs (see the module docstring).

    Args:
        api_key: the key of every keyed route (``None``: those routes are open).
        admin_api_key: the key of the admin routes (``None``: they take ``api_key``).
        hosts: the allowed ``Host`` names (:func:`allowed_hosts`); ``None``: any.
    """

    api_key: str | None = None
    admin_api_key: str | None = None
    hosts: frozenset[str] | None = field(default=LOOPBACK_NAMES)

    def host_ok(self, value: str | None) -> bool:
        """Whether a ``Host`` (or an ``Origin``'s host) names this server."""
        if self.hosts is None or value is None:
            return True
        name = hostname(value)
        if name in self.hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def refusal(self, request: web.Request) -> web.Response | None:
        """The response that refuses ``request``, or ``None`` to let it through."""
        host = request.headers.get("Host")
        if not self.host_ok(host):
            return _error(f"Host {host!r} is not a name of this server (--allowed-hosts)", 421)
        origin = request.headers.get("Origin")
        if origin is not None:
            origin_host = urlsplit(origin).hostname if "://" in origin else None
            if origin_host is None or not self.host_ok(origin_host):
                return _error(f"Origin {origin!r} may not use this server", 403)
        expected = key_for(request.path, self.api_key, self.admin_api_key)
        if expected is not None and not matches(presented(request.headers), expected):
            admin = expected is self.admin_api_key and self.admin_api_key is not None
            which = "the admin API key" if admin else "the API key"
            response = _error(
                f"Unauthorized: {request.path} needs {which} (Authorization: Bearer <key>)", 401
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if request.method in ("POST", "PUT") and _has_body(request):
            if request.content_type != "application/json":
                return _error(
                    f"Unsupported Media Type: {request.method} {request.path} needs "
                    f"Content-Type: application/json, got {request.content_type!r}",
                    415,
                )
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The middleware: refuse before the handler reads the body."""
        refused = self.refusal(request)
        return refused if refused is not None else await handler(request)


def _has_body(request: web.Request) -> bool:
    length = request.content_length
    return (length is not None and length > 0) or "chunked" in request.headers.get(
        "Transfer-Encoding", ""
    ).lower()
