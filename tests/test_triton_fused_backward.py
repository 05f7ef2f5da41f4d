"""The backward of `selector::triton_fused_experts` (plugins/triton_fused/backward.py) against float64 autograd.

Fast lane: the backward formula alone, fed the op's inputs in float64 (the loop path), compared with autograd
through a straight-from-the-definition float64 forward, for every layout and activation it declares. The
interpreter lane runs the real op (Triton interpreter, tiny fp32 shapes); the GPU lane compares bf16 gradients
with grouped_mm's through the layer.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from experts_fixtures import Layout, make_experts, random_routing, relative_error

import selector
from selector import layers
from selector.dispatch import get_backend_registry, last_backend, problem_of
from selector.plugins.triton_fused import BACKWARD_ACTIVATIONS
from selector.plugins.triton_fused.backward import backward_for_test, context_for_test
from selector.probes import collect_environment
from selector.requirements import evaluate
from selector.types import GRAD_INPUTS

E, H, I, T, K = 4, 8, 6, 5, 2
LAYOUTS = [
    Layout(),
    Layout(gated=False),
    Layout(bias=True),
    Layout(transposed=True),
    Layout(interleaved=True),
    Layout(bias=True, transposed=True, interleaved=True),
    Layout(expert_parallel=True),
]
ACTS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu, "relu": torch.relu,
        "gelu_tanh": lambda z: torch.nn.functional.gelu(z, approximate="tanh")}  # fmt: skip


def _inputs(layout: Layout, dtype: torch.dtype = torch.float64, seed: int = 0) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * I if layout.gated else I
    up_shape = (E, H, channels) if layout.transposed else (E, channels, H)
    down_shape = (E, I, H) if layout.transposed else (E, H, I)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.5).to(dtype)

    index = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    if layout.expert_parallel:
        index[::2, -1] = E  # sentinel slots: not this rank's experts
        index[1, 0] = -1
    return {
        "hidden": rand(T, H), "gate_up": rand(*up_shape), "down": rand(*down_shape), "index": index,
        "weights": torch.softmax(rand(T, K), dim=1),
        "gate_up_bias": rand(E, channels) if layout.bias else None, "down_bias": rand(E, H) if layout.bias else None,
    }  # fmt: skip


def _reference(v: dict[str, object], layout: Layout, activation: str) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * (down_e(act(gate_e(x_t) + bg) * (up_e(x_t) + bu)) + bd), e = ids[t, j]."""
    act = ACTS[activation]
    rows = []
    for t in range(T):
        acc = torch.zeros(H, dtype=v["hidden"].dtype)
        for j in range(K):
            e = int(v["index"][t, j])
            if not 0 <= e < E:
                continue
            w1 = v["gate_up"][e] if layout.transposed else v["gate_up"][e].t()  # [H, C]
            w2 = v["down"][e] if layout.transposed else v["down"][e].t()  # [I, H]
            g = v["hidden"][t] @ w1
            if v["gate_up_bias"] is not None:
                g = g + v["gate_up_bias"][e]
            if layout.gated:
                gate, up = (g[0::2], g[1::2]) if layout.interleaved else (g[:I], g[I:])
                a = act(gate) * up
            else:
                a = act(g)
            y = a @ w2
            if v["down_bias"] is not None:
                y = y + v["down_bias"][e]
            acc = acc + v["weights"][t, j] * y
        rows.append(acc)
    return torch.stack(rows)


_DIFF = ("hidden", "gate_up", "down", "weights", "gate_up_bias", "down_bias")
_POSITION = {"hidden": 0, "gate_up": 1, "down": 2, "weights": 4, "gate_up_bias": 10, "down_bias": 11}


def _op_inputs(v: dict[str, object], layout: Layout, activation: str) -> tuple[object, ...]:
    return (v["hidden"], v["gate_up"], v["down"], v["index"], v["weights"], E, activation, layout.gated,
            layout.interleaved, layout.transposed, v["gate_up_bias"], v["down_bias"], None, 0)  # fmt: skip


@pytest.mark.parametrize("activation", sorted(BACKWARD_ACTIVATIONS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_backward_matches_float64_autograd(layout: Layout, activation: str) -> None:
    v = _inputs(layout)
    wrt = [name for name in _DIFF if v[name] is not None]
    for name in wrt:
        v[name] = v[name].clone().requires_grad_(True)
    out = _reference(v, layout, activation)
    upstream = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    want = torch.autograd.grad(out, [v[n] for n in wrt], upstream)
    needs = tuple(i in {_POSITION[n] for n in wrt} for i in range(14))
    ctx = context_for_test(tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in
                                 _op_inputs(v, layout, activation)), needs)  # fmt: skip
    got = backward_for_test(ctx, upstream)
    assert len(got) == 14 and all(got[i] is None for i in range(14) if not needs[i])
    for name, expected in zip(wrt, want):
        grad = got[_POSITION[name]]
        assert grad.shape == expected.shape and grad.dtype == expected.dtype, name
        # in the parameter's own layout: a transposed view would make autograd copy every expert's weights
        assert grad.stride() == v[name].stride(), name
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_backward_computes_only_what_is_asked() -> None:
    layout = Layout(bias=True)
    v = _inputs(layout)
    needs = tuple(i == 4 for i in range(14))  # the routing weights alone
    got = backward_for_test(context_for_test(_op_inputs(v, layout, "silu"), needs), torch.ones(T, H, dtype=torch.float64))
    assert got[4] is not None and got[4].shape == (T, K)
    assert all(g is None for i, g in enumerate(got) if i != 4)


def test_backward_refuses_an_activation_it_does_not_differentiate() -> None:
    v = _inputs(Layout())
    needs = tuple(i == 0 for i in range(14))
    with pytest.raises(NotImplementedError, match="no backward for activation 'clamped_swiglu'"):
        backward_for_test(context_for_test(_op_inputs(v, Layout(), "clamped_swiglu"), needs), torch.ones(T, H))


def _h200_problem(module: torch.nn.Module, **changes: object):  # noqa: ANN202
    return replace(problem_of(module, 2), device="cuda", dtype="bfloat16", **changes)


def test_triton_fused_declares_its_backward_for_dense_experts_and_these_activations() -> None:
    env = collect_environment({"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "PATH": ""})
    spec = get_backend_registry().get("triton_fused")
    assert spec.differentiable == frozenset(GRAD_INPUTS) and spec.grad_weight_formats == frozenset({"dense"})
    module = make_experts(4, 16, 8, seed=0)
    verdict = evaluate(spec, _h200_problem(module, grad_inputs=GRAD_INPUTS), env)
    if verdict.status.value == "missing_package":
        pytest.skip("triton is not installed here")
    assert verdict.ok, verdict.reason
    # an activation the forward runs but backward.py does not differentiate: refused under autograd only
    more = replace(spec, requirements=replace(spec.requirements, activations=spec.requirements.activations | {"relu2"}))
    assert evaluate(more, _h200_problem(module, activation="relu2"), env).ok
    verdict = evaluate(more, _h200_problem(module, grad_inputs=("hidden_states",), activation="relu2"), env)
    assert not verdict.ok and "no backward for the 'relu2' activation" in verdict.reason
    assert "no_grad" in verdict.remedy
    quantised = _h200_problem(module, grad_inputs=("hidden_states",), weight_format="fp8_block", scale_format="float32")
    verdict = evaluate(spec, quantised, env)
    assert not verdict.ok and "no backward for fp8_block" in verdict.reason


def test_auto_under_autograd_on_an_h200_trains_with_grouped_mm() -> None:
    """The fused backward (recomputed in torch) measured 1.8-2.4x slower per training step than grouped_mm's on
    the H200, so auto trains with grouped_mm; without grad the fused forward stays first."""
    from selector.presets import preset
    from selector.ranking import rank
    from selector.registry import get_registry

    env = collect_environment({"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "PATH": ""})
    if not evaluate(get_registry().get("triton_fused"), preset("qwen3-30b-a3b").with_tokens(8), env).ok:
        pytest.skip("triton is not installed here")
    problem = replace(preset("qwen3-30b-a3b"), grad_inputs=GRAD_INPUTS)
    for tokens in (8, 512, 4096):
        ranking = rank(problem.with_tokens(tokens), env, get_registry())
        assert ranking.best == "grouped_mm", tokens
        assert "triton_fused" in [c.name for c in ranking.candidates]  # still differentiable, ranked behind
        assert rank(preset("qwen3-30b-a3b").with_tokens(tokens), env, get_registry()).best == "triton_fused", tokens


# -- the real op: the Triton interpreter on a CPU, the kernels on a GPU --

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETER, reason="runs the Triton forward on the CPU (interpreter)")
@pytest.mark.parametrize("layout", [Layout(), Layout(bias=True, transposed=True, interleaved=True),
                                    Layout(gated=False), Layout(expert_parallel=True)], ids=str)  # fmt: skip
def test_the_op_differentiates_through_the_interpreter(layout: Layout) -> None:
    import selector.plugins.triton_fused.forward  # noqa: F401 - defines the op and registers its backward

    v64 = _inputs(layout)
    v = {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in v64.items()}
    wrt = [name for name in _DIFF if v[name] is not None]
    for name in wrt:
        v[name] = v[name].clone().requires_grad_(True)
        v64[name] = v64[name].clone().requires_grad_(True)
    out = torch.ops.selector.triton_fused_experts(*_op_inputs(v, layout, "silu"))
    ref = _reference(v64, layout, "silu")
    assert relative_error(out, ref) < 1e-5
    upstream = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    got = torch.autograd.grad(out, [v[n] for n in wrt], upstream)
    want = torch.autograd.grad(ref, [v64[n] for n in wrt], upstream.double())
    for name, g, w in zip(wrt, got, want):
        assert relative_error(g, w) < 1e-4, name


@pytest.mark.interpreter
@pytest.mark.skipif(not INTERPRETER, reason="runs the Triton forward on the CPU (interpreter)")
def test_opcheck_the_triton_fused_op_with_its_backward() -> None:
    import selector.plugins.triton_fused.forward  # noqa: F401

    v = {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
         for n, t in _inputs(Layout(bias=True)).items()}  # fmt: skip
    for name in _DIFF:
        v[name] = v[name].requires_grad_(True)
    torch.library.opcheck(torch.ops.selector.triton_fused_experts.default, _op_inputs(v, Layout(bias=True), "silu"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))  # fmt: skip


def _grads(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    out = module(*inputs)
    wrt = [inputs[0], inputs[2], layers.up_weight(module), module.down_proj]
    upstream = torch.linspace(-1.0, 1.0, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    return list(torch.autograd.grad(out, wrt, upstream))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [Layout(), Layout(bias=True), Layout(transposed=True), Layout(interleaved=True),
                                    Layout(gated=False), Layout(expert_parallel=True)], ids=str)  # fmt: skip
@pytest.mark.parametrize("tokens", [3, 200])
def test_gpu_triton_fused_gradients_match_grouped_mm_in_bf16(layout: Layout, tokens: int) -> None:
    grads = {}
    for name in ("grouped_mm", "triton_fused"):
        module = make_experts(8, 256, 128, layout, dtype=torch.bfloat16, device="cuda", seed=0)
        selector.set_experts_implementation(module, name)
        torch.manual_seed(1)
        index, weights = random_routing(tokens, 8, 2, device="cuda", sentinel=layout.expert_parallel)
        hidden = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grads[name] = _grads(module, (hidden, index, weights.requires_grad_(True)))
        assert last_backend(module) == name
    for got, want in zip(grads["triton_fused"], grads["grouped_mm"]):
        assert relative_error(got, want) < 3e-2  # bf16 matmuls summed in another order


@pytest.mark.gpu
def test_gpu_auto_fine_tunes_through_a_backward() -> None:
    module = make_experts(8, 256, 128, dtype=torch.bfloat16, device="cuda", seed=0)
    index, weights = random_routing(64, 8, 2, device="cuda")
    hidden = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    module(hidden, index, weights).sum().backward()
    from selector.dispatch import get_backend_registry

    # the ranking's call (on a layer this small a torch backend); whichever it is declares a backward for both
    picked = get_backend_registry().get(last_backend(module))
    assert {"hidden_states", "expert_weights"} <= picked.differentiable, picked.name
    assert hidden.grad is not None and module.gate_up_proj.grad is not None
    assert bool(hidden.grad.isfinite().all()) and bool(module.gate_up_proj.grad.isfinite().all())


def _float64_gradients(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Gradients of the plain gated SiLU layer from its definition in float64 (sentinel slots contribute nothing)."""
    hidden, index, weights = inputs
    num_experts = module.num_experts
    h64, w64 = (t.detach().double().requires_grad_(True) for t in (hidden, weights))
    up64, down64 = (t.detach().double().requires_grad_(True) for t in (module.gate_up_proj, module.down_proj))
    out = torch.zeros_like(h64)
    for j in range(index.shape[1]):
        expert = index[:, j].long()
        routed = (expert >= 0) & (expert < num_experts)
        safe = expert.clamp(0, num_experts - 1)
        gate, up = torch.einsum("th,tch->tc", h64, up64[safe]).chunk(2, dim=-1)
        y = torch.einsum("ti,thi->th", torch.nn.functional.silu(gate) * up, down64[safe])
        out = out + torch.where(routed[:, None], y * w64[:, j : j + 1], 0.0)
    upstream = torch.linspace(-1.0, 1.0, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    return list(torch.autograd.grad(out, [h64, w64, up64, down64], upstream))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["grouped_mm", "triton_fused"])
@pytest.mark.parametrize("layout", [Layout(), Layout(expert_parallel=True)], ids=str)
def test_gpu_gradients_match_float64(name: str, layout: Layout) -> None:
    module = make_experts(8, 256, 128, layout, dtype=torch.bfloat16, device="cuda", seed=0)
    selector.set_experts_implementation(module, name)
    torch.manual_seed(1)
    index, weights = random_routing(200, 8, 2, device="cuda", sentinel=layout.expert_parallel)
    hidden = torch.randn(200, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inputs = (hidden, index, weights.requires_grad_(True))
    got = _grads(module, inputs)
    for what, g, want in zip(("hidden", "routing weights", "gate_up", "down"), got, _float64_gradients(module, inputs)):
        assert relative_error(g, want) < 3e-2, f"{name}: d/d {what}"
