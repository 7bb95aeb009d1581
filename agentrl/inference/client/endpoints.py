"""Endpoint bookkeeping of :class:`~agentrl.inference.client.sglang_client.SGLangClient`.

Which endpoints are in rotation, which session sticks to which endpoint, where a new request
goes (the healthy endpoint with the fewest requests in flight), and the backoff between tries.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger("agentrl.inference.client.sglang_client")


def backoff_delay(first_s: float, attempt: int, cap_s: float = 5.0) -> float:
    """``first_s * 2**attempt`` capped at ``cap_s``, with +-20% jitter (so retries spread out)."""
    return min(cap_s, first_s * 2**attempt) * random.uniform(0.8, 1.2)


MAX_ENDPOINTS = 1024
"""The most endpoints one config may name (checked before the text is split)."""
MAX_URL_CHARS = 2048


def parse_endpoints(value: Any) -> list[str]:
    """Base URLs from a list, a JSON list (``'["http://a:1"]'``) or a comma list of URLs.

    Each must be ``http(s)://HOST[:PORT][/PATH]``; a trailing ``/`` is dropped.

    Raises:
        ValueError: one line naming the malformed entry and what is expected.
    """
    if isinstance(value, str):
        if len(value) > MAX_ENDPOINTS * (MAX_URL_CHARS + 1):
            raise ValueError(f"expected at most {MAX_ENDPOINTS} URLs, got {len(value)} characters")
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not a valid JSON list of URLs ({e.msg} at {e.pos})") from None
        else:
            value = [] if not text else [u.strip() for u in text.split(",")]
    if not isinstance(value, (list, tuple)):
        raise ValueError("expected a URL, a comma list or a list of URLs")
    if len(value) > MAX_ENDPOINTS:
        raise ValueError(f"expected at most {MAX_ENDPOINTS} URLs, got {len(value)}")
    return [
        _checked_url(u, f"entry {i + 1} {u!r:.100}: " if len(value) > 1 else "")
        for i, u in enumerate(value)
    ]


def _checked_url(url: Any, which: str) -> str:
    want = f"{which}expected http://HOST:PORT (or https://)"
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise ValueError(want)
    try:
        parts = urlsplit(url)
        port = parts.port  # a port that is not a number in 0..65535 raises ValueError
    except ValueError:
        raise ValueError(f"{want}: bad port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise ValueError(want)
    if parts.query or parts.fragment or any(c.isspace() for c in url):
        raise ValueError(f"{want}, with no query, fragment or spaces")
    return url.rstrip("/")


@dataclass
class Endpoint:
    """One server: its URL, requests in flight, and whether it is in rotation."""

    url: str
    in_flight: int = 0
    healthy: bool = True
    last_check: float = 0.0
    checking: bool = False


@dataclass
class Active:
    """A generate call in progress: where it runs now, under which server-side rid."""

    server_rid: str
    endpoint: Endpoint | None = None
    aborted: bool = False


class Retryable(Exception):
    """A connection error, timeout or 5xx: worth another try.

    Args:
        message: what happened.
        status: the HTTP status of a 5xx (``None``: no answer at all).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Stalled(Retryable):
    """A request made no progress for ``stall_s`` on an endpoint that stopped answering."""


class EndpointPool:
    """The endpoints, their rotation flags and sticky sessions; placement by fewest in flight."""

    def __init__(self, urls: list[str], max_sessions: int) -> None:
        self.endpoints = [Endpoint(url.rstrip("/")) for url in urls]
        self._sessions: OrderedDict[str, Endpoint] = OrderedDict()
        self._max_sessions = max_sessions
        self._rr = 0

    def healthy(self, exclude: set[str]) -> list[Endpoint]:
        """The endpoints in rotation, less ``exclude``."""
        return [ep for ep in self.endpoints if ep.healthy and ep.url not in exclude]

    def down(self, exclude: set[str]) -> list[Endpoint]:
        """The endpoints out of rotation, less ``exclude``."""
        return [ep for ep in self.endpoints if not ep.healthy and ep.url not in exclude]

    def mark_down(self, ep: Endpoint, why: str) -> None:
        """Take ``ep`` out of rotation (logged once per outage)."""
        if ep.healthy:
            logger.warning("endpoint %s out of rotation: %s", ep.url, why)
        ep.healthy = False
        ep.last_check = time.monotonic()

    def due_for_probe(self, interval_s: float) -> list[Endpoint]:
        """Endpoints out of rotation whose last probe is ``interval_s`` old."""
        now = time.monotonic()
        return [
            ep
            for ep in self.endpoints
            if not ep.healthy and not ep.checking and now - ep.last_check >= interval_s
        ]

    def choose(self, session_id: str | None, exclude: set[str]) -> Endpoint | None:
        """The session's endpoint if it is usable, else the least-loaded healthy one."""
        sticky = self._sessions.get(session_id) if session_id is not None else None
        if session_id is not None and sticky is not None:
            if sticky.healthy and sticky.url not in exclude:
                self._sessions.move_to_end(session_id)
                return sticky
        candidates = self.healthy(exclude)
        if not candidates:
            return None
        start = self._rr % len(candidates)  # ties go round-robin
        self._rr += 1
        best = min(candidates[start:] + candidates[:start], key=lambda ep: ep.in_flight)
        if session_id is not None:
            self._sessions[session_id] = best
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return best
