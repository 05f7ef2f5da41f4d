"""Test helpers: build decorated experts modules with random weights, and a float64 reference.

The reference is written from the definition (loop over tokens and slots), not from any backend.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

import selector


@dataclass(frozen=True)
class Layout:
    gated: bool = True
    bias: bool = False
    transposed: bool = False
    interleaved: bool = False
    custom_gate: bool = False
    post_norm: bool = False
    expert_parallel: bool = False

    def __str__(self) -> str:
        on = [k for k, v in self.__dict__.items() if v is True and k != "gated"]
        return "-".join((["gated"] if self.gated else ["plain"]) + on)


def clamped_swiglu(module: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """A GPT-OSS style gate: interleaved channels, clamped, sigmoid(1.702 x) glu, (up + 1)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    return (up + 1) * gate * torch.sigmoid(gate * 1.702)


def make_experts(
    num_experts: int,
    hidden: int,
    inter: int,
    layout: Layout = Layout(),
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    act: torch.nn.Module | None = None,
    seed: int | None = None,
) -> torch.nn.Module:
    """A decorated experts module with random weights (scaled so activations stay O(1))."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)

    @selector.experts(
        has_gate=layout.gated,
        has_bias=layout.bias,
        is_transposed=layout.transposed,
        is_concatenated=not layout.interleaved,
        has_post_expert_norm=layout.post_norm,
        gate_fn=clamped_swiglu if layout.custom_gate else None,
        replace_forward=True,  # its forward is the plain loop the decorator replaces
    )
    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = num_experts
            up_out = 2 * inter if layout.gated else inter

            def param(*shape: int, scale: float) -> torch.nn.Parameter:
                return torch.nn.Parameter((torch.randn(*shape, generator=gen) * scale).to(dtype))

            up_shape = (num_experts, hidden, up_out) if layout.transposed else (num_experts, up_out, hidden)
            down_shape = (num_experts, inter, hidden) if layout.transposed else (num_experts, hidden, inter)
            up = param(*up_shape, scale=hidden**-0.5)
            if layout.gated:
                self.gate_up_proj = up
            else:
                self.up_proj = up
            self.down_proj = param(*down_shape, scale=inter**-0.5)
            if layout.bias:
                bias = param(num_experts, up_out, scale=0.1)
                if layout.gated:
                    self.gate_up_proj_bias = bias
                else:
                    self.up_proj_bias = bias
                self.down_proj_bias = param(num_experts, hidden, scale=0.1)
            if layout.post_norm:
                self.post_expert_norm = torch.nn.LayerNorm(hidden, dtype=dtype)
            self.act_fn = act if act is not None else torch.nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):  # replaced by the decorator
            raise AssertionError("the decorator must replace forward")

    module = Experts().to(device)
    module._is_expert_parallel = layout.expert_parallel
    return module


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, device: str = "cpu", skew: bool = False, sentinel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token; `skew` sends most tokens to expert 0; `sentinel` marks some slots id == E."""
    scores = torch.rand(num_tokens, num_experts)
    if skew:
        scores[:, 0] += 10.0
    index = scores.topk(top_k, dim=1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k), dim=1)
    if sentinel and num_tokens:
        index[::2, -1] = num_experts
    return index.to(device), weights.to(device)


def reference_experts(
    module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """float64 loop over tokens and slots, straight from the definition."""
    ref = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)
    x, idx, w = hidden.detach().cpu().double(), index.cpu(), weights.detach().cpu().double()
    gated = getattr(ref, "has_gate", True)
    up_w = ref.gate_up_proj if gated else ref.up_proj
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= ref.num_experts:
                continue
            up = x[t] @ up_w[e] if ref.is_transposed else up_w[e] @ x[t]
            if ref.has_bias:
                up = up + (ref.gate_up_proj_bias[e] if gated else ref.up_proj_bias[e])
            h = ref._apply_gate(up) if gated else ref.act_fn(up)
            down = h @ ref.down_proj[e] if ref.is_transposed else ref.down_proj[e] @ h
            if ref.has_bias:
                down = down + ref.down_proj_bias[e]
            if ref.has_post_expert_norm:
                down = ref.post_expert_norm(down)
            out[t] += w[t, j] * down
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.detach().cpu().double()
    assert torch.isfinite(out64).all(), "output holds NaN or inf"
    denom = ref.norm().item()
    return (out64 - ref).norm().item() / (denom if denom > 0 else 1.0)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
