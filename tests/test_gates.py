"""Gates as data (selector/gates.py): the vocabulary, recognition from modules (Transformers' GPT-OSS experts, a
declared gate), requirement verdicts and ranking reasons, the tuning key, and the tile lookup of other layouts.
No kernel runs here: tests/test_gates_kernels.py runs the epilogue (Triton interpreter, and the GPU)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import selector
from selector import layers
from selector.gates import DEFAULT_GATE, Gate, clamped_swiglu
from selector.presets import preset
from selector.probes import collect_environment
from selector.problem import gate_of, problem_from_module
from selector.ranking import rank
from selector.registry import build_registry
from selector.requirements import evaluate, gates_run
from selector.testing import Layout, make_experts
from selector.tuning import problem_key
from selector.types import BackendSpec, Problem, Requirements, Status

H200 = collect_environment(environ={"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "SELECTOR_PACKAGE_TRITON": "3.6.0",
                                    "PATH": ""})  # fmt: skip
GPT_OSS = preset("gpt-oss-20b")
QWEN3 = Problem(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8)


def _gpt_oss_experts(limit: float = 7.0, alpha: float = 1.702, seed: int = 0):
    """A real Transformers GptOssExperts, tiny, with random weights (its own init leaves them empty)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                                       num_experts_per_tok=2, swiglu_limit=limit, swiglu_alpha=alpha)  # fmt: skip
    module = GptOssExperts(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def _spec(**req) -> BackendSpec:
    return BackendSpec(name="probe_me", load=lambda: None, requirements=Requirements(**req))


# --- the vocabulary ----------------------------------------------------------------------------------------------


def test_gate_names_parameters_and_labels():
    assert Gate() == DEFAULT_GATE and DEFAULT_GATE.is_default and DEFAULT_GATE.label() == "act_mul"
    gate = selector.Gate("clamped_swiglu", alpha=1.702, limit=7)
    assert gate == clamped_swiglu() and not gate.is_default
    assert isinstance(gate.limit, float) and gate.label() == "clamped_swiglu(alpha=1.702,limit=7)"
    assert len({gate, clamped_swiglu(1.702, 7.0), clamped_swiglu(1.0, 7.0)}) == 2  # hashable, by value


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "swish"}, "unknown gate 'swish'"),
        ({"name": "act_mul", "alpha": 1.0}, "takes no parameters"),
        ({"name": "clamped_swiglu", "alpha": 1.0}, "finite number limit="),
        ({"name": "clamped_swiglu", "alpha": float("nan"), "limit": 7.0}, "finite number alpha="),
        ({"name": "clamped_swiglu", "alpha": True, "limit": 7.0}, "finite number alpha="),
        ({"name": "clamped_swiglu", "alpha": 1.0, "limit": 0.0}, "limit > 0"),
    ],
)
def test_bad_gates_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Gate(**kwargs)


# --- recognition -------------------------------------------------------------------------------------------------


def test_transformers_gpt_oss_experts_are_recognised_with_their_parameters():
    module = _gpt_oss_experts(limit=5.0, alpha=1.5)
    problem = problem_from_module(module, top_k=2)
    assert problem.gate == clamped_swiglu(1.5, 5.0)
    assert not problem.custom_gate and problem.activation == "clamped_swiglu"
    assert problem.interleaved and problem.is_transposed and problem.has_bias
    assert problem_key(problem) == (
        "E4-H32-I16-k2/float32/dense/clamped_swiglu(alpha=1.5,limit=5)/gated+has_bias+is_transposed+interleaved"
    )


def test_the_gate_recognised_computes_transformers_own_gate():
    """The torch form of a declared clamped SwiGLU equals GptOssExperts._apply_gate on the same values."""
    module = _gpt_oss_experts(limit=2.0, alpha=1.3)
    x = torch.randn(9, 32) * 3  # wide enough that both clamps bite
    declared = type("Declared", (), {"selector_gate": gate_of(module), "is_concatenated": False})()
    torch.testing.assert_close(layers.declared_apply_gate(declared, x), module._apply_gate(x), rtol=0, atol=0)
    seven = _gpt_oss_experts()
    torch.testing.assert_close(layers.clamped_swiglu(seven, x), seven._apply_gate(x), rtol=0, atol=0)


def test_gpt_oss_gate_elsewhere_needs_alpha_limit_and_interleaved_channels():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    module = _gpt_oss_experts()
    assert gate_of(module) == clamped_swiglu()
    del module.alpha  # GPT-OSS's function without its parameters: Python the selector cannot read
    assert gate_of(module) is None and problem_from_module(module).custom_gate

    class Borrowed(torch.nn.Module):  # another class with GPT-OSS's function and parameters
        _apply_gate = GptOssExperts._apply_gate

        def __init__(self, concatenated: bool) -> None:
            super().__init__()
            self.alpha, self.limit, self.is_concatenated = 1.702, 3.0, concatenated

    assert gate_of(Borrowed(False)) == clamped_swiglu(1.702, 3.0)
    assert gate_of(Borrowed(True)) is None  # its slices read interleaved channels: not the fused pairing


def test_other_python_gates_stay_custom_and_run_in_torch_only():
    def scaled_gate(module, x):
        return torch.nn.functional.silu(x[..., ::2]) * x[..., 1::2] * 0.5

    module = make_experts(4, 32, 16, Layout(interleaved=True), seed=1)
    type(module)._apply_gate = scaled_gate
    problem = problem_from_module(module, top_k=2)
    assert problem.custom_gate and problem.gate == DEFAULT_GATE and problem.activation == "silu"
    on_gpu = replace(problem, device="cuda", dtype="bfloat16")
    ranking = rank(on_gpu, H200, build_registry(environ={}))
    assert "triton_fused" not in {c.name for c in ranking.candidates}
    assert ranking.excluded["triton_fused"].reason == (
        "does not support a custom gate function "
        "(test_other_python_gates_stay_custom_and_run_in_torch_only.<locals>.scaled_gate)"
    )
    assert problem_key(problem) == "E4-H32-I16-k2/float32/dense/silu/gated+interleaved+custom_gate"  # as before
    assert {"grouped_mm", "batched_mm", "eager"} <= {c.name for c in ranking.candidates}


def test_selectors_own_clamped_swiglu_is_the_gpt_oss_gate():
    module = make_experts(4, 32, 16, Layout(custom_gate=True, interleaved=True), seed=2)
    assert type(module)._apply_gate is layers.clamped_swiglu
    problem = problem_from_module(module, top_k=2)
    assert problem.gate == clamped_swiglu() and not problem.custom_gate
    concatenated = make_experts(4, 32, 16, Layout(custom_gate=True), seed=2)  # ::2 slices on [gate | up]
    assert problem_from_module(concatenated).custom_gate


def test_decorator_declares_a_gate_and_installs_its_torch_form():
    gate = selector.Gate("clamped_swiglu", alpha=1.25, limit=2.5)

    @selector.experts(has_bias=True, is_concatenated=False, gate=gate)
    class Declared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 3
            self.gate_up_proj = torch.nn.Parameter(torch.randn(3, 16, 8))
            self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(3, 16))
            self.down_proj = torch.nn.Parameter(torch.randn(3, 8, 8))
            self.down_proj_bias = torch.nn.Parameter(torch.randn(3, 8))

    module = Declared()
    assert Declared.selector_gate is gate and Declared._apply_gate is layers.declared_apply_gate
    problem = problem_from_module(module, top_k=1)
    assert problem.gate == gate and not problem.custom_gate and problem.activation == "clamped_swiglu"
    x = torch.randn(5, 16) * 3
    g, u = x[..., ::2].clamp(max=2.5), x[..., 1::2].clamp(-2.5, 2.5)
    torch.testing.assert_close(module._apply_gate(x), (u + 1) * g * torch.sigmoid(1.25 * g))
    with pytest.raises(TypeError, match="takes a selector.Gate"):
        selector.experts(gate="clamped_swiglu")


def test_a_class_attribute_declares_the_gate_of_its_own_apply_gate():
    @selector.experts(is_concatenated=False)
    class Own(torch.nn.Module):
        selector_gate = clamped_swiglu(1.702, 7.0)

        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 2
            self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 4))

        def _apply_gate(self, x):
            return layers.clamped_swiglu(self, x)

    assert Own._apply_gate is not layers.declared_apply_gate  # its own function stays what torch backends run
    assert problem_from_module(Own()).gate == clamped_swiglu()


# --- requirements and ranking ------------------------------------------------------------------------------------


def test_requirements_name_the_gate_they_do_not_run():
    clamped = replace(GPT_OSS, has_bias=False, is_transposed=False)
    verdict = evaluate(_spec(interleaved=True), clamped, H200)
    assert verdict.status is Status.UNSUPPORTED_CONFIG and verdict.status.error_type is ValueError
    assert verdict.reason == "does not run gate clamped_swiglu(alpha=1.702,limit=7) (runs act_mul)"
    assert evaluate(_spec(interleaved=True, custom_gate=True), clamped, H200).ok  # torch code: every gate
    declared = _spec(interleaved=True, gates=frozenset({"act_mul", "clamped_swiglu"}), activations=frozenset({"silu"}))
    assert evaluate(declared, clamped, H200).ok  # the gate is the function: the activation list is act_mul's
    assert not evaluate(declared, replace(QWEN3, activation="relu"), H200).ok
    assert not evaluate(_spec(custom_gate=True, gates=frozenset({"act_mul"})), clamped, H200).ok  # closed world
    assert gates_run(Requirements()) == {"act_mul"} and gates_run(Requirements(custom_gate=True)) >= {"clamped_swiglu"}


def test_gpt_oss_ranks_triton_fused_and_explains_the_others():
    ranking = rank(GPT_OSS, H200, build_registry(environ={}))
    assert "triton_fused" in {c.name for c in ranking.candidates}
    assert {"grouped_mm", "batched_mm", "eager"} <= {c.name for c in ranking.candidates}
    # a kernel that declares act_mul only (DeepGEMM's MegaMoE: fp4, silu) says which gate it lacks, on its GPU
    megamoe = build_registry(environ={}).get("deepgemm_megamoe")
    megamoe = replace(megamoe, requirements=replace(megamoe.requirements, toolkit=()), check=None)
    blackwell = collect_environment(
        environ={"SELECTOR_GPUS": "NVIDIA B200:10.0:180", "SELECTOR_PACKAGE_KERNELS": "0.17.0", "PATH": ""}
    )
    fp4 = replace(GPT_OSS, weight_format="fp4", scale_format="ue8m0")
    assert evaluate(megamoe, fp4, blackwell).reason.startswith("does not run gate clamped_swiglu(alpha=1.702,limit=7)")
    quantised = rank(replace(GPT_OSS, is_transposed=False, weight_format="fp8_block", scale_format="float32"),
                     H200, build_registry(environ={}))  # fmt: skip
    reason = quantised.excluded["triton_fused"].reason
    assert "runs gate clamped_swiglu(alpha=1.702,limit=7) for dense experts only" in reason


def test_the_preset_and_a_real_gpt_oss_module_share_one_tuning_key():
    """The GPT-OSS preset (what bench and tune time) describes what problem_from_module reads off the module."""
    module = _gpt_oss_experts()
    real = problem_from_module(module, top_k=4)
    shaped = replace(GPT_OSS, num_experts=4, hidden_size=32, intermediate_size=16, dtype="float32", device="cpu")
    assert problem_key(shaped) == problem_key(real)


def test_tuning_keys_of_default_gates_are_unchanged():
    assert problem_key(QWEN3) == "E128-H2048-I768-k8/bfloat16/dense/silu/gated"
    assert problem_key(replace(QWEN3, gate=Gate())) == problem_key(QWEN3)
    relu_custom = replace(QWEN3, activation="relu", custom_gate=True, interleaved=True)
    assert problem_key(relu_custom) == "E128-H2048-I768-k8/bfloat16/dense/relu/gated+interleaved+custom_gate"
    module = make_experts(4, 32, 16, Layout(bias=True), seed=3)
    assert problem_key(problem_from_module(module, top_k=2)) == "E4-H32-I16-k2/float32/dense/silu/gated+has_bias"


# --- tiles for other layouts -------------------------------------------------------------------------------------


def test_tile_lookup_prefers_the_layouts_own_entry_then_the_plain_one(tmp_path, monkeypatch):
    C = pytest.importorskip("selector.plugins.triton_fused.configs")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    plain, other = C.shape_key(8, 64, 32, 2), C.shape_key(4, 64, 32, 2)
    assert C.layout_key(plain, transposed=True, interleaved=True) == "E=8,H=64,I=32,k=2,transposed,interleaved"
    assert C.layout_key(plain) == plain
    table = {"configs": {plain: {"64": {"BLOCK_M": 32}},
                         C.layout_key(other, interleaved=True): {"64": {"BLOCK_M": 128}}}}  # fmt: skip
    (shipped / C.config_file_name("Fake GPU")).write_text(json.dumps(table))
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_CONFIG_DIR", str(shipped))
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(C, "_device_name", lambda index: "Fake GPU")
    C.clear_caches()
    try:
        get = lambda e, **layout: C.get_config(e, 64, 32, 64, 2, device="cuda", **layout)  # noqa: E731
        assert get(8, transposed=True, interleaved=True)["BLOCK_M"] == 32  # no own entry: the plain layout's
        assert get(4, interleaved=True)["BLOCK_M"] == 128  # its own entry
        # the plain layout has none: the nearest tabled cell's (the interleaved entry: 32 rows per expert, as here)
        assert get(4)["BLOCK_M"] == 128
        assert get(4, transposed=True) == get(4)
    finally:
        C.clear_caches()


def test_tile_tuning_takes_the_gpt_oss_layer_into_its_own_entry(tmp_path, monkeypatch):
    C = pytest.importorskip("selector.plugins.triton_fused.configs")
    TU = pytest.importorskip("selector.plugins.triton_fused.tune")
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", str(tmp_path / "user"))
    C.clear_caches()
    seen = []

    def measure(task):
        seen.append(task)
        return 1e-5 * task.block_m / 16 if task.part != "align" else 1e-6

    problem = replace(GPT_OSS, num_experts=8, hidden_size=64, intermediate_size=32)
    try:
        summary = TU.tune_kernels(problem, [8], 30.0, measure=measure, device_name="Fake GPU", directory=tmp_path)
        assert summary["skipped"] is None and summary["tokens_tuned"] == [8]
        assert summary["shape"] == "E=8,H=64,I=32,k=4,transposed,interleaved"
        written = json.loads((tmp_path / C.config_file_name("Fake GPU")).read_text())
        assert list(written["configs"]) == [summary["shape"]]
        custom = TU.tune_kernels(replace(problem, gate=DEFAULT_GATE, custom_gate=True), [8], 30.0, measure=measure,
                                 device_name="Fake GPU", directory=tmp_path)  # fmt: skip
        assert "custom gate function" in custom["skipped"]
    finally:
        C.clear_caches()
    assert seen


def test_a_gpt_oss_config_file_becomes_its_gate(tmp_path):
    from selector.tune.inputs import read_config

    config = {"model_type": "gpt_oss", "num_local_experts": 32, "hidden_size": 2880, "intermediate_size": 2880,
              "num_experts_per_tok": 4, "torch_dtype": "bfloat16", "swiglu_limit": 5.5}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    problem = read_config(tmp_path).problem
    assert problem.gate == clamped_swiglu(1.702, 5.5) and not problem.custom_gate
    gate_and_layout = "/clamped_swiglu(alpha=1.702,limit=5.5)/gated+has_bias+is_transposed+interleaved"
    assert problem_key(problem).endswith(gate_and_layout)


def test_a_gate_compares_what_kernels_run_and_a_problem_the_whole_layer():
    from selector.types import Problem

    assert Gate(activation="gelu", custom=True, source="M._apply_gate") == DEFAULT_GATE
    assert hash(Gate(activation="gelu")) == hash(DEFAULT_GATE) and Gate() != clamped_swiglu()
    plain = Problem(num_experts=4, hidden_size=32, intermediate_size=16, top_k=2)
    for other in (replace(plain, custom_gate=True), replace(plain, activation="gelu"),
                  replace(plain, custom_gate=True, gate_source="M._apply_gate")):
        assert other.gate == plain.gate and other != plain
    twin = replace(plain, custom_gate=True)
    assert twin == replace(plain, custom_gate=True) and hash(twin) == hash(replace(plain, custom_gate=True))
    assert len({plain, twin, replace(plain, activation="gelu")}) == 3
