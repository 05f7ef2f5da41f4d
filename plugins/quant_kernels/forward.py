"""Adapter from a quantised Transformers-style experts module (see selector/quant/) to the kernels.

``quant_experts_forward(module, hidden_states, top_k_index, top_k_weights, mode)`` is what `batched_mm`
(mode "batched": one pair per program, no sorting) and `grouped_mm` (mode "grouped": pairs sorted by expert,
tensor-core grouped GEMM) run for fp8_block / fp4 experts. Layers whose gate is act(gate) * up with a known
activation and no post-expert norm run entirely in the kernels (one custom op); others (a module-specific
gate such as GPT-OSS's, another activation, a post-expert norm) run the projections in the kernels and that
code in torch between them.

What the module holds is checked once per set of weights (a cached plan). On a GPU the in-kernel path is
recorded once per (module, shape) in a CUDA graph and replayed, as the fused backend does (selector.graphs: on
first use up to 64 tokens, on a shape's second call up to 4096): inputs are copied into the graph's buffers, the
graph replays, the output is cloned out.
`SELECTOR_QUANT_GRAPHS=0` turns that off; it is never used while torch.compile traces or a caller captures.
"""

from __future__ import annotations

import torch
from selector.plugins.quant_kernels.layer import MODES, layer_forward
from selector.plugins.quant_kernels.projection import run_projection
from selector.plugins.quant_kernels.records import LINEAR, Epilogue, QuantLayer, QuantWeights, WeightFormat
from selector.plugins.quant_kernels.routing import combine_slots, route
import selector.plugins.triton_common.guard  # noqa: F401 - registers the one-launch sanitiser

from selector import graphs, layers
from selector.guard import sanitize_routing
from selector.problem import activation_name, has_custom_gate
from selector.quant import QuantFormat, is_ue8m0_tensor, quant_format

KERNEL_ACTIVATIONS = frozenset({"silu", "gelu", "gelu_tanh", "relu"})
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fail(message: str) -> ValueError:
    return ValueError(f"quantised experts: {message}")


def _check_projection(name: str, w: torch.Tensor, s: torch.Tensor, fmt: QuantFormat, rows: int, k_in: int,
                      num_experts: int, scale_rows: int) -> None:  # fmt: skip
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


class _Plan:
    """What a forward needs from the module, checked once per set of weights (not on every call)."""

    def __init__(self, module: torch.nn.Module, hidden: int) -> None:
        fmt = quant_format(module)
        if fmt is None:
            raise _fail("the module has dense weights (selector_weight_format is 'dense')")
        gated = bool(getattr(module, "has_gate", True))
        interleaved = gated and not getattr(module, "is_concatenated", True)
        if getattr(module, "is_transposed", False):
            raise _fail("quantised weights are stored [E, out, in]; is_transposed must be False")
        num_experts = int(module.num_experts)
        up_name = "gate_up_proj" if gated else "up_proj"
        w1, s1 = getattr(module, up_name), getattr(module, f"{up_name}_scale_inv")
        w2, s2 = module.down_proj, module.down_proj_scale_inv
        fp4 = fmt.weight_format == "fp4"
        bn, _ = fmt.block_size
        c = w1.shape[1]
        inter = c // 2 if gated else c
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
        self.post_norm = bool(getattr(module, "has_post_expert_norm", False))
        self.in_kernel = act in KERNEL_ACTIVATIONS and not self.post_norm and not (gated and has_custom_gate(module))
        self.compute = compute
        self.hidden, self.inter = hidden, inter
        split = inter if gated and not interleaved else None
        # the launches' records, built once per set of weights (the eager hot path builds none)
        self.up = QuantWeights(w1, s1, layers.up_bias(module), as1)
        self.down = QuantWeights(w2, s2, layers.down_bias(module), as2)
        self.fmt = WeightFormat(num_experts, fp4, fmt.scale_format == "ue8m0", bn, fmt.activation_group)
        self.layer = QuantLayer(self.up, self.down, self.fmt, Epilogue(gated, interleaved, act, split))
        self.up_between = Epilogue(split_inter=split)  # torch runs the gate / activation after this projection
        self.device = w1.device


_TENSORS = ("gate_up_proj", "gate_up_proj_scale_inv", "up_proj", "up_proj_scale_inv", "down_proj",
            "down_proj_scale_inv", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias",
            "gate_up_proj_activation_scale", "down_proj_activation_scale")  # fmt: skip


_FLAGS = ("has_gate", "is_concatenated", "has_bias", "is_transposed", "has_post_expert_norm", "selector_weight_format",
          "selector_scale_format", "selector_block_size", "selector_activation_quant", "selector_compute_dtype")  # fmt: skip


def _plan_key(module: torch.nn.Module, hidden: int) -> tuple:
    """What makes a cached plan stale, read cheaply (every eager call): the weight tensors (object, storage,
    dtype, shape), the activation, and the layout and format attributes set on the module itself (a class
    attribute is the same on every call). Straight from the module's dicts: nn.Module.__getattr__ raising for
    an absent name costs a microsecond each."""
    d = module.__dict__
    params, buffers = d["_parameters"], d["_buffers"]
    found = [params.get(n) if n in params else buffers.get(n, d.get(n)) for n in _TENSORS]
    return (hidden, type(module), d["_modules"].get("act_fn", d.get("act_fn")), *[d.get(n) for n in _FLAGS],
            *[(id(t), t.data_ptr(), t.dtype, t.shape) if t is not None else None for t in found])  # fmt: skip


def _plan(module: torch.nn.Module, hidden: int) -> _Plan:
    if torch.compiler.is_compiling():  # traced once per compiled shape; no data pointers while tracing
        return _Plan(module, hidden)
    key = _plan_key(module, hidden)
    cached = module.__dict__.get("_selector_quant_plan")
    if cached is None or cached[0] != key:
        cached = (key, _Plan(module, hidden))
        module.__dict__["_selector_quant_plan"] = cached
    return cached[1]


def _direct(plan: _Plan, module: torch.nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, mode: str, config: dict | None) -> torch.Tensor:  # fmt: skip
    # bad slots -> expert 0 with weight NaN (selector.guard); inside the recorded graph when one replays
    top_k_index, top_k_weights = sanitize_routing(module, top_k_index, top_k_weights)
    if plan.in_kernel:
        return layer_forward(x, top_k_index, top_k_weights, plan.layer, mode, config)
    # torch between the projections: the module's own gate / activation, and its post-expert norm
    num_tokens, top_k = top_k_index.shape
    out = torch.empty((num_tokens, plan.hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    ids = top_k_index.reshape(-1).contiguous()
    wts = top_k_weights.reshape(-1).contiguous()
    routing = route(mode, ids, plan.fmt.num_experts, config, top_k)
    whole = {**(config or {}), "SPLIT_K": 1}  # torch code below needs whole outputs, not partial sums
    h = run_projection(mode, x, plan.up, plan.fmt, routing, ids.numel(), a_div=top_k, epilogue=plan.up_between,
                       config=whole)  # fmt: skip
    h = layers.activate(module, h).to(x.dtype).contiguous()
    down_config = whole if plan.post_norm else config  # the combine adds a split down's shares; a norm cannot
    y = run_projection(mode, h, plan.down, plan.fmt, routing, ids.numel(), a_div=1, epilogue=LINEAR,
                       topk_w=None if plan.post_norm else wts, config=down_config)  # fmt: skip
    if plan.post_norm:
        y = (layers.post_norm(module, y).float() * wts.float().unsqueeze(-1)).to(x.dtype)
    return combine_slots(y, ids, out, top_k, plan.fmt.num_experts)


# ---- replay a recorded CUDA graph (launching the Triton kernels from Python can cost more than they run)

GRAPH_MAX_TOKENS = graphs.REPEAT_TOKENS  # recorded on first use up to graphs.DECODE_TOKENS, above when repeated


def _graphs_enabled(x: torch.Tensor, plan: _Plan, config: dict | None) -> bool:
    return plan.in_kernel and config is None and graphs.graphs_enabled(x, GRAPH_MAX_TOKENS, "SELECTOR_QUANT_GRAPHS")


def quant_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
    mode: str = "grouped",
    config: dict | None = None,
) -> torch.Tensor:  # [T, H]
    """Quantised experts forward; `mode` "grouped" or "batched"; `config` overrides the tile heuristics."""
    if mode not in MODES:
        raise _fail(f"mode {mode!r}: expected one of {MODES}")
    plan = _plan(module, hidden_states.shape[1])
    if plan.device != hidden_states.device:
        raise _fail(f"weights are on {plan.device}, hidden_states on {hidden_states.device}")
    dtype = hidden_states.dtype
    x = hidden_states if plan.compute in (None, dtype) else hidden_states.to(plan.compute)  # .to costs host time
    if x.dtype not in COMPUTE_DTYPES:
        raise _fail(f"compute dtype {x.dtype} is not supported (float32, bfloat16, float16)")
    x = x if x.stride(1) == 1 else x.contiguous()
    if not _graphs_enabled(x, plan, config):
        out = _direct(plan, module, x, top_k_index, top_k_weights, mode, config)
    else:
        key = (id(plan), mode, x.shape, x.dtype, top_k_index.shape, top_k_index.dtype, top_k_weights.dtype, x.device)

        def run(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return _direct(plan, module, a, b, c, mode, None)

        out = graphs.replay(module, "quant", key, run, (x, top_k_index, top_k_weights))
    return out if out.dtype == dtype else out.to(dtype)


def quant_batched_forward(module, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
    return quant_experts_forward(module, hidden_states, top_k_index, top_k_weights, mode="batched")


def quant_grouped_forward(module, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
    return quant_experts_forward(module, hidden_states, top_k_index, top_k_weights, mode="grouped")
