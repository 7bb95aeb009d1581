"""The page of ``report.html``: the episode data it shows, its HTML, CSS and JavaScript.

:func:`episode_payload` defines the shape of an episode that the JavaScript reads (compact
per-token arrays, labelled turn segments), so the two live together. The page is static and
loads no external resource: plots are ``data:`` URIs, the data is a JSON script element, and
the browser is vanilla JavaScript that builds the DOM with ``textContent`` (run data is never
parsed as HTML). The JSON is escaped so that no ``<`` can close its script element.
"""

from __future__ import annotations

import html
import json
from typing import Any

from agentrl.report.plots import figure_captions
from agentrl.types import Trajectory

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#eceff1;padding:12px 20px}
header h1{margin:0;font-size:20px} header .sub{opacity:.8;font-size:13px}
section{padding:12px 20px} h2{font-size:17px;margin:8px 0}
.banner{background:#fff3cd;border:1px solid #e0c36a;padding:6px 10px;margin:8px 0}
.chips span{display:inline-block;background:#eceff1;border-radius:10px;padding:2px 9px;margin:2px;
 font-size:13px;color:#455a64} .chips b{color:#263238}
.plots{display:flex;flex-wrap:wrap;gap:10px}
.plots figure{margin:0;background:#fff;border:1px solid #ddd;padding:4px}
.plots figure{width:660px;max-width:100%} .plots img{width:100%;display:block}
figcaption{font-size:12px;color:#444;padding:2px 6px} figcaption p{margin:3px 0}
figcaption .file{color:#888;font-size:11px}
.controls{display:flex;gap:14px;flex-wrap:wrap;align-items:center;margin:8px 0}
.note{font-size:12px;color:#555}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ddd;padding:2px 7px;
 font-size:12px;text-align:right} th{background:#eceff1}
#group-table tbody tr{cursor:pointer} #group-table tbody tr:hover{background:#f1f8ff}
#group-table tr.sel{background:#dbeafe}
.bar{display:inline-block;height:9px;vertical-align:middle;margin-left:4px}
.episode{display:flex;gap:16px;align-items:flex-start;margin-top:10px}
#turns{flex:1;min-width:0} aside{width:320px;flex:none;background:#fff;border:1px solid #ddd;
 padding:8px;font-size:12px;position:sticky;top:6px}
.turn{background:#fff;border:1px solid #ddd;margin-bottom:8px}
.turn-head{font-size:12px;background:#eceff1;padding:3px 8px}
.turn.assistant .turn-head{background:#e3f2fd} .turn.observation .turn-head{background:#f3e5f5}
.toks{font:13px/1.9 ui-monospace,monospace;padding:6px 8px;white-space:pre-wrap;
 word-break:break-all}
.tok{white-space:pre;border-radius:2px;padding:1px 0}
.tok.masked{color:#9e9e9e;
 background:repeating-linear-gradient(45deg,#f4f4f4,#f4f4f4 3px,#e8e8e8 3px,#e8e8e8 6px)}
.tok:hover{outline:1px solid #333}
.kv{display:grid;grid-template-columns:auto 1fr;gap:1px 8px} .kv b{color:#555;font-weight:600}
.legend{height:12px;border:1px solid #ccc;margin:4px 0} .err{color:#b71c1c}
pre{background:#fff;border:1px solid #ddd;padding:8px;font-size:12px;overflow:auto}
.msg{border-left:3px solid #90a4ae;padding-left:6px;margin:4px 0;white-space:pre-wrap}
"""

_BODY = """
<header><h1 id="title"></h1><div class="sub" id="subtitle"></div></header>
<section><div id="banner"></div><div class="chips" id="chips"></div></section>
<section><h2>Curves</h2><div class="plots">__PLOTS__</div></section>
<section id="browser"><h2>Trajectories</h2><div class="note" id="sampling"></div>
<div class="controls">
 <label>Step <select id="step-select"></select></label>
 <label>Task <select id="group-select"></select></label>
 <label>Shade by <select id="shade-select">
  <option value="adv">advantage (per token)</option>
  <option value="lp">behaviour log-prob</option>
  <option value="mm">mismatch (trainer - engine)</option>
  <option value="ver">weight version</option>
  <option value="none">nothing</option></select></label>
</div>
<table id="group-table"><thead><tr><th>episode</th><th>reward</th><th>advantage</th>
<th>finish</th><th>response tokens</th><th>turns</th><th>error</th></tr></thead>
<tbody></tbody></table>
<div class="episode"><div id="turns"></div><aside id="side"></aside></div>
</section>
<section><details><summary>config.yaml</summary><pre id="config"></pre></details></section>
"""

_JS = r"""
const D = JSON.parse(document.getElementById('report-data').textContent);
const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => { const e = document.createElement(tag);
  if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; };
const fmt = (x, d = 4) => x === null || x === undefined ? '-' : (Math.abs(x) < 1e-3 && x !== 0
  ? x.toExponential(2) : (+x).toFixed(d));
const S = {group: null, ep: 0, shade: 'adv'};
const steps = [...new Set(D.groups.map((g) => g.step))].sort((a, b) => b - a);

function header() {
  const r = D.run; $('title').textContent = 'agentrl report: ' + r.name;
  $('subtitle').textContent = r.dir + ' · generated ' + r.generated_at;
  if (r.in_progress) $('banner').append(el('div', 'banner', 'Run in progress (no summary.json ' +
    'yet; last step ' + r.last_step + '). Re-run `agentrl report` to refresh.'));
  for (const c of r.chips || []) { const chip = el('span', '', c.label + ': ');
    chip.append(el('b', '', c.value)); chip.title = 'summary.json: ' + c.key;
    $('chips').append(chip); }
  if (r.last_metrics) { const d = el('details'); d.append(el('summary', '', 'Metrics of the ' +
    'last record (step ' + r.last_metrics.step + ')')); const t = el('div', 'kv');
    for (const [k, v] of Object.entries(r.last_metrics)) if (k !== 'time') kv(t, k, fmt(v, 4));
    d.append(t); $('chips').after(d); }
  $('config').textContent = r.config_text;
  const n = D.sampling;
  $('sampling').textContent = 'Showing ' + n.shown_trajectories + ' of ' + n.total_trajectories +
    ' trajectories (' + n.shown_groups + ' of ' + n.total_groups + ' groups, ' + n.shown_steps +
    ' of ' + n.total_steps + ' steps). Rule: ' + n.rule + '.' + (n.unreadable_lines ?
    ' Unreadable lines skipped: ' + n.unreadable_lines + '.' : '') + (n.pending_trajectories ?
    ' ' + n.pending_trajectories + ' trajectories of a step not logged yet are left for the ' +
    'next refresh.' : '') +
    (D.tokenizer ? '' : ' No tokenizer: tokens are shown as ids.');
}

function fillSteps() {
  const sel = $('step-select');
  for (const s of steps) { const n = D.groups.filter((g) => g.step === s).length;
    const o = el('option', '', 'step ' + s + ' (' + n + (n > 1 ? ' groups)' : ' group)'));
    o.value = s; sel.append(o); }
  sel.onchange = () => fillGroups(+sel.value); if (steps.length) fillGroups(steps[0]);
}

function fillGroups(step) {
  const sel = $('group-select'); sel.textContent = '';
  D.groups.forEach((g, i) => { if (g.step !== step) return;
    const mean = g.episodes.reduce((a, e) => a + e.reward, 0) / g.episodes.length;
    const o = el('option', '', g.task_id + ' (mean reward ' + fmt(mean, 2) + ')'); o.value = i;
    sel.append(o); });
  sel.onchange = () => selectGroup(+sel.value); if (sel.options.length) selectGroup(+sel.value);
}

function bar(v, scale, pos, neg) {
  const b = el('span', 'bar'); b.style.width = Math.round(40 * Math.min(1, Math.abs(v) /
    (scale || 1))) + 'px'; b.style.background = v >= 0 ? pos : neg; return b;
}

function selectGroup(i) {
  S.group = i; const g = D.groups[i]; const body = $('group-table').tBodies[0];
  body.textContent = '';
  const aMax = Math.max(1e-9, ...g.episodes.map((e) => Math.abs(e.adv)));
  const rMax = Math.max(1e-9, ...g.episodes.map((e) => Math.abs(e.reward)));
  g.episodes.forEach((e, k) => { const tr = el('tr'); tr.dataset.ep = k;
    const cells = ['#' + e.gi, null, null, e.finish, e.nresp,
      e.segs.filter((s) => s.kind === 'assistant').length, e.error || ''];
    cells.forEach((c, j) => { const td = el('td', '', c === null ? undefined : String(c));
      if (j === 1) { td.textContent = fmt(e.reward, 3);
        td.append(bar(e.reward, rMax, '#43a047', '#e53935')); }
      if (j === 2) { td.textContent = fmt(e.adv, 3) + (e.adv_min !== e.adv_max ? ' [' +
        fmt(e.adv_min, 2) + ', ' + fmt(e.adv_max, 2) + ']' : '');
        td.append(bar(e.adv, aMax, '#d32f2f', '#1e88e5')); }
      if (j === 6 && c) td.className = 'err'; tr.append(td); });
    tr.onclick = () => selectEpisode(k); body.append(tr); });
  selectEpisode(0);
}

function groupScale(key) {
  let m = 0; for (const e of D.groups[S.group].episodes) { const v = e[key]; if (!v) continue;
    e.mask.forEach((on, t) => { if (on) m = Math.max(m, Math.abs(v[t])); }); } return m || 1e-12;
}

const PALETTE = ['#c8e6c9', '#bbdefb', '#ffe0b2', '#e1bee7', '#b2ebf2', '#f8bbd0', '#dcedc8',
  '#d7ccc8'];
// Shades stop at 70% so that black token text stays readable on the darkest one.
function mix(rgb, t) { t = 0.7 * Math.max(0, Math.min(1, t));
  return 'rgb(' + rgb.map((c) => Math.round(255 - t * (255 - c))).join(',') + ')'; }
function diverging(v, s) {
  return v >= 0 ? mix([214, 39, 40], v / s) : mix([31, 119, 180], -v / s); }

function shadeOf(e, t, scales) {
  if (S.shade === 'adv') return diverging(e.a[t], scales.adv);
  if (S.shade === 'lp') return mix([255, 140, 0], 1 - Math.exp(e.lp[t]));
  if (S.shade === 'mm') return e.mm ? diverging(e.mm[t], scales.mm) : '';
  if (S.shade === 'ver') return PALETTE[((e.ver[t] % 8) + 8) % 8];
  return '';
}

function legend(scales) {
  const box = el('div'); const bar = el('div', 'legend'); let lo = '', hi = '';
  if (S.shade === 'adv' || S.shade === 'mm') { const s = scales[S.shade];
    bar.style.background = 'linear-gradient(90deg,' + diverging(-s, s) + ',#fff,' +
      diverging(s, s) + ')';
    lo = fmt(-s); hi = fmt(s); }
  else if (S.shade === 'lp') { bar.style.background = 'linear-gradient(90deg,#fff,' +
    mix([255, 140, 0], 1) + ')'; lo = 'p = 1'; hi = 'p = 0'; }
  else if (S.shade === 'ver') {
    bar.style.background = 'linear-gradient(90deg,' + PALETTE.join(',') + ')';
    lo = 'colour = version mod 8'; }
  const scaled = S.shade === 'adv' || S.shade === 'mm' ? ' (largest |value| in the group)' : '';
  box.append(el('div', '', lo + ' … ' + hi + scaled), bar,
    el('div', 'note', 'Striped grey: masked tokens (prompt, tool, env; loss mask 0).'));
  if (S.shade === 'mm' && !D.groups[S.group].episodes[S.ep].mm)
    box.append(el('div', 'note', 'No trainer log-probs were recorded for this episode (the ' +
      'learner records them for the trajectories of its first mini-batch).'));
  return box;
}

function kv(parent, k, v, cls) { parent.append(el('b', '', k), el('span', cls || '', v)); }

function side(e, scales) {
  const a = $('side'); a.textContent = ''; a.append(el('h3', '', 'Episode #' + e.gi));
  const g = el('div', 'kv'); a.append(g);
  kv(g, 'task', e.task_id); kv(g, 'step', String(e.step)); kv(g, 'kind', e.kind || 'trained');
  kv(g, 'reward', fmt(e.reward, 4));
  kv(g, 'advantage', fmt(e.adv, 4)); kv(g, 'finish', e.finish || '-');
  kv(g, 'terminated', String(e.terminated)); kv(g, 'truncated', String(e.truncated));
  kv(g, 'error', e.error || 'none', e.error ? 'err' : '');
  kv(g, 'tokens', e.ntok + ' (' + e.nresp + ' sampled)');
  a.append(el('h4', '', 'Verifier / env per turn'));
  for (const s of e.segs) if (s.kind === 'assistant') { const t = el('div', 'kv');
    kv(t, s.label, 'reward ' + fmt(s.reward, 3));
    for (const [k, v] of Object.entries(s.info || {})) kv(t, k, JSON.stringify(v)); a.append(t); }
  if (Object.keys(e.info || {}).length) { a.append(el('h4', '', 'Episode info'));
    a.append(el('pre', '', JSON.stringify(e.info, null, 1))); }
  a.append(el('h4', '', 'Shading'), legend(scales));
  a.append(el('h4', '', 'Token'), el('div', 'note', 'Hover a token.'));
  a.lastChild.id = 'tok-info';
}

function tokText(id) { const s = D.vocab[id] ?? ('<' + id + '>');
  return s.replace(/\n/g, '\u21b5').replace(/\t/g, '\u2192'); }

function tokInfo(e, t) {
  const mm = e.mm ? e.mm[t] : null;
  return 'token ' + t + ' · id ' + e.ids[t] + ' ' + JSON.stringify(D.vocab[e.ids[t]] ?? '') +
    '\nmask ' + e.mask[t] + ' · advantage ' + fmt(e.a[t]) + '\nbehaviour log-prob ' + fmt(e.lp[t]) +
    (mm === null ? '' : ' · trainer ' + fmt(e.lp[t] + mm) + ' · mismatch ' + fmt(mm)) +
    '\nweight version ' + e.ver[t];
}

function selectEpisode(k) {
  S.ep = k; const e = D.groups[S.group].episodes[k];
  for (const tr of $('group-table').tBodies[0].rows)
    tr.classList.toggle('sel', +tr.dataset.ep === k);
  const scales = {adv: groupScale('a'), mm: groupScale('mm')}; side(e, scales);
  const box = $('turns'); box.textContent = '';
  for (const s of e.segs) {
    const turn = el('div', 'turn ' + s.kind); turn.dataset.kind = s.kind;
    turn.append(el('div', 'turn-head', s.label + ' · tokens ' + s.start + '–' + s.end +
      (s.reward !== undefined && s.reward !== null ? ' · reward ' + fmt(s.reward, 3) : '')));
    const toks = el('div', 'toks');
    for (let t = s.start; t < s.end; t++) {
      const span = el('span', e.mask[t] ? 'tok' : 'tok masked', tokText(e.ids[t]));
      span.dataset.i = t; if (e.mask[t]) span.style.backgroundColor = shadeOf(e, t, scales);
      span.title = tokInfo(e, t);
      span.onmouseenter = () => { $('tok-info').textContent = tokInfo(e, t); };
      toks.append(span); if (D.vocab[e.ids[t]] === '\n') toks.append(el('br'));
    }
    turn.append(toks); box.append(turn);
  }
  const msgs = el('details'); msgs.append(el('summary', '', 'Conversation as text (' +
    e.messages.length + ' messages)'));
  for (const m of e.messages) msgs.append(el('div', 'msg', m.role + ': ' + m.content));
  box.append(msgs);
}

$('shade-select').onchange = (ev) => { S.shade = ev.target.value;
  if (S.group !== null) selectEpisode(S.ep); };
header(); fillSteps();
if (!D.groups.length) $('turns').append(el('div', 'note', 'No trajectories recorded yet.'));
"""


def _observation_roles(traj: Trajectory) -> list[str]:
    """``tool`` or ``env`` for each block of messages that follows an assistant message."""
    roles: list[str] = []
    seen_assistant = False
    for m in traj.messages:
        if m.role == "assistant":
            seen_assistant = True
            roles.append("")
        elif seen_assistant and roles:
            roles[-1] = "tool" if m.role == "tool" or roles[-1] == "tool" else "env"
    return [r for r in roles if r]


def turn_segments(traj: Trajectory) -> list[dict[str, Any]]:
    """Labelled spans covering every token: the prompt, then each turn, gaps as ``other``."""
    n = len(traj.tokens)
    prompt_roles = []
    for m in traj.messages:
        if m.role == "assistant":
            break
        prompt_roles.append(m.role)
    segs: list[dict[str, Any]] = []
    if traj.prompt_len:
        roles = ", ".join(dict.fromkeys(prompt_roles))
        label = f"prompt ({roles})" if roles else "prompt"
        segs.append({"label": label, "kind": "prompt", "start": 0, "end": traj.prompt_len})
    obs_roles = iter(_observation_roles(traj))
    pos, k = traj.prompt_len, 0
    for turn in sorted(traj.turns, key=lambda t: t.start):
        if turn.start > pos:
            segs.append({"label": "other", "kind": "other", "start": pos, "end": turn.start})
        if turn.kind == "assistant":
            k += 1
            label = f"assistant (turn {k})"
        else:
            label = next(obs_roles, "env")
        segs.append(
            {
                "label": label,
                "kind": turn.kind,
                "start": turn.start,
                "end": turn.end,
                "reward": turn.reward,
                "info": turn.info,
            }
        )
        pos = max(pos, turn.end)
    if pos < n:
        segs.append({"label": "other", "kind": "other", "start": pos, "end": n})
    return segs


def _per_token(values: Any, n: int) -> list[float] | None:
    if not isinstance(values, list) or len(values) != n:
        return None
    return [float(v) if v is not None else 0.0 for v in values]


def episode_payload(rec: dict[str, Any]) -> dict[str, Any]:
    """One trajectory record of ``trajectories.jsonl`` as the page's compact episode object."""
    traj = Trajectory.model_validate(rec["trajectory"])
    n = len(traj.tokens)
    adv = _per_token(rec.get("advantages"), n) or [0.0] * n
    trainer = _per_token(rec.get("trainer_logprobs"), n)
    resp = [i for i, m in enumerate(traj.loss_mask) if m]
    seq_adv = sum(adv[i] for i in resp) / len(resp) if resp else 0.0
    mismatch = None
    if trainer is not None:  # trainer - engine, full precision before rounding (values ~1e-7)
        mismatch = [
            float(f"{trainer[i] - traj.logprobs[i]:.3g}") if m else 0.0
            for i, m in enumerate(traj.loss_mask)
        ]
    return {
        "step": rec.get("step"),
        "kind": rec.get("kind", "trained"),  # or failed / timeout / zero_signal (not trained)
        "task_id": traj.task_id,
        "gi": traj.group_index,
        "reward": traj.reward,
        "adv": round(seq_adv, 4),
        "adv_min": round(min((adv[i] for i in resp), default=0.0), 4),
        "adv_max": round(max((adv[i] for i in resp), default=0.0), 4),
        "finish": traj.finish_reason,
        "error": traj.error,
        "terminated": traj.terminated,
        "truncated": traj.truncated,
        "ntok": n,
        "nresp": len(resp),
        "info": traj.info,
        "messages": [m.model_dump() for m in traj.messages],
        "segs": turn_segments(traj),
        "ids": traj.tokens,
        "mask": traj.loss_mask,
        "lp": [round(x, 4) for x in traj.logprobs],
        "ver": traj.versions,
        "a": [round(x, 4) for x in adv],
        "mm": mismatch,
    }


def _data_json(data: dict[str, Any]) -> str:
    # "<" escaped as \u003c keeps "</script>" and "<!--" in run data from ending the element.
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")


def _figure(name: str, b64: str) -> str:
    """One plot with a line per panel that says how to read it."""
    stem = name.removesuffix(".png")
    lines = "".join(
        f'<p class="panel-caption"><b>{html.escape(title)}</b>: {html.escape(caption)}</p>'
        for title, caption in figure_captions(stem)
        if caption
    )
    return (
        f'<figure id="fig-{html.escape(stem)}"><img alt="{html.escape(stem)}" '
        f'src="data:image/png;base64,{b64}"><figcaption>{lines}'
        f'<span class="file">{html.escape(name)}</span></figcaption></figure>'
    )


def render_page(data: dict[str, Any], plots: list[tuple[str, str]]) -> str:
    """The whole HTML document.

    Args:
        data: the JSON-serialisable report data (:func:`agentrl.report.build.collect_report_data`).
        plots: ``(file name, base64 PNG)`` pairs, shown in order.
    """
    figures = "".join(_figure(name, b64) for name, b64 in plots)
    title = html.escape(f"agentrl report: {data['run']['name']}")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        # The page may load nothing from anywhere: a CSP makes that a browser-enforced rule.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'\">"
        f"<title>{title}</title><style>{_CSS}</style></head><body>"
        + _BODY.replace("__PLOTS__", figures)
        + f'<script type="application/json" id="report-data">{_data_json(data)}</script>'
        + f"<script>{_JS}</script></body></html>\n"
    )
