"""LoRA on the paged engine on CUDA (issue 46): after an adapter push, decode gives the learner's
log-probs to bf16 tolerance (the engine in bfloat16, CUDA graphs on; the learner's float32
teacher forcing as the reference)."""

from __future__ import annotations

import pytest
import torch
from test_learner import make_samples
from test_lora import LORA, perturb

from agentrl.inference.base import SamplingParams
from agentrl.inference.engine import LocalEngine
from agentrl.learner import Learner, LearnerConfig
from agentrl.tiny import build_tiny

MEAN_TOL = 0.02  # bf16 engine vs float32 learner, mean |difference| per token


def teacher(model: torch.nn.Module, prompt: list[int], output: list[int], t: float) -> torch.Tensor:
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(1, torch.tensor(output, device="cuda")[:, None])[:, 0].cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_paged_engine_decodes_the_learners_logprobs_after_an_adapter_push() -> None:
    model, tokenizer = build_tiny()
    model = model.cuda()
    learner = Learner(model, LearnerConfig(lr=1e-2, lora=LORA, dtype="bfloat16"))
    learner.step(make_samples(build_tiny()[0], n=6))
    perturb(model, seed=7)
    model.eval()
    engine = LocalEngine(build_tiny()[0], tokenizer, device="cuda", dtype=torch.bfloat16, seed=0)
    assert engine.path == "paged", engine.path_reason
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (5 + 3 * i,), generator=gen).tolist() for i in range(6)]
    params = SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True)
    base_model = build_tiny()[0].cuda().eval()

    async def errors(reference: torch.nn.Module, lora: str | None) -> tuple[float, float]:
        outs = [await engine.generate(p, params, lora_path=lora) for p in prompts]
        diffs = [
            (torch.tensor(o.logprobs) - teacher(reference, p, o.output_ids, 1.0)).abs()
            for p, o in zip(prompts, outs, strict=True)
        ]
        return torch.cat(diffs).mean().item(), torch.cat(diffs).max().item()

    try:
        base_err = await errors(base_model, None)  # graphs captured on the base weights
        shift = await errors(model, None)  # the base engine against the adapted learner
        adapter = learner.adapter_state()
        await engine.load_lora_adapter_tensors("run-v1", adapter, LORA.alpha / LORA.rank, 1)
        adapted = await errors(model, "run-v1")
        print(f"mean/max |engine - learner|: base {base_err}, adapted {adapted}, shift {shift}")
        assert base_err[0] < MEAN_TOL and adapted[0] < MEAN_TOL
        assert shift[0] > 2 * adapted[0]  # the adapter is what closed the gap
        await engine.unload_lora_adapter("run-v1")
        assert (await errors(base_model, None))[0] < MEAN_TOL  # the base again
    finally:
        await engine.aclose()
