"""Tests for :mod:`agentrl.kernels.attention` (packed causal GQA attention in Triton).

- Without Triton (CI) the whole file skips.
- CPU: the kernels run under the Triton interpreter in a subprocess (``TRITON_INTERPRET=1`` is
  read when kernels are decorated, so it must not leak into this process) that runs this file as
  a script and prints, per case, the errors of out, lse, dq, dk and dv against a float64
  per-sequence reference; the tests here assert on them. The subprocess also checks that
  ``torch.compile`` (``aot_eager``, full graph) gives eager's results, that the ops pass
  ``torch.library.opcheck`` and that bad offsets raise ValueError.
- GPU (skipped without CUDA): Qwen3-0.6B's heads in bf16 against float64, eager and compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]

# name -> lengths, query heads, KV heads, head dim, dtype, block configs (fwd, dq, dkdv) or None
CASES: dict[str, dict[str, Any]] = {
    "three_seqs_f32": {"lengths": [5, 37, 70], "hq": 4, "hkv": 2, "d": 16, "dtype": "float32"},
    "rect_tiles_f32": {
        "lengths": [5, 37, 70],
        "hq": 4,
        "hkv": 2,
        "d": 32,
        "dtype": "float32",
        "blocks": {"fwd": (32, 16), "dq": (32, 16), "dkdv": (16, 32)},
    },
    "one_seq_mha_f32": {"lengths": [45], "hq": 2, "hkv": 2, "d": 16, "dtype": "float32"},
    "short_and_empty_f32": {
        "lengths": [1, 20, 0, 1],
        "hq": 4,
        "hkv": 1,
        "d": 16,
        "dtype": "float32",
    },
    "three_seqs_f16": {"lengths": [5, 37, 70], "hq": 4, "hkv": 2, "d": 16, "dtype": "float16"},
}
TOLERANCE = {"float32": 1e-5, "float16": 3e-3}  # max |err| / max |reference|
TENSORS = ("out", "lse", "dq", "dk", "dv")


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 causal attention per sequence, KV heads repeated: ``(out, lse (Hq, total))``."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    outs, lses, start = [], [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs), torch.cat(lses, 1)


def _inputs(
    lengths: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    q, k, v, dout = (
        randn(total, hq, d),
        randn(total, hkv, d),
        randn(total, hkv, d),
        randn(total, hq, d),
    )
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    return q, k, v, dout, cu


def _relative_errors(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, float]:
    errors = {}
    for name in TENSORS:
        a, b = got[name].double(), want[name].double()
        assert a.shape == b.shape, (name, a.shape, b.shape)
        err = (a - b).abs().max().item() if a.isfinite().all() else float("inf")
        errors[name] = err / max(b.abs().max().item(), 1e-30)
    return errors


def _attention_and_grads(
    attend: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
) -> dict[str, torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


# ----------------------------------------------------------------------------------------------
# The interpreter script (runs in a subprocess with TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter calls ``int()`` on 1-element arrays; numpy >= 2.4 refuses that.

    Same one-line fix as triton-lang/triton#9171: take the element explicitly. Loops with
    run-time bounds need it.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _interpreter_case(spec: dict[str, Any], seed: int) -> dict[str, float]:
    from agentrl.kernels import attention as ta

    dtype = getattr(torch, spec["dtype"])
    lengths = spec["lengths"]
    q, k, v, dout, cu = _inputs(lengths, spec["hq"], spec["hkv"], spec["d"], dtype, "cpu", seed)
    scale = spec["d"] ** -0.5
    max_len = max(lengths)
    for name in ("fwd", "dq", "dkdv"):
        blocks = spec.get("blocks", {}).get(name)
        ta.CONFIG[name] = (
            ta.KernelConfig(blocks[0], blocks[1], num_warps=1, num_stages=1) if blocks else None
        )
    try:
        got = _attention_and_grads(
            lambda q, k, v: ta.varlen_attention(q, k, v, cu, max_len, scale), q, k, v, dout
        )
        got["lse"] = ta.varlen_attn_fwd(q, k, v, cu, max_len, scale)[1]
    finally:
        ta.CONFIG.update(dict.fromkeys(ta.CONFIG))
    want = _attention_and_grads(
        lambda q, k, v: reference(q, k, v, lengths, scale)[0],
        q.double(),
        k.double(),
        v.double(),
        dout.double(),
    )
    want["lse"] = reference(q, k, v, lengths, scale)[1]
    return _relative_errors(got, want)


def _interpreter_compile_check() -> float:
    """Largest difference between eager and ``torch.compile`` (aot_eager) results and grads."""
    from agentrl.kernels.attention import varlen_attention

    lengths = [9, 30]
    q, k, v, dout, cu = _inputs(lengths, 4, 2, 16, torch.float32, "cpu", seed=7)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(q * 2.0, k, v, cu, 30, 0.25) + 1.0

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    eager = _attention_and_grads(attend, q, k, v, dout)
    traced = _attention_and_grads(compiled, q, k, v, dout)
    return max((eager[n] - traced[n]).abs().max().item() for n in ("out", "dq", "dk", "dv"))


def _interpreter_opcheck() -> list[str]:
    """``torch.library.opcheck`` on both ops; returns the names of failed checks."""
    from agentrl.kernels import attention as ta

    q, k, v, dout, cu = _inputs([3, 18], 2, 1, 16, torch.float32, "cpu", seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ta.varlen_attn_fwd(q, k, v, cu, 18, 0.25)
    failed = []
    for op, args in (
        (ta.varlen_attn_fwd, (q, k, v, cu, 18, 0.25)),
        (
            ta.varlen_attn_bwd,
            (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, cu, 18, 0.25),
        ),
    ):
        result = torch.library.opcheck(op, args)
        failed += [f"{op}: {name}" for name, status in result.items() if status != "SUCCESS"]
    return failed


def _interpreter_bad_offsets() -> list[str]:
    """Offsets that must raise ValueError; returns those that did not."""
    from agentrl.kernels.attention import varlen_attention

    q, k, v, _, _ = _inputs([10], 2, 1, 16, torch.float32, "cpu", seed=0)
    bad = {
        "not starting at 0": ([1, 10], 10),
        "not ending at total": ([0, 8], 10),
        "decreasing": ([0, 6, 4, 10], 10),
        "max_len too short": ([0, 4, 10], 5),
    }
    missed = []
    for name, (offsets, max_len) in bad.items():
        cu = torch.tensor(offsets, dtype=torch.int32)
        try:
            varlen_attention(q, k, v, cu, max_len, 0.25)
        except ValueError:
            continue
        missed.append(name)
    return missed


def _interpreter_main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _fix_interpreter_index()
    torch.manual_seed(0)
    report: dict[str, Any] = {
        "cases": {
            name: _interpreter_case(spec, seed=i) for i, (name, spec) in enumerate(CASES.items())
        },
        "compile_diff": _interpreter_compile_check(),
        "opcheck_failed": _interpreter_opcheck(),
        "bad_offsets_missed": _interpreter_bad_offsets(),
    }
    print("RESULT " + json.dumps(report))


def run_under_interpreter(script: str) -> dict[str, Any]:
    """`python SCRIPT --interpreter` under `TRITON_INTERPRET=1`: its `RESULT` line's JSON."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, script, "--interpreter"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    report: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return report


@pytest.fixture(scope="module")
def interpreter_report() -> dict[str, Any]:
    return run_under_interpreter(str(Path(__file__).resolve()))


@pytest.mark.parametrize("case", list(CASES))
def test_interpreter_matches_float64_reference(
    interpreter_report: dict[str, Any], case: str
) -> None:
    errors = interpreter_report["cases"][case]
    tol = TOLERANCE[CASES[case]["dtype"]]
    for name in TENSORS:
        assert errors[name] <= tol, (case, name, errors)


def test_interpreter_compile_matches_eager(interpreter_report: dict[str, Any]) -> None:
    assert interpreter_report["compile_diff"] <= 1e-6


def test_interpreter_opcheck(interpreter_report: dict[str, Any]) -> None:
    assert interpreter_report["opcheck_failed"] == []


def test_interpreter_bad_offsets_raise(interpreter_report: dict[str, Any]) -> None:
    assert interpreter_report["bad_offsets_missed"] == []


# ----------------------------------------------------------------------------------------------
# Input validation (this process: errors raised before any kernel launch)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "cu_dtype", "dtype", "match"),
    [
        ((10, 4, 16), (10, 3, 16), torch.int32, torch.float32, "multiple of KV heads"),
        ((10, 4, 16), (9, 2, 16), torch.int32, torch.float32, "token counts or head dims"),
        ((10, 4, 24), (10, 2, 24), torch.int32, torch.float32, "head dim 24"),
        ((10, 4, 256), (10, 2, 256), torch.int32, torch.float32, "head dim 256"),
        ((10, 4, 16), (10, 2, 16), torch.int64, torch.float32, "int32"),
        ((10, 4, 16), (10, 2, 16), torch.int32, torch.float64, "dtypes"),
        ((10, 64), (10, 2, 16), torch.int32, torch.float32, "expected \\(total, heads"),
    ],
)
def test_bad_inputs_raise(
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    cu_dtype: torch.dtype,
    dtype: torch.dtype,
    match: str,
) -> None:
    from agentrl.kernels.attention import varlen_attention

    q, k = torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)
    cu = torch.tensor([0, 10], dtype=cu_dtype)
    with pytest.raises(ValueError, match=match):
        varlen_attention(q, k, k, cu, 10, 0.25)


def test_k_v_shape_mismatch_raises() -> None:
    from agentrl.kernels.attention import varlen_attention

    q, k, v = torch.randn(10, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 1, 16)
    with pytest.raises(ValueError, match="k and v shapes differ"):
        varlen_attention(q, k, v, torch.tensor([0, 10], dtype=torch.int32), 10, 0.25)


def test_bad_block_config_raises() -> None:
    from agentrl.kernels import attention as ta

    ta.CONFIG["dkdv"] = ta.KernelConfig(block_m=64, block_n=32)
    try:
        with pytest.raises(ValueError, match="bad tile shape"):
            ta._config("dkdv")
    finally:
        ta.CONFIG["dkdv"] = None


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_qwen3_shapes_bf16_eager_and_compiled() -> None:
    from agentrl.kernels.attention import varlen_attention, varlen_attn_fwd

    lengths = [1000, 1537, 773, 811, 95]
    hq, hkv, d, scale, max_len = 16, 8, 128, 128**-0.5, 1537
    q, k, v, dout, cu = _inputs(lengths, hq, hkv, d, torch.bfloat16, "cuda", seed=11)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(q, k, v, cu, max_len, scale)

    got = _attention_and_grads(attend, q, k, v, dout)
    got["lse"] = varlen_attn_fwd(q, k, v, cu, max_len, scale)[1]
    want = _attention_and_grads(
        lambda q, k, v: reference(q, k, v, lengths, scale)[0],
        q.double(),
        k.double(),
        v.double(),
        dout.double(),
    )
    want["lse"] = reference(q, k, v, lengths, scale)[1]
    errors = {n: (got[n].double() - want[n]).abs().max().item() for n in TENSORS}
    limits = {"out": 2e-2, "lse": 1e-2, "dq": 6e-2, "dk": 6e-2, "dv": 6e-2}
    assert all(errors[n] < limits[n] for n in TENSORS), errors

    compiled = _attention_and_grads(torch.compile(attend, fullgraph=True), q, k, v, dout)
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(compiled[name], got[name], atol=0, rtol=0)


if __name__ == "__main__" and "--interpreter" in sys.argv:
    _interpreter_main()
