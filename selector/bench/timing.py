"""Timing primitives of `selector bench` and `selector tune`: the machine's ceilings, a first call, calls back to
back, graph replays, and interleaved rounds over several runners.

Every timer takes the `torch` module as its first argument so that importing this module imports no torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

MAX_CALLS_PER_SAMPLE = 2000  # a sample of a microsecond-sized replay stays bounded in host time


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


def capture_graph(torch: Any, fn: Callable[[], Any]) -> Any:
    """One call of `fn` captured in a CUDA graph, after two warm-up calls on a side stream (lazy allocations and
    one-time work happen outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_graph(torch: Any, fn: Callable[[], Any], calls: int, repeats: int = 5) -> float:
    """Capture one call in a CUDA graph (`capture_graph`), then time replays back to back."""
    return time_back_to_back(torch, capture_graph(torch, fn).replay, calls, repeats)


@dataclass(frozen=True)
class Timing:
    """One runner's interleaved samples (seconds per call): the median, the relative spread, the samples."""

    median_s: float
    spread: float  # (max - min) / median over the samples
    samples: tuple[float, ...]

    @property
    def rounds(self) -> int:
        return len(self.samples)


def timing_of(samples: list[float]) -> Timing:
    median = statistics.median(samples)
    return Timing(median, (max(samples) - min(samples)) / median if median > 0 else 0.0, tuple(samples))


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def time_interleaved(
    torch: Any,
    runners: Mapping[str, Callable[[], Any]],
    mode: str,
    rounds: int = 5,
    sample_s: float = 0.02,
    device: str = "cuda",
    errors: MutableMapping[str, str] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Time every runner in `rounds` rounds, each runner once per round, the order rotated every round (A B C,
    B C A, C A B, ...), so that clock and power drift spread over all of them instead of favouring one.

    One sample is CUDA events around n back-to-back calls (no sync between them, as a decode loop runs), n from
    one timed call so that a sample takes about `sample_s` (`sample_s` <= 0: one call). `mode` "graph" captures
    each runner's CUDA graph first (`capture_graph`) and interleaves the replays; "eager" or "compile" calls
    the runner itself. `device` other than "cuda" times on the host clock (`clock`), for a CPU run of the
    harness; graph mode needs CUDA (ValueError). A runner that raises, at capture or in any round, is dropped
    and its error put in `errors`; the others still run. Returns {name: Timing} of the runners that finished,
    in `runners`' order."""
    if mode not in ("eager", "graph", "compile"):
        raise ValueError(f"mode {mode!r}: expected eager, graph or compile")
    cuda = device == "cuda"
    if mode == "graph" and not cuda:
        raise ValueError("graph mode needs CUDA")
    errors = {} if errors is None else errors
    calls: dict[str, Callable[[], Any]] = {}
    graphs: list[Any] = []  # kept alive until the rounds are done
    for name, fn in runners.items():
        try:
            if mode == "graph":
                graph = capture_graph(torch, fn)
                graphs.append(graph)
                fn = graph.replay
            calls[name] = fn
        except Exception as exc:
            errors[name] = _failure(exc)
    n: dict[str, int] = {}
    for name, fn in list(calls.items()):
        try:
            n[name] = _calls_per_sample(torch, fn, sample_s, cuda, clock)
        except Exception as exc:
            errors[name] = _failure(exc)
            del calls[name]
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if name in errors:
                continue
            try:
                samples[name].append(_sample(torch, calls[name], n[name], cuda, clock))
            except Exception as exc:
                errors[name] = _failure(exc)
    del graphs
    return {name: timing_of(s) for name, s in samples.items() if name not in errors and s}


def _calls_per_sample(torch: Any, fn: Callable[[], Any], sample_s: float, cuda: bool, clock: Callable[[], float]) -> int:
    """Calls that fill about `sample_s`, from one synced call (after one untimed call to warm it)."""
    if sample_s <= 0:
        return 1
    fn()
    if cuda:
        torch.cuda.synchronize()
    start = clock()
    fn()
    if cuda:
        torch.cuda.synchronize()
    once = max(clock() - start, 1e-7)
    return max(1, min(MAX_CALLS_PER_SAMPLE, round(sample_s / once)))


def _sample(torch: Any, fn: Callable[[], Any], calls: int, cuda: bool, clock: Callable[[], float]) -> float:
    """Seconds per call over `calls` calls back to back: CUDA events around them, or the host clock."""
    if not cuda:
        start = clock()
        for _ in range(calls):
            fn()
        return (clock() - start) / calls
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e-3 / calls


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
