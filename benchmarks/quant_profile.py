"""Where one quantised cell's time goes: each kernel's device time per call (torch.profiler) beside the
call's back-to-back time and the host's time to issue one call, so a host-bound cell (issue time near the
call's time, kernels well below it) shows as such; and the caching allocator's events per call (a device
free or an allocation retry synchronises the host with the GPU).

    python3 benchmarks/quant_profile.py --shapes qwen3-30b-a3b --tokens 512,4096 --formats fp8-f32,bf16 --out DIR
    python3 benchmarks/quant_profile.py --tokens 1,8,64 --graphs on,off      # eager decode: replay vs launches
    python3 benchmarks/quant_profile.py --tokens 512 --pressure-gb 38         # the allocator after a huge temporary
    python3 benchmarks/quant_profile.py --micro --tokens 512,4096             # quantize_rows / combine tile sweeps

Uses quant_gpu.py's layers, routing and timer; the `triton_fused` backend (the quantised grouped path, and the
fused bf16 kernel for bf16). Writes quant_profile.json under --out; prints one block per cell.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_gpu as G  # noqa: E402  (sets up sys.path and the validation level like the grid does)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from selector import quant as Q  # noqa: E402

CALLS = 20
GRAPH_VARIABLES = ("SELECTOR_QUANT_GRAPHS", "SELECTOR_TRITON_FUSED_GRAPHS")
ALLOC_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def _alloc_events() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOC_EVENTS}


def host_issue_time(run, calls: int = CALLS) -> float:  # noqa: ANN001
    """Seconds the host takes to issue one call, the GPU idle at the start (valid while the queue is short)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    return issued / calls


_LAYER: dict = {}  # the last (shape, format) layer built: cells go token count by token count


def _layer(shape: str, fmt: str) -> torch.nn.Module:
    if (shape, fmt) not in _LAYER:
        _LAYER.clear()
        h, i, e, _ = G.SHAPES[shape]
        layer = G.make_layer(e, h, i, torch.device("cuda"))
        if fmt != "bf16":
            Q.quantize_experts(layer, *G.FORMATS[fmt])
        _LAYER[(shape, fmt)] = layer
    return _LAYER[(shape, fmt)]


def profile_cell(shape: str, tokens: int, fmt: str, host: bool = False, graphs: bool = True) -> dict:
    h, i, e, k = G.SHAPES[shape]
    dev = torch.device("cuda")
    layer = _layer(shape, fmt)
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    idx, w = G.routing(tokens, e, k, dev)
    fwd = G.forward_of("triton_fused")
    run = lambda: fwd(layer, x, idx, w)  # noqa: E731
    for var in GRAPH_VARIABLES:  # read on every call: eager decode through recorded graphs, or launches
        os.environ[var] = "1" if graphs else "0"
    per_call = G.timed(run, "eager")
    issue = host_issue_time(run)
    from selector.plugins.triton_fused import kernels as fused_kernels

    cached, before = len(fused_kernels._LAUNCH_CACHE), _alloc_events()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            run()
        torch.cuda.synchronize()
    alloc = {k: round((v - before[k]) / CALLS, 2) for k, v in _alloc_events().items()}
    new_launch_entries = len(fused_kernels._LAUNCH_CACHE) - cached
    host_top = ""
    if host:  # where the host's time per call goes (cProfile: own time, top functions)
        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(CALLS):
            run()
        prof_host.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof_host, stream=text).sort_stats("tottime").print_stats(18)
        host_top = text.getvalue()
    kernels = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.count >= CALLS:
            kernels[ev.key[:70]] = round(t / CALLS, 2)  # us per layer call
    return {"shape": shape, "tokens": tokens, "format": fmt, "graphs": graphs, "us_per_call": round(per_call * 1e6, 1),
            "host_issue_us_per_call": round(issue * 1e6, 1), "alloc_events_per_call": alloc,
            "new_launch_cache_entries": new_launch_entries,
            "kernel_us_per_call": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
            "kernel_us_sum": round(sum(kernels.values()), 1), "host_profile": host_top}  # fmt: skip


def _event_time(fn, calls: int = 50) -> float:  # noqa: ANN001
    return G.time_back_to_back(fn, calls, 3) * 1e6


def micro(shape: str, tokens: int) -> list[dict]:
    """quantize_rows (x [T, H]) and combine (y [T*k, H] -> [T, H]) over their tile choices, device time each."""
    from selector.plugins.quant_kernels.ops import quantize_rows
    from selector.plugins.triton_fused.kernels import combine

    h, _, e, k = G.SHAPES[shape]
    dev = torch.device("cuda")
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    idx, _ = G.routing(tokens, e, k, dev)
    ids = idx.reshape(-1).contiguous()
    y = torch.randn(tokens * k, h, device=dev, dtype=torch.bfloat16)
    out = torch.empty(tokens, h, device=dev, dtype=torch.bfloat16)
    rows = []
    for block_r in (None, 16, 32, 64, 128):
        for warps in (4, 8):
            us = _event_time(lambda: quantize_rows(x, 128, block_r, warps))
            rows.append({"kernel": "quantize_rows", "shape": shape, "tokens": tokens, "tile": block_r, "num_warps": warps,
                         "us": round(us, 2), "GB/s": round(x.numel() * 3 / us / 1e3, 1)})  # fmt: skip
    for block_h in (None, 256, 512, 1024, 2048):
        for warps in (4, 8):
            us = _event_time(lambda: combine(y, ids, out, k, e, block_h, warps))
            rows.append({"kernel": "combine", "shape": shape, "tokens": tokens, "tile": block_h, "num_warps": warps,
                         "us": round(us, 2), "GB/s": round((y.numel() + out.numel()) * 2 / us / 1e3, 1)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b", help="comma-separated: " + ", ".join(G.SHAPES))
    p.add_argument("--tokens", default="512")
    p.add_argument("--formats", default="fp8-f32", help="comma-separated: bf16, " + ", ".join(G.FORMATS))
    p.add_argument("--graphs", default="on", help="on, off or on,off: eager decode through recorded graphs or not")
    p.add_argument("--pressure-gb", type=float, default=0.0,
                   help="first allocate and free this many GiB (as the grid's batched_mm bf16 cells leave cached)")
    p.add_argument("--micro", action="store_true", help="only the quantize_rows / combine tile sweeps")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--host-profile", action="store_true", help=f"also cProfile {CALLS} calls (host time)")
    a = p.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    tokens = [int(v) for v in a.tokens.split(",") if v]
    if a.pressure_gb:
        torch.empty(int(a.pressure_gb * 2**30), dtype=torch.uint8, device="cuda")  # freed, still reserved
    results: list[dict] = []
    if a.micro:
        for shape in shapes:
            for t in tokens:
                for row in micro(shape, t):
                    results.append(row)
                    print(" ".join(f"{k}={v}" for k, v in row.items()))
    else:
        for shape in shapes:
            for fmt in (f for f in a.formats.split(",") if f):
                for t in tokens:
                    for graphs in (g == "on" for g in a.graphs.split(",") if g):
                        cell = profile_cell(shape, t, fmt, a.host_profile, graphs)
                        results.append(cell)
                        print(f"{shape} T={t} {fmt} graphs={'on' if graphs else 'off'}: {cell['us_per_call']} us per "
                              f"call back to back; host issues one in {cell['host_issue_us_per_call']} us; kernels "
                              f"{cell['kernel_us_sum']} us; allocator/call {cell['alloc_events_per_call']}; new launch "
                              f"cache entries {cell['new_launch_cache_entries']}")  # fmt: skip
                        for name, us in cell["kernel_us_per_call"].items():
                            print(f"  {us:9.1f} us  {name}")
                        if cell["host_profile"]:
                            print(cell["host_profile"])
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "quant_profile.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
