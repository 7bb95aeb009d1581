"""OpenEnv environments as agentrl envs: ``env.id = "openenv:<URL or module:Class>"``.

`OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ (``openenv-core``) environments take a typed
action and return an observation with ``reward`` and ``done``. :class:`OpenEnvEnv` maps one
episode onto them: the assistant's text fills the action's one text field, the observation
becomes a user message, ``reward`` is the turn's reward (``None`` is 0) and ``done`` ends the
episode as terminated (OpenEnv has no truncation flag; ``rollout.max_turns`` truncates).

Two targets:

- ``openenv:http://host:port`` (``https``/``ws``/``wss`` too): a served env, driven through
  openenv-core's own async client (``GenericEnvClient``), one WebSocket per episode, so one
  server-side session per episode (the server's ``max_concurrent_envs`` must allow as many
  as run at once). Frames over ``max_message_bytes`` are refused before they are parsed.
- ``openenv:package.module:ClassName``: the ``Environment`` class, run in this process, one
  instance per episode (sync ``reset``/``step`` in a thread of the env pool). A class that does
  not declare ``SUPPORTS_CONCURRENT_SESSIONS`` runs one episode at a time, as its server would.

Any failure (server down, killed mid-episode, a protocol error, a bad reward) raises
:class:`EnvError` with one line naming the target, which the rollout engine records as the
episode's error; ``close`` always ends the session.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import math
import random
import threading
from typing import Any, ClassVar

from agentrl.env import Env, StepResult
from agentrl.errors import ConfigError, EnvError
from agentrl.types import Message, Task

PREFIX = "openenv:"
_URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
_NOT_TEXT = frozenset({"metadata"})
_MAX_SCHEMA_BYTES = 1 << 20


def require_openenv() -> None:
    """Raise a one-line :class:`ConfigError` naming the extra when openenv-core is missing."""
    if importlib.util.find_spec("openenv") is None:
        raise ConfigError(
            "openenv: env ids need openenv-core; install it with pip install 'agentrl[openenv]'"
        )


def pick_text_field(schema: dict[str, Any], where: str) -> str:
    """The action's one text field: its only required string field, else its only string field.

    Raises:
        ConfigError: none or several; the message lists them and names ``action_field``.
    """
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k not in _NOT_TEXT}
    text = [k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"]
    required = [k for k in text if k in (schema.get("required") or [])]
    for found in (required, text):
        if len(found) == 1:
            return found[0]
    raise ConfigError(
        f"{where}: cannot tell which action field takes the agent's text (fields: "
        f"{sorted(props)}); set env.kwargs.action_field"
    )


def observation_text(obs: dict[str, Any], field: str | None, where: str) -> str:
    """The text of an observation dict: ``field``, else its only string value, else its JSON."""
    if field is not None:
        if field not in obs:
            raise EnvError(f"{where}: observation has no field {field!r} (has {sorted(obs)})")
        value = obs[field]
        return value if isinstance(value, str) else json.dumps(value, default=str)
    strings = [v for v in obs.values() if isinstance(v, str)]
    if len(strings) == 1:
        return strings[0]
    return json.dumps(obs, sort_keys=True, default=str)


def checked_reward(reward: Any, where: str) -> float:
    """OpenEnv's ``reward`` (``None``, bool, int or float) as a finite float."""
    if reward is None:
        return 0.0
    if not isinstance(reward, (bool, int, float)) or not math.isfinite(float(reward)):
        raise EnvError(f"{where}: reward must be a finite number or null, got {reward!r:.100}")
    return float(reward)


class _Remote:
    """One WebSocket session on a served env (openenv-core's async ``GenericEnvClient``)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float,
        message_timeout_s: float,
        max_message_bytes: int,
    ) -> None:
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(
            base_url=url,
            connect_timeout_s=connect_timeout_s,
            message_timeout_s=message_timeout_s,
            max_message_size_mb=max_message_bytes / (1024 * 1024),
        )

    async def reset(self, **kwargs: Any) -> tuple[dict[str, Any], Any, bool]:
        r = await self.client.reset(**kwargs)
        return r.observation, r.reward, r.done

    async def step(self, action: dict[str, Any]) -> tuple[dict[str, Any], Any, bool]:
        r = await self.client.step(action)
        return r.observation, r.reward, r.done

    async def close(self) -> None:
        await self.client.close()


_LIVE: dict[type, int] = {}
_LIVE_LOCK = threading.Lock()


class _Local:
    """One in-process instance of an ``Environment`` class (sync calls run in the env pool)."""

    def __init__(self, cls: type[Any], action_cls: type[Any]) -> None:
        from openenv.core.env_server.interfaces import Environment

        self.cls, self.action_cls, self.base = cls, action_cls, Environment
        with _LIVE_LOCK:
            if _LIVE.get(cls, 0) and not getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
                raise EnvError(
                    f"{cls.__name__} does not set SUPPORTS_CONCURRENT_SESSIONS, and an episode "
                    "on it is running; serve it, or run one episode at a time"
                )
            _LIVE[cls] = _LIVE.get(cls, 0) + 1
        self.env: Any = None

    def _result(self, obs: Any) -> tuple[dict[str, Any], Any, bool]:
        from openenv.core.env_server.serialization import serialize_observation

        data = serialize_observation(obs)  # the dict a server would send
        return data["observation"], data["reward"], bool(data["done"])

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        from agentrl.rollout.env_pool import run_sync

        if getattr(type(self.env), f"{name}_async") is not getattr(self.base, f"{name}_async"):
            return await getattr(self.env, f"{name}_async")(*args, **kwargs)
        return await run_sync(getattr(self.env, name), *args, **kwargs)

    async def reset(self, **kwargs: Any) -> tuple[dict[str, Any], Any, bool]:
        if self.env is None:
            from agentrl.rollout.env_pool import run_sync

            self.env = await run_sync(self.cls)
        return self._result(await self._call("reset", **kwargs))

    async def step(self, action: dict[str, Any]) -> tuple[dict[str, Any], Any, bool]:
        return self._result(await self._call("step", self.action_cls(**action)))

    async def close(self) -> None:
        from agentrl.rollout.env_pool import run_sync

        try:
            if self.env is not None:
                await run_sync(self.env.close)
        finally:
            self.env = None
            with _LIVE_LOCK:
                _LIVE[self.cls] -= 1


def _load_class(target: str) -> tuple[type[Any], type[Any]]:
    """``module:Class`` -> (the Environment class, its Action class from ``step``'s hint)."""
    import typing

    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action

    module, _, attr = target.partition(":")
    try:
        cls: Any = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"env.id: openenv:{target}: cannot import it ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"env.id: openenv:{target} is not an openenv Environment class")
    step = getattr(cls, "step")  # noqa: B009 - mypy narrows cls to a bare `type` here
    hint = typing.get_type_hints(step).get("action")
    if not (isinstance(hint, type) and issubclass(hint, Action)):
        raise ConfigError(
            f"env.id: openenv:{target}: step() has no Action subclass type hint for 'action'"
        )
    return cls, hint


_SCHEMAS: dict[str, dict[str, Any]] = {}


async def _action_schema(url: str, timeout_s: float) -> dict[str, Any]:
    """The served env's action JSON schema (``GET /schema``, cached per URL, size-bounded)."""
    if url in _SCHEMAS:
        return _SCHEMAS[url]
    import aiohttp

    http = "http" + url[2:] if url.startswith("ws") else url
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.get(http + "/schema") as resp:
        body = await resp.content.read(_MAX_SCHEMA_BYTES + 1)
        if resp.status != 200 or len(body) > _MAX_SCHEMA_BYTES:
            raise EnvError(f"openenv:{url}: GET /schema answered {resp.status} ({len(body)} B)")
    schema = json.loads(body).get("action")
    if not isinstance(schema, dict):
        raise EnvError(f"openenv:{url}: GET /schema has no action schema")
    _SCHEMAS[url] = schema
    return schema


class OpenEnvEnv(Env):
    """An OpenEnv environment, served (a URL) or in this process (``module:Class``).

    Args:
        target: a URL (``http://127.0.0.1:8000``) or ``module.path:ClassName``.
        action_field: the action field that gets the agent's text (default: its one text field).
        observation_field: the observation field shown to the agent (default: its one string
            field, else the whole observation as JSON).
        system_prompt: an optional first system message.
        connect_timeout_s: bound on opening the WebSocket (and on ``GET /schema``).
        message_timeout_s: bound on each answer of the server.
        max_message_bytes: the largest WebSocket frame accepted from a server.
    """

    sees_cut_turns: ClassVar[bool] = False

    def __init__(
        self,
        target: str,
        *,
        action_field: str | None = None,
        observation_field: str | None = None,
        system_prompt: str | None = None,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        max_message_bytes: int = 4 << 20,
    ) -> None:
        require_openenv()
        self.target = target.removeprefix(PREFIX)
        self.where = PREFIX + self.target
        self.remote = self.target.startswith(_URL_SCHEMES)
        if not self.remote and ":" not in self.target:
            raise ConfigError(
                f"env.id: {self.where}: expected openenv:http://HOST:PORT (a served env) or "
                "openenv:package.module:ClassName (an Environment class)"
            )
        self.action_field = action_field
        self.observation_field = observation_field
        self.system_prompt = system_prompt
        self.timeouts = (connect_timeout_s, message_timeout_s)
        self.max_message_bytes = max_message_bytes
        self.session: _Remote | _Local | None = None
        self.done = False

    async def _open(self) -> _Remote | _Local:
        # openenv-core imports gradio: 3-6 s, more on a busy host. Imported on the event loop it
        # stalls every other episode, and their armed timers (the connect timeout) expire.
        if self.remote:
            await asyncio.to_thread(importlib.import_module, "openenv.core.generic_client")
            if self.action_field is None:
                schema = await _action_schema(self.target, self.timeouts[0])
                self.action_field = pick_text_field(schema, self.where)
            return _Remote(
                self.target,
                connect_timeout_s=self.timeouts[0],
                message_timeout_s=self.timeouts[1],
                max_message_bytes=self.max_message_bytes,
            )
        cls, action_cls = await asyncio.to_thread(_load_class, self.target)
        if self.action_field is None:
            self.action_field = pick_text_field(action_cls.model_json_schema(), self.where)
        return _Local(cls, action_cls)

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Open a session (first reset) and reset it with the task's seed and reset kwargs."""
        kwargs = dict(task.data.get("reset") or {})
        seed = task.data.get("seed", seed)
        if seed is not None:
            kwargs["seed"] = int(seed) % (1 << 31)  # OpenEnv wants a seed >= 0
        try:
            if self.session is None:
                self.session = await self._open()
            obs, _, done = await self.session.reset(**kwargs)
        except (ConfigError, EnvError):
            raise
        except Exception as e:
            raise self._error("reset", e) from None
        self.done = done
        text = "\n\n".join(t for t in (task.prompt, self._text(obs)) if t)
        messages = [Message(role="user", content=text)]
        if self.system_prompt:
            messages.insert(0, Message(role="system", content=self.system_prompt))
        return messages, {"openenv_done_at_reset": done} if done else {}

    async def step(self, action: str) -> StepResult:
        """Send the text as the action; the observation comes back as a user message."""
        if self.session is None or self.done:
            raise EnvError(f"{self.where}: step() called before reset() or after the end")
        assert self.action_field is not None
        try:
            obs, reward, done = await self.session.step({self.action_field: action})
        except (ConfigError, EnvError):
            raise
        except Exception as e:
            raise self._error("step", e) from None
        self.done = done
        value = checked_reward(reward, self.where)
        observation = [] if done else [Message(role="user", content=self._text(obs))]
        return StepResult(observation, reward=value, terminated=done)

    async def close(self) -> None:
        """End the session (close the WebSocket / the Environment); safe to call twice."""
        session, self.session = self.session, None
        if session is not None:
            try:
                await session.close()
            except Exception:  # noqa: S110 - the server may already be gone; nothing to free
                pass

    def _text(self, obs: Any) -> str:
        if not isinstance(obs, dict):
            raise EnvError(f"{self.where}: observation is {type(obs).__name__}, expected object")
        return observation_text(obs, self.observation_field, self.where)

    def _error(self, what: str, e: BaseException) -> EnvError:
        if isinstance(e, asyncio.TimeoutError):
            why = f"no answer within message_timeout_s={self.timeouts[1]}"
        else:
            why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        return EnvError(f"{self.where}: {what}() failed: {why}")

    @classmethod
    def sample_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        """``n`` tasks that reset the env with distinct seeds (the splits' seeds are disjoint)."""
        rng = random.Random(f"openenv:{seed}:{split}")
        odd = int(split != "train")  # train seeds are even, test seeds odd
        seeds = [2 * x + odd for x in rng.sample(range(1 << 30), n)]
        return [
            Task(id=f"openenv-{split}-{i}", prompt="", data={"seed": s})
            for i, s in enumerate(seeds)
        ]
