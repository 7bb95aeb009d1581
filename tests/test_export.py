"""``agentrl export``: a real run's checkpoints as Hugging Face model directories, on CPU.

One tiny training run (two steps, a checkpoint at each, the cold start giving the update a
learning signal) is shared by the module. Its export must load in transformers with the
learner's logits, serve through ``agentrl serve --model DIR`` with the learner's log-probs,
pick the asked step, write the asked dtype, and refuse bad input in one line.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.cli import main
from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.inference.engine.model_io import load_model
from agentrl.learner import Learner
from agentrl.loop.checkpoints import name_of
from agentrl.loop.placement import load_policy
from agentrl.loop.trainer import Trainer
from agentrl.tiny import build_tiny_tokenizer

IDS = [1, 39, 37, 23, 36, 2, 1, 19, 37, 37, 27, 38, 19, 32, 58, 21, 37]


def train(run_dir: Path, model: str, cold_steps: int, steps: int) -> Path:
    config = {
        "run_dir": str(run_dir),
        "seed": 3,
        "model": {"path": model},
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_train_tasks": 64,
                "num_eval_tasks": 2},
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4, "max_total_tokens": 48},
        "cold_start": {"steps": cold_steps, "lr": 2e-3, "batch_size": 32},
        "learner": {"lr": 1e-3},
        "train": {"steps": steps, "tasks_per_step": 8, "eval_every": 0, "checkpoint_every": 1,
                  "max_staleness": 0},
    }  # fmt: skip
    asyncio.run(Trainer(load_config(config)).run())
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dense run: steps 1 and 2 checkpointed, different weights (the cold start taught it)."""
    return train(tmp_path_factory.mktemp("export") / "run", "tiny", cold_steps=20, steps=2)


def learner_model(run_dir: Path, step: int) -> Any:
    """The learner of ``run_dir`` restored from its checkpoint of ``step`` (the trainer's path)."""
    config = load_config(str(run_dir / "config.yaml"))
    model, _ = load_policy(config)
    learner = Learner(model, config.learner)
    learner.load_checkpoint(run_dir / "checkpoints" / name_of(step))
    return learner.model.eval()


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([IDS])).logits[0].float()


def test_train_writes_an_export_transformers_loads_with_the_learners_logits(run: Path) -> None:
    out = run / "export"  # train.export is on by default
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= names  # fmt: skip
    assert not [p for p in run.iterdir() if p.name.startswith(".export")]  # no temp dir left
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    want = logits(learner_model(run, 2))
    assert (logits(model) - want).abs().max().item() <= 1e-5
    tok, ref = AutoTokenizer.from_pretrained(out), build_tiny_tokenizer()
    assert tok.chat_template == ref.chat_template  # the template the run used
    chat = [{"role": "user", "content": "2+3"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == ref.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert model.generation_config.eos_token_id == ref.eos_token_id


def test_served_export_gives_the_learners_logprobs(run: Path) -> None:
    from conftest import start_tiny_server

    want = torch.log_softmax(logits(learner_model(run, 2)), -1)
    want_lp = [want[i - 1, t].item() for i, t in enumerate(IDS) if i > 0]
    server = start_tiny_server(source=("--model", str(run / "export")))
    try:
        body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": 0}  # fmt: skip

        async def score() -> Any:
            async with aiohttp.ClientSession() as http:
                async with http.post(server.url + "/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

        got = asyncio.run(score())["meta_info"]["input_token_logprobs"]
    finally:
        server.stop()
    assert got[0][0] is None and [e[1] for e in got] == IDS
    assert max(abs(e[0] - w) for e, w in zip(got[1:], want_lp, strict=True)) <= 1e-5


def test_export_picks_the_step_and_the_dtype(run: Path, tmp_path: Path, capsys: Any) -> None:
    one = tmp_path / "one"
    assert main(["export", str(run), "--step", "1", "--out", str(one)]) == 0
    assert f"exported step 1 of {run}" in capsys.readouterr().out
    exported = load_file(str(one / "model.safetensors"))
    step1 = learner_model(run, 1).state_dict()
    step2 = learner_model(run, 2).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert all(torch.equal(v, step1[k]) for k, v in exported.items())
    assert not torch.equal(exported[name], step2[name])  # the steps differ: the pick is seen
    # the default is the newest; a non-empty --out is refused, --overwrite replaces it
    assert main(["export", str(run), "--out", str(one), "--dtype", "bfloat16"]) == 2
    assert "not empty; pass --overwrite" in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(one), "--dtype", "bfloat16", "--overwrite"]) == 0
    bf16 = load_file(str(one / "model.safetensors"))
    assert {v.dtype for v in bf16.values()} == {torch.bfloat16}
    assert torch.equal(bf16[name], step2[name].to(torch.bfloat16))
    assert json.loads((one / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one"]  # no temp or old dirs left


def one_line_error(capsys: Any, argv: list[str], code: int, *needles: str) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(n in err for n in needles), err


def test_bad_input_fails_in_one_line(run: Path, tmp_path: Path, capsys: Any) -> None:
    out = str(tmp_path / "out")
    one_line_error(capsys, ["export", str(tmp_path / "nope"), "--out", out], 2, "no such")
    one_line_error(capsys, ["export", str(tmp_path), "--out", out], 2, "no config.yaml")
    one_line_error(capsys, ["export", str(run), "--step", "7", "--out", out], 2, "has: 1, 2")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    one_line_error(  # --overwrite never deletes what is not a model directory
        capsys, ["export", str(run), "--out", str(tmp_path / "notes"), "--overwrite"], 2,
        "only a model directory",
    )  # fmt: skip
    # a checkpoint given as a model names the command that makes one
    ckpt = str(run / "checkpoints" / "step-000002")
    one_line_error(
        capsys, ["rollout", "arith-v0", "--out", str(tmp_path / "t.jsonl"), "--model", ckpt], 2,
        "training checkpoint", f"agentrl export {ckpt} --out DIR",
    )  # fmt: skip
    # and so does the engine's loader (`agentrl serve --model`, `agentrl eval`)
    with pytest.raises(ConfigError, match="agentrl export"):
        load_model(ckpt, "cpu", None)
    # a corrupt checkpoint: refused when asked for, passed over (with a line) by default
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("export"))
    shard = copy / "checkpoints" / "step-000002" / "learner" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    one_line_error(
        capsys, ["export", str(copy), "--step", "2", "--out", out], 1, "corrupt", "checksum"
    )
    assert main(["export", str(copy), "--out", out]) == 0
    captured = capsys.readouterr()
    assert "skipping checkpoint" in captured.err and "exported step 1" in captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "notes", "out"]


def test_moe_run_exports_with_the_learners_logits(tmp_path: Path) -> None:
    run = train(tmp_path / "moe", "tiny-moe", cold_steps=0, steps=1)
    model = AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32)
    names = load_file(str(run / "export" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names  # the layout SGLang reads
    assert (logits(model) - logits(learner_model(run, 1))).abs().max().item() <= 1e-5
