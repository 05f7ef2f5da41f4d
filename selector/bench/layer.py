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


def train_costs(moved: float, flops: float, problem: Any, tokens: int, elem: int) -> tuple[float, float]:
    """(bytes, FLOPs) of a training step's floor from the forward's: the backward's two matmuls per forward matmul
    (the inputs' and the weights' gradients) triple the FLOPs; the expert weights hit are read and their gradients
    written, and the upstream gradient read and the inputs' gradient written beside the activations."""
    weights = moved - 2 * tokens * problem.hidden_size * elem
    return 2 * weights + 4 * tokens * problem.hidden_size * elem, 3 * flops


def floor_seconds(ceilings: dict[str, float], problem: Any, moved: float, flops: float) -> float:
    """max(bytes / bandwidth, FLOPs / matmul rate), both ceilings measured in the same run."""
    return max(moved / ceilings["bandwidth_Bps"], flops / compute_ceiling(ceilings, problem))


def temp_bytes_estimate(name: str, tokens: int, problem: Any, elem: int, train: bool = False) -> int:
    """Temporaries a backend needs; dense batched_mm copies one expert's weights per (token, slot). `train`: a
    training step's too, roughly: the forward's temporaries again in the backward, the activations kept for it
    (per (token, slot): gate_up's 2I outputs, their I activations, the gathered input and the weighted output),
    and the expert weights' gradients (as large as the weights)."""
    pairs = tokens * problem.top_k
    h, i = problem.hidden_size, problem.intermediate_size
    if name.endswith("batched_mm") and problem.weight_format == "dense":
        forward = pairs * 3 * h * i * elem
    else:
        forward = 4 * pairs * max(2 * i, h) * elem
    if not train:
        return forward
    saved = pairs * (2 * i + i + 2 * h) * elem
    weight_grads = 3 * problem.num_experts * h * i * elem
    return 2 * forward + saved + weight_grads + 2 * tokens * h * elem


def expert_params(problem: Any) -> list[str]:
    """The layer's per-expert parameter names for this layout: the projections, then their biases if any."""
    return ["gate_up_proj", "down_proj"] + (["gate_up_proj_bias", "down_proj_bias"] if problem.has_bias else [])


def expert_rows(layer: Any, problem: Any, x: Any, params: dict[str, Any]) -> Any:
    """One expert's output rows from the definition: x [n, H] through `params` (one expert's slices, by the
    names of `expert_params`), in the layout `problem` describes and the layer's own activation."""
    from selector import layers

    up_w, down_w = params["gate_up_proj"], params["down_proj"]
    up = x @ (up_w if problem.is_transposed else up_w.T)
    if problem.has_bias:
        up = up + params["gate_up_proj_bias"]
    y = layers.activate(layer, up) @ (down_w if problem.is_transposed else down_w.T)
    return y + params["down_proj_bias"] if problem.has_bias else y


def _relative(diff_sq: float, ref_sq: float) -> float:
    return (diff_sq / max(ref_sq, 1e-60)) ** 0.5


def grad_errors(
    torch: Any, layer: Any, problem: Any, x: Any, index: Any, weights: Any, grad_out: Any, grads: dict[str, Any]
) -> dict[str, float]:
    """Relative errors (norm of the difference / norm of the reference) of one training step's gradients against
    float64 from the definition, per GRAD_INPUTS name, for a dense layer of any layout `reference_of` knows.

    `x`, `index`, `weights`, `grad_out`: the rows the step ran on; `grads`: the step's gradients, keyed
    hidden_states, routing_weights and the layer's parameter names (gate_up_proj, down_proj, biases; a missing or
    None gradient reads as zeros). The reference goes one expert at a time (the output is a sum over experts, so
    each expert's share of the backward stands alone): float64 copies of one expert's weights at a time, never of
    the whole layer."""
    x64, w64, g64 = x.double(), weights.double(), grad_out.double()
    gx, gw = torch.zeros_like(x64), torch.zeros_like(w64)
    names = expert_params(problem)
    diff_sq = ref_sq = 0.0
    hit = set(index.unique().tolist())
    for e in range(problem.num_experts):
        got = {n: grads.get(n) for n in names}
        if e not in hit:  # no token reached it: its gradient must be zero
            diff_sq += sum(float(g[e].double().square().sum()) for g in got.values() if g is not None)
            continue
        t, j = torch.where(index == e)
        xe = x64[t].clone().requires_grad_(True)
        we = w64[t, j].clone().requires_grad_(True)
        params = {n: getattr(layer, n)[e].detach().double().requires_grad_(True) for n in names}
        (expert_rows(layer, problem, xe, params) * we.unsqueeze(-1)).backward(g64[t])
        gx.index_add_(0, t, xe.grad)
        gw[t, j] = we.grad
        for n, ref in params.items():
            mine = got[n][e].double() if got[n] is not None else torch.zeros_like(ref.grad)
            diff_sq += float((mine - ref.grad).square().sum())
            ref_sq += float(ref.grad.square().sum())
    out = {"expert_weights": _relative(diff_sq, ref_sq)}
    for name, ref in (("hidden_states", gx), ("routing_weights", gw)):
        mine = grads.get(name)
        mine = mine.double() if mine is not None else torch.zeros_like(ref)
        out[name] = _relative(float((mine - ref).square().sum()), float(ref.square().sum()))
    return {name: out[name] for name in ("hidden_states", "routing_weights", "expert_weights")}
