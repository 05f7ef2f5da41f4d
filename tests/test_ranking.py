"""Requirements and ranking as pure functions of injected probe facts: no GPU needed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from selector.probes import collect_environment
from selector.config import ConfigError, SelectorConfig, load_config, read_config_file
from selector.ranking import rank
from selector.registry import Registry, build_registry
from selector.requirements import evaluate, version_tuple
from selector.types import BackendSpec, Problem, Requirements, Status, ToolkitRule

H200 = {"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""}
CPU_ONLY = {"SELECTOR_GPUS": "", "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""}
QWEN3 = Problem(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8)


def env_of(**variables: str):
    return collect_environment(environ=variables)


def spec(**req) -> BackendSpec:
    return BackendSpec(name="probe_me", load=lambda: None, requirements=Requirements(**req))


@pytest.fixture(scope="module")
def registry() -> Registry:
    return build_registry(environ={})


def test_version_tuple() -> None:
    assert version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert version_tuple("0.1.2.post1") == (0, 1, 2)
    assert version_tuple("3.6.0") >= version_tuple("3.0")


def test_no_gpu_excludes_cuda_backends_with_reason() -> None:
    verdict = evaluate(spec(devices=frozenset({"cuda"})), QWEN3, env_of(**CPU_ONLY))
    assert verdict.status is Status.UNSUPPORTED_HARDWARE
    assert "needs a CUDA GPU" in verdict.reason and verdict.status.error_type is ImportError


def test_compute_capability_range() -> None:
    ampere = env_of(SELECTOR_GPUS="NVIDIA A100-SXM4-80GB:8.0:80")
    verdict = evaluate(spec(devices=frozenset({"cuda"}), min_compute_capability=(9, 0)), QWEN3, ampere)
    assert verdict.status is Status.UNSUPPORTED_HARDWARE
    assert ">= 9.0" in verdict.reason and "8.0" in verdict.reason and "A100" in verdict.found
    blackwell_only = spec(devices=frozenset({"cuda"}), min_compute_capability=(10, 0))
    assert not evaluate(blackwell_only, QWEN3, env_of(**H200)).ok
    hopper_only = spec(min_compute_capability=(9, 0), max_compute_capability=(10, 0))
    assert evaluate(hopper_only, QWEN3, env_of(**H200)).ok
    assert not evaluate(hopper_only, QWEN3, env_of(SELECTOR_GPUS="NVIDIA B200:10.0")).ok


def test_missing_and_old_packages() -> None:
    env = env_of(**H200, SELECTOR_PACKAGE_KERNELS="", SELECTOR_PACKAGE_NVIDIA_CUTLASS_DSL="4.1.0")
    missing = evaluate(spec(packages={"kernels": "0.17"}), QWEN3, env)
    assert missing.status is Status.MISSING_PACKAGE and "pip install 'kernels>=0.17'" in missing.remedy
    old = evaluate(spec(packages={"nvidia-cutlass-dsl": "4.4"}), QWEN3, env)
    assert old.status is Status.PACKAGE_TOO_OLD and "4.1.0" in old.reason


HOPPER_NVCC = (ToolkitRule((9, 0), (10, 0), (12, 3), "Hopper"), ToolkitRule((10, 0), None, (12, 9), "Blackwell"))


@pytest.mark.parametrize(
    ("variables", "status", "text"),
    [
        ({"SELECTOR_CUDA_TOOLKIT": ""}, Status.TOOLKIT_MISSING, "none was found"),
        ({"SELECTOR_NVCC_VERSION": "12.1", "SELECTOR_CUDA_TOOLKIT": "/opt/cuda"}, Status.TOOLKIT_TOO_OLD, "nvcc 12.1"),
        ({"SELECTOR_NVCC_VERSION": "12.4", "SELECTOR_CUDA_TOOLKIT": "/opt/cuda"}, Status.OK, ""),
    ],
)
def test_toolkit_rules(variables: dict[str, str], status: Status, text: str) -> None:
    verdict = evaluate(spec(toolkit=HOPPER_NVCC), QWEN3, env_of(**H200, **variables))
    assert verdict.status is status and text in verdict.reason


def test_runtime_only_toolkit_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "lib64").mkdir()
    env = env_of(**H200, SELECTOR_CUDA_TOOLKIT=str(tmp_path))
    verdict = evaluate(spec(toolkit=HOPPER_NVCC), QWEN3, env)
    assert verdict.status is Status.TOOLKIT_MISSING and "runtime-only" in verdict.reason
    assert "CUDA_HOME" in verdict.remedy


def test_blackwell_needs_newer_nvcc() -> None:
    env = env_of(SELECTOR_GPUS="NVIDIA B200:10.0", SELECTOR_NVCC_VERSION="12.4", SELECTOR_CUDA_TOOLKIT="/x")
    verdict = evaluate(spec(toolkit=HOPPER_NVCC), QWEN3, env)
    assert verdict.status is Status.TOOLKIT_TOO_OLD and "12.9 on Blackwell" in verdict.reason


@pytest.mark.parametrize(
    ("change", "req", "text"),
    [
        ({"dtype": "float16"}, {"dtypes": frozenset({"bfloat16"})}, "float16"),
        ({"weight_format": "fp4", "scale_format": "ue8m0"}, {}, "fp4"),
        ({"activation": "custom:Foo"}, {"activations": frozenset({"silu"})}, "custom:Foo"),
        ({"has_bias": True}, {"bias": False}, "biases"),
        ({"custom_gate": True}, {"custom_gate": False}, "custom gate"),
        ({"gated": False}, {"non_gated": False}, "non-gated"),
    ],
)
def test_unsupported_configuration_is_a_value_error(change: dict, req: dict, text: str) -> None:
    verdict = evaluate(spec(**req), replace(QWEN3, **change), env_of(**H200))
    assert verdict.status is Status.UNSUPPORTED_CONFIG and text in verdict.reason
    assert verdict.status.error_type is ValueError


def test_plugin_check_that_raises_becomes_plugin_error() -> None:
    def boom(problem, env):
        raise KeyError("oops")

    s = BackendSpec(name="x", load=lambda: None, check=boom)
    verdict = evaluate(s, QWEN3, env_of(**H200))
    assert verdict.status is Status.PLUGIN_ERROR and "KeyError" in verdict.reason


def test_ranking_on_h200_prefers_fused_and_lists_no_exclusions(registry: Registry) -> None:
    env = env_of(**H200)
    for tokens in (1, 64, 4096):
        ranking = rank(QWEN3.with_tokens(tokens), env, registry)
        assert ranking.best == "triton_fused"
        assert "triton_fused" not in ranking.excluded
    decode = [c.name for c in rank(QWEN3.with_tokens(1), env, registry).candidates]
    assert decode.index("batched_mm") < decode.index("eager")
    prefill = [c.name for c in rank(QWEN3.with_tokens(16384), env, registry).candidates]
    assert prefill.index("grouped_mm") < prefill.index("batched_mm")


def test_ranking_on_cpu_excludes_gpu_backends_with_reason(registry: Registry) -> None:
    ranking = rank(replace(QWEN3, device="cpu", dtype="float32"), env_of(**CPU_ONLY), registry)
    assert ranking.best in {"eager", "grouped_mm", "batched_mm"}
    assert ranking.excluded["triton_fused"].status is Status.UNSUPPORTED_DEVICE


def test_config_prefer_deny_pin(registry: Registry) -> None:
    env = env_of(**H200)
    denied = rank(QWEN3, env, registry, SelectorConfig(deny=frozenset({"triton_fused"})))
    assert denied.best != "triton_fused" and denied.excluded["triton_fused"].status is Status.DENIED_BY_CONFIG
    preferred = rank(QWEN3, env, registry, SelectorConfig(prefer=("eager", "batched_mm")))
    assert [c.name for c in preferred.candidates[:2]] == ["eager", "batched_mm"]
    pinned = rank(QWEN3, env, registry, SelectorConfig(pin="grouped_mm", prefer=("eager",)))
    assert pinned.best == "grouped_mm" and pinned.candidates[0].pinned
    # a pin that cannot run degrades quietly: the next best runs, the reason is kept
    cpu_pin = rank(replace(QWEN3, device="cpu"), env_of(**CPU_ONLY), registry, SelectorConfig(pin="triton_fused"))
    assert cpu_pin.best != "triton_fused" and "triton_fused" in cpu_pin.excluded


def test_measured_times_override_estimates(registry: Registry) -> None:
    ranking = rank(QWEN3, env_of(**H200), registry, measured={"eager": 1e-9})
    assert ranking.best == "eager"


def test_yaml_config_files_merge_in_order(tmp_path: Path) -> None:
    user, project = tmp_path / "user.yaml", tmp_path / "project.yaml"
    user.write_text("prefer: [grouped_mm]\ndeny: batched_mm\n")
    project.write_text("prefer:\n  - eager\npin: grouped_mm\n")
    config = load_config(paths=[user, project, tmp_path / "absent.yaml"])
    assert config.prefer == ("eager",) and config.deny == frozenset({"batched_mm"}) and config.pin == "grouped_mm"
    assert config.files == (str(user), str(project))


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "selector.yaml"
    bad.write_text("prefer: [eager\ndeny: x\n")
    with pytest.raises(ConfigError, match=r"selector\.yaml:\d+:\d+: malformed YAML"):
        read_config_file(bad)
    bad.write_text("prefer: eager\nfavourite: x\n")
    with pytest.raises(ConfigError, match="unknown key.*favourite"):
        read_config_file(bad)


def test_config_variable_must_name_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SELECTOR_CONFIG=.*no such file"):
        load_config(environ={"SELECTOR_CONFIG": str(tmp_path / "missing.yaml")})
    good = tmp_path / "c.yaml"
    good.write_text("deny: [eager]\n")
    assert "eager" in load_config(environ={"SELECTOR_CONFIG": str(good)}).deny
