"""TRL's whole loop for ``loop_gpu.py``: ``GRPOTrainer.train()`` with its own generation
(``use_vllm=False``) on one of ``loop_gpu.py``'s workloads, GSPO settings as in ``loss_path``
(sequence-level ratio, epsilon 3e-4/4e-4, beta 0), one optimizer step per generation batch, the
hashed reward of ``_hash_env``.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch


def trl_loop(w: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """TRL's ``GRPOTrainer.train()`` on workload ``w`` (one of ``loop_gpu.py``'s), its own
    generation; trained tokens/s over the timed steps."""
    from _hash_env import HashEnv, hashed_reward
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agentrl.tiny import build_tiny

    bf16 = w["dtype"] == "bfloat16"
    model, tok = build_tiny(seed=0, **dict(w["model"], max_position_embeddings=4096))
    model = model.to("cuda", torch.bfloat16 if bf16 else torch.float32)
    n_seqs = w["tasks"] * w["group"]
    micro = min(n_seqs, 64 if not bf16 else 16)
    tasks = HashEnv.sample_tasks(w["tasks"] * (steps + warmup), seed=0)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": t.prompt}] for t in tasks]})
    gen_kwargs = {"min_new_tokens": w["new_tokens"]} if w["ignore_eos"] else {}

    def reward(completions: list[Any], **kwargs: Any) -> list[float]:
        return [hashed_reward(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_loop_"),
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
        beta=0.0, bf16=bf16, per_device_train_batch_size=micro,
        gradient_accumulation_steps=n_seqs // micro, steps_per_generation=n_seqs // micro,
        num_generations=w["group"], max_completion_length=w["new_tokens"], temperature=1.0,
        generation_kwargs=gen_kwargs, use_vllm=False, learning_rate=w["lr"],
        lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=steps + warmup,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, shuffle_dataset=False,
    )  # fmt: skip
    marks: dict[int, float] = {}

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.cuda.synchronize()
            marks[state.global_step] = time.perf_counter()

    class Quiet(GRPOTrainer):  # type: ignore[misc]
        def _send_telemetry(self) -> None:  # no network on benchmark hosts
            return

    trainer = Quiet(model=model, reward_funcs=reward, args=args, train_dataset=data,
                    processing_class=tok, callbacks=[Clock()])  # fmt: skip
    trainer.train()
    logs = {int(h["step"]): h for h in trainer.state.log_history if "num_tokens" in h}
    wall = marks[warmup + steps] - marks[warmup]
    tokens = logs[warmup + steps]["num_tokens"] - logs[warmup]["num_tokens"]
    return {"tokens_per_s": tokens / wall, "tokens_per_step": tokens / steps,
            "step_s": wall / steps}  # fmt: skip
