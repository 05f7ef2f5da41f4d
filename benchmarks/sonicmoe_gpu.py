"""SonicMoE on the GPU through the `kernels` local-kernel path: check the `sonicmoe` backend, time it.

What it does, in one process (target: under 3 minutes; SonicMoE's first call of a shape JIT-compiles 25-144 s):
1. `site.addsitedir(--site)`: the unpacked wheel set of benchmarks/fetch_sonicmoe.sh (sonic-moe 0.1.2.post1,
   nvidia-cutlass-dsl 4.4.2 with its .pth, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, einops, kernels).
2. Builds a local kernel directory `<out>/kernel/sonic-moe/build/torch-cuda/` (metadata.json + an __init__.py
   re-exporting the installed `sonicmoe` package's functional API, which is what the hub kernel
   `kernels-community/sonic-moe` exposes) and sets LOCAL_KERNELS to it and HF_HUB_OFFLINE=1, so selector's
   `sonicmoe` backend loads it with `kernels.get_kernel("kernels-community/sonic-moe", version=2)`.
3. Registers the built-in plugins in code (the repo need not be pip-installed there), prints selector's
   verdict for `sonicmoe` on this machine (packages, toolkit, the kernel's location).
4. For the Qwen3-30B-A3B shape (E=128, H=2048, I=768, k=8, bf16) and T in --tokens (1, 64, 4096): runs the
   layer through selector's model API with `sonicmoe` requested, times the first call (the JIT), checks the
   output against a float64 reference on the first 32 tokens and against `grouped_mm`, then times both back
   to back (CUDA events around many calls) against the floor measured in the same run.
5. Checks the token buckets: T=60 right after T=64 (same bucket: no new compile expected), and T=61 with
   padding off (a new token count: ~2 s expected).
6. Runs the same cells through `selector bench` (sonicmoe and grouped_mm, eager mode) into <out>/bench/.

Prints a short table last; writes <out>/sonicmoe_gpu.json.

    mkdir -p /tmp/sonicmoe && tar -xJf .carry/sonicmoe.tar.xz -C /tmp/sonicmoe &&
    python3 benchmarks/sonicmoe_gpu.py --site /tmp/sonicmoe/site --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import site
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIN_REPO = "kernels-community/sonic-moe"

SHIM = '''"""Local kernel for `kernels`: the installed sonic-moe package's functional API, as the hub kernel exposes it."""
import sonicmoe as _package
from sonicmoe import enums
from sonicmoe.functional import moe_general_routing_inputs

__version__ = getattr(_package, "__version__", "unknown")
__all__ = ["enums", "moe_general_routing_inputs"]
'''


def build_kernel_dir(dest: Path, variant: str = "torch-cuda") -> Path:
    """<dest>/build/<variant>/{metadata.json,__init__.py} wrapping the importable `sonicmoe`; returns dest."""
    from selector.hub import write_local_kernel

    target = write_local_kernel(dest, "sonic-moe", "Apache-2.0", variant)
    (target / "__init__.py").write_text(SHIM)
    return dest


def _say(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", type=Path, help="unpacked wheel folder (from fetch_sonicmoe.sh)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "sonicmoe_out")))
    parser.add_argument("--tokens", default="1,64,4096")
    parser.add_argument("--budget-s", type=float, default=170.0, help="skip optional steps past this many seconds")
    parser.add_argument("--no-bench", action="store_true", help="skip the `selector bench` cells at the end")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    elapsed = lambda: time.perf_counter() - start  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"tokens": [], "notes": []}

    if args.site:
        site.addsitedir(str(args.site))  # not PYTHONPATH: cutlass-dsl relies on its .pth file
    sys.path.insert(0, str(REPO))
    kernel_dir = build_kernel_dir(args.out / "kernel" / "sonic-moe")
    os.environ["LOCAL_KERNELS"] = f"{PIN_REPO}={kernel_dir}"
    os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported: no network there anyway

    import torch

    import selector.plugins.eager
    import selector.plugins.grouped_mm
    import selector.plugins.sonicmoe as sonic
    import selector
    from selector.probes import collect_environment
    from selector.bench import calls_for, make_layer, measure_ceilings, random_routing, reference_rows
    from selector.bench import time_back_to_back, time_first_call
    from selector.environment import current_environment
    from selector.presets import preset
    from selector.registry import get_registry, register_plugin
    from selector.requirements import evaluate

    for plugin in (selector.plugins.sonicmoe, selector.plugins.grouped_mm, selector.plugins.eager):
        register_plugin(plugin, name=plugin.__name__.split(".")[-1])
    env = collect_environment(packages=("torch", "kernels", "nvidia-cutlass-dsl", "apache-tvm-ffi", "sonic-moe",
                                        "quack-kernels", "huggingface-hub", "pluggy"))
    from selector.environment import set_environment

    set_environment(env)
    versions = {p.name: p.version for p in env.packages}
    _say(f"packages: {versions}")
    report["packages"] = versions
    device = torch.device("cuda")
    _say(f"device: {torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()}; torch {torch.__version__}")

    problem = selector.Problem(**{**preset("qwen3-30b-a3b").to_dict(), "dtype": "bfloat16", "device": "cuda"})
    registry = get_registry()
    verdict = evaluate(registry.get("sonicmoe"), problem.with_tokens(64), current_environment())
    _say(f"selector verdict for sonicmoe: {verdict.status.value}: {verdict.reason} | found: {verdict.found}")
    report["verdict"] = verdict.to_dict()

    t0 = time.perf_counter()
    try:
        import kernels

        module = kernels.get_kernel(PIN_REPO, version=2)
        report["kernel_module"] = f"{module.__name__} from {getattr(module, '__file__', '?')}"
        _say(f"kernels.get_kernel loaded {report['kernel_module']} in {time.perf_counter() - t0:.1f} s")
    except Exception as exc:
        # Do not lose the device time: load the same directory without `kernels`, and say so loudly.
        report["kernel_error"] = f"{type(exc).__name__}: {exc}"
        _say(f"kernels could not load the local kernel: {report['kernel_error']}")
        traceback.print_exc()
        import importlib.util

        from selector import hub

        spec = importlib.util.spec_from_file_location(
            "sonic_moe_direct", kernel_dir / "build" / "torch-cuda" / "__init__.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        hub._LOADED[sonic.KERNEL] = module
        report["kernel_module"] = "DIRECT IMPORT, NOT through kernels (see kernel_error)"
        report["notes"].append("the kernels package failed; results below bypass it")

    ceilings = measure_ceilings(torch, device)
    report["ceilings"] = ceilings
    _say(f"ceilings: {ceilings['bandwidth_Bps'] / 1e12:.2f} TB/s, {ceilings['bf16_flops'] / 1e12:.0f} TFLOP/s")

    os.environ["SELECTOR_VALIDATE"] = "shapes"  # time the layer, not the value checks
    layer = make_layer(torch, problem, torch.bfloat16, device, seed=0)
    grouped = registry.get("grouped_mm").load()
    selector.set_experts_implementation(layer, "sonicmoe")
    elem, e, h, i, k = 2, problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k

    def run_cell(t: int, timed: bool = True) -> dict:
        index, weights = random_routing(torch, t, e, k, device, seed=t)
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        row: dict = {"T": t, "padded_T": sonic.padded_tokens(t)}
        out, row["first_call_s"] = time_first_call(torch, lambda: layer(x, index, weights))
        row["backend_ran"] = selector.last_backend(layer)
        sample = min(t, 32)
        ref = reference_rows(torch, layer, x, index, weights, sample)
        row["rel_err_sonicmoe"] = float((out[:sample].double() - ref).norm() / ref.norm().clamp_min(1e-30))
        peer = grouped(layer, x, index, weights)
        row["rel_err_grouped_mm"] = float((peer[:sample].double() - ref).norm() / ref.norm().clamp_min(1e-30))
        row["sonicmoe_vs_grouped_mm"] = float((out.double() - peer.double()).norm() / peer.double().norm())
        if not timed:
            return row
        hits = int(index.unique().numel())
        moved = hits * 3 * h * i * elem + 2 * t * h * elem
        flops = 2.0 * t * k * 3 * h * i
        floor = max(moved / ceilings["bandwidth_Bps"], flops / ceilings["bf16_flops"])
        row["floor_s"] = floor
        for name, fn in (("sonicmoe", lambda: layer(x, index, weights)), ("grouped_mm", lambda: grouped(layer, x, index, weights))):
            probe = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            row[f"{name}_s"] = time_back_to_back(torch, fn, calls_for(time.perf_counter() - probe))
            row[f"{name}_x_floor"] = row[f"{name}_s"] / floor
        return row

    tokens = [int(t) for t in args.tokens.split(",") if t]
    with torch.no_grad():
        for t in tokens:
            if elapsed() > args.budget_s and report["tokens"]:
                report["notes"].append(f"T={t} skipped: past the {args.budget_s:.0f} s budget")
                continue
            try:
                row = run_cell(t)
            except Exception as exc:
                row = {"T": t, "error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            report["tokens"].append(row)
            _say(json.dumps(row))
        # token buckets: 60 pads to 64 (compiled above); 61 with padding off is a new token count
        bucket_checks = []
        if 64 in tokens and elapsed() < args.budget_s:
            bucket_checks.append(("T=60 (bucket 64, compiled)", 60, "1"))
            bucket_checks.append(("T=61 unpadded (new count)", 61, "0"))
        for label, t, pad in bucket_checks:
            os.environ["SELECTOR_SONICMOE_PAD_TOKENS"] = pad
            try:
                row = run_cell(t, timed=False)
                row["label"] = label
            except Exception as exc:
                row = {"T": t, "label": label, "error": f"{type(exc).__name__}: {exc}"}
            report.setdefault("buckets", []).append(row)
            _say(json.dumps(row))
        os.environ.pop("SELECTOR_SONICMOE_PAD_TOKENS", None)

    # what "auto" would pick now (warm) vs a cold process, per T
    from selector.ranking import rank

    picks = {}
    for t in tokens:
        warm = rank(problem.with_tokens(t), current_environment(), registry)
        picks[t] = {"warm": [(c.name, c.estimate) for c in warm.candidates]}
    sonic.forget_compiled()
    for t in tokens:
        cold = rank(problem.with_tokens(t), current_environment(), registry)
        picks[t]["cold"] = [(c.name, c.estimate) for c in cold.candidates]
    report["ranking"] = picks

    # the same cells in `selector bench`'s own format (the kernel is warm now, so this is quick)
    if not args.no_bench and elapsed() < args.budget_s:
        from selector.bench import markdown_table, run_bench, write_outputs

        try:
            for t in tokens:  # warm again: forget_compiled above only cleared the record, not the kernel
                sonic.record_compiled(sonic.problem_key(problem), sonic.padded_tokens(t))
            bench = run_bench(["qwen3-30b-a3b"], tokens, backends=["sonicmoe", "grouped_mm"], modes=("eager",),
                              with_peers=False)
            write_outputs(bench, args.out / "bench")
            report["selector_bench"] = str(args.out / "bench")
            _say(markdown_table(bench))
        except Exception as exc:
            report["notes"].append(f"selector bench failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    report["elapsed_s"] = elapsed()
    (args.out / "sonicmoe_gpu.json").write_text(json.dumps(report, indent=2, default=str))

    _say("")
    _say(f"SonicMoE, Qwen3-30B-A3B bf16, {torch.cuda.get_device_name()}, loaded: {report['kernel_module']}  "
         f"({elapsed():.0f} s)")
    _say("| T | first call | sonicmoe | x floor | grouped_mm | x floor | err sonic | err grouped | auto warm / cold |")
    _say("|---|---|---|---|---|---|---|---|---|")
    for row in report["tokens"]:
        if "error" in row:
            _say(f"| {row['T']} | error: {row['error'][:80]} |")
            continue
        t = row["T"]
        auto = f"{picks[t]['warm'][0][0]} / {picks[t]['cold'][0][0]}" if picks[t]["warm"] else "-"
        _say(f"| {t} | {row['first_call_s']:.1f} s | {row['sonicmoe_s'] * 1e6:.0f} us | {row['sonicmoe_x_floor']:.2f} "
             f"| {row['grouped_mm_s'] * 1e6:.0f} us | {row['grouped_mm_x_floor']:.2f} | {row['rel_err_sonicmoe']:.1e} "
             f"| {row['rel_err_grouped_mm']:.1e} | {auto} |")
    for row in report.get("buckets", []):
        if "error" in row:
            _say(f"bucket check {row['label']}: error {row['error'][:120]}")
        else:
            _say(f"bucket check {row['label']}: first call {row['first_call_s']:.2f} s, err {row['rel_err_sonicmoe']:.1e}")
    ok = all("error" not in r and r["rel_err_sonicmoe"] < 2e-2 for r in report["tokens"]) and report["tokens"]
    _say("CHECK " + ("PASSED" if ok else "FAILED") + ": sonicmoe vs float64 reference (rel err < 2e-2)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
