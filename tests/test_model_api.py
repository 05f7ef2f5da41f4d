"""The model API on plain nn.Module trees: decorator, set/get, auto, first-forward errors, input validation."""

from __future__ import annotations

import pytest
import torch
from experts_fixtures import TOLERANCE, make_experts, random_routing, reference_experts, relative_error

import selector
from selector import BackendSpec, Requirements, hookimpl
from selector.errors import ExpertsInputError
from selector.dispatch import forget_module, last_backend, reset_selection_caches


class Block(torch.nn.Module):
    def __init__(self, backbone: str | None = None) -> None:
        super().__init__()
        self.experts = make_experts(4, 16, 8)
        if backbone:
            self.experts._selector_backbone = backbone


class TwoTowers(torch.nn.Module):
    """A model with experts in its own scope and in two named backbones."""

    def __init__(self) -> None:
        super().__init__()
        self.text = torch.nn.ModuleList([Block("text_config"), Block("text_config")])
        self.vision = Block("vision_config")
        self.head = Block()


def _inputs(t: int = 5, e: int = 4, h: int = 16, k: int = 2):
    idx, w = random_routing(t, e, k)
    return torch.randn(t, h), idx, w


def test_set_and_get_by_name_and_dict() -> None:
    model = TwoTowers()
    assert selector.get_experts_implementation(model) == {"": "auto", "text_config": "auto", "vision_config": "auto"}
    selector.set_experts_implementation(model, "grouped_mm")
    assert set(selector.get_experts_implementation(model).values()) == {"grouped_mm"}
    selector.set_experts_implementation(model, {"": "eager", "vision_config": "batched_mm"})
    got = selector.get_experts_implementation(model)
    assert got == {"": "eager", "text_config": "eager", "vision_config": "batched_mm"}
    x, idx, w = _inputs()
    model.vision.experts(x, idx, w)
    model.text[1].experts(x, idx, w)
    assert last_backend(model.vision.experts) == "batched_mm"
    assert last_backend(model.text[1].experts) == "eager"


def test_unknown_name_fails_at_once_listing_names() -> None:
    model = TwoTowers()
    with pytest.raises(ValueError, match="unknown experts backend 'fastest'.*batched_mm.*eager.*grouped_mm"):
        selector.set_experts_implementation(model, "fastest")
    with pytest.raises(ValueError, match=r"sub-config key\(s\) \['audio_config'\].*'text_config'.*'vision_config'"):
        selector.set_experts_implementation(model, {"audio_config": "eager"})


def test_explicit_backend_that_cannot_run_loads_then_raises_import_error_on_forward() -> None:
    module = make_experts(4, 16, 8)  # on the CPU: triton_fused needs CUDA
    selector.set_experts_implementation(module, "triton_fused")  # loading/choosing does not raise
    with pytest.raises(ImportError) as info:
        module(*_inputs())
    message = str(info.value)
    assert "'triton_fused' cannot run here" in message
    assert "runs on cuda, not on cpu" in message and "fix:" in message and "selector doctor" in message


class OnlyBf16:
    """A fake third-party plugin whose kernel only runs bf16 experts on the CPU."""

    calls = 0

    @staticmethod
    @hookimpl
    def selector_backends():
        def load():
            def forward(module, hidden_states, top_k_index, top_k_weights):
                OnlyBf16.calls += 1
                return torch.zeros_like(hidden_states)

            return forward

        return [
            BackendSpec(
                name="fake_bf16_only",
                load=load,
                requirements=Requirements(devices=frozenset({"cpu"}), dtypes=frozenset({"bfloat16"})),
                estimate=lambda problem, env: 1e-12 if (problem.num_tokens or 0) <= 8 else 10.0,
            )
        ]


@pytest.fixture
def bf16_plugin(fresh_registry):
    fresh_registry(fake_bf16_only=OnlyBf16)
    return OnlyBf16


def test_unsupported_configuration_raises_value_error_on_forward(bf16_plugin) -> None:
    module = make_experts(4, 16, 8, dtype=torch.float32)
    selector.set_experts_implementation(module, "fake_bf16_only")
    with pytest.raises(ValueError, match="does not run float32 experts"):
        module(*_inputs())


def test_auto_skips_quietly_and_switches_with_token_count(bf16_plugin) -> None:
    fp32 = make_experts(4, 16, 8, dtype=torch.float32)
    out = fp32(*_inputs())  # auto: the bf16-only fake is excluded quietly, a reference backend runs
    assert last_backend(fp32) != "fake_bf16_only" and out.abs().sum() > 0

    bf16 = make_experts(4, 16, 8, dtype=torch.bfloat16)
    x, idx, w = _inputs(t=4)
    bf16(x.bfloat16(), idx, w)
    assert last_backend(bf16) == "fake_bf16_only"  # cheapest at few tokens
    x, idx, w = _inputs(t=100)
    bf16(x.bfloat16(), idx, w)
    assert last_backend(bf16) != "fake_bf16_only"  # re-ranked for the larger bucket
    ranking = selector.explain_model(bf16, num_tokens=4)[""]
    assert ranking.best == "fake_bf16_only" and "triton_fused" in ranking.excluded


def test_switching_at_run_time_keeps_results() -> None:
    module = make_experts(6, 24, 12)
    x, idx, w = _inputs(t=11, e=6, h=24)
    ref = reference_experts(module, x, idx, w)
    for name in ("eager", "grouped_mm", "batched_mm", "auto"):
        selector.set_experts_implementation(module, name)
        assert relative_error(module(x, idx, w), ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda x, i, w: (x[:, :-1], i, w), r"hidden_states must be \[num_tokens, 16\]"),
        (lambda x, i, w: (x, i.float(), w), "top_k_index must be an integer tensor"),
        (lambda x, i, w: (x, i[:-1], w[:-1]), r"top_k_index must be \[5, k\]"),
        (lambda x, i, w: (x, i, w[:, :1]), "must have the shape of top_k_index"),
        (lambda x, i, w: (x, i.clone().fill_(4), w), r"expert ids must lie in \[0, 4\); got ids from 4 to 4"),
        (lambda x, i, w: (x, i.clone().fill_(-1), w), "expert ids must lie in"),
        (lambda x, i, w: (x, i, w.clone().fill_(float("nan"))), "NaN or infinite"),
        (lambda x, i, w: (x.long(), i, w), "hidden_states must be floating point"),
    ],
)
def test_bad_inputs_get_clear_errors(mutate, message: str) -> None:
    module = make_experts(4, 16, 8)
    with pytest.raises(ExpertsInputError, match=message):
        module(*mutate(*_inputs()))


def test_sentinel_is_allowed_only_under_expert_parallelism() -> None:
    module = make_experts(4, 16, 8)
    x, idx, w = _inputs()
    idx[0, 0] = 4
    with pytest.raises(ExpertsInputError):
        module(x, idx, w)
    module._is_expert_parallel = True
    reset_selection_caches()
    forget_module(module)
    out = module(x, idx, w)
    assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]


def test_validation_level_shapes_skips_value_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELECTOR_VALIDATE", "shapes")
    module = make_experts(4, 16, 8)
    x, idx, w = _inputs()
    w[0, 0] = float("nan")
    selector.set_experts_implementation(module, "eager")
    assert torch.isnan(module(x, idx, w)[0]).any()  # documented: no value checks at this level
    monkeypatch.setenv("SELECTOR_VALIDATE", "sometimes")
    with pytest.raises(ValueError, match="SELECTOR_VALIDATE='sometimes'"):
        module(x, idx, w)


@pytest.mark.compile
def test_auto_under_compile_avoids_backends_that_break_the_graph() -> None:
    module = make_experts(4, 16, 8)
    x, idx, w = _inputs()
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    out = compiled(x, idx, w)  # eager (host sync) is excluded while tracing: fullgraph holds
    assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]
    ranking = selector.explain_model(module)[""]
    from dataclasses import replace

    from selector.environment import current_environment
    from selector.registry import get_registry

    traced = selector.rank(replace(ranking.problem, compile=True), current_environment(), get_registry())
    assert "torch.compile" in traced.excluded["eager"].reason


@pytest.mark.compile
def test_explicit_eager_still_runs_under_compile_with_a_graph_break() -> None:
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "eager")
    x, idx, w = _inputs()
    out = torch.compile(module, backend="eager")(x, idx, w)
    assert relative_error(out, reference_experts(module, x, idx, w)) < TOLERANCE[torch.float32]


def test_validation_level_first_checks_values_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELECTOR_VALIDATE", "first")
    module = make_experts(4, 16, 8)
    selector.set_experts_implementation(module, "eager")
    x, idx, w = _inputs()
    bad = idx.clone().fill_(9)
    with pytest.raises(ExpertsInputError):
        module(x, bad, w)  # the first call of this shape reads the values
    module(x, idx, w)
    assert torch.isnan(module(x, idx, w.clone().fill_(float("nan")))).all()  # after that only shapes
    x2, idx2, w2 = _inputs(t=9)
    with pytest.raises(ExpertsInputError):
        module(x2, idx2.clone().fill_(9), w2)  # a new shape is checked again


def test_compiled_modules_are_named_by_constant_ids() -> None:
    import copy

    from selector.dispatch import track, tracked_module

    module = make_experts(4, 16, 8)
    uid = track(module)
    assert tracked_module(uid) is module and track(module) == uid
    clone = copy.deepcopy(module)
    assert track(clone) != uid  # a copy is its own layer


def test_every_eager_call_keeps_the_module_reachable_by_its_id() -> None:
    """A module whose registration died while its __dict__ lived on (unpickled, or a copy, where a dead module
    had lived: same id(), same stored owner) is registered again by its next eager call, so torch.compile finds
    it by its id."""
    import copy
    import gc

    from selector.dispatch import tracked_id, tracked_module

    original = make_experts(4, 16, 8).requires_grad_(False)
    x = torch.randn(2, 16)
    index, weights = random_routing(2, 4, 2)
    original(x, index, weights)
    twin = copy.deepcopy(original)
    del original
    gc.collect()
    # the state a copy (or an unpickled module) at its dead original's address carries: the stored owner id is its own
    twin.__dict__["_selector_uid_owner"] = id(twin)
    twin(x, index, weights)
    assert tracked_module(tracked_id(twin)) is twin


class BrokenLoad:
    """A fake plugin that looks best on paper but whose implementation fails to import."""

    @staticmethod
    @hookimpl
    def selector_backends():
        def load():
            raise ImportError("fake: the kernel library is missing its shared object")

        return [BackendSpec(name="fake_broken_load", load=load, estimate=lambda problem, env: 0.0)]


def test_auto_skips_a_backend_whose_load_fails(fresh_registry) -> None:
    fresh_registry(fake_broken_load=BrokenLoad)
    module = make_experts(4, 16, 8)
    module(*_inputs())
    assert last_backend(module) not in ("fake_broken_load", None)
    selector.set_experts_implementation(module, "fake_broken_load")
    with pytest.raises(ImportError, match="shared object"):
        module(*_inputs())  # asked for by name: the failure is the user's to see


def _plain_experts_class(**flags):  # type: ignore[no-untyped-def]
    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 16, 16) * 0.25)
            self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 8) * 0.35)
            self.act_fn = torch.nn.SiLU()

    return Experts


def test_decorating_a_class_with_its_own_forward_warns() -> None:
    class Own(torch.nn.Module):
        def forward(self, hidden_states, top_k_index, top_k_weights):  # type: ignore[no-untyped-def]
            return hidden_states

    with pytest.warns(UserWarning, match=r"Own defines forward\(\) itself.*replace_forward=True") as record:
        selector.experts(Own)
    assert record[0].filename == __file__  # points at the decoration, not at selector
    import warnings

    class Meant(torch.nn.Module):
        def forward(self, hidden_states, top_k_index, top_k_weights):  # type: ignore[no-untyped-def]
            return hidden_states

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        selector.experts(replace_forward=True)(Meant)  # said on purpose: no warning
        selector.experts(_plain_experts_class())  # no forward of its own: no warning
    with pytest.raises(TypeError, match="decorates a class"):
        selector.experts(lambda m: m)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [3, None, ["eager"]])
def test_non_string_implementation_is_a_clear_type_error(bad: object) -> None:
    model = TwoTowers()
    with pytest.raises(TypeError, match=r"backend name, \"auto\" or \{sub-config key: name\}, got"):
        selector.set_experts_implementation(model, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a backend name, got 3"):
        selector.set_experts_implementation(model, {"": 3})  # type: ignore[dict-item]


def test_explain_model_takes_k_from_the_last_call(caplog: pytest.LogCaptureFixture) -> None:
    module = selector.experts(_plain_experts_class())()
    with caplog.at_level("WARNING", logger="selector"):
        guessed = selector.explain_model(module)
    assert guessed[""].problem.top_k == 1
    assert "has not run yet and declares no top_k; ranking with k=1 is a guess" in caplog.text
    caplog.clear()
    x, idx, w = _inputs(t=3, k=3)
    module(x, idx, w)
    with caplog.at_level("WARNING", logger="selector"):
        traced = selector.explain_model(module)
    assert traced[""].problem.top_k == 3 and "guess" not in caplog.text
    assert selector.explain_model(module, top_k=2)[""].problem.top_k == 2
