"""A CPU check of ``trl_side.loss_path.trl_update`` on the tiny model: TRL's first loss and
gradient norm equal a plain-PyTorch reference, with either padding scope, with and without
checkpointing.

Usage: ``python benchmarks/trl_side/check.py`` (needs TRL: ``benchmarks/trl_wheels.sh``).
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # benchmarks/
from trl_side.loss_path import _is_checkpointing, trl_update  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _reference_grad_norm(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completions: list[list[int]],
    advantages: list[float],
) -> tuple[float, float]:
    """GSPO on-policy loss and gradient norm in plain PyTorch, one unpadded sequence at a time.

    At the first step the sequence ratio s_i = exp(mean_t(logp - sg(logp))) is 1, inside the clip
    range, so the loss is -mean_i(A_i) and its gradient -1/N sum_i A_i mean_t grad logp_it.
    """
    model.zero_grad()
    total = torch.zeros(())
    for p, c, a in zip(prompts, completions, advantages, strict=True):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]  # (C, V)
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        ratio = torch.exp((logprobs - logprobs.detach()).mean())  # s_i, = 1 in value
        loss = -a * ratio / len(prompts)
        loss.backward()
        total += loss.detach()
    grads = [q.grad.flatten() for q in model.parameters() if q.grad is not None]
    norm = torch.linalg.vector_norm(torch.cat(grads).double()).item()
    model.zero_grad()
    return total.item(), norm


def _self_check() -> None:
    """CPU check on the tiny model: TRL's first loss and gradient norm match a plain reference."""
    import copy

    from agentrl.tiny import build_tiny

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model, tok = build_tiny()
    gen = torch.Generator().manual_seed(1)
    lens_p = torch.randint(3, 9, (8,), generator=gen).tolist()
    lens_c = torch.randint(2, 12, (8,), generator=gen).tolist()
    prompts = [torch.randint(10, 100, (n,), generator=gen).tolist() for n in lens_p]
    completions = [torch.randint(10, 100, (n,), generator=gen).tolist() for n in lens_c]
    advantages = torch.randn(8, generator=gen).tolist()
    ref_loss, ref_norm = _reference_grad_norm(
        copy.deepcopy(model), prompts, completions, advantages
    )
    print(f"reference (plain torch): loss {ref_loss:+.6f}  grad norm {ref_norm:.6f}")
    for scope in ("generation_batch", "micro_batch"):
        for ckpt in (False, True):
            m = copy.deepcopy(model)
            before = [q.detach().clone() for q in m.parameters()]
            r = trl_update(
                m,
                tok,
                prompts,
                completions,
                advantages,
                micro_batch_seqs=4,
                gradient_checkpointing=ckpt,
                bf16=False,
                warmup=1,
                repeats=2,
                pad_scope=scope,
            )
            moved = max(
                (q.detach() - b).abs().max().item()
                for q, b in zip(m.parameters(), before, strict=True)
            )
            print(
                f"trl {scope:16s} ckpt={ckpt!s:5s}: loss {r.first_loss:+.6f}  grad norm "
                f"{r.first_grad_norm:.6f}  max |dparam| {moved:.2e}  tokens {r.tokens_per_step}  "
                f"padded {r.settings['padded_tokens_per_step']}  step {min(r.step_s) * 1e3:.0f} ms"
            )
            _expect(math.isfinite(r.first_loss) and r.first_grad_norm > 0, "finite loss, grad > 0")
            _expect(moved > 0, "parameters moved")
            _expect(abs(r.first_loss - ref_loss) < 1e-5, "first loss equals the reference's")
            _expect(
                abs(r.first_grad_norm / ref_norm - 1) < 1e-5, "grad norm equals the reference's"
            )
            _expect(r.settings["checkpointing_active"] == ckpt, "checkpointing as asked")
            _expect("forward" not in m.__dict__ and not _is_checkpointing(m), "model restored")
    print(r.settings)
    print("ok")


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"self-check failed: {what}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    _self_check()
