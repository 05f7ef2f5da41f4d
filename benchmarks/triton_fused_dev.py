"""Dev check + timing of the fused Triton experts kernel on the GPU (one call does everything).

    cd <repo> && PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/triton_fused_dev.py [--tune] [--quick]

Sections: ceilings (2 GiB copy, 8192^3 bf16 matmul) -> correctness on the perf.md grid vs an fp32 reference
-> optional tuning (writes $OUT/NVIDIA_H200.json) -> timing of every grid cell: fused (default heuristics and,
after tuning, tuned), Transformers' grouped_mm and batched_mm as peers, eager back-to-back and (T <= 64)
CUDA-graph replay -> custom-op overhead. Prints a short table last; full numbers in $OUT/triton_fused_dev.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _import_plugin():
    """Import kernels/configs/tune; if the package __init__ (someone else's) fails, bypass it with stubs."""
    try:
        from selector.plugins.triton_fused import configs, kernels, tune

        return kernels, configs, tune
    except Exception:
        traceback.print_exc()
        print("!! package import failed; loading the kernel modules without plugins/triton_fused/__init__.py")
        for name in ("plugins", "selector.plugins.triton_fused"):
            sys.modules.pop(name, None)
            mod = types.ModuleType(name)
            mod.__path__ = [str(ROOT / name.replace(".", "/"))]
            sys.modules[name] = mod
        return tuple(importlib.import_module(f"selector.plugins.triton_fused.{m}") for m in ("kernels", "configs", "tune"))


K, C, TU = _import_plugin()

OUT = Path(os.environ.get("OUT", "/tmp/triton_fused_out"))
OUT.mkdir(parents=True, exist_ok=True)
GRID = {
    "Qwen1.5-MoE-A2.7B": (60, 2048, 1408, 4),
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
    "Mixtral-8x7B": (8, 4096, 14336, 2),
    "DeepSeek-V3": (256, 7168, 2048, 8),
}
TOKENS = (1, 8, 64, 512, 4096, 16384)
RESULTS: dict = {"cells": [], "checks": [], "notes": []}


def log(*a):
    print(*a, flush=True)


def save():
    (OUT / "triton_fused_dev.json").write_text(json.dumps(RESULTS, indent=1, default=str) + "\n")


# ------------------------------------------------------------------------------------------------------------
# ceilings
# ------------------------------------------------------------------------------------------------------------


def ceilings():
    n = (2 << 30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    e.synchronize()
    bw = 2 * a.numel() * 2 * 10 / (s.elapsed_time(e) * 1e-3)
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    s.record()
    for _ in range(10):
        x @ y
    e.record()
    e.synchronize()
    peak = 2 * m**3 * 10 / (s.elapsed_time(e) * 1e-3)
    del x, y
    torch.cuda.empty_cache()
    return bw, peak


# ------------------------------------------------------------------------------------------------------------
# problems, references, peers
# ------------------------------------------------------------------------------------------------------------


def make_weights(E, H, I, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g).mul_(1 / math.sqrt(H))
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g).mul_(1 / math.sqrt(I))
    return w1, w2


def make_inputs(T, H, E, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.rand(T, E, device="cuda", generator=g)
    w, ids = torch.topk(scores, k, dim=-1)
    return x, ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


def ref_fp32(x, w1, w2, ids, wts, E):
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if e >= E:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = x[tok].float() @ w1[e].float().T
        g, u = h.chunk(2, dim=-1)
        o = (torch.nn.functional.silu(g) * u) @ w2[e].float().T
        out.index_add_(0, tok, o * wts[tok, slot, None].float())
    return out


class _Experts(torch.nn.Module):
    """Just enough of a Transformers experts module for its reference backends."""

    def __init__(self, w1, w2, E):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.num_experts = w1, w2, E
        self.has_gate, self.has_bias, self.is_transposed, self.is_concatenated = True, False, False, True
        self._is_expert_parallel, self.has_post_expert_norm = False, False
        self.act_fn = torch.nn.functional.silu
        self.config = types.SimpleNamespace(_experts_implementation="grouped_mm")

    def _apply_gate(self, gu):
        g, u = gu.chunk(2, dim=-1)
        return self.act_fn(g) * u


def peers():
    out = {}
    try:
        from transformers.integrations import moe as tmoe

        out["grouped_mm"] = tmoe.grouped_mm_experts_forward
        out["batched_mm"] = tmoe.batched_mm_experts_forward
    except Exception as exc:
        RESULTS["notes"].append(f"transformers backends unavailable: {exc!r}")
    return out


# ------------------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------------------


def time_eager(fns, target_s=0.06, reps=3):
    """Back-to-back calls (rotating input sets), events around the whole run; median of reps, seconds/call."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in fns:
        f()
    torch.cuda.synchronize()
    est = max(1e-6, (time.perf_counter() - t0) / len(fns))
    n = int(min(2000, max(len(fns), target_s / est)))
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    res = []
    for _ in range(reps):
        s.record()
        for i in range(n):
            fns[i % len(fns)]()
        e.record()
        e.synchronize()
        res.append(s.elapsed_time(e) * 1e-3 / n)
    return statistics.median(res)


def time_graph(fns, target_s=0.06, reps=3):
    graphs = []
    for f in fns:
        f()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    for f in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            f()
        graphs.append(g)
    torch.cuda.synchronize()
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    est = max(1e-6, (time.perf_counter() - t0) / len(graphs))
    n = int(min(400, max(len(graphs), target_s / est)))
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    res = []
    for _ in range(reps):
        s.record()
        for i in range(n):
            graphs[i % len(graphs)].replay()
        e.record()
        e.synchronize()
        res.append(s.elapsed_time(e) * 1e-3 / n)
    del graphs
    return statistics.median(res)


def floor_s(T, E, H, I, k, ids, bw, peak):
    hit = int(torch.unique(ids).numel())
    bytes_ = hit * 3 * H * I * 2 + 2 * T * H * 2
    flops = 2 * T * k * 3 * H * I
    return max(bytes_ / bw, flops / peak), flops


# ------------------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------------------


def profile_mode(bw, peak):
    """Where the eager time goes at large T (kernel times from torch.profiler), GROUP_M variants, clocks."""
    import subprocess

    smi = None
    try:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader", "-lms", "250"],
            stdout=open(OUT / "smi.csv", "w"), stderr=subprocess.DEVNULL,
        )  # fmt: skip
    except Exception as exc:
        log(f"nvidia-smi sampling unavailable: {exc!r}")
    # sustained vs burst matmul rate
    m = 8192
    xa = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    xb = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ev = [torch.cuda.Event(True) for _ in range(201)]
    ev[0].record()
    for i in range(200):
        xa @ xb
        ev[i + 1].record()
    torch.cuda.synchronize()
    per = [ev[i].elapsed_time(ev[i + 1]) * 1e-3 for i in range(200)]
    rate = lambda ts: 2 * m**3 * len(ts) / sum(ts) / 1e12  # noqa: E731
    RESULTS["matmul_burst_vs_sustained_tflops"] = [rate(per[:10]), rate(per[-50:])]
    log(f"matmul 8192^3: first 10 {rate(per[:10]):.0f} TF/s, last 50 of 200 {rate(per[-50:]):.0f} TF/s")
    del xa, xb
    from torch.profiler import ProfilerActivity, profile

    for name, T, variants in (
        ("Qwen3-30B-A3B", 16384, (8, 16, 32, 4)),
        ("DeepSeek-V3", 16384, (8, 16)),
        ("Qwen3-30B-A3B", 4096, (8, 16)),
    ):
        E, H, I, k = GRID[name]
        w1, w2 = make_weights(E, H, I)
        sets = [make_inputs(T, H, E, k, seed=1000 + s) for s in range(2)]
        base = C.get_config(E, H, I, T, k, torch.bfloat16, device="cuda")
        fl, flops = floor_s(T, E, H, I, k, sets[0][1], bw, peak)
        for gm in variants:
            cfg = {"BLOCK_M": base["BLOCK_M"], "gate_up": dict(base["gate_up"], GROUP_M=gm),
                   "down": dict(base["down"], GROUP_M=gm)}  # fmt: skip
            fns = [(lambda x=x, ids=ids, wts=wts: K.fused_experts(x, w1, w2, ids, wts, num_experts=E, config=cfg))
                   for x, ids, wts in sets]  # fmt: skip
            t = time_eager(fns)
            RESULTS["cells"].append(dict(shape=name, T=T, group_m=gm, fused_eager_s=t, floor_s=fl, flops=flops))
            log(f"{name} T={T} GROUP_M={gm}: {t * 1e6:.0f} us ({t / fl:.2f}x floor, {flops / t / 1e12:.0f} TF/s)")
        x, ids, wts = sets[0]
        for _ in range(2):
            K.fused_experts(x, w1, w2, ids, wts, num_experts=E)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                K.fused_experts(x, w1, w2, ids, wts, num_experts=E)
            torch.cuda.synchronize()
        rows = []
        for ev_ in prof.key_averages():
            dt = getattr(ev_, "device_time_total", None) or getattr(ev_, "cuda_time_total", 0)
            if dt:
                rows.append((dt / 3, ev_.key[:60], ev_.count // 3))
        rows.sort(reverse=True)
        RESULTS.setdefault("kernel_profile", {})[f"{name}:{T}"] = rows
        log(f"{name} T={T} per-call kernel times (us): " + "; ".join(f"{r[1]} {r[0]:.0f}" for r in rows[:6]))
        del w1, w2, sets
        torch.cuda.empty_cache()
        save()
    if smi is not None:
        smi.terminate()
        smi.wait()
        try:
            lines = (OUT / "smi.csv").read_text().splitlines()
            clk = [int(ln.split(",")[1].split()[0]) for ln in lines]
            pw = [float(ln.split(",")[2].split()[0]) for ln in lines]
            RESULTS["smi"] = dict(sm_mhz=clk, power_w=pw)
            log(f"nvidia-smi: {len(lines)} samples, SM clock {min(clk)}..{max(clk)} MHz, power {min(pw):.0f}..{max(pw):.0f} W")
        except Exception as exc:
            log(f"nvidia-smi parse failed: {exc!r}")
    save()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tune", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer cells (smoke run)")
    p.add_argument("--shapes", default=",".join(GRID))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--with-default", action="store_true", help="also time the default heuristics")
    p.add_argument("--profile", action="store_true", help="only: kernel-time profile, GROUP_M variants, clocks")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip tuning once this much time has passed")
    p.add_argument("--rep-ms", type=float, default=10.0, help="do_bench rep per tuning candidate")
    a = p.parse_args()
    t_start = time.perf_counter()
    import triton

    dev = torch.cuda.get_device_name()
    RESULTS["env"] = dict(device=dev, torch=torch.__version__, triton=triton.__version__, argv=sys.argv)
    log(f"device {dev} torch {torch.__version__} triton {triton.__version__}")
    bw, peak = ceilings()
    RESULTS["bw"], RESULTS["peak"] = bw, peak
    log(f"copy BW {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    save()
    if a.profile:
        profile_mode(bw, peak)
        return
    shapes = [s for s in a.shapes.split(",") if s]
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.quick:
        tokens = [t for t in tokens if t in (1, 64, 4096)]
    pe = {} if a.no_peers else peers()
    tuned_doc = None
    summary = []
    for name in shapes:
        E, H, I, k = GRID[name]
        t_shape = time.perf_counter()
        w1, w2 = make_weights(E, H, I)
        # --- correctness (default heuristics) ---
        for T in [t for t in tokens if t in (1, 64, 512, 4096)]:
            try:
                x, ids, wts = make_inputs(T, H, E, k, seed=T)
                out = K.fused_experts(x, w1, w2, ids, wts, num_experts=E)
                ref = ref_fp32(x, w1, w2, ids, wts, E)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                row = dict(shape=name, T=T, rel_err=err, finite=bool(torch.isfinite(out).all()))
                if "grouped_mm" in pe:
                    g = pe["grouped_mm"](_Experts(w1, w2, E), x, ids, wts)
                    row["grouped_mm_rel_err"] = ((g.float() - ref).norm() / ref.norm()).item()
                RESULTS["checks"].append(row)
                log(f"check {name} T={T}: rel err {err:.2e} (grouped_mm {row.get('grouped_mm_rel_err', float('nan')):.2e})")
            except Exception as exc:
                traceback.print_exc()
                RESULTS["checks"].append(dict(shape=name, T=T, error=repr(exc)))
        save()
        # --- tuning ---
        if a.tune and time.perf_counter() - t_start > a.budget_s:
            RESULTS["notes"].append(f"tuning skipped for {name}: over the time budget")
            log(f"tuning skipped for {name}: over budget")
        elif a.tune:
            try:
                tuned_doc = TU.tune([(E, H, I, k)], tokens, torch.bfloat16, OUT / C.config_file_name(dev),
                                    rep_ms=a.rep_ms)  # fmt: skip
                RESULTS.setdefault("tune_timings", {}).update(tuned_doc.get("_timings", {}))
            except Exception as exc:
                traceback.print_exc()
                RESULTS["notes"].append(f"tune {name} failed: {exc!r}")
        # --- timing ---
        for T in tokens:
            cell = dict(shape=name, T=T)
            try:
                sets = [make_inputs(T, H, E, k, seed=1000 + s) for s in range(4)]
                fl, flops = floor_s(T, E, H, I, k, sets[0][1], bw, peak)
                cell.update(floor_s=fl, flops=flops)
                # "fused": the production path (config=None: the shipped JSON, else the heuristics)
                cfgs = {"fused": None}
                if a.with_default:
                    cfgs["fused_default"] = C.default_config(E, H, I, T, k, torch.bfloat16, num_sms=132)
                if tuned_doc is not None:
                    ent = C.lookup({kk: {int(t): C.normalize(v) for t, v in per.items()}
                                    for kk, per in tuned_doc["configs"].items()}, C.shape_key(E, H, I, k), T)  # fmt: skip
                    if ent is not None:
                        cfgs["fused_tuned"] = ent
                cell["configs"] = cfgs
                backends = {}
                for label, cfg in cfgs.items():
                    backends[label] = [
                        (lambda x=x, ids=ids, wts=wts, cfg=cfg: K.fused_experts(x, w1, w2, ids, wts, num_experts=E,
                                                                                config=cfg))  # fmt: skip
                        for x, ids, wts in sets
                    ]
                mod = _Experts(w1, w2, E)
                if T <= 64:  # the same call through the torch custom op (what torch.compile sees)
                    backends["fused_viaop"] = [
                        (lambda x=x, ids=ids, wts=wts: torch.ops.selector.triton_fused_experts(
                            x, w1, w2, ids, wts, E, "silu", True, False, False, None, None, None))
                        for x, ids, wts in sets
                    ]  # fmt: skip
                if "grouped_mm" in pe:
                    backends["grouped_mm"] = [
                        (lambda x=x, ids=ids, wts=wts: pe["grouped_mm"](mod, x, ids, wts)) for x, ids, wts in sets
                    ]
                if "batched_mm" in pe and T * k * 3 * H * I * 2 < 12e9:
                    backends["batched_mm"] = [
                        (lambda x=x, ids=ids, wts=wts: pe["batched_mm"](mod, x, ids, wts)) for x, ids, wts in sets
                    ]
                for label, fns in backends.items():
                    try:
                        cell[f"{label}_eager_s"] = time_eager(fns)
                    except Exception as exc:
                        cell[f"{label}_eager_err"] = repr(exc)[:200]
                    if T <= 64:
                        try:
                            cell[f"{label}_graph_s"] = time_graph(fns)
                        except Exception as exc:
                            cell[f"{label}_graph_err"] = repr(exc)[:200]
                            torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                parts = []
                for label in backends:
                    for mode in ("eager", "graph"):
                        v = cell.get(f"{label}_{mode}_s")
                        if v is not None:
                            parts.append(f"{label}/{mode} {v * 1e6:.0f}us ({v / fl:.2f}x)")
                log(f"time {name} T={T} floor {fl * 1e6:.1f}us: " + "; ".join(parts))
            except Exception as exc:
                traceback.print_exc()
                cell["error"] = repr(exc)[:300]
            RESULTS["cells"].append(cell)
            summary.append(cell)
            save()
        del w1, w2
        torch.cuda.empty_cache()
        log(f"{name} done in {time.perf_counter() - t_shape:.0f}s")

    # --- host overhead: op vs direct, fast launch vs Triton's dispatch; profile of the direct path ---
    try:
        E, H, I, k = GRID["Qwen3-30B-A3B"]
        w1, w2 = make_weights(E, H, I)
        x, ids, wts = make_inputs(1, H, E, k, seed=5)
        f_op = lambda: torch.ops.selector.triton_fused_experts(  # noqa: E731
            x, w1, w2, ids, wts, E, "silu", True, False, False, None, None, None
        )
        f_dir = lambda: K.fused_experts(x, w1, w2, ids, wts, num_experts=E)  # noqa: E731
        host = {}
        for label, f, fast in (("op", f_op, True), ("direct", f_dir, True), ("direct_jit_launch", f_dir, False)):
            K._FAST_LAUNCH = fast
            for _ in range(3):
                f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                f()
            host[label] = (time.perf_counter() - t0) / 300
            torch.cuda.synchronize()
        K._FAST_LAUNCH = True
        RESULTS["host_overhead_s"] = host
        log("host time per call (T=1 Qwen3, no sync): " + ", ".join(f"{kk} {v * 1e6:.1f}us" for kk, v in host.items()))
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            f_dir()
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
        RESULTS["host_profile"] = buf.getvalue()
        log("\n".join(buf.getvalue().splitlines()[:40]))
        del w1, w2
    except Exception:
        traceback.print_exc()
    save()

    # --- short table last ---
    log("\nshape                T      floor       fused fused(tuned)  fused(op)  grouped_mm  batched_mm   [eager | graph] x floor")
    for c in summary:
        fl = c.get("floor_s")
        if not fl:
            log(f"{c['shape']:<20} {c['T']:>6} ERROR {c.get('error', '')[:80]}")
            continue

        def r(label, c=c, fl=fl):
            e, g = c.get(f"{label}_eager_s"), c.get(f"{label}_graph_s")
            s = f"{e / fl:5.2f}" if e else "   - "
            if g:
                s += f"|{g / fl:4.2f}"
            return f"{s:>11}"

        best_f = min([c[kk] for kk in ("fused_eager_s", "fused_tuned_eager_s") if kk in c] or [float("nan")])
        tf = c["flops"] / best_f / 1e12 if best_f == best_f else float("nan")
        log(f"{c['shape']:<20} {c['T']:>6} {fl * 1e6:8.1f}us {r('fused')} {r('fused_tuned')} {r('fused_viaop')} "
            f"{r('grouped_mm')} {r('batched_mm')}   fused {best_f * 1e6:9.1f}us {tf:6.0f} TF/s")  # fmt: skip
    bad = [c for c in RESULTS["checks"] if "error" in c or not c.get("finite") or c.get("rel_err", 1) > 2e-2]
    log(f"checks: {len(RESULTS['checks'])} run, {len(bad)} bad {bad[:3]}")
    save()


if __name__ == "__main__":
    main()
