"""Renderers for the doctor report: text (a flutter-doctor style checklist), markdown and JSON."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from selector.compat_table import markdown_table
from selector.doctor import Check, DoctorReport
from selector.model_shapes import ModelSection, ModelShape, status_counts
from selector.parallel.report import section_markdown, section_text
from selector.types import BackendSpec, Candidate, Ranking

OK, BAD, WARN = "✓", "✗", "!"


def check_mark(check: Check) -> str:
    """The mark of a check's status, the same in text and markdown (JSON carries the status itself)."""
    return {"ok": OK, "warning": WARN, "failed": BAD}[check.status]


def format_seconds(seconds: float) -> str:
    """A time as people read it: µs below a millisecond, ms below a second, then seconds."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:,.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:,.1f} ms"
    return f"{seconds:,.1f} s"


def cost_text(c: Candidate, no_estimate: Sequence[str] = ()) -> str:
    """What a candidate was ordered by: "measured 1.2 ms at T=512 (±3%)" or "estimated 1.5 ms"."""
    if c.source == "measured":
        at = f" at T={c.measured_tokens}" if c.measured_tokens else ""
        spread = f" (±{c.spread * 50:.0f}%)" if c.spread else ""
        return f"measured {format_seconds(c.estimate)}{at}{spread}"
    return "(no estimate)" if c.name in no_estimate else f"estimated {format_seconds(c.estimate)}"


def ranking_lines(r: Ranking, no_estimate: Sequence[str] = ()) -> list[str]:
    """The ranking section of the report; `no_estimate`: candidates shown as "(no estimate)" instead of a time."""
    lines = [f"Ranking for {r.problem.describe()}:"]
    for i, c in enumerate(r.candidates, 1):
        why = " (pinned)" if c.pinned else " (preferred)" if c.preferred else ""
        lines.append(f"  {i}. {c.name:<16} {cost_text(c, no_estimate)}{why}")
    if not r.candidates:
        lines.append("  no backend can run this layer here")
    for name, a in r.excluded.items():
        lines.append(f"  {BAD} {name:<16} {a.reason}")
    return lines


def _shape_text(s: ModelShape) -> str:
    p = s.problem
    return f"E={p.num_experts} H={p.hidden_size} I={p.intermediate_size} k={p.top_k} {p.dtype} {s.layout}"


def _coverage(s: ModelShape) -> str:
    """Why a shape has its status, in words."""
    parts = []
    if s.measured:
        parts.append("measured " + "; ".join(f"{mode} T={','.join(map(str, t))}" for mode, t in s.measured.items()))
    if s.tile_table:
        parts.append({"shipped": "the shipped tile table", "node": "a tile table tuned on this node"}[s.tile_table])
    return ", ".join(parts) or "static estimates and heuristic tiles"


def model_lines(m: ModelSection) -> list[str]:
    """The model section as text: one line per distinct experts shape, its status and the command tuning it."""
    counts = status_counts(m.shapes)
    summary = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    plural = "s" * (len(m.shapes) != 1)
    lines = [f"Model {m.name} ({m.source}) on {m.gpu}: {len(m.shapes)} distinct experts shape{plural} ({summary})"]
    for s in m.shapes:
        mark = OK if s.status != "estimated" else WARN
        where = f"  [{', '.join(x or 'config' for x in s.scopes)}]" if any(s.scopes) else ""
        lines.append(f"  {mark} {_shape_text(s):<44} {s.status}: {_coverage(s)}{where}")
        if s.status != "tuned":
            lines.append(f"      tune: {s.tune_command}")
        lines.extend(f"      note: {n}" for n in s.notes)
    lines.extend(f"  note: {n}" for n in m.notes)
    return lines


def render_text(report: DoctorReport) -> str:
    import selector

    lines = [f"selector {selector.__version__} doctor", ""]
    for c in report.checks:
        lines.append(f"[{check_mark(c)}] {c.title}")
        lines.extend(f"    {d}" for d in c.detail)
    lines += ["", f"Backends (judged for {report.backend_problem.describe()}):"]
    for b in report.backends:
        mark = OK if b.verdict.ok else BAD
        lines.append(f"  {mark} {b.name:<16} {b.description}" + (f"  [{b.provider}]" if b.provider != b.name else ""))
        if b.verdict.ok and (b.verdict.reason or b.verdict.found):
            lines.append(f"      {b.verdict.reason or b.verdict.found}")
        if not b.verdict.ok:
            lines.append(f"      {b.verdict.status.value}: {b.verdict.reason}")
            if b.verdict.found:
                lines.append(f"      found: {b.verdict.found}")
            if b.verdict.remedy:
                lines.append(f"      fix: {b.verdict.remedy}")
        if b.first_call_cost:
            lines.append(f"      first call: {b.first_call_cost}")
    if report.parallel is not None:
        lines += ["", *section_text(report.parallel, OK, BAD)]
    if report.config.get("files"):
        lines += ["", "Config: " + ", ".join(report.config["files"])]
    if report.model is not None:
        lines += ["", *model_lines(report.model)]
    if report.ranking is not None:
        lines += ["", *ranking_lines(report.ranking, report.no_estimate)]
    lines.append("")
    if report.warnings:
        lines.append(f"{WARN} {len(report.warnings)} warning(s):")
        lines.extend(f"  - {w}" for w in report.warnings)
    if report.broken:
        lines.append(f"{BAD} {len(report.broken)} problem(s):")
        lines.extend(f"  - {b}" for b in report.broken)
    else:
        lines.append(f"{OK} usable: {', '.join(report.usable)}")
    return "\n".join(lines)


def render_markdown(report: DoctorReport, specs: Iterable[BackendSpec] = ()) -> str:
    """The doctor report as markdown; with `specs`, their torch.compile / CUDA graph / autograd table too."""
    import selector

    lines = [f"# selector {selector.__version__} doctor", "", "| check | status | detail |", "|---|---|---|"]
    for c in report.checks:
        detail = "<br>".join(c.detail).replace("|", "\\|")
        lines.append(f"| {c.title.replace('|', '/')} | {check_mark(c)} | {detail} |")
    lines += ["", f"## Backends ({report.backend_problem.describe()})", "",
              "| backend | status | reason | fix |", "|---|---|---|---|"]
    for b in report.backends:
        lines.append(f"| {b.name} | {b.verdict.status.value} | {b.verdict.reason} | {b.verdict.remedy} |")
    if report.parallel is not None:
        lines += ["", *section_markdown(report.parallel)]
    if report.model is not None:
        lines += ["", *model_markdown(report.model)]
    if report.ranking is not None:
        lines += ["", "## Ranking", "", "```", *ranking_lines(report.ranking, report.no_estimate), "```"]
    specs = list(specs)
    if specs:
        lines += ["", "## torch.compile, CUDA graphs and autograd (as declared)", "", markdown_table(specs)]
    if report.warnings:
        lines += ["", "## Warnings", "", *(f"- {w}" for w in report.warnings)]
    if report.broken:
        lines += ["", "## Problems", "", *(f"- {b}" for b in report.broken)]
    else:
        lines += ["", f"{OK} usable: {', '.join(report.usable)}"]
    return "\n".join(lines) + "\n"


def model_markdown(m: ModelSection) -> list[str]:
    """The model section as a markdown table."""
    lines = [f"## Model {m.name} on {m.gpu}", "", f"Read from `{m.source}`.", "",
             "| E | H | I | k | dtype | layout | status | coverage | tune |", "|---|---|---|---|---|---|---|---|---|"]
    for s in m.shapes:
        p = s.problem
        tune = "" if s.status == "tuned" else f"`{s.tune_command}`"
        lines.append(f"| {p.num_experts} | {p.hidden_size} | {p.intermediate_size} | {p.top_k} | {p.dtype} | "
                     f"{s.layout} | {s.status} | {_coverage(s)} | {tune} |")
    lines.extend(f"- {n}" for n in (*m.notes, *(n for s in m.shapes for n in s.notes)))
    return lines


def render_json(report: DoctorReport) -> str:
    return json.dumps(report.to_dict(), indent=2, sort_keys=False)
