"""One error model for agentrl.

Every error the toolkit raises derives from :class:`AgentRLError`; the flat subclasses are named
after the boundary that was crossed. A failed rollout is *data*: the rollout engine records the
error type and message on the trajectory and counts it, it never cancels sibling episodes.
"""

from __future__ import annotations


class AgentRLError(Exception):
    """Base class of every error raised by agentrl."""


class ConfigError(AgentRLError, ValueError):
    """A config, task or argument did not validate; the message names the field."""


class EnvError(AgentRLError):
    """An environment broke its contract (bad return type, step after done, ...)."""


class ServerError(AgentRLError):
    """An inference endpoint failed or answered with something malformed.

    Attributes:
        message: what failed, without the ``[endpoint=... rid=...]`` that ``str()`` adds.
        endpoint: the base URL (or ``"local"``) that failed.
        rid: the request id involved, if any.
        status: the HTTP status, if there was one.
    """

    def __init__(
        self, message: str, *, endpoint: str = "", rid: str | None = None, status: int | None = None
    ) -> None:
        where = f" [endpoint={endpoint}" + (f" rid={rid}" if rid else "") + "]" if endpoint else ""
        super().__init__(message + where)
        self.message = message
        self.endpoint = endpoint
        self.rid = rid
        self.status = status


class VerifierError(AgentRLError):
    """A verifier itself failed (not the model's answer: bad answers score 0 with a reason)."""


class TrainingError(AgentRLError):
    """A run stopped because it could not learn (e.g. most episodes kept failing)."""
