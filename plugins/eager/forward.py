"""The eager loop: for each expert that received tokens, gather them, run its MLP, scatter back.

The per-(token, slot) results are written into a [T, k, H] buffer and summed over k in a fixed order, so
duplicate tokens never race (no index_add_ atomics) and the result is deterministic.
"""

from __future__ import annotations

import torch

from selector import layers
from selector.plugins.torch_common.routing import guarded_routing

FULLGRAPH_MESSAGE = (
    "experts backend 'eager' loops over the experts hit on the host, which breaks a torch.compile graph: "
    "compile without fullgraph=True, or pick a fullgraph-safe backend such as grouped_mm"
)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ weight if transposed else x @ weight.transpose(0, 1)
    return out + bias if bias is not None else out


def eager_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    num_tokens, top_k = top_k_index.shape
    num_experts = module.num_experts
    transposed = getattr(module, "is_transposed", False)
    up_w, down_w = layers.up_weight(module), module.down_proj
    up_b, down_b = layers.up_bias(module), layers.down_bias(module)
    x = hidden_states.to(up_w.dtype)
    # bad slots -> the dropped id E with weight NaN: skipped like a sentinel (no expert's batch changes), their
    # tokens' rows NaN below
    top_k_index, top_k_weights, _ = guarded_routing(module, top_k_index, top_k_weights, drop=True)

    if torch.compiler.is_compiling():  # say why here: under fullgraph=True this is the error the user reads
        torch._dynamo.graph_break(msg=FULLGRAPH_MESSAGE)
    per_slot = torch.zeros(num_tokens, top_k, hidden_states.shape[1], dtype=x.dtype, device=x.device)
    present = torch.unique(top_k_index).tolist()  # the one host sync of the loop
    hit = [expert for expert in present if expert < num_experts]  # the sentinel id is skipped
    for expert in hit:
        token_idx, slot_idx = torch.where(top_k_index == expert)
        h = _linear(x[token_idx], up_w[expert], None if up_b is None else up_b[expert], transposed)
        h = layers.activate(module, h)
        h = _linear(h, down_w[expert], None if down_b is None else down_b[expert], transposed)
        h = layers.post_norm(module, h)
        weight = top_k_weights[token_idx, slot_idx].unsqueeze(-1)
        per_slot[token_idx, slot_idx] = (h.float() * weight.float()).to(x.dtype)
    out = per_slot.float().sum(dim=1)
    if len(hit) < len(present):
        # a skipped slot contributes 0 * weight, as in the sorting backends: 0, or NaN for a dropped bad slot
        skipped = (top_k_index >= num_experts).unsqueeze(-1)
        out = out + (top_k_weights.float().unsqueeze(-1) * 0.0).masked_fill(~skipped, 0.0).sum(dim=1)
    return out.to(hidden_states.dtype)
