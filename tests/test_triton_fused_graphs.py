"""The fused backend's recorded CUDA graphs at decode sizes: fresh inputs every call, new weights, limits.
Inference layers (weights without grad): a call that autograd records never replays a graph. The dispatch core
records and replays the backend's plan (its GraphPolicy), so the calls go through `run_experts`."""

from __future__ import annotations

import pytest
import torch
from experts_fixtures import make_experts, random_routing, reference_experts, relative_error

import selector
from selector import graphs

pytestmark = pytest.mark.gpu


def _run(module: torch.nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return selector.run_experts(module, x, idx, w, implementation="triton_fused")


@pytest.mark.smoke
def test_replays_see_fresh_inputs_each_call() -> None:
    module = make_experts(8, 64, 32, dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    for _ in range(3):  # same shape: one graph, replayed with new values
        x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
        idx, w = random_routing(5, 8, 2, device="cuda")
        out = _run(module, x, idx, w)
        assert relative_error(out, reference_experts(module, x, idx, w)) < 2e-2
    assert len(graphs.graphs_of(module, "triton_fused")) == 1
    import copy

    assert copy.deepcopy(module).down_proj.shape == module.down_proj.shape  # users copy models
    first = out.clone()
    _run(module, x * 2, idx, w)
    assert torch.equal(out, first)  # the returned tensor is not the graph's buffer


def test_new_weights_record_a_new_graph_and_the_cache_is_bounded() -> None:
    module = make_experts(4, 32, 16, dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    idx, w = random_routing(2, 4, 2, device="cuda")
    x = torch.randn(2, 32, device="cuda", dtype=torch.bfloat16)
    _run(module, x, idx, w)
    module.down_proj = torch.nn.Parameter(torch.randn_like(module.down_proj) * 0.2, requires_grad=False)
    out = _run(module, x, idx, w)
    assert relative_error(out, reference_experts(module, x, idx, w)) < 2e-2
    for t in range(1, graphs.GRAPHS_PER_MODULE + 4):
        i, ww = random_routing(t, 4, 2, device="cuda")
        _run(module, torch.randn(t, 32, device="cuda", dtype=torch.bfloat16), i, ww)
    assert len(graphs.graphs_of(module, "triton_fused")) == graphs.GRAPHS_PER_MODULE


def test_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_GRAPHS", "0")
    module = make_experts(4, 32, 16, dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    idx, w = random_routing(3, 4, 2, device="cuda")
    x = torch.randn(3, 32, device="cuda", dtype=torch.bfloat16)
    out = _run(module, x, idx, w)
    assert len(graphs.graphs_of(module, "triton_fused")) == 0
    assert relative_error(out, reference_experts(module, x, idx, w)) < 2e-2


def test_larger_calls_are_recorded_when_their_shape_comes_back() -> None:
    """Above graphs.DECODE_TOKENS a shape's first call runs directly (a one-off prefill size records nothing);
    its second call records, later ones replay; up to REPEAT_TOKENS."""
    module = make_experts(4, 32, 16, dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    t = graphs.DECODE_TOKENS + 1
    x = torch.randn(t, 32, device="cuda", dtype=torch.bfloat16)
    idx, w = random_routing(t, 4, 2, device="cuda")
    before = graphs.recordings()
    _run(module, x, idx, w)
    assert graphs.recordings() == before
    for _ in range(3):
        out = _run(module, x, idx, w)
    assert graphs.recordings() == before + 1
    assert relative_error(out, reference_experts(module, x, idx, w)) < 2e-2


def test_repeated_addresses_replay_on_the_callers_tensors_and_keep_results_apart() -> None:
    """A decode loop's steady state: the same input tensors refilled in place and each result dropped before the
    next call (the loop allocates nothing else). Within a few calls the layer replays a graph recorded on those
    addresses (no copies); every result is right for the inputs' current contents; a result the caller keeps is
    never overwritten."""
    module = make_experts(8, 64, 32, dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    steps = 8
    xs = torch.randn(steps, 4, 64, device="cuda", dtype=torch.bfloat16)
    routes = [random_routing(4, 8, 2, device="cuda") for _ in range(steps)]
    refs = [reference_experts(module, xs[s], *routes[s]) for s in range(steps)]
    results = torch.empty(steps, 4, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.empty(4, 64, device="cuda", dtype=torch.bfloat16)
    idx, w = (t.clone() for t in routes[0])
    made, replayed = graphs.direct_counts()
    for s in range(steps):
        x.copy_(xs[s])
        idx.copy_(routes[s][0])
        w.copy_(routes[s][1])
        out = _run(module, x, idx, w)
        results[s].copy_(out)
        del out  # the block goes back to the allocator, which hands it out again
    assert all(relative_error(results[s], refs[s]) < 2e-2 for s in range(steps))
    (recorded,) = graphs.graphs_of(module, "triton_fused").values()
    assert len(recorded.direct) >= 1 and graphs.direct_counts()[1] - replayed >= steps - 4
    assert graphs.direct_counts()[0] - made == len(recorded.direct)
    kept = _run(module, x, idx, w)
    before = kept.clone()
    x.mul_(2)
    again = _run(module, x, idx, w)  # `kept` is alive: another block
    torch.cuda.synchronize()
    assert again.data_ptr() != kept.data_ptr() and torch.equal(kept, before)
    assert relative_error(again, reference_experts(module, x, idx, w)) < 2e-2
