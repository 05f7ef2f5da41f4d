"""Quantised experts modules: read a module's format, quantise and dequantise its projections in place, adopt
Transformers' FP8 experts, and the bytes a module's weights take."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from selector.quant.codes import dequantize_weight, is_ue8m0_tensor, quantize_weight
from selector.quant.formats import DEFAULT_FP8_BLOCK, QuantFormat, make_format


def _up_name(module: torch.nn.Module) -> str:
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def _split_gate_up(module: torch.nn.Module) -> bool:
    """Gated + concatenated: gate and up rows are blocked separately (see the module docstring)."""
    return bool(getattr(module, "has_gate", True)) and bool(getattr(module, "is_concatenated", True))


def is_quantised(module: torch.nn.Module) -> bool:
    """quant_format(module) is not None, without building the format (backends ask on every call)."""
    return getattr(module, "selector_weight_format", "dense") not in (None, "dense")


def quant_format(module: torch.nn.Module) -> QuantFormat | None:
    """The module's QuantFormat, or None for dense experts."""
    if not is_quantised(module):
        return None
    return QuantFormat(
        module.selector_weight_format,
        getattr(module, "selector_scale_format", None) or "float32",
        tuple(getattr(module, "selector_block_size", None) or DEFAULT_FP8_BLOCK),  # type: ignore[arg-type]
        getattr(module, "selector_activation_quant", "dynamic") or "dynamic",
    )


def forget_caches(module: torch.nn.Module) -> None:
    """Drop what the dispatch core and the backends cached about the module's weights (on a format change)."""
    from selector.dispatch import forget_module
    from selector.graphs import forget

    forget_module(module)
    forget(module)


def _set(module: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
    if name in module._parameters:
        del module._parameters[name]
    if name in module._buffers:
        del module._buffers[name]
    if hasattr(module, name):
        delattr(module, name)
    if value is not None:
        module.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))


def _quantize_projection(w: torch.Tensor, fmt: QuantFormat, split: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] -> (q, scale); `split` = I blocks gate rows [0, I) and up rows [I, 2I) separately."""
    if split is None or fmt.weight_format == "fp4" or split % fmt.block_size[0] == 0:
        return quantize_weight(w, fmt)
    qg, sg = quantize_weight(w[:, :split], fmt)
    qu, su = quantize_weight(w[:, split:], fmt)
    return torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)


def _dequantize_projection(
    q: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat, split: int | None, dtype: torch.dtype
) -> torch.Tensor:
    if split is None or fmt.weight_format == "fp4" or split % fmt.block_size[0] == 0:
        return dequantize_weight(q, scale, fmt, dtype)
    rows = -(-split // fmt.block_size[0])
    gate = dequantize_weight(q[:, :split], scale[:, :rows], fmt, dtype)
    up = dequantize_weight(q[:, split:], scale[:, rows:], fmt, dtype)
    return torch.cat([gate, up], dim=1)


def _inter_size(module: torch.nn.Module, up: torch.Tensor) -> int:
    return up.shape[1] // 2 if getattr(module, "has_gate", True) else up.shape[1]


def set_quantized(
    module: torch.nn.Module,
    fmt: QuantFormat,
    up_q: torch.Tensor,
    up_scale: torch.Tensor,
    down_q: torch.Tensor,
    down_scale: torch.Tensor,
    compute_dtype: torch.dtype,
    activation_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.nn.Module:
    """Put already quantised projections on a module ([E, out, in] layout) and mark its format."""
    name = _up_name(module)
    _set(module, name, up_q)
    _set(module, f"{name}_scale_inv", up_scale)
    _set(module, "down_proj", down_q)
    _set(module, "down_proj_scale_inv", down_scale)
    static = fmt.activation_quant == "static"
    if static and activation_scales is None:
        raise ValueError(
            "static activation quantisation needs per-expert activation scales: pass activation_scales= "
            "(see calibrate_activation_scales) or use activation_quant='dynamic'"
        )
    # on the weights' device: calibration may have run elsewhere, and the kernels read them beside the weights
    _set(module, "gate_up_proj_activation_scale", activation_scales[0].float().to(up_q.device) if static else None)
    _set(module, "down_proj_activation_scale", activation_scales[1].float().to(up_q.device) if static else None)
    module.is_transposed = False
    module.selector_weight_format = fmt.weight_format
    module.selector_scale_format = fmt.scale_format
    module.selector_block_size = tuple(fmt.block_size)
    module.selector_activation_quant = fmt.activation_quant
    module.selector_compute_dtype = compute_dtype
    # Transformers' FP8Experts attribute names, so its own code reads the module too
    module.block_size = None if fmt.weight_format == "fp4" else list(fmt.block_size)
    module.activation_scheme = fmt.activation_quant
    forget_caches(module)
    return module


@torch.no_grad()
def quantize_experts(
    module: torch.nn.Module,
    weight_format: str = "fp8_block",
    scale_format: str | None = None,
    block_size: Iterable[int] | None = None,
    activation_quant: str = "dynamic",
    activation_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.nn.Module:
    """Quantise a dense experts module in place (weights only; biases stay in the compute dtype).

    weight_format "fp8_block" (scale_format "float32" or "ue8m0", block (128, 128) by default) or "fp4"
    (UE8M0 scales per 32 inputs). activation_quant "static" needs activation_scales = (gate_up [E], down [E]).
    """
    if quant_format(module) is not None:
        raise ValueError("the experts are already quantised; dequantize_experts first")
    fmt = make_format(weight_format, scale_format, block_size, activation_quant)
    name = _up_name(module)
    up, down = getattr(module, name).detach(), module.down_proj.detach()
    compute_dtype = up.dtype
    if getattr(module, "is_transposed", False):
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    split = _inter_size(module, up) if _split_gate_up(module) else None
    up_q, up_s = _quantize_projection(up, fmt, split)
    down_q, down_s = _quantize_projection(down, fmt, None)
    return set_quantized(module, fmt, up_q, up_s, down_q, down_s, compute_dtype, activation_scales)


def dequantized_weights(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [E, C, H], down [E, H, I]) of a quantised module, dequantised to `dtype`."""
    fmt = quant_format(module)
    if fmt is None:
        raise ValueError("the experts are not quantised")
    name = _up_name(module)
    up_q, up_s = getattr(module, name), getattr(module, f"{name}_scale_inv")
    split = _inter_size(module, up_q) if _split_gate_up(module) else None
    up = _dequantize_projection(up_q, up_s, fmt, split, dtype)
    down = _dequantize_projection(module.down_proj, module.down_proj_scale_inv, fmt, None, dtype)
    return up, down


@torch.no_grad()
def dequantize_experts(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Turn a quantised experts module back into dense experts (in place), in `dtype` or its compute dtype."""
    fmt = quant_format(module)
    if fmt is None:
        return module
    dtype = dtype or getattr(module, "selector_compute_dtype", None) or torch.bfloat16
    up, down = dequantized_weights(module, dtype)
    name = _up_name(module)
    for attr in (f"{name}_scale_inv", "down_proj_scale_inv", "gate_up_proj_activation_scale", "down_proj_activation_scale"):
        _set(module, attr, None)
    _set(module, name, None)
    _set(module, "down_proj", None)
    module.register_parameter(name, torch.nn.Parameter(up))
    module.register_parameter("down_proj", torch.nn.Parameter(down))
    for attr in ("selector_scale_format", "selector_block_size", "selector_activation_quant", "selector_compute_dtype",
                 "block_size", "activation_scheme"):  # fmt: skip
        module.__dict__.pop(attr, None)
    module.selector_weight_format = "dense"
    forget_caches(module)
    return module


def adopt_transformers_experts(module: torch.nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Mark a Transformers `FP8Experts` module (fp8 or fp4 weights) with the selector_* attributes.

    Reads what Transformers stores: the weight dtype (float8_e4m3fn or int8 for fp4), the scale dtype
    (float32 or e8m0), `block_size` and `activation_scheme`.
    """
    name = _up_name(module)
    weight, scale = getattr(module, name), getattr(module, f"{name}_scale_inv")
    fp4 = weight.dtype in (torch.int8, torch.uint8)
    fmt = make_format(
        "fp4" if fp4 else "fp8_block",
        "ue8m0" if is_ue8m0_tensor(scale) else "float32",
        None if fp4 else (getattr(module, "block_size", None) or DEFAULT_FP8_BLOCK),
        getattr(module, "activation_scheme", "dynamic"),
    )
    module.selector_weight_format = fmt.weight_format
    module.selector_scale_format = fmt.scale_format
    module.selector_block_size = tuple(fmt.block_size)
    module.selector_activation_quant = fmt.activation_quant
    module.selector_compute_dtype = compute_dtype
    module.is_transposed = False
    forget_caches(module)
    return module


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the expert weights and their scales as stored (what a decode step reads per expert hit x E)."""
    name = _up_name(module)
    total = 0
    for attr in (name, f"{name}_scale_inv", "down_proj", "down_proj_scale_inv"):
        t = getattr(module, attr, None)
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def bytes_per_weight(fmt: QuantFormat | None, dense_dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes per weight element including the scales (fp8 128x128 float32: 1 + 4/16384; fp4: 0.5 + 1/32)."""
    if fmt is None:
        return torch.empty(0, dtype=dense_dtype).element_size()
    bn, bk = fmt.block_size
    scale = 1 if fmt.scale_format == "ue8m0" else 4
    return (0.5 if fmt.weight_format == "fp4" else 1.0) + scale / (bn * bk)
