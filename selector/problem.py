"""Builds the `Problem` the ranking sees from a live experts module."""

from __future__ import annotations

import torch

from selector import layers
from selector.gates import DEFAULT_GATE, Gate, clamped_swiglu
from selector.types import Problem

# act_fn class name -> the activation name backends declare
_ACTIVATIONS = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "ReLU": "relu",
    "GELUActivation": "gelu",
    "GELU": "gelu",
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "FastGELUActivation": "gelu_tanh",
}
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def activation_name(act_fn: object) -> str:
    """'silu', 'gelu', 'gelu_tanh', 'relu', or 'custom:<name>' for anything else."""
    if isinstance(act_fn, torch.nn.GELU):
        return "gelu_tanh" if act_fn.approximate == "tanh" else "gelu"
    fn = act_fn if callable(act_fn) and not isinstance(act_fn, torch.nn.Module) else None
    if fn is torch.nn.functional.silu:
        return "silu"
    if fn is torch.nn.functional.relu or fn is torch.relu:
        return "relu"
    name = type(act_fn).__name__ if fn is None else getattr(fn, "__name__", "function")
    return _ACTIVATIONS.get(name, f"custom:{name}")


def has_custom_gate(module: torch.nn.Module) -> bool:
    """True when the module's class brings its own _apply_gate (not act(gate) * up)."""
    gate = getattr(type(module), "_apply_gate", None)
    if gate is None or gate is layers.default_apply_gate:
        return False
    # Transformers' own default gate computes the same thing as ours
    return not (gate.__name__ == "_default_apply_gate" and gate.__module__.startswith("transformers."))


def _is_transformers_gpt_oss_gate(fn: object) -> bool:
    """Transformers' GptOssExperts._apply_gate (or the same function bound to a subclass or another class)."""
    module = getattr(fn, "__module__", "") or ""
    return module.startswith("transformers.models.gpt_oss.") and getattr(fn, "__name__", "") == "_apply_gate"


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _function_name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__)


def gate_of(module: torch.nn.Module) -> Gate | None:
    """The module's gate as data (selector.gates), or None when its _apply_gate is Python the selector does not
    recognise. In order: a declared `selector_gate` (class or instance attribute, `selector.experts(gate=...)`;
    ignored over the default `_apply_gate`, which torch backends would run as act(gate) * up);
    selector's own `layers.clamped_swiglu`; Transformers' GPT-OSS gate with the module's `alpha` and `limit`;
    the default act(gate) * up. The clamped SwiGLU functions read interleaved channels only, so a concatenated
    layout with one of them stays a custom gate."""
    declared = getattr(module, "selector_gate", None)
    custom = has_custom_gate(module)
    # a declaration counts where torch backends run the same: over the default _apply_gate they run act_mul
    if isinstance(declared, Gate) and (custom or declared.is_default):
        return declared
    if not custom:
        return DEFAULT_GATE
    fn = getattr(type(module), "_apply_gate", None)
    interleaved = not getattr(module, "is_concatenated", True)
    if fn is layers.clamped_swiglu and interleaved:
        return clamped_swiglu(layers.GPT_OSS_ALPHA, layers.GPT_OSS_LIMIT)
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if _is_transformers_gpt_oss_gate(fn) and interleaved and _number(alpha) and _number(limit):
        try:
            return clamped_swiglu(float(alpha), float(limit))
        except ValueError:  # a limit the gate cannot take (<= 0): the module's own Python runs it
            return None
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).replace("torch.", ""))


def problem_from_module(module: torch.nn.Module, num_tokens: int | None = None, top_k: int = 1) -> Problem:
    weight = layers.up_weight(module)
    num_experts, hidden, inter = layers.dims(module)
    device = weight.device
    gated = bool(getattr(module, "has_gate", True))
    recognised = gate_of(module) if gated else DEFAULT_GATE
    custom = recognised is None
    gate = DEFAULT_GATE if recognised is None else recognised
    return Problem(
        num_experts=int(getattr(module, "num_experts", num_experts)),
        hidden_size=hidden,
        intermediate_size=inter,
        top_k=top_k,
        # quantised experts (selector.quant) run in the dtype they were quantised from, not their weights' one
        dtype=dtype_name(getattr(module, "selector_compute_dtype", None) or weight.dtype),
        device=device.type,
        device_index=device.index or 0,
        # a gate other than act_mul is the whole function between the projections: it names the activation
        activation=activation_name(getattr(module, "act_fn", None)) if gate.is_default else gate.name,
        gated=gated,
        has_bias=bool(getattr(module, "has_bias", False)),
        is_transposed=bool(getattr(module, "is_transposed", False)),
        interleaved=not getattr(module, "is_concatenated", True),
        custom_gate=custom,
        gate=gate,
        gate_source=_function_name(getattr(type(module), "_apply_gate", None)) if custom else "",
        post_expert_norm=bool(getattr(module, "has_post_expert_norm", False)),
        weight_format=str(getattr(module, "selector_weight_format", "dense")),
        scale_format=getattr(module, "selector_scale_format", None),
        activation_quant=str(getattr(module, "selector_activation_quant", None) or "dynamic"),
        expert_parallel=layers.is_expert_parallel(module),
        num_tokens=num_tokens,
        compile=torch.compiler.is_compiling(),
    )
