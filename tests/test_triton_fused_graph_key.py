"""What a triton_fused graph is keyed on, read on every replayed call (CPU: the key is plain Python on tensors):
new weights, another layer object (a deep copy), another gate, another shape each give another key; a repeat call
gives the same one, and the gate is read once per module object."""

from __future__ import annotations

import copy

import pytest
import torch

from selector import Gate, layers
from selector.testing import Layout, make_experts, random_routing

forward = pytest.importorskip("selector.plugins.triton_fused.forward")


def _call(module: torch.nn.Module, tokens: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    idx, w = random_routing(tokens, 4, 2)
    return torch.randn(tokens, 16), idx, w


def test_a_repeat_call_gives_the_same_key_and_new_weights_another() -> None:
    module = make_experts(4, 16, 8, seed=0).requires_grad_(False)
    x, idx, w = _call(module)
    key = forward._graph_key(module, x, idx, w)
    assert forward._graph_key(module, x.clone(), idx.clone(), w.clone()) == key  # values are not part of it
    module.down_proj = torch.nn.Parameter(module.down_proj.clone(), requires_grad=False)
    assert forward._graph_key(module, x, idx, w) != key
    assert forward._graph_key(module, x[:1], idx[:1], w[:1]) != forward._graph_key(module, x, idx, w)


def test_a_deep_copy_reads_its_own_weights_and_gate() -> None:
    module = make_experts(4, 16, 8, layout=Layout(interleaved=True), seed=0).requires_grad_(False)
    x, idx, w = _call(module)
    key = forward._graph_key(module, x, idx, w)
    twin = copy.deepcopy(module)  # carries the original's cached gate entry in its __dict__
    assert forward._static(twin).owner == id(twin) != id(module)
    assert forward._graph_key(twin, x, idx, w) != key  # its own weights, its own guard tag


def test_the_gate_is_part_of_the_key() -> None:
    plain = make_experts(4, 16, 8, layout=Layout(interleaved=True), seed=0).requires_grad_(False)
    swiglu = make_experts(4, 16, 8, layout=Layout(interleaved=True, custom_gate=True), seed=0).requires_grad_(False)
    assert forward._static(plain).gate == Gate()
    assert forward._static(swiglu).gate.name == "clamped_swiglu"
    assert forward._static(plain).gate_token != forward._static(swiglu).gate_token


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
    """The gate is read once per module, like its problem; after its declaration changes, forget_module (the call
    that makes the selection read the problem again) makes the fused kernel read it again too."""
    from selector.dispatch import forget_module
    from selector.gates import clamped_swiglu

    module = make_experts(4, 16, 8, layout=Layout(interleaved=True, custom_gate=True), seed=0).requires_grad_(False)
    module.selector_gate = clamped_swiglu(1.702, 7.0)
    assert forward._static(module).gate == clamped_swiglu(1.702, 7.0)
    module.selector_gate = clamped_swiglu(1.0, 3.0)
    forget_module(module)
    assert forward._static(module).gate == clamped_swiglu(1.0, 3.0)
