"""The experts-module convention every backend reads, the same as Hugging Face Transformers' experts modules.

A module carries `num_experts`, `act_fn`, `gate_up_proj` [E, 2I, H] (or `up_proj` [E, I, H] when not gated),
`down_proj` [E, H, I]; transposed layouts swap the last two dims; optional `gate_up_proj_bias` [E, 2I] /
`up_proj_bias` and `down_proj_bias` [E, H]; flags `has_gate`, `has_bias`, `is_transposed`, `is_concatenated`
(False: gate/up channels interleaved), `has_post_expert_norm` (+ `post_expert_norm`), `_is_expert_parallel`
(an expert id equal to `num_experts` is then a sentinel that contributes nothing), and `_apply_gate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from selector.gates import CLAMPED_SWIGLU, GPT_OSS_ALPHA, GPT_OSS_LIMIT

if TYPE_CHECKING:
    import torch


def default_apply_gate(module: torch.nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, for concatenated [gate | up] or interleaved [g0, u0, g1, u1, ...] channels."""
    if getattr(module, "is_concatenated", True):
        gate, up = gate_up_out.chunk(2, dim=-1)
    else:
        gate, up = gate_up_out[..., ::2], gate_up_out[..., 1::2]
    return module.act_fn(gate) * up


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * (gate * alpha).sigmoid())  # Transformers' GptOssExperts order of operations


def clamped_swiglu(module: torch.nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's gate over interleaved channels: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""
    return _clamped_swiglu(gate_up_out[..., ::2], gate_up_out[..., 1::2], GPT_OSS_ALPHA, GPT_OSS_LIMIT)


def declared_apply_gate(module: torch.nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """The module's declared `selector_gate` (selector.gates) in torch, over concatenated or interleaved
    channels: what `selector.experts(gate=...)` installs as `_apply_gate`, so torch backends compute the gate
    the fused kernels run."""
    gate = module.selector_gate
    if gate.name != CLAMPED_SWIGLU:
        return default_apply_gate(module, gate_up_out)
    if getattr(module, "is_concatenated", True):
        g, up = gate_up_out.chunk(2, dim=-1)
    else:
        g, up = gate_up_out[..., ::2], gate_up_out[..., 1::2]
    return _clamped_swiglu(g, up, gate.alpha, gate.limit)


def tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """module.<name>, looked up in the module's parameters first: nn.Module finds a parameter through its Python
    __getattr__ (about 0.6 us), and every experts call reads a few of them. Buffers and plain attributes too."""
    found = module._parameters.get(name)
    return found if found is not None else getattr(module, name)


def up_weight(module: torch.nn.Module) -> torch.Tensor:
    """gate_up_proj for gated experts, up_proj otherwise."""
    return tensor(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj")


def down_weight(module: torch.nn.Module) -> torch.Tensor:
    return tensor(module, "down_proj")


def up_bias(module: torch.nn.Module) -> torch.Tensor | None:
    if not getattr(module, "has_bias", False):
        return None
    return tensor(module, "gate_up_proj_bias" if getattr(module, "has_gate", True) else "up_proj_bias")


def down_bias(module: torch.nn.Module) -> torch.Tensor | None:
    return tensor(module, "down_proj_bias") if getattr(module, "has_bias", False) else None


def activate(module: torch.nn.Module, up_out: torch.Tensor) -> torch.Tensor:
    """Gating (gated experts) or the plain activation (non-gated) on the up projection's output."""
    if getattr(module, "has_gate", True):
        return module._apply_gate(up_out)
    return module.act_fn(up_out)


def post_norm(module: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
    return module.post_expert_norm(out) if getattr(module, "has_post_expert_norm", False) else out


def is_expert_parallel(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "_is_expert_parallel", False))


def dims(module: torch.nn.Module) -> tuple[int, int, int]:
    """(E, H, I) read off the weights, whatever the layout."""
    w = up_weight(module)
    e = w.shape[0]
    out_dim, in_dim = (w.shape[2], w.shape[1]) if getattr(module, "is_transposed", False) else (w.shape[1], w.shape[2])
    if getattr(module, "selector_weight_format", "dense") == "fp4":
        in_dim *= 2  # two e2m1 values per byte along the input dim (selector.quant)
    inter = out_dim // 2 if getattr(module, "has_gate", True) else out_dim
    return e, in_dim, inter


# The class attribute `selector.experts` sets on a decorated experts class.
DECORATED = "_selector_experts"


def is_decorated(module: torch.nn.Module) -> bool:
    """An experts module whose class `selector.experts` decorated."""
    return bool(getattr(type(module), DECORATED, False))


def is_transformers_experts(module: torch.nn.Module) -> bool:
    """A module built by Transformers' `use_experts_implementation` (or following its convention)."""
    config = getattr(module, "config", None)
    return (
        config is not None
        and hasattr(config, "_experts_implementation")
        and "is_concatenated" in module.__dict__
        and hasattr(module, "down_proj")
        and (hasattr(module, "gate_up_proj") or hasattr(module, "up_proj"))
    )


def find_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every experts module of `model` selector runs, with its path: decorated modules and Transformers' experts
    modules."""
    return [(p, m) for p, m in model.named_modules() if is_decorated(m) or is_transformers_experts(m)]
