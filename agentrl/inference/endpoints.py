"""Endpoint bookkeeping of :class:`~agentrl.inference.client.SGLangClient`.

Which endpoints are in rotation, which session sticks to which endpoint, where a new request
goes (the healthy endpoint with the fewest requests in flight), and the backoff between tries.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger("agentrl.inference.client")


def backoff_delay(first_s: float, attempt: int, cap_s: float = 5.0) -> float:
    """``first_s * 2**attempt`` capped at ``cap_s``, with +-20% jitter (so retries spread out)."""
    return min(cap_s, first_s * 2**attempt) * random.uniform(0.8, 1.2)


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
