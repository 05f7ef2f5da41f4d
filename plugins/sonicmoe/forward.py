"""SonicMoE adapter: Transformers' experts layout -> `moe_general_routing_inputs`.

The kernel takes the flat (token, expert) pairs with token indices sorted ascending (int32), router scores,
and the weights as w1 (2I, H, E) and w2 (H, I, E) in stride order (2, 0, 1), i.e. permuted views of
contiguous (E, 2I, H) / (E, H, I) tensors. The standard layout [E, 2I, H] / [E, H, I] permutes to that for
free; the transposed layout [E, H, 2I] / [E, I, H] is copied once into it and the copy is cached on the
module (one more copy of the expert weights in memory; refreshed when the parameters change; not cached
while the weights need gradients). Gate/up rows
are interleaved by default; concatenated [gate | up] is the kernel's `concat_layout` flag, or, on a kernel
without that flag, an interleaved copy. Expert-parallel sentinel slots go to expert 0 with weight 0 (no host
sync, whatever the kernel does with out-of-range ids), and the token count is padded to the bucket of
`selector.plugins.sonicmoe.padded_tokens` with zero rows of weight 0 to bound JIT compiles.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import selector.plugins.triton_common.guard  # noqa: F401 - registers the one-launch sanitiser

from selector import hub, layers
from selector.guard import sanitize_routing
from selector.problem import activation_name, dtype_name, has_custom_gate
from selector.weight_cache import DerivedWeights, fingerprint

from selector.plugins.sonicmoe.warmth import ACTIVATION_TYPES, KERNEL, padded_tokens, record_compiled, shape_key

REQUIRED = ("moe_general_routing_inputs", "enums.ActivationType")
CONCAT_FLAGS = ("concat_layout", "is_concatenated_gate_up")  # 0.1.2.post1; later sources


@dataclass(frozen=True)
class SonicMoE:
    run: Callable
    activation_type: type
    takes_stream: bool
    concat_flag: str | None
    module: object


_SONICMOE: SonicMoE | None = None
_WEIGHTS: DerivedWeights[tuple] = DerivedWeights()  # (w1 (2I, H, E), w2 (H, I, E), b1 or None)


def load_sonicmoe() -> SonicMoE:
    global _SONICMOE
    module = hub.load_kernel(KERNEL, REQUIRED, backend="sonicmoe")
    if _SONICMOE is None or _SONICMOE.module is not module:
        run = module.moe_general_routing_inputs
        try:
            params = set(inspect.signature(run).parameters)
        except (TypeError, ValueError):
            params = {"stream_id", "concat_layout"}
        _SONICMOE = SonicMoE(
            run=run,
            activation_type=hub.resolve_symbol(module, "enums.ActivationType"),
            takes_stream="stream_id" in params,
            concat_flag=next((f for f in CONCAT_FLAGS if f in params), None),
            module=module,
        )
    return _SONICMOE


def kernel_activation(module: torch.nn.Module) -> str:
    """SWIGLU / GEGLU / REGLU for this layer, or ImportError naming what SonicMoE cannot run."""
    act = activation_name(getattr(module, "act_fn", None))
    gated = bool(getattr(module, "has_gate", True))
    what = None
    if not gated:
        what = "non-gated experts"
    elif has_custom_gate(module):
        what = "a custom gate function"
    elif act not in ACTIVATION_TYPES:
        what = f"the gated activation {act!r}"
    if what is not None:
        raise ImportError(
            f"experts backend 'sonicmoe' has no kernel for {what}: SonicMoE fuses gated silu/gelu/relu only "
            "(SwiGLU, GeGLU, ReGLU). fix: pick another experts backend for this layer, e.g. grouped_mm, "
            "triton_fused or eager."
        )
    return ACTIVATION_TYPES[act]


def _interleave_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[gate | up] along `dim` -> [gate0, up0, gate1, up1, ...]."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def kernel_weights(module: torch.nn.Module, interleave: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(w1 (2I, H, E), w2 (H, I, E), b1 or None) in the kernel's stride order; copies cached on the module."""
    up, down = module.gate_up_proj, module.down_proj
    bias = layers.up_bias(module)
    transposed = bool(getattr(module, "is_transposed", False))

    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        w1 = up.transpose(1, 2) if transposed else up  # [E, 2I, H]
        w2 = down.transpose(1, 2) if transposed else down  # [E, H, I]
        b1 = bias
        if interleave:
            w1, b1 = _interleave_rows(w1, 1), None if bias is None else _interleave_rows(bias, 1)
        return w1.contiguous().permute(1, 2, 0), w2.contiguous().permute(1, 2, 0), b1

    def copied(value: tuple) -> bool:  # views of the parameters need no keeping; copies do
        return interleave or value[0].data_ptr() != up.data_ptr() or value[1].data_ptr() != down.data_ptr()

    # a kept copy would cut the weights' gradients: keep one only when none is wanted
    cacheable = not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (up, down, bias)))
    key = fingerprint((up, down, bias)) + (interleave, transposed)
    return _WEIGHTS.get(module, key, build, cache=cacheable, keep=copied)


def sonicmoe_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    activation = kernel_activation(module)
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(
            "experts backend 'sonicmoe' cannot apply a post-expert norm (the kernel fuses the sum over experts). "
            "fix: pick grouped_mm or eager for this layer."
        )
    kernel = load_sonicmoe()
    num_tokens, top_k = top_k_index.shape
    num_experts = module.num_experts
    hidden = hidden_states.shape[-1]
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden)
    dtype = module.gate_up_proj.dtype
    x = hidden_states.to(dtype).contiguous()
    # bad slots -> expert 0 with weight NaN (selector.guard): the kernel reads no expert out of bounds
    top_k_index, top_k_weights = sanitize_routing(module, top_k_index, top_k_weights)
    ids = top_k_index.to(torch.int32)
    weights = top_k_weights.float()
    if layers.is_expert_parallel(module):
        sentinel = ids >= num_experts
        ids, weights = ids.masked_fill(sentinel, 0), weights.masked_fill(sentinel, 0.0)

    rows = padded_tokens(num_tokens)
    if rows > num_tokens:  # dummy tokens: zero input, distinct experts, weight 0
        extra = rows - num_tokens
        x = torch.cat([x, x.new_zeros(extra, hidden)])
        dummy_ids = (torch.arange(top_k, device=ids.device, dtype=torch.int32) % num_experts).expand(extra, top_k)
        ids = torch.cat([ids, dummy_ids])
        weights = torch.cat([weights, weights.new_zeros(extra, top_k)])
    token_indices = torch.arange(rows, device=ids.device, dtype=torch.int32).repeat_interleave(top_k)

    concatenated = bool(getattr(module, "is_concatenated", True))
    interleave_copy = concatenated and kernel.concat_flag is None
    w1, w2, b1 = kernel_weights(module, interleave=interleave_copy)
    b2 = layers.down_bias(module)
    extra_kwargs: dict[str, object] = {}
    if kernel.takes_stream:
        extra_kwargs["stream_id"] = None
    if kernel.concat_flag is not None:
        extra_kwargs[kernel.concat_flag] = concatenated
    out, _ = kernel.run(
        x,
        weights.reshape(-1),
        token_indices,
        ids.reshape(-1),
        w1,
        b1,
        w2,
        b2,
        E=num_experts,
        activation_type=getattr(kernel.activation_type, activation),
        is_inference_mode_enabled=not torch.is_grad_enabled(),
        **extra_kwargs,
    )
    inter = module.down_proj.shape[1] if module.is_transposed else module.down_proj.shape[2]
    key = shape_key(num_experts, hidden, inter, top_k, dtype_name(dtype),
                    activation_name(getattr(module, "act_fn", None)), b1 is not None, not concatenated)
    record_compiled(key, rows)
    return out[:num_tokens].to(hidden_states.dtype)


@torch.no_grad()
def warm_up(module: torch.nn.Module, token_counts: Sequence[int], top_k: int) -> None:
    """Run the kernel once per token bucket on zeros, so later calls of this shape start warm."""
    device = module.gate_up_proj.device
    hidden = layers.dims(module)[1]
    for count in sorted({padded_tokens(int(c)) for c in token_counts if int(c) > 0}):
        ids = (torch.arange(top_k, device=device) % module.num_experts).expand(count, top_k)
        x = torch.zeros(count, hidden, dtype=module.gate_up_proj.dtype, device=device)
        sonicmoe_experts_forward(module, x, ids, torch.zeros(count, top_k, device=device))
