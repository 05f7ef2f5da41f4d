"""Every built-in torch backend against the float64 reference, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from selector.dispatch import last_backend
from experts_fixtures import TOLERANCE, Layout, make_experts, random_routing, reference_experts, relative_error

import selector

BACKENDS = ["eager", "batched_mm", "grouped_mm"]
# On a GPU the same checks run on CUDA tensors, with the fused Triton backend too.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
CUDA_ONLY = ["triton_fused"]
LAYOUTS = [
    Layout(),
    Layout(bias=True),
    Layout(transposed=True),
    Layout(interleaved=True),
    Layout(gated=False),
    Layout(gated=False, bias=True, transposed=True),
    Layout(custom_gate=True, interleaved=True, bias=True, transposed=True),  # GPT-OSS style
    Layout(post_norm=True),
    Layout(expert_parallel=True),
]
# (T, E, H, I, k): tiny and odd sizes, E=1, k=E, T=0, T=1
SHAPES = [(7, 4, 32, 24, 2), (1, 5, 17, 9, 3), (0, 3, 16, 8, 2), (5, 1, 12, 10, 1), (6, 3, 20, 12, 3), (33, 8, 40, 28, 4)]


def _unsupported(backend: str, layout: Layout) -> bool:
    # the custom_gate layouts use selector's clamped SwiGLU, a gate triton_fused's epilogue runs (selector.gates)
    return backend == "triton_fused" and layout.post_norm


def _run(backend: str, module: torch.nn.Module, x, idx, w) -> torch.Tensor:
    selector.set_experts_implementation(module, backend)
    with torch.no_grad():  # outputs only: a backend without a backward for a layout still runs it in inference
        out = module(x, idx, w)
    assert last_backend(module) == backend
    return out


def _cases(device: str) -> list[str]:
    return BACKENDS + (CUDA_ONLY if device == "cuda" else [])


ALL_BACKENDS = BACKENDS + CUDA_ONLY


def _skip_if_cpu_only(backend: str, device: str) -> None:
    if backend in CUDA_ONLY and device == "cpu":
        pytest.skip("CUDA-only backend: covered on CPU through the Triton interpreter in its own tests")


@pytest.mark.smoke
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layouts_match_reference(backend: str, layout: Layout, device: str) -> None:
    _skip_if_cpu_only(backend, device)
    t, e, h, i, k = 9, 5, 24, 16, 2
    module = make_experts(e, h, i, layout, device=device)
    x = torch.randn(t, h, device=device)
    idx, w = random_routing(t, e, k, device=device, sentinel=layout.expert_parallel)
    if _unsupported(backend, layout):
        selector.set_experts_implementation(module, backend)
        with pytest.raises(ValueError, match="cannot run here: does not support"):
            module(x, idx, w)
        return
    out = _run(backend, module, x, idx, w)
    assert out.shape == (t, h) and out.dtype == x.dtype
    assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T%d-E%d-H%d-I%d-k%d" % s)
def test_shapes_match_reference(backend: str, shape: tuple[int, ...], device: str) -> None:
    _skip_if_cpu_only(backend, device)
    t, e, h, i, k = shape
    module = make_experts(e, h, i, device=device)
    x = torch.randn(t, h, device=device)
    idx, w = random_routing(t, e, k, device=device)
    out = _run(backend, module, x, idx, w)
    assert out.shape == (t, h)
    if t:
        assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_dtype_tolerance(backend: str, dtype: torch.dtype, device: str) -> None:
    _skip_if_cpu_only(backend, device)
    module = make_experts(6, 64, 48, Layout(bias=True), dtype=dtype, device=device)
    x = torch.randn(12, 64, device=device).to(dtype)
    idx, w = random_routing(12, 6, 2, device=device)
    out = _run(backend, module, x, idx, w)
    assert out.dtype == dtype
    assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_skewed_routing_and_idle_experts(backend: str) -> None:
    module = make_experts(8, 32, 16)
    x = torch.randn(40, 32)
    idx, w = random_routing(40, 8, 2, skew=True)
    idx[idx == 7] = 6  # expert 7 receives nothing
    out = _run(backend, module, x, idx, w)
    assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_results_are_deterministic(backend: str) -> None:
    module = make_experts(4, 32, 16)
    x = torch.randn(25, 32)
    idx, w = random_routing(25, 4, 3)
    first = _run(backend, module, x, idx, w)
    assert torch.equal(first, _run(backend, module, x, idx, w))


def test_grouped_mm_loop_fallback_matches_native() -> None:
    from selector.plugins.grouped_mm.forward import grouped_mm_loop

    x = torch.randn(10, 8)
    weight = torch.randn(3, 8, 5)
    offsets = torch.tensor([4, 4, 10], dtype=torch.int32)  # expert 1 gets no rows
    out = torch.ops.selector.grouped_mm_loop(x, weight, offsets)
    expected = torch.cat([x[:4] @ weight[0], x[4:] @ weight[2]])
    torch.testing.assert_close(out, expected)
    assert grouped_mm_loop is not None


@pytest.mark.compile
def test_grouped_mm_compiles_fullgraph() -> None:
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "grouped_mm")
    x = torch.randn(6, 16)
    idx, w = random_routing(6, 4, 2)
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    out = compiled(x, idx, w)
    assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]


@pytest.mark.compile
def test_auto_compiles_with_dynamic_token_counts() -> None:
    module = make_experts(4, 16, 8)
    compiled = torch.compile(module, fullgraph=True, backend="eager", dynamic=True)
    for t in (3, 7):
        x = torch.randn(t, 16)
        idx, w = random_routing(t, 4, 2)
        assert relative_error(compiled(x, idx, w), reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]
