"""`selector bench`: one experts layer per cell, every available backend and Transformers' own backends as
peers, timed side by side in one run against the physical floor measured in the same run.

For each cell (shape, token count, dtype, weight format, backend, mode): time, time / floor, TFLOP/s, GB/s,
peak extra memory, error against a float64 reference on a sample of tokens, and the ratio to the best
Transformers peer. `--formats` adds quantised copies of each layer (fp8 block scales as float32 or UE8M0, fp4):
their floor counts the bytes as stored (scales included) and, for compute, the e4m3 matmul rate measured in the
same run (the kernels multiply e4m3 tiles); their reference is float64 from the dequantised weights with the
activations quantised as the kernels do, and Transformers' peers run dense cells only. Modes: `eager` (calls back to back, events around the whole run, as a decode loop runs), `graph`
(one call captured in a CUDA graph, replays back to back) and `compile` (torch.compile, then like eager).
Output: a markdown table, JSON, and a PNG plot of time/floor against tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

DEFAULT_TOKENS = (1, 8, 64, 512, 4096, 16384)
DEFAULT_PRESETS = ("qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
FORMATS = {  # --formats name: (weight format, scale format) for selector.quant.quantize_experts
    "dense": None,
    "fp8-f32": ("fp8_block", "float32"),
    "fp8-ue8m0": ("fp8_block", "ue8m0"),
    "fp4": ("fp4", "ue8m0"),
}
PEER_PREFIX = "hf:"  # Transformers' own backends are listed as hf:eager, hf:batched_mm, hf:grouped_mm


@dataclass
class Cell:
    shape: str
    tokens: int
    dtype: str
    backend: str
    mode: str
    format: str = "dense"  # a FORMATS name
    time_s: float | None = None
    floor_s: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    extra_memory_bytes: int | None = None
    rel_error: float | None = None
    skipped: str | None = None
    vs_best_peer: float | None = None  # best peer time / this time: > 1 means faster than Transformers
    auto_pick: bool = False  # the backend selector's "auto" picks for this cell
    picked: str | None = None  # for the "auto" row: the backend it ran

    @property
    def ratio(self) -> float | None:
        return self.time_s / self.floor_s if self.time_s and self.floor_s else None


@dataclass
class BenchResult:
    device: str
    ceilings: dict[str, float]
    command: str
    cells: list[Cell] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "selector.bench/1",
            "device": self.device,
            "ceilings": self.ceilings,
            "command": self.command,
            "cells": [{**asdict(c), "time_over_floor": c.ratio} for c in self.cells],
            "environment": self.environment,
        }


# ---------------------------------------------------------------------------------------------- measurement


def measure_ceilings(torch: Any, device: Any, fp8: bool = False) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) over a 2 GiB device copy; bf16 8192^3 matmul rate; with `fp8`, also
    an e4m3 8192^3 scaled matmul's rate (torch._scaled_mm) where this GPU and torch have one."""
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    mm_ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    ceilings = {"bandwidth_Bps": 2 * 2**31 / (copy_ms * 1e-3), "bf16_flops": 2 * n**3 / (mm_ms * 1e-3)}
    if fp8:
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # _scaled_mm: b column-major
            one = torch.ones((), device=device)
            mm8 = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)  # noqa: E731
            ceilings["fp8_flops"] = 2 * n**3 / (do_bench(mm8, warmup=50, rep=300, return_mode="median") * 1e-3)
        except (RuntimeError, AttributeError, TypeError):  # no fp8 matmul here: quantised floors use bf16's
            pass
    return ceilings


def time_first_call(torch: Any, fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), seconds to its completion on the device): a call that may JIT-compile, timed once, synced."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def time_back_to_back(torch: Any, fn: Callable[[], Any], calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of (events around `calls` calls back to back) / calls, in seconds."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(samples)


def time_graph(torch: Any, fn: Callable[[], Any], calls: int, repeats: int = 5) -> float:
    """Capture one call in a CUDA graph, then time replays back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_back_to_back(torch, graph.replay, calls, repeats)


def calls_for(estimate_s: float) -> int:
    """Enough back-to-back calls for ~50 ms per sample, at least 3, at most 200."""
    return max(3, min(200, int(0.05 / max(estimate_s, 1e-6))))


# ---------------------------------------------------------------------------------------------- the layer


def make_layer(torch: Any, problem: Any, dtype: Any, device: Any, seed: int, weights: tuple[Any, Any] | None = None) -> Any:
    """A decorated experts module with random weights, scaled so activations stay O(1); `weights`: (gate_up,
    down) tensors to hold instead (shared, not copied)."""
    import selector

    @selector.experts
    class BenchExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            e, h, i = problem.num_experts, problem.hidden_size, problem.intermediate_size
            gen = torch.Generator(device=device).manual_seed(seed)
            self.num_experts = e
            if weights is None:
                up = torch.randn(e, 2 * i, h, device=device, dtype=dtype, generator=gen) * h**-0.5
                down = torch.randn(e, h, i, device=device, dtype=dtype, generator=gen) * i**-0.5
            else:
                up, down = weights
            self.gate_up_proj = torch.nn.Parameter(up, requires_grad=False)
            self.down_proj = torch.nn.Parameter(down, requires_grad=False)
            self.act_fn = torch.nn.SiLU()

    return BenchExperts()


def format_layer(torch: Any, dense: Any, problem: Any, fmt: str) -> Any:
    """The layer of a FORMATS entry: `dense` itself, or a copy quantised from its weights (which stay as they are)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if FORMATS[fmt] is None:
        return dense
    from selector import quant

    weights = (dense.gate_up_proj.data, dense.down_proj.data)
    twin = make_layer(torch, problem, dense.gate_up_proj.dtype, dense.gate_up_proj.device, 0, weights=weights)
    return quant.quantize_experts(twin, *FORMATS[fmt])


def compute_ceiling(ceilings: dict[str, float], problem: Any) -> float:
    """FLOP/s a cell's floor divides by: bf16's matmul rate, or for quantised weights (the kernels multiply e4m3
    tiles, fp4 widened to e4m3) the e4m3 matmul rate where it was measured."""
    if problem.weight_format != "dense" and "fp8_flops" in ceilings:
        return ceilings["fp8_flops"]
    return ceilings["bf16_flops"]


def bytes_moved(layer: Any, problem: Any, experts_hit: int, tokens: int, elem: int) -> float:
    """The floor's bytes: each expert hit read once as stored (scales included), activations in and out."""
    from selector import quant

    if quant.is_quantised(layer):
        per_expert = quant.weight_bytes(layer) / problem.num_experts
    else:
        per_expert = 3 * problem.hidden_size * problem.intermediate_size * elem
    return experts_hit * per_expert + 2 * tokens * problem.hidden_size * elem


def random_routing(torch: Any, tokens: int, experts: int, k: int, device: Any, seed: int) -> tuple[Any, Any]:
    """Uniform random top-k routing with distinct experts per token."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, experts, device=device, generator=gen)
    index = scores.topk(k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, k, device=device, generator=gen), dim=1)
    return index, weights


def reference_rows(torch: Any, layer: Any, x: Any, index: Any, weights: Any, rows: int) -> Any:
    """float64 result for the first `rows` tokens, straight from the definition."""
    x64, idx, w = x[:rows].double(), index[:rows], weights[:rows].double()
    out = torch.zeros_like(x64)
    for e in idx.unique().tolist():
        t, j = torch.where(idx == e)
        gate, up = (x64[t] @ layer.gate_up_proj[e].double().T).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        out.index_add_(0, t, (h @ layer.down_proj[e].double().T) * w[t, j].unsqueeze(-1))
    return out


def peer_functions() -> dict[str, Callable[..., Any]]:
    """Transformers' built-in experts functions, when transformers is installed."""
    try:
        from transformers.integrations import moe
        from transformers.models.qwen2_moe import modeling_qwen2_moe
    except Exception:
        return {}
    eager = getattr(modeling_qwen2_moe.Qwen2MoeExperts.forward, "__wrapped__", None)
    peers = {"hf:batched_mm": moe.batched_mm_experts_forward, "hf:grouped_mm": moe.grouped_mm_experts_forward}
    if eager is not None:
        peers["hf:eager"] = eager
    return peers


def temp_bytes_estimate(name: str, tokens: int, problem: Any, elem: int) -> int:
    """Temporaries a backend needs; dense batched_mm copies one expert's weights per (token, slot)."""
    pairs = tokens * problem.top_k
    if name.endswith("batched_mm") and problem.weight_format == "dense":
        return pairs * 3 * problem.hidden_size * problem.intermediate_size * elem
    return 4 * pairs * max(2 * problem.intermediate_size, problem.hidden_size) * elem


# ---------------------------------------------------------------------------------------------- the run


def run_bench(*args: Any, **kwargs: Any) -> BenchResult:
    """Time the grid (see `_run_bench`), with the per-call value checks off: the layer is timed, not them."""
    import os

    before = os.environ.get("SELECTOR_VALIDATE")
    os.environ["SELECTOR_VALIDATE"] = before or "shapes"
    try:
        return _run_bench(*args, **kwargs)
    finally:
        if before is None:
            del os.environ["SELECTOR_VALIDATE"]


def _run_bench(
    presets: Sequence[str],
    tokens: Sequence[int],
    dtype_name: str = "bfloat16",
    backends: Sequence[str] | None = None,
    modes: Sequence[str] = ("eager", "graph"),
    graph_max_tokens: int = 4096,
    memory_cap_gb: float = 40.0,
    with_peers: bool = True,
    progress: Callable[[str], None] | None = None,
    formats: Sequence[str] = ("dense",),
) -> BenchResult:
    import torch

    from selector.environment import current_environment
    from selector.dispatch import AUTO
    from selector.presets import preset
    from selector.registry import get_registry

    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown format(s) {unknown}: expected some of {', '.join(FORMATS)}")
    if not torch.cuda.is_available():
        raise RuntimeError("selector bench needs a CUDA GPU (it times kernels against the GPU's floor)")
    device = torch.device("cuda")
    dtype = getattr(torch, dtype_name)
    env = current_environment()
    registry = get_registry()
    ceilings = measure_ceilings(torch, device, fp8=any(FORMATS[f] for f in formats))
    result = BenchResult(
        device=torch.cuda.get_device_name(),
        ceilings=ceilings,
        command="selector " + " ".join(sys.argv[1:]) if sys.argv and "selector" in sys.argv[0] else "",
        environment=env.to_dict(),
    )
    peers = peer_functions() if with_peers else {}
    say = progress or (lambda _msg: None)

    def failed(shape: str, fmt: str, token_counts: Sequence[int], what: str, exc: Exception) -> None:
        reason = f"{what}: {type(exc).__name__}: {str(exc)[:160]}"
        result.cells.extend(Cell(shape, t, dtype_name, AUTO, mode, format=fmt, skipped=reason)
                            for t in token_counts for mode in modes)  # fmt: skip

    for shape_name in presets:
        base = replace(preset(shape_name), dtype=dtype_name, device="cuda")
        dense = make_layer(torch, base, dtype, device, seed=0)
        for fmt in formats:  # one quantised copy alive at a time
            wf, sf = FORMATS[fmt] or ("dense", None)
            try:
                layer = format_layer(torch, dense, base, fmt)
            except Exception as exc:  # e.g. out of memory: the other formats still run
                failed(shape_name, fmt, tokens, "failed to quantise", exc)
                continue
            for t in tokens:  # the same routing and hidden states for every format
                index, weights = random_routing(torch, t, base.num_experts, base.top_k, device, seed=t)
                gen = torch.Generator(device=device).manual_seed(1000 + t)
                x = torch.randn(t, base.hidden_size, device=device, dtype=dtype, generator=gen)
                problem = replace(base.with_tokens(t), weight_format=wf, scale_format=sf)
                try:
                    _time_cells(torch, result, layer, problem, shape_name, fmt, x, index, weights, env, registry,
                                backends, peers if fmt == "dense" else {}, modes, graph_max_tokens, memory_cap_gb,
                                say)  # fmt: skip
                except Exception as exc:  # the reference or auto's own call failed: record it, go on
                    failed(shape_name, fmt, [t], "failed", exc)
            del layer
            torch.cuda.empty_cache()
        del dense
        torch.cuda.empty_cache()
    _fill_peer_ratios(result.cells)
    return result


def _time_cells(torch: Any, result: BenchResult, layer: Any, problem: Any, shape_name: str, fmt: str, x: Any,
                index: Any, weights: Any, env: Any, registry: Any, backends: Sequence[str] | None,
                peers: dict[str, Callable[..., Any]], modes: Sequence[str], graph_max_tokens: int,
                memory_cap_gb: float, say: Callable[[str], None]) -> None:  # fmt: skip
    """Every backend's cells for one layer (one weight format) and one token count, appended to result.cells."""
    import selector
    from selector import quant
    from selector.dispatch import AUTO, last_backend

    t, dtype_name = x.shape[0], problem.dtype
    elem = x.element_size()
    moved = bytes_moved(layer, problem, int(index.unique().numel()), t, elem)
    flops = 2.0 * t * problem.top_k * 3 * problem.hidden_size * problem.intermediate_size
    floor = max(moved / result.ceilings["bandwidth_Bps"], flops / compute_ceiling(result.ceilings, problem))
    sample = min(t, 32)
    if quant.is_quantised(layer):  # float64 from the dequantised weights, activations quantised as the kernels do
        ref = quant.reference_forward(layer, x[:sample], index[:sample], weights[:sample], device=x.device)
    else:
        ref = reference_rows(torch, layer, x, index, weights, sample)

    def new_cell(name: str, mode: str, **kw: Any) -> Cell:
        return Cell(shape_name, t, dtype_name, name, mode, format=fmt, **kw)

    # what "auto" picks for this cell, through the model API itself
    selector.set_experts_implementation(layer, AUTO)
    layer(x, index, weights)
    auto_name = last_backend(layer)

    candidates: dict[str, Callable[..., Any] | None] = {}
    for name in backends or registry.names:
        verdict = selector.rank(problem, env, registry).excluded.get(name)
        candidates[name] = None if verdict else registry.get(name).loader(problem.weight_format)()
        if verdict:
            result.cells.extend(new_cell(name, mode, skipped=verdict.reason) for mode in modes)
    candidates.update(peers)
    # "auto" as a user runs it: the module's own forward (dispatch, shape checks, the picked backend)
    candidates[AUTO] = lambda module, hs, idx, w: module(hs, idx, w)

    for name, fn in candidates.items():
        if fn is None:
            continue
        if temp_bytes_estimate(name, t, problem, elem) > memory_cap_gb * 2**30:
            result.cells.extend(new_cell(name, mode, skipped=f"needs more than {memory_cap_gb:g} GB of temporaries")
                                for mode in modes)  # fmt: skip
            continue

        def call(fn: Callable[..., Any] = fn) -> Any:
            return fn(layer, x, index, weights)

        for mode in modes:
            cell = new_cell(name, mode, floor_s=floor, auto_pick=name == auto_name)
            if name == AUTO:
                cell.picked = auto_name
            say(f"{shape_name} T={t} {fmt} {name} {mode}")
            try:
                if mode == "graph" and t > graph_max_tokens:
                    cell.skipped = f"graph mode only up to T={graph_max_tokens}"
                elif mode == "graph" and name.endswith("eager"):
                    cell.skipped = "reads expert ids on the host: cannot be captured"
                else:
                    runner = call
                    if mode == "compile":
                        compiled = torch.compile(fn, dynamic=False)
                        runner = lambda compiled=compiled: compiled(layer, x, index, weights)  # noqa: E731
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    out = runner()
                    torch.cuda.synchronize()
                    cell.extra_memory_bytes = torch.cuda.max_memory_allocated() - base
                    if sample:
                        diff = (out[:sample].double() - ref).norm() / ref.norm().clamp_min(1e-30)
                        cell.rel_error = float(diff)
                    first = time.perf_counter()
                    runner()
                    torch.cuda.synchronize()
                    n = calls_for(time.perf_counter() - first)
                    timer = time_graph if mode == "graph" else time_back_to_back
                    cell.time_s = timer(torch, runner, n)
                    cell.tflops = flops / cell.time_s / 1e12
                    cell.gbps = moved / cell.time_s / 1e9
            except Exception as exc:  # one failing cell must not lose the run
                cell.skipped = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            result.cells.append(cell)
            torch.cuda.empty_cache()


def _fill_peer_ratios(cells: list[Cell]) -> None:
    """vs_best_peer against Transformers' best of the same cell and weight format (peers run dense cells only)."""
    best: dict[tuple[str, int, str, str, str], float] = {}
    for c in cells:
        if c.backend.startswith(PEER_PREFIX) and c.time_s:
            key = (c.shape, c.tokens, c.dtype, c.mode, c.format)
            best[key] = min(best.get(key, math.inf), c.time_s)
    for c in cells:
        peer = best.get((c.shape, c.tokens, c.dtype, c.mode, c.format))
        if peer and c.time_s:
            c.vs_best_peer = peer / c.time_s


# ---------------------------------------------------------------------------------------------- output


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.0f}µs" if s < 1e-3 else f"{s * 1e3:.2f}ms"


def markdown_table(result: BenchResult) -> str:
    """One row per (shape, T, mode, format); per backend: time (time/floor); then the best and auto's standing.
    With quantised formats in the run, a second table sets each format's best beside the dense best."""
    backends = sorted({c.backend for c in result.cells}, key=lambda b: (b != "auto", b.startswith(PEER_PREFIX), b))
    order = {f: i for i, f in enumerate(FORMATS)}
    rows = sorted({(c.shape, c.tokens, c.mode, c.format) for c in result.cells},
                  key=lambda r: (r[0], r[2], r[1], order.get(r[3], len(order))))  # fmt: skip
    by_key = {(c.shape, c.tokens, c.mode, c.format, c.backend): c for c in result.cells}
    c = result.ceilings
    lines = [
        f"Device: {result.device}. Ceilings measured in this run: copy {c['bandwidth_Bps'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {c['bf16_flops'] / 1e12:.0f} TFLOP/s. Cells: time (time / floor); `*` marks auto's pick, [name] what the auto row ran.",
        "",
        "| shape | T | mode | format | " + " | ".join(backends) + " | best | auto vs best hf |",
        "|---|---|---|---|" + "---|" * (len(backends) + 2),
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
                texts.append(f"{_fmt_time(cell.time_s)} ({cell.ratio:.2f}x){mark}")
        timed = [x for x in cells if x and x.time_s]
        best = min((x for x in timed if x.backend != "auto"), key=lambda x: x.time_s, default=None)
        best = best.backend if best else "-"
        auto = next((x for x in timed if x.backend == "auto"), None)
        standing = f"{auto.vs_best_peer:.2f}x faster" if auto and auto.vs_best_peer else "-"
        lines.append(f"| {shape} | {t} | {mode} | {fmt} | " + " | ".join(texts) + f" | {best} | {standing} |")
    return "\n".join(lines) + "\n" + _formats_table(result.cells)


def _formats_table(cells: Iterable[Cell]) -> str:
    """Per (shape, T, mode): the fastest selector backend of each format, time (time / floor), and its time over
    the dense best (the quantised formats' point: fewer bytes to read)."""
    best: dict[tuple[str, int, str, str], Cell] = {}
    for c in cells:
        if c.time_s and c.backend != "auto" and not c.backend.startswith(PEER_PREFIX):
            key = (c.shape, c.tokens, c.mode, c.format)
            if key not in best or c.time_s < best[key].time_s:
                best[key] = c
    quantised = [f for f in FORMATS if f != "dense" and any(k[3] == f for k in best)]
    if not quantised:
        return ""
    lines = ["", "Quantised against dense: the fastest selector backend per format, time (time / floor); "
                 "x dense = its time over the dense best.", "",
             "| shape | T | mode | dense | " + " | ".join(f"{f} | x dense" for f in quantised) + " |",
             "|---|---|---|---|" + "---|---|" * len(quantised)]  # fmt: skip
    for shape, t, mode in sorted({k[:3] for k in best}, key=lambda r: (r[0], r[2], r[1])):
        dense = best.get((shape, t, mode, "dense"))
        texts = [f"{_fmt_time(dense.time_s)} ({dense.ratio:.2f}x) {dense.backend}" if dense else "-"]
        for f in quantised:
            q = best.get((shape, t, mode, f))
            texts.append(f"{_fmt_time(q.time_s)} ({q.ratio:.2f}x) {q.backend}" if q else "-")
            texts.append(f"{q.time_s / dense.time_s:.2f}" if q and dense else "-")
        lines.append(f"| {shape} | {t} | {mode} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"


def plot(result: BenchResult, path: Path) -> bool:
    """time/floor against tokens, one panel per shape (eager mode solid, graph dashed)."""
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
            for mode, style in (("eager", "-"), ("graph", "--"), ("compile", ":")):
                pts = sorted((c.tokens, c.ratio) for c in result.cells if c.shape == shape and c.backend == backend
                             and c.format == fmt and c.mode == mode and c.ratio)  # fmt: skip
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
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps(result.to_dict(), indent=1))
    paths[1].write_text(markdown_table(result))
    if plot(result, out_dir / "bench.png"):
        paths.append(out_dir / "bench.png")
    return paths


# ---------------------------------------------------------------------------------------------- CLI


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _formats(text: str) -> list[str]:
    names = _names(text)
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'}: expected some of {', '.join(FORMATS)}")
    return names


def _progress() -> Callable[[str], None]:
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    bar = tqdm(unit="cell", file=sys.stderr)

    def step(msg: str) -> None:
        bar.set_description(msg)
        bar.update(1)

    return step


def _cmd_bench(args: argparse.Namespace) -> int:
    result = run_bench(
        presets=args.preset or list(DEFAULT_PRESETS),
        tokens=args.tokens,
        dtype_name=args.dtype,
        backends=args.backends,
        modes=args.modes,
        graph_max_tokens=args.graph_max_tokens,
        memory_cap_gb=args.memory_cap_gb,
        with_peers=not args.no_peers,
        progress=_progress(),
        formats=args.formats,
    )
    paths = write_outputs(result, Path(args.out))
    from selector.tuning import records_from_bench
    from selector.tuning_store import user_tuning_path, write_records

    records = records_from_bench(result.to_dict())
    write_records(Path(args.out) / "tuning.json", records)
    if args.save_tuning:
        write_records(user_tuning_path(), records)
        paths.append(user_tuning_path())
        from selector.daemon.client import ping, request, socket_path

        if ping(socket_path()):  # share with the other processes of this node at once
            request(socket_path(), {"op": "tuning_put", "records": records})
    print(markdown_table(result))
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def register(sub: Any) -> None:
    bench = sub.add_parser("bench", help="time every backend per cell against the floor and Transformers' backends")
    bench.add_argument("--preset", action="append", help=f"shape preset (repeatable); default: {', '.join(DEFAULT_PRESETS)}")
    bench.add_argument("--tokens", type=_ints, default=list(DEFAULT_TOKENS), help="comma list of token counts")
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bench.add_argument("--backends", type=_names, help="comma list of selector backends (default: all registered)")
    bench.add_argument("--modes", type=_names, default=["eager", "graph"], help="comma list of eager,graph,compile")
    bench.add_argument("--graph-max-tokens", type=int, default=4096)
    bench.add_argument("--memory-cap-gb", type=float, default=40.0, help="skip cells needing more temporaries")
    bench.add_argument("--no-peers", action="store_true", help="leave out Transformers' backends")
    bench.add_argument("--formats", type=_formats, default=["dense"],
                       help=f"comma list of weight formats to time side by side: {', '.join(FORMATS)}")  # fmt: skip
    bench.add_argument("--out", default="bench-results", help="folder for bench.json, bench.md, bench.png, tuning.json")
    bench.add_argument("--save-tuning", action="store_true", help="let auto use these timings on this machine")
    bench.set_defaults(func=_cmd_bench)


def summarise(cells: Iterable[Cell]) -> dict[str, Any]:
    """Counts used by notes: cells where auto beat or matched the best peer."""
    auto = [c for c in cells if c.backend == "auto" and c.vs_best_peer]
    return {"auto_cells": len(auto), "auto_not_slower": sum(1 for c in auto if c.vs_best_peer >= 1.0)}
