"""Regression report: report.json (numbers), summary.md, report.html with matplotlib plots.

Written even for a failed run (missing bag, node down, ...): the run's error and whatever
was compared before it are the report's content then.
"""
from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
import datetime
import html
import io
import json
import os
from pathlib import Path
from typing import Optional

from edge_llm_ros.regression.compare import (ComparisonResult, CpuClasses, CROSS_CPU,
                                             EXIT_INPUT, GoalComparison, INFO, INPUT,
                                             REGRESSION, TOKEN_RULE_TEXT, WARNING)

SEVERITY_ORDER = (REGRESSION, INPUT, WARNING, INFO)
JSON_NAME = 'report.json'
MARKDOWN_NAME = 'summary.md'
HTML_NAME = 'report.html'


@dataclass
class RunInfo:
    """How the replay was run; goes into every report format as is."""

    bag: str = ''
    new_bag: str = ''
    node: str = ''
    timing: str = ''
    overrides: dict = field(default_factory=dict)
    thresholds: dict = field(default_factory=dict)
    thresholds_file: str = ''
    started: str = ''
    finished: str = ''
    # A fatal error that stopped the run early (the report is partial then).
    error: str = ''
    exit_code: Optional[int] = None
    notes: list = field(default_factory=list)


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


# ---------------------------------------------------------------- JSON

def _goal_json(goal: GoalComparison) -> dict:
    old, new = goal.old, goal.new
    return {
        'index': goal.index,
        'goal_id': old.goal_id,
        'new_goal_id': new.goal_id if new else None,
        'label': old.label(),
        'kind': goal.kind,
        'status': goal.outcome.status,
        'verdict': goal.worst(),
        'compared': goal.compared,
        'synthesized_transcript': goal.outcome.synthesized,
        'tokens_equal': goal.tokens_equal,
        'first_divergence': goal.first_divergence,
        'similarity': goal.similarity,
        'json_schema': bool(old.json_schema),
        'json_valid_old': goal.json_valid_old,
        'json_valid_new': goal.json_valid_new,
        'token_rule': goal.token_rule,
        'token_rule_text': TOKEN_RULE_TEXT.get(goal.token_rule),
        'leading_agreement': goal.leading_agreement,
        'required_agreement': goal.required_agreement,
        'tool_calls_old': [c.name for c in old.tool_calls],
        'tool_calls_new': [c.name for c in new.tool_calls] if new else None,
        'finish_reason_old': old.finish_reason,
        'finish_reason_new': new.finish_reason if new else None,
        'completion_tokens_old': old.completion_tokens,
        'completion_tokens_new': new.completion_tokens if new else None,
        'ttft_s_old': old.timings.time_to_first_token_s,
        'ttft_s_new': new.timings.time_to_first_token_s if new else None,
        'decode_tps_old': old.timings.decode_tokens_per_second,
        'decode_tps_new': new.timings.decode_tokens_per_second if new else None,
        'text_old': old.text,
        'text_new': new.text if new else None,
        'findings': [asdict(f) for f in goal.findings],
    }


def _cpu_json(cpu: Optional[CpuClasses]) -> dict:
    """Both runs' CPU classes and the token rule greedy goals got (None: not known)."""
    if cpu is None:
        return {'recorded': None, 'replay': None, 'same_class': None, 'token_rule': None,
                'token_rule_text': None}
    return {'recorded': cpu.recorded, 'replay': cpu.replay, 'same_class': cpu.same,
            'token_rule': cpu.token_rule, 'token_rule_text': TOKEN_RULE_TEXT[cpu.token_rule]}


def _drifted(goal: GoalComparison) -> bool:
    return any(f.code == 'cross_cpu_drift' for f in goal.findings)


def report_dict(result: ComparisonResult, run: RunInfo) -> dict:
    """Every number of the report, as written to report.json."""
    goals = result.goals
    findings = result.all_findings()
    exit_code = run.exit_code if run.exit_code is not None else (
        EXIT_INPUT if run.error else result.exit_code())
    verdict = 'ERROR' if run.error else result.verdict()
    greedy = [g for g in goals if g.kind == 'greedy' and g.compared]
    return {
        'verdict': verdict,
        'exit_code': exit_code,
        'run': asdict(run),
        'cpu': _cpu_json(result.cpu),
        'summary': {
            'goals': len(goals),
            'compared': sum(g.compared for g in goals),
            'greedy_compared': len(greedy),
            # Greedy goals that met their token rule: identical tokens, or (on another CPU
            # class) a divergence within the cross-CPU thresholds; the two counts follow.
            'greedy_exact': sum(bool(g.tokens_equal) or _drifted(g) for g in greedy),
            'greedy_identical': sum(bool(g.tokens_equal) for g in greedy),
            'greedy_cross_cpu_drift': sum(_drifted(g) for g in greedy),
            'regressions': sum(f.severity == REGRESSION for f in findings),
            'input_problems': sum(f.severity == INPUT for f in findings),
            'warnings': sum(f.severity == WARNING for f in findings),
        },
        'latency': [{
            'name': m.name, 'unit': m.unit, 'higher_is_better': m.higher_is_better,
            'goals': len(m.old), 'old_median': m.old_median, 'new_median': m.new_median,
            'ratio': m.ratio, 'gated': m.gated, 'limit': m.limit,
            'regression': m.regression, 'old': m.old, 'new': m.new,
        } for m in result.metrics],
        'findings': [asdict(f) for f in _sorted(findings)],
        'goals': [_goal_json(g) for g in goals],
    }


def _sorted(findings: list) -> list:
    return sorted(findings, key=lambda f: (SEVERITY_ORDER.index(f.severity),
                                           -1 if f.goal is None else f.goal))


# ---------------------------------------------------------------- plots

def _plots(result: ComparisonResult) -> dict:
    """Render the plots: name -> PNG bytes; empty when nothing was compared."""
    compared = [g for g in result.goals if g.compared]
    if not compared:
        return {}
    import matplotlib
    matplotlib.use('Agg')
    from matplotlib import pyplot as plt

    pngs = {}
    metrics = [m for m in result.metrics if m.old and m.name in ('TTFT', 'decode tok/s')]
    if metrics:
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6),
                                 squeeze=False)
        for ax, metric in zip(axes[0], metrics):
            ax.boxplot([metric.old, metric.new], tick_labels=['recorded', 'replay'])
            for x, values in ((1, metric.old), (2, metric.new)):
                ax.plot([x] * len(values), values, 'o', alpha=0.5, markersize=4)
            if metric.limit is not None:
                ax.axhline(metric.limit, color='red', linestyle='--', linewidth=1,
                           label='limit (median)')
                ax.legend(loc='best', fontsize=8)
            ax.set_title(f'{metric.name} ({len(metric.old)} goals)')
            ax.set_ylabel(metric.unit)
        fig.tight_layout()
        pngs['latency_distributions.png'] = _png(fig, plt)

    indices = [g.index for g in compared]
    fig, axes = plt.subplots(3, 1, figsize=(max(6.0, 0.45 * len(compared) + 3), 8),
                             sharex=True)
    colors = ['tab:red' if g.worst() == REGRESSION else 'tab:green' for g in compared]
    axes[0].bar(indices, [g.similarity for g in compared], color=colors)
    axes[0].set_ylim(0, 1.05)
    axes[0].set_ylabel('text similarity')
    axes[0].set_title('per goal (red = regression)')
    width = 0.4
    for ax, attr, label in ((axes[1], 'time_to_first_token_s', 'TTFT (s)'),
                            (axes[2], 'decode_tokens_per_second', 'decode tok/s')):
        ax.bar([i - width / 2 for i in indices],
               [getattr(g.old.timings, attr) for g in compared], width, label='recorded')
        ax.bar([i + width / 2 for i in indices],
               [getattr(g.new.timings, attr) for g in compared], width, label='replay')
        ax.set_ylabel(label)
        ax.legend(loc='best', fontsize=8)
    axes[2].set_xlabel('goal index')
    axes[2].set_xticks(indices)
    fig.tight_layout()
    pngs['per_goal.png'] = _png(fig, plt)
    return pngs


def _png(fig, plt) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format='png', dpi=90)
    plt.close(fig)
    return buffer.getvalue()


# ---------------------------------------------------------------- Markdown

def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return '-'
    if isinstance(value, bool):
        return 'yes' if value else 'no'
    if isinstance(value, float):
        return f'{value:.{digits}g}'
    return str(value)


def _md_cell(text: str) -> str:
    return str(text).replace('|', '\\|').replace('\n', ' ')


def _cpu_line(cpu: dict) -> str:
    """Return one sentence on both runs' CPU classes and the greedy token rule."""
    text = (f"recorded `{cpu['recorded']}`, replay `{cpu['replay']}`: greedy goals compared "
            f"{cpu['token_rule_text']}")
    if cpu['token_rule'] == CROSS_CPU:
        text += ('; a divergence within outputs.cross_cpu_* is float drift (a warning), '
                 'see docs/regression.md "Replaying on another machine"')
    return text


def _md_cpu(cpu: dict) -> list:
    return [f'- CPU class: {_cpu_line(cpu)}'] if cpu['token_rule'] else []


def render_markdown(data: dict, plot_names: list) -> str:
    run, summary = data['run'], data['summary']
    lines = [f"# LLM regression replay: {data['verdict']}", '']
    if run['error']:
        lines += [f"**Run stopped early:** {run['error']}", '']
    lines += [
        f"- bag: `{run['bag']}`", f"- replay bag: `{run['new_bag'] or '-'}`",
        f"- node: `{run['node']}`, timing: {run['timing']}",
        f"- overrides: {run['overrides'] or 'none'}",
        f"- thresholds: {run['thresholds_file'] or 'defaults'}",
        *_md_cpu(data['cpu']),
        f"- {run['started']} .. {run['finished']}, exit status {data['exit_code']}", '',
        f"Goals: {summary['goals']}, compared: {summary['compared']}, greedy exact: "
        f"{summary['greedy_exact']}/{summary['greedy_compared']} "
        f"({summary['greedy_identical']} identical, {summary['greedy_cross_cpu_drift']} "
        'cross-CPU drift), regressions: '
        f"{summary['regressions']}, input problems: {summary['input_problems']}, "
        f"warnings: {summary['warnings']}.", '']
    for note in run['notes']:
        lines.append(f'> {note}')
    if run['notes']:
        lines.append('')
    findings = [f for f in data['findings'] if f['severity'] != INFO]
    lines += ['## Findings', '']
    if not findings:
        lines += ['None.', '']
    for f in findings:
        where = 'run' if f['goal'] is None else f"goal {f['goal']}"
        lines.append(f"- **{f['severity']}** `{f['code']}` ({where}): {f['message']}")
    lines += ['', '## Latency (medians over goals finished in both runs)', '',
              '| metric | goals | recorded | replay | ratio | limit | verdict |',
              '|---|---|---|---|---|---|---|']
    for m in data['latency']:
        verdict = 'REGRESSION' if m['regression'] else ('ok' if m['gated'] else 'not gated')
        lines.append(f"| {m['name']} ({m['unit']}) | {m['goals']} | {_fmt(m['old_median'])} | "
                     f"{_fmt(m['new_median'])} | {_fmt(m['ratio'])} | {_fmt(m['limit'])} | "
                     f'{verdict} |')
    lines += ['', '## Goals', '',
              '| # | request | kind | token rule | status | tokens equal | similarity | finish | '
              'TTFT s | decode tok/s | verdict |',
              '|---|---|---|---|---|---|---|---|---|---|---|']
    for g in data['goals']:
        finish = f"{g['finish_reason_old']} -> {_fmt(g['finish_reason_new'])}"
        ttft = f"{_fmt(g['ttft_s_old'])} -> {_fmt(g['ttft_s_new'])}"
        tps = f"{_fmt(g['decode_tps_old'])} -> {_fmt(g['decode_tps_new'])}"
        lines.append(
            f"| {g['index']} | {_md_cell(g['label'])} | {g['kind']} | "
            f"{g['token_rule_text'] or '-'} | {g['status']} | "
            f"{_fmt(g['tokens_equal'])} | {_fmt(g['similarity'])} | {finish} | {ttft} | "
            f"{tps} | {g['verdict']} |")
    if plot_names:
        lines += ['', '## Plots', ''] + [f'![{name}]({name})' for name in plot_names]
    return '\n'.join(lines) + '\n'


# ---------------------------------------------------------------- HTML

_CSS = """body{font-family:sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;
font-size:90%;vertical-align:top}.regression{background:#fdd}.input{background:#ffe4c4}
.warning{background:#ffc}.pass{background:#efe}pre{white-space:pre-wrap;margin:0;
max-width:500px}.verdict-PASS{color:green}.verdict-REGRESSION,.verdict-ERROR{color:#c00}
.verdict-INCOMPLETE{color:#c60}"""


def render_html(data: dict, pngs: dict) -> str:
    esc = html.escape
    run, summary = data['run'], data['summary']
    out = ['<!DOCTYPE html><html><head><meta charset="utf-8">',
           f"<title>LLM regression: {esc(data['verdict'])}</title><style>{_CSS}</style>",
           '</head><body>',
           f"<h1>LLM regression replay: <span class=\"verdict-{esc(data['verdict'])}\">"
           f"{esc(data['verdict'])}</span></h1>"]
    if run['error']:
        out.append(f"<p class=\"regression\"><b>Run stopped early:</b> {esc(run['error'])}</p>")
    out.append('<table>')
    for key in ('bag', 'new_bag', 'node', 'timing', 'thresholds_file', 'started', 'finished'):
        out.append(f'<tr><th>{esc(key)}</th><td>{esc(str(run[key]) or "-")}</td></tr>')
    out.append(f"<tr><th>overrides</th><td>{esc(str(run['overrides'] or 'none'))}</td></tr>")
    if data['cpu']['token_rule']:
        out.append(f"<tr><th>CPU class</th><td>{esc(_cpu_line(data['cpu']))}</td></tr>")
    out.append(f"<tr><th>exit status</th><td>{data['exit_code']}</td></tr></table>")
    out.append('<p>' + ', '.join(f'{esc(k)}: {v}' for k, v in summary.items()) + '</p>')
    for note in run['notes']:
        out.append(f'<p><i>{esc(note)}</i></p>')
    out.append('<h2>Findings</h2><ul>')
    for f in data['findings']:
        if f['severity'] == INFO:
            continue
        where = 'run' if f['goal'] is None else f"goal {f['goal']}"
        out.append(f"<li class=\"{esc(f['severity'])}\"><b>{esc(f['severity'])}</b> "
                   f"<code>{esc(f['code'])}</code> ({where}): {esc(f['message'])}</li>")
    out.append('</ul><h2>Latency</h2><table><tr><th>metric</th><th>goals</th>'
               '<th>recorded median</th><th>replay median</th><th>ratio</th><th>limit</th>'
               '<th>verdict</th></tr>')
    for m in data['latency']:
        cls = 'regression' if m['regression'] else 'pass'
        verdict = 'REGRESSION' if m['regression'] else ('ok' if m['gated'] else 'not gated')
        out.append(f"<tr class=\"{cls}\"><td>{esc(m['name'])} ({esc(m['unit'])})</td>"
                   f"<td>{m['goals']}</td><td>{_fmt(m['old_median'])}</td>"
                   f"<td>{_fmt(m['new_median'])}</td><td>{_fmt(m['ratio'])}</td>"
                   f"<td>{_fmt(m['limit'])}</td><td>{verdict}</td></tr>")
    out.append('</table>')
    for name, png in pngs.items():
        data_uri = base64.b64encode(png).decode('ascii')
        out.append(f'<h3>{esc(name)}</h3><img alt="{esc(name)}" '
                   f'src="data:image/png;base64,{data_uri}">')
    out.append('<h2>Goals</h2><table><tr><th>#</th><th>request</th><th>kind</th>'
               '<th>token rule</th><th>status</th><th>finish</th><th>similarity</th>'
               '<th>recorded text</th><th>replay text</th><th>findings</th></tr>')
    for g in data['goals']:
        findings = '<br>'.join(f"{esc(f['code'])}: {esc(f['message'])}"
                               for f in g['findings'])
        out.append(
            f"<tr class=\"{esc(g['verdict'])}\"><td>{g['index']}</td><td>{esc(g['label'])}</td>"
            f"<td>{esc(g['kind'])}</td><td>{esc(g['token_rule_text'] or '-')}</td>"
            f"<td>{esc(g['status'])}</td>"
            f"<td>{esc(g['finish_reason_old'])} &rarr; {esc(str(g['finish_reason_new']))}</td>"
            f"<td>{_fmt(g['similarity'])}</td><td><pre>{esc(g['text_old'])}</pre></td>"
            f"<td><pre>{esc(g['text_new'] or '')}</pre></td><td>{findings}</td></tr>")
    out.append('</table></body></html>')
    return '\n'.join(out)


# ---------------------------------------------------------------- entry point

def write_report(result: ComparisonResult, run: RunInfo, out_dir: str | os.PathLike) -> dict:
    """Write report.json, summary.md, report.html and the PNGs into `out_dir`.

    Returns the JSON dict. Plots are skipped (with a note) when nothing was compared.
    """
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    pngs = _plots(result)
    if not pngs:
        run.notes.append('no plots: no goal finished in both runs')
    for name, png in pngs.items():
        (folder / name).write_bytes(png)
    data = report_dict(result, run)
    (folder / JSON_NAME).write_text(json.dumps(data, indent=2, default=str) + '\n')
    (folder / MARKDOWN_NAME).write_text(render_markdown(data, list(pngs)))
    (folder / HTML_NAME).write_text(render_html(data, pngs))
    return data


def main(argv: Optional[list] = None) -> int:
    """edge-llm-report OLD_BAG NEW_BAG: compare two recordings without a running node.

    NEW_BAG is a replay bag (goals pair by the id map edge-llm-replay stored in it) or
    another recording of the same requests (goals pair by request, in order).
    """
    import argparse
    import sys

    from edge_llm_ros.regression.bagio import read_bag
    from edge_llm_ros.regression.compare import compare_run, pair_recordings
    from edge_llm_ros.regression.errors import RegressionToolError
    from edge_llm_ros.regression.thresholds import load_thresholds, Thresholds

    parser = argparse.ArgumentParser(
        prog='edge-llm-report',
        description='Compare two llm_node recordings (e.g. a bag and its replay bag) and '
                    'write the regression report. Exit status: 0 pass, 1 regression, '
                    '2 bad input.')
    parser.add_argument('old_bag')
    parser.add_argument('new_bag')
    parser.add_argument('--report', required=True, metavar='DIR', help='report folder')
    parser.add_argument('--thresholds', default='', metavar='FILE')
    args = parser.parse_args(argv)
    run = RunInfo(bag=args.old_bag, new_bag=args.new_bag, timing='offline (two bags)',
                  thresholds_file=args.thresholds, started=now_iso())
    result = ComparisonResult()
    thresholds = Thresholds()
    try:
        thresholds = load_thresholds(args.thresholds)
        old = read_bag(args.old_bag)
        new = read_bag(args.new_bag)
        run.node = ', '.join(sorted({t.topic for t in new.transcripts}))
        goal_map = json.loads(new.custom.get('edge_llm_ros.goal_map', '{}') or '{}')
        outcomes = pair_recordings(old.transcripts, new.transcripts, goal_map)
        problems = old.problems + [f'new bag: {p}' for p in new.problems]
        run.notes.extend(old.warnings + [f'new bag: {w}' for w in new.warnings])
        result = compare_run(old.transcripts, outcomes, thresholds, problems,
                             CpuClasses(old.cpu_class, new.cpu_class))
    except (RegressionToolError, ValueError) as exc:
        run.error = str(exc)
        run.exit_code = getattr(exc, 'exit_code', EXIT_INPUT)
    run.thresholds = thresholds.to_dict()
    run.finished = now_iso()
    data = write_report(result, run, args.report)
    print(f"edge-llm-report: {data['verdict']} (exit {data['exit_code']}), report in "
          f'{args.report}/', file=sys.stderr if data['exit_code'] else sys.stdout)
    if run.error:
        print(f'edge-llm-report: error: {run.error}', file=sys.stderr)
    return int(data['exit_code'])


if __name__ == '__main__':
    raise SystemExit(main())
