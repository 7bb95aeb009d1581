"""``agentrl report``: plots and the HTML trajectory browser, built from a real short CPU run.

The module fixture trains the tiny model on guess-v0 (a number in 1..4 over up to three turns: a
supervised cold start, then a few GSPO steps), so the run directory is what ``agentrl train``
writes, with multi-turn episodes. The browser test opens
the page in headless Chromium (Debian's ``chromium`` + the ``playwright`` package, no
``playwright install``) and is skipped, saying why, where either is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.config import load_config
from agentrl.loop.trainer import Trainer
from agentrl.report.build import add_report_command, build_report, scan_groups, select_groups
from agentrl.report.chips import summary_chips
from agentrl.report.page import render_page, turn_segments
from agentrl.report.plots import FIGURE_PX, Panel, plot_all, y_range
from agentrl.report.plots import FIGURES as SPECS
from agentrl.tiny import build_tiny_tokenizer
from agentrl.types import Message, Trajectory, TurnSpan

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FIGURES = ["reward", "clipping", "mismatch", "lengths", "outcomes", "speed"]


STEPS = 3
CONFIG: dict[str, Any] = {  # guess-v0: multi-turn, so episodes have assistant and env turns
    "name": "report-test",
    "seed": 0,
    "env": {
        "id": "guess-v0",
        "num_train_tasks": 64,
        "num_eval_tasks": 8,
        "task_kwargs": {"high": 4},
    },
    "rollout": {"group_size": 8, "max_turns": 3, "max_new_tokens": 4, "max_total_tokens": 160},
    "cold_start": {"steps": 40, "lr": 2e-3, "batch_size": 32},
    "learner": {"lr": 5e-5, "num_minibatches": 2},
    "train": {"steps": STEPS, "tasks_per_step": 4, "eval_every": 2, "max_staleness": 0},
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "guess"
    cfg = load_config({**CONFIG, "run_dir": str(out)})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU is shared: more threads only contend
    try:
        asyncio.run(Trainer(cfg).run())
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def report(run_dir: Path) -> Path:
    return build_report(run_dir)


def page_data(html: str) -> dict[str, Any]:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S)
    assert m is not None
    return json.loads(m.group(1))


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


@pytest.mark.slow  # uses the module's training run
def test_plots_are_pngs_of_the_right_size_and_inline(run_dir: Path, report: Path) -> None:
    html = report.read_text()
    for name in FIGURES:
        png = run_dir / f"{name}.png"
        assert png_size(png) == FIGURE_PX, name
        assert png.stat().st_size > 10_000, name  # drawn curves, not an empty canvas
        assert base64.b64encode(png.read_bytes()).decode() in html, name
    assert not (run_dir / "staleness.png").exists()  # no partial rollouts in this run
    assert "http://" not in html and "https://" not in html


@pytest.mark.slow  # uses the module's training run
def test_embedded_data_is_what_the_update_saw(run_dir: Path, report: Path) -> None:
    data = page_data(report.read_text())
    records = jsonl(run_dir / "trajectories.jsonl")
    assert len(records) >= 16, "the run should train on at least two groups"
    n = data["sampling"]
    assert n["total_trajectories"] == n["shown_trajectories"] == len(records)
    assert n["total_steps"] == len({r["step"] for r in records}) and n["unreadable_lines"] == 0
    episodes = [(g, e) for g in data["groups"] for e in g["episodes"]]
    assert len(episodes) == len(records)
    by_key: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for r in records:  # generated tasks can repeat, so a key can hold several records
        by_key.setdefault(
            (r["step"], r["trajectory"]["task_id"], r["trajectory"]["group_index"]), []
        ).append(r)
    tok = build_tiny_tokenizer()
    with_trainer = 0
    for g, e in episodes:
        same = by_key[(g["step"], g["task_id"], e["gi"])]
        rec = same.pop(next(i for i, r in enumerate(same) if r["trajectory"]["tokens"] == e["ids"]))
        t = rec["trajectory"]
        assert e["mask"] == t["loss_mask"] and e["ver"] == t["versions"]
        assert e["a"] == pytest.approx(rec["advantages"], abs=1e-4)
        assert e["reward"] == t["reward"] and e["finish"] == t["finish_reason"]
        resp = [i for i, m in enumerate(t["loss_mask"]) if m]
        assert e["adv"] == pytest.approx(
            sum(rec["advantages"][i] for i in resp) / len(resp), abs=1e-4
        )
        if rec["trainer_logprobs"] is None:  # the learner records its first mini-batch only
            assert e["mm"] is None
        else:
            with_trainer += 1
            want = [
                rec["trainer_logprobs"][i] - t["logprobs"][i] if m else 0.0
                for i, m in enumerate(t["loss_mask"])
            ]
            assert e["mm"] == pytest.approx(want, rel=1e-2, abs=1e-12)
        assert [(s["start"], s["end"]) for s in e["segs"]] == [(0, t["prompt_len"])] + [
            (s["start"], s["end"]) for s in t["turns"]
        ]
        assert e["segs"][-1]["end"] == len(t["tokens"])
        assert "".join(data["vocab"][str(i)] for i in t["tokens"]) == tok.decode(t["tokens"])
    assert with_trainer > 0
    # groups keep their episodes together, and a group's advantages are centred (GSPO)
    for g in data["groups"]:
        assert sorted(e["gi"] for e in g["episodes"]) == [e["gi"] for e in g["episodes"]]
        assert sum(e["adv"] for e in g["episodes"]) == pytest.approx(0.0, abs=1e-3)
    assert data["run"]["in_progress"] is False and data["run"]["summary"]["steps"] == STEPS
    assert data["run"]["chips"] == summary_chips(data["run"]["summary"])


@pytest.mark.slow  # uses the module's training run
def test_selection_keeps_groups_whole_newest_steps_first(run_dir: Path) -> None:
    groups, bad = scan_groups(run_dir / "trajectories.jsonl")
    assert bad == 0 and sum(len(g) for g in groups) == len(jsonl(run_dir / "trajectories.jsonl"))
    steps = sorted({g[0].step for g in groups}, reverse=True)
    first_of_step = [next(g for g in groups if g[0].step == s) for s in steps]
    budget = sum(len(g) for g in first_of_step[:2])
    chosen = select_groups(groups, max_trajectories=budget, max_bytes=2**40)
    assert chosen == first_of_step[:2]  # round 1: the first group of the two newest steps
    everything = select_groups(groups, max_trajectories=10**6, max_bytes=2**40)
    assert sorted(map(id, everything)) == sorted(map(id, groups))
    one_step = select_groups(groups, max_trajectories=10**6, max_bytes=2**40, steps=[steps[-1]])
    assert one_step == [g for g in groups if g[0].step == steps[-1]]
    tiny = select_groups(groups, max_trajectories=1, max_bytes=1)
    assert tiny == [first_of_step[0]]  # never split a group, never show nothing


@pytest.mark.slow  # uses the module's training run
def test_in_progress_run_with_half_written_lines(run_dir: Path, tmp_path: Path) -> None:
    live = tmp_path / "live"
    shutil.copytree(run_dir, live, ignore=shutil.ignore_patterns("*.png", "report.html"))
    (live / "summary.json").unlink()
    lines = (live / "trajectories.jsonl").read_text().splitlines(keepends=True)
    new = f'{{"step": {STEPS + 1},'

    def next_step(line: str) -> str:  # the record's step, whatever the writer's spacing
        out = re.sub(rf'^\{{"step":\s*{STEPS},', f'{{"step":{STEPS + 1},', line, count=1)
        assert out != line
        return out

    with (live / "trajectories.jsonl").open("a") as f:
        # the trainer is writing the next step's trajectories (3 lines out, the 4th half
        # written) and has not logged that step's metrics yet, only half of the line
        f.writelines(next_step(ln) for ln in lines[-3:])
        f.write(next_step(lines[-4])[:50])
    with (live / "metrics.jsonl").open("a") as f:
        f.write(new + ' "rollout/rew')
    data = page_data(build_report(live, max_trajectories=9).read_text())
    assert data["run"]["in_progress"] is True and data["run"]["last_step"] == STEPS
    assert data["sampling"]["total_trajectories"] == len(lines)
    assert data["sampling"]["pending_trajectories"] == 3
    assert data["sampling"]["shown_groups"] == 1 and data["sampling"]["unreadable_lines"] == 0
    assert data["groups"][0]["step"] == STEPS
    assert png_size(live / "reward.png") == FIGURE_PX


def test_page_data_cannot_close_its_script_element() -> None:
    hostile = "</script><script>alert(1)</script><!--"
    data = {"run": {"name": hostile}, "groups": [{"task_id": hostile}]}
    page = render_page(data, [])
    assert page.count("</script>") == 2  # the data element's and the code's own
    assert page_data(page) == data
    assert "<title>agentrl report: &lt;/script&gt;" in page


@pytest.mark.slow  # uses the module's training run
def test_staleness_plotted_when_present(run_dir: Path, tmp_path: Path) -> None:
    shutil.copy(run_dir / "metrics.jsonl", tmp_path / "metrics.jsonl")
    with (tmp_path / "metrics.jsonl").open("a") as f:
        for step in (5, 6):
            f.write(
                json.dumps(
                    {"step": step, "staleness/mean": 0.5 * step, "staleness/max": float(step)}
                )
                + "\n"
            )
    written = [p.name for p in plot_all(tmp_path)]
    assert written == [f"{n}.png" for n in FIGURES] + ["staleness.png"]
    assert png_size(tmp_path / "staleness.png") == FIGURE_PX


def test_turn_segments_label_tool_and_env_turns() -> None:
    # prompt (system+user) | assistant | tool result | assistant | env feedback | assistant
    spans = [
        (3, 5, "assistant"),
        (5, 7, "observation"),
        (7, 9, "assistant"),
        (9, 10, "observation"),
        (10, 12, "assistant"),
    ]
    traj = Trajectory(
        task_id="t",
        env_id="e",
        prompt_len=3,
        tokens=list(range(12)),
        loss_mask=[0] * 3 + [int(k == "assistant") for s, e, k in spans for _ in range(s, e)],
        logprobs=[0.0] * 12,
        versions=[-1] * 12,
        turns=[
            TurnSpan(kind=k, start=s, end=e, reward=0.5 if k == "assistant" else None)
            for s, e, k in spans
        ],
        messages=[
            Message(role="system", content="s"),
            Message(role="user", content="u"),
            Message(role="assistant", content="a"),
            Message(role="tool", content="r"),
            Message(role="assistant", content="b"),
            Message(role="user", content="hint"),
            Message(role="assistant", content="c"),
            Message(role="user", content="done"),
        ],
    )
    segs = turn_segments(traj)
    assert [s["label"] for s in segs] == [
        "prompt (system, user)",
        "assistant (turn 1)",
        "tool",
        "assistant (turn 2)",
        "env",
        "assistant (turn 3)",
    ]
    assert [(s["start"], s["end"]) for s in segs] == [(0, 3)] + [(s, e) for s, e, _ in spans]


@pytest.mark.slow  # uses the module's training run
def test_cli_command(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="agentrl")
    add_report_command(parser.add_subparsers())
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("*.png", "report.html"))
    args = parser.parse_args(["report", str(copy), "--max-trajectories", "8", "--steps", "1,2"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(copy / "report.html")
    data = page_data((copy / "report.html").read_text())
    assert {g["step"] for g in data["groups"]} <= {1, 2} and data["sampling"]["shown_groups"] == 1
    missing = parser.parse_args(["report", str(tmp_path / "nope")])
    assert missing.func(missing) == 1


def _backgrounds(page: Any, selector: str) -> list[str]:
    return page.eval_on_selector_all(
        selector, "els => els.map(e => getComputedStyle(e).backgroundColor)"
    )


@pytest.mark.slow  # uses the module's training run
def test_browser_shows_turns_and_shading_offline(report: Path, tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs `pip install playwright`")
    data = page_data(report.read_text())

    def turns(e: dict[str, Any]) -> int:
        return sum(s["kind"] == "assistant" for s in e["segs"])

    # a group of the oldest step with a multi-turn episode (assistant, env, assistant, ...)
    oldest = min(g["step"] for g in data["groups"])
    gi = next(
        i
        for i, g in enumerate(data["groups"])
        if g["step"] == oldest and any(turns(e) > 1 for e in g["episodes"])
    )
    group = data["groups"][gi]
    pos = next(k for k, e in enumerate(group["episodes"]) if e["adv"] > 0)
    neg = max(
        (k for k, e in enumerate(group["episodes"]) if e["adv"] < 0),
        key=lambda k: turns(group["episodes"][k]),
    )
    assert turns(group["episodes"][neg]) > 1
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        requests: list[str] = []
        errors: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(report.as_uri())
        chips = page.locator("#chips").inner_text()
        assert "held-out success at RL start: " in chips and "wall time: " in chips
        for key in data["run"]["summary"]:  # no raw key such as success_start or wall_s
            assert not re.search(rf"\b{key}\b", chips) or key in ("env", "loss", "steps"), key
        for name in FIGURES:  # under each plot, one caption per panel
            spec = next(f for f in SPECS if f.name == name)
            shown = page.locator(f"#fig-{name} .panel-caption").all_inner_texts()
            assert [c.split(":")[0] for c in shown] == [p.title for p in spec.panels], name
        page.select_option("#step-select", str(group["step"]))
        page.select_option("#group-select", str(gi))
        rows = page.locator("#group-table tbody tr")
        assert rows.count() == len(group["episodes"])
        shades = {}
        for k in (pos, neg):
            rows.nth(k).click()
            ep = group["episodes"][k]
            assert page.locator("#turns .turn").count() == len(ep["segs"])
            labels = page.locator("#turns .turn-head").all_inner_texts()
            heads = [h.split(" · ")[0] for h in labels]
            assert heads == [s["label"] for s in ep["segs"]]
            assert heads[:2] == ["prompt (user)", "assistant (turn 1)"]
            assert page.locator("#turns .tok").count() == ep["ntok"]
            assert page.locator("#turns .tok.masked").count() == ep["ntok"] - ep["nresp"]
            assert page.locator("#side").inner_text().count(f"{ep['reward']:.4f}") >= 1
            shades[k] = set(_backgrounds(page, "#turns .tok:not(.masked)"))
            masked = set(_backgrounds(page, "#turns .tok.masked"))
            assert len(shades[k]) == 1 and not shades[k] & masked  # one advantage per episode
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        assert shades[pos] != shades[neg]
        assert "env" in heads and "assistant (turn 2)" in heads  # the multi-turn episode
        page.select_option("#shade-select", "lp")  # behaviour log-prob varies token by token
        ep = group["episodes"][neg]
        n_lp = len({round(ep["lp"][t], 2) for t in range(ep["ntok"]) if ep["mask"][t]})
        assert len(set(_backgrounds(page, "#turns .tok:not(.masked)"))) >= min(n_lp, 2)
        browser.close()
    assert errors == []
    assert requests == [report.as_uri()], requests
    assert png_size(tmp_path / "report.png")[0] == 1400


SUMMARY = {  # the keys the trainer writes (agentrl/loop/summary.py), plus a newer one
    "success_start": 0.375,
    "success_end": 0.8125,
    "steps": 40,
    "wall_s": 185.25,
    "rl_wall_s": 120.5,
    "cold_start_s": 64.75,
    "turns_mean": 1.98,
    "tool_calls_mean": 0.99,
    "tool_use_frac": 0.96875,
    "env": "lookup-v0",
    "loss": "gspo_token",
    "run_dir": "/runs/lookup",
    "warnings": {"no_learning_signal": 28},
    "failures": {"episodes": 5120, "failed": 4, "by_cause": {"env": 3, "timeout": 1}},
    "failed_by_cause": {"env_error": 3, "timeout": 1},
}


def test_summary_chips_name_facts_with_units() -> None:
    chips = {c["label"]: c["value"] for c in summary_chips(SUMMARY)}
    assert chips == {
        "held-out success at RL start": "37.5%",
        "held-out success at end": "81.2%",
        "RL steps": "40",
        "wall time": "3 min 05 s",
        "cold start": "1 min 05 s",
        "RL time": "2 min 00 s",
        "turns per episode at end": "1.98",
        "tool calls per episode at end": "0.99",
        "episodes that used the tool": "96.9%",
        "env": "lookup-v0",
        "loss": "gspo_token",
        "failed episodes": "4 of 5120 (env 3, timeout 1)",
        "warnings": "no learning signal 28",
        "failed by cause": "env error 3, timeout 1",  # a key the chips do not know yet
    }
    assert summary_chips({"warnings": {}})[0]["value"] == "none"
    assert summary_chips({"failures": [1]}) == []  # an unknown shape is left to summary.json
    text = " ".join(f"{c['label']}: {c['value']}" for c in summary_chips(SUMMARY))
    assert "_" not in text.replace("gspo_token", "") and "/" not in text
    long = summary_chips({"first_error": "x" * 10_000})[0]
    assert long["label"] == "first error" and len(long["value"]) == 80


def _panel(title: str) -> Panel:
    return next(p for f in SPECS for p in f.panels if p.title == title)


def test_axis_ranges_do_not_magnify_noise() -> None:
    turns = [1.98, 2.0, 1.99, 2.0]  # a two-turn env: the mean barely moves
    lo, hi = y_range(_panel("turns"), turns) or (1.0, 1.0)
    assert lo <= 0 and hi >= 2.0 and hi - lo < 2.5  # from 0, so 1.98-2.00 reads as flat
    assert y_range(_panel("failed episodes"), [0.0, 0.0]) == pytest.approx((-0.05, 1.05))
    assert y_range(_panel("success rate"), [0.5, 0.51]) == (-0.02, 1.02)
    lo, hi = y_range(_panel("importance ratio"), [1.0, 1.0001]) or (1.0, 1.0)
    assert hi - lo >= 0.05 and lo < 1.0 < hi  # not zoomed to 1e-4 of round-off
    assert y_range(_panel("numeric mismatch, per token |diff|"), [1e-7, 1e-6]) is None  # log
    # the drawn axes of the lengths figure use it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from agentrl.report.plots import _draw_panel

    fig, ax = plt.subplots()
    try:
        _draw_panel(ax, _panel("turns"), [("mean", [(i + 1, y) for i, y in enumerate(turns)])])
        assert ax.get_ylim()[0] <= 0 <= 2.0 <= ax.get_ylim()[1]
    finally:
        plt.close(fig)


def test_outcomes_split_fractions_from_counts() -> None:
    outcomes = next(f for f in SPECS if f.name == "outcomes")
    fraction, failed, no_signal = outcomes.panels
    assert fraction.unit_range and {k for k, _ in fraction.series} == {
        "rollout/truncated_frac",
        "rollout/success_rate",
    }
    for counts in (failed, no_signal):
        assert not counts.unit_range and counts.from_zero and counts.whole
    assert failed.series == (("rollout/failed", "all causes"),)
    assert no_signal.series == (("rollout/zero_signal_groups", "groups"),)
    for panel in (p for f in SPECS for p in f.panels):  # no panel mixes fractions and counts
        keys = [k for k, _ in panel.series] + ([panel.prefix] if panel.prefix else [])
        fractions = [("frac" in k or "rate" in k or "hist" in k) for k in keys]
        assert panel.unit_range == all(fractions), panel.title
        if panel.unit_range:
            assert not panel.from_zero and not panel.whole


def test_every_panel_has_a_one_line_caption_on_the_page() -> None:
    plots = [(f"{f.name}.png", "") for f in SPECS]
    page = render_page({"run": {"name": "r"}, "groups": []}, plots)
    for figure in SPECS:
        for panel in figure.panels:
            assert panel.caption and "\n" not in panel.caption and len(panel.caption) <= 200
            line = f"<b>{panel.title}</b>: {panel.caption}".replace(">=", "&gt;=")
            assert line.replace("'", "&#x27;") in page, panel.title
    for title in ("clip fraction", "numeric mismatch, per token |diff|", "versions behind"):
        assert _panel(title).caption  # the panels a newcomer asks about
