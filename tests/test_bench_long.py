"""Long-sequence and long-context benchmarks: the FLOP counter by hand, tiny CPU dry runs, the
code agent's gpu-small preset with tiny overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "recipes"))
from learner_gpu import PEAK_BF16_TFLOPS, PRIME_RL_16K_TOKENS_PER_S, train_flops  # noqa: E402

from agentrl.tiny import QWEN3_0_6B_SHAPE  # noqa: E402

ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def run(*cmd: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**ENV, "HOME": str(home)})  # fmt: skip


def test_train_flops_by_hand() -> None:
    # 2 layers, 4 heads of 8, 2 kv heads, hidden 16, MLP 32, vocab 100; T=10, 6 trained tokens
    c = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, hidden_size=16, intermediate_size=32,
                        vocab_size=100)  # fmt: skip
    matmul, attention = train_flops(c, 10, 6)
    # per layer: q 16*32 + o 32*16 = 1024, k+v 2*16*16 = 512, MLP 3*16*32 = 1536 -> 3072
    assert matmul == 6 * (2 * 3072 * 10 + 100 * 16 * 6) == 426_240
    # causal: Q K^T 2*8*(1+...+10) = 880 FLOPs per head and layer, P V the same; x3 for training
    assert attention == 3 * 2 * 4 * 2 * 880 == 42_240


def test_train_flops_reproduces_prime_rl_anchor() -> None:
    """prime-rl: Qwen3-0.6B at 16k, 11.9k tokens/s on an H100 is 11% MFU (with attention)."""
    c = SimpleNamespace(**QWEN3_0_6B_SHAPE)
    t = 16384
    matmul, attention = train_flops(c, t, t)
    assert attention / t == pytest.approx(12 * 28 * 1024 * t, rel=1e-4)  # its 12*L*hidden*T
    mfu = (matmul + attention) / t * PRIME_RL_16K_TOKENS_PER_S / (PEAK_BF16_TFLOPS * 1e12)
    assert mfu == pytest.approx(0.11, abs=0.005)
    assert matmul / t == pytest.approx(6 * 596e6, rel=0.01)  # 6N of its 596M parameters


def test_learner_long_sequences_dry_run(tmp_path: Path) -> None:
    out = run("benchmarks/learner_gpu.py", "--model", "tiny", "--seq-lens", "64", "128",
              "--long-tokens", "256", "--warmup", "1", "--repeats", "1", home=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = result["seq_lens"]
    assert set(rows) == {"64", "128"} and result["card"]
    assert rows["64"]["sequences"] == 4 and rows["128"]["sequences"] == 2
    assert rows["128"]["micro_batch_tokens"] >= 128
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and 0 < row["mfu_no_attention"] < row["mfu"]
    bad = run("benchmarks/learner_gpu.py", "--model", "tiny", "--seq-lens", "4096", home=tmp_path)
    assert bad.returncode == 2 and "--seq-lens: expected" in bad.stderr
    assert "Traceback" not in bad.stderr


ENGINE = ("benchmarks/engine_throughput.py", "--paged", "--history-tokens", "256", "--turns", "4",
          "--turn-tokens", "8", "--obs-tokens", "16", "--history-episodes", "2",
          "--concurrency", "2", "--hf-requests", "0", "--new-tokens", "8")  # fmt: skip


def test_engine_long_context_dry_run(tmp_path: Path) -> None:
    out = run(*ENGINE, home=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["history_tokens"] == 256 and r["history_turns"] == 4 and r["engine_2_tokens_per_s"] > 0
    # turns re-send 256 + ... tokens; all but the last partial page and the new tokens are cached
    assert r["history_cached_tokens"] + r["history_computed_tokens"] == r["history_prefill_tokens"]
    assert r["history_prefix_reuse_frac"] > 0.8
    assert r["kv_tokens_needed"] == 2 * (256 + 4 * (8 + 16)) <= r["kv_cache_tokens"]
    assert r["history_prefill_tokens_per_s"] > 0 and r["history_decode_tokens_per_s"] > 0


def test_engine_long_context_too_big_for_kv_cache_fails_clearly(tmp_path: Path) -> None:
    out = run(*ENGINE, "--kv-cache-gib", "0.0005", home=tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("error: an episode of 352 tokens does")
    assert "Traceback" not in out.stderr


def test_code_gpu_small_preset_dry_run(tmp_path: Path) -> None:
    """The gpu-small preset on CPU with tiny overrides: cold start on demonstrations, one step."""
    tiny = ('model.tiny={"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,'
            '"num_attention_heads":2,"num_key_value_heads":1,"head_dim":32}')  # fmt: skip
    out = run("recipes/code_agent.py", "--preset", "gpu-small", f"run_dir={tmp_path / 'run'}",
              "model.device=cpu", "train.steps=1", "train.tasks_per_step=2",
              "rollout.group_size=2", "env.num_eval_tasks=2", "env.num_train_tasks=8",
              "cold_start.steps=2", "cold_start.batch_size=4", "cold_start.check_every=2",
              "rollout.max_new_tokens=24", tiny, home=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cold start on 8 demonstrations" in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["env"] == "code-fn-v0"


def test_function_tasks_are_seeded_and_their_solutions_pass() -> None:
    from code_agent import FunctionCodeEnv

    from agentrl.verifiers.code import score
    from agentrl.verifiers.code_tasks import parse_tests

    a, b = FunctionCodeEnv.sample_tasks(4), FunctionCodeEnv.sample_tasks(4)
    assert [t.prompt for t in a] == [t.prompt for t in b]
    test = FunctionCodeEnv.sample_tasks(4, split="test")
    assert {t.prompt for t in a}.isdisjoint(t.prompt for t in test)
    for t in a:
        code = t.answer.removeprefix("```python\n").removesuffix("```")
        tests = parse_tests(t.data["public_tests"]) + parse_tests(t.data["hidden_tests"])
        assert score(code, tests, mode="all").score == 1.0, t.prompt
