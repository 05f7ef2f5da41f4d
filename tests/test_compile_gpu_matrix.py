"""The GPU lane of the compile matrix: every CUDA backend (and auto) x torch.compile mode x fullgraph x autograd.

A combination the backend declares compiles with inductor and matches the uncompiled layer within bf16
tolerance (output, and gradients under autograd); one it does not declare is refused as declared: a backend
without a backward raises at the first forward under autograd, one that breaks the graph raises under
fullgraph=True. A mode a backend does not declare promises nothing, so it is skipped, and so is
fullgraph=False where the backend traces without a break (the same graph). Backends not installed here
(sonicmoe, deepgemm) skip. About 40 inductor compiles on an H200: `-k "default or reduce"` for a shorter run.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from experts_fixtures import TOLERANCE, make_experts, random_routing, relative_error

import selector
from selector.dispatch import get_backend_registry, last_backend, problem_of
from selector.environment import current_environment
from selector.requirements import evaluate
from selector.types import COMPILE_MODES, GRAD_INPUTS, GRAPH_MODES

pytestmark = pytest.mark.compile

BACKENDS = ("auto", "triton_fused", "grouped_mm", "batched_mm", "eager", "sonicmoe", "deepgemm")
GRAD_TOLERANCE = 3e-2  # bf16 gradients, compiled kernels summed in another order than the uncompiled ones


def _layer(name: str, grad: bool) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    module = make_experts(8, 256, 128, dtype=torch.bfloat16, device="cuda", seed=0)
    module.requires_grad_(grad)
    index, weights = random_routing(48, 8, 2, device="cuda")
    hidden = torch.randn(48, 256, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    selector.set_experts_implementation(module, name)
    return module, (hidden, index, weights.requires_grad_(grad))


def _grads(module: torch.nn.Module, out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    wrt = [inputs[0], inputs[2], module.gate_up_proj, module.down_proj]
    upstream = torch.linspace(-1.0, 1.0, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    return [g.clone() for g in torch.autograd.grad(out, wrt, upstream)]


def _step(mode: str) -> Callable[[], None]:
    return torch.compiler.cudagraph_mark_step_begin if mode in GRAPH_MODES else (lambda: None)


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
@pytest.mark.parametrize("mode", COMPILE_MODES)
@pytest.mark.parametrize("name", BACKENDS)
def test_gpu_compile_matrix(name: str, mode: str, fullgraph: bool, grad: bool) -> None:
    module, inputs = _layer(name, grad)
    spec = None if name == "auto" else get_backend_registry().get(name)
    if spec is not None:
        verdict = evaluate(spec, problem_of(module, 2), current_environment())
        if not verdict.ok:
            pytest.skip(f"{name} does not run this layer here: {verdict.reason}")
        if grad and not (spec.differentiable is None or set(GRAD_INPUTS) <= spec.differentiable):
            with pytest.raises(ValueError, match="has no backward"):
                module(*inputs)
            return
        if mode not in spec.supported_compile_modes():
            pytest.skip(f"{name} does not declare mode {mode!r}: nothing promised")
    if not fullgraph and (spec is None or spec.traces_fullgraph()):
        pytest.skip("traces without a break: the same graph as the fullgraph=True case")
    context = torch.enable_grad() if grad else torch.no_grad()
    try:
        with context:
            ref = module(*inputs)
    except ImportError as exc:  # its requirements hold but its kernel is not on this node (a hub kernel offline)
        pytest.skip(f"{name} cannot load its kernel here: {str(exc)[:160]}")
    want = _grads(module, ref, inputs) if grad else None
    ref = ref.detach().clone()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="inductor", mode=mode, fullgraph=fullgraph)
    step = _step(mode)
    if fullgraph and spec is not None and not spec.traces_fullgraph():
        with context, pytest.raises(torch._dynamo.exc.Unsupported):
            compiled(*inputs)
        return
    for _ in range(3):  # CUDA-graph modes warm up, then record, then replay
        step()
        with context:
            out = compiled(*inputs)
        got = _grads(module, out, inputs) if grad else None
        out = out.detach().clone()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16], last_backend(module)
    if grad:
        for g, w in zip(got, want):
            assert relative_error(g, w) < GRAD_TOLERANCE, last_backend(module)
