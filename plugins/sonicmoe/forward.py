"""SonicMoE adapter: Transformers' experts layout -> `moe_general_routing_inputs`.

The kernel takes the flat (token, expert) pairs with token indices sorted ascending (int32), router scores,
and the weights as w1 (2I, H, E) and w2 (H, I, E) in stride order (2, 0, 1), i.e. permuted views of
contiguous (E, 2I, H) / (E, H, I) tensors. The standard layout [E, 2I, H] / [E, H, I] permutes to that for
free; the transposed layout [E, H, 2I] / [E, I, H] is copied once into it at prepare time and held by the
plan (one more copy of the expert weights in memory; copied per run while autograd differentiates the
weights, so their gradients reach the parameters). Gate/up rows
are interleaved by default; concatenated [gate | up] is the kernel's `concat_layout` flag, or, on a kernel
without that flag, an interleaved copy. Expert-parallel sentinel slots go to expert 0 with weight 0 (no host
sync, whatever the kernel does with out-of-range ids), and the token count is padded to the bucket of
`selector.plugins.sonicmoe.padded_tokens` with zero rows of weight 0 to bound JIT compiles.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from selector.plugins.adapter import KernelPlan, differentiates_weights, forward_of, kernel_routing
from selector.plugins.sonicmoe import ACTIVATION_TYPES, KERNEL, SHAPES, TOKENS, padded_tokens, problem_key

from selector import hub, layers
from selector.problem import activation_name, has_custom_gate
from selector.types import ExpertsForward, Problem

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


def load_sonicmoe() -> SonicMoE:
    """The hub kernel's entry points, read again when the hub hands out another module (tests swap fakes)."""
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


def kernel_weights(module: torch.nn.Module, interleave: bool) -> tuple:
    """(w1 (2I, H, E), w2 (H, I, E), b1 or None, b2 or None) in the kernel's stride order: permuted views of the
    parameters where they are in its layout, else copies."""
    up, down = module.gate_up_proj, module.down_proj
    bias = layers.up_bias(module)
    transposed = bool(getattr(module, "is_transposed", False))
    w1 = up.transpose(1, 2) if transposed else up  # [E, 2I, H]
    w2 = down.transpose(1, 2) if transposed else down  # [E, H, I]
    if interleave:
        w1, bias = _interleave_rows(w1, 1), None if bias is None else _interleave_rows(bias, 1)
    return w1.contiguous().permute(1, 2, 0), w2.contiguous().permute(1, 2, 0), bias, layers.down_bias(module)


@dataclass(frozen=True, kw_only=True)
class SonicMoEPlan(KernelPlan):
    kernel: SonicMoE
    activation: object  # the kernel's ActivationType member
    num_experts: int
    flags: tuple[tuple[str, object], ...]  # the kernel's keyword flags (stream, concatenated layout)

    def launch(self, module: torch.nn.Module, weights: tuple, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        (w1, w2, b1, b2), (ids, routing) = weights, kernel_routing(module, top_k_index, top_k_weights)
        (num_tokens, top_k), hidden = top_k_index.shape, hidden_states.shape[-1]
        x = hidden_states.to(w1.dtype).contiguous()
        rows = padded_tokens(num_tokens)
        if rows > num_tokens:  # dummy tokens: zero input, distinct experts, weight 0
            extra = rows - num_tokens
            x = torch.cat([x, x.new_zeros(extra, hidden)])
            dummy = torch.arange(top_k, device=ids.device, dtype=torch.int32) % self.num_experts
            ids = torch.cat([ids, dummy.expand(extra, top_k)])
            routing = torch.cat([routing, routing.new_zeros(extra, top_k)])
        token_indices = torch.arange(rows, device=ids.device, dtype=torch.int32).repeat_interleave(top_k)
        out, _ = self.kernel.run(x, routing.reshape(-1), token_indices, ids.reshape(-1), w1, b1, w2, b2,
                                 E=self.num_experts, activation_type=self.activation,
                                 is_inference_mode_enabled=not torch.is_grad_enabled(), **dict(self.flags))  # fmt: skip
        TOKENS.record((self.shape, rows))
        return out[:num_tokens].to(hidden_states.dtype)


def prepare(module: torch.nn.Module, problem: Problem) -> KernelPlan:
    """The kernel loaded, the layer checked and its weights in the kernel's layout, once per weights and call
    mode (per run where autograd differentiates the weights)."""
    activation = kernel_activation(module)
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(
            "experts backend 'sonicmoe' cannot apply a post-expert norm (the kernel fuses the sum over experts). "
            "fix: pick grouped_mm or eager for this layer."
        )
    kernel = load_sonicmoe()
    concatenated = bool(getattr(module, "is_concatenated", True))
    flags = (("stream_id", None),) if kernel.takes_stream else ()
    if kernel.concat_flag is not None:
        flags += ((kernel.concat_flag, concatenated),)
    # a kernel without the concatenated flag reads interleaved rows only: an interleaved copy
    convert = functools.partial(kernel_weights, interleave=concatenated and kernel.concat_flag is None)
    return SonicMoEPlan.prepared(module, convert, differentiates_weights(problem), backend="sonicmoe", kernel=kernel,
                                 activation=getattr(kernel.activation_type, activation),
                                 num_experts=int(module.num_experts), flags=flags, ledger=SHAPES,
                                 shape=problem_key(problem))  # fmt: skip


sonicmoe_experts_forward = forward_of(prepare)


@torch.no_grad()
def warm_up(module: torch.nn.Module, token_counts: Sequence[int], top_k: int) -> None:
    """Run the kernel once per token bucket on zeros, so later calls of this shape start warm."""
    device = module.gate_up_proj.device
    hidden = layers.dims(module)[1]
    for count in sorted({padded_tokens(int(c)) for c in token_counts if int(c) > 0}):
        ids = (torch.arange(top_k, device=device) % module.num_experts).expand(count, top_k)
        x = torch.zeros(count, hidden, dtype=module.gate_up_proj.dtype, device=device)
        sonicmoe_experts_forward(module, x, ids, torch.zeros(count, top_k, device=device))


def load() -> ExpertsForward:
    return sonicmoe_experts_forward
