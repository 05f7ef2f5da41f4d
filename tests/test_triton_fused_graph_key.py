"""What a triton_fused plan bakes in, read once when it is prepared (CPU: preparing is plain Python on tensors):
the weights it was prepared with, its own layer's weights and guard for a deep copy, the gate. Recorded graphs are
keyed by the dispatch core on the plan, which it prepares again for new weights (its weights fingerprint) and after
`forget_module`."""

from __future__ import annotations

import copy

import pytest
import torch

from selector import Gate, layers
from selector.problem import problem_from_module
from selector.testing import Layout, make_experts

forward = pytest.importorskip("selector.plugins.triton_fused.forward")


def _prepare(module: torch.nn.Module):  # noqa: ANN202
    return forward.prepare(module, problem_from_module(module, top_k=2))


def test_a_plan_holds_the_weights_it_was_prepared_with() -> None:
    module = make_experts(4, 16, 8, seed=0).requires_grad_(False)
    plan = _prepare(module)
    assert _prepare(module).layer.down is plan.layer.down is layers.down_weight(module)
    assert plan.graphs is not None and plan.graphs.variable == "SELECTOR_TRITON_FUSED_GRAPHS"
    module.down_proj = torch.nn.Parameter(module.down_proj.clone(), requires_grad=False)
    assert _prepare(module).layer.down is module.down_proj and plan.layer.down is not module.down_proj


def test_a_deep_copy_reads_its_own_weights_and_guard() -> None:
    module = make_experts(4, 16, 8, layout=Layout(interleaved=True), seed=0).requires_grad_(False)
    plan = _prepare(module)
    twin = copy.deepcopy(module)  # carries the original's guard tag in its __dict__
    twin_plan = _prepare(twin)
    assert twin_plan.layer.gate_up is layers.up_weight(twin) and twin_plan.layer.gate_up is not plan.layer.gate_up
    assert twin_plan.guard != plan.guard  # its own guard tag


def test_the_gate_is_read_into_the_plan() -> None:
    plain = make_experts(4, 16, 8, layout=Layout(interleaved=True), seed=0).requires_grad_(False)
    swiglu = make_experts(4, 16, 8, layout=Layout(interleaved=True, custom_gate=True), seed=0).requires_grad_(False)
    assert (_prepare(plain).layer.gate, _prepare(plain).layer.gate_alpha) == (Gate().name, None)
    assert _prepare(swiglu).layer.gate == "clamped_swiglu"
    assert _prepare(swiglu).layer.up.gate != _prepare(plain).layer.up.gate


def test_weights_are_read_from_parameters_buffers_and_plain_attributes() -> None:
    module = make_experts(4, 16, 8, seed=0)
    assert layers.up_weight(module) is module.gate_up_proj and layers.down_weight(module) is module.down_proj
    down = module.down_proj.detach().clone()
    del module.down_proj
    module.register_buffer("down_proj", down)
    assert layers.down_weight(module) is down
    del module.down_proj
    module.__dict__["down_proj"] = down  # a plain attribute (as some quantised layouts hold theirs)
    assert layers.down_weight(module) is down


def test_forget_module_drops_the_cached_gate() -> None:
    """The gate is read once per plan, like the layer's problem; after its declaration changes, forget_module (the
    call that makes the selection read the problem again) drops the core's plans, and the plan it prepares next
    reads the new gate (the backend keeps no cache of its own)."""
    from selector.dispatch import forget_module, module_cache
    from selector.gates import clamped_swiglu

    module = make_experts(4, 16, 8, layout=Layout(interleaved=True, custom_gate=True), seed=0).requires_grad_(False)
    module.selector_gate = clamped_swiglu(1.702, 7.0)
    plan = _prepare(module)
    assert (plan.layer.gate_alpha, plan.layer.gate_limit) == (1.702, 7.0)
    module_cache(module).plans["key"] = plan  # as the dispatch core keeps it
    module.selector_gate = clamped_swiglu(1.0, 3.0)
    forget_module(module)
    assert not module_cache(module).plans
    plan = _prepare(module)
    assert (plan.layer.gate_alpha, plan.layer.gate_limit) == (1.0, 3.0)
