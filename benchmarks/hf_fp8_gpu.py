"""Transformers' own FP8 experts (5.17: `fp8_batched_mm_experts_forward` / `fp8_grouped_mm_experts_forward`) beside
selector's FP8 path, on the same weights, in one run on one GPU (issue 5's "compare with them if you can bring them").

Transformers loads those experts' Triton kernels from the kernels hub (`kernels-community/finegrained-fp8`), which
the GPU machine cannot reach. This script takes a copy of that kernel's source from a directory (--kernel-dir,
holding the `finegrained_fp8` package; not part of this repository) and hands it to Transformers the way its loader
would (the module global `_FINEGRAINED_FP8`), then times, per shape and token count:
- `hf-grouped` / `hf-batched`: Transformers' functions on a Transformers `FP8Experts` module whose tensors are the
  quantised layer's own (fp8 e4m3, 128x128 float32 block scales: Transformers' default scale format);
- `selector`: selector's `triton_fused` backend on that quantised layer;
both checked against the float64 reference from the dequantised weights (`selector.quant.reference_forward`, first
8 tokens) and timed back to back ("eager") and, up to 64 tokens, as CUDA-graph replays ("graph"), with the same
timers and floor as `quant_gpu.py`. The kernel autotunes on first use of each shape (its batched kernel per token
count too): every cell is warmed up before it is timed.

    python benchmarks/hf_fp8_gpu.py --kernel-dir DIR --out $OUT [--shapes qwen3-30b-a3b,deepseek-v3] [--tokens 1,64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_gpu as G  # noqa: E402  (also puts the repository on sys.path and sets SELECTOR_VALIDATE)
import torch  # noqa: E402

from selector import quant as Q  # noqa: E402

CHECK_ROWS = 8
BATCHED_MAX_PAIRS = 512  # one pair per program reads its expert's weights: decode only (as quant_gpu.py)


def install_kernel(kernel_dir: Path):  # noqa: ANN201
    """Import the kernel's package from kernel_dir and make Transformers use it, as its hub loader would."""
    sys.path.insert(0, str(kernel_dir))
    import finegrained_fp8 as kernel
    from transformers.integrations import finegrained_fp8 as hf

    hf._FINEGRAINED_FP8 = hf.FineGrainedFP8(
        matmul=kernel.matmul_2d, batched_matmul=kernel.matmul_batched, grouped_matmul=kernel.matmul_grouped
    )
    return hf


def hf_experts(hf, layer: torch.nn.Module, h: int, i: int):  # noqa: ANN001, ANN201
    """A Transformers FP8Experts module holding the quantised layer's tensors (built small, then given them)."""
    config = SimpleNamespace(hidden_size=128, num_experts=1, moe_intermediate_size=128, hidden_act="silu")
    mod = hf.FP8Experts(config, block_size=(128, 128))
    mod.num_experts, mod.hidden_dim, mod.intermediate_dim = layer.num_experts, h, i
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        setattr(mod, name, torch.nn.Parameter(getattr(layer, name).data, requires_grad=False))
    if not hasattr(mod, "_is_expert_parallel"):  # newer Transformers read it in these functions (their loader sets it)
        mod._is_expert_parallel = False
    return mod


def write(cells: list[dict], out: Path | None, ceilings: dict, final: bool = False) -> None:
    """The table (printed when final) and, with --out, the JSON and markdown: after every cell, so a run cut by a
    timeout keeps what it measured."""
    head = ("| shape | T | mode | selector fp8 | Transformers fp8 grouped_mm | Transformers fp8 batched_mm "
            "| best HF / selector |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for key in sorted({(c["shape"], c["tokens"], c["mode"]) for c in cells}, key=lambda x: (x[0], x[2], x[1])):
        got = {c["backend"]: c for c in cells if (c["shape"], c["tokens"], c["mode"]) == key}

        def show(c: dict | None) -> str:
            if not c or "time_s" not in c:
                return "-"
            return f"{G.fmt_time(c['time_s'])} ({c['time_over_floor']:.2f}x, err {c['rel_error']:.1e})"

        hf_best = min((c["time_s"] for n, c in got.items() if n != "selector" and "time_s" in c), default=None)
        mine = got.get("selector", {}).get("time_s")
        ratio = f"{hf_best / mine:.2f}x" if hf_best and mine else "-"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {show(got.get('selector'))} | {show(got.get('hf-grouped'))} "
                     f"| {show(got.get('hf-batched'))} | {ratio} |")  # fmt: skip
    table = "\n".join(lines)
    if final:
        print(table)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        payload = {"schema": "selector.hf_fp8_gpu/1", "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "ceilings": ceilings, "command": " ".join(sys.argv), "complete": final,
                   "cells": cells}  # fmt: skip
        (out / "hf_fp8_gpu.json").write_text(json.dumps(payload, indent=1) + "\n")
        (out / "hf_fp8_gpu.md").write_text(table + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel-dir", type=Path, required=True, help="directory holding the finegrained_fp8 package")
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--tokens", default="1,8,64,512,4096")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("hf_fp8_gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    hf = install_kernel(a.kernel_dir)
    device = torch.device("cuda")
    ceilings = G.measure_ceilings(device)
    deadline = G.Deadline(a.budget_s)
    ours = G.forward_of("triton_fused")
    runners = {"hf-grouped": hf.fp8_grouped_mm_experts_forward, "hf-batched": hf.fp8_batched_mm_experts_forward}
    tokens_list = [int(t) for t in a.tokens.split(",") if t]
    cells: list[dict] = []
    for name in [s for s in a.shapes.split(",") if s]:
        h, i, e, k = G.SHAPES[name]
        built = G.build_layers(name, ["fp8-f32"], max(tokens_list), log)
        layer = built["layers"]["fp8-f32"]
        del built["layers"]["bf16"]
        mod = hf_experts(hf, layer, h, i)
        fns = {"selector": lambda x, idx, w, layer=layer: ours(layer, x, idx, w)}
        fns.update({n: (lambda f, mod=mod: lambda x, idx, w: f(mod, x, idx, w))(f) for n, f in runners.items()})
        for tokens in tokens_list:
            x = built["x"][:tokens]
            index, weights = G.routing(tokens, e, k, device)
            floor, moved, flops = G.floor_of(layer, index, h, i, k, ceilings)
            rows = min(tokens, CHECK_ROWS)
            ref = Q.reference_forward(layer, x[:rows], index[:rows], weights[:rows], device=device)
            for backend, fn in fns.items():
                for mode in ["eager", "graph"] if tokens <= G.GRAPH_MAX_TOKENS else ["eager"]:
                    cell = {"shape": name, "tokens": tokens, "backend": backend, "mode": mode, "floor_s": floor}
                    cells.append(cell)
                    if deadline.left() <= 0:
                        cell["skipped"] = G.BUDGET
                        continue
                    if backend == "hf-batched" and tokens * k > BATCHED_MAX_PAIRS:
                        cell["skipped"] = f"one pair per program: for T x k <= {BATCHED_MAX_PAIRS}"
                        continue
                    try:
                        t0 = time.perf_counter()
                        out = fn(x, index, weights)  # first call: the kernel's autotuning and compiles
                        torch.cuda.synchronize()
                        cell["first_call_s"] = time.perf_counter() - t0
                        cell["rel_error"] = ((out[:rows].double() - ref).norm() / ref.norm()).item()
                        cell["time_s"] = G.timed(lambda fn=fn: fn(x, index, weights), mode)
                        cell["time_over_floor"] = cell["time_s"] / floor
                    except Exception as exc:
                        cell["skipped"] = f"{type(exc).__name__}: {exc}"[:300]
                        traceback.print_exc()
                    log(f"{name} T={tokens} {backend} {mode}: "
                        + (f"{G.fmt_time(cell['time_s'])} ({cell['time_over_floor']:.2f}x floor) err "
                           f"{cell['rel_error']:.1e} (first call {cell['first_call_s']:.1f}s)"
                           if "time_s" in cell else f"skipped ({cell['skipped']})"))  # fmt: skip
                    write(cells, a.out, ceilings)
        del layer, mod, fns, built
        torch.cuda.empty_cache()

    write(cells, a.out, ceilings, final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
