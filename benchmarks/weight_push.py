"""Weight push to a server: from disk vs broadcast over a process group (SGLang's protocol).

For each shape (random weights from config, no download) one ``agentrl serve --model DIR``
subprocess serves the model, then this process pushes new weights as a trainer would:

* ``disk``: write the HF checkpoint (safetensors) and ``POST /update_weights_from_disk``;
* ``distributed``: :class:`~agentrl.inference.client.weight_push.DistributedWeightPush`
  broadcasts the state dict bucket by bucket (``/update_weights_from_distributed``): NCCL
  between two GPUs (this process on ``cuda:0``, the server on ``cuda:1``), gloo on a CPU-only
  host.

The first distributed push also forms the group; it is reported apart. Medians of ``--repeats``.

Usage: ``python benchmarks/weight_push.py [--shapes qwen3-0.6b qwen3-1.7b] [--repeats 3]``
(on a CPU host: ``--shapes tiny``). Last line: JSON with ``nccl_push_s`` (or ``gloo_push_s``),
``disk_push_s``, ``speedup`` per shape, and ``card``.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _serve import start_server, stop_server  # noqa: E402 - benchmarks/ is a folder of scripts

from agentrl.inference.client.sglang_client import SGLangClient  # noqa: E402
from agentrl.inference.client.weight_push import DistributedWeightPush  # noqa: E402
from agentrl.tiny import QWEN3_0_6B_SHAPE, build_tiny_model, build_tiny_tokenizer  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "qwen3-0.6b": dict(QWEN3_0_6B_SHAPE),
    "qwen3-1.7b": dict(QWEN3_0_6B_SHAPE, hidden_size=2048, intermediate_size=6144),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def watched(coro: Any, proc: subprocess.Popen[str], log: Path, limit_s: float) -> Any:
    """``await coro``; past ``limit_s``, print both sides' stacks and the server's log, exit 3.

    A push stuck in a collective never returns: the thread that broadcasts cannot be
    cancelled, so the process exits rather than wait for it.
    """
    # a C-level watchdog too: it prints this side's stacks even if a thread holds the GIL and
    # the event loop (and so ``wait_for``) never runs again
    faulthandler.dump_traceback_later(limit_s + 10, exit=True)
    try:
        return await asyncio.wait_for(coro, limit_s)
    except TimeoutError:
        err = sys.stderr
        print(f"\npush stalled for {limit_s:.0f} s; this side's threads:", file=err, flush=True)
        faulthandler.dump_traceback(file=err, all_threads=True)
        proc.send_signal(signal.SIGUSR1)  # agentrl serve prints its threads' stacks
        time.sleep(3)
        tail = log.read_text(errors="replace").splitlines()[-200:]
        print("the server's last output:\n" + "\n".join(tail), file=err, flush=True)
        proc.kill()
        os._exit(3)
    finally:
        faulthandler.cancel_dump_traceback_later()


async def measure(
    name: str, repeats: int, gpus: int, watchdog_s: float = 180.0
) -> dict[str, Any]:
    here = "cuda:0" if gpus >= 2 else "cpu"
    there = "cuda:1" if gpus >= 2 else "cpu"
    dtype = torch.bfloat16 if gpus >= 2 else torch.float32
    tok = build_tiny_tokenizer()
    if SHAPES[name]:  # the real vocabulary's size: the embedding is a large part of the bytes
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**SHAPES[name], eos_token_id=tok.eos_token_id, pad_token_id=0)
        with torch.device(here):  # random init of 1.7B parameters on a CPU takes minutes
            model = Qwen3ForCausalLM(cfg).to(dtype)
    else:
        model = build_tiny_model(tok).to(dtype)
    params = sum(p.numel() for p in model.parameters())
    work = Path(tempfile.mkdtemp(prefix=f"push_{name}_"))
    model.save_pretrained(work / "init")
    tok.save_pretrained(work / "init")
    model = model.to(here)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    server_log = Path(os.environ.get("WEIGHT_PUSH_SERVER_LOG", work / "server.log"))
    proc, url = start_server(
        ["--model", str(work / "init"), "--device", there, "--weights-dir", str(work)], server_log
    )
    out: dict[str, Any] = {"params": params, "bytes": sum(t.numel() * t.element_size()
                                                          for t in weights.values())}
    try:
        async with SGLangClient(url, timeout_s=600) as client:
            disk = []
            for k in range(repeats):
                t = time.perf_counter()
                model.save_pretrained(work / "push")  # what Learner.save_pretrained writes
                await client.update_weights_from_disk(str(work / "push"), 100 + k)
                disk.append(time.perf_counter() - t)
            push = DistributedWeightPush(
                [url], master_address="127.0.0.1", master_port=free_port(),
                backend="nccl" if gpus >= 2 else "gloo", device=here, timeout_s=600,
            )  # fmt: skip
            try:
                first = await watched(push.push(weights, 200), proc, server_log, watchdog_s)
                dist = [
                    await watched(push.push(weights, 201 + k), proc, server_log, watchdog_s)
                    for k in range(repeats)
                ]
            finally:
                await push.aclose()
            assert (await client.model_info())["weight_version"] == str(200 + repeats)
    finally:
        stop_server(proc)
    out.update(disk_s=statistics.median(disk), push_s=statistics.median(dist), first_push_s=first)
    out["speedup"] = out["disk_s"] / out["push_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"], choices=SHAPES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--watchdog-s", type=float, default=180.0,
                    help="a push stalled this long prints both sides' stacks and exits 3")
    args = ap.parse_args()
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    card = torch.cuda.get_device_name(0) if gpus else "cpu"
    results: dict[str, dict[str, Any]] = {}
    for name in args.shapes:
        r = results[name] = asyncio.run(measure(name, args.repeats, gpus, args.watchdog_s))
        print(f"[progress] {name}: disk {r['disk_s']:.3f} s, {backend} {r['push_s']:.3f} s "
              f"(first {r['first_push_s']:.3f} s)", flush=True)
    print(f"weight push on {card} x{max(gpus, 1)} ({backend}); medians of {args.repeats}")
    print(f"{'shape':<12}{'GB':>7}{'disk s':>9}{backend + ' s':>9}{'first s':>9}{'speedup':>9}")
    for name, r in results.items():
        print(f"{name:<12}{r['bytes'] / 1e9:>7.2f}{r['disk_s']:>9.3f}{r['push_s']:>9.3f}"
              f"{r['first_push_s']:>9.3f}{r['speedup']:>8.1f}x")  # fmt: skip
    print(json.dumps({
        f"{backend}_push_s": {n: round(r["push_s"], 4) for n, r in results.items()},
        "disk_push_s": {n: round(r["disk_s"], 4) for n, r in results.items()},
        "speedup": {n: round(r["speedup"], 2) for n, r in results.items()},
        "bytes": {n: r["bytes"] for n, r in results.items()},
        "card": card, "gpus": gpus,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
