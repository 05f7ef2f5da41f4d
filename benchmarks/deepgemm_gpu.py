"""DeepGEMM on the GPU through the `kernels` local-kernel path: check the `deepgemm` backend, time it.

What it does, in one process:
1. Adds the unpacked folder of benchmarks/fetch_deepgemm.sh (sgl-deep-gemm 0.1.5.post3 + apache-tvm-ffi) to
   the path, makes sure the CUDA 13 libraries its `_C.so` links are loaded (torch loads most; NVRTC is found in
   torch's NVIDIA wheels or CUDA_HOME), builds a local kernel directory `<out>/kernel/deep-gemm/build/torch-cuda/`
   holding that `deep_gemm` package, and points LOCAL_KERNELS at it (HF_HUB_OFFLINE=1), so selector's
   `deepgemm` backend loads it with `kernels.get_kernel("kernels-community/deep-gemm", version=2)`.
2. Prints selector's verdict for `deepgemm` on this machine (GPU, nvcc found by the search order, kernel location).
3. For each (shape, format, T) cell, in priority order under --budget-s: runs the layer through selector's model
   API with `deepgemm` requested, times the first call (DeepGEMM's nvcc JIT), checks the output against a
   float64 reference (dense: from the weights; FP8: from the dequantised weights with activations quantised as
   the kernels do), then times deepgemm, grouped_mm and (dense) triton_fused back to back against the floor.
   JSON is rewritten after every cell.

Prints a short table last; writes <out>/deepgemm_gpu.json.

    mkdir -p /tmp/dg && tar -xJf .carry/deepgemm.tar.xz -C /tmp/dg &&
    python3 benchmarks/deepgemm_gpu.py --site /tmp/dg/site --out "$OUT"
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import site
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIN_REPO = "kernels-community/deep-gemm"
# (preset, format, scale format, T) in priority order: the Hopper FP8 path first, since that is what DeepGEMM is for
CELLS = [
    ("qwen3-30b-a3b", "fp8_block", "float32", 4096),
    ("qwen3-30b-a3b", "dense", None, 4096),
    ("qwen3-30b-a3b", "fp8_block", "float32", 64),
    ("qwen3-30b-a3b", "fp8_block", "ue8m0", 4096),
    ("qwen3-30b-a3b", "dense", None, 64),
    ("qwen3-30b-a3b", "fp8_block", "float32", 1),
    ("deepseek-v3", "fp8_block", "float32", 4096),
    ("deepseek-v3", "fp8_block", "float32", 64),
    ("qwen3-30b-a3b", "fp8_block", "float32", 16384),
    ("deepseek-v3", "dense", None, 4096),
]


def build_kernel_dir(package: Path, dest: Path, variant: str = "torch-cuda") -> Path:
    """<dest>/build/<variant>/ = the deep_gemm package (linked) + metadata.json; returns dest."""
    from selector.hub import write_local_kernel

    target = write_local_kernel(dest, "deep-gemm", "MIT", variant)
    for entry in package.iterdir():
        link = target / entry.name
        if not link.exists():
            link.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return dest


def preload_cuda_libs() -> dict[str, str]:
    """Load (RTLD_GLOBAL) the CUDA 13 libraries deep_gemm/_C.so links, so its NEEDED entries resolve by soname.
    Call after `import torch`, which has loaded its own copies of most of them already."""
    found: dict[str, str] = {}
    dirs = [Path(p) / "nvidia" / sub / "lib" for p in sys.path if p for sub in ("cu13", "cuda_nvrtc", "cuda_runtime",
                                                                           "cublas")]
    dirs.append(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64")
    for lib in ("libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13", "libnvrtc.so.13"):
        for candidate in [lib, *(str(d / lib) for d in dirs if (d / lib).exists())]:
            try:
                ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
                found[lib] = candidate
                break
            except OSError:
                continue
        else:
            found[lib] = "NOT FOUND"
    return found


def _say(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", type=Path, required=True, help="unpacked folder from fetch_deepgemm.sh")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "deepgemm_out")))
    parser.add_argument("--package", type=Path, help="folder holding the deep_gemm package (default: --site)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no new cell past this many seconds")
    parser.add_argument("--smoke", action="store_true", help="one small dense cell only: does this build run here?")
    parser.add_argument("--profile", action="store_true", help="profile a few cells: where does the time go?")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    elapsed = lambda: time.perf_counter() - start  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"cells": [], "notes": []}
    json_path = args.out / "deepgemm_gpu.json"

    def save() -> None:
        report["elapsed_s"] = elapsed()
        json_path.write_text(json.dumps(report, indent=2, default=str))

    site.addsitedir(str(args.site))  # tvm_ffi (deep_gemm itself is loaded from the kernel directory)
    sys.path.insert(0, str(REPO))
    package = (args.package or args.site) / "deep_gemm"
    report["package"] = f"{package} (version {(package / 'VERSION').read_text().strip() if (package / 'VERSION').exists() else '?'})"
    kernel_dir = build_kernel_dir(package, args.out / "kernel" / "deep-gemm")
    os.environ["LOCAL_KERNELS"] = f"{PIN_REPO}={kernel_dir}"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(args.out / "jit-cache"))

    import torch

    report["cuda_libs"] = preload_cuda_libs()
    _say(f"CUDA libraries for deep_gemm/_C.so: {report['cuda_libs']}")

    import selector.plugins.deepgemm
    import selector.plugins.grouped_mm
    import selector.plugins.triton_fused
    import selector
    from selector.probes import collect_environment
    from selector.bench import calls_for, make_layer, measure_ceilings, random_routing, reference_rows
    from selector.bench import time_back_to_back, time_first_call
    from selector.environment import current_environment, set_environment
    from selector.presets import preset
    from selector.quant import quantize_experts, reference_forward
    from selector.registry import get_registry, register_plugin
    from selector.requirements import evaluate

    for plugin in (selector.plugins.deepgemm, selector.plugins.grouped_mm, selector.plugins.triton_fused):
        register_plugin(plugin, name=plugin.__name__.split(".")[-1])
    env = collect_environment(packages=("torch", "kernels", "triton", "huggingface-hub", "pluggy"))
    set_environment(env)
    report["toolkit"] = {"nvcc": env.toolkit.nvcc_version, "root": env.toolkit.root, "found_by": env.toolkit.found_by}
    device = torch.device("cuda")
    _say(f"device: {torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()}; torch {torch.__version__}; "
         f"nvcc {env.toolkit.nvcc_version} at {env.toolkit.root} (found by {env.toolkit.found_by})")
    registry = get_registry()
    base = preset("qwen3-30b-a3b")
    problem = selector.Problem(**{**base.to_dict(), "dtype": "bfloat16", "device": "cuda"})
    verdict = evaluate(registry.get("deepgemm"), problem.with_tokens(64), current_environment())
    _say(f"selector verdict for deepgemm: {verdict.status.value}: {verdict.reason} | found: {verdict.found}")
    report["verdict"] = verdict.to_dict()

    t0 = time.perf_counter()
    try:
        from selector.plugins.deepgemm.forward import load_deepgemm

        dg = load_deepgemm()
        report["kernel_module"] = f"{dg.module.__name__} from {getattr(dg.module, '__file__', '?')}"
        report["alignment"] = dg.alignment
        _say(f"loaded {report['kernel_module']} in {time.perf_counter() - t0:.1f} s; M alignment {dg.alignment}")
    except Exception as exc:
        report["kernel_error"] = f"{type(exc).__name__}: {exc}"
        _say(f"DeepGEMM did not load: {report['kernel_error']}")
        traceback.print_exc()
        save()
        return 1

    ceilings = measure_ceilings(torch, device)
    report["ceilings"] = ceilings
    _say(f"ceilings: {ceilings['bandwidth_Bps'] / 1e12:.2f} TB/s, {ceilings['bf16_flops'] / 1e12:.0f} TFLOP/s")
    os.environ["SELECTOR_VALIDATE"] = "shapes"  # time the layer, not the value checks
    grouped = registry.get("grouped_mm").load()
    fused = registry.get("triton_fused").load()
    layers: dict[tuple, torch.nn.Module] = {}

    def layer_for(name: str, fmt: str, scale_fmt: str | None) -> torch.nn.Module:
        key = (name, fmt, scale_fmt)
        if key not in layers:
            for old in [k for k in layers if k[0] != name]:  # one shape's layers at a time (DeepSeek is 22 GB)
                del layers[old]
            torch.cuda.empty_cache()
            p = preset(name)
            layer = make_layer(torch, selector.Problem(**{**p.to_dict(), "dtype": "bfloat16", "device": "cuda"}),
                               torch.bfloat16, device, seed=0)
            if fmt != "dense":
                quantize_experts(layer, fmt, scale_fmt)
            selector.set_experts_implementation(layer, "deepgemm")
            layers[key] = layer
        return layers[key]

    def run_cell(name: str, fmt: str, scale_fmt: str | None, t: int) -> dict:
        p = preset(name)
        e, h, i, k = p.num_experts, p.hidden_size, p.intermediate_size, p.top_k
        layer = layer_for(name, fmt, scale_fmt)
        index, weights = random_routing(torch, t, e, k, device, seed=t)
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        row: dict = {"shape": name, "format": fmt if fmt == "dense" else f"{fmt}/{scale_fmt}", "T": t}
        out, row["first_call_s"] = time_first_call(torch, lambda: layer(x, index, weights))
        row["backend_ran"] = selector.last_backend(layer)
        sample = min(t, 16)
        if fmt == "dense":
            ref = reference_rows(torch, layer, x, index, weights, sample)
        else:
            ref = reference_forward(layer, x[:sample], index[:sample], weights[:sample], device=device).double()
        row["rel_err"] = float((out[:sample].double() - ref).norm() / ref.norm().clamp_min(1e-30))
        peer = grouped(layer, x, index, weights)
        row["rel_err_grouped_mm"] = float((peer[:sample].double() - ref).norm() / ref.norm().clamp_min(1e-30))
        hits = int(index.unique().numel())
        weight_bytes = 3 * h * i * (2 if fmt == "dense" else 1)  # FP8: 1 byte per weight (scales are ~0.01%)
        moved = hits * weight_bytes + 2 * t * h * 2
        flops = 2.0 * t * k * 3 * h * i
        row["floor_s"] = floor = max(moved / ceilings["bandwidth_Bps"], flops / ceilings["bf16_flops"])
        runs = [("deepgemm", lambda: layer(x, index, weights)), ("grouped_mm", lambda: grouped(layer, x, index, weights))]
        if fmt == "dense":
            runs.append(("triton_fused", lambda: fused(layer, x, index, weights)))
        for label, fn in runs:
            probe = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            row[f"{label}_s"] = time_back_to_back(torch, fn, calls_for(time.perf_counter() - probe))
            row[f"{label}_x_floor"] = row[f"{label}_s"] / floor
            row[f"{label}_tflops"] = flops / row[f"{label}_s"] / 1e12
        return row

    if args.profile:
        with torch.no_grad():
            for name, fmt, scale_fmt, t in [("qwen3-30b-a3b", "fp8_block", "float32", 1),
                                            ("qwen3-30b-a3b", "fp8_block", "float32", 4096),
                                            ("qwen3-30b-a3b", "dense", None, 4096)]:
                p = preset(name)
                layer = layer_for(name, fmt, scale_fmt)
                index, weights = random_routing(torch, t, p.num_experts, p.top_k, device, seed=t)
                x = torch.randn(t, p.hidden_size, device=device, dtype=torch.bfloat16)
                for _ in range(3):
                    layer(x, index, weights)
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        layer(x, index, weights)
                    torch.cuda.synchronize()
                _say(f"=== profile {name} {fmt}/{scale_fmt} T={t} (10 calls)")
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
                _say(table)
                _say(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=60))
        return 0
    cells = [("qwen3-30b-a3b", "dense", None, 64)] if args.smoke else CELLS
    with torch.no_grad():
        for name, fmt, scale_fmt, t in cells:
            if elapsed() > args.budget_s and report["cells"]:
                report["notes"].append(f"{name} {fmt}/{scale_fmt} T={t} skipped: past the {args.budget_s:.0f} s budget")
                continue
            try:
                row = run_cell(name, fmt, scale_fmt, t)
            except Exception as exc:
                row = {"shape": name, "format": f"{fmt}/{scale_fmt}", "T": t, "error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            report["cells"].append(row)
            _say(json.dumps(row))
            save()

    _say("")
    _say(f"DeepGEMM {report['package']} via the kernels local path, {torch.cuda.get_device_name()} ({elapsed():.0f} s)")
    _say("| shape | format | T | first call | deepgemm | x floor | grouped_mm | triton_fused | err deepgemm | err grouped |")
    _say("|---|---|---|---|---|---|---|---|---|---|")
    us = lambda s: f"{s * 1e6:.0f} us" if s else "-"  # noqa: E731
    for r in report["cells"]:
        if "error" in r:
            _say(f"| {r['shape']} | {r['format']} | {r['T']} | error: {r['error'][:100]} |")
            continue
        _say(f"| {r['shape']} | {r['format']} | {r['T']} | {r['first_call_s']:.1f} s | {us(r['deepgemm_s'])} "
             f"| {r['deepgemm_x_floor']:.2f} | {us(r['grouped_mm_s'])} | {us(r.get('triton_fused_s'))} "
             f"| {r['rel_err']:.1e} | {r['rel_err_grouped_mm']:.1e} |")
    # FP8: the adapter rounds gate/up to bf16 before the activation, the reference does not, and the intermediate's
    # e4m3 rounding then lands elsewhere for some elements: ~1.6e-2 (benchmarks/fp8_intermediate_rounding.py).
    bound = {"dense": 2e-2}
    ok = bool(report["cells"]) and all("error" not in r and r["rel_err"] < bound.get(r["format"], 2.5e-2)
                                       for r in report["cells"])
    _say("CHECK " + ("PASSED" if ok else "FAILED") + ": deepgemm vs float64 reference (bf16 < 2e-2, fp8 < 2.5e-2)")
    report["check_passed"] = ok
    save()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
