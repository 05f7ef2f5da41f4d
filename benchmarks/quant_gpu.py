"""GPU check and timing of quantised experts (issue 5): FP8 (float32 and UE8M0 scales) and FP4 cells beside bf16.

One run, on one GPU:
1. ceilings: copy bandwidth (2 GiB device copy, bytes read + written) and a bf16 8192^3 matmul (perf.md), and
   an e4m3 one (torch._scaled_mm): quantised cells also report a floor with that rate for compute, since their
   kernels multiply e4m3 tiles (the targets keep perf.md's floor);
2. a correctness check of every quantised path (format x backend) on a small layer against the float64
   reference from the dequantised weights (`selector.quant.reference_forward`, activations quantised as the
   kernels do): bf16 compute, bound GPU_BOUND = 1e-2 (the interpreter meets 1e-2, tests/test_quant.py; the
   H200 reads 2-3e-3 since the reference quantises activations alike on the GPU and the CPU: until session 8
   it divided by a Python scalar, which torch on CUDA does as a multiplication by the rounded reciprocal, and
   every path read 1.3-2.1e-2 against it under a 2.5e-2 bound: benchmarks/reference_device_check.py);
3. per shape of perf.md and T in --tokens: bf16 cells (grouped_mm, batched_mm, triton_fused where it loads)
   and quantised cells (fp8-f32, fp8-ue8m0, fp4 through batched_mm and grouped_mm), timed back to back with
   CUDA events around the whole run ("eager") and, for T <= 64, as CUDA-graph replays ("graph");
   floor = max(bytes / BW, FLOPs / PEAK) with bytes = experts hit x (weights + scales as stored) + 2 x T x H x 2;
   quantised cells at T <= 64 are also checked against the float64 reference on their first 8 tokens;
4. a short table, and the issue's targets: at T <= 64 the best FP8 time <= 0.65 x the best bf16 time (same
   mode), at T >= 512 the best FP8 time <= 2 x its floor.

    python benchmarks/quant_gpu.py --out $OUT            # everything (a few minutes on an H200)
    python benchmarks/quant_gpu.py --shapes qwen3-30b-a3b --tokens 1,64 --sweep

--out DIR writes quant_gpu.json (every cell) and quant_gpu.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("SELECTOR_VALIDATE", "shapes")  # time the layer, not the per-call value checks
if "--cpu-smoke" in sys.argv:  # the script's own test: tiny layers through Triton's interpreter, no timing value
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import selector  # noqa: E402
from selector import quant as Q  # noqa: E402

SHAPES = {  # name: (H, I, E, k), perf.md's grid, in the order they are run (cells go T by T across shapes)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
}
FORMATS = {  # cell name: (weight format, scale format)
    "fp8-f32": ("fp8_block", "float32"),
    "fp8-ue8m0": ("fp8_block", "ue8m0"),
    "fp4": ("fp4", "ue8m0"),
}
BF16_BACKENDS = ("grouped_mm", "batched_mm", "triton_fused")
QUANT_BACKENDS = ("triton_fused", "grouped_mm", "batched_mm")  # all checked for correctness
QUANT_TIMED = ("triton_fused", "batched_mm")  # grouped_mm runs the same grouped kernels as triton_fused
BATCHED_BF16_CAP = 40 * 2**30  # perf.md: batched_mm gathers T x k weight copies; cap its temporaries
BATCHED_QUANT_MAX_PAIRS = 512  # one pair per program re-reads its expert's weights: decode only
GRAPH_MAX_TOKENS = 64
GPU_BOUND = 1e-2  # relative error vs float64 on the GPU (module docstring says why)
BUDGET = "budget spent (--budget-s)"
SWEEP = [  # --sweep: tile configurations tried for the grouped quantised cells (both projections take the same)
    {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns} for bn in (32, 64, 128) for nw in (4, 8) for ns in (3, 4)
] + [{"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}, {"BLOCK_M": 32}, {"BLOCK_M": 64}]


@dataclass
class Cell:
    shape: str
    tokens: int
    format: str  # bf16, fp8-f32, fp8-ue8m0, fp4
    backend: str
    mode: str  # eager | graph
    time_s: float | None = None
    floor_s: float | None = None
    bytes: float | None = None
    flops: float | None = None
    rel_error: float | None = None  # vs the float64 reference (quantised cells, first 8 tokens)
    skipped: str | None = None
    config: dict | None = None  # --sweep: the best tile configuration found
    floor_fp8_mma_s: float | None = None  # quantised cells: the floor with the e4m3 matmul rate for compute

    @property
    def ratio(self) -> float | None:
        return self.time_s / self.floor_s if self.time_s and self.floor_s else None

    @property
    def ratio_fp8_mma(self) -> float | None:
        return self.time_s / self.floor_fp8_mma_s if self.time_s and self.floor_fp8_mma_s else None


# ---------------------------------------------------------------------------------------------- measurement


# the ceilings and timers are selector bench's own, so these cells compare with its tables
from selector import bench as _bench  # noqa: E402


def measure_ceilings(device: torch.device) -> dict[str, float]:
    return _bench.measure_ceilings(torch, device, fp8=True)


def time_back_to_back(fn, calls: int, repeats: int = 5) -> float:  # noqa: ANN001
    if not torch.cuda.is_available():  # --cpu-smoke
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return _bench.time_back_to_back(torch, fn, calls, repeats)


def time_graph(fn, calls: int, repeats: int = 5) -> float:  # noqa: ANN001
    return _bench.time_graph(torch, fn, calls, repeats)


SAMPLE_S = 0.02  # --sample-ms
REPEATS = 3


def timed(fn, mode: str) -> float:  # noqa: ANN001
    """Warm up (compiles), estimate, then enough calls for SAMPLE_S per sample, median of REPEATS samples."""
    if not torch.cuda.is_available():  # --cpu-smoke
        return time_back_to_back(fn, 1)
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    estimate = time.perf_counter() - t0
    calls = max(3, min(200, int(SAMPLE_S / max(estimate, 1e-6))))
    return time_graph(fn, calls, REPEATS) if mode == "graph" else time_back_to_back(fn, calls, REPEATS)


# ---------------------------------------------------------------------------------------------- layers


def make_layer(e: int, h: int, i: int, device: torch.device, seed: int = 0) -> torch.nn.Module:
    @selector.experts
    class QuantBenchExperts(torch.nn.Module):
        def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
            super().__init__()
            self.num_experts = gate_up.shape[0]
            self.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
            self.down_proj = torch.nn.Parameter(down, requires_grad=False)
            self.act_fn = torch.nn.SiLU()

    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.empty(e, 2 * i, h, device=device, dtype=torch.bfloat16)
    down = torch.empty(e, h, i, device=device, dtype=torch.bfloat16)
    for j in range(e):  # expert by expert: no fp32 temporaries of the whole layer
        gate_up[j] = torch.randn(2 * i, h, device=device, generator=gen) * h**-0.5
        down[j] = torch.randn(h, i, device=device, generator=gen) * i**-0.5
    layer = QuantBenchExperts(gate_up, down)
    layer.share = lambda: QuantBenchExperts(layer.gate_up_proj.data, layer.down_proj.data)  # same tensors
    return layer


def routing(tokens: int, e: int, k: int, device: torch.device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    index = torch.rand(tokens, e, device=device, generator=gen).topk(k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, k, device=device, generator=gen), dim=1)
    return index, weights


def forward_of(name: str):  # noqa: ANN201
    return selector.get_registry().get(name).load()


def floor_of(layer: torch.nn.Module, index: torch.Tensor, h: int, i: int, k: int, ceilings: dict,
             compute: str = "bf16_flops") -> tuple[float, float, float]:  # fmt: skip
    """perf.md's floor (compute at the bf16 matmul rate), or with compute="fp8_flops" at the e4m3 one."""
    hit = int(torch.unique(index).numel())
    per_expert = Q.weight_bytes(layer) / layer.num_experts  # as stored, scales included
    tokens = index.shape[0]
    moved = hit * per_expert + 2 * tokens * h * 2
    flops = 2.0 * tokens * k * 3 * h * i
    return max(moved / ceilings["bandwidth_Bps"], flops / ceilings[compute]), moved, flops


# ---------------------------------------------------------------------------------------------- the run


class Deadline:
    """--budget-s: cells not started before it are recorded as skipped; the outputs are still written."""

    def __init__(self, budget_s: float | None) -> None:
        self.end = None if budget_s is None else time.perf_counter() + budget_s

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.perf_counter()


def check_paths(device: torch.device, log, deadline: Deadline) -> list[dict]:  # noqa: ANN001
    """Every quantised path on a small layer (odd-ish sizes) against the float64 reference."""
    results = []
    x_all = torch.randn(300, 640, device=device, dtype=torch.bfloat16)
    for fmt_name, (wf, sf) in FORMATS.items():
        layer = make_layer(16, 640, 320, device, seed=5).share()
        Q.quantize_experts(layer, wf, sf)
        for tokens in (8, 300):
            if deadline.left() <= 0:
                return results
            idx, w = routing(tokens, 16, 4, device, seed=tokens)
            x = x_all[:tokens]
            ref = Q.reference_forward(layer, x, idx, w, device=device)
            for backend in QUANT_BACKENDS:
                out = forward_of(backend)(layer, x, idx, w)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ok = err < GPU_BOUND and torch.isfinite(out).all().item()
                results.append({"format": fmt_name, "backend": backend, "tokens": tokens, "rel_error": err, "ok": ok})
                log(f"check {fmt_name:9s} {backend:10s} T={tokens:<4d} rel err {err:.2e} {'ok' if ok else 'FAIL'}")
    return results


def build_layers(name: str, formats: list[str], max_tokens: int, log) -> dict:  # noqa: ANN001
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, i, e, k = SHAPES[name]
    t0 = time.perf_counter()
    dense = make_layer(e, h, i, device)
    layers = {"bf16": dense}
    for fmt_name in formats:
        wf, sf = FORMATS[fmt_name]
        layers[fmt_name] = Q.quantize_experts(dense.share(), wf, sf)
    if device.type == "cuda":
        torch.cuda.synchronize()
    log(f"{name}: layers built and quantised in {time.perf_counter() - t0:.1f}s")
    return {"layers": layers, "x": torch.randn(max_tokens, h, device=device, dtype=torch.bfloat16)}


def run_cells(name: str, built: dict, tokens: int, ceilings: dict, args, log, deadline: Deadline) -> list[Cell]:  # noqa: ANN001
    """Every cell of one shape and token count (bf16 backends, then each quantised format)."""
    h, i, e, k = SHAPES[name]
    x = built["x"][:tokens]
    device = x.device
    index, weights = routing(tokens, e, k, device)
    modes = ["eager", "graph"] if tokens <= GRAPH_MAX_TOKENS and device.type == "cuda" else ["eager"]
    cells: list[Cell] = []
    for fmt_name, layer in built["layers"].items():
        backends = BF16_BACKENDS if fmt_name == "bf16" else QUANT_TIMED
        floor, moved, flops = floor_of(layer, index, h, i, k, ceilings)
        # the kernels multiply e4m3 tiles (fp4 widened to e4m3): a floor at that rate, reported beside perf.md's
        floor8 = floor_of(layer, index, h, i, k, ceilings, "fp8_flops")[0] if fmt_name != "bf16" and "fp8_flops" in ceilings else None
        ref = None
        for backend in backends:
            if fmt_name != "bf16" and backend not in args.quant_backends:
                continue
            if fmt_name == "bf16" and backend not in args.bf16_backends:
                continue
            for mode in modes:
                cell = Cell(name, tokens, fmt_name, backend, mode, floor_s=floor, bytes=moved, flops=flops,
                            floor_fp8_mma_s=floor8)  # fmt: skip
                cells.append(cell)
                if deadline.left() <= 0:
                    cell.skipped = BUDGET
                    continue
                if fmt_name == "bf16" and backend == "batched_mm" and tokens * k * 3 * h * i * 2 > BATCHED_BF16_CAP:
                    cell.skipped = "gathers T x k weight copies: over the 40 GB cap"
                    continue
                if fmt_name != "bf16" and backend == "batched_mm" and tokens * k > BATCHED_QUANT_MAX_PAIRS:
                    cell.skipped = f"one pair per program: for T x k <= {BATCHED_QUANT_MAX_PAIRS}"
                    continue
                try:
                    fwd = forward_of(backend)
                except Exception as exc:  # e.g. triton_fused not importable here
                    cell.skipped = f"{type(exc).__name__}: {exc}"[:160]
                    continue
                try:
                    if args.sweep and tokens >= 512 and fmt_name != "bf16" and backend == "triton_fused":
                        from selector.plugins.quant_kernels.forward import quant_experts_forward

                        best = None
                        for cfg in SWEEP:
                            try:
                                t = timed(lambda cfg=cfg: quant_experts_forward(layer, x, index, weights, "grouped", cfg), mode)
                            except Exception:
                                continue
                            if best is None or t < best[0]:
                                best = (t, cfg)
                        if best is not None:
                            cell.config = best[1]
                    cell.time_s = timed(lambda fwd=fwd, layer=layer: fwd(layer, x, index, weights), mode)
                    if fmt_name != "bf16" and tokens <= GRAPH_MAX_TOKENS and mode == "eager":
                        rows = min(tokens, 8)
                        if ref is None:
                            ref = Q.reference_forward(layer, x[:rows], index[:rows], weights[:rows], device=device)
                        out = fwd(layer, x, index, weights)[:rows].double()
                        cell.rel_error = ((out - ref).norm() / ref.norm()).item()
                except torch.cuda.OutOfMemoryError:
                    cell.skipped = "out of memory"
                    torch.cuda.empty_cache()
                except Exception as exc:
                    cell.skipped = f"{type(exc).__name__}: {exc}"[:200]
                    traceback.print_exc()
                log(line(cell))
    return cells


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.0f}µs" if s < 1e-3 else f"{s * 1e3:.2f}ms"


def line(c: Cell) -> str:
    if c.skipped:
        return f"{c.shape} T={c.tokens} {c.format} {c.backend} {c.mode}: skipped ({c.skipped})"
    err = f" err {c.rel_error:.1e}" if c.rel_error is not None else ""
    cfg = f" best cfg {c.config}" if c.config else ""
    return f"{c.shape} T={c.tokens} {c.format} {c.backend} {c.mode}: {fmt_time(c.time_s)} ({c.ratio:.2f}x floor){err}{cfg}"


def best(cells: list[Cell], shape: str, tokens: int, mode: str, formats: tuple[str, ...]) -> Cell | None:
    found = [c for c in cells if c.shape == shape and c.tokens == tokens and c.mode == mode and c.format in formats
             and c.time_s]  # fmt: skip
    return min(found, key=lambda c: c.time_s) if found else None


def summary(cells: list[Cell]) -> tuple[str, list[dict]]:
    rows = []
    head = ("| shape | T | mode | best bf16 | best fp8-f32 | best fp8-ue8m0 | best fp4 | fp8 / bf16 | target |\n"
            "|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    out = [head]
    keys = sorted({(c.shape, c.tokens, c.mode) for c in cells}, key=lambda x: (x[0], x[2], x[1]))
    for shape, tokens, mode in keys:
        b16 = best(cells, shape, tokens, mode, ("bf16",))
        per = {f: best(cells, shape, tokens, mode, (f,)) for f in FORMATS}
        fp8 = best(cells, shape, tokens, mode, ("fp8-f32", "fp8-ue8m0"))
        speed = fp8.time_s / b16.time_s if fp8 and b16 else None
        if tokens <= 64:
            target = "-" if speed is None else ("met" if speed <= 0.65 else "MISSED") + " (fp8 <= 0.65x bf16)"
        else:
            target = "-" if fp8 is None else ("met" if fp8.ratio <= 2.0 else "MISSED") + " (fp8 <= 2x floor)"
        target = target if tokens <= 64 or tokens >= 512 else "-"

        def cellstr(c: Cell | None) -> str:
            return "-" if c is None else f"{fmt_time(c.time_s)} ({c.ratio:.2f}x) {c.backend}"

        out.append(f"| {shape} | {tokens} | {mode} | {cellstr(b16)} | {cellstr(per['fp8-f32'])} | "
                   f"{cellstr(per['fp8-ue8m0'])} | {cellstr(per['fp4'])} | "
                   f"{'-' if speed is None else f'{speed:.2f}x'} | {target} |")  # fmt: skip
        rows.append({"shape": shape, "tokens": tokens, "mode": mode, "fp8_over_bf16": speed,
                     "fp8_over_floor": fp8.ratio if fp8 else None, "target": target,
                     "fp8_over_floor_at_fp8_mma_rate": fp8.ratio_fp8_mma if fp8 else None})  # fmt: skip
    return "\n".join(out), rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--tokens", default="1,8,64,512,4096")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--bf16-backends", default=",".join(BF16_BACKENDS))
    parser.add_argument("--quant-backends", default=",".join(QUANT_TIMED), help="quantised cells: which to time")
    parser.add_argument("--sweep", action="store_true",
                        help="also try tile configs for grouped quantised cells at T >= 512 (reports the best)")
    parser.add_argument("--no-check", action="store_true", help="skip the small-layer correctness check")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting cells after this many seconds (outputs are written either way)")
    parser.add_argument("--sample-ms", type=float, default=20.0, help="back-to-back calls per timing sample (ms)")
    parser.add_argument("--repeats", type=int, default=3, help="timing samples per cell (median)")
    parser.add_argument("--out", type=Path, default=None, help="directory for quant_gpu.json and quant_gpu.md")
    parser.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global SAMPLE_S, REPEATS
    SAMPLE_S, REPEATS = args.sample_ms / 1e3, max(1, args.repeats)
    args.formats = [f for f in args.formats.split(",") if f]
    args.bf16_backends = [b for b in args.bf16_backends.split(",") if b]
    args.quant_backends = [b for b in args.quant_backends.split(",") if b]
    tokens_list = [int(t) for t in args.tokens.split(",") if t]
    if args.cpu_smoke:  # exercise every code path on tiny layers (tests/test_quant.py runs this)
        SHAPES.clear()
        SHAPES["tiny"] = (128, 64, 6, 2)
        args.shapes, args.bf16_backends = "tiny", ["grouped_mm", "batched_mm"]
    elif not torch.cuda.is_available():
        print("quant_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke run)"
    log(f"{name} torch {torch.__version__}")
    ceilings = measure_ceilings(device) if device.type == "cuda" else {"bandwidth_Bps": 20e9, "bf16_flops": 0.5e12, "fp8_flops": 1e12}
    log(f"ceilings: copy {ceilings['bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 matmul {ceilings['bf16_flops'] / 1e12:.0f} TFLOP/s")
    deadline = Deadline(args.budget_s)
    checks: list[dict] = []
    cells: list[Cell] = []
    shapes = [x for x in args.shapes.split(",") if x]

    interrupted = False

    def write_outputs(final: bool) -> None:
        table, rows = summary(cells)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            payload = {
                "schema": "selector.quant_gpu/1",
                "device": name,
                "torch": torch.__version__,
                "ceilings": ceilings,
                "command": " ".join(sys.argv),
                "complete": final and not interrupted and not any(c.skipped == BUDGET for c in cells),
                "checks": checks,
                "cells": [{**asdict(c), "time_over_floor": c.ratio} for c in cells],
                "summary": rows,
            }
            (args.out / "quant_gpu.json").write_text(json.dumps(payload, indent=1) + "\n")
            (args.out / "quant_gpu.md").write_text(table + "\n")
        if final:
            print()
            print(f"Device: {name}. Ceilings: copy {ceilings['bandwidth_Bps'] / 1e12:.2f} TB/s, "
                  f"bf16 matmul {ceilings['bf16_flops'] / 1e12:.0f} TFLOP/s. Cells: best time (time / floor) backend; "
                  "floor from the bytes as stored (quantised weights + scales).")  # fmt: skip
            print(table)
            failed = [c for c in checks if not c["ok"]]
            print(f"\ncorrectness: {len(checks) - len(failed)}/{len(checks)} paths within {GPU_BOUND:g} of the float64 "
                  "reference")  # fmt: skip
            bad = [c for c in cells if c.rel_error is not None and c.rel_error > GPU_BOUND]
            if bad:
                print(f"cells above {GPU_BOUND:g}: {[(c.shape, c.tokens, c.format, c.backend, c.rel_error) for c in bad]}")
            skipped = sum(1 for c in cells if c.skipped == BUDGET)
            if skipped:
                print(f"{skipped} cells not run: budget spent")
            print("targets (issue 5):")
            for r in rows:
                if r["target"] != "-":
                    print(f"  {r['shape']} T={r['tokens']} {r['mode']}: {r['target']}"
                          f" [fp8/bf16 {r['fp8_over_bf16'] or 0:.2f}x, fp8/floor {r['fp8_over_floor'] or 0:.2f}x,"
                          f" at the e4m3 matmul rate {r['fp8_over_floor_at_fp8_mma_rate'] or 0:.2f}x]")  # fmt: skip
            if args.out:
                log(f"wrote {args.out / 'quant_gpu.json'} and quant_gpu.md")

    def on_term(signum, frame):  # noqa: ANN001, ARG001 - `timeout` sends SIGTERM: still write what was measured
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        if not (args.no_check or args.cpu_smoke):
            checks = check_paths(device, log, deadline)
        built = {}
        for shape in shapes:  # every layer up front: cells then go token count by token count, decode first
            built[shape] = build_layers(shape, args.formats, max(tokens_list), log)
        for tokens in sorted(tokens_list):
            for shape in shapes:
                cells += run_cells(shape, built[shape], tokens, ceilings, args, log, deadline)
            write_outputs(final=False)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: writing what was measured")
    finally:
        signal.signal(signal.SIGTERM, previous)
    write_outputs(final=True)
    failed = [c for c in checks if not c["ok"]] or [c for c in cells if c.rel_error is not None and c.rel_error > GPU_BOUND]
    log("done")
    return 1 if failed or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
