"""Builds the `Problem` the ranking sees from a live experts module."""

from __future__ import annotations

import torch

from selector import layers
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


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).replace("torch.", ""))


def problem_from_module(module: torch.nn.Module, num_tokens: int | None = None, top_k: int = 1) -> Problem:
    weight = layers.up_weight(module)
    num_experts, hidden, inter = layers.dims(module)
    device = weight.device
    return Problem(
        num_experts=int(getattr(module, "num_experts", num_experts)),
        hidden_size=hidden,
        intermediate_size=inter,
        top_k=top_k,
        # quantised experts (selector.quant) run in the dtype they were quantised from, not their weights' one
        dtype=dtype_name(getattr(module, "selector_compute_dtype", None) or weight.dtype),
        device=device.type,
        device_index=device.index or 0,
        activation=activation_name(getattr(module, "act_fn", None)),
        gated=bool(getattr(module, "has_gate", True)),
        has_bias=bool(getattr(module, "has_bias", False)),
        is_transposed=bool(getattr(module, "is_transposed", False)),
        interleaved=not getattr(module, "is_concatenated", True),
        custom_gate=bool(getattr(module, "has_gate", True)) and has_custom_gate(module),
        post_expert_norm=bool(getattr(module, "has_post_expert_norm", False)),
        weight_format=str(getattr(module, "selector_weight_format", "dense")),
        scale_format=getattr(module, "selector_scale_format", None),
        activation_quant=str(getattr(module, "selector_activation_quant", None) or "dynamic"),
        expert_parallel=layers.is_expert_parallel(module),
        num_tokens=num_tokens,
        compile=torch.compiler.is_compiling(),
    )
