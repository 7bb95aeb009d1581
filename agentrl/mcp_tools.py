"""Tools from an MCP server: a :class:`~agentrl.env.ToolEnv` whose tools a server provides.

:class:`MCPToolEnv` lists the server's tools (name, description, input schema) as its
:attr:`~agentrl.env.Env.tools`, so :func:`~agentrl.env.describe_tools` and :meth:`tool_schemas`
put them in a system prompt or a chat template's ``tools``; the agent's calls go to the server.
What each failure becomes:

- the tool failed (an ``isError`` result, a protocol error for the call, an unknown tool): a
  tool message ``error: MCPToolError: ...``; the episode goes on and ``tool_errors`` counts it
  (as a Python tool that raises, in :class:`~agentrl.env.ToolEnv`);
- the call took longer than ``tool_timeout_s``: a tool message ``error: MCPToolTimeout: tool
  'x' took longer than 2 s``; the episode goes on (the agent may retry or answer);
- the server died or broke the protocol: :class:`~agentrl.mcp_client.MCPServerDied`, an
  :class:`~agentrl.errors.EnvError`, is the episode's error (recorded as data); the shared
  server is restarted for the next episode;
- the server does not start or list its tools in ``start_timeout_s``: the same, from ``reset``.

Bounds: a result is cut to ``max_result_chars`` before it becomes a message, a call to
``tool_timeout_s``, the tool list to ``max_tools`` (more is an error: tools silently dropped
would train an agent on a different task), descriptions to 1024 characters, schemas to 8192.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from agentrl.env import StepResult, Tool, ToolEnv
from agentrl.errors import EnvError
from agentrl.mcp_client import (
    Limits,
    MCPConnection,
    MCPServerDied,
    MCPServerSpec,
    MCPToolError,
    shared_connection,
)
from agentrl.types import Message, Task


def result_text(result: Any, max_chars: int) -> str:
    """A ``CallToolResult``'s content as text, cut to ``max_chars``.

    Text blocks are joined by newlines; other blocks show as ``[image]``, ``[resource]``...;
    a result with no content but structured content shows that as JSON.
    """
    parts: list[str] = []
    size = 0
    for block in result.content:
        text = block.text if getattr(block, "type", None) == "text" else f"[{block.type}]"
        parts.append(text)
        size += len(text)
        if size > max_chars:
            break
    text = "\n".join(parts)
    if not parts and result.structured_content is not None:
        text = json.dumps(result.structured_content)[: max_chars + 1]
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n[truncated to {max_chars} characters]"
    return text


def _as_tool(
    listed: Any, conn: MCPConnection, limits: Limits, timeout_s: float, max_result_chars: int
) -> Tool:
    schema = listed.input_schema or {"type": "object"}
    if len(json.dumps(schema)) > limits.max_schema_chars:
        raise MCPServerDied(
            f"MCP server {conn.spec}: tool {listed.name!r} has an input schema over "
            f"{limits.max_schema_chars} characters"
        )
    description = (listed.description or "")[: limits.max_description_chars]

    async def call(**arguments: Any) -> str:
        result = await conn.call(listed.name, arguments, timeout_s)
        text = result_text(result, max_result_chars)
        if result.is_error:
            raise MCPToolError(text)
        return text

    return Tool(listed.name, description, call, schema)


class MCPToolEnv(ToolEnv):
    """A :class:`~agentrl.env.ToolEnv` whose :attr:`tools` come from an MCP server.

    Subclass it as any ToolEnv (``prompt`` and ``score``); put it first among the bases to
    give an existing ToolEnv the server's tools. The tools are listed at the first ``reset``.

    Args:
        mcp_server: the server: a command (a list, or a shell-quoted string) started over
            stdio, or an ``http(s)://`` URL of a streamable-HTTP server.
        mcp_env: environment variables for a started server (besides PATH, HOME and the like).
        mcp_shared: one server per (command or URL) for the whole run (the default: a stdio
            server takes ~0.5 s to start, a call ~1 ms), or False for one per env instance
            (tools with per-episode state), started at ``reset`` and stopped at ``close``.
        tool_timeout_s: the longest a tool call may take.
        max_result_chars: a tool's output is cut to this many characters.
        max_tools: the most tools a server may list.
        start_timeout_s: the longest a server may take to start and list its tools.
        **kwargs: for the next base class (e.g. ``system_prompt``).
    """

    def __init__(
        self,
        *,
        mcp_server: str | Sequence[str],
        mcp_env: dict[str, str] | None = None,
        mcp_shared: bool = True,
        tool_timeout_s: float = 10.0,
        max_result_chars: int = 4096,
        max_tools: int = 64,
        start_timeout_s: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if tool_timeout_s <= 0 or max_result_chars < 1 or max_tools < 1 or start_timeout_s <= 0:
            raise EnvError(
                "MCPToolEnv: tool_timeout_s, max_result_chars, max_tools and start_timeout_s "
                "must be positive"
            )
        self.mcp_spec = MCPServerSpec.parse(mcp_server, mcp_env)
        self.mcp_shared = mcp_shared
        self.tool_timeout_s = tool_timeout_s
        self.max_result_chars = max_result_chars
        self.limits = Limits(start_timeout_s=start_timeout_s, max_tools=max_tools)
        self.tools: list[Tool] = []
        self._conn: MCPConnection | None = None

    async def connect(self) -> list[Tool]:
        """Start (or reuse) the server and list its tools as :attr:`tools`.

        Raises:
            MCPServerDied: the server did not start, or listed tools beyond the bounds.
        """
        conn = self._conn
        if conn is None or not conn.alive:
            if conn is not None and not self.mcp_shared:
                await asyncio.to_thread(conn.close)
            conn = (
                shared_connection(self.mcp_spec, self.limits)
                if self.mcp_shared
                else MCPConnection(self.mcp_spec, self.limits)
            )
            self._conn = conn
        listed = await conn.ready()
        self.tools = [
            _as_tool(t, conn, self.limits, self.tool_timeout_s, self.max_result_chars)
            for t in listed
        ]
        return self.tools

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools in the OpenAI/Hugging Face form a chat template's ``tools`` takes."""
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description,
                             "parameters": t.parameters},
            }
            for t in self.tools
        ]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Connect (the first time, or after the server died), then start the episode."""
        await self.connect()
        return await super().reset(task, seed=seed)

    async def step(self, action: str) -> StepResult:
        """As :meth:`ToolEnv.step`; a server that died during a call fails the episode."""
        result = await super().step(action)
        conn = self._conn
        if result.info.get("tool_calls") and conn is not None and conn.error is not None:
            raise MCPServerDied(f"MCP server {conn.spec}: {conn.error}")
        return result

    async def close(self) -> None:
        """Stop the env's own server (``mcp_shared=False``); a shared one runs on."""
        conn, self._conn = self._conn, None
        if conn is not None and not self.mcp_shared:
            await asyncio.to_thread(conn.close)
