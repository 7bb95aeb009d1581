"""API keys of ``agentrl serve`` and of the client: where a key comes from, how one is checked.

SGLang's semantics (``--api-key`` / ``--admin-api-key``, ``Authorization: Bearer <key>``):

- ``/health*``, ``/ready*`` and ``/metrics*`` need no key (probes carry no secrets).
- The admin routes (:data:`ADMIN_ROUTES`: weights, LoRA adapters, pause, continue, abort, flush)
  want the admin key when one is set (the API key is then refused), else the API key when one is
  set, else none.
- Every other route wants the API key when one is set (the admin key does not stand in for it),
  else none.

A key is given as ``env:NAME`` (the value of environment variable ``NAME``), ``file:PATH`` (the
file's text, stripped) or, on the command line only, the key itself. References keep keys out of
argv (``ps``), configs saved in run directories, and logs; nothing here logs a key.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

ADMIN_ROUTES = frozenset(
    {
        "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
        "/update_weights_from_disk", "/update_weights_from_tensor",
        "/update_weights_from_distributed", "/init_weights_update_group",
        "/destroy_weights_update_group", "/update_weight_version",
        "/release_memory_occupation", "/resume_memory_occupation",
        "/load_lora_adapter", "/unload_lora_adapter",
    }
)  # fmt: skip
"""Routes that change what the server serves or abort others' requests (SGLang's admin level)."""

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Routes that need no key (SGLang matches these by prefix too)."""


def is_reference(spec: str) -> bool:
    """Whether ``spec`` says where a key is (``env:NAME`` / ``file:PATH``) not the key itself."""
    return spec.startswith(("env:", "file:"))


def read_key(spec: str | None, what: str) -> str | None:
    """The key ``spec`` stands for (``env:NAME``, ``file:PATH`` or the key itself), or ``None``.

    Raises:
        ValueError: one line naming ``what`` and the variable or file, never the key.
    """
    if spec is None:
        return None
    if spec.startswith("env:"):
        name = spec[4:]
        value = os.environ.get(name, "")
        if not value.strip():
            raise ValueError(f"{what}: environment variable {name!r} is not set or empty")
    elif spec.startswith("file:"):
        path = Path(spec[5:]).expanduser()
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"{what}: cannot read key file {str(path)!r}: {why}") from None
        if not value.strip():
            raise ValueError(f"{what}: key file {str(path)!r} is empty")
    else:
        value = spec
    key = value.strip()
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError(f"{what}: a key must be non-empty printable text without spaces")
    return key


def bearer(key: str | None) -> dict[str, str]:
    """The ``Authorization`` header that presents ``key`` (none when there is no key)."""
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def presented(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: ``Authorization: Bearer K`` (or SGLang's ``x-api-key: K``)."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return token.strip()
    return headers.get("x-api-key") or None


def key_for(path: str, api_key: str | None, admin_api_key: str | None) -> str | None:
    """The key a request to ``path`` must present (``None``: no key needed)."""
    if path.startswith(OPEN_PREFIXES):
        return None
    if path in ADMIN_ROUTES:
        return admin_api_key or api_key
    return api_key


def matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison (a timing side channel must not spell the key out)."""
    return given is not None and secrets.compare_digest(given.encode(), expected.encode())
