"""Environments: the async ``reset``/``step`` contract, tools, the registry, a gymnasium adapter.

An environment is one class. ``reset(task)`` returns the first messages; ``step(action)`` takes the
assistant's text and returns a frozen :class:`StepResult` (observation messages, reward,
``terminated``, ``truncated``, info). Turn limits and token budgets belong to the rollout engine,
never to envs. ``close()`` is idempotent and always runs, however the episode ends.

Register with one line, ``register("name-v0", "package.module:Class")``, and the env is found by
both ``agentrl.make("name-v0")`` and ``gymnasium.make("agentrl/name-v0")``. The CLI finds an env
registered in your own module or file through ``--import`` (:func:`import_envs`). An OpenEnv
environment needs no registering: ``openenv:http://HOST:PORT`` or ``openenv:module:Class``
(:mod:`agentrl.envs.openenv_env`).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import re
import string
import sys
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import gymnasium
from gymnasium import spaces

from agentrl.config_errors import did_you_mean
from agentrl.errors import ConfigError, EnvError
from agentrl.types import Message, Task

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one ``step`` returns: messages to append, reward, and whether the episode ended."""

    observation: list[Message] = field(default_factory=list)
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """Base class of every environment (async, text in, messages out)."""

    tools: Sequence[Tool] = ()
    """Tools the agent may call; :class:`ToolEnv` dispatches them."""

    sees_cut_turns: ClassVar[bool] = False
    """Whether ``step`` receives a turn that ``rollout.max_new_tokens`` cut off. By default such
    a turn ends the episode as truncated (finish reason ``max_new_tokens``, reward 0) without
    reaching ``step``, so an unfinished answer is never scored; set True in an env that wants
    to see it (and, e.g., ask the agent to go on)."""

    @abstractmethod
    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Start an episode on ``task``; return the first messages and an info dict."""

    def turn_max_new_tokens(self, turn: int) -> int | None:
        """The most tokens the agent may sample in assistant turn ``turn`` (0-based).

        ``None`` (the default): ``rollout.max_new_tokens``. A value lowers that turn's budget
        (short answers expected, a benchmark's set turn lengths); ``rollout.max_new_tokens`` and
        the context budget still bound it. Asked once per turn, before its request.
        """
        return None

    @abstractmethod
    async def step(self, action: str) -> StepResult:
        """Apply the assistant's text ``action``; return observation, reward and end flags."""

    async def close(self) -> None:  # noqa: B027 - optional hook; most envs hold nothing
        """Release resources; called once per episode however it ends, and safe to call twice."""

    def demonstration(self, task: Task) -> list[str] | None:
        """The assistant turns of a demonstrated episode on ``task``, for the cold start.

        The cold start replays them through the env: every turn but the last goes to ``step``,
        and the observation it returns (a tool's output, feedback) joins the demonstration,
        masked out of the loss like in a rollout. A tool env overrides this to show the whole
        conversation (call, then answer); a bare answer would teach the agent to skip the tool.

        Returns:
            By default ``task.data["demonstration"]`` (a list of assistant texts) when the task
            has one, else its reference answer as one turn, else ``None`` (no demonstration).
        """
        turns = task.data.get("demonstration")
        if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
            return list(turns)
        return None if task.answer is None else [task.answer]

    @classmethod
    def sample_tasks(cls, n: int, *, seed: int = 0, split: str = "train") -> list[Task]:
        """Generate ``n`` tasks of ``split`` (``train`` or ``test``), for envs that can.

        Raises:
            EnvError: the env has no built-in task generator (give it tasks from a file).
        """
        raise EnvError(f"{cls.__name__} has no built-in task generator; load tasks from data")


class SyncEnv(Env):
    """Adapter for synchronous environments: implement ``reset_sync``/``step_sync``.

    They run in a worker thread, so a slow env never blocks the event loop: a daemon thread of
    the rollout engine's own pool (:mod:`agentrl.rollout.env_pool`), not the loop's default
    executor. A call past ``rollout.env_timeout_s`` fails its episode and its thread is
    abandoned (a thread cannot be killed); ``close_sync`` may then run while it is still stuck.
    """

    @abstractmethod
    def reset_sync(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Synchronous ``reset``."""

    @abstractmethod
    def step_sync(self, action: str) -> StepResult:
        """Synchronous ``step``."""

    def close_sync(self) -> None:
        """Synchronous ``close`` (idempotent)."""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Run ``reset_sync`` in a worker thread."""
        return await _run_sync(self.reset_sync, task, seed=seed)

    async def step(self, action: str) -> StepResult:
        """Run ``step_sync`` in a worker thread."""
        return await _run_sync(self.step_sync, action)

    async def close(self) -> None:
        """Run ``close_sync`` in a worker thread."""
        await _run_sync(self.close_sync)


async def _run_sync(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn`` in a thread of the env pool (imported here: ``agentrl.rollout`` imports this)."""
    from agentrl.rollout.env_pool import run_sync

    return await run_sync(fn, *args, **kwargs)


# ----------------------------------------------------------------------------- tools

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the agent may call: ``fn(**arguments)`` returns text (sync or async)."""

    name: str
    description: str
    fn: Callable[..., Any]
    parameters: dict[str, Any] = field(default_factory=dict)
    """JSON schema of the arguments (shown to the model)."""

    async def __call__(self, arguments: dict[str, Any]) -> str:
        """Run the tool; a sync function runs in a worker thread (as :class:`SyncEnv`'s do)."""
        if inspect.iscoroutinefunction(self.fn):
            out = await self.fn(**arguments)
        else:
            out = await _run_sync(self.fn, **arguments)
        return str(out)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: a tool name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A tool call in the assistant's text is malformed; the message says what is wrong."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Parse Hermes/Qwen-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    Returns an empty list when the text has no call.

    Raises:
        ToolCallError: a call is not JSON, lacks ``name``, or has non-object ``arguments``.
    """
    if "<tool_call>" in text and not _TOOL_CALL.search(text):
        raise ToolCallError("unterminated <tool_call>: expected <tool_call>{json}</tool_call>")
    calls = []
    for raw in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"tool call is not valid JSON ({e.msg} at char {e.pos})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError('tool call must be an object with a string "name"')
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            raise ToolCallError(f'"arguments" must be an object, got {type(args).__name__}')
        calls.append(ToolCall(obj["name"], args))
    return calls


def render_tool_response(content: str) -> Message:
    """The message that carries a tool's output back to the agent."""
    return Message(role="tool", content=f"<tool_response>\n{content}\n</tool_response>")


def describe_tools(tools: Sequence[Tool]) -> str:
    """A system-prompt paragraph that lists ``tools`` and the call format."""
    lines = [
        "You may call tools. Write exactly:",
        '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>',
        "Tools:",
    ]
    for t in tools:
        lines.append(
            json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
        )
    return "\n".join(lines)


class ToolEnv(Env):
    """A multi-turn env whose agent calls :attr:`tools` until it gives a final answer.

    Subclasses implement :meth:`prompt` (first messages) and :meth:`score` (final answer to
    reward). A turn with tool calls gets their outputs as a tool message; a malformed call gets
    a message saying what was wrong, and the episode goes on. Per-turn info records the number
    of calls and tool errors, for per-token advantage shaping.
    """

    def __init__(self) -> None:
        self.task: Task | None = None
        self.done = False

    @abstractmethod
    def prompt(self, task: Task) -> list[Message]:
        """The first messages of an episode on ``task``."""

    @abstractmethod
    async def score(self, answer: str) -> tuple[float, dict[str, Any]]:
        """Reward of a final answer (a turn without tool calls) and diagnostics."""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict]:
        """Start an episode on ``task``."""
        self.task, self.done = task, False
        return self.prompt(task), {}

    async def step(self, action: str) -> StepResult:
        """Run the tool calls in ``action``, or score it as the final answer."""
        if self.done:
            raise EnvError("step() called after the episode ended")
        try:
            calls = parse_tool_calls(action)
        except ToolCallError as e:
            info = {"tool_calls": 0, "tool_errors": 1, "format_error": True}
            return StepResult([render_tool_response(f"error: {e}")], info=info)
        if not calls:
            self.done = True
            scored: Any = self.score(action)
            if inspect.isawaitable(scored):  # a plain `def score` works too
                scored = await scored
            reward, info = self._checked_score(scored)
            return StepResult([], reward=reward, terminated=True, info=info)
        by_name = {t.name: t for t in self.tools}
        outputs, errors = [], 0
        for call in calls:
            tool = by_name.get(call.name)
            if tool is None:
                errors += 1
                outputs.append(f"error: unknown tool {call.name!r}; known: {sorted(by_name)}")
                continue
            try:
                outputs.append(await tool(call.arguments))
            except Exception as e:  # a tool failing is an observation, not a crash
                errors += 1
                outputs.append(f"error: {type(e).__name__}: {e}")
        info = {"tool_calls": len(calls), "tool_errors": errors}
        return StepResult([render_tool_response("\n".join(outputs))], info=info)

    def _checked_score(self, out: Any) -> tuple[float, dict[str, Any]]:
        """``score``'s return, or an :class:`EnvError` naming the class, what came, what is due."""
        where = f"{type(self).__name__}.score()"
        due = "expected a (reward, info) tuple such as (1.0, {})"
        if not isinstance(out, tuple) or len(out) != 2:
            got = f"a {len(out)}-tuple" if isinstance(out, tuple) else type(out).__name__
            raise EnvError(f"{where} returned {got} {out!r:.100}; {due}")
        reward, info = out
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise EnvError(f"{where} reward is {type(reward).__name__} {reward!r:.100}; {due}")
        if not math.isfinite(reward):
            raise EnvError(f"{where} reward is {reward!r}; expected a finite number")
        if not isinstance(info, dict):
            raise EnvError(f"{where} info is {type(info).__name__} {info!r:.100}; {due}")
        return float(reward), info


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True, slots=True)
class _Spec:
    env_id: str
    entry_point: str | Callable[..., Env]
    kwargs: dict[str, Any]


_REGISTRY: dict[str, _Spec] = {}
_ID = re.compile(r"^[A-Za-z0-9_.-]+-v\d+$")


def register(env_id: str, entry_point: str | Callable[..., Env], **kwargs: Any) -> None:
    """Register an env as ``"name-vN"`` from ``"module:Class"`` (imported lazily) or a class.

    It becomes available as ``agentrl.make(env_id)`` and ``gymnasium.make("agentrl/" + env_id)``.
    """
    if not _ID.match(env_id):
        raise ConfigError(f"env_id: expected 'name-vN', got {env_id!r}")
    _REGISTRY[env_id] = _Spec(env_id, entry_point, kwargs)
    gym_id = f"agentrl/{env_id}"
    if gym_id not in gymnasium.registry:
        gymnasium.register(
            id=gym_id, entry_point="agentrl.env:GymAdapter", kwargs={"env_id": env_id}
        )


def _load_builtins() -> None:
    importlib.import_module("agentrl.envs")


_IMPORTED: dict[Path, str] = {}


def import_envs(specs: Sequence[str]) -> None:
    """Import modules or ``.py`` files so that the envs they ``register`` can be made by id.

    Args:
        specs: importable module names (``my_pkg.envs``) or paths of ``.py`` files (a file is
            imported once, as a module named after it, with its folder on ``sys.path``).

    Raises:
        ConfigError: a file does not exist or a module cannot be found (one line; an error
            raised by the module's own code propagates with its traceback).
    """
    for spec in specs:
        if spec.endswith(".py") or "/" in spec:
            path = Path(spec).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"imports: no such file {spec}")
            if path in _IMPORTED:
                continue
            name = path.stem if path.stem not in sys.modules else f"agentrl_user_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            if module_spec is None or module_spec.loader is None:
                raise ConfigError(f"imports: {spec} is not an importable Python file")
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))  # so it can import its neighbours
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            _IMPORTED[path] = name
            module_spec.loader.exec_module(module)
            continue
        try:
            importlib.import_module(spec)
        except ModuleNotFoundError as e:
            if e.name is None or not spec.startswith(e.name):
                raise  # the module exists; one of its own imports is missing
            raise ConfigError(
                f"imports: no module named {spec!r} (expected a module on sys.path or a .py file)"
            ) from None


def env_class(env_id: str) -> Callable[..., Env]:
    """The class (or factory) registered as ``env_id``.

    Raises:
        ConfigError: no env is registered as ``env_id``; the message says how to import one.
    """
    spec = _spec(env_id)
    if isinstance(spec.entry_point, str):
        module, _, attr = spec.entry_point.partition(":")
        factory: Callable[..., Env] = getattr(importlib.import_module(module), attr)
        return factory
    return spec.entry_point


def _spec(env_id: str) -> _Spec:
    """The registered spec of ``env_id``; ``openenv:<URL or module:Class>`` needs no registering."""
    if env_id.startswith("openenv:"):  # an entry point like a builtin's; openenv loads lazily
        if importlib.util.find_spec("openenv") is None:
            raise ConfigError(
                f"env.id: {env_id} needs openenv-core; pip install 'agentrl[openenv]'"
            )
        return _Spec(env_id, "agentrl.envs.openenv_env:OpenEnvEnv", {"target": env_id})
    _load_builtins()
    spec = _REGISTRY.get(env_id)
    if spec is None:
        raise ConfigError(
            f"env.id: unknown env {env_id!r}{did_you_mean(env_id, _REGISTRY)}; registered: "
            f"{sorted(_REGISTRY)}. An env registered in your own file or module is found with "
            "--import my_env.py (or imports = [\"my_env.py\"] in the config)"
        )
    return spec


def make(env_id: str, **kwargs: Any) -> Env:
    """A new instance of the env registered as ``env_id`` (kwargs override registered ones)."""
    factory = env_class(env_id)
    env = factory(**{**_spec(env_id).kwargs, **kwargs})
    if not isinstance(env, Env):
        raise EnvError(f"{env_id}: entry point made {type(env).__name__}, expected an agentrl Env")
    return env


def registered() -> list[str]:
    """The ids of every registered env."""
    _load_builtins()
    return sorted(_REGISTRY)


# ----------------------------------------------------------------------------- gymnasium

_TEXT = spaces.Text(max_length=1 << 16, min_length=0, charset=string.printable)


def _render(messages: list[Message]) -> str:
    return "\n".join(f"{m.role}: {m.content}" for m in messages)


class GymAdapter(gymnasium.Env[str, str]):
    """A registered agentrl env as a synchronous gymnasium env with text spaces.

    ``reset(options={"task": Task | dict})`` (or a generated task when the env can make them);
    observations are the new messages rendered as ``"role: content"`` lines.
    """

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        self.env = make(env_id, **kwargs)
        self.observation_space = _TEXT
        self.action_space = _TEXT
        self._loop = asyncio.new_event_loop()

    def _run(self, coro: Awaitable[Any]) -> Any:
        return self._loop.run_until_complete(coro)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict]:
        """Reset on ``options["task"]`` (a Task or dict), else on a generated task."""
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is None:
            task = type(self.env).sample_tasks(1, seed=seed or 0)[0]
        elif isinstance(task, dict):
            task = Task.model_validate(task)
        messages, info = self._run(self.env.reset(task, seed=seed))
        return _render(messages), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """One step with the assistant's text."""
        r: StepResult = self._run(self.env.step(action))
        return _render(r.observation), r.reward, r.terminated, r.truncated, r.info

    def close(self) -> None:
        """Close the env and its private event loop."""
        if not self._loop.is_closed():
            self._run(self.env.close())
            self._loop.close()
