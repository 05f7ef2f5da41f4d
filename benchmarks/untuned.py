"""Out of the box against tuned: `auto` on a fresh machine (no tuning store, no tiles tuned on this node: the shipped
table for this GPU, else the nearest tabled shape's tiles) against `auto` after tuning the shape's tiles, and
against Transformers' own experts backends, in one process, interleaved rounds.

    python benchmarks/untuned.py --out results/            # held-out shapes tuned twice, then the grid untuned
    python benchmarks/untuned.py --preset olmoe-1b-7b --tokens 64,4096 --load-budget 30 --full-budget 60

Per shape, up to three copies of the layer sharing its weights, each reading tiles from its own folder (the
variable SELECTOR_TRITON_FUSED_USER_CONFIG_DIR, set by each copy's runner before its call; tiles are looked up by
folder): "untuned" (an empty folder), "load" (`tune_kernels` with `--load-budget` seconds, what tune-on-load spends)
and "full" (`--full-budget` seconds, `selector tune`'s default). Every runner's output is checked against a float64
reference first. Eager at every token count, CUDA-graph replay up to 64 tokens. JSON after every shape; a markdown
table at the end: each cell's median, spread, the untuned/tuned ratio and untuned against Transformers' best.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

# a fresh store, whatever the environment names (removed at exit): the untuned runs must find no records
_STORE = tempfile.TemporaryDirectory(prefix="untuned-")
os.environ["SELECTOR_TUNING_STORE"] = os.path.join(_STORE.name, "store.sqlite3")

import torch  # noqa: E402

import selector  # noqa: E402
from selector.bench.grid import peer_functions  # noqa: E402
from selector.bench.layer import (  # noqa: E402
    bytes_moved,
    flops_of,
    floor_seconds,
    make_layer,
    random_routing,
    temp_bytes_estimate,
)
from selector.bench.layouts import is_plain, make_problem_layer, reference_of  # noqa: E402
from selector.bench.timing import measure_ceilings, time_interleaved  # noqa: E402
from selector.dispatch import last_backend  # noqa: E402
from selector.plugins.triton_fused import tune as tiles  # noqa: E402
from selector.presets import GRID_PRESETS, HELD_OUT_PRESETS, preset  # noqa: E402
from selector.testing import relative_error  # noqa: E402

TILES = "SELECTOR_TRITON_FUSED_USER_CONFIG_DIR"
TOKENS = (1, 8, 64, 512, 4096, 16384)
GRAPH_MAX_TOKENS = 64
MEMORY_CAP_BYTES = 40 * 2**30  # a peer needing more temporaries is left out of the cell
TOLERANCE = 0.03  # relative RMS error against float64 for bfloat16 experts


def layer_copies(problem: Any, folders: list[str]) -> dict[str, Any]:
    """One module per name (a tile folder's, and Transformers' own), sharing the weights where the layer is plain."""
    first = make_problem_layer(torch, problem, torch.device("cuda"), seed=0)
    copies = {}
    for name in folders:
        if not copies:
            copies[name] = first
        elif is_plain(problem):
            weights = (first.gate_up_proj.data, first.down_proj.data)
            copies[name] = make_layer(torch, problem, first.gate_up_proj.dtype, "cuda", 0, weights=weights)
            copies[name].act_fn = first.act_fn
        else:  # its own copy (GPT-OSS's layout: the grid's copy is small)
            copies[name] = make_problem_layer(torch, problem, torch.device("cuda"), seed=0)
    return copies


def runner(module: Any, folder: str, x: Any, index: Any, weights: Any) -> Callable[[], Any]:
    def call() -> Any:
        os.environ[TILES] = folder  # each copy reads its own tiles (a lookup is cached per folder)
        return module(x, index, weights)

    return call


def tiles_of(problem: Any, tokens: int, folder: str) -> dict[str, Any]:
    """The tile configuration a copy runs at `tokens` (its folder's table, else the shipped or nearest one)."""
    os.environ[TILES] = folder
    shape = tiles._configs.LayerShape(problem.num_experts, problem.hidden_size, problem.intermediate_size,
                                      torch.bfloat16, transposed=problem.is_transposed,
                                      interleaved=problem.interleaved)  # fmt: skip
    return tiles._configs.layer_config(shape, tokens, problem.top_k, torch.device("cuda"))


def bench_shape(name: str, args: argparse.Namespace, ceilings: dict[str, float], root: Path) -> list[dict[str, Any]]:
    problem = replace(preset(name), dtype="bfloat16", device="cuda")
    folders = {"untuned": str(root / name / "untuned")}
    tuning: dict[str, Any] = {}
    for variant, budget in (("load", args.load_budget), ("full", args.full_budget)):
        if budget > 0 and name in args.tune:
            folders[variant] = str(root / name / variant)
            t0 = time.perf_counter()
            summary = tiles.tune_kernels(problem, TOKENS, budget, force=True, directory=folders[variant])
            tuning[variant] = {"seconds": round(time.perf_counter() - t0, 1), "tokens_tuned": summary["tokens_tuned"],
                               "cut_short": summary["cut_short"]}  # fmt: skip
    copies = layer_copies(problem, [*folders, "peers"])  # the peers run on a copy selector never dispatched
    peers = peer_functions()
    rows = []
    for t in args.tokens:
        index, weights = random_routing(torch, t, problem.num_experts, problem.top_k, "cuda", seed=t)
        gen = torch.Generator(device="cuda").manual_seed(1000 + t)  # not the default one: graph capture owns its state
        x = torch.randn(t, problem.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = reference_of(torch, copies["untuned"], problem, x, index, weights, min(t, 16))
        runners = {v: runner(copies[v], folders[v], x, index, weights) for v in folders}
        first = copies["peers"]
        for peer, fn in peers.items():
            if peer == "hf:eager" and t > 64:
                continue  # a loop over experts in Python: far behind at large T, and minutes to time
            if temp_bytes_estimate(peer, t, problem, 2) > MEMORY_CAP_BYTES:
                continue  # batched_mm copies one expert's weights per (token, slot)
            runners[peer] = lambda fn=fn: fn(first, x, index, weights)
        errors = {}
        with torch.no_grad():
            for v, run in list(runners.items()):
                try:
                    errors[v] = relative_error(run(), ref)
                except Exception as exc:  # noqa: BLE001 - one failing runner must not lose the shape
                    errors[v] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    del runners[v]
            bad = {v: e for v, e in errors.items() if not isinstance(e, float) or e > TOLERANCE}
            picks = {v: last_backend(copies[v]) for v in folders}
            used = {v: tiles_of(problem, t, folders[v]) for v in folders}
            moved = bytes_moved(first, problem, int(index.unique().numel()), t, 2)
            floor = floor_seconds(ceilings, problem.with_tokens(t), moved, flops_of(problem, t))
            for mode in ("eager", "graph") if t <= GRAPH_MAX_TOKENS else ("eager",):
                failed: dict[str, str] = {}
                # Transformers' eager loop syncs the host (nonzero per expert): no graph of it
                mine = {v: r for v, r in runners.items() if v not in bad and not (mode == "graph" and v == "hf:eager")}
                timed = time_interleaved(torch, mine, mode, rounds=args.rounds, sample_s=args.sample_s, errors=failed)
                rows.append({
                    "shape": name, "tokens": t, "mode": mode, "floor_us": floor * 1e6, "picks": picks,
                    "errors": errors, "failed": failed, "tuning": tuning, "tiles": used,
                    "us": {v: tm.median_s * 1e6 for v, tm in timed.items()},
                    "spread": {v: tm.spread for v, tm in timed.items()},
                })  # fmt: skip
                print(summary_line(rows[-1]), flush=True)
        del runners, ref, x
        gc.collect()
        torch.cuda.empty_cache()
    del copies
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def summary_line(row: dict[str, Any]) -> str:
    us = row["us"]
    peers = {k: v for k, v in us.items() if k.startswith("hf:")}
    best_peer = min(peers, key=peers.__getitem__) if peers else None
    parts = [f"{row['shape']} T={row['tokens']} {row['mode']}:"]
    parts += [f"{k} {v:.1f}us (±{row['spread'][k] * 50:.0f}%)" for k, v in us.items() if not k.startswith("hf:")]
    if best_peer:
        parts.append(f"best peer {best_peer} {peers[best_peer]:.1f}us")
    return " ".join(parts)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| shape | T | mode | untuned µs | x floor | load µs | full µs | untuned / full | Transformers' best µs | "
             "untuned / best peer | spread |", "|" + "---|" * 11]  # fmt: skip
    ratios, loads, over_peer = [], [], []
    for r in rows:
        us, spread = r["us"], r["spread"]
        peers = {k: v for k, v in us.items() if k.startswith("hf:")}
        best = min(peers.values()) if peers else math.nan
        u = us.get("untuned", math.nan)
        full = us.get("full", math.nan)
        if math.isfinite(full) and math.isfinite(u):
            ratios.append(u / full)
            if math.isfinite(us.get("load", math.nan)):
                loads.append(us["load"] / full)
        if math.isfinite(best) and math.isfinite(u):
            over_peer.append((u / best, r["shape"], r["tokens"], r["mode"]))
        cells = [r["shape"], str(r["tokens"]), r["mode"], f"{u:.1f}", f"{u / r['floor_us']:.2f}",
                 f"{us.get('load', math.nan):.1f}", f"{full:.1f}", f"{u / full:.3f}", f"{best:.1f}",
                 f"{u / best:.3f}", f"{max(spread.values(), default=0):.0%}"]  # fmt: skip
        lines.append("| " + " | ".join("–" if c == "nan" else c for c in cells) + " |")
    for name, found in (("untuned / full tuned", ratios), ("load-tuned / full tuned", loads)):
        if found:
            gmean = math.exp(statistics.fmean(math.log(x) for x in found))
            lines.append(f"\n{name}: geometric mean {gmean:.3f}, worst {max(found):.3f} ({len(found)} cells)")
    slower = [o for o in over_peer if o[0] > 1.0]
    lines.append(f"untuned slower than Transformers' best in {len(slower)} of {len(over_peer)} cells"
                 + "".join(f"\n- {s} T={t} {m}: {x:.3f}x" for x, s, t, m in sorted(slower, reverse=True)))  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", action="append", help="shapes (default: the held-out ones, then the grid)")
    p.add_argument("--tune", action="append", help="presets to tune (default: the held-out ones)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--load-budget", type=float, default=30.0, help="seconds of tile search, as tune-on-load")
    p.add_argument("--full-budget", type=float, default=60.0, help="seconds of tile search, as selector tune")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sample-s", type=float, default=0.02)
    p.add_argument("--out", default="untuned-results")
    p.add_argument("--render", metavar="JSON", help="only write the markdown of a result file beside it")
    args = p.parse_args()
    if args.render:
        render(Path(args.render))
        return
    args.tokens = [int(t) for t in args.tokens.split(",")]
    names = args.preset or [*HELD_OUT_PRESETS, *GRID_PRESETS]
    args.tune = args.tune or list(HELD_OUT_PRESETS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings(torch, torch.device("cuda"))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "ceilings": ceilings, "selector": selector.__version__,
                              "torch": torch.__version__, "command": "python benchmarks/untuned.py " + " ".join(sys.argv[1:]),
                              "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            result["rows"] += bench_shape(name, args, ceilings, Path(root))
            (out / "untuned.json").write_text(json.dumps(result, indent=1))
    print(render(out / "untuned.json"))


def tuning_table(rows: list[dict[str, Any]]) -> str:
    """Per tuned shape: each variant's search seconds, the token counts it finished, whether the budget cut it."""
    lines = ["| shape | tuned | seconds | token counts finished | cut by the budget |", "|---|---|---|---|---|"]
    seen = set()
    for r in rows:
        if r["shape"] in seen or not r["tuning"]:
            continue
        seen.add(r["shape"])
        for variant, t in r["tuning"].items():
            done = ",".join(map(str, sorted(t["tokens_tuned"])))
            lines.append(f"| {r['shape']} | {variant} | {t['seconds']} | {done} | {'yes' if t['cut_short'] else 'no'} |")
    return "\n".join(lines)


def render(path: Path) -> str:
    """untuned.md beside a result file: the command, the ceilings and the table."""
    result = json.loads(path.read_text())
    c = result["ceilings"]
    md = (f"# Untuned against tuned, {result['device']}\n\n`{result['command']}`\n\n"
          f"Ceilings measured in the run: {c['bandwidth_Bps'] / 1e12:.2f} TB/s, {c['bf16_flops'] / 1e12:.0f} TFLOP/s "
          "(bf16). Times are medians of interleaved rounds, spread = (max - min) / median of the cell's widest "
          "runner.\n\n" + table(result["rows"]) + "\n\n" + tuning_table(result["rows"]) + "\n")  # fmt: skip
    path.with_suffix(".md").write_text(md)
    return md


if __name__ == "__main__":
    main()
