"""Does the float64 reference read the same on the GPU as on the CPU? (the quantised grid computes it on the GPU)

The quantised grid (quant_gpu.py) reads 1.3-2.1e-2 against `reference_forward(..., device="cuda")` for every
quantised path, the CUDA-core batched_mm as much as the tensor-core ones, while the CUDA tests, whose reference
runs on the CPU, meet 1e-4 with a few pairs. This script times nothing: on one small layer and one
Qwen3-sized layer it compares each path with the reference computed on the CPU and on the GPU, and the two
references with each other, and it checks the casts the reference makes on the GPU (float32 -> e4m3,
float64 -> bf16) against the CPU's on the same values.

    python benchmarks/reference_device_check.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_gpu import forward_of, make_layer, routing  # noqa: E402

from selector import quant as Q  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    v = torch.randn(1 << 22, device=dev) * 100
    e4m3 = (v.clamp(-448, 448).to(torch.float8_e4m3fn).float().cpu() != v.cpu().clamp(-448, 448).to(torch.float8_e4m3fn).float())
    d = torch.randn(1 << 22, device=dev, dtype=torch.float64)
    bf16 = d.to(torch.bfloat16).float().cpu() != d.cpu().to(torch.bfloat16).float()
    print(f"cast float32 -> e4m3: GPU != CPU on {e4m3.float().mean().item():.2e} of values; "
          f"float64 -> bf16: {bf16.float().mean().item():.2e}")
    for name, (e, h, i, k, tokens) in {"small": (16, 640, 320, 4, 8), "qwen3": (128, 2048, 768, 8, 8)}.items():
        dense = make_layer(e, h, i, dev, seed=5)
        layer = Q.quantize_experts(dense.share(), "fp8_block", "float32")
        idx, w = routing(tokens, e, k, dev, seed=tokens)
        x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
        ref_cpu = Q.reference_forward(layer, x, idx, w, device="cpu")
        ref_gpu = Q.reference_forward(layer, x, idx, w, device=dev)
        print(f"{name}: reference GPU vs CPU {rel(ref_gpu, ref_cpu):.2e}")
        for backend in ("batched_mm", "grouped_mm"):
            out = forward_of(backend)(layer, x, idx, w)
            print(f"  {backend}: vs CPU reference {rel(out, ref_cpu):.2e}, vs GPU reference {rel(out, ref_gpu):.2e}")


if __name__ == "__main__":
    main()
