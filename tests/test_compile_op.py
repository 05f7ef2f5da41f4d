"""The opaque `selector::experts` op itself: what it returns, and on the GPU, on which streams a backend may
record its own graph inside it (the device's default stream only)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from experts_fixtures import TOLERANCE, make_experts, random_routing, relative_error

from selector import BackendSpec, Requirements, graphs, hookimpl
from selector.dispatch import backend_forward, last_backend, track

PRODUCED: list[torch.Tensor] = []  # what the fake backend returned, to compare with what the op returns
SHAPE = {"how": "as_is"}


def _load() -> Callable[..., torch.Tensor]:
    def forward(module, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN202
        out = backend_forward("grouped_mm")(module, hidden_states, top_k_index, top_k_weights)
        if SHAPE["how"] == "float64":
            out = out.double()
        elif SHAPE["how"] == "strided":  # same values, column-major
            out = out.t().contiguous().t()
        PRODUCED.append(out)
        return out

    return forward


class Shaper:
    """A fake CPU backend declared for torch.compile whose output is as the test asks: as is, float64, strided."""

    @staticmethod
    @hookimpl
    def selector_backends():  # noqa: ANN205
        return [BackendSpec(name="fake_shaper", load=_load, requirements=Requirements(devices=frozenset({"cpu"})),
                            estimate=lambda problem, env: 0.0)]  # fmt: skip


@pytest.fixture(autouse=True)
def _clear() -> None:
    PRODUCED.clear()
    SHAPE["how"] = "as_is"


def _call(module: torch.nn.Module, tokens: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    index, weights = random_routing(tokens, 4, 2)
    hidden = torch.randn(tokens, 16)
    with torch.no_grad():
        out = torch.ops.selector.experts(track(module), "fake_shaper", hidden, index, weights, module.gate_up_proj)
        return out, backend_forward("eager")(module, hidden, index, weights)


def test_the_op_returns_the_backends_output_itself_when_it_has_the_fakes_layout(fresh_registry) -> None:  # noqa: ANN001
    fresh_registry(Shaper)
    module = make_experts(4, 16, 8, seed=0).requires_grad_(False)
    out, want = _call(module)
    assert last_backend(module) == "fake_shaper"
    assert len(PRODUCED) == 1 and out.data_ptr() == PRODUCED[0].data_ptr()  # no copy
    assert relative_error(out, want) < 1e-5


@pytest.mark.parametrize("how", ["float64", "strided"])
def test_the_op_converts_an_output_unlike_its_fake(fresh_registry, how: str) -> None:  # noqa: ANN001
    fresh_registry(Shaper)
    module = make_experts(4, 16, 8, seed=0).requires_grad_(False)
    SHAPE["how"] = how
    out, want = _call(module)
    produced = PRODUCED[0]
    assert (produced.dtype == torch.float64) == (how == "float64") and produced.is_contiguous() == (how != "strided")
    # what inductor assumes of the op's output (its fake): contiguous, of hidden_states' dtype
    assert out.dtype == torch.float32 and out.is_contiguous() and out.data_ptr() != produced.data_ptr()
    assert relative_error(out, want) < 1e-5


# -- the GPU lane --


@pytest.mark.compile
@pytest.mark.gpu
def test_gpu_the_op_records_its_own_graph_on_the_default_stream_only() -> None:
    """Called directly (as a compiled model's wrapper calls it): on a side stream, as torch.compile's CUDA-graph
    modes warm up, triton_fused launches its kernels; on the default stream it records once and replays."""
    module = make_experts(16, 512, 256, dtype=torch.bfloat16, device="cuda", seed=0).requires_grad_(False)
    index, weights = random_routing(8, 16, 4, device="cuda")
    hidden = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    args = (hidden, index, weights, module.gate_up_proj)
    with torch.no_grad():
        ref = backend_forward("grouped_mm")(module, hidden, index, weights)
        uid = track(module)
        before = graphs.recordings()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = torch.ops.selector.experts(uid, "triton_fused", *args)
        torch.cuda.current_stream().wait_stream(side)
        assert last_backend(module) == "triton_fused"
        assert graphs.recordings() == before  # not the default stream: no graph of its own
        for _ in range(3):
            out = torch.ops.selector.experts(uid, "triton_fused", *args)
        assert graphs.recordings() == before + 1  # the default stream: recorded at the first call, replayed since
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    assert relative_error(on_side, ref) < TOLERANCE[torch.bfloat16]
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
