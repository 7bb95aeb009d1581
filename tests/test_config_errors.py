"""One validation up front: every config mistake is one line naming the field, before any model.

Each case runs the real ``agentrl train`` entry point in process with the model loader replaced
by one that fails the test, so "fails before any model is built" is checked, not assumed; and
no run directory may appear.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import agentrl.loop.assemble as assemble_module
from agentrl.cli import main
from agentrl.config import load_config
from agentrl.config_reference import reference
from agentrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "arith-tiny.toml"


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(config: object) -> None:
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr(assemble_module, "load_policy", refuse)


def train(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    rc = main(["train", *args, f"--out_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip()
    assert not (tmp_path / "runs").exists(), "a failed start left a run directory"
    return rc, err


EXTRA = "Extra inputs are not permitted; did you mean"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--nmae=x", f"nmae: {EXTRA} 'name'?"),
        ("--model.dtyp=float32", f"model.dtyp: {EXTRA} 'dtype'?"),
        ("--inference.max_batch=4", f"inference.max_batch: {EXTRA} 'max_batch_size'?"),
        ("--env.prompt_feld=q", f"env.prompt_feld: {EXTRA} 'prompt_field'?"),
        ("--rollout.grup_size=4", f"rollout.grup_size: {EXTRA} 'group_size'?"),
        ("--advantages.shapers=[{name: formt}]", "advantages.shapers[0]:"),
        (
            "--advantages.shapers=[{name: format, penatly: 1}]",
            f"advantages.shapers[0].penatly: {EXTRA} 'penalty'?",
        ),
        ("--learner.lrr=1e-4", f"learner.lrr: {EXTRA} 'lr'?"),
        (
            "--learner.loss=gsop",
            "learner.loss: Input should be 'gspo_token', 'gspo', 'grpo', 'cispo' or 'dppo'",
        ),
        ("--cold_start.step=3", f"cold_start.step: {EXTRA} 'steps'?"),
        ("--train.max_failed_frac=2", "train.max_failed_frac: Input should be less than or equal"),
        ("--model.path=./no-such-model", "model.path: no such model directory ./no-such-model"),
    ],
)
def test_a_typo_in_each_section_fails_before_any_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None, override: str, expected: str
) -> None:
    rc, err = train(tmp_path, capsys, str(CONFIG), override)
    assert rc == 2
    assert err.startswith(f"agentrl: error: command line {override!r}: "), err
    assert expected in err and "\n" not in err and "Traceback" not in err
    for typo, fix in (("formt", "format"), ("gsop", "gspo")):
        if typo in override:
            assert f"did you mean {fix!r}?" in err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--env.id=arith-v1", "env.id: unknown env 'arith-v1'; did you mean 'arith-v0'?"),
        ("--env.train_tasks=missing.jsonl", "env.train_tasks: data source missing.jsonl: no such"),
        ("--import=no_such_module_xyz", "imports: no module named 'no_such_module_xyz'"),
    ],
)
def test_env_and_task_mistakes_fail_before_any_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None, override: str, expected: str
) -> None:
    rc, err = train(tmp_path, capsys, str(CONFIG), override)
    assert rc == 2 and expected in err and "\n" not in err, err
    if "unknown env" in expected:
        assert "--import" in err  # the error says how to bring an env of your own


def test_an_env_without_a_generator_names_the_task_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    env_file = tmp_path / "my_env.py"
    env_file.write_text(
        "from agentrl import Env, register\n"
        "class NoTasks(Env):\n"
        "    async def reset(self, task, *, seed=None): return [], {}\n"
        "    async def step(self, action): ...\n"
        "register('no-tasks-v0', NoTasks)\n"
    )
    rc, err = train(tmp_path, capsys, str(CONFIG), f"--import={env_file}", "--env.id=no-tasks-v0")
    assert rc == 2
    assert "env.train_tasks: no-tasks-v0 has no built-in task generator" in err
    assert "env.prompt_field ('question')" in err and "env.answer_field ('answer')" in err


def test_file_syntax_errors_name_the_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_model: None
) -> None:
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text('name = "x"\n[rollout]\ngroup_size 4\n')
    rc, err = train(tmp_path, capsys, str(bad_toml))
    assert rc == 2 and f"{bad_toml}:3: TOML syntax error" in err and "\n" not in err
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: x\nrollout:\n  group_size: [4\n")
    rc, err = train(tmp_path, capsys, str(bad_yaml))
    assert rc == 2 and f"{bad_yaml}:" in err and "YAML syntax error" in err and "\n" not in err
    rc, err = train(tmp_path, capsys, str(tmp_path / "missing.toml"))
    assert rc == 2 and "config: no such file" in err


def test_a_field_error_in_a_file_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('name = "x"\n\n[rollout]\ngroup_size = 0\n\n[learner]\nlrr = 1e-4\n')
    with pytest.raises(ConfigError, match=rf"^{path}:4: rollout.group_size: Input should be"):
        load_config(path)
    path.write_text('name = "x"\n\n[learner]\nlr = 1e-4\nlrr = 1e-4\n')
    with pytest.raises(ConfigError, match=rf"^{path}:5: learner.lrr: .*did you mean 'lr'"):
        load_config(path)
    path = tmp_path / "run.yaml"
    path.write_text("name: x\nlearner:\n  lr: 1e-4\n  num_minibatch: 2\n")
    with pytest.raises(ConfigError, match=rf"^{path}:4: learner.num_minibatch: .*minibatches'"):
        load_config(path)


def test_learner_temperature_follows_the_rollout_or_fails() -> None:
    config = load_config({"rollout": {"temperature": 0.7}, "seed": 5})
    assert config.learner.temperature == 0.7 and config.learner.seed == 5
    assert load_config({"rollout": {"temperature": 0.0}}).learner.temperature == 1.0  # greedy
    same = {"rollout": {"temperature": 0.7}, "learner": {"temperature": 0.7}}
    assert load_config(same).learner.temperature == 0.7
    with pytest.raises(ConfigError, match=r"learner.temperature: expected the rollout's .* 0.7"):
        load_config({"rollout": {"temperature": 0.7}, "learner": {"temperature": 1.0}})


def test_shapers_and_learner_are_typed() -> None:
    config = load_config(None, ["--advantages.shapers=[{name: format, penalty: 0.5}]"])
    (shaper,) = config.advantages.shapers
    assert type(shaper).__name__ == "FormatPenalty" and shaper.penalty == 0.5
    assert load_config(None, ["learner.lr=3e-5"]).learner.lr == 3e-5  # the bare form works too


def test_config_reference_is_generated_and_up_to_date() -> None:
    assert (ROOT / "docs" / "config.md").read_text() == reference("markdown"), (
        "docs/config.md is stale: python -m agentrl.config_reference > docs/config.md"
    )
    text = reference("text")
    from agentrl.config import TrainConfig

    for name, field in TrainConfig.model_fields.items():  # every field of every section
        sub = getattr(field.annotation, "model_fields", None)
        for key in [f"{name}.{k}" for k in sub] if sub else [name]:
            assert f"  {key} : " in text, key
    assert "learner.lr : float = 1e-06" in text and "rollout.group_size : int = 8" in text


def test_train_help_shows_every_field() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "--import MODULE_OR_FILE.py" in out.stdout
    assert "train.max_failed_frac : float = 0.5" in out.stdout
    assert "advantages.shapers : list[shaper discount" in out.stdout


@pytest.mark.parametrize(
    ("value", "urls"),
    [
        ("http://host:30000", ["http://host:30000"]),
        ("http://a:1, https://b/sglang/", ["http://a:1", "https://b/sglang"]),
        ('["http://a:1","http://b:2"]', ["http://a:1", "http://b:2"]),
        ("[http://a:1]", ["http://a:1"]),  # a YAML flow list
    ],
)
def test_endpoints_take_a_url_a_comma_list_or_a_json_list(value: str, urls: list[str]) -> None:
    assert load_config(None, [f"--inference.endpoints={value}"]).inference.endpoints == urls


def test_endpoints_in_files_and_malformed_urls(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('[inference]\nendpoints = "http://a:1,http://b:2"\n')
    (tmp_path / "a.yaml").write_text("inference:\n  endpoints: http://a:1\n")
    assert load_config(tmp_path / "a.toml").inference.endpoints == ["http://a:1", "http://b:2"]
    assert load_config(tmp_path / "a.yaml").inference.endpoints == ["http://a:1"]
    want = "inference.endpoints: expected http://HOST:PORT (or https://)"
    for bad, said in [
        ("host:30000", f"{want} (got 'host:30000')"),
        ("http://a:99999", f"{want}: bad port"),
        ("http://a:1,,http://b:2", "inference.endpoints: entry 2 '': expected http://HOST:PORT"),
        ("http://a:1?k=v", f"{want}, with no query, fragment or spaces"),
        ('"[\\"http://a:1\\""', "inference.endpoints: not a valid JSON list of URLs"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"--inference.endpoints={bad}"])
        assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
