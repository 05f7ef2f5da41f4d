"""Sort by expert + grouped GEMM. Temporaries: the sorted [S, H] input and [S, 2I] / [S, H] outputs."""

from __future__ import annotations

import torch

from selector import layers
from selector.plugins.torch_common.routing import guarded_routing


@torch.library.custom_op("selector::grouped_mm_loop", mutates_args=())
def grouped_mm_loop(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] sorted by expert, weight [E, in, out], offsets [E] cumulative row ends -> [S, out]."""
    out = torch.zeros(x.shape[0], weight.shape[2], dtype=x.dtype, device=x.device)
    start = 0
    for expert, end in enumerate(offsets.tolist()):  # one host sync for the whole loop
        if end > start:
            torch.mm(x[start:end], weight[expert], out=out[start:end])
        start = end
    return out


@grouped_mm_loop.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("selector::grouped_mm_loop_weight_grad", mutates_args=())
def grouped_mm_loop_weight_grad(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The weight gradient of `grouped_mm_loop`: x [S, in], grad [S, out] -> [E, in, out], x_e^T @ grad_e per
    expert (zero for an expert without rows)."""
    out = torch.zeros(offsets.shape[0], x.shape[1], grad.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end].t(), grad[start:end], out=out[expert])
        start = end
    return out


@grouped_mm_loop_weight_grad.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offsets.shape[0], x.shape[1], grad.shape[1])


def _loop_setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    x, weight, offsets = inputs
    ctx.save_for_backward(x, weight, offsets)


def _loop_backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202 - torch.library's signature
    # rows sorted by expert: d x = grad @ W_e^T through the same loop, d W_e = x_e^T @ grad_e; offsets are integers
    x, weight, offsets = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = grouped_mm_loop(grad, weight.transpose(1, 2), offsets)
    if ctx.needs_input_grad[1]:
        grad_weight = grouped_mm_loop_weight_grad(x, grad, offsets)
    return grad_x, grad_weight, None


torch.library.register_autograd("selector::grouped_mm_loop", _loop_backward, setup_context=_loop_setup_context)


_CAPABILITY: dict[int, tuple[int, int]] = {}  # device index -> compute capability, asked once


def _native_ok(device_type: str, dtype: torch.dtype, device_index: int) -> bool:
    """Whether torch's grouped GEMM runs this device and dtype (CUDA: bf16 on compute capability >= 8.0)."""
    if not hasattr(torch.nn.functional, "grouped_mm"):
        return False
    if device_type == "cpu":
        return True
    if device_type == "cuda" and dtype == torch.bfloat16:
        if device_index not in _CAPABILITY:
            _CAPABILITY[device_index] = torch.cuda.get_device_capability(device_index)
        return _CAPABILITY[device_index] >= (8, 0)
    return False


def _aligned(t: torch.Tensor) -> bool:
    """torch's grouped GEMM wants 16-byte aligned data and strides (odd sizes take the loop)."""
    size = t.element_size()
    strides_ok = all((s * size) % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)
    if torch.compiler.is_compiling():  # no data pointers while tracing; inductor lowers grouped_mm for bf16 only
        return strides_ok and t.dtype == torch.bfloat16
    return strides_ok and t.data_ptr() % 16 == 0


def _grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None, transposed: bool
) -> torch.Tensor:
    w = weight if transposed else weight.transpose(1, 2)  # -> [E, in, out]
    if _native_ok(x.device.type, x.dtype, x.device.index or 0) and _aligned(x) and _aligned(w):
        out = torch.nn.functional.grouped_mm(x, w, offs=offsets)
    else:
        out = grouped_mm_loop(x, w, offsets)
    return out + bias if bias is not None else out


def _records_grad(module: torch.nn.Module, hidden: torch.Tensor, weights: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():
        return False
    return hidden.requires_grad or weights.requires_grad or any(p.requires_grad for p in module.parameters())


def grouped_mm_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    num_tokens, top_k = top_k_index.shape
    num_experts = module.num_experts
    transposed = getattr(module, "is_transposed", False)
    up_w = layers.up_weight(module)
    # bad slots -> the dropped id E with weight NaN: out of every matmul (an id of -1 would sort first and shift
    # every other token's rows; expert 0 would change that expert's batch), their tokens' rows NaN
    top_k_index, top_k_weights, guarded = guarded_routing(module, top_k_index, top_k_weights, drop=True)

    ids = top_k_index.reshape(-1)
    sorted_ids, order = torch.sort(ids, stable=True)  # sentinels and dropped slots (id == E) sort to the tail
    x = hidden_states.to(up_w.dtype)[order // top_k]  # [S, H]
    # histc, not bincount: no host sync, so CUDA graphs can capture it; values > E-1 (sentinels) drop out
    counts_in = sorted_ids.float() if ids.device.type == "cpu" else sorted_ids.int()
    counts = torch.histc(counts_in, bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)

    up_b, down_b = layers.up_bias(module), layers.down_bias(module)
    bias_ids = None if up_b is None and down_b is None else sorted_ids.clamp(max=num_experts - 1)
    beyond = (sorted_ids >= num_experts).unsqueeze(-1)  # sentinel / dropped rows, past the last offset
    if (guarded or layers.is_expert_parallel(module)) and _records_grad(module, hidden_states, top_k_weights):
        # The native grouped GEMM leaves rows past the last offset unwritten, in its backward too: zero the rows
        # going in (their gradient to the gather is then zero, not garbage) and coming out of the first GEMM
        # (the activation's backward then multiplies finite values)
        x = x.masked_fill(beyond, 0.0)
        h = _grouped_linear(x, up_w, offsets, None if up_b is None else up_b[bias_ids], transposed)
        h = h.masked_fill(beyond, 0.0)
    else:
        h = _grouped_linear(x, up_w, offsets, None if up_b is None else up_b[bias_ids], transposed)
    h = layers.activate(module, h)
    h = _grouped_linear(h, module.down_proj, offsets, None if down_b is None else down_b[bias_ids], transposed)
    h = layers.post_norm(module, h)

    if h.is_cuda and not torch.compiler.is_compiling():
        from selector.plugins.grouped_mm import combine  # Triton is imported on a GPU only

        if combine.available(h, top_k_weights):
            # one launch reads each slot's row once; rows of ids >= E (never written) count as 0 * weight
            flat_w = top_k_weights.reshape(-1)
            return combine.weighted_combine(h, order, ids, flat_w, num_tokens, num_experts, hidden_states.dtype)
    weights = top_k_weights.reshape(-1)[order].float()
    if guarded or layers.is_expert_parallel(module):
        # rows past the last offset were never written: zero them (0 * weight: 0, or NaN for a dropped bad slot)
        h = h.masked_fill(beyond, 0.0)
    weighted = h.float() * weights.unsqueeze(-1)
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted  # back to (token, slot) order, then a fixed-order sum over slots
    return unsorted.view(num_tokens, top_k, h.shape[-1]).sum(dim=1).to(hidden_states.dtype)
