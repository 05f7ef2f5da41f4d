"""Where one quantised cell's time goes: each kernel's device time per call (torch.profiler) beside the
call's back-to-back time, so a host-bound cell (time per call well above the summed kernel time) shows as such.

    python3 benchmarks/quant_profile.py --shape qwen3-30b-a3b --tokens 512,4096 --format fp8-f32 --out DIR

Uses quant_gpu.py's layers, routing and timer; the `triton_fused` backend (the quantised grouped path).
Writes quant_profile.json under --out; prints one block per cell.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quant_gpu as G  # noqa: E402  (sets up sys.path and the validation level like the grid does)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from selector import quant as Q  # noqa: E402

CALLS = 20


def profile_cell(shape: str, tokens: int, fmt: str, host: bool = False) -> dict:
    h, i, e, k = G.SHAPES[shape]
    dev = torch.device("cuda")
    layer = G.make_layer(e, h, i, dev)
    if fmt != "bf16":
        Q.quantize_experts(layer, *G.FORMATS[fmt])
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    idx, w = G.routing(tokens, e, k, dev)
    fwd = G.forward_of("triton_fused")
    run = lambda: fwd(layer, x, idx, w)  # noqa: E731
    per_call = G.timed(run, "eager")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            run()
        torch.cuda.synchronize()
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
    return {"shape": shape, "tokens": tokens, "format": fmt, "us_per_call": round(per_call * 1e6, 1),
            "kernel_us_per_call": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
            "kernel_us_sum": round(sum(kernels.values()), 1), "host_profile": host_top}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(G.SHAPES))
    p.add_argument("--tokens", default="512")
    p.add_argument("--format", default="fp8-f32", choices=["bf16", *G.FORMATS])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--host-profile", action="store_true", help=f"also cProfile {CALLS} calls (host time)")
    a = p.parse_args(argv)
    cells = []
    for t in (int(v) for v in a.tokens.split(",")):
        cell = profile_cell(a.shape, t, a.format, a.host_profile)
        cells.append(cell)
        print(f"{a.shape} T={t} {a.format}: {cell['us_per_call']} us per call back to back; kernels "
              f"{cell['kernel_us_sum']} us:")  # fmt: skip
        for name, us in cell["kernel_us_per_call"].items():
            print(f"  {us:9.1f} us  {name}")
        print(cell["host_profile"])
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "quant_profile.json").write_text(json.dumps(cells, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
