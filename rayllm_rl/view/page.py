"""The trace viewer's page: one self-contained HTML file made from a run directory alone.

It shows, per RL step, the traced samples: the prompt, the completion with each token coloured by the
version lag of the policy that sampled it (or by its rollout/learner mismatch, or by version), the
reward and its components, with the step's figures from metrics.jsonl. Filters: reward range, version
lag, step range. The filters and colouring can also be set in the URL's fragment, e.g.
`trace.html#min_reward=0.5&lag=1&color=mismatch`, so a link opens a view.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from rayllm_rl.view.records import read_traces

PAGE_FILE = "trace.html"
STEP_FIELDS = ("reward", "version", "staleness_max", "mismatch_abs_logp_diff", "mismatch_k3", "mismatch_ratio_max",
               "teacher_kl_mean", "teacher_kl_p90", "teacher_s", "teacher_share")
"""Figures of each step shown beside its samples (from metrics.jsonl, when the run wrote it)."""

_STYLE = """
body{font:14px system-ui,sans-serif;margin:1em 2em;color:#222}
#controls{position:sticky;top:0;background:#fff;padding:.5em 0;border-bottom:1px solid #ccc}
#controls label{margin-right:1em}
input[type=number]{width:5em}
.step{margin:1em 0;border-top:2px solid #888}
.figures{color:#555;font-size:12px}
.sample{margin:.6em 0 .6em 1em;padding:.4em;border-left:3px solid #ccc}
.prompt{white-space:pre-wrap;color:#666;font-size:12px;max-height:6em;overflow:auto}
.completion{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:13px;line-height:1.6}
.tok{border-radius:2px}
.legend span{padding:0 .4em;margin-right:.3em}
"""

_SCRIPT = r"""
const DATA = JSON.parse(document.getElementById('data').textContent);
const LAG_COLOURS = ['#c8f7c5', '#fff3b0', '#ffd6a5', '#ffadad'];
const el = id => document.getElementById(id);
function lagColour(l) { return l === null ? '#eeeeee' : LAG_COLOURS[Math.min(l, 3)]; }
function mismatchColour(d) {
  if (d === null) return '#eeeeee';
  const a = Math.min(1, Math.abs(d) / 0.5);
  return d > 0 ? `rgba(0,90,255,${a.toFixed(3)})` : `rgba(255,40,0,${a.toFixed(3)})`;
}
function versionColour(v) { return v < 0 ? '#eeeeee' : `hsl(${(v * 47) % 360},70%,82%)`; }
function maxLag(s) { return Math.max(-1, ...s.lag.filter(l => l !== null)); }
function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  for (const [k, v] of p) { if (el(k)) el(k).value = v; }
}
function keep(s, step) {
  const lo = parseFloat(el('min_reward').value), hi = parseFloat(el('max_reward').value);
  const s0 = parseInt(el('from_step').value), s1 = parseInt(el('to_step').value);
  const lag = el('lag').value, m = maxLag(s);
  if (!isNaN(lo) && s.reward < lo) return false;
  if (!isNaN(hi) && s.reward > hi) return false;
  if (!isNaN(s0) && step < s0) return false;
  if (!isNaN(s1) && step > s1) return false;
  if (lag === '0' && m !== 0) return false;
  if (lag === '1' && m !== 1) return false;
  if (lag === '2+' && m < 2) return false;
  return true;
}
function tokenSpan(s, i, colour) {
  const span = document.createElement('span');
  span.className = 'tok';
  span.textContent = s.tokens[i];
  const v = s.versions[i], l = s.lag[i], d = s.mismatch[i];
  span.dataset.version = v; span.dataset.lag = l === null ? '' : l;
  span.style.background = colour === 'mismatch' ? mismatchColour(d)
    : colour === 'version' ? versionColour(v) : lagColour(l);
  span.title = `version ${v}` + (l === null ? '' : ` · lag ${l}`) + (d === null ? ' · not trained' : ` · Δlogp ${d}`);
  return span;
}
function render() {
  const colour = el('color').value, out = el('steps');
  out.replaceChildren();
  let shown = 0, total = 0, steps = 0;
  for (const rec of DATA.traces) {
    if (!rec.samples) continue;
    total += rec.samples.length;
    const kept = rec.samples.filter(s => keep(s, rec.step));
    if (!kept.length) continue;
    steps += 1; shown += kept.length;
    const box = document.createElement('div'); box.className = 'step'; box.dataset.step = rec.step;
    const h = document.createElement('h3'); h.textContent = `step ${rec.step}`; box.appendChild(h);
    const figs = DATA.steps[rec.step];
    if (figs) {
      const f = document.createElement('div'); f.className = 'figures';
      f.textContent = Object.entries(figs)
        .map(([k, v]) => `${k} ${typeof v === 'number' ? +v.toPrecision(4) : v}`).join(' · ');
      box.appendChild(f);
    }
    for (const s of kept) {
      const d = document.createElement('div'); d.className = 'sample';
      d.dataset.reward = s.reward; d.dataset.maxLag = maxLag(s);
      const head = document.createElement('div');
      const comps = Object.entries(s.components).map(([k, v]) => `${k} ${+v.toPrecision(4)}`).join(', ');
      head.textContent = `reward ${s.reward}` + (comps ? ` (${comps})` : '') +
        ` · trained from version ${s.trained_from}` +
        ` · max lag ${maxLag(s)}` + (s.cut_tokens ? ` · ${s.cut_tokens} more tokens not kept` : '');
      const p = document.createElement('div'); p.className = 'prompt'; p.textContent = s.prompt;
      const c = document.createElement('div'); c.className = 'completion';
      s.tokens.forEach((_, i) => c.appendChild(tokenSpan(s, i, colour)));
      d.append(head, p, c); box.appendChild(d);
    }
    out.appendChild(box);
  }
  el('count').textContent = `showing ${shown} of ${total} samples in ${steps} steps`;
  const legend = el('legend');
  legend.replaceChildren();
  const items = colour === 'mismatch' ? [['learner < rollout', mismatchColour(-0.5)], ['equal', mismatchColour(0)],
      ['learner > rollout', mismatchColour(0.5)], ['not trained', '#eeeeee']]
    : colour === 'version' ? [['one hue per policy version', versionColour(1)], ['prompt / not sampled', '#eeeeee']]
    : [['lag 0', LAG_COLOURS[0]], ['lag 1', LAG_COLOURS[1]], ['lag 2', LAG_COLOURS[2]], ['lag 3+', LAG_COLOURS[3]],
       ['not sampled', '#eeeeee']];
  for (const [t, bg] of items) {
    const s = document.createElement('span'); s.textContent = t; s.style.background = bg; legend.appendChild(s);
  }
}
readHash();
for (const id of ['min_reward', 'max_reward', 'lag', 'from_step', 'to_step', 'color']) {
  el(id).addEventListener('input', render);
}
window.addEventListener('hashchange', () => { readHash(); render(); });
render();
"""


def step_figures(run_dir: Path) -> dict[int, dict]:
    """`STEP_FIELDS` of each RL step's record in metrics.jsonl ({} when the run kept no jsonl)."""
    path = run_dir / "metrics.jsonl"
    out: dict[int, dict] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("phase") == "rl" and "step" in rec:
            out[int(rec["step"])] = {k: rec[k] for k in STEP_FIELDS if rec.get(k) is not None}
    return out


def render_page(run_dir: str | Path) -> str:
    """The page's HTML for `run_dir` (its traces.jsonl and, when there, metrics.jsonl)."""
    run_dir = Path(run_dir)
    data = {"traces": read_traces(run_dir), "steps": step_figures(run_dir)}
    blob = json.dumps(data).replace("</", "<\\/")  # no "</script>" inside the script element
    title = html.escape(f"rayllm_rl trace: {run_dir.name}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title><style>{_STYLE}</style></head>
<body>
<h1>{title}</h1>
<div id="controls">
<label>reward ≥ <input id="min_reward" type="number" step="any"></label>
<label>reward ≤ <input id="max_reward" type="number" step="any"></label>
<label>max version lag <select id="lag"><option value="any">any</option><option value="0">0</option>
<option value="1">1</option><option value="2+">2+</option></select></label>
<label>steps <input id="from_step" type="number"> to <input id="to_step" type="number"></label>
<label>colour by <select id="color"><option value="lag">version lag</option><option value="mismatch">mismatch</option>
<option value="version">version</option></select></label>
<span id="count"></span>
<div class="legend" id="legend"></div>
</div>
<div id="steps"></div>
<script type="application/json" id="data">{blob}</script>
<script>{_SCRIPT}</script>
</body></html>
"""


def write_page(run_dir: str | Path) -> Path:
    """Writes `<run_dir>/trace.html` and returns its path."""
    path = Path(run_dir) / PAGE_FILE
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_page(run_dir), encoding="utf-8")
    tmp.replace(path)
    return path
