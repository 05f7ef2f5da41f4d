"""The layer `selector tune` and `selector bench` time for a problem: random weights in the problem's layout (GPT-OSS's biases,
transposed weights, interleaved gate/up and clamped SwiGLU included), quantised where the problem says, and a
float64 reference on a sample of tokens to check each backend's result before it is timed."""

from __future__ import annotations

from typing import Any

from selector.layers import clamped_swiglu
from selector.types import Problem


def is_plain(problem: Problem) -> bool:
    """Whether `problem` is the plain layer quantising expects: gated, no biases, gate/up concatenated and not
    transposed, the default gate, no norm after the experts, not expert-parallel."""
    special = (
        problem.has_bias,
        problem.is_transposed,
        problem.interleaved,
        problem.gate.custom,
        not problem.gate.is_default,
        problem.post_expert_norm,
        problem.expert_parallel,
    )
    return problem.gated and not any(special)


def _activation(torch: Any, name: str) -> Any:
    return {"gelu": torch.nn.GELU(), "gelu_tanh": torch.nn.GELU(approximate="tanh"), "relu": torch.nn.ReLU()}.get(
        name, torch.nn.SiLU()
    )


def make_problem_layer(torch: Any, problem: Problem, device: Any, seed: int = 0) -> Any:
    """A decorated experts module for `problem` (its dtype, layout, activation, weight format) on `device`.
    ValueError for a quantised format on a layout other than the plain one (selector quantises plain layers)."""
    import selector
    from selector.bench.layer import make_layer

    dtype = getattr(torch, problem.dtype)
    if is_plain(problem):
        layer = make_layer(torch, problem, dtype, device, seed)
        layer.act_fn = _activation(torch, problem.activation)
        if problem.weight_format != "dense":
            from selector import quant

            layer = quant.quantize_experts(layer, problem.weight_format, problem.scale_format)
        return layer
    if problem.weight_format != "dense" or not problem.gated or problem.post_expert_norm or problem.expert_parallel:
        raise ValueError(
            "selector tune builds quantised, non-gated, post-norm and expert-parallel layers in the plain layout "
            "only: drop --format or the layout flags"
        )
    e, h, i = problem.num_experts, problem.hidden_size, problem.intermediate_size
    gen = torch.Generator(device=device).manual_seed(seed)

    def param(*shape: int, scale: float) -> Any:
        data = torch.randn(*shape, device=device, dtype=dtype, generator=gen) * scale
        return torch.nn.Parameter(data, requires_grad=False)

    # a custom gate: Python the selector does not recognise (a copy of the clamped SwiGLU); a recognised gate:
    # declared as data, so the layer is the one problem_from_module reads back
    gate_fn = (lambda module, x: clamped_swiglu(module, x)) if problem.gate.custom else None
    gate = None if problem.gate.custom or problem.gate.is_default else problem.gate

    @selector.experts(
        has_bias=problem.has_bias,
        is_transposed=problem.is_transposed,
        is_concatenated=not problem.interleaved,
        gate_fn=gate_fn,
        gate=gate,
    )
    class TuneExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = e
            t = problem.is_transposed
            self.gate_up_proj = param(*((e, h, 2 * i) if t else (e, 2 * i, h)), scale=h**-0.5)
            self.down_proj = param(*((e, i, h) if t else (e, h, i)), scale=i**-0.5)
            if problem.has_bias:
                self.gate_up_proj_bias = param(e, 2 * i, scale=0.1)
                self.down_proj_bias = param(e, h, scale=0.1)
            self.act_fn = _activation(torch, problem.activation)

    return TuneExperts()


def reference_of(torch: Any, layer: Any, problem: Problem, x: Any, index: Any, weights: Any, rows: int) -> Any:
    """float64 result for the first `rows` tokens, from the definition (quantised: `selector.bench`'s reference
    from the dequantised weights)."""
    from selector.bench.layer import expert_params, expert_rows, reference

    if is_plain(problem):
        return reference(torch, layer, x, index, weights, rows)
    x64, idx, w = x[:rows].double(), index[:rows], weights[:rows].double()
    out = torch.zeros_like(x64)
    for e in idx.unique().tolist():
        t, j = torch.where(idx == e)
        params = {name: getattr(layer, name)[e].double() for name in expert_params(problem)}
        out.index_add_(0, t, expert_rows(layer, problem, x64[t], params) * w[t, j].unsqueeze(-1))
    return out
