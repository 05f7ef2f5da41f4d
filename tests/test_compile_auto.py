"""auto under torch.compile: one opaque op, `selector::experts`, that chooses per token bucket at run time.

CPU: fake backends whose estimates flip with the token count stand in for a decode kernel and a prefill kernel;
the compiled layer must run each where the eager layer would, among backends declared for torch.compile, with
few graphs across token counts (dynamic shapes). GPU: the compiled default mode replays the backend's own
recorded graph at small T; CUDA-graph modes never record one inside their warm-up or capture.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from experts_fixtures import TOLERANCE, make_experts, random_routing, relative_error

import selector
from selector import BackendSpec, Requirements, graphs, hookimpl
from selector.dispatch import OPAQUE_WHEN_COMPILED, backend_forward, last_backend, track

SMALL_TOKENS = 4  # the fake decode backend is fastest up to this many tokens, the prefill one above
RAN: list[str] = []


def _forward_as(name: str) -> Callable[[], Callable[..., torch.Tensor]]:
    def load() -> Callable[..., torch.Tensor]:
        def forward(module, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN202
            RAN.append(name)
            return backend_forward("grouped_mm")(module, hidden_states, top_k_index, top_k_weights)

        return forward

    return load


def _decode_cost(problem, env) -> float:  # noqa: ANN001
    return 1e-9 if problem.num_tokens is not None and problem.num_tokens <= SMALL_TOKENS else 1.0


def _prefill_cost(problem, env) -> float:  # noqa: ANN001
    return 1e-8 if problem.num_tokens is None or problem.num_tokens > SMALL_TOKENS else 1.0


class TwoKernels:
    """A fake plugin: a decode backend and a prefill backend, both declared for torch.compile, and a faster one
    that is not (compile_compatible=False: auto must never pick it for a compiled model)."""

    @staticmethod
    @hookimpl
    def selector_backends():  # noqa: ANN205
        cpu = Requirements(devices=frozenset({"cpu"}))
        return [
            BackendSpec(name="fake_decode", load=_forward_as("fake_decode"), requirements=cpu, estimate=_decode_cost),
            BackendSpec(name="fake_prefill", load=_forward_as("fake_prefill"), requirements=cpu,
                        estimate=_prefill_cost),
            BackendSpec(name="fake_untraceable", load=_forward_as("fake_untraceable"), requirements=cpu,
                        estimate=lambda problem, env: 0.0, compile_compatible=False, fullgraph=False),
        ]  # fmt: skip


def _layer() -> torch.nn.Module:
    module = make_experts(4, 16, 8, seed=0)
    module.requires_grad_(False)
    return module


def _inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    index, weights = random_routing(tokens, 4, 2)
    return torch.randn(tokens, 16), index, weights


@pytest.fixture(autouse=True)
def _fresh_dynamo():  # noqa: ANN202
    torch._dynamo.reset()
    RAN.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.compile
def test_compiled_auto_chooses_per_token_count_with_two_graphs(fresh_registry, capsys) -> None:  # noqa: ANN001
    from torch._dynamo.utils import counters

    fresh_registry(TwoKernels)
    module = _layer()
    with torch.no_grad():
        module(*_inputs(3))
        assert last_backend(module) == "fake_untraceable"  # eager: the fastest, traceable or not
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
        counters.clear()
        for tokens in (1, 2, 3, 4, 5, 8, 16, 64, 2, 1):
            RAN.clear()
            hidden, index, weights = _inputs(tokens)
            out = compiled(hidden, index, weights)
            want = "fake_decode" if tokens <= SMALL_TOKENS else "fake_prefill"
            assert RAN == [want], tokens
            assert last_backend(module) == want
            assert relative_error(out, backend_forward("eager")(module, hidden, index, weights)) < 1e-5
    graphs_compiled = int(counters["stats"]["unique_graphs"])
    with capsys.disabled():
        print(f"\nauto under torch.compile(dynamic=True): {graphs_compiled} graphs for 10 calls at 1..64 tokens")
    assert graphs_compiled <= 2  # one specialised to 1 token, one symbolic in T


@pytest.mark.compile
@pytest.mark.parametrize("seen", [True, False], ids=["run_before", "only_tracked"])
def test_compiled_auto_without_dynamic_compiles_two_graphs(fresh_registry, seen: bool) -> None:  # noqa: ANN001
    """dynamic=None: static at the first shape, symbolic from the second; and nothing the op's eager run writes
    on the module (its k, its pinned defaults) fails a guard of the first graph, run before or not."""
    from torch._dynamo.utils import counters

    fresh_registry(TwoKernels)
    module = _layer()
    selector.set_experts_implementation(module, "auto")  # tracks it
    with torch.no_grad():
        if seen:
            module(*_inputs(3))
        compiled = torch.compile(module, backend="eager", fullgraph=True)
        counters.clear()
        for tokens in (2, 2, 3, 5, 7, 2, 3):
            compiled(*_inputs(tokens))
    assert int(counters["stats"]["unique_graphs"]) == 2


@pytest.mark.compile
def test_compiled_auto_under_autograd_keeps_one_traced_choice(fresh_registry) -> None:  # noqa: ANN001
    """Autograd: the op has no backward, so auto is chosen once per layer and traced (differentiable ones only)."""
    fresh_registry(TwoKernels)
    module = make_experts(4, 16, 8, seed=0)
    hidden, index, weights = _inputs(6)
    module(hidden, index, weights)  # tracked, k seen
    RAN.clear()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    out = compiled(hidden.requires_grad_(True), index, weights)
    out.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    assert RAN == ["fake_prefill"]  # traced into the graph: the choice for a typical token count, declared for compile


@pytest.mark.compile
def test_a_named_backend_is_traced_not_run_through_the_op(fresh_registry) -> None:  # noqa: ANN001
    fresh_registry(TwoKernels)
    module = _layer()
    selector.set_experts_implementation(module, "fake_decode")
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    with torch.no_grad():
        module(*_inputs(3))
        torch.compile(module, backend=backend)(*_inputs(3))
    assert not any("selector.experts" in target for target in seen)


class OpaqueKernel:
    """A fake plugin whose forward asks to run eagerly inside compiled models (as one replaying its own graphs)."""

    @staticmethod
    @hookimpl
    def selector_backends():  # noqa: ANN205
        def load() -> Callable[..., torch.Tensor]:
            forward = _forward_as("fake_opaque")()
            setattr(forward, OPAQUE_WHEN_COMPILED, True)
            return forward

        return [BackendSpec(name="fake_opaque", load=load, requirements=Requirements(devices=frozenset({"cpu"})))]


def _targets(compiled_call: Callable[[], object]) -> list[str]:
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    compiled_call(backend)
    return seen


@pytest.mark.compile
def test_a_named_backend_that_asks_for_it_runs_through_the_op_without_autograd(fresh_registry) -> None:  # noqa: ANN001
    fresh_registry(OpaqueKernel)
    module = _layer()
    selector.set_experts_implementation(module, "fake_opaque")
    with torch.no_grad():
        module(*_inputs(3))
        RAN.clear()
        targets = _targets(lambda backend: torch.compile(module, backend=backend, fullgraph=True)(*_inputs(5)))
    assert any("selector.experts" in t for t in targets)
    assert RAN == ["fake_opaque"] and last_backend(module) == "fake_opaque"  # run by the op, eagerly
    torch._dynamo.reset()
    module.requires_grad_(True)
    RAN.clear()
    targets = _targets(lambda backend: torch.compile(module, backend=backend, fullgraph=True)(*_inputs(5)))
    assert not any("selector.experts" in t for t in targets)  # autograd: traced (the op has no backward)
    assert RAN == ["fake_opaque"]  # ... while tracing


@pytest.mark.compile
def test_the_op_is_one_node_and_its_fake_is_shaped_like_hidden_states(fresh_registry) -> None:  # noqa: ANN001
    fresh_registry(TwoKernels)
    module = _layer()
    seen: list[tuple[str, object]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., object]:
        for node in gm.graph.nodes:
            if "selector.experts" in str(node.target):
                seen.append((str(node.target), node.meta["example_value"]))
        return gm.forward

    with torch.no_grad():
        module(*_inputs(3))
        torch.compile(module, backend=backend, fullgraph=True)(*_inputs(5))
    assert len(seen) == 1
    fake = seen[0][1]
    assert tuple(fake.shape) == (5, 16) and fake.dtype == torch.float32 and fake.is_contiguous()


def test_opcheck_the_experts_op(fresh_registry) -> None:  # noqa: ANN001
    fresh_registry(TwoKernels)
    module = _layer()
    hidden, index, weights = _inputs(5)
    with torch.no_grad():
        module(hidden, index, weights)
    uid = track(module)
    torch.library.opcheck(
        torch.ops.selector.experts.default,
        (uid, "", hidden, index, weights, module.gate_up_proj),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_the_op_names_a_module_that_is_gone() -> None:
    hidden, index, weights = _inputs(2)
    with pytest.raises(RuntimeError, match="no longer exists"):
        torch.ops.selector.experts("experts-gone", "", hidden, index, weights, torch.zeros(1))


@pytest.mark.compile
def test_a_copy_compiled_before_any_eager_call_runs_its_own_weights(fresh_registry) -> None:  # noqa: ANN001
    import copy

    fresh_registry(TwoKernels)
    module = _layer()
    with torch.no_grad():
        module(*_inputs(3))
        twin = copy.deepcopy(module)  # keeps the original's id until selector sees it run
        twin.gate_up_proj.mul_(2.0)
        hidden, index, weights = _inputs(3)
        targets = _targets(lambda backend: torch.compile(twin, backend=backend, fullgraph=True)(hidden, index, weights))
        assert not any("selector.experts" in t for t in targets)  # traced: the op would run the original
        torch._dynamo.reset()
        out = torch.compile(twin, backend="eager", fullgraph=True)(hidden, index, weights)
        assert relative_error(out, backend_forward("eager")(twin, hidden, index, weights)) < 1e-5
        assert relative_error(out, backend_forward("eager")(module, hidden, index, weights)) > 1e-2
        torch._dynamo.reset()
        twin(*_inputs(3))  # seen run: its own id, so the op from now on
        targets = _targets(lambda backend: torch.compile(twin, backend=backend, fullgraph=True)(hidden, index, weights))
        assert any("selector.experts" in t for t in targets)


@pytest.mark.compile
def test_inductor_compiles_the_op_and_matches_eager(fresh_registry) -> None:  # noqa: ANN001
    fresh_registry(TwoKernels)
    module = _layer()
    with torch.no_grad():
        module(*_inputs(3))
        compiled = torch.compile(module, backend="inductor", fullgraph=True)
        for tokens in (3, 9):
            hidden, index, weights = _inputs(tokens)
            out = compiled(hidden, index, weights)
            assert relative_error(out, backend_forward("eager")(module, hidden, index, weights)) < TOLERANCE[
                torch.float32
            ]
            assert last_backend(module) == ("fake_decode" if tokens <= SMALL_TOKENS else "fake_prefill")


def test_own_graphs_off_turns_graphs_off_and_nests(monkeypatch: pytest.MonkeyPatch) -> None:
    class Cuda:  # only what graphs_enabled reads
        is_cuda = True
        shape = (4, 16)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_GRAPHS", "1")
    assert graphs.graphs_enabled(Cuda(), 64, "SELECTOR_TRITON_FUSED_GRAPHS")
    with graphs.own_graphs(False):
        assert not graphs.graphs_enabled(Cuda(), 64, "SELECTOR_TRITON_FUSED_GRAPHS")
        with graphs.own_graphs(True):  # allowing inside a block that forbids does not re-allow
            assert not graphs.graphs_enabled(Cuda(), 64, "SELECTOR_TRITON_FUSED_GRAPHS")
        with pytest.raises(KeyError), graphs.own_graphs(False):
            raise KeyError("a failing call")
        assert not graphs.graphs_enabled(Cuda(), 64, "SELECTOR_TRITON_FUSED_GRAPHS")
    assert graphs.graphs_enabled(Cuda(), 64, "SELECTOR_TRITON_FUSED_GRAPHS")


# -- the GPU lane --


def _gpu_layer() -> torch.nn.Module:
    torch.manual_seed(0)
    module = make_experts(16, 512, 256, dtype=torch.bfloat16, device="cuda", seed=0)
    return module.requires_grad_(False)


def _gpu_inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    index, weights = random_routing(tokens, 16, 4, device="cuda")
    return torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16), index, weights


@pytest.mark.compile
@pytest.mark.gpu
def test_gpu_compiled_default_mode_replays_the_backends_own_graph() -> None:
    module, inputs = _gpu_layer(), _gpu_inputs(8)
    with torch.no_grad():
        module(*_gpu_inputs(3))  # seen eagerly, at another token count
        ref = backend_forward("grouped_mm")(module, *inputs)
        compiled = torch.compile(module, fullgraph=True, mode="default")
        before = graphs.recordings()
        out = compiled(*inputs)
        if last_backend(module) != "triton_fused":
            pytest.skip(f"auto picked {last_backend(module)} here, which records no graphs of its own")
        assert graphs.recordings() == before + 1  # recorded at its first compiled call (T=8 <= DECODE_TOKENS)
        for _ in range(3):
            out = compiled(*inputs)
        assert graphs.recordings() == before + 1  # replayed since
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.compile
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_gpu_cuda_graph_modes_record_no_graph_of_their_own(mode: str) -> None:
    module, inputs = _gpu_layer(), _gpu_inputs(8)
    with torch.no_grad():
        ref = backend_forward("grouped_mm")(module, *inputs)
        module(*_gpu_inputs(3))  # seen eagerly, at another token count
        compiled = torch.compile(module, fullgraph=True, mode=mode)
        before = graphs.recordings()
        for _ in range(4):  # warm-up, capture, replays
            out = compiled(*inputs).clone()
    assert graphs.recordings() == before  # warm-up on inductor's side stream, then inside its capture
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.compile
@pytest.mark.gpu
def test_gpu_compiled_auto_chooses_per_token_count_as_declared() -> None:
    from selector.dispatch import choose_backend

    module = _gpu_layer()
    with torch.no_grad():
        module(*_gpu_inputs(1))
        compiled = torch.compile(module, fullgraph=True, dynamic=True)
        for tokens in (1, 8, 64, 512, 4096):
            inputs = _gpu_inputs(tokens)
            out = compiled(*inputs)
            assert last_backend(module) == choose_backend(module, tokens, 4, compiled=True), tokens
            assert relative_error(out, backend_forward("grouped_mm")(module, *inputs)) < TOLERANCE[torch.bfloat16]


@pytest.mark.compile
def test_the_op_checks_the_inputs_when_the_compiled_model_runs(fresh_registry) -> None:  # noqa: ANN001
    fresh_registry(TwoKernels)
    module = _layer()
    with torch.no_grad():
        module(*_inputs(3))
        compiled = torch.compile(module, backend="eager", fullgraph=True)
        hidden, index, weights = _inputs(3)
        index[1, 0] = 9  # not an expert of this layer (E=4)
        with pytest.raises(ValueError, match="expert"):
            compiled(hidden, index, weights)
