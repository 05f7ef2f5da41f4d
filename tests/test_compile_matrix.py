"""torch.compile and autograd against what every backend declares, on the CPU.

The matrix runs each backend that runs on the CPU, traced with and without fullgraph=True, with autograd on
and off: a combination the backend declares compiles and matches the uncompiled layer (output and
gradients); one it does not declare is refused with the declared reason. A wrong declaration fails here.

CPU only checks the `default` mode: `reduce-overhead` and `max-autotune` capture CUDA graphs, and
`max-autotune-no-cudagraphs` autotunes GPU kernels; those belong to the GPU lane. The matrix traces through
Dynamo and AOTAutograd (`backend="aot_eager"`: the graphs, the guards and the backward that inductor would
compile, without its C++ code generation, ~20 s a graph on a shared 2-core CPU); one test compiles with
inductor end to end.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from experts_fixtures import TOLERANCE, make_experts, random_routing, relative_error

import selector
from selector import BackendSpec, Requirements, hookimpl
from selector.compat_table import markdown_table
from selector.dispatch import backend_forward, get_backend_registry, grad_inputs, last_backend, problem_of, rank_problem
from selector.environment import current_environment
from selector.plugins.eager.forward import FULLGRAPH_MESSAGE
from selector.plugins.grouped_mm.forward import grouped_mm_loop
from selector.probes import collect_environment
from selector.ranking import rank
from selector.registry import get_registry
from selector.requirements import evaluate
from selector.types import COMPILE_MODES, GRAD_INPUTS, Problem

ALL_GRADS = frozenset(GRAD_INPUTS)
GRAD_TOLERANCE = 1e-4  # float32 gradients summed in another order than the uncompiled run's


def _builtin_specs() -> list[BackendSpec]:
    registry = get_registry()
    return [s for n, s in sorted(registry.specs.items()) if registry.providers.get(n) in registry.builtins]


CPU_BACKENDS = [s.name for s in _builtin_specs() if "cpu" in s.requirements.devices]


def _layer(name: str, grad: bool) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    module = make_experts(4, 16, 8, seed=0)
    module.requires_grad_(grad)
    index, weights = random_routing(6, 4, 2)
    hidden = torch.randn(6, 16, requires_grad=grad)
    selector.set_experts_implementation(module, name)
    return module, (hidden, index, weights.requires_grad_(grad))


def _grads(module: torch.nn.Module, out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    wrt = [inputs[0], inputs[2], module.gate_up_proj, module.down_proj]
    upstream = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    return list(torch.autograd.grad(out, wrt, upstream))


def _declared(spec: BackendSpec, fullgraph: bool, grad: bool) -> bool:
    """Whether the declarations promise this combination runs on the CPU in the default mode."""
    if "default" not in spec.supported_compile_modes() or (fullgraph and not spec.traces_fullgraph()):
        return False
    return not grad or spec.differentiable is None or ALL_GRADS <= spec.differentiable


def _compiled_layer(
    module: torch.nn.Module, fullgraph: bool, backend: str = "aot_eager", **options: object
) -> Callable[..., torch.Tensor]:
    torch._dynamo.reset()
    return torch.compile(module, backend=backend, fullgraph=fullgraph, **options)


@pytest.mark.compile
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_compile_matrix(name: str, fullgraph: bool, grad: bool) -> None:
    spec = get_backend_registry().get(name)
    module, inputs = _layer(name, grad)
    mode = contextlib.nullcontext() if grad else torch.no_grad()
    if grad and not _declared(spec, False, True):  # no backward declared: refused at the first forward
        with pytest.raises(ValueError, match="has no backward"):
            module(*inputs)
        with pytest.raises(RuntimeError):  # ... and the forward itself really has none
            _grads(module, backend_forward(name)(module, *inputs), inputs)
        return
    with mode:
        ref = module(*inputs)  # uncompiled, and selector has seen the layer before it is traced
    compiled = _compiled_layer(module, fullgraph)
    if not _declared(spec, fullgraph, grad):
        with mode, pytest.raises(torch._dynamo.exc.Unsupported, match="fullgraph"):
            compiled(*inputs)
        return
    with mode:
        out = compiled(*inputs)
    assert relative_error(out, ref) < TOLERANCE[torch.float32]
    if grad:
        for got, want in zip(_grads(module, out, inputs), _grads(module, ref, inputs)):
            assert relative_error(got, want) < GRAD_TOLERANCE


@pytest.mark.compile
def test_eager_under_fullgraph_says_why_and_what_to_do() -> None:
    module, inputs = _layer("eager", grad=False)
    with torch.no_grad():
        module(*inputs)
        with pytest.raises(torch._dynamo.exc.Unsupported) as info:
            _compiled_layer(module, fullgraph=True)(*inputs)
    assert FULLGRAPH_MESSAGE in str(info.value)


@pytest.mark.compile
def test_inductor_compiles_grouped_mm_with_autograd_in_fullgraph() -> None:
    """The failure this declaration fixes: inductor, fullgraph, parameters that require grad, the loop op."""
    module, inputs = _layer("grouped_mm", grad=True)
    ref = module(*inputs)
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would skip the backward's trace
        out = _compiled_layer(module, fullgraph=True, backend="inductor", mode="default")(*inputs)
    assert last_backend(module) == "grouped_mm"
    assert relative_error(out, ref) < TOLERANCE[torch.float32]
    for got, want in zip(_grads(module, out, inputs), _grads(module, ref, inputs)):
        assert relative_error(got, want) < GRAD_TOLERANCE


def _compiled_graph_count(name: str, max_tokens: int) -> int:
    """Graphs Dynamo compiled for one layer called at 1..max_tokens tokens with dynamic=True (no_grad)."""
    from torch._dynamo.utils import counters

    module, (hidden, index, weights) = _layer(name, grad=False)
    with torch.no_grad():
        module(hidden, index, weights)
        compiled = _compiled_layer(module, fullgraph=False, dynamic=True)
        counters.clear()
        for tokens in range(1, max_tokens + 1):
            idx, w = random_routing(tokens, 4, 2)
            compiled(torch.randn(tokens, 16), idx, w)
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.compile
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_recompilations_across_token_counts(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    graphs = _compiled_graph_count(name, 8)
    with capsys.disabled():
        print(f"\n{name}: {graphs} graphs for token counts 1..8 (dynamic=True)")
    spec = get_backend_registry().get(name)
    # fullgraph backends: one graph for 1 token (specialised) and one symbolic graph for the rest; a backend
    # that breaks the graph compiles its pieces again for some counts, but not more than twice per count
    assert graphs <= (2 if spec.traces_fullgraph() else 2 * 8)


# -- the declarations and the ranking (no compiling) --


def test_every_builtin_declares_modes_fullgraph_and_autograd() -> None:
    for spec in _builtin_specs():
        assert spec.compile_modes is not None and spec.compile_modes <= set(COMPILE_MODES), spec.name
        assert spec.fullgraph is not None, spec.name
        assert spec.differentiable is not None and spec.differentiable <= ALL_GRADS, spec.name
        assert spec.traces_fullgraph() == spec.compile_compatible, spec.name  # what auto avoids while tracing


def test_the_loop_op_backward_matches_finite_differences_in_float64() -> None:
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 2, 2, 7], dtype=torch.int32)  # experts 0 and 2 receive no rows
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm_loop(a, b, offsets), (x, w))
    grad = torch.autograd.grad(grouped_mm_loop(x, w, offsets).sum(), w)[0]
    assert grad[0].abs().sum() == 0 and grad[2].abs().sum() == 0


def test_grouped_mm_layer_gradients_match_the_eager_backend() -> None:
    """Uncompiled, through torch's grouped GEMM where it runs (the matrix covers the loop op under compile)."""
    grads: dict[str, list[torch.Tensor]] = {}
    for name in ("eager", "grouped_mm"):
        module, inputs = _layer(name, grad=True)
        grads[name] = _grads(module, module(*inputs), inputs)
    for got, want in zip(grads["grouped_mm"], grads["eager"]):
        assert relative_error(got, want) < GRAD_TOLERANCE


def test_grad_inputs_names_what_autograd_records() -> None:
    module, (hidden, _, weights) = _layer("eager", grad=False)
    assert grad_inputs(module, hidden, weights) == ()
    weights.requires_grad_(True)
    assert grad_inputs(module, hidden, weights) == ("routing_weights",)
    module.requires_grad_(True)
    assert grad_inputs(module, hidden.requires_grad_(True), weights) == GRAD_INPUTS
    with torch.no_grad():
        assert grad_inputs(module, hidden, weights) == ()


class ForwardOnly:
    """A fake plugin: fastest on paper, its kernel has no backward (declared)."""

    @staticmethod
    @hookimpl
    def selector_backends():  # noqa: ANN205
        def load():  # noqa: ANN202
            def forward(module, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN202
                return torch.zeros_like(hidden_states)

            return forward

        fast = {"requirements": Requirements(devices=frozenset({"cpu"})), "estimate": lambda problem, env: 0.0}
        return [
            BackendSpec(name="fake_forward_only", load=load, differentiable=frozenset(), **fast),
            BackendSpec(name="fake_undeclared", load=load, **fast),
        ]


def test_auto_picks_only_differentiable_backends_while_autograd_records(fresh_registry) -> None:  # noqa: ANN001
    fresh_registry(ForwardOnly)
    module, inputs = _layer("auto", grad=False)
    module(*inputs)
    assert last_backend(module) in ("fake_forward_only", "fake_undeclared")  # no grad: the fast fakes
    module.requires_grad_(True)
    module(*inputs)
    assert last_backend(module) != "fake_forward_only"
    ranking = rank_problem(replace(problem_of(module, 2), grad_inputs=grad_inputs(module)))
    assert "has no backward" in ranking.excluded["fake_forward_only"].reason
    assert "fake_forward_only" not in selector.explain_model(module)[""].excluded  # explained for inference


def test_a_named_backend_without_backward_raises_at_the_first_forward(fresh_registry) -> None:  # noqa: ANN001
    fresh_registry(ForwardOnly)
    module, inputs = _layer("fake_forward_only", grad=True)
    with pytest.raises(ValueError, match=r"has no backward.*fix: pick a differentiable backend such as grouped_mm"):
        module(*inputs)
    with torch.no_grad():
        assert module(*inputs).abs().sum() == 0  # the same call without autograd runs
    selector.set_experts_implementation(module, "fake_undeclared")
    module(*inputs)  # undeclared: its backward is its own business, as before the declaration existed


def _problem(**changes: object) -> Problem:
    return replace(Problem(4, 16, 8, 2, dtype="float32", device="cpu"), **changes)


def test_compile_mode_and_fullgraph_are_refused_as_declared() -> None:
    env, registry = current_environment(), get_registry()
    eager = registry.get("eager")
    verdict = evaluate(eager, _problem(compile=True, fullgraph=True), env)
    assert not verdict.ok and "fullgraph=True" in verdict.reason and "grouped_mm" in verdict.remedy
    verdict = evaluate(eager, _problem(compile=True, compile_mode="reduce-overhead"), env)
    assert not verdict.ok and "'reduce-overhead'" in verdict.reason and "max-autotune-no-cudagraphs" in verdict.reason
    verdict = evaluate(eager, _problem(compile=True, compile_mode="default"), env)
    assert "cannot be traced by" in verdict.reason  # a declared mode, but a graph break: auto avoids it while tracing
    assert evaluate(registry.get("grouped_mm"), _problem(compile=True, compile_mode="reduce-overhead"), env).ok
    ranking = rank(_problem(compile=True, fullgraph=True, compile_mode="max-autotune", grad_inputs=GRAD_INPUTS),
                   env, registry)  # fmt: skip
    assert {c.name for c in ranking.candidates} == {"batched_mm", "grouped_mm"}


def test_quantised_experts_have_no_backward_on_any_builtin() -> None:
    env = collect_environment({"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "PATH": ""})
    problem = _problem(device="cuda", dtype="bfloat16", weight_format="fp8_block", scale_format="float32",
                       grad_inputs=("hidden_states",))  # fmt: skip
    for name in ("grouped_mm", "batched_mm"):
        verdict = evaluate(get_registry().get(name), problem, env)
        assert not verdict.ok and "no backward for fp8_block" in verdict.reason and "no_grad" in verdict.remedy


def test_readme_table_is_the_generated_one() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert markdown_table(_builtin_specs()) in readme, "paste the output of `python -m selector.compat_table`"


def test_doctor_markdown_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from selector.cli import main

    main(["doctor", "--markdown"])
    out = capsys.readouterr().out
    assert "CUDA graphs and autograd (as declared)" in out
    assert markdown_table(get_registry().specs.values()) in out


# -- the GPU lane: every declared mode, on the backends that run on this GPU --


def _gpu_cases() -> list[tuple[str, str, bool]]:
    """(backend, mode, fullgraph) per built-in that declares the mode; fullgraph where it declares it."""
    return [(s.name, m, s.traces_fullgraph()) for s in _builtin_specs() if "cuda" in s.requirements.devices
            for m in COMPILE_MODES if m in s.supported_compile_modes()]  # fmt: skip


def _gpu_layer(name: str, grad: bool) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    module = make_experts(8, 256, 128, dtype=torch.bfloat16, device="cuda", seed=0)
    module.requires_grad_(grad)
    index, weights = random_routing(48, 8, 2, device="cuda")
    hidden = torch.randn(48, 256, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    selector.set_experts_implementation(module, name)
    return module, (hidden, index, weights.requires_grad_(grad))


def _runs_here(name: str, module: torch.nn.Module) -> bool:
    verdict = evaluate(get_backend_registry().get(name), problem_of(module, 2), current_environment())
    return verdict.ok


@pytest.mark.compile
@pytest.mark.gpu
@pytest.mark.parametrize(("name", "mode", "fullgraph"), _gpu_cases())
def test_gpu_declared_modes_compile_and_match(name: str, mode: str, fullgraph: bool) -> None:
    module, inputs = _gpu_layer(name, grad=False)
    if not _runs_here(name, module):
        pytest.skip(f"{name} does not run on this machine")
    with torch.no_grad():
        ref = module(*inputs).clone()
        compiled = _compiled_layer(module, fullgraph=fullgraph, backend="inductor", mode=mode)
        for _ in range(3):  # CUDA-graph modes record on a later call than the first
            out = compiled(*inputs).clone()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.compile
@pytest.mark.gpu
@pytest.mark.parametrize("name", [s.name for s in _builtin_specs() if "cuda" in s.requirements.devices])
def test_gpu_autograd_as_declared(name: str) -> None:
    """A differentiable backend's compiled gradients match its uncompiled ones; one without a backward is
    refused at the first forward."""
    spec = get_backend_registry().get(name)
    module, inputs = _gpu_layer(name, grad=True)
    if not _runs_here(name, module):
        pytest.skip(f"{name} does not run on this machine")
    if not (spec.differentiable and ALL_GRADS <= spec.differentiable):
        with pytest.raises(ValueError, match="has no backward"):
            module(*inputs)
        return
    ref = module(*inputs)
    want = _grads(module, ref, inputs)
    eager, eager_inputs = _gpu_layer("eager", grad=True)  # the same weights and inputs (seeded)
    for got, expected in zip(want, _grads(eager, eager(*eager_inputs), eager_inputs)):
        assert relative_error(got, expected) < 5e-2  # bf16 gradients summed in another order
    if "default" in spec.supported_compile_modes():
        out = _compiled_layer(module, fullgraph=spec.traces_fullgraph(), backend="inductor")(*inputs)
        assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
        for got, expected in zip(_grads(module, out, inputs), want):
            assert relative_error(got, expected) < TOLERANCE[torch.bfloat16]


def test_doctor_judges_a_layer_called_under_fullgraph_or_autograd(capsys: pytest.CaptureFixture[str]) -> None:
    from selector.cli import main

    layer = ["doctor", "--json", "--device", "cpu", "--experts", "8", "--hidden", "64", "--intermediate", "32",
             "--top-k", "2"]  # fmt: skip
    main([*layer, "--fullgraph"])
    excluded = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    assert "fullgraph=True" in excluded["eager"]["reason"] and excluded["grouped_mm"]["status"] == "ok"
    main([*layer, "--grad", "--weight-format", "fp8_block", "--scale-format", "float32"])
    excluded = {b["name"]: b for b in json.loads(capsys.readouterr().out)["backends"]}
    assert "no backward for fp8_block" in excluded["grouped_mm"]["reason"]
