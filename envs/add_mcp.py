"""``add-mcp-v0``: ``add-tool-v0`` with its ``add`` tool served by an MCP server over stdio.

The tasks, demonstrations, tool-call text and scoring are ``add-tool-v0``'s, and the server
(:mod:`agentrl.envs.mcp_add_server`, written with the ``mcp`` SDK) answers ``add`` with the same
text, so a model sees the very conversations of ``add-tool-v0``; only the tool's transport
differs. One server serves the whole run (see :mod:`agentrl.mcp_client`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.envs.add_tool import AddToolEnv
from agentrl.mcp_tools import MCPToolEnv

SERVER = str(Path(__file__).with_name("mcp_add_server.py"))
"""The server script; run with ``-P`` so that this folder (which has a ``math.py``) does not
shadow the standard library."""


def server_command() -> list[str]:
    """The stdio command of the ``add`` server, in this interpreter."""
    return [sys.executable, "-P", SERVER]


class AddMCPEnv(MCPToolEnv, AddToolEnv):
    """``add-tool-v0`` whose ``add`` comes from an MCP server (by default the bundled one).

    Args:
        mcp_server: the server's command or URL (default: :func:`server_command`).
        **kwargs: :class:`~agentrl.mcp_tools.MCPToolEnv`'s and ``add-tool-v0``'s options.
    """

    def __init__(self, *, mcp_server: str | Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(mcp_server=mcp_server or server_command(), **kwargs)
