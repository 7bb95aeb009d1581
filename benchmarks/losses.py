"""Time and peak memory of one forward+backward of each loss at B=64, T=8,192 (and 2k, 32k).

Shows that the losses stay O(B*T): the peak extra memory, in units of one (B, T) float32 tensor,
does not grow with T, and no op produces a tensor larger than (B, T) (no (B, T, T), no vocab).

Memory is measured as:
* CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before the call;
* CPU (Linux/glibc): peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``)
  above the resident memory before the call, with glibc told to ``mmap`` every block over
  64 KiB and ``malloc_trim`` run first, so that freed memory is not resident;
* both: the largest tensor any op produced (a ``TorchDispatchMode`` over forward and backward).

Usage: ``python benchmarks/losses.py [--batch 64] [--tokens 2048 8192 32768] [--reps 5]``.
The last line printed is one JSON object with the headline figures and the machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from agentrl.learner.losses import grpo_loss, gspo_loss, gspo_token_loss, kl_to_reference

LOSSES: dict[str, Callable[..., tuple[torch.Tensor, object]]] = {
    "gspo": lambda lp, old, a, m: gspo_loss(lp, old, a[:, 0], m),
    "gspo_token": lambda lp, old, a, m: gspo_token_loss(lp, old, a, m),
    "grpo": lambda lp, old, a, m: grpo_loss(lp, old, a, m),
    "kl_to_reference": lambda lp, old, a, m: kl_to_reference(lp, old, m),
}


class LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def cpu_peak_supported() -> bool:
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: mmap blocks > 64 KiB
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        _status_kib("VmHWM")
        return True
    except (OSError, KeyError):
        return False


def make_inputs(batch: int, tokens: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    old = -3.0 * torch.rand(batch, tokens, generator=g)
    lp = old + 5e-4 * torch.randn(batch, tokens, generator=g)
    mask = torch.rand(batch, tokens, generator=g) > 0.3
    adv = torch.randn(batch, 1, generator=g).expand(batch, tokens).contiguous()
    return [t.to(device) for t in (lp, old, adv, mask)]


def run_once(fn, lp, old, adv, mask) -> None:
    leaf = lp.detach().requires_grad_()
    loss, _ = fn(leaf, old, adv, mask)
    loss.backward()


def time_loss(name: str, batch: int, tokens: int, device: torch.device, reps: int) -> float:
    """Median seconds of one forward+backward, after a warm-up call."""
    fn = LOSSES[name]
    lp, old, adv, mask = make_inputs(batch, tokens, device)
    run_once(fn, lp, old, adv, mask)  # warm-up (lazy init, kernel selection)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        run_once(fn, lp, old, adv, mask)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_loss(name: str, batch: int, tokens: int, device: torch.device, cpu_peak: bool):
    """Peak extra bytes of one forward+backward (None if unmeasurable) and the largest tensor."""
    fn = LOSSES[name]
    lp, old, adv, mask = make_inputs(batch, tokens, device)
    run_once(fn, lp, old, adv, mask)
    peak: float | None = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run_once(fn, lp, old, adv, mask)
        peak = float(torch.cuda.max_memory_allocated(device) - before)
    elif cpu_peak:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back: reuse faults them in
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        run_once(fn, lp, old, adv, mask)
        peak = 1024.0 * (_status_kib("VmHWM") - before)
    with LargestTensor() as rec:
        run_once(fn, lp, old, adv, mask)
    return peak, rec.largest


def memory_probe(args: argparse.Namespace, device: torch.device) -> None:
    """Child process: measure memory of every case on a clean heap, print one JSON line."""
    cpu_peak = device.type == "cpu" and cpu_peak_supported()
    out = [
        [name, t, *memory_loss(name, args.batch, t, device, cpu_peak)]
        for t in sorted(args.tokens)
        for name in LOSSES
    ]
    print(json.dumps(out))


def measure_all(args: argparse.Namespace, device: torch.device) -> list[dict]:
    cases = [(name, t) for t in sorted(args.tokens) for name in LOSSES]
    times = {c: time_loss(c[0], args.batch, c[1], device, args.reps) for c in cases}
    # memory in a fresh process: a heap that timing runs have fragmented would inflate RSS
    cmd = [
        sys.executable,
        __file__,
        "--memory-probe",
        "--device",
        device.type,
        "--batch",
        str(args.batch),
        "--tokens",
        *map(str, args.tokens),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    probe = subprocess.run(cmd, capture_output=True, text=True, check=True)
    memory = {
        (n, t): (peak, largest) for n, t, peak, largest in json.loads(probe.stdout.splitlines()[-1])
    }
    rows = []
    for name, tokens in cases:
        peak, largest = memory[(name, tokens)]
        unit = args.batch * tokens * 4  # one (B, T) float32 tensor
        rows.append(
            {
                "loss": name,
                "T": tokens,
                "ms": 1e3 * times[(name, tokens)],
                "peak_mib": None if peak is None else peak / 2**20,
                "peak_bt_units": None if peak is None else peak / unit,
                "largest_over_bt": largest / (args.batch * tokens),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--headline-tokens", type=int, default=8192, help="T of the JSON line")
    parser.add_argument("--memory-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.memory_probe:
        memory_probe(args, device)
        return
    rows = measure_all(args, device)
    print(
        f"device: {machine(device)} ({device.type}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, B={args.batch}, float32 inputs"
    )
    print(
        f"{'loss':<16}{'T':>7}{'fwd+bwd ms':>12}{'peak MiB':>10}{'peak/(B*T*4B)':>15}"
        f"{'largest/(B*T)':>15}"
    )
    for r in rows:
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        units = "n/a" if r["peak_bt_units"] is None else f"{r['peak_bt_units']:.1f}"
        print(
            f"{r['loss']:<16}{r['T']:>7}{r['ms']:>12.2f}{peak:>10}{units:>15}"
            f"{r['largest_over_bt']:>15.2f}"
        )
    top = args.headline_tokens if args.headline_tokens in args.tokens else max(args.tokens)
    headline: dict[str, object] = {"benchmark": "losses", "B": args.batch, "T": top}
    for r in rows:
        if r["T"] == top:
            headline[f"{r['loss']}_ms"] = round(r["ms"], 3)
            if r["peak_mib"] is not None:
                headline[f"{r['loss']}_peak_mib"] = round(r["peak_mib"], 2)
    headline["max_largest_over_bt"] = max(r["largest_over_bt"] for r in rows)
    units = [r["peak_bt_units"] for r in rows if r["peak_bt_units"] is not None]
    headline["max_peak_bt_units"] = round(max(units), 2) if units else None
    headline["machine"] = {
        "device": device.type,
        "name": machine(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
