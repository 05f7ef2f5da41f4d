"""Rendering a `selector bench` run: the markdown tables, the plot, the files, a summary count."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from selector.bench.cells import FORMATS, PEER_PREFIX, TRAIN, BenchResult, Cell, choice_quality


def fmt_time(s: float | None) -> str:
    """µs below a millisecond, ms above; "-" for no time."""
    if s is None:
        return "-"
    return f"{s * 1e6:.0f}µs" if s < 1e-3 else f"{s * 1e3:.2f}ms"


def _ceilings_text(result: BenchResult) -> str:
    """The ceilings the floors were computed with: this run's, or each merged run's with its command."""
    def one(c: dict[str, float]) -> str:
        return f"copy {c['bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 matmul {c['bf16_flops'] / 1e12:.0f} TFLOP/s"

    if len(result.runs) < 2:
        return f"Ceilings measured in this run: {one(result.ceilings)}."
    runs = "; ".join(f"`{r['command'] or 'selector bench'}` ({one(r['ceilings'])})" for r in result.runs)
    return (
        f"Merged from {len(result.runs)} runs, each row from one of them, each run measuring its own ceilings: {runs}."
    )


def markdown_table(result: BenchResult) -> str:
    """One row per (shape, T, mode, format); per backend: time (time/floor); then the best and auto's standing.
    With quantised formats in the run, a second table sets each format's best beside the dense best."""
    backends = sorted({c.backend for c in result.cells}, key=lambda b: (b != "auto", b.startswith(PEER_PREFIX), b))
    order = {f: i for i, f in enumerate(FORMATS)}
    rows = sorted(
        {(c.shape, c.tokens, c.mode, c.format) for c in result.cells},
        key=lambda r: (r[0], r[2], r[1], order.get(r[3], len(order))),
    )
    by_key = {(c.shape, c.tokens, c.mode, c.format, c.backend): c for c in result.cells}
    lines = [
        f"Device: {result.device}. {_ceilings_text(result)} Cells: time (time / floor), the median of interleaved "
        "rounds; `*` marks auto's pick, [name] what the auto row ran; spread: the largest (max - min) / median of "
        "the row's backends.",
        "",
        "| shape | T | mode | format | " + " | ".join(backends) + " | spread | best | auto vs best hf |",
        "|---|---|---|---|" + "---|" * (len(backends) + 3),
    ]
    for shape, t, mode, fmt in rows:
        cells = [by_key.get((shape, t, mode, fmt, b)) for b in backends]
        if not any(cell and cell.time_s for cell in cells):
            continue  # e.g. graph mode above --graph-max-tokens
        texts = []
        for cell in cells:
            if cell is None or cell.time_s is None:
                texts.append("-")
            else:
                mark = f" [{cell.picked}]" if cell.picked else "*" if cell.auto_pick else ""
                texts.append(f"{fmt_time(cell.time_s)} ({cell.ratio:.2f}x){mark}")
        timed = [x for x in cells if x and x.time_s]
        best = min((x for x in timed if x.backend != "auto"), key=lambda x: x.time_s, default=None)
        best_name = best.backend if best else "-"
        auto = next((x for x in timed if x.backend == "auto"), None)
        standing = f"{auto.vs_best_peer:.2f}x faster" if auto and auto.vs_best_peer else "-"
        spreads = [x.spread for x in timed if x.spread is not None]
        spread = f"{max(spreads):.0%}" if spreads else "-"
        lines.append(f"| {shape} | {t} | {mode} | {fmt} | " + " | ".join(texts) + f" | {spread} | {best_name} | {standing} |")
    tables = choice_table(result.cells) + formats_table(result.cells) + train_table(result.cells)
    return "\n".join(lines) + "\n" + tables


def train_table(cells: Iterable[Cell]) -> str:
    """Train mode's gradient check: per (shape, T, format) and backend, the largest relative error of a training
    step's gradients (hidden states, routing weights, expert weights) against float64 on the cell's sample rows.
    Empty without a checked train cell."""
    checked = [c for c in cells if c.mode == TRAIN and c.grad_rel_error is not None]
    if not checked:
        return ""
    backends = sorted({c.backend for c in checked}, key=lambda b: (b != "auto", b.startswith(PEER_PREFIX), b))
    by_key = {(c.shape, c.tokens, c.format, c.backend): c for c in checked}
    lines = ["", "Train mode: a row's time is one training step (forward under autograd, then the backward of a "
                 "fixed gradient) over the step's floor (3x the forward's FLOPs; the expert weights hit read and "
                 "their gradients written). Gradient check: the largest relative error of the step's gradients "
                 "(hidden states, routing weights, expert weights) against float64, on the first up to 32 tokens.",
             "", "| shape | T | format | " + " | ".join(backends) + " |", "|---|---|---|" + "---|" * len(backends)]
    for shape, t, fmt in sorted({k[:3] for k in by_key}, key=lambda r: (r[0], r[1], r[2])):
        texts = [
            f"{by_key[shape, t, fmt, b].grad_rel_error:.1e}" if (shape, t, fmt, b) in by_key else "-" for b in backends
        ]
        lines.append(f"| {shape} | {t} | {fmt} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"


def choice_table(cells: list[Cell]) -> str:
    """The choice-quality summary: the time of the backend auto picked over the fastest selector backend of the
    same interleaved run (and the auto row's own time, dispatch included), the share of cells within 5%, and the
    worst cells. Empty without an auto row beside a timed backend."""
    q = choice_quality(cells)
    if not q["cells"]:
        return ""
    lines = ["", f"Choice quality: auto's pick within {q['within']:.0%} of the fastest selector backend of the same "
                 f"interleaved run in {q['within_count']} of {q['cells']} cells ({q['share_within']:.0%}); the auto "
                 f"row itself (dispatch included) in {q['auto_share_within']:.0%}.", ""]
    if q["worst"]:
        lines += ["| shape | T | mode | format | pick | auto row | fastest | pick / fastest | spread |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in q["worst"]:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['mode']} | {r['format']} | {fmt_time(r['pick_s'])} "
                         f"{r['picked'] or '-'} | {fmt_time(r['auto_s'])} | {fmt_time(r['fastest_s'])} "
                         f"{r['fastest']} | {r['ratio']:.2f} | {r['spread']:.0%} |")
    return "\n".join(lines) + "\n"


def formats_table(cells: Iterable[Cell]) -> str:
    """Per (shape, T, mode): the fastest selector backend of each format, time (time / floor), and its time over
    the dense best (the quantised formats' point: fewer bytes to read). Empty without quantised cells."""
    best: dict[tuple[str, int, str, str], Cell] = {}
    for c in cells:
        if c.time_s and c.backend != "auto" and not c.backend.startswith(PEER_PREFIX):
            key = (c.shape, c.tokens, c.mode, c.format)
            if key not in best or c.time_s < (best[key].time_s or 0):
                best[key] = c
    quantised = [f for f in FORMATS if f != "dense" and any(k[3] == f for k in best)]
    if not quantised:
        return ""
    lines = [
        "",
        "Quantised against dense: the fastest selector backend per format, time (time / floor); "
        "x dense = its time over the dense best.",
        "",
        "| shape | T | mode | dense | " + " | ".join(f"{f} | x dense" for f in quantised) + " |",
        "|---|---|---|---|" + "---|---|" * len(quantised),
    ]
    for shape, t, mode in sorted({k[:3] for k in best}, key=lambda r: (r[0], r[2], r[1])):
        dense = best.get((shape, t, mode, "dense"))
        texts = [f"{fmt_time(dense.time_s)} ({dense.ratio:.2f}x) {dense.backend}" if dense else "-"]
        for f in quantised:
            q = best.get((shape, t, mode, f))
            texts.append(f"{fmt_time(q.time_s)} ({q.ratio:.2f}x) {q.backend}" if q else "-")
            texts.append(f"{q.time_s / dense.time_s:.2f}" if q and dense and q.time_s and dense.time_s else "-")
        lines.append(f"| {shape} | {t} | {mode} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"


def plot(result: BenchResult, path: Path) -> bool:
    """time/floor against tokens, one panel per shape (eager solid, graph dashed, compile dotted, train
    dash-dotted); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = sorted({c.shape for c in result.cells})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    series = sorted({(c.backend, c.format) for c in result.cells if c.ratio})
    colours = {s: plt.get_cmap("tab20")(i % 20) for i, s in enumerate(series)}  # one colour per backend and format
    for ax, shape in zip(axes[0], shapes):
        for backend, fmt in series:
            for mode, style in (("eager", "-"), ("graph", "--"), ("compile", ":"), (TRAIN, "-.")):
                pts = sorted(
                    (c.tokens, c.ratio)
                    for c in result.cells
                    if c.shape == shape and c.backend == backend and c.format == fmt and c.mode == mode and c.ratio
                )
                if pts:
                    marker = "x" if backend.startswith(PEER_PREFIX) else "o"
                    name = backend if fmt == "dense" else f"{backend} {fmt}"
                    ax.plot(*zip(*pts), style, marker=marker, color=colours[backend, fmt], label=f"{name} ({mode})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(shape)
        ax.set_xlabel("tokens")
        ax.set_ylabel("time / floor")
    axes[0][-1].legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_outputs(result: BenchResult, out_dir: Path) -> list[Path]:
    """bench.json, bench.md and (with matplotlib) bench.png in `out_dir`; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps(result.to_dict(), indent=1))
    paths[1].write_text(markdown_table(result))
    if plot(result, out_dir / "bench.png"):
        paths.append(out_dir / "bench.png")
    return paths


def summarise(cells: Iterable[Cell]) -> dict[str, Any]:
    """Counts of the auto cells with a peer, and of those where auto beat or matched the best peer."""
    auto = [c for c in cells if c.backend == "auto" and c.vs_best_peer]
    return {"auto_cells": len(auto), "auto_not_slower": sum(1 for c in auto if (c.vs_best_peer or 0) >= 1.0)}
