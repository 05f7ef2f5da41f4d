"""Tune the quantised grouped path's tiles on this GPU and write them as JSON (see configs.py).

    python -m selector.plugins.quant_kernels.tune --out plugins/quant_kernels/configs/NVIDIA_H200.json --budget-s 150

Per (format, shape, token count) and candidate layout (pairs sorted into BLOCK_M blocks, or one block per pair
for a few pairs): times align (unless, as at decode, it rides on x's quantisation: ``quantize_rows(align=)``),
each gate_up tile with x quantised up front (that launch timed with it: it also zeroes a split gate_up's counters)
or, for a few pairs, inside its K loop (plus a second quantisation of the intermediate when the tile does not
cover whole groups) and each down tile with the combine (its own launch, or
the down kernel's COMBINE, less the memset of its counters that the test needs and the layer does not pay: pair
blocks always, sorted blocks of a few pairs per expert both ways; the output's zeroing rides in x's quantisation,
timed with gate_up), and keeps the layout whose sum is smallest. Where the layer would run its projections through
TMA (``ops.use_tma``: sorted blocks of >= 64 rows) the candidates are timed that way: x quantised into block order,
the intermediate in block order. Random e4m3 / e2m1 weights and scales (never zeros), uniform
top-k routing. Cells of up to GRAPH_TIMING_MAX_TOKENS tokens are timed as CUDA-graph replays: the layer replays
recorded graphs at decode and for repeated calls up to that size, and above it its GPU time dwarfs the host's;
timed back to back instead, single launches measured the host at T=512 on the H200 (align alone 35-100 us).
fp8 configs serve both scale formats (a scale load differs, not the tile). Stops at --budget-s and writes what
it has.

``tune_kernels`` (what ``selector tune`` runs for a quantised layer through triton_fused's
``BackendSpec.tune_kernels``) tunes one layer within a budget into this node's user tile table (configs.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton
import triton.testing
from selector.plugins import tile_tables
from selector.plugins.quant_kernels import configs as C
from selector.plugins.quant_kernels import ops
from selector.plugins.triton_common.align import run_align

SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4),
}  # (E, H, I, k)
TOKENS = (1, 8, 64, 512, 4096)
TRY_DECODE_LAYOUTS_MAX_PAIRS = 64  # pair blocks and x quantised in the K loop are tried up to here (T=8, k=8)
TRY_QUANT_X_LOOP = False
TRY_COMBINE_IN_KERNEL_PER_EXPERT = 4  # sorted blocks: the down kernel's own combine timed up to these pairs per expert
GRAPH_TIMING_MAX_TOKENS = 4096  # above: back to back (Qwen3 T=512 on the H200: 225 us as graphs, 425-491 back to back)
# (BLOCK_N, num_warps, num_stages); gate_up's BLOCK_N counts intermediate channels (2 x that many weight rows)
# (ptxas for sm_90: gated BLOCK_M 64 x 128 spills with 4 warps, BLOCK_M 128 spills above 64 channels)
# gate_up: (BLOCK_N, num_warps, num_stages[, SPLIT_K]); a split gate_up is finished by its last share in the kernel
GATE_UP = {
    16: (
        (32, 4, 4),
        (64, 4, 4),
        (128, 4, 3),
        (128, 4, 4),
        (128, 8, 4),
        (64, 4, 6),
        (16, 2, 4),
        (32, 2, 4),
        (32, 4, 6),
        (32, 4, 4, 2),
        (64, 4, 4, 2),
        (64, 4, 6, 2),
        (128, 4, 4, 2),
        (64, 4, 4, 4),
        (128, 4, 3, 4),
        (128, 4, 4, 4),
        (128, 8, 4, 2),
        (128, 8, 3, 4),
        (128, 8, 3, 8),
        (64, 4, 3, 8),
    ),
    32: ((32, 4, 4), (64, 4, 4), (128, 8, 3), (128, 8, 4)),
    64: ((64, 4, 4), (64, 4, 3), (128, 8, 3), (128, 8, 4), (64, 8, 4)),
    128: ((64, 8, 3), (64, 8, 4), (32, 4, 4), (128, 8, 3)),
}
# down: (BLOCK_N, num_warps, num_stages[, SPLIT_K]); K split in shares only where the K loop is long (>= 32 steps),
# or with pair blocks (no combine launch to pay for it) where each share keeps >= 3 steps
DOWN = {
    "small": (
        (32, 4, 4),
        (64, 4, 4),
        (128, 4, 3),
        (128, 4, 4),
        (128, 8, 4),
        (256, 8, 3),
        (32, 4, 4, 4),
        (64, 4, 4, 2),
        (64, 4, 4, 4),
        (64, 4, 4, 8),
        (128, 4, 4, 2),
        (128, 4, 4, 4),
    ),
    "large": ((64, 4, 4), (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 3)),
}
# 16-row blocks also with swapped tiles (SWAP, kernels._mma: weights on the MMA's M side, on sm_90 a native fp8
# wgmma instead of an mma.sync on operands widened to f16): (BLOCK_N, num_warps, num_stages, SPLIT_K, 1)
SWAPPED = {
    "gate_up": (
        (64, 4, 4, 1, 1),
        (128, 4, 3, 1, 1),
        (128, 4, 4, 1, 1),
        (128, 8, 3, 1, 1),
        (128, 4, 3, 2, 1),
        (128, 4, 3, 4, 1),
        (64, 4, 4, 2, 1),
    ),
    "down": (
        (64, 4, 4, 1, 1),
        (128, 4, 3, 1, 1),
        (128, 4, 4, 1, 1),
        (128, 8, 3, 1, 1),
        (128, 4, 4, 2, 1),
        (64, 4, 4, 2, 1),
    ),
}
SPLIT_MIN_STEPS = 32


def block_m_candidates(pairs: int, num_experts: int) -> tuple[int, ...]:
    per_expert = pairs / max(1, min(num_experts, pairs))
    if per_expert <= 2:
        return (16, 64)  # 64: the Hopper fp8 tensor-core instruction; 16: the emulated (f16) mma
    if per_expert <= 24:
        return (16, 32, 64)
    if per_expert <= 96:
        return (32, 64, 128)
    return (64, 128)


def _weights(e: int, n: int, k: int, fp4: bool, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(n * 7 + k)
    if fp4:
        w = torch.randint(-128, 128, (e, n, k // 2), dtype=torch.int8, device=dev, generator=g)
        s = torch.randint(118, 124, (e, n, triton.cdiv(k, 32)), dtype=torch.uint8, device=dev, generator=g)
        return w, s
    w = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=dev)
    for j in range(e):  # expert by expert: no [E, N, K] fp32 temporary
        w[j] = (torch.randn(n, k, device=dev, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(e, triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev, generator=g) * 1e-4 + 1e-4
    return w, s


def _zero(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None:
            t.zero_()


def _time(fn, graph: bool) -> float:
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=15, return_mode="median")) * 1e-3
    return float(triton.testing.do_bench(fn, warmup=3, rep=12, return_mode="median")) * 1e-3


def tune_cell(w1, s1, w2, s2, fp4: bool, tokens: int, top_k: int, deadline: float, log=print) -> dict | None:
    e, _, h = w1.shape
    inter = w2.shape[2] * (2 if fp4 else 1)
    dev = w1.device
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(tokens, e, device=dev).topk(top_k, dim=1).indices.reshape(-1).contiguous()
    wts = torch.rand(ids.numel(), device=dev)
    out = torch.empty(tokens, h, device=dev, dtype=torch.bfloat16)
    pairs, graph = ids.numel(), tokens <= GRAPH_TIMING_MAX_TOKENS
    fmt = ops.WeightFormat(e, fp4, fp4, 1 if fp4 else 128, 128)
    up_proj = ops.Projection(ops.QuantWeights(w1, s1), fmt, ops.Epilogue(True, False, "silu", None if fp4 else inter))
    down_proj = ops.Projection(ops.QuantWeights(w2, s2), fmt)
    bf16 = torch.bfloat16
    t_qx = _time(lambda: ops.quantize_rows(x, 128), graph)
    # counters of a split gate_up's tiles or of the down's (token, N tile): more than any candidate needs
    counts = torch.zeros((pairs + e + tokens) * triton.cdiv(max(h, inter), 16), dtype=torch.int32, device=dev)
    t_zero = _time(counts[: tokens * triton.cdiv(h, 16)].zero_, graph)  # a memset of the down's counters
    ih = torch.randn(pairs, inter, device=dev, dtype=torch.bfloat16)
    iq, isc = ops.quantize_rows(ih, 128)
    t_qi = _time(lambda: ops.quantize_rows(ih, 128), graph)
    best = None
    layouts = [("sorted", bm) for bm in block_m_candidates(pairs, e)]
    if pairs <= TRY_DECODE_LAYOUTS_MAX_PAIRS:
        layouts.insert(0, ("pairs", 16))
    # x quantised in the K loop lost every decode cell on the H200: tried only with --try-quant-x-loop
    quant_x = ("once", "loop") if TRY_QUANT_X_LOOP and pairs <= TRY_DECODE_LAYOUTS_MAX_PAIRS else ("once",)
    for route, bm in layouts:
        if time.perf_counter() > deadline:
            break
        rcfg = {"BLOCK_M": bm, "ROUTE": route}
        routing, plan = ops.route_deferred("grouped", ids, e, rcfg)
        if plan is not None:
            run_align(plan)  # the candidates below read the routing
        size = "small" if bm <= 32 else "large"
        tma = ops.use_tma(routing, fp4, dev, w1, w2)  # every candidate tile is within TMA's 256 rows
        # as the layer does: a one-program align rides on x's quantisation (timed with gate_up, which includes it)
        ride = plan if plan is not None and plan.single and not tma else None
        # pair blocks launch nothing to route (host only: an empty graph cannot be timed)
        t_align = 0.0 if route == "pairs" or ride else _time(lambda: ops.route("grouped", ids, e, rcfg), graph)
        if tma:  # the down GEMM reads the intermediate in block order
            iq_in, isc_in = ops.quantize_rows(
                torch.randn(routing[0].numel(), inter, device=dev, dtype=torch.bfloat16), 128, slots=routing
            )
        else:
            iq_in, isc_in = iq, isc
        parts = {}
        # where the down kernel may add the slots itself: both ways timed for sorted blocks of a few rows
        if route == "pairs" or tma:
            combines = ("kernel",) if route == "pairs" else ("launch",)
        elif pairs <= TRY_COMBINE_IN_KERNEL_PER_EXPERT * e:
            combines = ("kernel", "launch")
        else:
            combines = ("launch",)
        for part, options in (("gate_up", GATE_UP[bm]), ("down", DOWN[size])):
            variants = quant_x if part == "gate_up" else combines
            options = options + (SWAPPED[part] if bm == 16 else ())
            # qx: where x is quantised (gate_up), or where the slots are added (down)
            for option, qx in itertools.product(options, variants):
                if time.perf_counter() > deadline:  # what was timed so far still counts
                    break
                bn, warps, stages = option[:3]
                split, swap = (option[3] if len(option) > 3 else 1), (option[4] if len(option) > 4 else 0)
                cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "GROUP_M": 1 if bm <= 32 else 8}
                if swap:
                    cfg["SWAP"] = 1
                if part == "down":
                    # a kernel that combines needs no launch to add the shares: shares of >= 3 steps there
                    min_steps = 3 * split if split > 1 and qx == "kernel" else SPLIT_MIN_STEPS
                    if split > 1 and triton.cdiv(inter, 128) < min_steps:
                        continue
                    cfg["SPLIT_K"] = split
                elif split > 1:
                    # each share keeps >= 4 K steps, or 2 with one-row blocks (their shares add real rows only)
                    if qx != "once" or triton.cdiv(h, 128) < (2 if route == "pairs" else 4) * split:
                        continue
                    cfg["SPLIT_K"] = split
                if part == "gate_up":
                    qo = bn % 128 == 0
                    up = lambda a, a_s, c: ops.run_projection(  # noqa: E731
                        "grouped",
                        up_proj,
                        ops.Activations(a, a_s, top_k, tma),
                        routing,
                        pairs,
                        config=cfg,
                        dest=ops.Output(bf16, qo, tma, counts=c),
                    )
                    # as the layer does: x's quantisation also zeroes a split gate_up's counters and, where the down
                    # kernel combines, its counters and the output (with QUANT_X "loop", memsets do)
                    fused = "kernel" in combines
                    n_counts = (routing[1].numel() * triton.cdiv(inter, bn) if split > 1 else 0) + (
                        tokens * triton.cdiv(h, 16) if fused else 0
                    )
                    c = counts[:n_counts] if n_counts else None
                    zero = out if fused else None
                    if tma and qx != "once":  # x quantised in the K loop never runs with TMA
                        continue
                    if tma:
                        fn = lambda: up(*ops.quantize_rows(x, 128, counts=c, slots=routing, a_div=top_k), c)
                    elif qx == "once":
                        fn = lambda: up(*ops.quantize_rows(x, 128, zero=zero, counts=c, align=ride), c)
                    else:  # no quantisation launch for a riding align (t_align is 0 then): its own launch, here
                        fn = lambda: (_zero(c, zero), ride is not None and run_align(ride), up(x, None, c))
                    extra = 0.0 if qo else t_qi
                elif qx == "kernel":  # the kernel combines; its counters zeroed here
                    c = counts[: tokens * triton.cdiv(h, bn)]
                    fn = lambda: ops.run_projection(  # noqa: E731
                        "grouped",
                        down_proj,
                        ops.Activations(iq, isc),
                        routing,
                        pairs,
                        topk_w=wts,
                        config=cfg,
                        dest=ops.Output(bf16, combine=(out, ids, top_k), counts=c.zero_()),
                    )
                    extra = -t_zero  # the layer's x quantisation zeroes them, no launch of their own
                else:
                    # with the combine: a split down hands it shares x pairs x H fp32 partial sums to add
                    src = ops.Activations(iq_in, isc_in, 1, tma)
                    fn = lambda: ops.combine_slots(  # noqa: E731
                        ops.run_projection(
                            "grouped", down_proj, src, routing, pairs, topk_w=wts, config=cfg, dest=ops.Output(bf16)
                        ),
                        ids,
                        out,
                        top_k,
                        e,
                    )
                    extra = 0.0
                try:
                    t = _time(fn, graph) + extra
                except Exception as exc:  # resources: a tile this GPU cannot run
                    log(f"    skip {route} BM={bm} {part} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                if part not in parts or t < parts[part][0]:
                    parts[part] = (t, {**cfg, "QUANT_X" if part == "gate_up" else "COMBINE": qx})
        if len(parts) < 2:
            continue
        up_t, up_cfg = parts["gate_up"]
        up_cfg, down_cfg = dict(up_cfg), dict(parts["down"][1])
        qx, combine = up_cfg.pop("QUANT_X"), down_cfg.pop("COMBINE")
        total = t_align + up_t + parts["down"][0]
        name = f"{route} BM={bm}{' TMA' if tma else ''}"
        aligned = "with x's quantisation" if ride else f"{t_align * 1e6:.1f}"
        log(
            f"  T={tokens} {name}: {total * 1e6:.1f}us (align {aligned}, x quantised {qx} "
            f"[{t_qx * 1e6:.1f} us up front], gate_up {up_t * 1e6:.1f} {up_cfg}, down {parts['down'][0] * 1e6:.1f} "
            f"{down_cfg}, combine {combine})"
        )
        if best is None or total < best["time_s"]:
            config = {
                "BLOCK_M": bm,
                "ROUTE": route,
                "QUANT_X": qx,
                "COMBINE": combine,
                "gate_up": up_cfg,
                "down": down_cfg,
            }
            best = {"config": config, "time_s": total}
    return best


def tune(
    shapes: dict, tokens: tuple[int, ...], formats: tuple[str, ...], out: Path, budget_s: float, log=print
) -> dict:
    """Token counts outer, shapes inner (every shape's weights resident): a budget cut leaves no shape untuned."""
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    doc = {"version": 1, "device": name, "configs": {}, "timings_us": {}}
    if out.exists():
        old = json.loads(out.read_text())
        if old.get("device") == name:
            doc["configs"].update(old.get("configs", {}))
    for fmt in formats:
        fp4 = fmt == "fp4"
        weights = {}
        for shape, (e, h, i, k) in shapes.items():
            weights[shape] = (*_weights(e, 2 * i, h, fp4, dev), *_weights(e, h, i, fp4, dev))
        for t in tokens:
            for shape, (e, h, i, k) in shapes.items():
                if time.perf_counter() > deadline:
                    break
                key = C.shape_key(fp4, e, h, i, k)
                log(f"{key} ({shape}) T={t}")
                best = tune_cell(*weights[shape], fp4, t, k, deadline, log)
                if best is not None:
                    doc["configs"].setdefault(key, {})[str(t)] = best["config"]
                    doc["timings_us"].setdefault(key, {})[str(t)] = round(best["time_s"] * 1e6, 1)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")  # what we have so far
        del weights
        torch.cuda.empty_cache()
    doc["tuned_seconds"] = round(time.perf_counter() - t0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    C.clear_caches()
    return doc


# --- tune_kernels: one layer within a budget (selector tune) ----------------------------------------------------

FORMATS = {"fp8_block": False, "fp4": True}  # weight format -> fp4
START_MARGIN_S = 2.0  # no candidate starts later than this before its share ends: a compile and its timing
NEEDS_CUDA = (
    "quant_kernels tune: needs a CUDA GPU and none is visible (it times the kernels on the GPU the "
    "tiles are for); run it on that GPU's node"
)


def _order(token_counts: Iterable[int]) -> list[int]:
    """Largest first: there tiles matter most; a budget cut leaves the small (weight-bound) ones on defaults."""
    return sorted({int(t) for t in token_counts if int(t) >= 1}, reverse=True)


def _weight(tokens: int) -> float:
    return 3.0 if tokens >= 512 else 1.0 if tokens >= 64 else 0.5


def tune_kernels(
    problem: Any,
    token_counts: Sequence[int] = TOKENS,
    budget_s: float = 60.0,
    *,
    force: bool = False,
    cell: Callable[[int, float], dict | None] | None = None,
    device_name: str | None = None,
    directory: str | Path | None = None,
    log: Callable[..., None] = lambda *a: None,
) -> dict[str, Any]:
    """Tune one quantised layer's grouped tiles at these token counts within `budget_s` seconds and merge them
    into the user tile table, where the layer finds them first.

    Shapes the shipped table has and token counts already tuned are skipped unless `force`. Token counts go
    largest first, each with a weighted share of the budget left (what one leaves goes to the next); one cut
    short keeps its best tiles so far ("tokens_partial", tuned again next time), one never reached gets the
    heuristics ("tokens_default"). `cell(tokens, deadline)`, `device_name` and `directory` replace the GPU
    search of one token count, the GPU's name and the table's folder (tests). Returns a summary like
    triton_fused's `tune_kernels`.
    """
    start = time.perf_counter()
    e, h, i, k = problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k
    fp4 = FORMATS.get(problem.weight_format)
    key = C.shape_key(bool(fp4), e, h, i, k)
    summary = tile_tables.tuning_summary(key, device_name, budget_s, kernels="quant_kernels")
    if fp4 is None:
        summary["skipped"] = f"weight format {problem.weight_format!r} has no quantised tiles (fp8_block, fp4 do)"
        return summary
    if cell is None and not torch.cuda.is_available():
        raise RuntimeError(NEEDS_CUDA)
    dev = torch.device("cuda", getattr(problem, "device_index", 0))
    name = device_name or torch.cuda.get_device_name(dev)
    summary["device"] = name
    shipped = C.load_table(name).get(key, {})
    if shipped and not force:
        summary["skipped"] = f"the shipped tile table for {name} has {key} (force=True tunes it again)"
        return summary
    done = set() if force else tile_tables.tuned_tokens(C.user_table_file(name, directory), key)
    todo = [t for t in _order(token_counts) if t not in done]
    if not todo:
        summary["skipped"] = f"the user tile table already holds tuned tiles for {key} at every token count asked"
        return summary
    if cell is None:
        weights = (*_weights(e, 2 * i, h, fp4, dev), *_weights(e, h, i, fp4, dev))
        cell = lambda t, deadline: tune_cell(*weights, fp4, t, k, deadline, log)  # noqa: E731
    deadline = start + max(0.0, budget_s)
    existing = C.load_user_table(name, str(directory) if directory else None).get(key, {})
    entries: dict[int, dict] = {}
    for n, t in enumerate(todo):
        now = time.perf_counter()
        share_end = now + (deadline - now) * _weight(t) / sum(_weight(u) for u in todo[n:])
        best = cell(t, share_end - START_MARGIN_S) if share_end - START_MARGIN_S > now else None
        cut = time.perf_counter() > share_end - START_MARGIN_S
        summary["cut_short"] |= cut
        if best is not None:
            entries[t] = C.normalize(best["config"])
            summary["tokens_partial" if cut else "tokens_tuned"].append(t)
            summary["time_us"][t] = round(best["time_s"] * 1e6, 2)
        else:
            summary["tokens_default"].append(t)
            if t not in existing:  # what would run without the user table
                entries[t] = C.lookup({key: shipped}, key, t) if shipped else C.normalize(None)
        if t in entries:
            summary["configs"][t] = entries[t]
    if summary["tokens_tuned"] or summary["tokens_partial"]:
        path = C.write_user_entries(name, key, entries, summary["tokens_tuned"], directory)
        summary["written_to"] = str(path)
    summary["seconds"] = round(time.perf_counter() - start, 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Exit 0 after writing the table, 1 when it cannot run here (one line; --debug: the traceback), 2 on bad flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--formats", default="fp8,fp4")
    p.add_argument("--budget-s", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--try-quant-x-loop", action="store_true", help="also time x quantised in gate_up's K loop")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    a = p.parse_args(argv)
    unknown = [s for s in a.shapes.split(",") if s and s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    try:
        tokens = tuple(int(t) for t in a.tokens.split(","))
    except ValueError:
        p.error(f"--tokens takes a comma list of integers, got {a.tokens!r}")
    global TRY_QUANT_X_LOOP
    TRY_QUANT_X_LOOP = a.try_quant_x_loop
    shapes = {s: SHAPES[s] for s in a.shapes.split(",") if s}

    def write() -> str | Path:
        out = a.out or C.table_file(torch.cuda.get_device_name())
        tune(shapes, tokens, tuple(a.formats.split(",")), out, a.budget_s)
        return out

    return tile_tables.run_tuner("quant_kernels", "the kernels", torch.cuda.is_available(), a.debug, write)


if __name__ == "__main__":
    raise SystemExit(main())
