"""The head's Triton kernels against the reference torch code.

On CPU they run in Triton's interpreter (a subprocess: interpreter mode is fixed when kernels
are defined); on CUDA also at the real vocabulary size. Skipped where Triton is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from agentrl.kernels import head as head_kernels  # noqa: E402
from agentrl.learner.logprobs import _dlogits, _logprob_lse  # noqa: E402

_CHECK = """
import torch
from agentrl.kernels import head as head_kernels
from agentrl.learner.logprobs import _dlogits, _logprob_lse
g = torch.Generator().manual_seed(0)
for c, vocab, inv_t in ((7, 5000, 1.0), (3, 4096, 1 / 0.7), (1, 9000, 1.0)):
    logits = torch.randn(c, vocab, generator=g) * 4
    targets = torch.randint(0, vocab, (c,), generator=g)
    up = torch.randn(c, generator=g)
    out, lse = head_kernels.logprob_lse(logits, targets, inv_t)
    ref_out, ref_lse = _logprob_lse(logits.double(), targets, inv_t)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    grad = head_kernels.dlogits(logits, lse, up, targets, inv_t, torch.float32)
    ref = _dlogits(logits.double(), ref_lse, up.double(), targets, inv_t, torch.float64)
    torch.testing.assert_close(grad.double(), ref, atol=5e-6, rtol=0)
print("ok")
"""


def test_kernels_match_the_reference_in_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run(
        [sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


@pytest.mark.gpu
def test_kernels_match_the_reference_on_cuda() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    c, vocab, inv_t = 1024, 151936, 1.0
    logits = torch.randn(c, vocab, device="cuda", generator=g) * 4
    targets = torch.randint(0, vocab, (c,), device="cuda", generator=g)
    up = torch.randn(c, device="cuda", generator=g)
    out, lse = head_kernels.logprob_lse(logits, targets, inv_t)
    ref_out, ref_lse = _logprob_lse(logits.double(), targets, inv_t)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)
    grad = head_kernels.dlogits(logits, lse, up, targets, inv_t, torch.bfloat16)
    ref = _dlogits(logits.double(), ref_lse, up.double(), targets, inv_t, torch.float64)
    torch.testing.assert_close(grad.double(), ref, atol=1e-2, rtol=1e-2)  # bf16 output


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="float32"):
        head_kernels.logprob_lse(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match="targets"):
        head_kernels.dlogits(
            torch.zeros(2, 8), torch.zeros(2), torch.zeros(2), torch.zeros(3), 1.0, torch.float32
        )
