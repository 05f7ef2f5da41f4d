"""The adapters of other libraries' kernels as prepared plans (selector.plugins.adapter), against the fakes.

Each adapter's `prepare` converts the layout once: a plan run twice converts nothing more and hands the kernel the
same weights; `prepare` writes nothing into the module, and the plan does not keep the module alive. Where the
call differentiates the experts' weights, the plan converts on each run instead (a kept copy would cut the
gradient). Also the base's own pieces: package verdicts, the first-call ledger, the library import's error.
"""

from __future__ import annotations

import gc
import importlib
import sys
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from experts_fixtures import Layout, make_experts, random_routing, reference_experts, relative_error
from test_candidate_plugins import install_fake

from selector import Status, hub, layers
from selector.environment import set_environment
from selector.plugins.adapter import FirstCalls, Library, Package, package_verdict, shape_key
from selector.probes import DEFAULT_PACKAGES, collect_environment
from selector.problem import problem_from_module
from selector.registry import get_registry

FAKES = Path(__file__).parent / "fake_kernels"
LIBRARY_FAKES = ("liger", "flashinfer_cutlass", "triton_kernels")
H100 = "NVIDIA H100 80GB HBM3:9.0:80"
B200 = "NVIDIA B200:10.0:180"


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The fake libraries on sys.path and the fake hub kernels as local kernels; everything loaded forgotten."""
    for which in LIBRARY_FAKES:
        install_fake(tmp_path, which)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("LOCAL_KERNELS", f"{hub.PINS['deep-gemm'].repo_id}={FAKES / 'deep-gemm'}:"
                                        f"{hub.PINS['sonic-moe'].repo_id}={FAKES / 'sonic-moe'}")  # fmt: skip
    _forget()
    importlib.invalidate_caches()
    yield
    _forget()


def _forget() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in ("liger_kernel", "flashinfer", "triton_kernels"):
            del sys.modules[name]
    from selector.plugins.flashinfer_cutlass.forward import FLASHINFER
    from selector.plugins.liger.forward import LIGER
    from selector.plugins.triton_kernels.forward import TRITON_KERNELS

    for library in (FLASHINFER, LIGER, TRITON_KERNELS):
        library.forget()
    hub.forget_loaded()


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors a plan holds in its (nested) weights tuple."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _layer(backend: str) -> torch.nn.Module:
    """A layer each backend must convert (a copy, not the parameters as they are)."""
    if backend == "deepgemm_megamoe":
        from selector.quant import quantize_experts

        return quantize_experts(make_experts(4, 256, 256, dtype=torch.bfloat16, seed=1), "fp4")
    if backend == "deepgemm":
        from selector.quant import quantize_experts

        return quantize_experts(make_experts(4, 256, 256, dtype=torch.bfloat16, seed=1), "fp8_block")
    dtype = torch.bfloat16 if backend == "sonicmoe" else torch.float32
    return make_experts(4, 64, 32, Layout(transposed=True, interleaved=backend != "triton_kernels",
                                          bias=backend == "triton_kernels"), dtype=dtype, seed=2)  # fmt: skip


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    from selector.plugins.deepgemm_megamoe.forward import destroy_buffers

    destroy_buffers()
    dist.destroy_process_group()


BACKENDS = ("liger", "flashinfer_cutlass", "triton_kernels", "sonicmoe", "deepgemm", "deepgemm_megamoe")


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepare_converts_once_and_writes_nothing_into_the_module(fakes, backend: str, request: pytest.FixtureRequest,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    if backend == "deepgemm_megamoe":
        request.getfixturevalue("world_of_one")  # its symmetric buffer needs a process group
    gpu = B200 if backend == "deepgemm_megamoe" else H100  # the fakes run on the CPU as the probe facts' GPU
    set_environment(collect_environment({"SELECTOR_GPUS": gpu, "PATH": ""}, packages=DEFAULT_PACKAGES))
    forward = importlib.import_module(f"selector.plugins.{backend}.forward")
    conversions = []
    convert = forward.kernel_weights

    def counting(*args, **kwargs):  # noqa: ANN002,ANN003,ANN202
        conversions.append(1)
        return convert(*args, **kwargs)

    monkeypatch.setattr(forward, "kernel_weights", counting)
    module = _layer(backend)
    before = {name: id(value) for name, value in module.__dict__.items()}
    params = {name: (p.data_ptr(), p._version) for name, p in module.named_parameters()}
    plan = get_registry().get(backend).prepare(module, problem_from_module(module, top_k=2))
    assert conversions == [1]
    assert {name: id(value) for name, value in module.__dict__.items()} == before, "prepare wrote to the module"
    assert {name: (p.data_ptr(), p._version) for name, p in module.named_parameters()} == params
    bf16 = backend in ("sonicmoe", "deepgemm", "deepgemm_megamoe")
    x = torch.randn(5, layers.dims(module)[1]).to(torch.bfloat16 if bf16 else torch.float32)
    ids, weights = random_routing(5, 4, 2)
    held = [t.data_ptr() for t in _tensors(plan.weights)]
    with torch.no_grad():
        first = plan.run(x, ids, weights)
        second = plan.run(x, ids, weights)
    assert conversions == [1], "a run converted the weights again"
    assert torch.equal(first, second)
    assert [t.data_ptr() for t in _tensors(plan.weights)] == held
    # the plan does not keep the module alive (it lives in the module's own cache)
    ref = weakref.ref(module)
    del module
    gc.collect()
    assert ref() is None and plan.module() is None
    with pytest.raises(RuntimeError, match="module this plan was prepared for is gone"):
        plan.run(x, ids, weights)


def test_liger_plan_gives_the_kernel_the_same_copy_every_run(fakes) -> None:
    module = _layer("liger")
    plan = get_registry().get("liger").prepare(module, problem_from_module(module, top_k=2))
    calls = importlib.import_module("liger_kernel.ops.fused_moe").LigerFusedMoEFunction.CALLS
    x = torch.randn(3, 64)
    ids, weights = random_routing(3, 4, 2)
    with torch.no_grad():
        plan.run(x, ids, weights)
        plan.run(x, ids, weights)
    assert calls[-1] == calls[-2] == (plan.weights[0].data_ptr(), plan.weights[1].data_ptr())
    assert calls[-1][0] != module.gate_up_proj.data_ptr()  # transposed and interleaved: a copy


@pytest.mark.parametrize("backend", ["liger", "sonicmoe"])
def test_a_call_that_differentiates_the_weights_converts_on_each_run(fakes, backend: str) -> None:
    module = _layer(backend)
    problem = replace(problem_from_module(module, top_k=2), grad_inputs=("expert_weights",))
    plan = get_registry().get(backend).prepare(module, problem)
    assert plan.weights is None  # a kept copy would cut the weights' gradient
    x = torch.randn(3, 64).to(module.gate_up_proj.dtype)
    ids, weights = random_routing(3, 4, 2)
    if backend == "liger":  # the fake kernel has no backward of its own: autograd runs through its torch code
        plan.run(x, ids, weights).float().sum().backward()
        assert module.gate_up_proj.grad is not None and module.gate_up_proj.grad.abs().sum() > 0
    else:
        out = plan.run(x, ids, weights)
        assert relative_error(out, reference_experts(module, x, ids, weights)) < 2e-2


# --- the base's own pieces -----------------------------------------------------------------------------------------


def _env(**packages: str):
    environ = {"SELECTOR_GPUS": "", "PATH": ""}
    environ.update({"SELECTOR_PACKAGE_" + name.upper(): version for name, version in packages.items()})
    return collect_environment(environ, packages=(*DEFAULT_PACKAGES, *(n.replace("_", "-") for n in packages)))


def test_package_verdicts_name_the_package_the_version_and_the_fix() -> None:
    wanted = [Package("some-kernel", "1.2", "its kernels", "docs/offline.md#some"), Package("ninja")]
    missing = package_verdict(wanted, _env(some_kernel="", ninja="1.11"))
    assert missing.status is Status.MISSING_PACKAGE
    assert missing.reason == "needs the Python package 'some-kernel' >= 1.2 (its kernels), which is not installed"
    assert missing.remedy == "pip install 'some-kernel>=1.2' (offline nodes: docs/offline.md#some)"
    assert missing.found.startswith("some-kernel: not found (")
    old = package_verdict(wanted, _env(some_kernel="1.1.9", ninja="1.11"))
    assert old.status is Status.PACKAGE_TOO_OLD and "1.1.9 is installed" in old.reason
    assert old.remedy.startswith("pip install -U 'some-kernel>=1.2'")
    no_ninja = package_verdict(wanted, _env(some_kernel="1.3", ninja=""))
    assert no_ninja.reason == "needs the Python package 'ninja', which is not installed"
    assert package_verdict(wanted, _env(some_kernel="1.3", ninja="1.11")) is None


def test_first_call_ledger_and_shape_key() -> None:
    from selector.types import Problem

    ledger = FirstCalls(30.0)
    problem = Problem(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2)
    key = shape_key(problem, ("hidden_size", "intermediate_size"))
    assert key == (64, 32) and ledger.pending(key) == 30.0
    ledger.record(key)
    assert ledger.paid(key) and ledger.pending(key) == 0.0
    assert ledger.pending(shape_key(replace(problem, hidden_size=128), ("hidden_size", "intermediate_size"))) == 30.0
    ledger.forget()
    assert ledger.pending(key) == 30.0


def test_library_import_error_names_what_is_needed_and_the_fix() -> None:
    library = Library("demo", "demo-kernels >= 2 with demo_kernels.moe", "pip install 'demo-kernels>=2'",
                      lambda import_module: import_module("demo_kernels_not_installed").moe)  # fmt: skip
    with pytest.raises(ImportError) as caught:
        library.get()
    message = str(caught.value)
    assert message.startswith("experts backend 'demo' needs demo-kernels >= 2 with demo_kernels.moe; importing it")
    assert "ModuleNotFoundError" in message and message.endswith("fix: pip install 'demo-kernels>=2'")
