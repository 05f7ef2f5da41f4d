"""Timing primitives of `selector bench`: the machine's ceilings, a first call, calls back to back, graph replays.

Every timer takes the `torch` module as its first argument so that importing this module imports no torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


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
            mm8 = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)
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
    """Median over `repeats` of (events around `calls` calls back to back) / calls, in seconds: no sync between
    calls, as a decode loop runs."""
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
    """Capture one call in a CUDA graph (after two warm-up calls on a side stream), then time replays back to
    back."""
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


def time_host(fn: Callable[[], Any], calls: int, repeats: int = 1) -> float:
    """Median over `repeats` of the host clock around `calls` calls, per call: for a CPU run of the harness."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def calls_for(estimate_s: float) -> int:
    """Enough back-to-back calls for ~50 ms per sample, at least 3, at most 200."""
    return max(3, min(200, int(0.05 / max(estimate_s, 1e-6))))
