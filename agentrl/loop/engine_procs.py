"""Dedicated inference cards: ``inference.engine_gpus = K`` starts K ``agentrl serve`` processes.

The layout people run at scale: some cards generate, the rest train, and the weights go from
the learner to the engines over a process group. With ``engine_gpus = K`` (and no
``inference.endpoints``) :func:`start_engines` starts K servers (the embedded engine behind
SGLang's API, ``agentrl serve --config``: the policy and engine ``agentrl train`` would build),
each on loopback with a port of its own and generated API and admin keys, waits for their
``/health``, and the run then goes as with ``inference.endpoints`` on them and
``inference.weight_sync = "distributed"`` (NCCL from a learner on a card, gloo on the CPU):
partial rollouts, bounded staleness and several endpoints work as they do remotely.

**Cards.** On one host with N cards, the learner keeps the cards it has without this setting
(card ``LOCAL_RANK`` per rank under ``torchrun``, or ``model.device``) and the engines take the
next K: ``torchrun --nproc-per-node N-K -m agentrl.cli train ... --inference.engine_gpus=K``
puts the learner ranks on cards 0..N-K-1 and the engines on N-K..N-1 (each sees only its card,
through ``CUDA_VISIBLE_DEVICES``). One process: the learner on card 0, the engines on 1..K.
Rank 0 starts the engines; every rank rolls out on all of them. A learner on the CPU gets K
engines on the CPU (the tests). Several hosts: not here (the engines listen on loopback); use
``inference.endpoints`` for a fleet elsewhere.

**Lifecycle.** The servers stop (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`, waited
for) when the run's client closes, which the trainer does at the end of every run, failed,
stopped by a signal or finished; when assembling the run fails; and at interpreter exit. They
run in a session of their own, so the terminal's Ctrl-C reaches the trainer alone (it ends its
step and checkpoints while they still serve); and each asks the kernel to SIGKILL it when the
trainer dies (Linux ``PR_SET_PDEATHSIG``; a polling thread elsewhere), so a trainer that is
SIGKILLed or leaves through ``os._exit`` leaves no server behind. ``RUN_DIR/engines/`` holds
their config, keys (mode 0600, deleted at the stop), logs and ``engines.json`` (urls, pids,
cards).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import runpy
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import yaml

from agentrl.config import TrainConfig
from agentrl.errors import ConfigError, TrainingError
from agentrl.inference.client.sglang_client import SGLangClient
from agentrl.loop import ranks as dist_ranks

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0
"""How long an engine may take to load its model and answer ``/health``."""
STOP_GRACE_S = 10.0
"""How long a server may take to exit on SIGTERM before it is SIGKILLed."""
_LISTENING = re.compile(r"agentrl serve: listening on (http://\S+)")
_PR_SET_PDEATHSIG = 1


def engine_cards(
    k: int, learner_cards: list[int], device_count: int, visible: str | None = None
) -> list[str]:
    """The physical cards (``CUDA_VISIBLE_DEVICES`` entries) of ``k`` engines.

    Args:
        k: ``inference.engine_gpus``.
        learner_cards: the cards (as this process numbers them) the learner's ranks use.
        device_count: the cards this process sees.
        visible: this process's ``CUDA_VISIBLE_DEVICES`` (its entries name the cards).

    Raises:
        ConfigError: fewer than ``k`` cards are left beside the learner's.
    """
    free = [c for c in range(device_count) if c not in learner_cards]
    if len(free) < k:
        raise ConfigError(
            f"inference.engine_gpus: {k} engine cards asked for, {len(free)} left of "
            f"{device_count} beside the learner's {len(learner_cards)} (on N cards run "
            "torchrun --nproc-per-node N-K)"
        )
    names = [v.strip() for v in visible.split(",")] if visible else []
    return [names[c] if c < len(names) else str(c) for c in free[:k]]


class EngineProcs:
    """The ``agentrl serve`` processes of one run (rank 0's), and how to stop them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self.key_files = (root / "api_key", root / "admin_key")

    def start(self, config: TrainConfig, cards: list[str | None]) -> None:
        """Start one server per entry of ``cards`` (``None``: on the CPU), then wait for all."""
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.key_files:
            _write_secret(path, secrets.token_urlsafe(32))
        atexit.register(self.stop)
        served = config.model_copy(deep=True)
        served.inference.engine_gpus = None
        for i, card in enumerate(cards):
            served.model.device = "cpu" if card is None else "cuda:0"  # the one card it sees
            config_path = self.root / f"engine-{i}.yaml"
            config_path.write_text(yaml.safe_dump(served.model_dump(mode="json"), sort_keys=False))
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if card is not None:
                env["CUDA_VISIBLE_DEVICES"] = card
            cmd = [sys.executable, "-m", "agentrl.loop.engine_procs", str(os.getpid()), "serve",
                   "--config", str(config_path), "--host", "127.0.0.1", "--port", "0",
                   "--api-key", f"file:{self.key_files[0]}",
                   "--admin-api-key", f"file:{self.key_files[1]}",
                   "--log-level", "WARNING"]  # fmt: skip
            with open(self.root / f"engine-{i}.log", "wb") as out:
                self.procs.append(subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    start_new_session=True,  # the terminal's Ctrl-C goes to the trainer alone
                ))  # fmt: skip
        self.urls = [self._ready(i) for i in range(len(cards))]
        record = {"urls": self.urls, "pids": [p.pid for p in self.procs], "cards": cards}
        (self.root / "engines.json").write_text(json.dumps(record))
        log.info("dedicated engines: %s on cards %s", ", ".join(self.urls), cards)

    def _ready(self, i: int) -> str:
        """Engine ``i``'s URL, once it answers ``/health``."""
        proc, log_path = self.procs[i], self.root / f"engine-{i}.log"
        deadline = time.monotonic() + START_TIMEOUT_S
        url = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_bytes()[-2000:].decode(errors="replace").strip()
                last = tail.splitlines()[-1] if tail else "(no output)"
                raise TrainingError(
                    f"inference.engine_gpus: engine {i} exited with {proc.returncode} while "
                    f"starting: {last} (log: {log_path})"
                )
            if url is None:
                found = _LISTENING.search(log_path.read_bytes()[:65536].decode(errors="replace"))
                url = found.group(1) if found else None
            if url is not None and _healthy(url):
                return url
            time.sleep(0.1)
        raise TrainingError(
            f"inference.engine_gpus: engine {i} did not answer /health within "
            f"{START_TIMEOUT_S:.0f} s (log: {log_path})"
        )

    def stop(self) -> None:
        """Terminate every server and wait for it (SIGKILL after the grace); idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                log.warning("engine pid %d ignored SIGTERM for %.0f s: killed", proc.pid,
                            STOP_GRACE_S)  # fmt: skip
                proc.kill()
                proc.wait()
        for path in self.key_files:
            path.unlink(missing_ok=True)
        atexit.unregister(self.stop)


class DedicatedClient(SGLangClient):
    """The run's client of its own engines; closing it stops them (rank 0's).

    Under ``torchrun`` the trainer asks every rank to load the new weights in place
    (:func:`agentrl.loop.ranks.push_weights` with no ``inference.endpoints``):
    :meth:`update_weights_from_state_dict` gathers the shards and rank 0 pushes them once.
    """

    def __init__(self, endpoints: list[str], procs: EngineProcs | None, **options: Any) -> None:
        super().__init__(endpoints, **options)
        self.procs = procs
        self.weight_push: Any = None
        """Rank 0's :class:`~agentrl.inference.client.weight_push.DistributedWeightPush`."""
        self.dtype = torch.float32

    async def update_weights_from_state_dict(
        self, weights: dict[str, torch.Tensor], weight_version: int
    ) -> None:
        """Gather ``weights`` (FSDP shards: every rank calls) and push them from rank 0."""
        ranks = dist_ranks.active()
        full: dict[str, torch.Tensor] = {}
        for name, value in weights.items():  # one collective per tensor, in the same order
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            if ranks.is_main:
                full[name] = whole.detach().to(self.dtype)
            del whole
        if ranks.is_main:
            if self.weight_push is None:
                raise TrainingError("inference.engine_gpus: no weight push to the engines")
            await self.weight_push.push(full, weight_version)
        del full
        ranks.barrier()  # no rank rolls out before the engines serve the new version

    async def aclose(self) -> None:
        """Close the HTTP session, then stop the engines (rank 0)."""
        await super().aclose()
        if self.procs is not None:
            self.procs.stop()


def start_engines(config: TrainConfig, run_dir: Path, model: Any) -> tuple[TrainConfig, Any]:
    """Start ``inference.engine_gpus`` servers (rank 0) and make every rank's client of them.

    Returns:
        The config as the run's client and weight push see it (``inference.endpoints`` the
        servers, ``weight_sync`` distributed, their keys), and the :class:`DedicatedClient`.

    Raises:
        ConfigError: too few cards, or several hosts.
        TrainingError: a server did not start (on every rank).
    """
    ranks = dist_ranks.active()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world_size))
    if local != ranks.world_size:
        raise ConfigError(
            "inference.engine_gpus: engines on one host only (they listen on loopback); "
            "for servers on other hosts use inference.endpoints"
        )
    device = next(model.parameters()).device
    procs = EngineProcs(run_dir / "engines") if ranks.is_main else None
    failed = None
    if procs is not None:
        k = int(config.inference.engine_gpus or 0)
        try:
            cards: list[str | None] = [None] * k
            if device.type == "cuda":
                learner = list(range(ranks.world_size)) if ranks.world_size > 1 else [device.index]
                cards = list(engine_cards(k, learner, torch.cuda.device_count(),
                                          os.environ.get("CUDA_VISIBLE_DEVICES")))  # fmt: skip
            procs.start(config, cards)
        except BaseException as exc:
            procs.stop()
            if ranks.world_size == 1 or not isinstance(exc, Exception):
                raise
            failed = f"{type(exc).__name__}: {exc}"
    urls, failed = ranks.broadcast((procs.urls if procs else None, failed))
    if failed:
        raise TrainingError(failed)
    root = run_dir / "engines"
    inference = config.inference.model_copy(update={
        "endpoints": urls, "weight_sync": "distributed", "engine_gpus": None,
        "weight_sync_address": "127.0.0.1", "api_key": f"file:{root / 'api_key'}",
        "admin_api_key": f"file:{root / 'admin_key'}",
    })  # fmt: skip
    served = config.model_copy(update={"inference": inference})
    try:
        options = inference.client_options()
        from agentrl.routing import is_moe, routing_shape

        if is_moe(model):
            options["routed_experts_shape"] = routing_shape(model)[:2]
        client = DedicatedClient(urls, procs, **options)
    except BaseException:
        if procs is not None:
            procs.stop()
        raise
    client.dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
    return served, client


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def _write_secret(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)  # a file left by a crash may have other modes
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (the trainer) dies, however it dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="agentrl-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # it died before the request above was made
        os._exit(1)


def _child_main(argv: list[str]) -> None:
    """``python -m agentrl.loop.engine_procs PARENT_PID serve ...``: ``agentrl serve``, for life.

    It ends when the trainer ``PARENT_PID`` does (:func:`_die_with_parent`).
    """
    _die_with_parent(int(argv[0]))
    sys.argv = ["agentrl", *argv[1:]]
    runpy.run_module("agentrl.cli", run_name="__main__")  # by name: the CLI imports the loop


if __name__ == "__main__":
    _child_main(sys.argv[1:])
