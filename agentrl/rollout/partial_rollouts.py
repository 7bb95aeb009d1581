"""Partial rollouts: the gate a weight update closes, and turns that survive the update.

:meth:`RolloutEngine.interrupt <agentrl.rollout.engine.RolloutEngine.interrupt>` closes the
:class:`WeightGate` and aborts (or pauses) the requests in flight; each keeps the tokens it
sampled with their log-probs and weight versions, and after ``release`` it continues from
prompt + partial output on whatever weights the engine serves then (:func:`generate_turn`). An
episode can span several versions; every token keeps its own. ``release`` lets the turns re-send
while the server is still paused, so that the server finds them all queued when it continues and
prefills them in one batch.

The gate never holds the client: the engine passes its current one (benchmarks swap it).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, Protocol, cast

from agentrl.errors import ServerError
from agentrl.inference.base import GenerateOutput, InferenceClient, SamplingParams
from agentrl.rollout.episode import EpisodeState

__all__ = ["WeightGate", "generate_turn", "pausable"]

InterruptMode = Literal["abort", "retract", "in_place"]


class _Pausable(Protocol):
    """A client with SGLang's pause/continue (``LocalEngine``, ``SGLangClient``)."""

    async def pause(self, mode: InterruptMode = "abort") -> object: ...

    async def continue_generation(self) -> None: ...


def pausable(client: object) -> _Pausable | None:
    """``client`` if it can pause and continue, else ``None``.

    Checked by attribute lookup rather than ``isinstance`` on a runtime protocol, which since
    Python 3.12 ignores attributes that a wrapping client forwards through ``__getattr__``.
    """
    names = ("pause", "continue_generation")
    ok = all(callable(getattr(client, name, None)) for name in names)
    return cast(_Pausable, client) if ok else None


_RESEND_YIELDS = 100  # most loop turns release() waits for turns to pass the gate (all wake in
# one turn; the bound only guards against a stuck one)


def _attempt_seed(seed: int | None, attempt: int) -> int | None:
    """The sampling seed of a turn's ``attempt``-th request (0: the turn's own seed).

    A resumed request needs a fresh stream: ``seed + attempt`` would replay the next turn's.
    """
    if seed is None or attempt == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31)


class WeightGate:
    """No request starts while weights are being swapped; an interrupt bumps the epoch.

    A request sent in an older epoch than the current one was cut off by an interrupt, so its
    turn resumes; an abort within its own epoch came from someone else (the server).
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._waiting = 0  # turns waiting at the closed gate to send a request
        self.epoch = 0
        """Bumped by every :meth:`interrupt`."""
        self._paused = False

    async def passed(self) -> int:
        """Wait until the gate is open; the epoch the next request is sent in."""
        if not self._open.is_set():
            self._waiting += 1
            try:
                await self._open.wait()
            finally:
                self._waiting -= 1
        return self.epoch

    async def interrupt(
        self, client: InferenceClient, mode: InterruptMode, then: Callable[[], None] | None
    ) -> None:
        """Close the gate, run ``then``, pause ``client`` in ``mode`` (or abort all of it).

        A client that ``queues_while_paused`` (the embedded engine) opens the gate once paused.
        """
        self.epoch += 1
        self._open.clear()
        if then is not None:
            then()
        can_pause = pausable(client)
        if can_pause is not None:
            self._paused = True  # (before the call: a pause that half failed is undone too)
            await can_pause.pause(mode)
            if getattr(client, "queues_while_paused", False):
                self._open.set()
        else:
            await client.abort(None)

    async def release(self, client: InferenceClient) -> None:
        """Open the gate, let the waiting turns re-send, then continue a paused ``client``."""
        can_pause = pausable(client)
        self._open.set()
        try:
            if self._paused and can_pause is not None:
                for _ in range(_RESEND_YIELDS):  # until every waiting turn has sent its request
                    if not self._waiting:
                        break
                    await asyncio.sleep(0)
                await asyncio.sleep(0)  # (and the last one's client got past its own awaits)
                await can_pause.continue_generation()
        finally:
            self._paused = False


async def generate_turn(
    client: InferenceClient,
    gate: WeightGate,
    ep: EpisodeState,
    params: SamplingParams,
    turn_id: str,
    session_id: str,
    rid: list[str | None],
    *,
    routed: bool,
) -> GenerateOutput:
    """One assistant turn, surviving weight updates (partial rollouts).

    A request cut off by an interrupt keeps the tokens it sampled, with their log-probs and
    versions; after the release it is re-sent as prompt + partial output under a new rid
    (``<turn>.rN``: SGLang refuses a rid that is still open), for the tokens left in its budget,
    so the turn spans several weight versions. Only an abort that an interrupt caused resumes;
    any other abort ends the turn as ``abort``. ``rid[0]`` holds the rid in flight (else None).
    """
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    attempt = 0
    while True:
        epoch = await gate.passed()
        rid[0] = turn_id if attempt == 0 else f"{turn_id}.r{attempt}"
        extra: dict[str, Any] = {}
        if routed:  # the rows known already are not sent again
            extra = dict(return_routed_experts=True, routed_experts_start_len=ep.routed_rows)
        out = await client.generate(
            ep.tokens + ids,
            replace(
                params,
                max_new_tokens=params.max_new_tokens - len(ids),
                seed=_attempt_seed(params.seed, attempt),
            ),
            rid=rid[0],
            session_id=session_id,
            **extra,
        )
        rid[0] = None
        if out.routed_experts is not None:
            ep.add_routing(out.routed_experts)
        elif routed and not (out.finish_reason == "abort" and not out.output_ids):
            raise ServerError("return_routed_experts: the response has no routed experts")
        ids += out.output_ids
        logprobs += out.logprobs
        versions += out.versions
        finish = out.finish_reason
        if finish != "abort" or gate.epoch == epoch:
            break  # done, or aborted by someone else (the server): not ours to resume
        ep.interruptions += 1
        if len(ids) >= params.max_new_tokens:  # cut exactly at its last token
            finish = "length"
            break
        ep.resumes += bool(ids)  # a continuation, not a plain re-send
        attempt += 1
    return GenerateOutput(
        rid=turn_id,
        output_ids=ids,
        logprobs=logprobs,
        versions=versions,
        finish_reason=finish,
        weight_version=out.weight_version,
        prompt_tokens=len(ep.tokens),
        matched_stop=out.matched_stop,
        endpoint=out.endpoint,
    )
