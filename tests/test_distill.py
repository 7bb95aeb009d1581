"""On-policy distillation: the reverse-KL advantage, the teacher's scores, a run that uses them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.inference.base import SamplingParams
from agentrl.inference.engine import LocalEngine
from agentrl.learner.advantages import compute_token_advantages
from agentrl.learner.distill import distill_token_advantages, reverse_kl
from agentrl.loop.teacher import Teacher, make_teacher, token_batch
from agentrl.loop.trainer import Trainer
from agentrl.tiny import build_tiny, build_tiny_tokenizer
from agentrl.types import Group, Task, Trajectory, TurnSpan


def two_turn(reward: float, index: int, logprobs: list[float]) -> Trajectory:
    """prompt(3) | assistant(2) | tool(2) | assistant(3): 10 tokens, 5 sampled."""
    mask = [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    return Trajectory(
        task_id="t", env_id="e", group_index=index, prompt_len=3, tokens=list(range(10, 20)),
        loss_mask=mask, logprobs=[lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)],
        versions=[0 if m else -1 for m in mask], reward=reward,
        turns=[TurnSpan(kind="assistant", start=3, end=5),
               TurnSpan(kind="observation", start=5, end=7),  # a tool's output
               TurnSpan(kind="assistant", start=7, end=10)],
    )  # fmt: skip


def test_advantage_is_minus_coef_times_reverse_kl_on_sampled_tokens_only() -> None:
    gen = torch.Generator().manual_seed(0)
    student = [(-torch.rand(10, generator=gen, dtype=torch.float64) * 3).tolist() for _ in "ab"]
    teacher = [(-torch.rand(10, generator=gen, dtype=torch.float64) * 3).tolist() for _ in "ab"]
    group = Group(task=Task(id="t", prompt="q"), trajectories=[two_turn(1.0, 0, student[0]),
                                                   two_turn(0.0, 1, student[1])])  # fmt: skip
    advs, kl_sum, tokens = distill_token_advantages(group, teacher, kl_coef=0.5)
    mask = torch.tensor([0, 0, 0, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    want_kl = 0.0
    for adv, s, t in zip(advs, student, teacher, strict=True):
        kl = torch.tensor(s, dtype=torch.float64) - torch.tensor(t, dtype=torch.float64)
        want = torch.where(mask, -0.5 * kl, 0.0)
        torch.testing.assert_close(adv, want.float(), rtol=0, atol=1e-7)
        assert adv[~mask].eq(0).all()  # prompt and tool tokens carry nothing
        want_kl += float(kl[mask].sum())
    assert tokens == 10 and kl_sum == pytest.approx(want_kl, abs=1e-12)
    # rl+distill: the RL advantage (outcome ±1 here) plus the same term
    both, _, _ = distill_token_advantages(group, teacher, mode="rl+distill", kl_coef=0.5)
    rl = compute_token_advantages(group)
    for b, r, d in zip(both, rl, advs, strict=True):
        torch.testing.assert_close(b, r + d, rtol=0, atol=1e-6)
        assert b[~mask].eq(0).all()
    assert rl[0][mask].sub(1).abs().max() < 1e-5 and rl[1][mask].add(1).abs().max() < 1e-5
    with pytest.raises(ValueError, match="expected 10"):
        reverse_kl(group.trajectories[0], [0.0] * 9)


def config(**teacher) -> object:
    return load_config(None, [f"teacher.{k}={v}" for k, v in teacher.items()])


def test_embedded_teacher_scores_like_a_teacher_forced_forward() -> None:
    model, tok = build_tiny(seed=7)
    teacher = make_teacher(config(model="tiny", seed=7), tok)  # type: ignore[arg-type]
    assert teacher is not None
    ids = tok("<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n46")["input_ids"]

    async def go() -> list[list[float]]:
        try:
            return await teacher.scorer.score([ids, ids[:7]])
        finally:
            await teacher.aclose()

    got = asyncio.run(go())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(got[0]) == len(ids) and got[0][0] == 0.0  # aligned: nothing predicts token 0
    torch.testing.assert_close(torch.tensor(got[0][1:]), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got[1][1:]), want[:6], rtol=0, atol=1e-5)


def test_teacher_equal_to_student_gives_zero_advantage() -> None:
    model, tok = build_tiny(seed=5)
    prompt = tok("<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n")["input_ids"]

    async def go() -> tuple[list[Trajectory], dict[str, float], Teacher]:
        engine = LocalEngine(model, tok, seed=0)
        teacher = make_teacher(config(model="tiny", seed=5), tok)  # type: ignore[arg-type]
        assert teacher is not None
        trajs = []
        for i in range(3):
            out = await engine.generate(prompt, SamplingParams(max_new_tokens=8, seed=i))
            n = len(out.output_ids)
            trajs.append(Trajectory(
                task_id="t", env_id="e", group_index=i, prompt_len=len(prompt),
                tokens=prompt + out.output_ids, loss_mask=[0] * len(prompt) + [1] * n,
                logprobs=[0.0] * len(prompt) + out.logprobs, versions=[-1] * len(prompt) + [0] * n,
                reward=float(i),
            ))  # fmt: skip
        metrics: dict[str, float] = {}
        await teacher.score([Group(task=Task(id="t", prompt="q"), trajectories=trajs)], metrics)
        await engine.aclose()
        await teacher.aclose()
        return trajs, metrics, teacher

    trajs, metrics, teacher = asyncio.run(go())
    assert abs(metrics["distill/reverse_kl_mean"]) < 1e-5
    assert metrics["distill/tokens"] == sum(t.num_response_tokens for t in trajs) > 0
    group = Group(task=Task(id="t", prompt="q"), trajectories=trajs)
    advs, _, _ = distill_token_advantages(group, [teacher.scores[id(t)] for t in trajs])
    assert max(float(a.abs().max()) for a in advs) < 1e-5
    # without a teacher the batch is the RL one: reward 1 is the group's mean, so no signal
    kept, _, _ = token_batch([group], load_config(None), None)
    assert [t.reward for t in kept] == [0.0, 2.0]


def test_vocabulary_mismatch_is_refused_in_one_line(tmp_path: Path) -> None:
    model, tok = build_tiny(seed=1)
    other = build_tiny_tokenizer()
    other.add_tokens(["<extra_token>"])
    model.resize_token_embeddings(len(other))
    model.save_pretrained(tmp_path)
    other.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as err:
        make_teacher(config(model=str(tmp_path)), tok)  # type: ignore[arg-type]
    message = str(err.value)
    assert "\n" not in message and message.startswith("teacher.model: its vocabulary differs")
    assert "'<extra_token>'" in message


def distill_run(run_dir: Path, steps: int, **teacher) -> dict:
    return {
        "run_dir": str(run_dir), "seed": 3,
        "env": {"id": "arith-v0", "task_kwargs": {"digits": 1}, "num_train_tasks": 64,
                "num_eval_tasks": 8},
        "rollout": {"group_size": 4, "max_turns": 1, "max_new_tokens": 4,
                    "max_total_tokens": 48, "temperature": 1.0},
        "learner": {"lr": 3e-3, "num_minibatches": 1},
        "train": {"steps": steps, "tasks_per_step": 8, "eval_every": 0, "max_staleness": 0,
                  "export": False, "checkpoint_every": 0},
        "teacher": {"model": "tiny", "seed": 11, **teacher},
    }  # fmt: skip


@pytest.mark.parametrize("staleness", [0, 1])
def test_distillation_run_logs_the_reverse_kl(tmp_path: Path, staleness: int) -> None:
    # a sharper, differently seeded teacher: a clearly positive KL to the student; overlapped
    # (staleness 1), finished groups are scored a full batch (4 groups) at a time while others
    # generate (prefetched), the rest at the step
    run = distill_run(tmp_path, 3, tiny={"initializer_range": 0.2})
    run["train"]["max_staleness"] = staleness
    asyncio.run(Trainer(load_config(run)).run())
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "distill/reverse_kl_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["time/teacher_busy_s"] > 0 and r["distill/tokens"] > 0 for r in steps)
    fracs = [r["distill/prefetched_frac"] for r in steps]
    if staleness:  # a group is 4 of a step's 32 trajectories
        assert sum(fracs) > 0 and all(f * 8 == round(f * 8) and f <= 1 for f in fracs), fracs
    else:
        assert fracs == [0.0] * 3
    assert all(1.0 < r["distill/reverse_kl_mean"] < 10.0 for r in steps), steps
    assert "rollout/failed_teacher" not in steps[0]
    records = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["kind"] == "trained"]
    assert trained and all(any(r["advantages"]) for r in trained)


def one_group(tok) -> Group:
    ids = tok("<|im_start|>user\n5+6=<|im_end|>\n<|im_start|>assistant\n11<|im_end|>")["input_ids"]
    n = len(ids)
    trajs = [
        Trajectory(task_id="t", env_id="e", group_index=i, prompt_len=n - 3, tokens=ids[: n - i],
                   loss_mask=[0] * (n - 3) + [1] * (3 - i),
                   logprobs=[0.0] * (n - 3) + [-1.0] * (3 - i),
                   versions=[-1] * (n - 3) + [0] * (3 - i))
        for i in range(3)
    ]  # fmt: skip
    return Group(task=Task(id="t", prompt="q"), trajectories=trajs)


def test_endpoint_teacher_scores_like_the_embedded_one(tiny_server) -> None:
    _, tok = build_tiny(seed=0)  # `agentrl serve --model tiny` builds seed 0

    async def go(
        prefetch: bool = False, **teacher: object
    ) -> tuple[Group, dict[str, float], list[list[float]]]:
        group, metrics = one_group(tok), {"rollout/failed": 0.0}
        t = make_teacher(config(batch_size=2, **teacher), tok)  # type: ignore[arg-type]
        assert t is not None
        calls = []
        real = t.scorer.score

        async def counted(seqs: list[list[int]]) -> list[list[float]]:
            calls.append(len(seqs))
            return await real(seqs)

        t.scorer.score = counted  # type: ignore[method-assign]
        try:
            if prefetch:  # as the pipeline does when the group finishes
                t.prefetch(group)
                await asyncio.sleep(0.5)  # the worker scores it meanwhile
                assert len(calls) == 2 and not group.trajectories[0].failed  # not yet failed
            await t.score([group], metrics)
            assert len(calls) == 2  # 3 sequences in batches of 2, once either way
        finally:
            await t.aclose()
        return group, metrics, [t.scores.get(id(x), []) for x in group.trajectories]

    _, remote_metrics, remote = asyncio.run(go(endpoint=tiny_server.url))
    _, local_metrics, local = asyncio.run(go(model="tiny", seed=0))
    _, early_metrics, early = asyncio.run(go(prefetch=True, model="tiny", seed=0))
    assert early == local and early_metrics["time/teacher_busy_s"] > 0
    assert early_metrics["distill/reverse_kl_mean"] == local_metrics["distill/reverse_kl_mean"]
    for r, loc in zip(remote, local, strict=True):
        torch.testing.assert_close(torch.tensor(r), torch.tensor(loc), rtol=0, atol=1e-5)
    assert remote_metrics["distill/reverse_kl_mean"] == pytest.approx(
        local_metrics["distill/reverse_kl_mean"], abs=1e-5
    )
    # a teacher that cannot be reached fails its episodes, counted like other failures (once,
    # at the step, when the group was scored early too)
    for prefetch in (False, True):
        group, metrics, scores = asyncio.run(go(prefetch, endpoint="http://127.0.0.1:9"))
        assert metrics["rollout/failed"] == metrics["rollout/failed_teacher"] == 3.0
        assert all(t.failed and t.error.startswith("TeacherError: teacher http://127.0.0.1:9")
                   for t in group.trajectories) and scores == [[], [], []]  # fmt: skip
        assert token_batch([group], load_config(None), None) == ([], [], 0)


def test_dense_advantages_keep_their_gradient_under_grpo_not_gspo_token() -> None:
    # after one mini-batch step the policy is ~0.02 nats off the sampler on each token: GSPO-token's
    # sequence ratio is then past its 3e-4/4e-4 clip, which zeroes every token whose per-token
    # (reverse-KL) advantage pushes further that way, about half; GRPO's token ratio keeps all
    from agentrl.learner.losses import grpo_loss, gspo_token_loss

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(64, 6, generator=g, dtype=torch.float64) * 3
    shift = torch.randn(64, 6, generator=g, dtype=torch.float64) * 0.02
    adv = torch.randn(64, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(64, 6)
    zeroed = {}
    for name, fn in (("gspo_token", gspo_token_loss), ("grpo", grpo_loss)):
        lp = (old + shift).requires_grad_()
        loss, _ = fn(lp, old, adv, mask)
        loss.backward()
        assert lp.grad is not None
        zeroed[name] = float((lp.grad == 0).double().mean())
    assert 0.35 < zeroed["gspo_token"] < 0.65 and zeroed["grpo"] == 0.0, zeroed


def test_distill_preset_student_is_the_teachers_shape_from_its_cold_start() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    from math_agent import PRESETS

    teacher = load_config(PRESETS["cpu-tiny"])
    student = load_config(PRESETS["cpu-tiny-distill"], ["teacher.model=tiny"])
    # RL alone on this student is the teacher's own run from the same start: it can reach it
    assert student.model == teacher.model and student.cold_start == teacher.cold_start
    assert student.env == teacher.env and student.learner.loss == "grpo"
    assert student.teacher.mode == "rl+distill" and student.rollout.temperature == 1.0
    # the teacher sharpened toward its greedy choice, a small weight beside the RL advantage
    assert (student.teacher.temperature, student.teacher.kl_coef) == (0.25, 0.1)
