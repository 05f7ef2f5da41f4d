"""The backward of `selector::triton_fused_experts`, recomputed in torch on the pairs sorted by expert.

The Triton forward keeps nothing for a backward (its intermediate lives in a temporary), so the backward
recomputes the gate_up projection and the activation per (token, slot) pair, then runs the chain rule with
grouped matmuls: torch's grouped GEMM on CUDA in bf16 where its alignment holds, the `grouped_mm` backend's loop
op elsewhere (any dtype, float64 included). Gradients: hidden states, routing weights, both projections and
both biases, for gated (concatenated or interleaved) and plain experts, either stride order, the activations in
BACKWARD_ACTIVATIONS. No host synchronisation on the CUDA path, so AOTAutograd traces it under torch.compile.
"""

from __future__ import annotations

from typing import Any

import torch
from selector.plugins.grouped_mm.forward import grouped_mm_loop, grouped_mm_loop_weight_grad

BACKWARD_ACTIVATIONS: frozenset[str] = frozenset({"silu", "gelu", "gelu_tanh", "relu"})
_CAPABILITY: dict[int, tuple[int, int]] = {}


def _act(name: str, z: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return torch.nn.functional.silu(z)
    if name in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(z, approximate="tanh" if name == "gelu_tanh" else "none")
    if name == "relu":
        return torch.relu(z)
    raise NotImplementedError(
        f"triton_fused: no backward for activation {name!r} (has: {sorted(BACKWARD_ACTIVATIONS)})"
    )


def _act_backward(name: str, grad: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """d act(z) / dz * grad, by torch's own derivative kernels."""
    if name == "silu":
        return torch.ops.aten.silu_backward(grad, z)
    if name in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, z, approximate="tanh" if name == "gelu_tanh" else "none")
    if name == "relu":
        return torch.ops.aten.threshold_backward(grad, z, 0)
    raise NotImplementedError(
        f"triton_fused: no backward for activation {name!r} (has: {sorted(BACKWARD_ACTIVATIONS)})"
    )


def _native(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether torch's grouped GEMM takes these operands: CUDA bf16 on compute capability >= 8.0, every
    matrix dimension a multiple of 16 bytes (strides of the views below)."""
    if not (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch.nn.functional, "grouped_mm")):
        return False
    index = device.index or 0
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index] >= (8, 0) and all(d % 8 == 0 for d in dims)


def _mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, native: bool) -> torch.Tensor:
    """x [S, in] sorted by expert times weight [E, in, out] per expert -> [S, out] (rows past the end: undefined)."""
    if native:
        return torch.nn.functional.grouped_mm(x, weight, offs=offsets)
    return grouped_mm_loop(x, weight, offsets)


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, native: bool) -> torch.Tensor:
    """sum over each expert's rows of x^T grad: x [S, in], grad [S, out] -> [E, in, out], contiguous."""
    if native:  # 2-D x 2-D with the jagged dimension contracted: how torch differentiates its own grouped GEMM
        return torch.nn.functional.grouped_mm(x.t(), grad, offs=offsets)
    return grouped_mm_loop_weight_grad(x, grad, offsets)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    hidden, gate_up, down, index, weights, num_experts, activation, gated, interleaved, transposed = inputs[:10]
    gate_up_bias, down_bias = inputs[10], inputs[11]
    ctx.save_for_backward(hidden, gate_up, down, index, weights, gate_up_bias, down_bias)
    ctx.layout = (num_experts, activation, gated, interleaved, transposed)
    ctx.constant_inputs = len(inputs) - 12  # config, guard and the gate's fields: no gradient
    gate = inputs[14] if len(inputs) > 14 else "act_mul"
    if gated and gate != "act_mul":  # selection never sends this here (the backend's check); a direct call might
        raise NotImplementedError(f"triton_fused has no backward for gate {gate!r}: run it under torch.no_grad()")


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    hidden, gate_up, down, index, weights, gate_up_bias, down_bias = ctx.saved_tensors
    num_experts, activation, gated, interleaved, transposed = ctx.layout
    needs = ctx.needs_input_grad
    tokens, top_k = index.shape
    dtype = gate_up.dtype
    acc = torch.promote_types(dtype, torch.float32)  # elementwise math and sums: fp32, float64 stays float64
    # [E, in, out] views of the stored layouts: gate_up [E, C, H] (transposed: [E, H, C]), down [E, H, I] ([E, I, H])
    up_w = gate_up if transposed else gate_up.transpose(1, 2)
    down_w = down if transposed else down.transpose(1, 2)
    hidden_size, channels = up_w.shape[1], up_w.shape[2]
    inter = down_w.shape[1]
    native = _native(hidden.device, dtype, hidden_size, channels, inter)

    ids = index.reshape(-1).long()
    valid_ids = (ids >= 0) & (ids < num_experts)
    ids = torch.where(valid_ids, ids, num_experts)  # sentinel slots sort to the tail, past the last offset
    sorted_ids, order = torch.sort(ids, stable=True)
    counts_in = sorted_ids.to(acc) if sorted_ids.device.type == "cpu" else sorted_ids.int()
    offsets = torch.cumsum(torch.histc(counts_in, bins=num_experts, min=0, max=num_experts - 1), 0).to(torch.int32)
    valid = (sorted_ids < num_experts).unsqueeze(-1)
    expert = sorted_ids.clamp(max=num_experts - 1)
    token = order // top_k

    def keep(t: torch.Tensor) -> torch.Tensor:  # rows past the last offset are not written by the grouped GEMM
        return torch.where(valid, t, 0)

    # recompute the pair rows: x -> g = x A_e + b1 -> a = act(gate) * up (or act(g)) -> y = a B_e + b2
    x = hidden.to(dtype)[token]
    g = keep(_mm(x, up_w, offsets, native)).to(acc)
    if gate_up_bias is not None:
        g = g + gate_up_bias[expert].to(acc)
    if gated:
        gate, up = (g[:, 0::2], g[:, 1::2]) if interleaved else (g[:, :inter], g[:, inter:])
        act_gate = _act(activation, gate)
        a = act_gate * up
    else:
        a = _act(activation, g)

    go = keep(grad_out.to(acc)[token])  # [S, H]: each pair's slice of the upstream gradient
    pair_w = weights.reshape(-1)[order].to(acc).unsqueeze(-1)
    dy = go * pair_w
    grad_weights = None
    if needs[4]:
        y = keep(_mm(a.to(dtype), down_w, offsets, native)).to(acc)
        if down_bias is not None:
            y = y + down_bias[expert].to(acc)
        per_pair = keep((y * go).sum(-1, keepdim=True)).squeeze(-1)
        grad_weights = torch.zeros(tokens * top_k, dtype=acc, device=weights.device)
        grad_weights = grad_weights.index_copy(0, order, per_pair).view(tokens, top_k).to(weights.dtype)

    dy_w = dy.to(dtype)
    grad_down = grad_down_bias = None
    # Weight gradients are computed in the stored layout ([E, I, H] transposed, else [E, H, I]) by the order of the
    # operands: a transposed view would be copied into the parameter's strides by autograd, an elementwise pass
    # over every expert's weights (Qwen3-30B-A3B at T=512: 2 ms a step for the two projections, the GEMMs 1.3 ms).
    if needs[2]:
        a_w = a.to(dtype)
        grad_down = _weight_grad(a_w, dy_w, offsets, native) if transposed else _weight_grad(dy_w, a_w, offsets, native)
        grad_down = grad_down.to(down.dtype)
    if needs[11] and down_bias is not None:
        grad_down_bias = torch.zeros(num_experts, hidden_size, dtype=acc, device=dy.device)
        grad_down_bias = grad_down_bias.index_add(0, expert, keep(dy)).to(down_bias.dtype)

    need_g = needs[0] or needs[1] or (needs[10] and gate_up_bias is not None)
    grad_hidden = grad_gate_up = grad_gate_up_bias = None
    if need_g:
        da = keep(_mm(dy_w, down_w.transpose(1, 2), offsets, native)).to(acc)  # [S, I]
        if gated:
            d_gate = _act_backward(activation, da * up, gate)
            d_up = da * act_gate
            dg = torch.stack((d_gate, d_up), -1).reshape(g.shape) if interleaved else torch.cat((d_gate, d_up), -1)
        else:
            dg = _act_backward(activation, da, g)
        dg = keep(dg)
        dg_w = dg.to(dtype)
        if needs[1]:  # [E, H, C] transposed, else [E, C, H]
            grad_gate_up = (
                _weight_grad(x, dg_w, offsets, native) if transposed else _weight_grad(dg_w, x, offsets, native)
            )
            grad_gate_up = grad_gate_up.to(gate_up.dtype)
        if needs[10] and gate_up_bias is not None:
            grad_gate_up_bias = torch.zeros(num_experts, channels, dtype=acc, device=dg.device)
            grad_gate_up_bias = grad_gate_up_bias.index_add(0, expert, dg).to(gate_up_bias.dtype)
        if needs[0]:
            dx = keep(_mm(dg_w, up_w.transpose(1, 2), offsets, native)).to(acc)  # [S, H]
            grad_hidden = torch.zeros(tokens, hidden_size, dtype=acc, device=dx.device)
            grad_hidden = grad_hidden.index_add(0, token, dx).to(hidden.dtype)
    return (
        grad_hidden,
        grad_gate_up,
        grad_down,
        None,
        grad_weights,
        None,
        None,
        None,
        None,
        None,
        grad_gate_up_bias,
        grad_down_bias,
    ) + (None,) * ctx.constant_inputs


_REGISTERED: list[bool] = []


def register() -> None:
    """Attach the backward to the op (once; the op is defined where the kernels are)."""
    if not _REGISTERED:
        torch.library.register_autograd("selector::triton_fused_experts", _backward, setup_context=_setup_context)
        _REGISTERED.append(True)


def backward_for_test(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The backward itself, for a check against a reference without running the Triton forward."""
    return _backward(ctx, grad_out)


def context_for_test(inputs: tuple[Any, ...], needs_input_grad: tuple[bool, ...]) -> Any:
    """A stand-in for autograd's ctx after `_setup_context` saw the op's inputs."""

    class Context:
        def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
            self.saved_tensors = tensors

    ctx = Context()
    ctx.needs_input_grad = needs_input_grad
    _setup_context(ctx, inputs, None)
    return ctx
