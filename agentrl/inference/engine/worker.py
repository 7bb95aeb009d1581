"""The embedded engine's own worker threads.

The engine's torch work (a decode step, a weight load, a scoring pass) runs off the event loop.
It gets threads of its own rather than asyncio's default executor, which envs and tools share
(``asyncio.to_thread``): an env whose threaded call blocks could otherwise take every default
thread and stall generation for every episode.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# A step, a load and a scoring pass may overlap; more is never in flight at once.
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agentrl-engine")


async def in_worker(fn: Callable[..., T], *args: Any) -> T:
    """``await fn(*args)`` on one of the engine's threads (``asyncio.to_thread``'s contract)."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))
