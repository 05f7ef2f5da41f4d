"""Activation quantisation as the kernels do it, and the float64 reference forward the tests compare with."""

from __future__ import annotations

import copy

import torch

from selector.quant.experts import (
    _dequantize_projection,
    _inter_size,
    _split_gate_up,
    _up_name,
    dequantized_weights,
    quant_format,
)
from selector.quant.formats import FP8_DTYPE, FP8_MAX


def quantize_activations(x: torch.Tensor, group: int, static_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """What the kernels multiply with: e4m3(x / s) * s per row and `group` channels, in float32 (exactly).

    Dynamic: s = amax / 448 over the group (1 where amax is 0), computed in float32; x / s as x * (1 / s),
    both correctly rounded. Static: s is the given per-tensor scale and values beyond +-448 saturate.
    Both divisions take a tensor divisor: on CUDA torch divides by a Python scalar as a multiplication by its
    rounded reciprocal, one ulp off the correctly rounded quotient the kernels compute, and bf16 inputs sit on
    e4m3 ties often enough that this ulp flips codes (the reference computed on the H200 read 1.7-1.9e-2 from
    the CPU's, where the kernels read 2-3e-3: docs/design/quant_kernels.md).
    """
    x = x.to(torch.float32)
    rows, k = x.shape
    groups = -(-k // group)
    xp = torch.nn.functional.pad(x, (0, groups * group - k)).reshape(rows, groups, group)
    if static_scale is None:
        amax = xp.abs().amax(dim=-1, keepdim=True)
        s = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    else:
        s = torch.as_tensor(static_scale, dtype=torch.float32, device=x.device).reshape(-1, 1, 1).expand(rows, 1, 1)
    r = torch.ones_like(s) / s
    q = (xp * r).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32)
    return (q * s).reshape(rows, groups * group)[:, :k]


def expert_weights(module: torch.nn.Module, expert: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [C, H], down [H, I]) of one expert, dequantised (only that expert's slices are touched)."""
    fmt = quant_format(module)
    name = _up_name(module)
    up_q, down_q = getattr(module, name)[expert : expert + 1], module.down_proj[expert : expert + 1]
    if fmt is None:
        up, down = up_q.to(dtype), down_q.to(dtype)
        if getattr(module, "is_transposed", False):
            up, down = up.transpose(1, 2), down.transpose(1, 2)
        return up[0], down[0]
    up_s = getattr(module, f"{name}_scale_inv")[expert : expert + 1]
    down_s = module.down_proj_scale_inv[expert : expert + 1]
    split = _inter_size(module, up_q) if _split_gate_up(module) else None
    up = _dequantize_projection(up_q, up_s, fmt, split, dtype)
    down = _dequantize_projection(down_q, down_s, fmt, None, dtype)
    return up[0], down[0]


@torch.no_grad()
def reference_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    quantize_activations_as_kernel: bool = True,
    intermediate_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """float64 forward from the dequantised weights, expert by expert (on `device`, the CPU by default).

    With `quantize_activations_as_kernel` the inputs of both projections are quantised as the kernels do
    (`quantize_activations`, in float32, before the float64 math), so the remaining difference to a kernel is
    its fp32 accumulation order and the rounding of the intermediate to `intermediate_dtype` (default: the
    module's compute dtype), which the reference applies too.
    """
    from selector import layers

    fmt = quant_format(module)
    if fmt is None:
        raise ValueError("reference_forward is for quantised experts")
    inter_dtype = intermediate_dtype or getattr(module, "selector_compute_dtype", None) or hidden_states.dtype
    x = hidden_states.detach().to(device=device, dtype=inter_dtype)
    idx, wts = top_k_index.to(device), top_k_weights.detach().to(device=device, dtype=torch.float64)
    up_b, down_b = layers.up_bias(module), layers.down_bias(module)
    up_b = None if up_b is None else up_b.detach().to(device=device, dtype=torch.float64)
    down_b = None if down_b is None else down_b.detach().to(device=device, dtype=torch.float64)
    static = fmt.activation_quant == "static"
    norm = None
    if getattr(module, "has_post_expert_norm", False):
        norm = copy.deepcopy(module.post_expert_norm).to(device=device, dtype=torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64, device=device)
    group = fmt.activation_group
    for e in torch.unique(idx[(idx >= 0) & (idx < module.num_experts)]).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        up, down = (t.to(device=device, dtype=torch.float64) for t in expert_weights(module, e))
        xe = x[tok]
        if quantize_activations_as_kernel:
            xe = quantize_activations(xe, group, module.gate_up_proj_activation_scale[e].to(device) if static else None)
        h = xe.double() @ up.T
        if up_b is not None:
            h = h + up_b[e]
        h = layers.activate(module, h).to(inter_dtype)
        if quantize_activations_as_kernel:
            h = quantize_activations(h, group, module.down_proj_activation_scale[e].to(device) if static else None)
        y = h.double() @ down.T
        if down_b is not None:
            y = y + down_b[e]
        if norm is not None:
            y = norm(y)
        out.index_add_(0, tok, y * wts[tok, slot, None])
    return out


@torch.no_grad()
def calibrate_activation_scales(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert static activation scales (amax / 448 of each projection's input) from sample tokens.

    Works on a dense module (before quantising) or a quantised one (dequantised weights). Experts that get no
    sample token take the largest scale seen.
    """
    from selector import layers

    if quant_format(module) is not None:
        up, _ = dequantized_weights(module, torch.float32)
    else:
        up = getattr(module, _up_name(module)).detach().float()
        if getattr(module, "is_transposed", False):
            up = up.transpose(1, 2)
    up_b = layers.up_bias(module)
    x = hidden_states.detach().float().to(up.device)
    num_experts = up.shape[0]
    s1 = torch.zeros(num_experts)  # filled from host floats; set_quantized puts them beside the weights
    s2 = torch.zeros(num_experts)
    for e in range(num_experts):
        tok = torch.nonzero((top_k_index == e).any(dim=1), as_tuple=True)[0].to(up.device)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = xe @ up[e].T
        if up_b is not None:
            h = h + up_b[e].float()
        h = layers.activate(module, h)
        s1[e] = xe.abs().max().item() / FP8_MAX
        s2[e] = h.abs().max().item() / FP8_MAX
    for s in (s1, s2):
        top = s.max().item()
        s[s == 0] = top if top > 0 else 1.0
    return s1, s2
