"""Training on several processes: ``torchrun --nproc-per-node N -m agentrl.cli train CONFIG``.

With ``WORLD_SIZE > 1`` in the environment (torchrun sets it, and ``RANK``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) :func:`process_group` joins the ranks before anything is built:
NCCL when the policy is on a card (``model.device``; each rank on its ``LOCAL_RANK`` card), gloo
on the CPU, with ``train.dist_timeout_s`` as the timeout of every collective. Then:

* every rank builds the same policy (same seed) and the learner shards it with FSDP2;
* **rollouts**: task group ``i`` of a step (and of an evaluation) runs on rank ``i % N``, with
  the episode seeds the single-process run gives it (they derive from ``i``), on the rank's own
  colocated engine, or over every endpoint with ``inference.endpoints``. The groups are then
  all-gathered (pickled, over a gloo group of their own), so every rank holds the whole batch in
  task order and computes the same advantages; the learner trains each rank's token-balanced
  share of it. The overlapped loop splits the task stream the same way
  (:mod:`agentrl.loop.pipeline`);
* **weights**: after each step every rank's engine loads the full new weights in place, one
  tensor at a time gathered from the FSDP shards (``DTensor.full_tensor()``): no full copy on
  the host or on the card. With endpoints the push happens once: rank 0 gathers (the other ranks
  take part in each gather and drop the tensor) and pushes from disk or over the distributed
  group, and every rank waits for it before its next rollout;
* **files**: rank 0 alone writes the logs, metrics, trajectories, config, summary, plots and
  progress; checkpoints are sharded (``torch.distributed.checkpoint``, each rank its shard and
  RNG) and ``--resume`` continues on the same number of ranks;
* **failures**: a rank that raises posts ``rank R failed at step S: ...`` on the rendezvous store
  and exits non-zero; a watcher thread on every other rank sees it within a second, prints it
  and ends its process (a rank blocked in a collective cannot be interrupted otherwise). A rank
  that dies without a word leaves the others waiting in a collective until
  ``train.dist_timeout_s``, which then fails them the same way. ``torchrun`` also ends the other
  workers once one has exited with an error.

Test hook: ``AGENTRL_FAULT=RANK:STEP`` makes rank ``RANK`` raise in step ``STEP`` (of the
synchronous loop, after its share of a rollout, before the groups are gathered);
``RANK:STEP:hang`` makes it hang there instead (``tests/test_multiprocess_train.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from agentrl.errors import ConfigError, TrainingError
from agentrl.loop.stop import Stopped
from agentrl.types import Group, Task

log = logging.getLogger(__name__)

FAULT_ENV = "AGENTRL_FAULT"
"""The test hook's environment variable (see the module docstring)."""

_POLL_S = 0.5  # how often a watcher looks for another rank's failure
_ACK_WAIT_S = 5.0  # how long a failing rank waits for the others to read its notice


@dataclass
class Ranks:
    """This process's place among the training ranks.

    Attributes:
        rank: this rank (0 in one process).
        world_size: number of ranks (1 in one process).
        timeout_s: timeout of every collective, for messages.
        step: the step the run is in (set by the trainer), for failure messages.
        group: a gloo group for pickled objects (``None`` in one process).
    """

    rank: int = 0
    world_size: int = 1
    timeout_s: float = 600.0
    step: int = 0
    group: Any = None
    _watch: _FailureWatch | None = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        """Whether this rank writes the run's files and progress (rank 0)."""
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (a collective)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a collective)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank (a collective)."""
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def mine(self, n: int) -> list[int]:
        """The group indices (of ``n``) this rank rolls out: ``i % world_size == rank``."""
        return list(range(self.rank, n, self.world_size))

    async def run_groups(
        self,
        engine: Any,
        make_env: Callable[[], Any],
        tasks: Sequence[Task],
        *,
        env_id: str,
        seed_offset: int,
    ) -> list[Group]:
        """Roll out this rank's share of ``tasks``; every rank gets all groups, in task order.

        ``engine`` is a :class:`~agentrl.rollout.RolloutEngine`. Task ``i`` runs as the list of
        one task at seed offset ``seed_offset + i``, which gives its episodes the seeds that
        ``engine.run_groups(tasks, seed_offset=seed_offset)`` gives them in one process.
        """
        if self.world_size == 1:
            return list(
                await engine.run_groups(make_env, tasks, env_id=env_id, seed_offset=seed_offset)
            )
        own = self.mine(len(tasks))
        done = await asyncio.gather(
            *(
                engine.run_groups(make_env, [tasks[i]], env_id=env_id, seed_offset=seed_offset + i)
                for i in own
            )
        )
        fault_hook(self.rank, self.step)
        parts = self.all_gather([(i, g) for i, (g,) in zip(own, done, strict=True)])
        by_index = dict(pair for part in parts for pair in part)
        return [by_index[i] for i in range(len(tasks))]


_active = Ranks()


def active() -> Ranks:
    """The ranks of this process (``world_size`` 1 outside :func:`process_group`)."""
    return _active


def fault_hook(rank: int, step: int, environ: dict[str, str] | None = None) -> None:
    """Raise (or hang) here when ``AGENTRL_FAULT`` names this rank and step (a test hook).

    Raises:
        RuntimeError: ``AGENTRL_FAULT=RANK:STEP`` names this rank and step.
    """
    spec = (os.environ if environ is None else environ).get(FAULT_ENV)
    if not spec:
        return
    at_rank, at_step, *how = spec.split(":")
    if int(at_rank) != rank or int(at_step) != step:
        return
    if how == ["hang"]:
        log.warning("%s=%s: rank %d hangs", FAULT_ENV, spec, rank)
        while True:
            time.sleep(3600)
    raise RuntimeError(f"injected failure ({FAULT_ENV}={spec})")


# ---------------------------------------------------------------- the process group


def world_from_env(environ: dict[str, str] | None = None) -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` as torchrun sets them (``(0, 0, 1)`` without)."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    return int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0")), world


@contextlib.contextmanager
def process_group(device: torch.device, timeout_s: float) -> Iterator[Ranks]:
    """Join the training ranks (from torchrun's environment) for the duration of a run.

    In one process (``WORLD_SIZE`` unset or 1) this yields the single rank and does nothing else.
    Else it initialises the default process group (NCCL for a CUDA ``device``, else gloo; a
    group the caller initialised is used as it is, and left to the caller) and a gloo group for
    objects, watches for other ranks' failures, and on the way out either waits for every rank
    and leaves the group, or (this rank raised) tells the others and re-raises the error as one
    that names the rank and step (:func:`failure_message`).

    Args:
        device: this rank's device (``model.device`` resolved for ``LOCAL_RANK``).
        timeout_s: timeout of every collective (``train.dist_timeout_s``).

    Raises:
        ConfigError: this rank's config or setup failed (names the rank).
        TrainingError: this rank failed while training (names the rank and step).
    """
    global _active
    _, _, world = world_from_env()
    joined = dist.is_available() and dist.is_initialized()  # by the caller: it leaves too
    if _active.world_size > 1 or (world <= 1 and not (joined and dist.get_world_size() > 1)):
        yield _active  # one process, or already inside a multi-process run
        return
    timeout = timedelta(seconds=timeout_s)
    if not joined and device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    elif not joined:
        dist.init_process_group("gloo", timeout=timeout)
    ranks = Ranks(rank=dist.get_rank(), world_size=dist.get_world_size(), timeout_s=timeout_s)
    ranks.group = dist.new_group(backend="gloo", timeout=timeout)
    ranks._watch = _FailureWatch(ranks)
    ranks._watch.start()
    _active = ranks
    if not ranks.is_main:  # progress and info are rank 0's; warnings and errors stay
        logging.getLogger("agentrl").setLevel(logging.WARNING)
    try:
        yield ranks
    except (KeyboardInterrupt, SystemExit, Stopped):  # every rank got it (torchrun forwards)
        ranks._watch.stop()
        raise
    except BaseException as exc:
        ranks._watch.stop()
        message = failure_message(exc, ranks)
        if not isinstance(exc, (ConfigError, TrainingError)) and not _timed_out(exc):
            traceback.print_exc(file=sys.stderr)  # an unexpected error: its traceback matters
        ranks._watch.post(message)
        if isinstance(exc, ConfigError):
            raise ConfigError(message) from exc
        raise TrainingError(message) from exc
    else:
        ranks._watch.stop()
        ranks.barrier()
        dist.destroy_process_group(ranks.group)
        if not joined:
            dist.destroy_process_group()
    finally:
        _active = Ranks()


def failure_message(exc: BaseException, ranks: Ranks) -> str:
    """``rank R failed at step S: ...`` (a timeout says which setting to raise)."""
    where = f"step {ranks.step}" if ranks.step else "step 0 (before the first step)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, ConfigError):
        return f"rank {ranks.rank}: {text}"
    if isinstance(exc, TrainingError):
        return f"rank {ranks.rank} failed at {where}: {text}"
    if _timed_out(exc):
        return (
            f"rank {ranks.rank} failed at {where}: no answer from the other ranks within "
            f"train.dist_timeout_s = {ranks.timeout_s:g} s (a rank died or hangs): {text}"
        )
    return f"rank {ranks.rank} failed at {where}: {type(exc).__name__}: {text}"


def _timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's timeout (gloo's message, or a timeout error type)."""
    return "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower()


class _FailureWatch:
    """Posts this rank's failure on the rendezvous store, and ends the process on another's.

    A rank blocked in a collective cannot be interrupted from Python, so the watcher thread
    prints the failing rank's message and exits the process itself (``os._exit(1)``).
    """

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"agentrl/{restart}/"  # a restarted worker group starts clean
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentrl-failure-watch", daemon=True)
        self.store: Any = None
        try:
            self.store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=30),
            )
        except (KeyError, RuntimeError, ValueError) as exc:  # no store: timeouts still apply
            log.warning("rank %d: no failure notices (%s); relying on timeouts", ranks.rank, exc)

    def start(self) -> None:
        """Start watching (a daemon thread)."""
        if self.store is not None:
            self._thread.start()

    def stop(self) -> None:
        """Stop watching (this rank is done or failing itself)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * _POLL_S + 1)

    def post(self, message: str) -> None:
        """Tell the other ranks that this one failed; wait briefly for them to read it."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}failed/{self.ranks.rank}", message)
            self.store.add(f"{self.prefix}failures", 1)
            deadline = time.monotonic() + _ACK_WAIT_S
            while time.monotonic() < deadline:  # rank 0 may host the store: let them read it
                if self.store.add(f"{self.prefix}acks", 0) >= self.ranks.world_size - 1:
                    break
                time.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 - best effort: the others time out otherwise
            log.warning("rank %d: could not post its failure: %s", self.ranks.rank, exc)

    def _failure(self) -> str | None:
        if self.store.add(f"{self.prefix}failures", 0) == 0:
            return None
        for r in range(self.ranks.world_size):
            key = f"{self.prefix}failed/{r}"
            if r != self.ranks.rank and self.store.check([key]):
                return bytes(self.store.get(key)).decode()
        return None

    def _run(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                message = self._failure()
            except Exception:  # noqa: BLE001 - the store went away (the run is ending)
                return
            if message is None or self._stop.is_set():
                continue
            with contextlib.suppress(Exception):
                self.store.add(f"{self.prefix}acks", 1)
                time.sleep(4 * 0.05)  # the poster sees the ack before a store it hosts goes away
            print(
                f"agentrl: error: {message} (rank {self.ranks.rank} stops too)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)


# ---------------------------------------------------------------- checks and files


# ---------------------------------------------------------------- the cold start


def cold_start_model(trainer: Any) -> tuple[torch.nn.Module, Callable[[], Awaitable[Any]]]:
    """The model a cold start fine-tunes and the push that serves it to the engines.

    One process: the policy itself and the trainer's weight sync. Several ranks: the learner's
    shards cannot run outside its FSDP root, so every rank fine-tunes the same unsharded float32
    replica of the initial policy (built again from the config: nothing has trained yet), alike
    (same demonstrations, same order), and :func:`adopt_cold_start` hands it to the learner.
    """
    if trainer.ranks.world_size == 1:
        return trainer.model, trainer.sync_weights
    from agentrl.loop.placement import load_policy

    device = trainer.learner.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model, _ = load_policy(trainer.config)  # seeds the RNG it builds with: leave ours be
    torch.nn.Module.to(model, torch.float32)  # float32, as the learner's master weights
    learner = trainer.learner
    shim = SimpleNamespace(
        model=model, export_dtype=learner.export_dtype, architecture=learner.architecture,
        device=device,
    )  # fmt: skip
    remote = trainer.run_dir / "weights" if trainer.config.inference.endpoints else None

    async def push() -> dict[str, float]:
        return await push_weights(
            shim, trainer.client, trainer.step, remote, trainer.tokenizer, trainer.weight_push
        )

    return model, push


def adopt_cold_start(learner: Any, model: torch.nn.Module) -> None:
    """Load a fine-tuned replica's weights (rank 0's) into the learner's shards (every rank)."""
    if model is learner.model:
        return
    from torch.distributed.tensor import distribute_tensor

    full = model.state_dict()
    with torch.no_grad():
        for name, value in learner.model.state_dict().items():  # views of the parameters
            src = full[name].to(device=learner.device, dtype=value.dtype)
            if hasattr(value, "device_mesh"):  # scattered from rank 0: every rank agrees
                src = distribute_tensor(src, value.device_mesh, value.placements)
            value.copy_(src)


# ---------------------------------------------------------------- weights


def sharded_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as held (DTensor shards under FSDP), one name per shared weight.

    Tied weights (a head tied to the embedding) appear once, under the name
    ``named_parameters`` gives them; an engine's strict load accepts that (the twin shares the
    storage). The choice is the same on every rank, so the gathers that follow pair up.
    """
    params = dict(model.named_parameters())  # one name per shared parameter
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in model.state_dict().items() if k in params or k not in every}


def gather_weights(
    model: torch.nn.Module, dtype: torch.dtype, keep: bool
) -> dict[str, torch.Tensor]:
    """Gather every weight of a sharded ``model``, one at a time (a collective per tensor).

    Returns:
        The full weights in ``dtype`` where ``keep`` (rank 0), else an empty dict (the rank
        only takes part in each gather).
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in sharded_weights(model).items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if keep:
            out[name] = full.detach().to(dtype)
        del full
    return out


async def push_weights(
    learner: Any,
    client: Any,
    version: int,
    remote_dir: Path | None,
    tokenizer: Any,
    distributed: Any = None,
) -> dict[str, float]:
    """Push the learner's weights as ``version`` with several ranks (every rank calls).

    :func:`agentrl.loop.placement.push_weights`'s arguments, for the ranks of :func:`active`.

    In process (``remote_dir`` is ``None``) each rank's engine loads the shards' full tensors
    one at a time, in place (the engine gathers each ``DTensor`` as it copies it). Remote, rank
    0 gathers the weights and pushes them once, over ``distributed`` (a
    :class:`~agentrl.inference.client.weight_push.DistributedWeightPush`, rank 0's) or as a
    safetensors checkpoint that ``/update_weights_from_disk`` loads; every rank then waits for
    the push.

    Returns:
        ``time/sync_s`` and, remote from disk, ``time/weight_write_s``.
    """
    from agentrl.learner.checkpoint import save_hf_checkpoint

    ranks = active()
    t = time.perf_counter()
    out: dict[str, float] = {}
    if remote_dir is None:
        await client.update_weights_from_state_dict(sharded_weights(learner.model), version)
        if learner.device.type == "cuda":
            torch.cuda.synchronize(learner.device)
    else:
        weights = gather_weights(learner.model, learner.export_dtype, keep=ranks.is_main)
        if ranks.is_main and distributed is not None:
            await distributed.push(weights, version)
        elif ranks.is_main:
            save_hf_checkpoint(
                learner.model,
                weights,
                remote_dir,
                architecture=learner.architecture,
                dtype=learner.export_dtype,
                tokenizer=tokenizer,
            )
            out["time/weight_write_s"] = time.perf_counter() - t
            await client.update_weights_from_disk(str(remote_dir.resolve()), version)
        del weights
        ranks.barrier()  # no rank rolls out before the endpoints serve the new version
    out["time/sync_s"] = time.perf_counter() - t
    return out
