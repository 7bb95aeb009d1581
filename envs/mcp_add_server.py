"""An MCP server (written with the ``mcp`` SDK) whose ``add`` tool is ``add-tool-v0``'s.

``add-mcp-v0`` starts it over stdio, one per run; it is also the worked example of
docs/envs.md ("Tools from an MCP server"):

.. code-block:: text

    python -m agentrl.envs.mcp_add_server                      # stdio (what the env starts)
    python -m agentrl.envs.mcp_add_server --http 8765          # streamable HTTP on loopback
    python -m agentrl.envs.mcp_add_server --test-tools         # + slow, fail, big (the tests')

``add`` answers exactly as ``add-tool-v0``'s Python tool does (the sum as plain digits), so a
model trained on either sees the same tool output.
"""

from __future__ import annotations

import argparse
import asyncio
import re

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

_INT = re.compile(r"-?\d+")


def _integer(name: str, v: int | str) -> int:
    if isinstance(v, str) and _INT.fullmatch(v.strip()):
        return int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ToolError(f"{name}: expected an integer, got {v!r}")  # the model sees it
    return v


def build(test_tools: bool = False) -> MCPServer:
    """The server: ``add``, plus ``slow``/``fail``/``big`` for the tests when asked."""
    server = MCPServer("agentrl-add", log_level="WARNING")

    @server.tool(description="a + b for two integers")
    def add(a: int | str, b: int | str) -> str:
        return str(_integer("a", a) + _integer("b", b))

    if test_tools:

        @server.tool(description="sleep for `seconds`, then say so")
        async def slow(seconds: float) -> str:
            await asyncio.sleep(min(seconds, 60.0))
            return f"slept {seconds}"

        @server.tool(description="always fails")
        def fail(reason: str = "asked to") -> str:
            raise ToolError(f"failed: {reason}")

        @server.tool(description="a text of `n` characters")
        def big(n: int) -> str:
            return "x" * min(n, 10_000_000)

    return server


def main(argv: list[str] | None = None) -> None:
    """Serve over stdio, or over streamable HTTP on loopback with ``--http PORT``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http", type=int, default=None, help="serve streamable HTTP on this port")
    ap.add_argument("--test-tools", action="store_true", help="add the tests' slow/fail/big tools")
    args = ap.parse_args(argv)
    server = build(args.test_tools)
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
