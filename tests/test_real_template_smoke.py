"""Smoke run of a real-model preset on a tiny stand-in: Qwen's BPE, a Qwen3-rules template.

A one-layer Qwen3-architecture model with Qwen's vocabulary is saved as a Hugging Face directory
with the Qwen3 template of tests/fixtures (thinking on). Its weights are set by hand so that it
answers every prompt with a thought and a calculator call (training it to would take minutes on
a CPU), so the episodes really are multi-turn with a tool. ``agentrl serve --model DIR`` serves
it on loopback and ``recipes/math_agent.py --preset qwen3-1.7b --endpoint URL model.path=DIR``
trains two steps on ``math-tool-v0``, with only sizes, CPU settings and a shaper overridden.
Both tests share one stand-in and one server (each run first pushes its own initial weights).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import ServerProcess, start_tiny_server
from fixtures.chat_templates import QWEN3
from fixtures.qwen_bpe import save_qwen_tokenizer

from agentrl.env import make
from agentrl.envs.math import MathToolEnv
from agentrl.rollout.chat import ChatTokenizer
from agentrl.tiny import build_tiny_model

SOURCE = "gsm_symbolic"  # the preset's task source
ROOT = Path(__file__).parents[1]
# Every token of the reply differs (and none is "\n", the prompt's last token): a bigram model
# can write it. Compact JSON keeps the repeated '":' tokens apart.
REPLY = (
    "<think>Add</think>"
    '<tool_call>{"name": "calculator","arguments":{"expression":"3*4"}}</tool_call>'
)


def wire_reply(model: torch.nn.Module, chain: list[int]) -> None:
    """Set the weights so that the model continues ``chain[i]`` with ``chain[i + 1]``.

    Attention and MLP outputs are zeroed, so the last hidden state is the normalised embedding
    of the current token: a bigram model. Chain token ``i`` embeds as basis vector ``i``; the
    output row of token ``i + 1`` reads that basis vector with a large weight. Every other
    token embeds as zero (uniform next token); only the chain is ever visited.
    """
    assert len(set(chain[:-1])) == len(chain) - 1 <= model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (here, nxt) in enumerate(zip(chain, chain[1:], strict=False)):
            model.model.embed_tokens.weight[here, i] = 1.0
            model.lm_head.weight[nxt, i] = 8.0  # logit 8 * sqrt(hidden) = 45 vs 0 elsewhere


def build_stand_in(directory: Path) -> None:
    tok = save_qwen_tokenizer(directory, QWEN3)
    model = build_tiny_model(
        tok, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=False,
    )  # fmt: skip
    newline = tok.encode("\n", add_special_tokens=False)  # the generation prompt's last token
    reply = tok.encode(REPLY, add_special_tokens=False)
    wire_reply(model, newline + reply + [tok.eos_token_id])
    model.save_pretrained(directory)
    chat = ChatTokenizer(tok)
    task = MathToolEnv.sample_tasks(1, seed=0, split="train", source=SOURCE)[0]
    prompt = chat.prompt_ids(asyncio.run(make("math-tool-v0").reset(task))[0])
    with torch.no_grad():  # it does write the reply after a real prompt
        out = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
    assert tok.decode(out[0, len(prompt) :]) == REPLY + "<|im_end|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-tiny")
    build_stand_in(directory)
    return directory


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    process = start_tiny_server("--model", str(model_dir))
    yield process
    process.stop()


@pytest.mark.slow
def test_qwen3_preset_runs_on_a_tiny_stand_in(
    tmp_path: Path, model_dir: Path, server: ServerProcess
) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, str(ROOT / "recipes" / "math_agent.py"), "--preset", "qwen3-1.7b",
        "--endpoint", server.url, f"model.path={model_dir}", f"run_dir={run_dir}",
        "env.id=math-tool-v0", "env.num_train_tasks=4", "env.num_eval_tasks=2",
        "rollout.group_size=2", "rollout.max_turns=2", "rollout.max_new_tokens=40",
        "rollout.max_total_tokens=1024", "train.steps=2", "train.tasks_per_step=2",
        "train.checkpoint_every=0", "model.dtype=float32", "learner.dtype=float32",
        "learner.compile=false", "learner.selective_recompute=false",
        "learner.micro_batch_tokens=2048",
        # every reward is 0 here: a penalty on tool-calling turns gives the update a signal
        "advantages.shapers=[{name: format, key: tool_calls, penalty: 0.1}]",
    ]  # fmt: skip
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    records = [json.loads(ln) for ln in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    trajs = [r["trajectory"] for r in records]
    assert len(trajs) == 2 * 2 * 2  # steps x tasks x group
    for t in trajs:
        assert t["error"] is None
        assistant = [s for s in t["turns"] if s["kind"] == "assistant"]
        assert len(assistant) == 2  # a tool call, its response, a second turn
        first = assistant[0]
        assert first["info"]["reasoning"] == "Add"  # split off, kept in the transcript ...
        assert t["messages"][2]["content"].startswith("<think>\nAdd\n</think>\n\n<tool_call>")
        assert first["info"]["tool_calls"] == 1 and first["info"]["tool_errors"] == 0
        assert t["messages"][3]["role"] == "tool" and "12" in t["messages"][3]["content"]
        # ... the env got the bare call, and the learner trains on every sampled token
        sampled = sum(s["end"] - s["start"] for s in assistant)
        assert sum(t["loss_mask"]) == sampled


@pytest.mark.slow
def test_qwen3_code_preset_gets_past_its_first_rollout(
    tmp_path: Path, model_dir: Path, server: ServerProcess
) -> None:
    """``recipes/code_agent.py --preset qwen3-1.7b`` on the same stand-in: its replies hold no
    code block, so code-v0 answers with feedback and the episode goes on, turn after turn."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, str(ROOT / "recipes" / "code_agent.py"), "--preset", "qwen3-1.7b",
        "--endpoint", server.url, f"--model.path={model_dir}", f"--run_dir={run_dir}",
        "--env.num_train_tasks=2", "--env.num_eval_tasks=1", "--rollout.group_size=2",
        "--rollout.max_new_tokens=40", "--rollout.max_total_tokens=2048", "--train.steps=1",
        "--train.tasks_per_step=2", "--train.eval_samples=1", "--train.checkpoint_every=0",
        "--model.dtype=float32", "--learner.dtype=float32", "--learner.compile=false",
        "--learner.selective_recompute=false", "--learner.micro_batch_tokens=4096",
    ]  # fmt: skip
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["env"] == "code-v0"
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (step,) = [m for m in metrics if "rollout/episodes" in m]
    assert step["rollout/episodes"] == 4 and step["rollout/failed"] == 0
    assert step["rollout/turns_mean"] == 3  # max_attempts: feedback after each codeless reply
