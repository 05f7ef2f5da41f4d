"""Hub-kernel backends (`deepgemm`, `deepgemm_megamoe`, `sonicmoe`) on CPU.

Requirements and errors: probe facts injected (SELECTOR_* overrides, fake toolkits in tmp_path), judged by
selector's own machinery (`evaluate` -> `unavailable_error`, as the first forward does), the exception type
asserted and the message checked for the fix it offers.

Data layout: the adapters run against FAKE hub kernels (tests/fake_kernels/, plain torch, same function names
and signatures, the real kernels' input contracts asserted) loaded through the `kernels` package's local
loading, and are compared with the float64 reference and with the `eager` backend. Nothing here touches the
network: the hub cache is a tmp directory and huggingface_hub is put offline where a load could reach out.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from selector.dispatch import last_backend
from experts_fixtures import Layout, make_experts, random_routing, reference_experts, relative_error

import selector
from selector.probes import DEFAULT_PACKAGES, collect_environment
from selector import hub
from selector.environment import set_environment
from selector.errors import unavailable_error
from selector.registry import get_registry
from selector.requirements import evaluate
from selector.types import Problem, Status

FAKES = Path(__file__).parent / "fake_kernels"
DEEP_GEMM = hub.PINS["deep-gemm"]
SONIC_MOE = hub.PINS["sonic-moe"]
H100 = "NVIDIA H100 80GB HBM3:9.0:80"
H200 = "NVIDIA H200:9.0:141"
B200 = "NVIDIA B200:10.0:180"
A100 = "NVIDIA A100-SXM4-80GB:8.0:80"


# --- fixtures ------------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """No real hub cache, no LOCAL_KERNELS from the shell, hub fakes forgotten (conftest resets selection state)."""
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "hub-cache"))
    for variable in ("LOCAL_KERNELS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SELECTOR_JIT_AMORTIZE_CALLS",
                     "SELECTOR_SONICMOE_PAD_TOKENS", "SELECTOR_KERNELS_LOCK"):
        monkeypatch.delenv(variable, raising=False)
    import selector.plugins.deepgemm as deepgemm
    import selector.plugins.sonicmoe as sonic

    sonic.forget_compiled()
    deepgemm.forget_compiled()
    hub.forget_loaded()
    yield
    hub.forget_loaded()
    sonic.forget_compiled()
    deepgemm.forget_compiled()


@pytest.fixture
def fake_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the pinned repos at the FAKE local kernels (kernels' own LOCAL_KERNELS mechanism)."""
    monkeypatch.setenv(
        "LOCAL_KERNELS",
        f"{DEEP_GEMM.repo_id}={FAKES / 'deep-gemm'}:{SONIC_MOE.repo_id}={FAKES / 'sonic-moe'}",
    )


def make_env(gpu: str | None = H100, nvcc: str | None = "12.8", toolkit: Path | str | None = "/opt/cuda",
             torch_version: str = "2.11.0", torch_cuda: str = "13.0", **packages: str):
    """Probe facts as a GPU host would report them, from override variables only."""
    environ = {
        "SELECTOR_GPUS": gpu or "",
        "SELECTOR_PACKAGE_TORCH": torch_version,
        "SELECTOR_TORCH_CUDA": torch_cuda,
        "SELECTOR_PACKAGE_KERNELS": "0.17.2",
        "SELECTOR_PACKAGE_NVIDIA_CUTLASS_DSL": "4.4.2",
        "SELECTOR_PACKAGE_APACHE_TVM_FFI": "0.1.15",
        "PATH": "",
    }
    if toolkit is not None:
        environ["SELECTOR_CUDA_TOOLKIT"] = str(toolkit)
    if nvcc is not None:
        environ["SELECTOR_NVCC_VERSION"] = nvcc
    for name, version in packages.items():
        environ["SELECTOR_PACKAGE_" + name.upper()] = version
    return collect_environment(environ, packages=(*DEFAULT_PACKAGES, "apache-tvm-ffi"))


def fake_toolkit(root: Path, release: str | None) -> Path:
    """A CUDA toolkit directory; with `release`, a bin/nvcc that prints it; without, runtime-only."""
    (root / "lib64").mkdir(parents=True)
    if release is not None:
        nvcc = root / "bin" / "nvcc"
        nvcc.parent.mkdir()
        nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
        nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return root


def problem(**changes) -> Problem:
    base = Problem(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8, dtype="bfloat16", device="cuda")
    return replace(base, **changes)


def first_forward_error(backend: str, prob: Problem, env) -> Exception | None:
    """What an explicit request raises at the first forward: the model API's own evaluate -> error path."""
    verdict = evaluate(get_registry().get(backend), prob, env)
    return None if verdict.ok else unavailable_error(backend, verdict)


def expect(backend: str, prob: Problem, env, error: type[Exception], *phrases: str) -> str:
    exc = first_forward_error(backend, prob, env)
    assert exc is not None, f"{backend} should be refused"
    assert type(exc) is error, f"{type(exc).__name__}: {exc}"
    message = str(exc)
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in: {message}"
    return message


def cache_snapshot(root: Path, pin: hub.HubKernel, variants: list[str], source: Path | None = None) -> Path:
    """A hub-cache entry laid out as huggingface_hub writes it: refs/vN -> commit, snapshots/<commit>/build/..."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"kernels--{pin.repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / pin.ref).write_text(commit)
    for variant in variants:
        target = repo / "snapshots" / commit / "build" / variant
        target.mkdir(parents=True)
        if source is not None:
            for f in source.iterdir():
                if f.is_file():
                    (target / f.name).write_bytes(f.read_bytes())
        else:
            (target / "metadata.json").write_text("{}")
    return repo / "snapshots" / commit


# --- registration --------------------------------------------------------------------------------------------


def test_backends_registered_through_entry_points() -> None:
    registry = get_registry()
    for name in ("deepgemm", "deepgemm_megamoe", "sonicmoe"):
        assert name in registry.names
        spec = registry.specs[name]
        assert spec.first_call_cost
        assert getattr(spec.check, "hub_kernel", None) in (DEEP_GEMM, SONIC_MOE)
    assert not [p for p in registry.plugins if p.error]


def test_declaring_backends_imports_no_torch() -> None:
    code = (
        "import sys; import selector.plugins.deepgemm, selector.plugins.deepgemm_megamoe, selector.plugins.sonicmoe, selector.hub; "
        "assert 'torch' not in sys.modules, 'torch imported'; assert 'kernels' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_pins_carry_exactly_one_of_version_or_revision() -> None:
    assert DEEP_GEMM.kwargs() == {"version": 2} and SONIC_MOE.kwargs() == {"version": 2}
    with pytest.raises(ValueError, match="exactly one"):
        hub.HubKernel("org/name")
    with pytest.raises(ValueError, match="exactly one"):
        hub.HubKernel("org/name", version=1, revision="main")
    assert hub.HubKernel("org/name", revision="abc").kwargs() == {"revision": "abc"}


# --- deepgemm: hardware and toolkit ------------------------------------------------------------------------


def test_deepgemm_runs_on_hopper_with_nvcc_12_3() -> None:
    assert first_forward_error("deepgemm", problem(), make_env(H100, nvcc="12.3")) is None


def test_deepgemm_refuses_pre_hopper() -> None:
    expect("deepgemm", problem(), make_env(A100), ImportError, "compute capability >= 9.0", "8.0", "fix:")


def test_deepgemm_refuses_cpu_only_machine() -> None:
    expect("deepgemm", problem(), make_env(gpu=None), ImportError, "needs a CUDA GPU")


@pytest.mark.parametrize(("gpu", "nvcc", "needed"), [(H100, "12.2", "12.3"), (B200, "12.8", "12.9")])
def test_deepgemm_nvcc_minimum_per_family(gpu: str, nvcc: str, needed: str) -> None:
    family = "Hopper" if gpu == H100 else "Blackwell"
    message = expect("deepgemm", problem(), make_env(gpu, nvcc=nvcc), ImportError, f"nvcc >= {needed} on {family}",
                     f"nvcc {nvcc} was found", f"CUDA toolkit {needed} or newer")
    assert "CUDA_HOME" in message
    assert first_forward_error("deepgemm", problem(), make_env(gpu, nvcc=needed)) is None


def test_deepgemm_fake_toolkits_found_by_search_order(tmp_path: Path) -> None:
    old = fake_toolkit(tmp_path / "cuda-12.2", "12.2")
    new = fake_toolkit(tmp_path / "cuda-12.9", "12.9")
    base = {"SELECTOR_GPUS": B200, "SELECTOR_PACKAGE_KERNELS": "0.17.2", "PATH": ""}

    env = collect_environment({**base, "CUDA_HOME": str(old), "CUDA_PATH": str(new)})
    message = expect("deepgemm", problem(), env, ImportError, "nvcc >= 12.9 on Blackwell", "found by CUDA_HOME")
    assert str(old) in message
    env = collect_environment({**base, "CUDA_PATH": str(new)})
    assert env.toolkit.found_by == "CUDA_PATH"
    assert first_forward_error("deepgemm", problem(), env) is None
    env = collect_environment({**base, "PATH": str(new / "bin")})
    assert env.toolkit.found_by == "nvcc on PATH"
    assert first_forward_error("deepgemm", problem(), env) is None


def test_deepgemm_rejects_runtime_only_toolkit(tmp_path: Path) -> None:
    runtime = fake_toolkit(tmp_path / "cuda-runtime", None)
    env = collect_environment({"SELECTOR_GPUS": H100, "SELECTOR_PACKAGE_KERNELS": "0.17.2", "PATH": "",
                               "CUDA_HOME": str(runtime)})
    assert env.toolkit.runtime_only
    expect("deepgemm", problem(), env, ImportError, "runtime-only install (no bin/nvcc)", str(runtime),
           "full CUDA toolkit 12.3 or newer (with nvcc)")


def test_deepgemm_without_any_toolkit_lists_where_it_looked() -> None:
    env = collect_environment({"SELECTOR_GPUS": H100, "SELECTOR_PACKAGE_KERNELS": "0.17.2", "PATH": "",
                               "SELECTOR_CUDA_TOOLKIT": ""})
    expect("deepgemm", problem(), env, ImportError, "needs a CUDA toolkit with nvcc >= 12.3", "searched")


def test_deepgemm_needs_the_kernels_package() -> None:
    expect("deepgemm", problem(), make_env(kernels=""), ImportError, "'kernels'", "pip install 'kernels>=0.17'")


# --- deepgemm: formats ---------------------------------------------------------------------------------------


def test_deepgemm_refuses_static_activation_scales() -> None:
    prob = problem(weight_format="fp8_block", scale_format="float32", activation_quant="static")
    expect("deepgemm", prob, make_env(H100), ValueError, "static activation quantisation", "dynamic", "fix:")


def test_deepgemm_fp8_float32_scales_run_on_hopper() -> None:
    prob = problem(weight_format="fp8_block", scale_format="float32")
    assert first_forward_error("deepgemm", prob, make_env(H100)) is None


def test_deepgemm_blackwell_float32_block_scales_is_a_value_error() -> None:
    prob = problem(weight_format="fp8_block", scale_format="float32")
    expect("deepgemm", prob, make_env(B200, nvcc="12.9"), ValueError, "float32 block-scale", "Blackwell",
           "silently corrupt", "UE8M0", "grouped_mm or batched_mm")
    assert first_forward_error("deepgemm", replace(prob, scale_format="ue8m0"), make_env(B200, nvcc="12.9")) is None


def test_deepgemm_fp4_needs_blackwell() -> None:
    prob = problem(weight_format="fp4", scale_format="ue8m0")
    expect("deepgemm", prob, make_env(H100), ImportError, "FP4 experts on Blackwell only", "9.0")
    assert first_forward_error("deepgemm", prob, make_env(B200, nvcc="12.9")) is None


def test_deepgemm_dense_experts_must_be_bf16() -> None:
    expect("deepgemm", problem(dtype="float16"), make_env(H100), ValueError, "float16", "bfloat16")


def test_deepgemm_machine_errors_come_before_config_errors() -> None:
    # static scales on an A100: the missing hardware is said first (ImportError), not the configuration
    prob = problem(weight_format="fp8_block", scale_format="float32", activation_quant="static")
    expect("deepgemm", prob, make_env(A100), ImportError, "compute capability")


def test_explicit_request_fails_at_first_forward_not_at_set_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the model API: the name is accepted, the first forward raises with the fix."""
    import selector.dispatch as model

    set_environment(make_env(B200, nvcc="12.9"))
    real = model.problem_from_module
    # the module lives on the CPU here; the layer is judged as the same layer on the (faked) GPU
    monkeypatch.setattr(model, "problem_from_module",
                        lambda m, *a, **k: replace(real(m, *a, **k), device="cuda", scale_format="float32",
                                                   weight_format="fp8_block"))
    module = make_experts(4, 16, 8, dtype=torch.bfloat16)
    selector.set_experts_implementation(module, "deepgemm")  # no error yet
    idx, w = random_routing(3, 4, 2)
    with pytest.raises(ValueError, match="UE8M0") as info:
        module(torch.randn(3, 16).bfloat16(), idx, w)
    assert "'deepgemm'" in str(info.value) and "grouped_mm" in str(info.value)


# --- deepgemm_megamoe ----------------------------------------------------------------------------------------


def mega_problem(**changes) -> Problem:
    return problem(**{"weight_format": "fp4", "scale_format": "ue8m0", **changes})


def test_megamoe_runs_on_blackwell_fp4_ue8m0() -> None:
    assert first_forward_error("deepgemm_megamoe", mega_problem(), make_env(B200, nvcc="12.9")) is None


def test_megamoe_needs_blackwell_and_nvcc_12_9() -> None:
    expect("deepgemm_megamoe", mega_problem(), make_env(H200), ImportError, "compute capability >= 10.0")
    expect("deepgemm_megamoe", mega_problem(), make_env(B200, nvcc="12.8"), ImportError, "nvcc >= 12.9")


@pytest.mark.parametrize(
    ("changes", "phrase"),
    [
        ({"weight_format": "fp8_block", "scale_format": "ue8m0"}, "fp8_block"),
        ({"scale_format": "float32"}, "float32 scales"),
        ({"activation": "gelu"}, "activation 'gelu'"),
        ({"has_bias": True}, "expert biases"),
    ],
)
def test_megamoe_format_errors(changes: dict, phrase: str) -> None:
    expect("deepgemm_megamoe", mega_problem(**changes), make_env(B200, nvcc="12.9"), ValueError, phrase)


def test_megamoe_expert_parallel_needs_a_process_group() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()
    expect("deepgemm_megamoe", mega_problem(expert_parallel=True), make_env(B200, nvcc="12.9"), ValueError,
           "process group", "init_process_group", "selector_process_group")


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    from selector.plugins.deepgemm_megamoe.forward import destroy_buffers

    destroy_buffers()
    dist.destroy_process_group()


@pytest.mark.slow
def test_megamoe_call_path_against_fake(fake_kernels: None, world_of_one) -> None:
    from selector.plugins.deepgemm_megamoe.forward import megamoe_experts_forward
    from selector.quant import quantize_experts, reference_forward

    # with a process group up, the EP request is accepted (the fake's torch-cpu build fits a CPU torch)
    assert first_forward_error("deepgemm_megamoe", mega_problem(expert_parallel=True),
                               make_env(B200, nvcc="12.9", torch_cuda="")) is None
    module = quantize_experts(make_experts(4, 256, 256, dtype=torch.bfloat16, seed=1), "fp4")
    params_before = module.gate_up_proj.clone()
    x = torch.randn(7, 256).bfloat16()
    idx, w = random_routing(7, 4, 2)
    with torch.no_grad():
        out = megamoe_experts_forward(module, x, idx, w)
        again = megamoe_experts_forward(module, x[:3], idx[:3], w[:3])  # the buffer is reused, weights prepared once
    ref = reference_forward(module, x, idx, w, quantize_activations_as_kernel=False)
    assert relative_error(out, ref) < 8e-2
    assert torch.equal(again, out[:3])
    assert torch.equal(module.gate_up_proj, params_before), "the module's own parameters stay as they were"


@pytest.mark.slow
def test_megamoe_forward_refuses_missing_group_and_wrong_weights(fake_kernels: None) -> None:
    from selector.plugins.deepgemm_megamoe.forward import megamoe_experts_forward
    from selector.quant import quantize_experts

    dense = make_experts(4, 256, 256, dtype=torch.bfloat16)
    idx, w = random_routing(2, 4, 2)
    with torch.no_grad(), pytest.raises(ValueError, match="FP4"):
        megamoe_experts_forward(dense, torch.randn(2, 256).bfloat16(), idx, w)
    fp4 = quantize_experts(make_experts(4, 256, 256, dtype=torch.bfloat16), "fp4")
    with torch.no_grad(), pytest.raises(ValueError, match="init_process_group"):
        megamoe_experts_forward(fp4, torch.randn(2, 256).bfloat16(), idx, w)


# --- sonicmoe: requirements ------------------------------------------------------------------------------------


def test_sonicmoe_runs_on_hopper() -> None:
    assert first_forward_error("sonicmoe", problem(), make_env(H200, nvcc=None, toolkit=None)) is None


def test_sonicmoe_needs_hopper_and_its_packages() -> None:
    expect("sonicmoe", problem(), make_env(A100), ImportError, "compute capability >= 9.0")
    expect("sonicmoe", problem(), make_env(H200, nvidia_cutlass_dsl=""), ImportError, "nvidia-cutlass-dsl")
    expect("sonicmoe", problem(), make_env(H200, apache_tvm_ffi=""), ImportError, "apache-tvm-ffi")
    expect("sonicmoe", problem(), make_env(H200, kernels=""), ImportError, "'kernels'")


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu"])
def test_sonicmoe_gated_activations_map_to_glu_kernels(activation: str) -> None:
    from selector.plugins.sonicmoe import ACTIVATION_TYPES

    assert first_forward_error("sonicmoe", problem(activation=activation), make_env(H200)) is None
    assert ACTIVATION_TYPES[activation] in ("SWIGLU", "GEGLU", "REGLU")


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"gated": False, "activation": "relu"}, "non-gated experts"),
        ({"activation": "custom:Tanh"}, "gated activation 'custom:Tanh'"),
        ({"activation": "custom:relu2"}, "gated activation"),
        ({"custom_gate": True, "interleaved": True}, "custom gate function"),
    ],
)
def test_sonicmoe_other_activations_are_an_import_error_naming_other_backends(changes: dict, what: str) -> None:
    expect("sonicmoe", problem(**changes), make_env(H200), ImportError, what, "SwiGLU, GeGLU, ReGLU",
           "pick another experts backend", "grouped_mm")


def test_sonicmoe_refuses_post_expert_norm_and_float32() -> None:
    expect("sonicmoe", problem(post_expert_norm=True), make_env(H200), ValueError, "post-expert norm")
    expect("sonicmoe", problem(dtype="float32"), make_env(H200), ValueError, "float32")


# --- offline: cached / local / absent -----------------------------------------------------------------------


def test_local_kernels_directory_is_found(fake_kernels: None) -> None:
    loc = hub.locate(DEEP_GEMM, make_env(torch_cuda=""))  # a CPU build of torch: the fake's torch-cpu fits
    assert loc.state == "local" and loc.variant == "torch-cpu" and loc.found_by == "LOCAL_KERNELS"
    verdict = hub.kernel_availability(DEEP_GEMM, make_env(torch_cuda=""))
    assert verdict.ok and "local kernel directory" in verdict.reason and "torch-cpu" in verdict.found


def test_write_local_kernel_lays_out_a_directory_locate_finds(tmp_path: Path) -> None:
    target = hub.write_local_kernel(tmp_path / "dg", "deep-gemm", "MIT", variant="torch-cpu")
    assert target == tmp_path / "dg" / "build" / "torch-cpu"
    meta = json.loads((target / "metadata.json").read_text())
    assert meta["name"] == "deep-gemm" and meta["backend"] == {"type": "cpu"} and meta["version"] == 2
    loc = hub.locate(DEEP_GEMM, make_env(torch_cuda=""), {"LOCAL_KERNELS": f"{DEEP_GEMM.repo_id}={tmp_path / 'dg'}"})
    assert loc.state == "local" and loc.variant == "torch-cpu"


def test_local_kernels_directory_without_a_fitting_variant(fake_kernels: None) -> None:
    env = make_env(H100)  # torch 2.11 + CUDA 13.0: a torch-cpu build does not fit
    expect("deepgemm", problem(), env, ImportError, "LOCAL_KERNELS points kernels-community/deep-gemm",
           "no build variant for this machine", "torch 2.11 (CUDA 13.0)", "torch-cpu: for cpu")


def test_offline_and_not_cached_is_an_import_error_with_prefetch_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = expect("deepgemm", problem(), make_env(H100), ImportError, "not in the local cache",
                     "HF_HUB_OFFLINE", "kernels download", "LOCAL_KERNELS=kernels-community/deep-gemm=",
                     "offline-kernels.md")
    assert "hub cache" in message and "KERNELS_CACHE" in message


def test_online_and_not_cached_is_runnable_with_a_note() -> None:
    verdict = hub.kernel_availability(SONIC_MOE, make_env(H200))
    assert verdict.ok and "downloaded from the Hub at the first forward" in verdict.reason


@pytest.mark.parametrize(
    ("variant", "fits"),
    [
        ("torch211-cxx11-cu130-x86_64-linux", True),
        ("torch211-cu128-x86_64-linux", False),  # CUDA 12 build for a CUDA 13 torch: major differs
        ("torch211-cxx11-cu131-x86_64-linux", False),  # newer minor than torch's CUDA
        ("torch210-cxx11-cu130-x86_64-linux", False),
        ("torch211-cxx11-cu130-aarch64-linux", False),
        ("torch-stable-abi28-cu130-x86_64-linux", True),
        ("torch-cuda", True),
        ("torch-universal", True),
        ("torch-cpu", False),
        ("tvm-ffi01-cu130-x86_64-linux", True),  # apache-tvm-ffi 0.1 faked installed
    ],
)
def test_cached_variant_matching(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variant: str, fits: bool) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = make_env(H200)
    if env.platform != "linux-x86_64":
        pytest.skip("variant names here are for linux x86_64")
    cache_snapshot(tmp_path / "hub-cache", SONIC_MOE, [variant])
    loc = hub.locate(SONIC_MOE, env)
    assert (loc.state == "cached") is fits, loc
    verdict = hub.kernel_availability(SONIC_MOE, env)
    assert verdict.ok is fits
    if fits:
        assert "cached, variant " + variant in verdict.reason and "found by KERNELS_CACHE" in verdict.found
    else:
        assert verdict.status is Status.MISSING_PACKAGE and "no build variant" in verdict.reason


def test_kernels_lock_file_pins_the_commit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`kernels lock` + `kernels download` store snapshots by commit, without refs/vN: the lock file names it."""
    import kernels

    commit = "fedcba9876543210fedcba9876543210fedcba98"
    repo = tmp_path / "hub-cache" / "kernels--kernels-community--deep-gemm"
    variant = repo / "snapshots" / commit / "build" / "torch-cpu"
    variant.mkdir(parents=True)
    for f in (FAKES / "deep-gemm" / "build" / "torch-cpu").iterdir():
        if f.is_file():
            (variant / f.name).write_bytes(f.read_bytes())
    lock = tmp_path / "kernels.lock"
    lock.write_text(json.dumps([{"dependency": {"repo-id": DEEP_GEMM.repo_id, "version": 2},
                                 "lock": {"commit": commit}}]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = make_env(torch_cuda="")
    assert hub.locate(DEEP_GEMM, env).state == "absent"  # no refs/v2 without the lock
    monkeypatch.setenv("SELECTOR_KERNELS_LOCK", str(lock))
    loc = hub.locate(DEEP_GEMM, env)
    assert loc.state == "cached" and loc.variant == "torch-cpu"
    seen = {}

    def get_kernel(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        raise FileNotFoundError("not in this test")

    monkeypatch.setattr(kernels, "get_kernel", get_kernel)
    set_environment(env)
    assert hub.load_kernel(DEEP_GEMM, backend="deepgemm").FAKE  # falls back to the locked snapshot
    assert seen == {"repo_id": DEEP_GEMM.repo_id, "revision": commit}


def test_download_fetches_pins_by_branch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: calls.append((repo_id, kw)) or
                        str(tmp_path))
    hub.download([DEEP_GEMM, SONIC_MOE], variants=["torch211-cxx11-cu130-x86_64-linux"])
    assert [c[0] for c in calls] == [DEEP_GEMM.repo_id, SONIC_MOE.repo_id]
    assert calls[0][1]["revision"] == "v2" and calls[0][1]["repo_type"] == "kernel"
    assert calls[0][1]["allow_patterns"] == ["build/torch211-cxx11-cu130-x86_64-linux/*"]
    assert calls[0][1]["cache_dir"] == str(tmp_path / "hub-cache")


def test_cache_root_order(tmp_path: Path) -> None:
    assert hub.cache_root({"KERNELS_CACHE": "/k", "HF_HUB_CACHE": "/h"}) == (Path("/k"), "KERNELS_CACHE")
    assert hub.cache_root({"HF_HUB_CACHE": "/h", "HF_HOME": "/home"}) == (Path("/h"), "HF_HUB_CACHE")
    assert hub.cache_root({"HF_HOME": "/home"}) == (Path("/home/hub"), "HF_HOME")
    assert hub.cache_root({"XDG_CACHE_HOME": "/x"}) == (Path("/x/huggingface/hub"), "the default cache")
    assert hub.hub_offline({"HF_HUB_OFFLINE": "1"}) and hub.hub_offline({"TRANSFORMERS_OFFLINE": "yes"})
    assert not hub.hub_offline({"HF_HUB_OFFLINE": "0"})


@pytest.mark.slow
def test_kernels_itself_loads_what_locate_calls_cached(tmp_path: Path) -> None:
    """The cache layout `locate` reads is the one `kernels` loads offline (a fresh process: its constants)."""
    cache = tmp_path / "offline-cache"
    cache_snapshot(cache, DEEP_GEMM, ["torch-cpu"], source=FAKES / "deep-gemm" / "build" / "torch-cpu")
    code = (
        "import kernels; m = kernels.get_kernel('kernels-community/deep-gemm', version=2); "
        "assert m.FAKE and m.get_mk_alignment_for_contiguous_layout() == 128; print('loaded', m.__name__)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KERNELS_CACHE": str(cache)}
    env.pop("LOCAL_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded fake_deep_gemm_torch_cpu" in done.stdout
    located = hub.locate(DEEP_GEMM, make_env(torch_cuda=""), {"KERNELS_CACHE": str(cache)})
    assert located.state == "cached" and located.variant == "torch-cpu"


def test_loader_falls_back_to_the_cached_snapshot_when_the_hub_is_unreachable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import kernels

    cache_snapshot(tmp_path / "hub-cache", DEEP_GEMM, ["torch-cpu"], source=FAKES / "deep-gemm" / "build" / "torch-cpu")
    set_environment(make_env(torch_cuda=""))

    def unreachable(*args, **kwargs):
        raise ValueError("Kernel repository 'kernels-community/deep-gemm' could not verify publisher trust status.")

    monkeypatch.setattr(kernels, "get_kernel", unreachable)
    module = hub.load_kernel(DEEP_GEMM, ("m_grouped_bf16_gemm_nt_contiguous",), backend="deepgemm")
    assert module.FAKE


def test_loader_failure_is_an_import_error_with_the_offline_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # never reach the network from a test
    set_environment(make_env(torch_cuda=""))
    with pytest.raises(ImportError) as info:
        hub.load_kernel(SONIC_MOE, backend="sonicmoe")
    message = str(info.value)
    assert "'sonicmoe'" in message and "kernels-community/sonic-moe v2" in message
    assert "kernels download" in message and "LOCAL_KERNELS" in message and "HF_HUB_OFFLINE=1" in message


def test_loader_refuses_a_kernel_without_the_pinned_api(fake_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImportError, match="lacks moe_general_routing_inputs"):
        hub.load_kernel(DEEP_GEMM, ("moe_general_routing_inputs",), backend="deepgemm")


def test_doctor_reports_the_kernel_state(monkeypatch: pytest.MonkeyPatch) -> None:
    from selector.doctor import build_report
    from selector.render import render_text

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = build_report(make_env(H200), get_registry(), problem=problem(num_tokens=64))
    lines = {b.name: b for b in report.backends}
    assert not lines["sonicmoe"].verdict.ok and "not in the local cache" in lines["sonicmoe"].verdict.reason
    assert "25-144 s" in lines["sonicmoe"].first_call_cost
    text = render_text(report)
    assert "kernels download" in text and "first call:" in text
    assert "sonicmoe" in report.ranking.excluded


def test_hub_status_command_lists_each_pinned_kernel(fake_kernels: None) -> None:
    env = {**os.environ, "SELECTOR_GPUS": H200, "SELECTOR_TORCH_CUDA": "", "HF_HUB_OFFLINE": "1",
           "LOCAL_KERNELS": f"{SONIC_MOE.repo_id}={FAKES / 'sonic-moe'}"}
    done = subprocess.run([sys.executable, "-m", "selector.hub", "status"], env=env, capture_output=True, text=True)
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line and not line.startswith(" ")}
    assert set(lines) == {"deepgemm", "deepgemm_megamoe", "sonicmoe"}
    assert "ok" in lines["sonicmoe"] and "local kernel directory" in lines["sonicmoe"]
    assert "missing_package" in lines["deepgemm"] and done.returncode == 1


def test_kernels_pyproject_is_what_kernels_lock_reads(tmp_path: Path) -> None:
    import tomllib

    text = hub.kernels_pyproject()
    data = tomllib.loads(text)
    assert data["tool"]["kernels"]["dependencies"] == {
        "kernels-community/deep-gemm": 2,
        "kernels-community/sonic-moe": 2,
    }
    assert subprocess.run([sys.executable, "-m", "selector.hub", "pyproject"], capture_output=True, text=True,
                          check=True).stdout == text


# --- the ranking knows SonicMoE's first-call cost ---------------------------------------------------------


def test_padded_token_buckets() -> None:
    from selector.plugins.sonicmoe import padded_tokens

    assert [padded_tokens(t) for t in (1, 3, 4, 5, 9, 17, 33, 3000, 4096, 4097)] == [
        1, 3, 4, 5, 10, 20, 40, 3072, 4096, 5120]
    for t in range(5, 3000, 7):
        assert t <= padded_tokens(t) <= 1.25 * t
    assert len({padded_tokens(t) for t in range(1, 257)}) <= 4 + 4 * 6  # four buckets per doubling


def test_estimate_charges_pending_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    import selector.plugins.sonicmoe as sonic
    from selector.costmodel import floor_seconds

    env = make_env(H200, torch_cuda="")
    prob = problem(num_tokens=16384)
    not_here = sonic._estimate(prob, env)
    monkeypatch.setenv("LOCAL_KERNELS", f"{SONIC_MOE.repo_id}={FAKES / 'sonic-moe'}")  # now it is local
    cold = sonic._estimate(prob, env)
    assert not_here - cold == pytest.approx(hub.DOWNLOAD_SECONDS / 1000)
    sonic.record_compiled(sonic.problem_key(prob), 16384)
    warm = sonic._estimate(prob, env)
    assert cold - warm == pytest.approx((sonic.SHAPE_JIT_SECONDS + sonic.TOKEN_JIT_SECONDS) / 1000)
    # same shape, an unseen token bucket (12000 pads to 12288): only the per-token-count compile is pending
    new_count = sonic._estimate(prob.with_tokens(12000), env)
    steady = max(sonic.HOST_SECONDS, sonic.EFFICIENCY * floor_seconds(prob.with_tokens(12288), env))
    assert new_count == pytest.approx(steady + sonic.TOKEN_JIT_SECONDS / 1000)
    assert sonic.pending_compile_seconds(prob.with_tokens(12000)) == sonic.TOKEN_JIT_SECONDS
    assert sonic.pending_compile_seconds(prob.with_tokens(None)) == sonic.TOKEN_JIT_SECONDS  # decode mix
    monkeypatch.setenv("SELECTOR_JIT_AMORTIZE_CALLS", "1e6")
    assert sonic._estimate(prob.with_tokens(12000), env) - warm < 1e-5


def test_deepgemm_estimate_charges_download_and_jit(fake_kernels: None) -> None:
    import selector.plugins.deepgemm as dg

    env = make_env(H100, torch_cuda="")  # the fake's torch-cpu variant fits: the kernel is local
    prob = problem(num_tokens=4096)
    cold = dg._estimate(prob, env)
    dg.COMPILED.record(dg.problem_key(prob))
    try:
        assert cold - dg._estimate(prob, env) == pytest.approx(dg.JIT_SECONDS / 1000)
        assert dg._estimate(prob, make_env(H100)) - dg._estimate(prob, env) == pytest.approx(hub.DOWNLOAD_SECONDS / 1000)
    finally:
        dg.forget_compiled()


def test_auto_waits_for_a_warm_sonicmoe(monkeypatch: pytest.MonkeyPatch, fake_kernels: None) -> None:
    """Cold, SonicMoE's compile keeps it out of first place; warm, it wins large batches, loses T=1."""
    import selector.plugins.sonicmoe as sonic
    from selector.config import SelectorConfig
    from selector.ranking import rank
    from selector.registry import build_registry

    monkeypatch.setenv("SELECTOR_PLUGINS_ALLOW", "sonicmoe,grouped_mm")
    registry = build_registry()
    env = make_env(H200, torch_cuda="")  # the FAKE kernel directory is local (torch-cpu fits a CPU torch)
    big = problem(num_tokens=16384)
    assert rank(big, env, registry, SelectorConfig()).best == "grouped_mm"
    sonic.record_compiled(sonic.problem_key(big), 16384)
    assert rank(big, env, registry, SelectorConfig()).best == "sonicmoe"
    assert rank(big.with_tokens(1), env, registry, SelectorConfig()).best == "grouped_mm"


# --- data layout against the fake kernels --------------------------------------------------------------------

LAYOUTS = [
    Layout(),
    Layout(bias=True),
    Layout(transposed=True),
    Layout(interleaved=True),
    Layout(gated=False),
    Layout(custom_gate=True, interleaved=True, bias=True, transposed=True),
    Layout(post_norm=True),
    Layout(expert_parallel=True),
]


def _fake_module(name: str):
    import kernels

    pin = DEEP_GEMM if name == "deep-gemm" else SONIC_MOE
    return kernels.get_kernel(pin.repo_id, **pin.kwargs())


@pytest.mark.parametrize("gpu", [H100, B200], ids=["hopper", "blackwell"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_deepgemm_bf16_layout_matches_reference(fake_kernels: None, gpu: str, layout: Layout) -> None:
    from selector.plugins.deepgemm.forward import deepgemm_experts_forward

    set_environment(make_env(gpu))
    fake = _fake_module("deep-gemm")
    fake.CALLS.clear()
    module = make_experts(6, 64, 40, layout, dtype=torch.bfloat16, seed=3)
    x = torch.randn(11, 64).bfloat16()
    idx, w = random_routing(11, 6, 3, sentinel=layout.expert_parallel)
    out = deepgemm_experts_forward(module, x, idx, w)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert relative_error(out, reference_experts(module, x, idx, w)) < 2e-2
    # the layout the kernel saw: Hopper per-row ids, Blackwell cumulative ends; blocks on the 128-row alignment
    assert [c["psum"] for c in fake.CALLS] == [gpu == B200] * 2
    assert all(start % 128 == 0 for c in fake.CALLS for _, start, _ in c["blocks"])
    assert [c["name"] for c in fake.CALLS] == (["bf16_nn"] * 2 if layout.transposed else ["bf16_nt"] * 2)


def test_deepgemm_layout_rows_and_padding() -> None:
    from selector.plugins.deepgemm.forward import contiguous_layout

    idx = torch.tensor([[2, 0], [0, 4], [2, 4], [4, 0]])  # expert 4 is the EP sentinel for E=4
    hopper = contiguous_layout(idx, num_experts=4, alignment=8, psum=False)
    assert hopper.expert_ids.tolist() == [0, 0, 0, 2, 2, 4, 4, 4]
    assert hopper.rows.tolist() == [0, 1, 2, 8, 9, 16, 17, 18]  # expert 2 starts on row 8; sentinels after all
    assert hopper.num_rows % 8 == 0 and hopper.num_rows >= 19
    assert hopper.layout[:10].tolist() == [0, 0, 0, -1, -1, -1, -1, -1, 2, 2]
    assert (hopper.layout[16:] == -1).all()
    # the combine finds every (token, slot) pair's row again; scatter puts sorted rows on their padded rows
    assert hopper.pair_row.tolist() == [8, 0, 1, 16, 9, 17, 18, 2]
    placed = hopper.scatter(torch.arange(8.0).unsqueeze(-1))
    assert placed.shape == (hopper.num_rows, 1) and placed[hopper.rows, 0].tolist() == list(range(8))
    assert torch.equal(hopper.rows[torch.argsort(hopper.order)], hopper.pair_row)
    blackwell = contiguous_layout(idx, num_experts=4, alignment=8, psum=True)
    assert blackwell.layout.tolist() == [8, 8, 16, 16]
    assert torch.equal(blackwell.rows, hopper.rows)


def test_deepgemm_combine_sums_slots_in_the_result_dtype() -> None:
    """float32 results keep float32 routing weights (exact to ~1e-7); bf16 results round them once (~2^-9)."""
    from selector.plugins.deepgemm.forward import combine, contiguous_layout

    idx, w = random_routing(9, 6, 3)
    lay = contiguous_layout(idx, num_experts=6, alignment=8, psum=False)
    out = torch.randn(lay.num_rows, 32).bfloat16()
    module = types.SimpleNamespace(num_experts=6)
    rows = out[lay.pair_row].double().view(9, 3, 32)
    expected = (rows * w.double().unsqueeze(-1)).sum(1)
    assert relative_error(combine(out, idx, w, lay, module, torch.float32), expected) < 1e-6
    assert relative_error(combine(out, idx, w, lay, module, torch.bfloat16), expected) < 8e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("gpu", "weight_format", "scale_format"),
    [(H100, "fp8_block", "float32"), (H100, "fp8_block", "ue8m0"), (B200, "fp8_block", "ue8m0"), (B200, "fp4", None)],
    ids=["hopper-fp8-f32", "hopper-fp8-ue8m0", "blackwell-fp8-ue8m0", "blackwell-fp4"],
)
def test_deepgemm_quantised_matches_reference(fake_kernels: None, gpu: str, weight_format: str,
                                             scale_format: str | None) -> None:
    from selector.plugins.deepgemm.forward import deepgemm_experts_forward
    from selector.quant import quantize_experts, reference_forward

    set_environment(make_env(gpu))
    module = quantize_experts(make_experts(4, 512, 512, dtype=torch.bfloat16, seed=5), weight_format, scale_format)
    x = torch.randn(7, 512).bfloat16()
    idx, w = random_routing(7, 4, 2)
    with torch.no_grad():
        out = deepgemm_experts_forward(module, x, idx, w)
    assert relative_error(out, reference_forward(module, x, idx, w, quantize_activations_as_kernel=False)) < 8e-2
    fake = _fake_module("deep-gemm")
    assert fake.CALLS[-1]["name"] == "fp8_fp4_nt" and fake.CALLS[-1]["psum"] == (gpu == B200)


def _older_deepgemm_api(fake) -> types.SimpleNamespace:
    """FAKE of an earlier DeepGEMM release's surface (the one inside sgl-kernel 0.3): FP8 GEMMs named
    `m_grouped_fp8_gemm_*`, no `use_psum_layout` keyword, and `per_token_cast_to_fp8(x, use_ue8m0)` only.
    Strict signatures, so an adapter that passes the newer keywords fails with a TypeError."""

    def fp8_nt(a, b, d, m_indices, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
        fake.m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, m_indices, recipe=recipe)

    def bf16_nt(a, b, d, m_indices, compiled_dims=""):
        fake.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)

    def cast(x, use_ue8m0):
        return fake.utils.per_token_cast_to_fp8(x, use_ue8m0)

    return types.SimpleNamespace(
        m_grouped_fp8_gemm_nt_contiguous=fp8_nt,
        m_grouped_fp8_gemm_nn_contiguous=fp8_nt,
        m_grouped_bf16_gemm_nt_contiguous=bf16_nt,
        m_grouped_bf16_gemm_nn_contiguous=bf16_nt,
        get_mk_alignment_for_contiguous_layout=fake.get_mk_alignment_for_contiguous_layout,
        utils=types.SimpleNamespace(per_token_cast_to_fp8=cast),
    )


@pytest.mark.slow
def test_deepgemm_runs_an_earlier_release_api_on_hopper(fake_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from selector.plugins.deepgemm import forward
    from selector.quant import quantize_experts, reference_forward

    set_environment(make_env(H100))
    fake = _fake_module("deep-gemm")
    older = _older_deepgemm_api(fake)
    monkeypatch.setattr(forward.hub, "load_kernel", lambda *args, **kwargs: older)
    monkeypatch.setattr(forward, "_DEEPGEMM", None)
    x = torch.randn(7, 512).bfloat16()
    idx, w = random_routing(7, 4, 2)
    dense = make_experts(4, 512, 512, dtype=torch.bfloat16, seed=6)
    with torch.no_grad():
        assert relative_error(forward.deepgemm_experts_forward(dense, x, idx, w),
                              reference_experts(dense, x, idx, w)) < 2e-2
        fp8 = quantize_experts(dense, "fp8_block", "float32")
        out = forward.deepgemm_experts_forward(fp8, x, idx, w)
    assert relative_error(out, reference_forward(fp8, x, idx, w, quantize_activations_as_kernel=False)) < 8e-2
    assert fake.CALLS[-1]["name"] == "fp8_fp4_nt" and fake.CALLS[-1]["psum"] is False
    # a build with neither FP8 name: the quantised forward says so, as an ImportError with a fix
    del older.m_grouped_fp8_gemm_nt_contiguous
    monkeypatch.setattr(forward, "_DEEPGEMM", None)
    with torch.no_grad(), pytest.raises(ImportError, match="no FP8 grouped GEMM"):
        forward.deepgemm_experts_forward(fp8, x, idx, w)


@pytest.mark.slow
def test_deepgemm_quantised_forward_guards(fake_kernels: None) -> None:
    from selector.plugins.deepgemm.forward import deepgemm_experts_forward
    from selector.quant import quantize_experts

    idx, w = random_routing(2, 4, 2)
    x = torch.randn(2, 512).bfloat16()
    set_environment(make_env(B200))
    f32 = quantize_experts(make_experts(4, 512, 512, dtype=torch.bfloat16), "fp8_block", "float32")
    with torch.no_grad(), pytest.raises(ValueError, match="UE8M0"):
        deepgemm_experts_forward(f32, x, idx, w)
    set_environment(make_env(H100))
    fp4 = quantize_experts(make_experts(4, 512, 512, dtype=torch.bfloat16), "fp4")
    with torch.no_grad(), pytest.raises(ImportError, match="Blackwell"):
        deepgemm_experts_forward(fp4, x, idx, w)
    f32.activation_scheme = "static"
    with torch.no_grad(), pytest.raises(ValueError, match="static activation"):
        deepgemm_experts_forward(f32, x, idx, w)


SONIC_LAYOUTS = [
    Layout(),
    Layout(bias=True),
    Layout(transposed=True),
    Layout(interleaved=True),
    Layout(interleaved=True, transposed=True, bias=True),
    Layout(expert_parallel=True),
]


@pytest.mark.parametrize("layout", SONIC_LAYOUTS, ids=str)
def test_sonicmoe_layout_matches_reference(fake_kernels: None, layout: Layout) -> None:
    from selector.plugins.sonicmoe.forward import sonicmoe_experts_forward

    fake = _fake_module("sonic-moe")
    fake.CALLS.clear()
    module = make_experts(6, 64, 40, layout, dtype=torch.bfloat16, seed=7)
    x = torch.randn(9, 64).bfloat16()
    idx, w = random_routing(9, 6, 3, sentinel=layout.expert_parallel)
    out = sonicmoe_experts_forward(module, x, idx, w)
    assert out.shape == x.shape
    assert relative_error(out, reference_experts(module, x, idx, w)) < 2e-2
    assert fake.CALLS[-1]["tokens"] == 10  # 9 tokens padded to the bucket of 10
    assert fake.CALLS[-1]["concat_layout"] is (not layout.interleaved)


@pytest.mark.parametrize(("act", "kind"), [(torch.nn.SiLU(), "SWIGLU"), (torch.nn.GELU(), "GEGLU"),
                                           (torch.nn.GELU(approximate="tanh"), "GEGLU"), (torch.nn.ReLU(), "REGLU")])
def test_sonicmoe_activations(fake_kernels: None, act: torch.nn.Module, kind: str) -> None:
    from selector.plugins.sonicmoe.forward import sonicmoe_experts_forward

    fake = _fake_module("sonic-moe")
    module = make_experts(4, 64, 32, dtype=torch.bfloat16, act=act, seed=2)
    x = torch.randn(6, 64).bfloat16()
    idx, w = random_routing(6, 4, 2)
    out = sonicmoe_experts_forward(module, x, idx, w)
    assert fake.CALLS[-1]["activation"].name == kind
    assert relative_error(out, reference_experts(module, x, idx, w)) < 2e-2  # GeGLU is tanh-GELU in the kernel


@pytest.mark.parametrize(
    ("layout", "act", "what"),
    [(Layout(gated=False), None, "non-gated"), (Layout(), torch.nn.Tanh(), "'custom:Tanh'"),
     (Layout(custom_gate=True, interleaved=True), None, "custom gate")],
)
def test_sonicmoe_forward_refuses_other_activations(fake_kernels: None, layout: Layout, act, what: str) -> None:
    from selector.plugins.sonicmoe.forward import sonicmoe_experts_forward

    module = make_experts(4, 32, 16, layout, dtype=torch.bfloat16, act=act)
    idx, w = random_routing(3, 4, 2)
    with pytest.raises(ImportError, match="pick another experts backend") as info:
        sonicmoe_experts_forward(module, torch.randn(3, 32).bfloat16(), idx, w)
    assert what in str(info.value)


def test_sonicmoe_kernel_without_concat_flag_gets_interleaved_weights(fake_kernels: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import selector.plugins.sonicmoe.forward as forward
    from selector.problem import problem_from_module

    bundle = forward.load_sonicmoe()
    monkeypatch.setattr(forward, "_SONICMOE", replace(bundle, concat_flag=None))
    monkeypatch.setattr(forward, "load_sonicmoe", lambda: forward._SONICMOE)
    module = make_experts(4, 64, 32, Layout(bias=True), dtype=torch.bfloat16, seed=4)
    x = torch.randn(5, 64).bfloat16()
    idx, w = random_routing(5, 4, 2)
    plan = forward.prepare(module, problem_from_module(module, top_k=2))
    with torch.no_grad():
        out = plan.run(x, idx, w)
        copy = plan.weights[0]
        assert copy.data_ptr() != module.gate_up_proj.data_ptr()  # interleaved: a copy, made at prepare
        assert plan.run(x, idx, w).equal(out)
        assert plan.weights[0] is copy  # the interleaved copy is made once
    assert _fake_module("sonic-moe").CALLS[-1]["concat_layout"] is False
    assert relative_error(out, reference_experts(module, x, idx, w)) < 2e-2


def test_sonicmoe_forward_records_compiles_and_warm_up(fake_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import selector.plugins.sonicmoe as sonic
    from selector.problem import problem_from_module

    module = make_experts(4, 64, 32, dtype=torch.bfloat16)
    prob = problem_from_module(module, num_tokens=9, top_k=2)
    assert sonic.pending_compile_seconds(prob) == sonic.SHAPE_JIT_SECONDS + sonic.TOKEN_JIT_SECONDS
    sonic.warm_up(module, [9, 100], top_k=2)
    assert sonic.pending_compile_seconds(prob) == 0.0
    assert sonic.pending_compile_seconds(prob.with_tokens(104)) == 0.0  # 100 and 104 share the bucket of 112
    assert sonic.pending_compile_seconds(prob.with_tokens(200)) == sonic.TOKEN_JIT_SECONDS
    monkeypatch.setenv("SELECTOR_SONICMOE_PAD_TOKENS", "0")
    assert sonic.padded_tokens(9) == 9


def test_sonicmoe_zero_tokens(fake_kernels: None) -> None:
    from selector.plugins.sonicmoe.forward import sonicmoe_experts_forward

    module = make_experts(4, 32, 16, dtype=torch.bfloat16)
    out = sonicmoe_experts_forward(module, torch.zeros(0, 32).bfloat16(), torch.zeros(0, 2, dtype=torch.long),
                                   torch.zeros(0, 2))
    assert out.shape == (0, 32)


# --- end to end through the dispatch core, against the eager backend -----------------------------------------


class _CpuFakePlugin:
    """Test-only backends: the real adapters (their prepared plans), declared for the CPU so the model API can run
    them on fakes."""

    @staticmethod
    @selector.hookimpl
    def selector_backends():
        from selector.plugins.adapter import declare
        from selector.types import Requirements

        cpu = Requirements(devices=frozenset({"cpu"}), dtypes=frozenset({"bfloat16"}), bias=True)  # the test's layer is biased
        return [declare("deepgemm_fake_cpu", "selector.plugins.deepgemm.forward", cpu),
                declare("sonicmoe_fake_cpu", "selector.plugins.sonicmoe.forward", cpu)]


@pytest.mark.parametrize("backend", ["deepgemm_fake_cpu", "sonicmoe_fake_cpu"])
def test_model_api_runs_the_adapters_like_eager(fake_kernels: None, backend: str, fresh_registry) -> None:
    set_environment(make_env(B200))
    fresh_registry(fake_cpu_backends=_CpuFakePlugin)
    module = make_experts(8, 64, 48, Layout(bias=True), dtype=torch.bfloat16, seed=11)
    x = torch.randn(13, 64).bfloat16()
    idx, w = random_routing(13, 8, 2)
    selector.set_experts_implementation(module, "eager")
    expected = module(x, idx, w)
    selector.set_experts_implementation(module, backend)
    out = module(x, idx, w)
    assert last_backend(module) == backend
    assert relative_error(out, expected.double()) < 2e-2
    from selector.dispatch import module_cache
    from selector.plugins.adapter import KernelPlan

    plans = [p.plan for p in module_cache(module).plans.values() if p.name == backend]
    assert plans and all(isinstance(plan, KernelPlan) for plan in plans)  # the core ran the adapter's own plan


# --- the GPU script's kernel directory ---------------------------------------------------------------------
