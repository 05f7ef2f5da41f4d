"""Does the float64 reference read the same on the GPU as on the CPU? (the quantised grid computes it on the GPU)

The quantised grid (quant_gpu.py) reads 1.3-2.1e-2 against `reference_forward(..., device="cuda")` for every
quantised path, the CUDA-core batched_mm as much as the tensor-core ones, while the CUDA tests, whose reference
runs on the CPU, meet 1e-4 with a few pairs. This script times nothing: on one small layer and one
Qwen3-sized layer it compares each path with the reference computed on the CPU and on the GPU, and the two
references with each other; it checks the casts the reference makes on the GPU (float32 -> e4m3,
float64 -> bf16) against the CPU's on the same values, and follows one expert through the reference's steps on
both devices. Found on the H200 (torch 2.11): the casts agree, the activations' quantisation did not (torch on
CUDA divides by a Python scalar as a multiplication by its rounded reciprocal), fixed in quantize_activations.

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
    v = v.clamp(-448, 448)
    e4m3 = v.to(torch.float8_e4m3fn).float().cpu() != v.cpu().to(torch.float8_e4m3fn).float()
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


def stages() -> None:
    """The reference's steps for one expert of the small layer on both devices: where do they part?"""
    from selector import layers

    dev = torch.device("cuda")
    layer = Q.quantize_experts(make_layer(16, 640, 320, dev, seed=5).share(), "fp8_block", "float32")
    x = torch.randn(8, 640, device=dev, dtype=torch.bfloat16)
    seen = {}
    for d in ("cpu", dev):
        up, down = (t.to(device=d, dtype=torch.float64) for t in Q.expert_weights(layer, 3))
        xq = Q.quantize_activations(x.to(d), 128)
        pre = xq.double() @ up.T
        act = layers.activate(layer, pre)
        inter = act.to(torch.bfloat16)
        iq = Q.quantize_activations(inter, 128)
        y = iq.double() @ down.T
        seen[str(d)] = dict(up=up, down=down, xq=xq, pre=pre, act=act, inter=inter, iq=iq, y=y)
    cpu, gpu = seen["cpu"], seen[str(dev)]
    for name in cpu:
        a, b = cpu[name].double(), gpu[name].double().cpu()
        print(f"  {name:5s}: max |gpu - cpu| / max |cpu| = {((a - b).abs().max() / a.abs().max()).item():.2e}")


if __name__ == "__main__":
    main()
    print("the reference's steps, one expert of the small layer:")
    stages()
