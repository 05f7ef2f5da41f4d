"""The forward as a pipeline: dispatch chooses, the backend prepares a plan once per key, the core runs it.

A fake third-party backend with a `prepare` counts how often it is asked; the built-in torch backends show the
default plan (their forward on the module). The one per-module cache is written by dispatch alone.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass, replace

import pytest
import torch
from experts_fixtures import TOLERANCE, make_experts, random_routing, reference_experts, relative_error

import selector
from selector import BackendSpec, ExpertsPlan, ForwardPlan, GraphPolicy, Problem, Requirements, hookimpl
from selector import dispatch, graphs


@dataclass(frozen=True, kw_only=True)
class ScaledPlan(ExpertsPlan):
    """A fake backend's plan: the reference experts on a copy of the weights taken at prepare time."""

    gate_up: torch.Tensor
    down: torch.Tensor
    requires_grad: bool

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        PreparingPlugin.runs += 1
        out = torch.zeros_like(hidden_states)
        for slot in range(top_k_index.shape[1]):
            for token in range(hidden_states.shape[0]):
                e = int(top_k_index[token, slot])
                gate, up = (self.gate_up[e] @ hidden_states[token]).chunk(2)
                out[token] += top_k_weights[token, slot] * (self.down[e] @ (torch.nn.functional.silu(gate) * up))
        return out


class PreparingPlugin:
    """A fake third-party plugin that declares `prepare` (no forward of its own but the one load() gives)."""

    prepared: list[Problem] = []
    runs = 0

    @staticmethod
    @hookimpl
    def selector_backends():
        def prepare(module: torch.nn.Module, problem: Problem) -> ScaledPlan:
            PreparingPlugin.prepared.append(problem)
            return ScaledPlan(
                backend="fake_preparing",
                gate_up=module.gate_up_proj.detach().clone(),
                down=module.down_proj.detach().clone(),
                requires_grad=problem.requires_grad,
                graphs=GraphPolicy(64, "SELECTOR_TRITON_FUSED_GRAPHS"),
            )

        def load():
            raise AssertionError("the core runs the prepared plan, not load()'s forward")

        return [
            BackendSpec(
                name="fake_preparing",
                load=load,
                prepare=prepare,
                requirements=Requirements(devices=frozenset({"cpu"})),
                estimate=lambda problem, env: 1e-12,
            )
        ]


@pytest.fixture
def preparing(fresh_registry):
    PreparingPlugin.prepared = []
    PreparingPlugin.runs = 0
    fresh_registry(fake_preparing=PreparingPlugin)
    return PreparingPlugin


def _inputs(t: int = 5, e: int = 4, h: int = 16, k: int = 2):
    idx, w = random_routing(t, e, k)
    return torch.randn(t, h), idx, w


def test_a_plan_is_prepared_once_per_key_and_run_per_call(preparing) -> None:
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "fake_preparing")
    x, idx, w = _inputs()
    with torch.no_grad():
        for _ in range(3):
            out = module(x, idx, w)
    assert len(preparing.prepared) == 1 and preparing.runs == 3
    assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]
    problem = preparing.prepared[0]
    assert (problem.num_experts, problem.hidden_size, problem.top_k, problem.grad_inputs) == (4, 16, 2, ())
    assert selector.last_backend(module) == "fake_preparing"


def test_an_in_place_update_of_the_weights_prepares_again(preparing) -> None:
    """The key's fingerprint covers each parameter's in-place version: a plan never runs stale weights."""
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "fake_preparing")
    x, idx, w = _inputs()
    with torch.no_grad():
        before = module(x, idx, w)
        module.down_proj.mul_(2.0)  # same storage, new values
        after = module(x, idx, w)
    assert len(preparing.prepared) == 2
    torch.testing.assert_close(after, 2 * before)
    assert relative_error(after, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]


def test_the_call_mode_is_part_of_the_key(preparing) -> None:
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "fake_preparing")
    x, idx, w = _inputs()
    with torch.no_grad():
        module(x, idx, w)
    module(x.requires_grad_(), idx, w)  # autograd records: another plan, told so
    assert [p.grad_inputs for p in preparing.prepared] == [(), ("hidden_states", "expert_weights")]


def test_a_copy_and_a_pickle_start_with_an_empty_cache(preparing) -> None:
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "fake_preparing")
    x, idx, w = _inputs()
    with torch.no_grad():
        module(x, idx, w)
        clone = copy.deepcopy(module)
        assert not dispatch.module_cache(clone).plans
        clone.down_proj.zero_()
        assert clone(x, idx, w).abs().max() == 0  # its own weights, not the original's plan
        assert module(x, idx, w).abs().max() > 0
        cache = dispatch.module_cache(module)
        assert cache.plans  # the module's own (the fixture's class is local: pickle the cache as its __dict__ would)
        assert not pickle.loads(pickle.dumps(cache)).plans
    assert len(preparing.prepared) == 2


def test_forget_module_drops_the_plans(preparing) -> None:
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "fake_preparing")
    x, idx, w = _inputs()
    with torch.no_grad():
        module(x, idx, w)
        dispatch.forget_module(module)
        module(x, idx, w)
    assert len(preparing.prepared) == 2


def test_the_core_replays_a_plan_that_allows_graphs(preparing, monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph recording wraps plan.run in the core: the key names the plan, never a module attribute."""
    replays: list[tuple] = []

    def fake_replay(module, namespace, key, run, inputs):
        replays.append((namespace, key))
        return run(*inputs)

    monkeypatch.setattr(graphs, "graphs_enabled", lambda x, max_tokens, variable: max_tokens == 64)
    monkeypatch.setattr(graphs, "replay", fake_replay)
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "fake_preparing")
    x, idx, w = _inputs()
    with torch.no_grad():
        module(x, idx, w)
        module(x, idx, w)
        module.down_proj.add_(1.0)
        module(x, idx, w)
    assert [namespace for namespace, _ in replays] == ["fake_preparing"] * 3
    assert replays[0][1] == replays[1][1] and replays[2][1] != replays[1][1]  # new weights: a new graph
    module(x.requires_grad_(), idx, w)  # under autograd nothing is replayed
    assert len(replays) == 3


def test_a_backend_with_only_a_forward_gets_a_forward_plan() -> None:
    module = make_experts(4, 16, 8)
    problem = dispatch.call_problem(module, 2)
    plan = dispatch.prepare_plan("grouped_mm", module, problem)
    assert isinstance(plan, ForwardPlan) and plan.backend == "grouped_mm" and plan.graphs is None
    x, idx, w = _inputs()
    assert relative_error(plan.run(x, idx, w), reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]
    del module
    with pytest.raises(RuntimeError, match="module this plan was prepared for is gone"):
        plan.run(x, idx, w)


@dataclass(frozen=True, kw_only=True)
class WatchedPlan(ExpertsPlan):
    """Runs another plan and fails if the module's __dict__ changed in the run (the routing guard's own entries,
    which the core's guard writes when a torch backend calls it, aside)."""

    inner: ExpertsPlan
    module: torch.nn.Module

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        before = _state(self.module)
        out = self.inner.run(hidden_states, top_k_index, top_k_weights)
        assert _state(self.module) == before, f"{self.backend}'s run wrote the module's __dict__"
        return out


def _state(module: torch.nn.Module) -> dict:
    return {k: id(v) for k, v in module.__dict__.items() if not k.startswith("_selector_guard")}


@pytest.mark.parametrize("name", ["eager", "batched_mm", "grouped_mm", "auto", "fake_preparing"])
def test_only_dispatch_writes_the_modules_dict(name: str, preparing, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-module state is one cache written by dispatch: a backend's prepare and run read the module and write
    nothing into it."""
    real_prepare = dispatch.prepare_plan
    watched: list[str] = []

    def watching_prepare(backend: str, module: torch.nn.Module, problem: Problem) -> ExpertsPlan:
        before = _state(module)
        plan = real_prepare(backend, module, problem)
        assert _state(module) == before, f"{backend}'s prepare wrote the module's __dict__"
        watched.append(backend)
        return WatchedPlan(backend=backend, inner=plan, module=module)

    monkeypatch.setattr(dispatch, "prepare_plan", watching_prepare)
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, name)
    x, idx, w = _inputs()
    with torch.no_grad():
        module(x, idx, w)
    module(x, idx, w)
    assert len(watched) == 2 and (name == "auto" or set(watched) == {name})


class RaisingPlugin:
    """A fake third-party plugin ranked first whose forward raises (a kernel that fails on this machine)."""

    calls = 0

    @staticmethod
    @hookimpl
    def selector_backends():
        def load():
            def forward(module, hidden_states, top_k_index, top_k_weights):
                RaisingPlugin.calls += 1
                raise RuntimeError("no kernel image is available for execution on the device")

            return forward

        return [
            BackendSpec(
                name="fake_raising",
                load=load,
                requirements=Requirements(devices=frozenset({"cpu"})),
                estimate=lambda problem, env: 1e-12,
            )
        ]


@pytest.fixture
def raising(fresh_registry):
    RaisingPlugin.calls = 0
    fresh_registry(fake_raising=RaisingPlugin)
    return RaisingPlugin


def test_auto_falls_back_when_its_pick_raises_at_the_first_forward(raising) -> None:
    module = make_experts(4, 16, 8)
    assert selector.explain_model(module)[""].best == "fake_raising"
    x, idx, w = _inputs()
    with pytest.warns(RuntimeWarning, match="'fake_raising', auto's pick, raised at its first forward.*no kernel image"):
        out = module(x, idx, w)
    assert selector.last_backend(module) not in (None, "fake_raising")
    assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]
    ranking = selector.explain_model(module)[""]  # the ranking says so
    assert ranking.best != "fake_raising" and "raised at its first forward" in ranking.excluded["fake_raising"].reason
    other = make_experts(4, 16, 8)  # the same layer elsewhere: no second warning, no second try
    other(x, idx, w)
    assert raising.calls == 1


def test_a_named_backend_that_raises_still_raises(raising) -> None:
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "fake_raising")
    with pytest.raises(RuntimeError, match="no kernel image"):
        module(*_inputs())


def test_bad_input_is_never_taken_for_a_backend_failure(raising) -> None:
    module = make_experts(4, 16, 8)
    x, idx, w = _inputs()
    idx[0, 0] = 7
    with pytest.raises(selector.errors.ExpertsInputError):
        module(x, idx, w)
    assert raising.calls == 0


def _tiles_plugin(tiles: str) -> type:
    """The preparing fake, its plans on `tiles` ("heuristic" or "nearest": a shape no table or tuning covers)."""

    class TilesPlugin:
        @staticmethod
        @hookimpl
        def selector_backends():
            (spec,) = PreparingPlugin.selector_backends()
            real = spec.prepare
            return [replace(spec, name=f"fake_{tiles}", prepare=lambda m, p: replace(real(m, p), tiles=tiles))]

    return TilesPlugin


@pytest.mark.parametrize("tiles,said", [("heuristic", "default tiles"), ("nearest", "nearest shape a table holds")])
def test_a_layer_on_estimated_tiles_is_told_once_per_shape(fresh_registry, caplog, tiles, said) -> None:
    """The first forward of a shape whose plan runs on estimated tiles (the heuristics, or borrowed from the nearest
    tabled shape) logs one line naming the shape and the command that tunes it; later calls, and other modules of
    the same shape, say nothing."""
    name = f"fake_{tiles}"  # told once per backend and shape in a process: each case has its own name
    fresh_registry(**{name: _tiles_plugin(tiles)})
    x, idx, w = _inputs()
    with caplog.at_level("WARNING", logger="selector"), torch.no_grad():
        for module in (make_experts(4, 16, 8), make_experts(4, 16, 8)):
            selector.set_experts_implementation(module, name)
            module(x, idx, w)
            module(x, idx, w)
    lines = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert len(lines) == 1, lines
    assert "E=4 H=16 I=8 k=2" in lines[0] and f"runs {name}" in lines[0]
    assert "`selector tune --experts 4 --hidden 16 --intermediate 8 --top-k 2 --dtype float32`" in lines[0]
    assert dispatch.untuned_message(name, dispatch.call_problem(module, 2), tiles) in lines[0]


def test_no_plugin_source_writes_a_modules_dict() -> None:
    """The built-in backends keep what they read off a module in their plans, never in the module: no write to a
    `__dict__`, no `setattr` on a module, no old per-module cache prefix anywhere in plugins/."""
    import re
    from pathlib import Path

    writes = re.compile(r"__dict__\s*\[[^\]]*\]\s*=|__dict__\.(setdefault|update)\(|setattr\(\s*module\b|MODULE_CACHE_PREFIX")
    root = Path(__file__).resolve().parent.parent / "plugins"
    found = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if writes.search(line)]  # fmt: skip
    assert not found, found
