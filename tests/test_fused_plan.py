"""triton_fused as a prepared plan (Triton interpreter, tiny shapes): the plan `prepare` reads off a module computes
what the public `fused_experts` computes from the same tensors, and what a float64 reference computes, for dense
layouts (plain, biased + transposed + interleaved, GPT-OSS's gate) and a quantised format; preparing writes nothing
into the module's __dict__ and keeps no strong reference to it."""

from __future__ import annotations

import copy
import gc
import os
import weakref
from dataclasses import replace

import pytest
import torch
from experts_fixtures import Layout, make_experts, random_routing, reference_experts, relative_error

from selector import layers
from selector import quant as Q
from selector.guard import guard_code
from selector.problem import problem_from_module

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="runs the Triton interpreter"),
]

LAYOUTS = [Layout(), Layout(bias=True, transposed=True, interleaved=True), Layout(interleaved=True, custom_gate=True)]


def _prepare(module: torch.nn.Module, grad: tuple[str, ...] = ()):  # noqa: ANN202
    from selector.registry import get_registry

    prepare = get_registry().get("triton_fused").prepare  # what the backend's spec declares
    return prepare(module, replace(problem_from_module(module, top_k=2), grad_inputs=grad))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("tokens", [1, 5])  # one token: the pair kernels; more: align, grouped GEMMs, combine
def test_the_plan_computes_what_fused_experts_does(layout: Layout, tokens: int) -> None:
    from selector.plugins.triton_fused.kernels import fused_experts

    module = make_experts(4, 32, 16, layout=layout, seed=3).requires_grad_(False)
    x = torch.randn(tokens, 32)
    idx, w = random_routing(tokens, 4, 2)
    plan = _prepare(module)
    out = plan.run(x, idx, w)
    layer = plan.layer
    direct = fused_experts(x, layers.up_weight(module), layers.down_weight(module), idx, w, num_experts=4,
                           gated=layer.gated, interleaved=layer.interleaved, transposed=layer.transposed,
                           gate_up_bias=layers.up_bias(module), down_bias=layers.down_bias(module), guard=plan.guard,
                           gate=layer.gate, gate_alpha=layer.gate_alpha, gate_limit=layer.gate_limit)  # fmt: skip
    assert torch.equal(out, direct)
    assert relative_error(out, reference_experts(module, x, idx, w)) < 1e-4
    assert plan.graphs is not None and plan.opaque_when_compiled and not plan.through_op


def test_the_forward_runs_the_plan_and_autograd_goes_through_the_op() -> None:
    from selector.plugins.triton_fused.forward import triton_fused_experts_forward

    module = make_experts(4, 32, 16, seed=4)  # weights that require grad
    x = torch.randn(3, 32)
    idx, w = random_routing(3, 4, 2)
    with torch.no_grad():
        ref = triton_fused_experts_forward(module, x, idx, w)
    plan = _prepare(module, ("expert_weights",))  # autograd records: no graphs (a replay records nothing), the op
    assert plan.graphs is None and plan.through_op
    out = triton_fused_experts_forward(module, x, idx, w)
    assert out.requires_grad and torch.equal(out.detach(), ref)


def test_a_quantised_plan_computes_what_its_forward_does() -> None:
    from selector.plugins.quant_kernels.forward import quant_experts_forward

    module = Q.quantize_experts(make_experts(4, 64, 64, seed=5), "fp8_block", "float32", block_size=(32, 32))
    module.requires_grad_(False)
    x = torch.randn(3, 64)
    idx, w = random_routing(3, 4, 2)
    plan = _prepare(module)
    out = plan.run(x, idx, w)
    assert torch.equal(out, quant_experts_forward(module, x, idx, w, mode="grouped"))
    dense = Q.dequantize_experts(copy.deepcopy(module))  # in place: on a copy
    assert relative_error(out, reference_experts(dense, x, idx, w)) < 0.1
    assert plan.graphs is not None and plan.graphs.variable == "SELECTOR_QUANT_GRAPHS" and plan.opaque_when_compiled


@pytest.mark.parametrize("fmt", ["dense", "fp8_block"])
def test_prepare_writes_nothing_into_the_module_and_holds_it_weakly(fmt: str) -> None:
    module = make_experts(4, 64, 64, layout=Layout(interleaved=True, custom_gate=fmt == "dense"), seed=6)
    if fmt != "dense":
        module = Q.quantize_experts(module, fmt, "float32", block_size=(32, 32))
    module.requires_grad_(False)
    guard_code(module, torch.device("cpu"))  # the guard's layer tag (selector.guard's, given on a layer's first call)
    before = dict(module.__dict__)
    plan = _prepare(module)
    assert module.__dict__.keys() == before.keys() and all(module.__dict__[k] is v for k, v in before.items())
    ref = weakref.ref(module)
    del module
    gc.collect()
    assert ref() is None and plan is not None
