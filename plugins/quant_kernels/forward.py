"""Adapter from a quantised Transformers-style experts module (see selector/quant/) to the kernels.

``quant_experts_forward(module, hidden_states, top_k_index, top_k_weights, mode)`` is what `batched_mm`
(mode "batched": one pair per program, no sorting) and `grouped_mm` (mode "grouped": pairs sorted by expert,
tensor-core grouped GEMM) run for fp8_block / fp4 experts. Layers whose gate is act(gate) * up with a known
activation and no post-expert norm run entirely in the kernels (one custom op); others (a module-specific
gate such as GPT-OSS's, another activation, a post-expert norm) run the projections in the kernels and that
code in torch between them.

What the module holds is read and checked once per set of weights and kind of call, into a ``QuantPlan``
(``prepare_quantised``: the dispatch core keeps it). On a GPU the dispatch core replays the in-kernel path from
recorded CUDA graphs, as for the fused backend (the plan's GraphPolicy; selector.graphs: on first use up to 64
tokens, on a shape's second call up to 4096); `SELECTOR_QUANT_GRAPHS=0` turns that off. The plain forwards read
the plan on each call and replay nothing.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
from selector.plugins.quant_kernels.layer import MODES, layer_forward
from selector.plugins.quant_kernels.projection import Activations, run_projection
from selector.plugins.quant_kernels.records import (
    Epilogue,
    Projection,
    QuantLayer,
    QuantWeights,
    WeightFormat,
    quant_layer,
)
from selector.plugins.quant_kernels.routing import combine_slots, route
from selector.plugins.triton_common.guard import sanitize_with

from selector import graphs, layers
from selector.guard import guard_code
from selector.guard import resolve as resolve_guard
from selector.problem import activation_name, has_custom_gate
from selector.quant import QuantFormat, is_ue8m0_tensor, quant_format
from selector.types import ExpertsPlan, GraphPolicy, Problem

KERNEL_ACTIVATIONS = frozenset({"silu", "gelu", "gelu_tanh", "relu"})
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fail(message: str) -> ValueError:
    return ValueError(f"quantised experts: {message}")


def _check_projection(
    name: str,
    w: torch.Tensor,
    s: torch.Tensor,
    fmt: QuantFormat,
    rows: int,
    k_in: int,
    num_experts: int,
    scale_rows: int,
) -> None:
    fp4 = fmt.weight_format == "fp4"
    want_dtype = "int8/uint8 (two e2m1 per byte)" if fp4 else "float8_e4m3fn"
    ok_dtype = w.dtype in (torch.int8, torch.uint8) if fp4 else w.dtype == torch.float8_e4m3fn
    if not ok_dtype:
        raise _fail(f"{name} must be {want_dtype} for {fmt.weight_format}, got {w.dtype}")
    want = (num_experts, rows, k_in // 2 if fp4 else k_in)
    if tuple(w.shape) != want:
        raise _fail(f"{name} must be {list(want)} ([E, out, in]{', in packed' if fp4 else ''}), got {list(w.shape)}")
    if w.stride(2) != 1:
        raise _fail(f"{name} must be contiguous along its input dim")
    bk = fmt.block_size[1]
    want_s = (num_experts, scale_rows, -(-k_in // bk))
    if s.dim() != 3 or tuple(s.shape) != want_s:
        raise _fail(f"{name}_scale_inv must be {list(want_s)} for block {fmt.block_size}, got {list(s.shape)}")
    if fmt.scale_format == "ue8m0" and not is_ue8m0_tensor(s):
        raise _fail(f"{name}_scale_inv must hold UE8M0 bytes (float8_e8m0fnu or uint8), got {s.dtype}")
    if fmt.scale_format == "float32" and s.dtype != torch.float32:
        raise _fail(f"{name}_scale_inv must be float32 for scale format float32, got {s.dtype}")
    if w.device != s.device:
        raise _fail(f"{name} is on {w.device} but its scales on {s.device}")


@dataclass(frozen=True, kw_only=True)
class QuantPlan(ExpertsPlan):
    """One quantised layer for one kind of call, read and checked once: its records, whether it runs entirely in
    the kernels (act(gate) * up with a kernel activation, no post-expert norm), the compute dtype, the routing
    guard's code, and `mode` ("grouped" / "batched").

    A layer whose gate or norm is torch code calls the module's own (its `_apply_gate`, act_fn, post-expert
    norm): for that path alone the plan holds the module, weakly."""

    layer: QuantLayer
    mode: str
    config: dict | None = None
    in_kernel: bool
    post_norm: bool
    compute: torch.dtype | None
    hidden: int
    device: torch.device
    guard: int
    module: weakref.ref | None  # the torch-between path only
    up_between: Projection | None  # the torch-between path: gate_up without its epilogue (torch runs the gate)

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states if self.compute in (None, dtype) else hidden_states.to(self.compute)  # .to costs host time
        if x.dtype not in COMPUTE_DTYPES:
            raise _fail(f"compute dtype {x.dtype} is not supported (float32, bfloat16, float16)")
        x = x if x.stride(1) == 1 else x.contiguous()
        # bad slots -> expert 0 with weight NaN (selector.guard); inside the recorded graph when one replays
        guard = resolve_guard(self.guard, top_k_index.device, self.layer.fmt.num_experts) if self.guard else None
        top_k_index, top_k_weights = sanitize_with(guard, top_k_index, top_k_weights)
        if self.in_kernel:
            out = layer_forward(x, top_k_index, top_k_weights, self.layer, self.mode, self.config)
        else:
            out = self._torch_between(x, top_k_index, top_k_weights)
        return out if out.dtype == dtype else out.to(dtype)

    def _torch_between(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The projections in the kernels, the module's own gate / activation and post-expert norm in torch."""
        module = self.module() if self.module is not None else None
        if module is None:
            raise RuntimeError("quantised experts: the module this plan was prepared for is gone")
        layer, mode, config = self.layer, self.mode, self.config
        num_tokens, top_k = top_k_index.shape
        out = torch.empty((num_tokens, self.hidden), dtype=x.dtype, device=x.device)
        if num_tokens == 0 or top_k == 0:
            return out.zero_()
        ids = top_k_index.reshape(-1).contiguous()
        wts = top_k_weights.reshape(-1).contiguous()
        routing = route(mode, ids, layer.fmt.num_experts, config, top_k)
        whole = {**(config or {}), "SPLIT_K": 1}  # torch code below needs whole outputs, not partial sums
        h = run_projection(mode, self.up_between, Activations(x, a_div=top_k), routing, ids.numel(), config=whole)
        h = layers.activate(module, h).to(x.dtype).contiguous()
        down_config = whole if self.post_norm else config  # the combine adds a split down's shares; a norm cannot
        y = run_projection(
            mode,
            layer.down_projection,
            Activations(h),
            routing,
            ids.numel(),
            topk_w=None if self.post_norm else wts,
            config=down_config,
        )
        if self.post_norm:
            y = (layers.post_norm(module, y).float() * wts.float().unsqueeze(-1)).to(x.dtype)
        return combine_slots(y, ids, out, top_k, layer.fmt.num_experts)


# Replayed from recorded CUDA graphs by the dispatch core: on first use up to graphs.DECODE_TOKENS, on a shape's
# second call up to this (launching the Triton kernels from Python can cost more than they run)
GRAPH_MAX_TOKENS = graphs.REPEAT_TOKENS
GRAPHS = GraphPolicy(GRAPH_MAX_TOKENS, "SELECTOR_QUANT_GRAPHS")


def _read(module: torch.nn.Module, mode: str, config: dict | None, backend: str, records_grad: bool) -> QuantPlan:
    """What a forward needs from the module, checked once per set of weights and kind of call."""
    if mode not in MODES:
        raise _fail(f"mode {mode!r}: expected one of {MODES}")
    fmt = quant_format(module)
    if fmt is None:
        raise _fail("the module has dense weights (selector_weight_format is 'dense')")
    gated = bool(getattr(module, "has_gate", True))
    interleaved = gated and not getattr(module, "is_concatenated", True)
    if getattr(module, "is_transposed", False):
        raise _fail("quantised weights are stored [E, out, in]; is_transposed must be False")
    num_experts = int(module.num_experts)
    up_name = "gate_up_proj" if gated else "up_proj"
    w1, s1 = layers.tensor(module, up_name), getattr(module, f"{up_name}_scale_inv")
    w2, s2 = layers.tensor(module, "down_proj"), module.down_proj_scale_inv
    fp4 = fmt.weight_format == "fp4"
    bn, _ = fmt.block_size
    c = w1.shape[1]
    inter = c // 2 if gated else c
    hidden = w1.shape[2] * (2 if fp4 else 1)  # gate_up's input channels (fp4: two per byte)
    if fp4:
        rows1, rows2 = c, hidden
    else:
        rows1 = 2 * -(-inter // bn) if gated and not interleaved else -(-c // bn)
        rows2 = -(-hidden // bn)
    _check_projection(up_name, w1, s1, fmt, c, hidden, num_experts, rows1)
    _check_projection("down_proj", w2, s2, fmt, hidden, inter, num_experts, rows2)
    compute = getattr(module, "selector_compute_dtype", None)
    if compute is not None and compute not in COMPUTE_DTYPES:
        raise _fail(f"compute dtype {compute} is not supported (float32, bfloat16, float16)")
    as1 = as2 = None
    if fmt.activation_quant == "static":
        as1 = getattr(module, "gate_up_proj_activation_scale", None)
        as2 = getattr(module, "down_proj_activation_scale", None)
        if as1 is None or as2 is None or as1.numel() != num_experts or as2.numel() != num_experts:
            raise _fail(
                "static activation quantisation needs gate_up_proj_activation_scale and "
                f"down_proj_activation_scale with one float32 scale per expert ({num_experts})"
            )
        as1, as2 = as1.reshape(-1).float().contiguous(), as2.reshape(-1).float().contiguous()
    act = activation_name(getattr(module, "act_fn", None))
    post_norm = bool(getattr(module, "has_post_expert_norm", False))
    in_kernel = act in KERNEL_ACTIVATIONS and not post_norm and not (gated and has_custom_gate(module))
    split = inter if gated and not interleaved else None  # where the up half's scale rows restart
    layer = quant_layer(
        QuantWeights(w1, s1, layers.up_bias(module), as1),
        QuantWeights(w2, s2, layers.down_bias(module), as2),
        WeightFormat(num_experts, fp4, fmt.scale_format == "ue8m0", bn, fmt.activation_group),
        Epilogue(gated, interleaved, act, split),
    )
    # recorded graphs where the whole layer runs in the kernels with the tables' tiles (no explicit config)
    replay = in_kernel and config is None and not records_grad
    compiling = torch.compiler.is_compiling()
    return QuantPlan(
        backend=backend,
        graphs=GRAPHS if replay else None,
        opaque_when_compiled=True,  # its eager call (recorded graphs) beats its trace
        layer=layer,
        mode=mode,
        config=config,
        in_kernel=in_kernel,
        post_norm=post_norm,
        compute=compute,
        hidden=hidden,
        device=w1.device,
        guard=0 if compiling else guard_code(module, w1.device),  # no routing guard while tracing
        module=None if in_kernel else weakref.ref(module),
        up_between=None if in_kernel else replace(layer.up_projection, epilogue=Epilogue(split_inter=split)),
    )


def prepare_quantised(module: torch.nn.Module, problem: Problem, mode: str, backend: str) -> QuantPlan:
    """A backend's plan for a quantised layer (`problem.weight_format` fp8_block / fp4) run in `mode`."""
    return _read(module, mode, None, backend, problem.call.requires_grad)


def quant_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
    mode: str = "grouped",
    config: dict | None = None,
) -> torch.Tensor:  # [T, H]
    """Quantised experts forward; `mode` "grouped" or "batched"; `config` overrides the tile heuristics. The plan,
    read for this call and run, without graph replay (the dispatch core replays plans)."""
    records_grad = torch.is_grad_enabled() and hidden_states.requires_grad
    plan = _read(module, mode, config, f"quant_{mode}", records_grad)
    if plan.device != hidden_states.device:
        raise _fail(f"weights are on {plan.device}, hidden_states on {hidden_states.device}")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != plan.hidden:
        raise _fail(f"hidden_states must be [T, {plan.hidden}] for these weights, got {list(hidden_states.shape)}")
    return plan.run(hidden_states, top_k_index, top_k_weights)


def quant_batched_forward(module, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
    return quant_experts_forward(module, hidden_states, top_k_index, top_k_weights, mode="batched")


def quant_grouped_forward(module, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
    return quant_experts_forward(module, hidden_states, top_k_index, top_k_weights, mode="grouped")
