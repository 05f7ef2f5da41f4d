"""FAKE `kernels-community/sonic-moe` for CPU tests: `moe_general_routing_inputs` in plain torch.

Signature of sonic-moe 0.1.2.post1 (`sonicmoe.functional.moe_general_routing_inputs`). Asserted as the real
kernel documents: token indices int32 and sorted ascending, expert ids int32 in [0, E), w1 of shape (2I, H, E)
and w2 of shape (H, I, E) with stride order (2, 0, 1) (that is, permuted views of contiguous (E, 2I, H) and
(E, H, I) tensors), both biases or none, a gated (GLU) activation. `concat_layout=False` reads w1's rows as
interleaved [gate0, up0, gate1, up1, ...]; True as [gate | up]. GeGLU uses the tanh GELU, as QuACK does.
"""

from __future__ import annotations

import torch

from . import enums
from .enums import ActivationType, is_glu

FAKE = True
CALLS: list[dict] = []


def _act(activation_type: ActivationType, gate: torch.Tensor) -> torch.Tensor:
    if activation_type is ActivationType.SWIGLU:
        return torch.nn.functional.silu(gate)
    if activation_type is ActivationType.GEGLU:
        return torch.nn.functional.gelu(gate, approximate="tanh")
    return torch.relu(gate)


def moe_general_routing_inputs(
    x: torch.Tensor,
    router_scores: torch.Tensor,
    token_indices: torch.Tensor,
    expert_indices: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    E: int,
    stream_id: int,
    activation_type: ActivationType,
    is_inference_mode_enabled: bool = False,
    concat_layout: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    assert (b1 is None) == (b2 is None), "b1 and b2 has to be None or not None at the same time!"
    assert is_glu(activation_type), "QuACK GEMM does not support non GLU activation yet"
    tokens, hidden = x.shape
    two_i, h1, experts = w1.shape
    h2, inter, e2 = w2.shape
    assert h1 == hidden == h2 and e2 == experts == E and two_i == 2 * inter, "w1 (2I, H, E), w2 (H, I, E)"
    assert w1.permute(2, 0, 1).is_contiguous(), "w1 must have stride order (2, 0, 1)"
    assert w2.permute(2, 0, 1).is_contiguous(), "w2 must have stride order (2, 0, 1)"
    assert token_indices.dtype == torch.int32 and expert_indices.dtype == torch.int32, "indices must be int32"
    assert router_scores.shape == token_indices.shape == expert_indices.shape
    if token_indices.numel():
        assert bool((token_indices[1:] >= token_indices[:-1]).all()), "token_indices must be sorted ascending"
        assert int(token_indices.max()) < tokens and int(token_indices.min()) >= 0
        assert int(expert_indices.min()) >= 0 and int(expert_indices.max()) < E, "expert ids must lie in [0, E)"
    CALLS.append({"tokens": tokens, "pairs": token_indices.numel(), "activation": activation_type,
                  "concat_layout": concat_layout})

    w1e = w1.permute(2, 0, 1).float()  # [E, 2I, H]
    w2e = w2.permute(2, 0, 1).float()  # [E, H, I]
    out = torch.zeros(tokens, hidden)
    xs = x.float()
    for t, e, s in zip(token_indices.tolist(), expert_indices.tolist(), router_scores.float().tolist()):
        z = w1e[e] @ xs[t]
        if b1 is not None:
            z = z + b1[e].float()
        gate, up = (z[:inter], z[inter:]) if concat_layout else (z[0::2], z[1::2])
        a = (_act(activation_type, gate) * up).to(x.dtype).float()  # the kernel stores `a` in x's dtype
        y = w2e[e] @ a
        if b2 is not None:
            y = y + b2[e].float()
        out[t] += s * y
    frequency = torch.bincount(expert_indices.long(), minlength=E).to(torch.int32)
    return out.to(x.dtype), frequency
