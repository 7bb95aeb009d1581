"""The distillation teacher of a run, and the step's per-token advantages with or without it.

``teacher.model`` runs a model of its own (right-padded batched forwards) on the
policy's device (built like the policy: a ``tiny`` preset or an HF directory such as a trained
run's ``RUN_DIR/export``), at ``teacher.temperature`` (its logits divided by it before the
softmax); ``teacher.endpoint`` (temperature 1 only) scores on an SGLang-compatible server through
``/generate`` with ``input_ids`` = the whole sequence, ``max_new_tokens`` 0, ``return_logprob``
and ``logprob_start_len`` 0 (its ``input_token_logprobs``). Either way the teacher sees the
student's exact token ids, so both must share one vocabulary: a teacher that does not is
refused with one line. Sequences are scored ``teacher.batch_size`` at a time; a batch that fails
(an HTTP error, a sequence past the teacher's context) fails its episodes, which are then left
out of the update and counted like other failed episodes (``rollout/failed_teacher``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from agentrl.config import TrainConfig
from agentrl.errors import AgentRLError, ConfigError, ServerError
from agentrl.learner.advantages import compute_token_advantages
from agentrl.learner.distill import distill_token_advantages
from agentrl.loop import teacher_prefix as prefix
from agentrl.types import Group, Trajectory

# a text the teacher's tokenizer must cut exactly as the student's (specials, digits, ASCII)
ASCII = "".join(map(chr, range(32, 127)))
VOCAB_PROBE = f"<|im_start|>user\n{ASCII}<|im_end|>\n<|im_start|>assistant\n<think>\n</think>\n"
MAX_RESPONSE_BYTES_PER_TOKEN = 256  # an input_token_logprobs entry is ~30 bytes
TOKENS_PER_FORWARD = 8192
"""An embedded teacher's forward takes this many (padded) tokens at most: its float32 logits are
``TOKENS_PER_FORWARD x vocab`` (5 GB for Qwen's vocabulary); a longer sequence goes alone."""


class TeacherError(AgentRLError):
    """The teacher could not score a batch (the episodes in it fail)."""


def vocab_mismatch(student: Any, teacher: Any) -> str | None:
    """Why two tokenizers do not share a vocabulary (``None`` when they do)."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a == b:
        return None
    diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[0]
    return (
        f"its vocabulary differs from the policy's ({len(b)} vs {len(a)} tokens; first "
        f"difference: {diff[0]!r} -> {diff[1]}): distillation scores the student's token ids"
    )


def tempered_logprobs(logits: torch.Tensor, targets: torch.Tensor, tau: float) -> torch.Tensor:
    """``log_softmax(logits / tau)`` at ``targets`` (float64), without a float64 copy of the rows.

    The row's max is taken out first: the gathered term ``(z_y - max) / tau`` is formed in
    float64, and the log-sum-exp of the shifted row lies in ``[0, log V]``, where float32 is
    within ~1e-7. (A float32 ``log_softmax`` of ``z / tau`` would round a log-prob of -30 to
    ~4e-6: sharpening makes such log-probs common.)
    """
    top = logits.amax(-1, keepdim=True)
    lse = torch.logsumexp((logits - top) / tau, -1).double()
    picked = logits.gather(-1, targets[..., None])[..., 0].double() - top[..., 0].double()
    return picked / tau - lse


class _LocalScorer:
    """Teacher-forced log-probs of a model run in this process, at ``teacher.temperature``.

    At 1 they are untempered, as SGLang's prompt ones; below 1 each position's logits are
    divided by it before the softmax (the whole row is here, so the normalisation is exact).
    """

    def __init__(self, config: TrainConfig, tokenizer: Any) -> None:
        from agentrl.loop.placement import load_policy

        t = config.teacher
        seed = config.seed if t.seed is None else t.seed
        model_cfg = config.model.model_copy(update={"path": t.model, "tiny": t.tiny})
        try:
            model, tok = load_policy(config.model_copy(update={"seed": seed, "model": model_cfg}))
        except ConfigError as e:
            raise ConfigError(str(e).replace("model.path:", "teacher.model:", 1)) from None
        if (why := vocab_mismatch(tokenizer, tok)) is not None:
            raise ConfigError(f"teacher.model: {why}")
        # no engine: the teacher only runs whole-sequence forwards, several sequences at once
        self.model = model.eval()
        self.temperature = t.temperature
        self.max_len = int(getattr(model.config, "max_position_embeddings", 0) or 32768)
        self.cache_kw = prefix.cache_kw(model)  # None: no shared-prefix forwards

    async def score(self, seqs: list[list[int]]) -> list[list[float]]:
        if any(len(ids) > self.max_len for ids in seqs):
            raise ServerError(f"a sequence is longer than the teacher's context ({self.max_len})")
        return await asyncio.to_thread(self._score, seqs)

    def _logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The log-probs of ``targets`` under float ``logits`` at the teacher's temperature."""
        if self.temperature == 1.0:
            return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        return tempered_logprobs(logits, targets, self.temperature)

    def _score(self, seqs: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs, in forwards of at most ``TOKENS_PER_FORWARD`` tokens.

        Sequences that share long prefixes (a group's prompt) run each prefix once
        (:mod:`~agentrl.loop.teacher_prefix`); otherwise each whole sequence runs, right-padded.
        """
        out: dict[int, list[float]] = {}
        if (kw := self.cache_kw) is not None and min(map(len, seqs), default=0) >= 2:
            found = prefix.clusters(seqs)
            if prefix.saved_frac(seqs, found) >= prefix.MIN_SHARED_FRAC:
                for part in prefix.chunks(seqs, found, TOKENS_PER_FORWARD):
                    out |= prefix.score_shared(self.model, kw, seqs, part, self._logprobs)
                return [out[i] for i in range(len(seqs))]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        while order:
            rows = [order.pop()]  # the longest left, then as many as fit beside it
            while order and len(seqs[rows[0]]) * (len(rows) + 1) <= TOKENS_PER_FORWARD:
                rows.append(order.pop())
            width = len(seqs[rows[0]])
            dev = next(self.model.parameters()).device
            ids = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(rows):
                ids[r, : len(seqs[i])] = torch.tensor(seqs[i], device=dev)
                mask[r, : len(seqs[i])] = 1
            with torch.inference_mode():  # right padding: causal rows never see it
                logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
                lps = self._logprobs(logits, ids[:, 1:])
            for r, i in enumerate(rows):
                out[i] = [0.0, *lps[r, : len(seqs[i]) - 1].tolist()]
        return [out[i] for i in range(len(seqs))]

    async def aclose(self) -> None:
        pass


class _RemoteScorer:
    """``/generate`` prompt log-probs of an SGLang-compatible endpoint."""

    def __init__(self, config: TrainConfig, tokenizer: Any) -> None:
        import aiohttp

        from agentrl.inference.api_keys import bearer, read_key

        t = config.teacher
        assert t.endpoint is not None
        self.url, self.tokenizer = t.endpoint, tokenizer
        try:
            self.headers = bearer(read_key(t.api_key, "teacher.api_key"))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.timeout = aiohttp.ClientTimeout(total=t.timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.checked = False

    async def _post(self, payload: dict[str, Any], limit: int) -> Any:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self.session.post(
                self.url + "/generate", json=payload, headers=self.headers
            ) as resp:
                body = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > limit:
                        raise TeacherError(f"teacher {self.url}: response over {limit} bytes")
                if resp.status != 200:
                    text = bytes(body[:200]).decode(errors="replace")
                    raise TeacherError(f"teacher {self.url}: HTTP {resp.status}: {text}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise TeacherError(f"teacher {self.url}: {type(exc).__name__}: {exc}") from None
        import json

        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise TeacherError(f"teacher {self.url}: malformed response") from None

    async def check_vocab(self) -> None:
        """Refuse a teacher whose tokenizer cuts the probe text otherwise than the student's."""
        want = list(self.tokenizer(VOCAB_PROBE, add_special_tokens=False)["input_ids"])
        payload = {"text": VOCAB_PROBE, "sampling_params": {"max_new_tokens": 0},
                   "return_prompt_token_ids": True}  # fmt: skip
        got = (await self._post(payload, 1 << 20)).get("prompt_token_ids")
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if isinstance(got, list) and got[:1] == [bos] and want[:1] != [bos]:
            got = got[1:]  # the server added its BOS
        if got != want:
            raise ConfigError(
                f"teacher.endpoint: its tokenizer differs from the policy's (a probe text gives "
                f"{len(got) if isinstance(got, list) else got!r} ids, expected {len(want)}): "
                "distillation scores the student's token ids"
            )

    async def score(self, seqs: list[list[int]]) -> list[list[float]]:
        if not self.checked:
            await self.check_vocab()
            self.checked = True
        payload = {"input_ids": seqs, "sampling_params": {"max_new_tokens": 0},
                   "return_logprob": True, "logprob_start_len": 0}  # fmt: skip
        limit = (1 << 16) + MAX_RESPONSE_BYTES_PER_TOKEN * sum(map(len, seqs))
        answer = await self._post(payload, limit)
        if not isinstance(answer, list) or len(answer) != len(seqs):
            raise TeacherError(f"teacher {self.url}: expected {len(seqs)} results")
        return [self._logprobs(item, ids) for item, ids in zip(answer, seqs, strict=True)]

    def _logprobs(self, item: Any, ids: list[int]) -> list[float]:
        try:
            rows = item["meta_info"]["input_token_logprobs"]
            if [int(r[1]) for r in rows] != ids:
                raise TeacherError(f"teacher {self.url}: input_token_logprobs do not echo the ids")
            out = [0.0] + [float(r[0]) for r in rows[1:]]  # nothing predicts token 0
        except (KeyError, IndexError, TypeError, ValueError):
            raise TeacherError(f"teacher {self.url}: malformed input_token_logprobs") from None
        if not all(math.isfinite(v) for v in out):
            raise TeacherError(f"teacher {self.url}: a log-prob is not finite")
        return out

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


class Teacher:
    """Scores a step's trajectories; :attr:`scores` holds the step's teacher log-probs.

    In the overlapped loop the pipeline hands each group to :meth:`prefetch` as it finishes:
    one worker scores the finished groups a batch at a time while others still generate, so
    the step's :meth:`score` mostly collects (a 2-core CPU run: 24% of a step).
    """

    def __init__(self, config: TrainConfig, tokenizer: Any) -> None:
        self.config = config.teacher
        self.scorer = (
            _RemoteScorer(config, tokenizer)
            if self.config.endpoint
            else _LocalScorer(config, tokenizer)
        )
        self.scores: dict[int, list[float]] = {}
        """The teacher's log-prob of every token, by ``id`` of the trajectory (this step's)."""
        # prefetched, by id of the trajectory: it (held, so no id is reused), its result
        self._early: dict[int, tuple[Trajectory, list[float] | str]] = {}
        self._queued: list[Group] = []
        self._done: dict[int, asyncio.Event] = {}  # by id of a prefetched group
        self._worker: asyncio.Task[None] | None = None
        self.busy_s = 0.0  # seconds spent scoring, prefetched or not

    def prefetch(self, group: Group) -> None:
        """Queue a finished group for the worker; :meth:`score` collects it at its step."""
        self._queued.append(group)
        self._done[id(group)] = asyncio.Event()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())

    def _take(self) -> list[Group]:
        """The oldest queued groups, whole, up to ``teacher.batch_size`` live sequences.

        None until that many are queued. Why not each group as it finishes: a group alone is a
        forward of its own (cpu-tiny-distill's teacher on one CPU thread, a step's 128
        sequences: 32 one-group calls 153 ms, 8 of 16 sequences 103 ms, 75 ms with each
        group's prompt run once by ``teacher_prefix``). Whole groups, so a prompt runs once.
        What is still queued at its step, :meth:`score` scores itself.
        """
        live = [sum(not t.failed for t in g.trajectories) for g in self._queued]
        if sum(live) < self.config.batch_size:
            return []
        k, n = 1, live[0]
        while k < len(live) and n + live[k] <= self.config.batch_size:
            k, n = k + 1, n + live[k]
        taken, self._queued = self._queued[:k], self._queued[k:]
        return taken

    async def _drain(self) -> None:
        while groups := self._take():
            trajs = [t for g in groups for t in g.trajectories if not t.failed]
            try:
                scored = await self._score(trajs)
                self._early.update({id(t): (t, scored[id(t)]) for t in trajs})
            finally:
                for g in groups:
                    self._done.pop(id(g)).set()

    async def _score(self, trajs: list[Trajectory]) -> dict[int, list[float] | str]:
        """Each trajectory's log-probs, or the one-line error of the batch it failed in."""
        t0 = time.perf_counter()
        out: dict[int, list[float] | str] = {}
        size = self.config.batch_size
        for start in range(0, len(trajs), size):
            batch = trajs[start : start + size]
            try:
                scored: list[list[float] | str] = list(
                    await self.scorer.score([list(t.tokens) for t in batch])
                )
            except (TeacherError, ServerError, ValueError) as exc:
                scored = [f"TeacherError: {str(exc).splitlines()[0][:500]}"] * len(batch)
            out.update(zip(map(id, batch), scored, strict=True))
        self.busy_s += time.perf_counter() - t0
        return out

    async def score(self, groups: Sequence[Group], metrics: dict[str, float]) -> None:
        """Score the groups' live trajectories into :attr:`scores`; update ``metrics``.

        Prefetched groups are waited for, the others scored now. Adds
        ``distill/reverse_kl_mean`` (per sampled token), ``distill/tokens``,
        ``distill/prefetched_frac`` (of the trajectories, those scored early), ``time/teacher_s``
        (the step's wait for the teacher) and ``time/teacher_busy_s`` (scoring time since the
        last step, prefetches included); a failed batch fails its episodes (``rollout/failed``
        and ``rollout/failed_teacher``).
        """
        t0 = time.perf_counter()
        mine = {id(g) for g in groups}
        for g in [g for g in self._queued if id(g) in mine]:  # not started: scored below
            self._queued.remove(g)
            self._done.pop(id(g)).set()
        for g in groups:
            if (done := self._done.get(id(g))) is not None:
                await done.wait()
        trajs = [t for g in groups for t in g.trajectories if not t.failed]
        found = {id(t): e[1] for t in trajs if (e := self._early.pop(id(t), None)) and e[0] is t}
        metrics["distill/prefetched_frac"] = len(found) / max(len(trajs), 1)
        found.update(await self._score([t for t in trajs if id(t) not in found]))
        self.scores = {}
        kl, tokens, failed = 0.0, 0, 0
        for t in trajs:
            lps = found[id(t)]
            if isinstance(lps, str):  # left out of the update, counted as failed
                t.error, failed = lps, failed + 1
                continue
            self.scores[id(t)] = lps
            kl += sum(s - q for s, q, m in zip(t.logprobs, lps, t.loss_mask, strict=True) if m)
            tokens += t.num_response_tokens
        metrics["distill/reverse_kl_mean"] = kl / max(tokens, 1)
        metrics["distill/tokens"] = float(tokens)
        metrics["time/teacher_s"] = time.perf_counter() - t0
        metrics["time/teacher_busy_s"], self.busy_s = self.busy_s, 0.0
        if failed:
            metrics["rollout/failed"] = metrics.get("rollout/failed", 0.0) + failed
            metrics["rollout/failed_teacher"] = float(failed)

    async def aclose(self) -> None:
        """Stop prefetching, then stop the embedded engine or close the HTTP session."""
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        await self.scorer.aclose()


def make_teacher(config: TrainConfig, tokenizer: Any) -> Teacher | None:
    """The run's teacher, or ``None`` when ``teacher.model`` and ``teacher.endpoint`` are unset."""
    return Teacher(config, tokenizer) if config.teacher.enabled else None


def token_batch(
    groups: Sequence[Group], config: TrainConfig, teacher: Teacher | None = None
) -> tuple[list[Trajectory], list[torch.Tensor], int]:
    """Trajectories that carry signal, with their per-token advantages, and zero-signal groups.

    Failed episodes are left out. With a teacher, the advantages are
    :func:`~agentrl.learner.distill.distill_token_advantages` of the scores it holds; without,
    :func:`~agentrl.learner.advantages.compute_token_advantages`. A trajectory whose
    advantages are zero everywhere would add nothing to the gradient and is not kept; a group
    with none kept counts as zero-signal.
    """
    adv = config.advantages
    trajs: list[Trajectory] = []
    advs: list[torch.Tensor] = []
    zero_signal = 0
    for g in groups:
        ok = [t for t in g.trajectories if not t.failed]
        if not ok:
            continue
        clean = Group(task=g.task, trajectories=ok)
        if teacher is None:
            per_token = compute_token_advantages(clean, adv.shapers, eps=adv.eps)
        else:
            per_token, _, _ = distill_token_advantages(
                clean, [teacher.scores[id(t)] for t in ok], mode=teacher.config.mode,
                kl_coef=teacher.config.kl_coef, shapers=adv.shapers, eps=adv.eps,
            )  # fmt: skip
        keep = [(t, a) for t, a in zip(ok, per_token, strict=True) if bool(a.any())]
        zero_signal += not keep
        trajs += [t for t, _ in keep]
        advs += [a for _, a in keep]
    return trajs, advs, zero_signal
