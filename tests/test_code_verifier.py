"""Code scoring (stdin/stdout and assert tests), code extraction, task loading, HumanEval."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.errors import ConfigError, VerifierError
from agentrl.verifiers.code import (
    AssertTest,
    IOTest,
    _assemble,
    extract_code,
    normalise_output,
    score,
    score_async,
)
from agentrl.verifiers.code_tasks import (
    TaskFields,
    load_humaneval,
    load_jsonl,
    load_parquet,
    parse_tests,
    tasks_from_records,
    validate_solutions,
)
from agentrl.verifiers.sandbox import ExecResult, Sandbox

REPO = Path(__file__).resolve().parents[1]
DOUBLE = "n = int(input())\nprint(n * 2)\n"


@pytest.fixture(scope="module")
def box():
    sandbox = Sandbox(max_concurrency=2)
    yield sandbox
    sandbox.close()


def test_stdin_stdout_cases_compare_normalised_output(box: Sandbox) -> None:
    tests = [IOTest("3\n", "6"), IOTest("4", "  8  \n\n"), IOTest("5", "11"), IOTest("x", "0")]
    r = score(DOUBLE, tests, sandbox=box)
    assert [t.status for t in r.tests] == ["passed", "passed", "failed", "runtime_error"]
    assert r.score == 0.5 and r.status == "failed" and r.num_passed == 2
    assert r.tests[2].detail == "input: '5' expected: '11' got: '10'"
    assert r.tests[3].detail.startswith("ValueError: invalid literal for int()")
    assert r.tests[3].detail.endswith("(line 1: n = int(input()))")
    assert score(DOUBLE, tests, mode="all", sandbox=box).score == 0.0
    assert score(DOUBLE, tests[:2], mode="all", sandbox=box).score == 1.0
    assert normalise_output("\n a  b \r\n\n c\t\n\n") == "a b\n\nc"


def test_assert_cases_share_one_run_with_per_test_outcomes(box: Sandbox) -> None:
    code = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print('main ran')\n"
    tests = [
        AssertTest("assert add(1, 2) == 3"),
        AssertTest("x = 1\nassert add(2, 2) == 5, 'off by one'"),
        AssertTest("while True:\n    pass"),
        AssertTest("add('a', 1)"),
        AssertTest("assert add(-1, 1) == 0"),
    ]
    start = time.monotonic()
    r = score(code, tests, timeout_s=0.5, sandbox=box)
    statuses = [t.status for t in r.tests]
    assert statuses == ["passed", "failed", "timeout", "runtime_error", "passed"]
    assert (
        r.tests[1].detail
        == "AssertionError: off by one (line 2: assert add(2, 2) == 5, 'off by one')"
    )
    assert r.tests[3].detail.startswith("TypeError: can only concatenate str")
    assert r.score == 0.4 and "main ran" not in r.stdout  # loaded as a module, not as __main__
    assert time.monotonic() - start < 5  # one sandbox run; the hanging test had its own limit
    report = r.report(max_tests=2)
    assert report.splitlines()[0] == "Passed 2/5 tests." and "and 1 more failing" in report


@pytest.mark.parametrize(
    ("program", "why"),
    [
        ("import sys\nsys.exit(0)\n", "the program failed: SystemExit: 0"),
        ("import os\nos._exit(0)\n", "the program failed: it ended (exit code 0)"),
        ("def f(:\n    pass\n", "the program failed: SyntaxError"),
        ("while True:\n    pass\n", "the program failed: took longer than 0.5s"),
    ],
)
def test_programs_that_skip_the_tests_fail_them(box: Sandbox, program: str, why: str) -> None:
    r = score(
        program, [AssertTest("assert True"), AssertTest("assert 1")], timeout_s=0.5, sandbox=box
    )
    assert r.score == 0.0 and all(t.detail.startswith(why) for t in r.tests), r.tests


def test_limits_become_test_outcomes(box: Sandbox) -> None:
    hog = "x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n"
    r = score(hog, [IOTest("", "")], memory_mb=128, sandbox=box)
    assert r.status == "memory" and r.score == 0.0
    r = score("while True:\n    pass\n", [IOTest("", "1")], timeout_s=0.5, sandbox=box)
    assert r.status == "timeout" and r.tests[0].detail.startswith("time limit exceeded")
    r = score("while True:\n    print('y' * 10000)\n", [IOTest("", "")], sandbox=box)
    assert r.status == "output_limit" and len(r.stdout) <= 4096


async def test_score_async_matches_score(box: Sandbox) -> None:
    tests = [IOTest(str(i), str(2 * i)) for i in range(4)] + [IOTest("1", "3")]
    r = await score_async(DOUBLE, tests, sandbox=box)
    assert r.score == 0.8 and [t.passed for t in r.tests] == [True] * 4 + [False]
    with pytest.raises(ValueError, match="at least one test"):
        await score_async(DOUBLE, [], sandbox=box)


def test_extract_code() -> None:
    assert extract_code("no code here") is None
    assert extract_code("```python\nprint(1)\n```") == "print(1)\n"
    two = "```\nplain\n```\ntext\n```py\nfirst\n```\n```python3\nsecond\n```\n```bash\nls\n```"
    assert extract_code(two) == "second\n"  # the last python block wins over other languages
    assert extract_code("```\nonly plain\n```") == "only plain\n"


def test_parse_tests_accepts_the_common_shapes() -> None:
    data = [
        {"stdin": "1", "stdout": "2"},
        {"input": "3", "output": "4"},
        {"assert": "assert 1"},
        "assert f(1) == 2",
    ]
    assert parse_tests(data) == [
        IOTest("1", "2"),
        IOTest("3", "4"),
        AssertTest("assert 1"),
        AssertTest("assert f(1) == 2"),
    ]
    assert parse_tests(json.dumps(data[:1])) == [IOTest("1", "2")]
    assert parse_tests("assert g()") == [AssertTest("assert g()")] and parse_tests(None) == []
    with pytest.raises(ConfigError, match="expected"):
        parse_tests([{"foo": 1}])


def test_tasks_load_from_jsonl_and_records_with_gold_checked(box: Sandbox, tmp_path: Path) -> None:
    good = {
        "id": "dbl",
        "prompt": "double it",
        "solution": DOUBLE,
        "public_tests": [{"stdin": "1", "stdout": "2"}],
        "hidden_tests": [{"stdin": "5", "stdout": "10"}],
        "split": "train",
    }
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(good) + "\n\n")
    (task,) = load_jsonl(path, sandbox=box)
    assert task.id == "dbl" and task.data["split"] == "train"
    assert task.data["hidden_tests"] == [{"stdin": "5", "stdout": "10"}]
    # other field names, MBPP style: a list of assert strings
    mbpp = [
        {
            "task_id": 7,
            "text": "add",
            "code": "def add(a, b):\n    return a + b",
            "test_list": ["assert add(1, 1) == 2", "assert add(0, 3) == 3"],
        }
    ]
    fields = TaskFields(id="task_id", prompt="text", hidden_tests="test_list", solution="code")
    (t,) = tasks_from_records(mbpp, fields=fields, sandbox=box)
    assert t.id == "7" and len(t.data["hidden_tests"]) == 2 and t.data["public_tests"] == []
    bad = [{**mbpp[0], "code": "def add(a, b):\n    return a - b"}]
    with pytest.raises(VerifierError, match=r"1 gold solutions fail their tests: \['7'\]"):
        tasks_from_records(bad, fields=fields, sandbox=box)
    with pytest.raises(ConfigError, match="expected a 'prompt' field"):
        tasks_from_records([{"id": 1}], validate=False)


def test_parquet_loads_when_pyarrow_is_installed(box: Sandbox, tmp_path: Path) -> None:
    if importlib.util.find_spec("pyarrow") is None:
        with pytest.raises(ConfigError, match="needs pyarrow"):
            load_parquet(tmp_path / "x.parquet")
        pytest.skip("pyarrow is not installed: only the clear error is checked")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "id": "a",
            "prompt": "p",
            "solution": DOUBLE,
            "hidden_tests": '[{"stdin": "2", "stdout": "4"}]',
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "x.parquet")
    assert [t.id for t in load_parquet(tmp_path / "x.parquet", sandbox=box)] == ["a"]


def test_all_humaneval_canonical_solutions_pass_and_a_broken_one_fails(box: Sandbox) -> None:
    start = time.monotonic()
    tasks = load_humaneval(validate=False)
    report = validate_solutions(tasks, sandbox=box)
    elapsed = time.monotonic() - start
    assert len(tasks) == 164 and (report.checked, report.passed, report.failed) == (164, 164, ())
    assert elapsed < 60, f"164 HumanEval checks took {elapsed:.1f}s"
    first = tasks[0]  # has_close_elements: break it by dropping the inner comparison
    broken = first.data["solution"].replace("if distance < threshold:", "if False:")
    assert broken != first.data["solution"]
    r = score(broken, parse_tests(first.data["hidden_tests"]), sandbox=box)
    assert r.score == 0.0 and r.status == "failed" and "AssertionError" in r.tests[0].detail
    assert validate_solutions(
        [first.model_copy(update={"data": {**first.data, "solution": broken}})], sandbox=box
    ).failed == ("HumanEval/0",)


# ----------------------------------------------------------------------------- forgery


def _code_bench() -> Any:
    """benchmarks/_code_bench.py, which holds the forged programs (benchmarks/faults.py counts
    them too)."""
    spec = importlib.util.spec_from_file_location("_code_bench", REPO / "benchmarks/_code_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("isolation", ["namespaces", "rlimits"])
def test_forged_programs_earn_nothing_at_either_isolation(isolation: str) -> None:
    # 21 programs print or write the result lines (also with the pre-fix harness's nonce, read
    # from the stack), exit early, kill, trace or signal the checker, shadow builtins, return
    # objects whose __eq__ says yes, or write protocol junk; an honest program scores 1 first.
    if isolation == "namespaces":
        try:
            assert Sandbox(isolation="namespaces").isolation == "namespaces"
        except VerifierError as e:
            pytest.skip(f"namespaces isolation is not available here: {e}")
    bench = _code_bench()
    found = bench.forged_rewards(isolation)
    assert found["isolation"] == isolation and found["forgeries"] == len(bench.FORGERIES) >= 21
    assert found["forged_rewards"] == 0, found["paid"]


def test_plain_values_cross_and_the_programs_objects_stay_handles(box: Sandbox) -> None:
    program = """
import math, this
LIMIT = 10
def values():
    return (1, 2.5), {3, 4}, {(1, 2): [b'x', bytearray(b'y')]}, 2 ** 200, -1j, float('nan'), None
def evens(n):
    return (i for i in range(n) if i % 2 == 0)
def sort_in_place(xs, *, reverse=False):
    xs.sort(reverse=reverse)
def positive(x):
    if x <= 0:
        raise ValueError(f"not positive: {x}")
    return x
class Counter:
    def __init__(self, start):
        self.n = start
    def bump(self):
        self.n += 1
        return self.n
def apply(f, x):
    return f(x)
"""
    tests = [
        "t, s, d, big, c, nan, none = values()\n"
        "assert t == (1, 2.5) and s == {3, 4} and d == {(1, 2): [b'x', bytearray(b'y')]}\n"
        "assert big == 2 ** 200 and c == -1j and nan != nan and none is None",
        "assert list(evens(7)) == [0, 2, 4, 6]",
        "xs = [3, 1, 2]\nsort_in_place(xs, reverse=True)\nassert xs == [3, 2, 1]",
        "try:\n    positive(-2)\nexcept ValueError as e:\n    assert 'not positive: -2' in str(e)\n"
        "else:\n    raise AssertionError('no ValueError')",
        "c = Counter(5)\nassert c.bump() == 6 and c.bump() == 7 and c.n == 7",
        "assert math.isqrt(LIMIT) == 3 and LIMIT == 10 and 'this' not in dir()",
        "assert Counter(1) == 1",  # an object of the program compares to nothing
        # the test's functions do not cross; what the checker prints goes nowhere
        "print('[6, \"passed\", \"\", 0.0]', flush=True)\napply(lambda x: x, 1)",
    ]
    r = score(program, [AssertTest(t) for t in tests], sandbox=box)
    assert [t.status for t in r.tests] == ["passed"] * 6 + ["runtime_error"] * 2, r.tests
    assert r.tests[6].detail.startswith("TypeError: the program gave a Counter object where tests")
    assert r.tests[7].detail.startswith("TypeError: cannot pass a function to the program")


@pytest.mark.parametrize(
    "body", ["import os\n    os._exit(0)", "raise SystemExit(0)", "raise KeyboardInterrupt"]
)
def test_ending_the_program_never_passes_a_test_that_expects_an_error(
    box: Sandbox, body: str
) -> None:
    test = "try:\n    add(None, 1)\nexcept Exception:\n    pass\nelse:\n    raise AssertionError"
    assert score("def add(a, b):\n    return a + b\n", [AssertTest(test)], sandbox=box).score == 1
    r = score(f"def add(a, b):\n    {body}\n", [AssertTest(test)], sandbox=box)
    assert r.score == 0.0 and r.status == "runtime_error", r.tests


def test_a_test_that_hangs_or_ends_the_program_does_not_take_the_next_ones(box: Sandbox) -> None:
    program = (
        "import os\ndef spin():\n    while True:\n        pass\ndef leave():\n    os._exit(3)\n"
        "def add(a, b):\n    return a + b\nprint('loaded', flush=True)\n"
    )
    tests = ["assert add(1, 1) == 2", "spin()", "assert add(2, 2) == 4", "leave()", "add(3, 3)"]
    start = time.monotonic()
    r = score(program, [AssertTest(t) for t in tests], timeout_s=0.3, sandbox=box)
    assert [t.status for t in r.tests] == ["passed", "timeout", "passed", "runtime_error", "passed"]
    assert r.tests[3].detail == "the program ended during the test (exit code 3) (line 1: leave())"
    assert r.stdout == "loaded\n" * 3  # started again after each
    assert time.monotonic() - start < 3


# ----------------------------------------------------------------------------- never raises


def _result(stdout: str, status: str = "ok", stderr: str = "") -> ExecResult:
    return ExecResult(status, 0, stdout, stderr, 0.01, "rlimits")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "stdout",
    [
        "",
        "\x00\xff\ufffd binary junk \ud800\n" * 100,
        "[0, 'passed', '', 0.0]\n",  # the pre-fix format
        '[0,"passed","",0.0',  # cut short
        '[0,"passed","",NaN]\n[1,"bogus","",0.0]\n[7,"passed","",0.0]\n[true,"passed","",0]\n',
        "[" * 100_000 + "\n",  # nested past the JSON parser's recursion limit
        '[0,"passed","' + "x" * (1 << 20) + '",0.0]\n',  # a huge line
        '["out", 1, 2]\n["error", null]\n{"a": 1}\n',
    ],
)
def test_malformed_harness_output_is_a_failed_test_never_an_exception(stdout: str) -> None:
    tests = [AssertTest("assert True"), AssertTest("assert 1")]
    r = _assemble(tests, [_result(stdout)], "fraction")
    assert r.score == 0.0 and all(t.status == "runtime_error" for t in r.tests), r.tests
    r = _assemble(tests, [_result(stdout, "sandbox_error", "bwrap: boom")], "all")
    assert (r.score, r.status) == (0.0, "verifier_error") and "bwrap: boom" in r.error


def test_a_sandbox_that_cannot_run_scores_zero_with_the_reason(tmp_path: Path) -> None:
    broken = Sandbox(isolation="rlimits", python="/bin/false")  # fails its self-test
    for tests in ([IOTest("1", "2")], [AssertTest("assert True")]):
        r = score(DOUBLE, tests, sandbox=broken)
        assert (r.score, r.status, r.isolation) == (0.0, "verifier_error", None)
        assert r.error == f"sandbox failed: sandbox cannot run {broken.python}"
        assert r.tests[0].detail == r.error[:300]
    r = asyncio.run(score_async(DOUBLE, [IOTest("1", "2")], sandbox=broken))
    assert r.status == "verifier_error"
    gold = {"prompt": "p", "solution": DOUBLE, "hidden_tests": [{"stdin": "1", "stdout": "2"}]}
    with pytest.raises(VerifierError, match="cannot check gold solutions: sandbox failed"):
        tasks_from_records([gold], sandbox=broken)


def test_an_output_flood_is_no_part_of_the_verdict(box: Sandbox) -> None:
    flood = "import sys\nsys.stdout.write('z' * (8 << 20))\nsys.stdout.buffer.write(b'\\xff')\n"
    r = score(flood + "def add(a, b):\n    return a + b\n", [AssertTest("assert add(1, 2) == 3")],
              sandbox=box)
    assert r.score == 1.0 and r.stdout == "z" * 4096
