"""One cell's inputs: the experts layer (dense or quantised), the routing, the float64 reference, the floor."""

from __future__ import annotations

from typing import Any

from selector.bench.cells import FORMATS


def make_layer(torch: Any, problem: Any, dtype: Any, device: Any, seed: int, weights: tuple[Any, Any] | None = None) -> Any:
    """A decorated experts module with random weights, scaled so activations stay O(1); `weights`: (gate_up,
    down) tensors to hold instead (shared, not copied)."""
    import selector

    @selector.experts
    class BenchExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            e, h, i = problem.num_experts, problem.hidden_size, problem.intermediate_size
            gen = torch.Generator(device=device).manual_seed(seed)
            self.num_experts = e
            if weights is None:
                up = torch.randn(e, 2 * i, h, device=device, dtype=dtype, generator=gen) * h**-0.5
                down = torch.randn(e, h, i, device=device, dtype=dtype, generator=gen) * i**-0.5
            else:
                up, down = weights
            self.gate_up_proj = torch.nn.Parameter(up, requires_grad=False)
            self.down_proj = torch.nn.Parameter(down, requires_grad=False)
            self.act_fn = torch.nn.SiLU()

    return BenchExperts()


def format_layer(torch: Any, dense: Any, problem: Any, fmt: str) -> Any:
    """The layer of a FORMATS entry: `dense` itself, or a copy quantised from its weights (which stay as they are)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    target = FORMATS[fmt]
    if target is None:
        return dense
    from selector import quant

    weights = (dense.gate_up_proj.data, dense.down_proj.data)
    twin = make_layer(torch, problem, dense.gate_up_proj.dtype, dense.gate_up_proj.device, 0, weights=weights)
    return quant.quantize_experts(twin, *target)


def random_routing(torch: Any, tokens: int, experts: int, k: int, device: Any, seed: int) -> tuple[Any, Any]:
    """Uniform random top-k routing with distinct experts per token."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, experts, device=device, generator=gen)
    index = scores.topk(k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, k, device=device, generator=gen), dim=1)
    return index, weights


def reference_rows(torch: Any, layer: Any, x: Any, index: Any, weights: Any, rows: int) -> Any:
    """float64 result for the first `rows` tokens of a dense layer, straight from the definition."""
    x64, idx, w = x[:rows].double(), index[:rows], weights[:rows].double()
    out = torch.zeros_like(x64)
    for e in idx.unique().tolist():
        t, j = torch.where(idx == e)
        gate, up = (x64[t] @ layer.gate_up_proj[e].double().T).chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        out.index_add_(0, t, (h @ layer.down_proj[e].double().T) * w[t, j].unsqueeze(-1))
    return out


def reference(torch: Any, layer: Any, x: Any, index: Any, weights: Any, rows: int) -> Any:
    """float64 result for the first `rows` tokens: for quantised weights from the dequantised weights, with the
    activations quantised as the kernels do."""
    from selector import quant

    if quant.is_quantised(layer):
        return quant.reference_forward(layer, x[:rows], index[:rows], weights[:rows], device=x.device)
    return reference_rows(torch, layer, x, index, weights, rows)


def compute_ceiling(ceilings: dict[str, float], problem: Any) -> float:
    """FLOP/s a cell's floor divides by: bf16's matmul rate, or for quantised weights (the kernels multiply e4m3
    tiles, fp4 widened to e4m3) the e4m3 matmul rate where it was measured."""
    if problem.weight_format != "dense" and "fp8_flops" in ceilings:
        return ceilings["fp8_flops"]
    return ceilings["bf16_flops"]


def bytes_moved(layer: Any, problem: Any, experts_hit: int, tokens: int, elem: int) -> float:
    """The floor's bytes: each expert hit read once as stored (scales included), activations in and out."""
    from selector import quant

    if quant.is_quantised(layer):
        per_expert = quant.weight_bytes(layer) / problem.num_experts
    else:
        per_expert = 3 * problem.hidden_size * problem.intermediate_size * elem
    return experts_hit * per_expert + 2 * tokens * problem.hidden_size * elem


def flops_of(problem: Any, tokens: int) -> float:
    """The floor's FLOPs: two matmuls (gate_up 2I wide, down I deep) per (token, slot)."""
    return 2.0 * tokens * problem.top_k * 3 * problem.hidden_size * problem.intermediate_size


def floor_seconds(ceilings: dict[str, float], problem: Any, moved: float, flops: float) -> float:
    """max(bytes / bandwidth, FLOPs / matmul rate), both ceilings measured in the same run."""
    return max(moved / ceilings["bandwidth_Bps"], flops / compute_ceiling(ceilings, problem))


def temp_bytes_estimate(name: str, tokens: int, problem: Any, elem: int) -> int:
    """Temporaries a backend needs; dense batched_mm copies one expert's weights per (token, slot)."""
    pairs = tokens * problem.top_k
    if name.endswith("batched_mm") and problem.weight_format == "dense":
        return pairs * 3 * problem.hidden_size * problem.intermediate_size * elem
    return 4 * pairs * max(2 * problem.intermediate_size, problem.hidden_size) * elem
