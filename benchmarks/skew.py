"""Skewed routing against uniform: the time per routed token of `auto` (and Transformers' grouped_mm beside it) when one
expert takes 4x or 16x the mean load, in one process, interleaved rounds.

    python benchmarks/skew.py --out results/            # the grid at T = 512, 4096, 16384
    python benchmarks/skew.py --preset qwen3-30b-a3b --tokens 4096 --skew 1,4,16

Skew s: every token routes to expert 0 with probability min(1, s·k/E) (so expert 0 sees s times the mean load
T·k/E, or every token where s·k > E), its other slots distinct experts drawn uniformly. The routed-token count is
the same T·k in every case, so time per routed token over uniform's is the time ratio. Every output is checked
against float64 first. JSON after every shape, a markdown table at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import selector
from selector.bench.grid import peer_functions
from selector.bench.layouts import make_problem_layer, reference_of
from selector.bench.timing import time_interleaved
from selector.dispatch import last_backend
from selector.presets import GRID_PRESETS, preset
from selector.testing import relative_error

TOLERANCE = 0.03  # relative RMS error against float64 for bfloat16 experts


def skewed_routing(tokens: int, experts: int, k: int, skew: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (distinct per token) where expert 0 takes `skew` times the mean load (capped at every token)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, experts, device="cuda", generator=gen)
    hot = torch.rand(tokens, device="cuda", generator=gen) < min(1.0, skew * k / experts)
    scores[:, 0] = torch.where(hot, 2.0, -1.0)  # in the top k exactly where hot
    index = scores.topk(k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, k, device="cuda", generator=gen), dim=1)
    return index, weights


def bench_shape(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    problem = replace(preset(name), dtype="bfloat16", device="cuda")
    layer = make_problem_layer(torch, problem, torch.device("cuda"), seed=0)
    peers = {k: v for k, v in peer_functions().items() if k == "hf:grouped_mm"}
    rows = []
    for t in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(1000 + t)
        x = torch.randn(t, problem.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        runners, errors, loads = {}, {}, {}
        for s in args.skew:
            index, weights = skewed_routing(t, problem.num_experts, problem.top_k, s, seed=t)
            counts = torch.bincount(index.flatten(), minlength=problem.num_experts).float()
            loads[s] = float(counts[0] / counts.mean())
            ref = reference_of(torch, layer, problem, x, index, weights, min(t, 16))
            runs = {f"auto@{s:g}": lambda i=index, w=weights: layer(x, i, w)}
            runs.update({f"{p}@{s:g}": lambda fn=fn, i=index, w=weights: fn(layer, x, i, w) for p, fn in peers.items()})
            with torch.no_grad():
                for label, run in runs.items():
                    try:
                        errors[label] = relative_error(run(), ref)
                    except Exception as exc:  # noqa: BLE001 - one failing runner (out of memory, ...) must not end the run
                        errors[label] = f"{type(exc).__name__}: {str(exc)[:160]}"
            runners.update({label: run for label, run in runs.items()
                            if isinstance(errors[label], float) and errors[label] < TOLERANCE})  # fmt: skip
        failed: dict[str, str] = {}
        with torch.no_grad():
            timed = time_interleaved(torch, runners, "eager", rounds=args.rounds, errors=failed)
        row = {"shape": name, "tokens": t, "expert0_load": loads, "picked": last_backend(layer), "errors": errors,
               "failed": failed, "us": {k: v.median_s * 1e6 for k, v in timed.items()},
               "spread": {k: v.spread for k, v in timed.items()}}  # fmt: skip
        rows.append(row)
        print(line(row), flush=True)
        del runners, x
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def line(row: dict[str, Any]) -> str:
    us = row["us"]
    base = {k.split("@")[0]: v for k, v in us.items() if k.endswith("@1")}
    parts = [f"{row['shape']} T={row['tokens']}:"]
    for k, v in us.items():
        who = k.split("@")[0]
        parts.append(f"{k} {v:.0f}us ({v / base[who]:.2f}x)" if who in base else f"{k} {v:.0f}us")
    return " ".join(parts)


def table(rows: list[dict[str, Any]], skews: list[float]) -> str:
    peer = "hf:grouped_mm"
    head = ("| shape | T | " + " | ".join(f"auto skew {s:g} (expert 0 load)" for s in skews) + " | "
            + " | ".join(f"{peer} skew {s:g}" for s in skews if s != 1) + " | spread |")  # fmt: skip
    lines = [head, "|" + "---|" * (2 * len(skews) + 2)]
    for r in rows:
        us = r["us"]
        base = us.get("auto@1")
        cells = []
        for s in skews:
            t = us.get(f"auto@{s:g}")
            load = r["expert0_load"].get(str(s), r["expert0_load"].get(s, 0.0))
            cells.append("–" if t is None else f"{t:.0f} µs, {t / base:.2f}x ({load:.1f}x mean)" if base else f"{t:.0f}")
        peer_base = us.get(f"{peer}@1")
        for s in skews:
            t = us.get(f"{peer}@{s:g}")
            if s != 1:
                cells.append("–" if t is None or not peer_base else f"{t:.0f} µs, {t / peer_base:.2f}x")
        spread = max(r["spread"].values(), default=0.0)
        lines.append(f"| {r['shape']} | {r['tokens']} | " + " | ".join(cells) + f" | {spread:.0%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", action="append", help="shapes (default: the grid)")
    p.add_argument("--tokens", default="512,4096,16384")
    p.add_argument("--skew", default="1,4,16", help="expert 0's load over the mean (1: uniform, always measured)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="skew-results")
    p.add_argument("--render", metavar="JSON", help="only write the markdown of a result file beside it")
    args = p.parse_args()
    if args.render:
        render(Path(args.render))
        return
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.skew = sorted({1.0, *(float(s) for s in args.skew.split(","))})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "selector": selector.__version__,
                              "torch": torch.__version__, "command": "python benchmarks/skew.py " + " ".join(sys.argv[1:]),
                              "rows": []}  # fmt: skip
    for name in args.preset or list(GRID_PRESETS):
        result["rows"] += bench_shape(name, args)
        (out / "skew.json").write_text(json.dumps(result, indent=1))
    print(render(out / "skew.json"))


def render(path: Path) -> str:
    """skew.md beside a result file: the command and the table (each runner over its own uniform time)."""
    result = json.loads(path.read_text())
    skews = sorted({float(k.split("@")[1]) for row in result["rows"] for k in row["us"]})
    md = f"# Skewed routing, {result['device']}\n\n`{result['command']}`\n\n" + table(result["rows"], skews) + "\n"
    path.with_suffix(".md").write_text(md)
    return md


if __name__ == "__main__":
    main()
