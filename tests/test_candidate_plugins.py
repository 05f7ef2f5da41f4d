"""The `liger`, `flashinfer_cutlass` and `triton_kernels` backends.

CPU part: the adapters run against FAKE libraries written into tmp_path and put on sys.path (a fake
`liger_kernel`, a fake `flashinfer`, a fake `triton_kernels`, each with a `*.dist-info` so the package probes
find a version). The fakes implement the functions the adapters call in plain torch, with the semantics and
input contracts read from the real sources (liger-kernel 0.8.5 `ops/fused_moe.py`, flashinfer-python 0.6.13
`fused_moe/core.py` and its CUTLASS activation kernel, the triton_kernels copy in vLLM 0.33 `matmul_ogs.py` /
`routing.py`), so the layout logic of each adapter is checked against the float64 reference of
`selector.testing`. They say nothing about the real kernels' speed or numerics.

GPU part (`gpu` marker; each test skips when its library is not importable): the real kernels through the model
API against the float64 reference, bf16, on a small shape of every declared layout and on the Qwen3-30B-A3B
shape at T=64.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

# Liger autotunes 32 configs per shape on its first call (over 200 s for the Qwen3-30B-A3B shape on the H200):
# the GPU tests check its results, not its tuning, so one pinned config. Liger reads this at import, which
# happens when the backend first loads, after collection.
os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")

from experts_fixtures import Layout, make_experts, random_routing, reference_experts, relative_error

import selector
from selector.dispatch import last_backend
from selector.environment import set_environment
from selector.errors import unavailable_error
from selector.presets import preset
from selector.probes import DEFAULT_PACKAGES, collect_environment
from selector.ranking import rank
from selector.registry import get_registry
from selector.requirements import evaluate
from selector.testing import check_backend_contract
from selector.types import Problem, Status

BACKENDS = ("liger", "flashinfer_cutlass", "triton_kernels")
H200 = "NVIDIA H200:9.0:141"
A100 = "NVIDIA A100-SXM4-80GB:8.0:80"
T4 = "Tesla T4:7.5:16"

# --- the fakes ---------------------------------------------------------------------------------------------------

FAKE_LIGER = '''
"""FAKE liger_kernel.ops.fused_moe for CPU tests: LigerFusedMoEFunction.apply in torch (liger-kernel 0.8.5)."""
import torch


class LigerFusedMoEFunction:
    CALLS = []

    @staticmethod
    def apply(x, gate_up_proj, down_proj, top_k_index, top_k_weights):
        # the real forward is wrapped in ensure_contiguous, reads ids as int32 and weights as float
        assert top_k_index.dtype == torch.int32, top_k_index.dtype
        assert top_k_weights.dtype == torch.float32, top_k_weights.dtype
        E, two_i, H = gate_up_proj.shape
        inter = two_i // 2
        assert down_proj.shape == (E, H, inter) and x.shape[1] == H
        assert int(top_k_index.min()) >= 0 and int(top_k_index.max()) < E, "id out of bounds"
        LigerFusedMoEFunction.CALLS.append((gate_up_proj.data_ptr(), down_proj.data_ptr()))
        out = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                h = gate_up_proj[e].float() @ x[t].float()
                gate, up = h[:inter], h[inter:]  # rows [gate | up], silu(gate) * up
                y = down_proj[e].float() @ (torch.nn.functional.silu(gate) * up)
                out[t] = out[t] + top_k_weights[t, j] * y
        return out.to(x.dtype)
'''

FAKE_FLASHINFER = '''
"""FAKE flashinfer.fused_moe for CPU tests: cutlass_fused_moe in torch (flashinfer-python 0.6.13)."""
import enum

import torch


class ActivationType(enum.IntEnum):
    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4


CALLS = []


def cutlass_fused_moe(input, token_selected_experts, token_final_scales, fc1_expert_weights, fc2_expert_weights,
                      output_dtype, quant_scales, fc1_expert_biases=None, fc2_expert_biases=None, output=None,
                      activation_type=ActivationType.Swiglu, **kwargs):
    # the binding's checks: int32 ids, float32 scales, fc1 [E, 2I, H] against fc2 [E, H, I]
    assert token_selected_experts.dtype == torch.int32, token_selected_experts.dtype
    assert token_final_scales.dtype == torch.float32, token_final_scales.dtype
    assert quant_scales is None or len(quant_scales) == 0
    assert activation_type == ActivationType.Swiglu
    E, H, inter = fc2_expert_weights.shape
    assert fc1_expert_weights.shape == (E, 2 * inter, H)
    assert fc1_expert_weights.is_contiguous() and fc2_expert_weights.is_contiguous()
    assert H % 8 == 0 and inter % 8 == 0, "TMA alignment"
    assert int(token_selected_experts.min()) >= 0 and int(token_selected_experts.max()) < E
    CALLS.append(fc1_expert_weights.data_ptr())
    result = torch.zeros(input.shape[0], H, dtype=torch.float32)
    for t in range(input.shape[0]):
        for j in range(token_selected_experts.shape[1]):
            e = int(token_selected_experts[t, j])
            h = fc1_expert_weights[e].float() @ input[t].float()
            linear, gate = h[:inter], h[inter:]  # the activation reads the linear half first
            y = fc2_expert_weights[e].float() @ (torch.nn.functional.silu(gate) * linear)
            result[t] += token_final_scales[t, j] * y
    if output is None:
        output = torch.empty(input.shape[0], H, dtype=output_dtype)
    assert output.shape == (input.shape[0], H) and output.dtype == output_dtype
    output.copy_(result)
    return [output]
'''

FAKE_TK_ROUTING = '''
"""FAKE triton_kernels.routing for CPU tests: the data classes and compute_expt_data (vLLM 0.33's copy)."""
from dataclasses import dataclass, field

import torch


@dataclass
class GatherIndx:
    src_indx: torch.Tensor
    dst_indx: torch.Tensor


@dataclass
class ScatterIndx:
    src_indx: torch.Tensor
    dst_indx: torch.Tensor


@dataclass
class ExptData:
    hist: torch.Tensor
    token_offs_raw: torch.Tensor
    token_offs_pad: dict
    block_pid_map: dict


@dataclass
class RoutingData:
    gate_scal: torch.Tensor = field()
    expt_hist: torch.Tensor = field()
    n_expts_tot: int = field()
    n_expts_act: int = field()
    expt_data: ExptData = None


def compute_expt_data(expt_hist, n_expts_tot, n_gates):
    assert expt_hist.dtype == torch.int32 and expt_hist.shape == (n_expts_tot,)
    assert int(expt_hist.sum()) == n_gates
    offs = torch.zeros(n_expts_tot + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(expt_hist, 0)
    return ExptData(expt_hist, offs, {}, {})
'''

FAKE_TK_MATMUL = '''
"""FAKE triton_kernels.matmul_ogs for CPU tests: matmul_ogs in torch, from the library's matmul_ogs_torch."""
import torch


def matmul_ogs(x, w, bias, routing_data=None, gather_indx=None, scatter_indx=None, precision_config=None,
               betas=None, gammas=None, out_alpha=None, y=None, fused_activation=None, epilogue=None):
    assert w.ndim == 3 and x.ndim == 2
    E, K, N = w.shape
    assert x.shape[1] == K, (x.shape, w.shape)
    assert w.stride(-1) == 1 or w.stride(-2) == 1, "W must be row- or column-major"
    k = routing_data.n_expts_act
    offs = routing_data.expt_data.token_offs_raw
    rows = x.shape[0] if gather_indx is None else gather_indx.src_indx.shape[0]
    if gather_indx is not None:
        assert gather_indx.src_indx.dtype == torch.int32
    out = torch.zeros(rows, N, dtype=torch.float32)
    for e in range(E):
        lo, hi = int(offs[e]), int(offs[e + 1])
        idx = torch.arange(lo, hi) if gather_indx is None else gather_indx.src_indx[lo:hi].long() // k
        part = x[idx].float() @ w[e].float()
        if bias is not None:
            assert bias.shape == (E, N)
            part = part + bias[e].float()
        if gammas is not None:
            part = part * gammas[lo:hi, None].float()
        out[lo:hi] = part
    if scatter_indx is None:
        return out.to(x.dtype)
    assert scatter_indx.src_indx.dtype == torch.int32
    group = scatter_indx.src_indx.view(-1, k).long()  # each token's k sorted rows, summed in float32
    return out[group].sum(dim=1).to(x.dtype)
'''


def _dist_info(root: Path, dist: str, version: str) -> None:
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def install_fake(root: Path, which: str) -> None:
    """Write one FAKE library (and its dist-info) under root."""
    if which == "liger":
        _write(root, {"liger_kernel/__init__.py": '"""FAKE liger_kernel."""\n', "liger_kernel/ops/__init__.py": "",
                      "liger_kernel/ops/fused_moe.py": FAKE_LIGER})
        _dist_info(root, "liger-kernel", "0.8.5")
    elif which == "flashinfer_cutlass":
        _write(root, {"flashinfer/__init__.py": '"""FAKE flashinfer."""\n__version__ = "0.6.13"\n',
                      "flashinfer/fused_moe/__init__.py": FAKE_FLASHINFER})
        _dist_info(root, "flashinfer-python", "0.6.13")
        _dist_info(root, "apache-tvm-ffi", "0.1.15")
        _dist_info(root, "ninja", "1.11.1")
    elif which == "triton_kernels":  # a copied tree: no dist-info, as vLLM's copy is brought
        _write(root, {"triton_kernels/__init__.py": '"""FAKE triton_kernels."""\n',
                      "triton_kernels/routing.py": FAKE_TK_ROUTING, "triton_kernels/matmul_ogs.py": FAKE_TK_MATMUL})
    else:
        raise ValueError(which)


def _forget_libraries() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in ("liger_kernel", "flashinfer", "triton_kernels"):
            del sys.modules[name]
    import selector.plugins.flashinfer_cutlass as fic
    import selector.plugins.liger as lig
    import selector.plugins.triton_kernels as tkp
    from selector.plugins.flashinfer_cutlass.forward import FLASHINFER
    from selector.plugins.liger.forward import LIGER
    from selector.plugins.triton_kernels.forward import TRITON_KERNELS

    for library in (FLASHINFER, LIGER, TRITON_KERNELS):
        library.forget()
    for ledger in (lig.TUNED, fic.BUILT, tkp.COMPILED):
        ledger.forget()


@pytest.fixture(autouse=True)
def _no_libraries(monkeypatch: pytest.MonkeyPatch):
    """No real (or earlier fake) library leaks in; overrides from the shell are dropped."""
    for name in ("SELECTOR_PACKAGE_LIGER_KERNEL", "SELECTOR_PACKAGE_FLASHINFER_PYTHON", "SELECTOR_PACKAGE_NINJA",
                 "SELECTOR_PACKAGE_APACHE_TVM_FFI", "SELECTOR_PACKAGE_TRITON_KERNELS", "SELECTOR_JIT_AMORTIZE_CALLS"):
        monkeypatch.delenv(name, raising=False)
    _forget_libraries()
    yield
    _forget_libraries()
    importlib.invalidate_caches()


@pytest.fixture
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """All three FAKE libraries on sys.path."""
    for which in BACKENDS:
        install_fake(tmp_path, which)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path


def make_env(gpu: str | None = H200, nvcc: str | None = "13.0", **packages: str):
    """Probe facts of a GPU host from override variables only; packages named by keyword are forced."""
    environ = {"SELECTOR_GPUS": gpu or "", "SELECTOR_PACKAGE_TORCH": "2.11.0", "SELECTOR_TORCH_CUDA": "13.0",
               "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""}  # fmt: skip
    if nvcc is None:
        environ["SELECTOR_CUDA_TOOLKIT"] = ""  # no toolkit anywhere
    else:
        environ.update({"SELECTOR_CUDA_TOOLKIT": "/opt/cuda", "SELECTOR_NVCC_VERSION": nvcc})
    for name, version in packages.items():
        environ["SELECTOR_PACKAGE_" + name.upper()] = version
    names = (*DEFAULT_PACKAGES, *(n.replace("_", "-") for n in packages))
    return collect_environment(environ, packages=names)


ALL_PRESENT = {"liger_kernel": "0.8.5", "flashinfer_python": "0.6.13", "apache_tvm_ffi": "0.1.15",
               "ninja": "1.11.1", "triton_kernels": "1.0.0"}  # fmt: skip


def qwen3(**changes) -> Problem:
    base = Problem(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8, dtype="bfloat16", device="cuda")
    return replace(base, **changes)


def expect(backend: str, prob: Problem, env, error: type[Exception], *phrases: str) -> str:
    verdict = evaluate(get_registry().get(backend), prob, env)
    assert not verdict.ok, f"{backend} should be refused"
    exc = unavailable_error(backend, verdict)
    assert type(exc) is error, f"{type(exc).__name__}: {exc}"
    for phrase in phrases:
        assert phrase in str(exc), f"{phrase!r} not in: {exc}"
    return str(exc)


# --- registration and declarations -------------------------------------------------------------------------------


def test_registered_through_entry_points() -> None:
    registry = get_registry()
    for name in BACKENDS:
        spec = registry.get(name)
        assert spec.name == name and spec.first_call_cost and spec.url
        assert spec.requirements.devices == frozenset({"cuda"})


def test_declaring_imports_neither_torch_nor_the_libraries() -> None:
    code = (
        "import sys; import selector.plugins.liger, selector.plugins.flashinfer_cutlass, "
        "selector.plugins.triton_kernels; "
        "bad = [m for m in ('torch', 'liger_kernel', 'flashinfer', 'triton_kernels') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_all_three_run_on_the_h200_with_their_packages() -> None:
    env = make_env(**ALL_PRESENT)
    for name in BACKENDS:
        verdict = evaluate(get_registry().get(name), qwen3(), env)
        assert verdict.ok, (name, verdict)


@pytest.mark.parametrize(
    ("backend", "dist", "variable", "phrases"),
    [
        ("liger", "liger-kernel", "liger_kernel", ("'liger-kernel' >= 0.8.5", "docs/offline-kernels.md#liger-kernel")),
        ("flashinfer_cutlass", "flashinfer-python", "flashinfer_python",
         ("'flashinfer-python' >= 0.6.13", "docs/offline-kernels.md#flashinfer-cutlass-fused-moe")),
        ("flashinfer_cutlass", "apache-tvm-ffi", "apache_tvm_ffi", ("'apache-tvm-ffi' >= 0.1.6",)),
        ("flashinfer_cutlass", "ninja", "ninja", ("'ninja'",)),
        ("triton_kernels", "triton_kernels", "triton_kernels",
         ("triton_kernels library", "docs/offline-kernels.md#openai-triton_kernels", "python/triton_kernels")),
    ],
)
def test_missing_package_is_an_import_error_naming_it(backend: str, dist: str, variable: str,
                                                      phrases: tuple[str, ...]) -> None:  # fmt: skip
    env = make_env(**{**ALL_PRESENT, variable: ""})
    message = expect(backend, qwen3(), env, ImportError, *phrases)
    assert "not found" in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_library_that_fails_to_import_fails_the_load_not_the_call(backend: str) -> None:
    # installed by its metadata but broken (a triton_kernels tree for another Triton, a missing FlashInfer
    # dependency): loading the backend imports the library, so auto skips it instead of failing every forward
    library = {"liger": "liger_kernel", "flashinfer_cutlass": "flashinfer", "triton_kernels": "triton_kernels"}[backend]
    if importlib.util.find_spec(library) is not None:
        pytest.skip(f"{library} is installed here")
    spec = get_registry().get(backend)
    with pytest.raises(ImportError, match=backend):
        spec.load()


def test_too_old_packages_are_refused() -> None:
    expect("liger", qwen3(), make_env(**{**ALL_PRESENT, "liger_kernel": "0.6.4"}), ImportError,
           "liger-kernel >= 0.8.5", "0.6.4 is installed")
    expect("flashinfer_cutlass", qwen3(), make_env(**{**ALL_PRESENT, "flashinfer_python": "0.5.3"}), ImportError,
           "flashinfer-python >= 0.6.13", "0.5.3 is installed")
    expect("triton_kernels", qwen3(), make_env(**ALL_PRESENT, triton="3.4.0"), ImportError, "triton >= 3.6")


def test_flashinfer_refused_beside_a_cutlass_dsl_its_import_rejects() -> None:
    # flashinfer-python 0.6.13 failed to import beside nvidia-cutlass-dsl 4.4.2 on the H200 machine
    expect("flashinfer_cutlass", qwen3(), make_env(**{**ALL_PRESENT, "nvidia_cutlass_dsl": "4.4.2"}), ImportError,
           "nvidia-cutlass-dsl >= 4.5.0", "4.4.2")
    assert evaluate(get_registry().get("flashinfer_cutlass"), qwen3(),
                    make_env(**{**ALL_PRESENT, "nvidia_cutlass_dsl": "4.5.0"})).ok  # fmt: skip


def test_triton_kernels_found_as_a_copied_tree_without_metadata(fakes: Path) -> None:
    from selector.plugins.triton_kernels import locate

    assert locate() == str(fakes / "triton_kernels")
    env = make_env(**{k: v for k, v in ALL_PRESENT.items() if k != "triton_kernels"})
    assert evaluate(get_registry().get("triton_kernels"), qwen3(), env).ok


@pytest.mark.parametrize(("backend", "gpu", "phrase"), [
    ("liger", T4, "compute capability >= 8.0"),
    ("flashinfer_cutlass", A100, "compute capability >= 9.0"),
    ("triton_kernels", A100, "compute capability >= 9.0"),
])  # fmt: skip
def test_wrong_compute_capability(backend: str, gpu: str, phrase: str) -> None:
    expect(backend, qwen3(), make_env(gpu, **ALL_PRESENT), ImportError, phrase)


def test_flashinfer_needs_nvcc_and_liger_and_triton_kernels_do_not() -> None:
    env = make_env(nvcc=None, **ALL_PRESENT)
    expect("flashinfer_cutlass", qwen3(), env, ImportError, "nvcc >= 12.3 on Hopper", "searched")
    expect("flashinfer_cutlass", qwen3(), make_env(nvcc="12.2", **ALL_PRESENT), ImportError, "nvcc 12.2 was found")
    for name in ("liger", "triton_kernels"):
        assert evaluate(get_registry().get(name), qwen3(), env).ok


def test_flashinfer_needs_aligned_sizes() -> None:
    expect("flashinfer_cutlass", qwen3(intermediate_size=772), make_env(**ALL_PRESENT), ValueError,
           "multiples of 8", "intermediate size 772")


@pytest.mark.parametrize("backend", BACKENDS)
def test_not_inside_a_graph_nor_under_compile(backend: str) -> None:
    env = make_env(**ALL_PRESENT)
    expect(backend, qwen3(cuda_graph=True), env, ValueError, "CUDA graph")
    expect(backend, qwen3(compile=True, compile_mode="default"), env, ValueError, "torch.compile")


def test_auto_skips_them_inside_a_graph_and_ranks_them_outside() -> None:
    env = make_env(**ALL_PRESENT)
    registry = get_registry()
    outside = rank(qwen3(num_tokens=4096), env, registry)
    names = [c.name for c in outside.candidates]
    assert set(BACKENDS) <= set(names), outside.excluded
    inside = rank(qwen3(num_tokens=8, cuda_graph=True), env, registry)
    for name in BACKENDS:
        assert name not in [c.name for c in inside.candidates]
        assert inside.excluded[name].status is Status.UNSUPPORTED_CONFIG


def test_first_call_costs_are_counted_until_the_shape_ran() -> None:
    import selector.plugins.flashinfer_cutlass as fic
    import selector.plugins.liger as lig
    import selector.plugins.triton_kernels as tkp

    env, prob = make_env(**ALL_PRESENT), qwen3(num_tokens=64)
    cold = {name: get_registry().get(name).pending_cost(prob, env) for name in BACKENDS}
    assert cold == {"liger": lig.AUTOTUNE_SECONDS, "flashinfer_cutlass": fic.JIT_SECONDS,
                    "triton_kernels": tkp.JIT_SECONDS}  # fmt: skip
    from selector.plugins.adapter import shape_key

    lig.TUNED.record(shape_key(prob, lig.SHAPE))
    fic.BUILT.record("90")
    tkp.COMPILED.record(shape_key(prob, tkp.SHAPE))
    assert all(get_registry().get(name).pending_cost(prob, env) == 0.0 for name in BACKENDS)
    assert get_registry().get("liger").estimate(prob, env) < get_registry().get("liger").estimate(
        replace(prob, intermediate_size=1024), env)


def test_declared_layouts() -> None:
    reqs = {name: get_registry().get(name).requirements for name in BACKENDS}
    assert reqs["liger"].activations == frozenset({"silu"}) and not reqs["liger"].bias
    assert reqs["flashinfer_cutlass"].activations == frozenset({"silu"})
    assert reqs["triton_kernels"].activations is None and reqs["triton_kernels"].bias
    assert not any(r.post_expert_norm for r in reqs.values())
    assert reqs["triton_kernels"].custom_gate and not (reqs["liger"].custom_gate or reqs["flashinfer_cutlass"].custom_gate)
    env = make_env(**ALL_PRESENT)
    expect("liger", qwen3(activation="gelu"), env, ValueError, "activation 'gelu'")
    expect("flashinfer_cutlass", qwen3(has_bias=True), env, ValueError, "expert biases")
    expect("triton_kernels", qwen3(post_expert_norm=True), env, ValueError, "post-expert norm")
    assert evaluate(get_registry().get("triton_kernels"),
                    qwen3(has_bias=True, is_transposed=True, interleaved=True), env).ok  # fmt: skip
    gpt_oss = replace(preset("gpt-oss-20b"), device="cuda")  # GPT-OSS's clamped SwiGLU: only triton_kernels
    assert evaluate(get_registry().get("triton_kernels"), gpt_oss, env).ok
    expect("liger", gpt_oss, env, ValueError, "clamped_swiglu")


# --- adapters against the fakes, on the CPU ------------------------------------------------------------------------

LAYOUTS = {
    "liger": [Layout(), Layout(transposed=True), Layout(interleaved=True), Layout(expert_parallel=True),
              Layout(transposed=True, interleaved=True)],
    "flashinfer_cutlass": [Layout(), Layout(transposed=True), Layout(interleaved=True),
                           Layout(expert_parallel=True), Layout(transposed=True, interleaved=True)],
    "triton_kernels": [Layout(), Layout(transposed=True), Layout(interleaved=True), Layout(expert_parallel=True),
                       Layout(bias=True), Layout(gated=False), Layout(bias=True, transposed=True, interleaved=True),
                       Layout(custom_gate=True, bias=True, transposed=True, interleaved=True)],
}
CASES = [(name, layout) for name, layouts in LAYOUTS.items() for layout in layouts]


def _forward(name: str):
    return get_registry().get(name).load()


@pytest.mark.parametrize(("backend", "layout"), CASES, ids=[f"{b}-{layout}" for b, layout in CASES])
def test_adapter_matches_the_float64_reference_on_the_fake(fakes: Path, backend: str, layout: Layout) -> None:
    torch.manual_seed(0)
    module = make_experts(6, 32, 16, layout, dtype=torch.float32, seed=1)
    x = torch.randn(9, 32)
    index, weights = random_routing(9, 6, 2, sentinel=layout.expert_parallel)
    out = _forward(backend)(module, x, index, weights)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert relative_error(out, reference_experts(module, x, index, weights)) < 1e-5


def test_gelu_experts_on_triton_kernels(fakes: Path) -> None:
    module = make_experts(4, 16, 8, Layout(), act=torch.nn.GELU(), seed=2)
    x = torch.randn(5, 16)
    index, weights = random_routing(5, 4, 2)
    out = _forward("triton_kernels")(module, x, index, weights)
    assert relative_error(out, reference_experts(module, x, index, weights)) < 1e-5


@pytest.mark.parametrize("backend", ["liger", "flashinfer_cutlass"])
def test_fused_kernels_refuse_what_they_cannot_run(fakes: Path, backend: str) -> None:
    x = torch.randn(3, 16)
    index, weights = random_routing(3, 4, 2)
    for module, phrase in ((make_experts(4, 16, 8, Layout(), act=torch.nn.GELU()), "activation 'gelu'"),
                           (make_experts(4, 16, 8, Layout(bias=True)), "expert biases"),
                           (make_experts(4, 16, 8, Layout(custom_gate=True, interleaved=True)), "custom gate")):
        with pytest.raises(ValueError, match=phrase):
            _forward(backend)(module, x, index, weights)


def test_liger_takes_the_standard_layout_without_a_copy(fakes: Path) -> None:
    calls = importlib.import_module("liger_kernel.ops.fused_moe").LigerFusedMoEFunction.CALLS
    module = make_experts(4, 16, 8, Layout(), seed=3)
    index, weights = random_routing(3, 4, 2)
    with torch.no_grad():
        _forward("liger")(module, torch.randn(3, 16), index, weights)
    assert calls[-1] == (module.gate_up_proj.data_ptr(), module.down_proj.data_ptr())


@pytest.mark.parametrize(("backend", "layout"), [("liger", Layout(transposed=True)),
                                                 ("flashinfer_cutlass", Layout())])  # fmt: skip
def test_weight_copies_are_made_once_per_set_of_weights(fakes: Path, backend: str, layout: Layout) -> None:
    """The copy is made at prepare and reused by every run of the plan (the dispatch core keeps the plan, and
    prepares again when the parameters change in place: its key covers their in-place version)."""
    from selector.problem import problem_from_module

    module = make_experts(4, 16, 8, layout, seed=4)
    x = torch.randn(3, 16)
    index, weights = random_routing(3, 4, 2)
    prepare = get_registry().get(backend).prepare
    plan = prepare(module, problem_from_module(module, top_k=2))
    first = plan.weights[0]
    assert first.data_ptr() not in (module.gate_up_proj.data_ptr(), module.down_proj.data_ptr())  # a copy
    with torch.no_grad():
        plan.run(x, index, weights)
        assert plan.weights[0] is first  # held by the plan, not rebuilt per call
        module.gate_up_proj.mul_(2.0)  # the parameters changed: a new plan copies them again
        again = prepare(module, problem_from_module(module, top_k=2))
        out = again.run(x, index, weights)
    assert again.weights[0] is not first
    assert relative_error(out, reference_experts(module, x, index, weights)) < 1e-5


def test_liger_keeps_gradients_of_copied_weights(fakes: Path) -> None:
    module = make_experts(4, 16, 8, Layout(transposed=True), seed=5)
    x = torch.randn(3, 16)
    index, weights = random_routing(3, 4, 2)
    _forward("liger")(module, x, index, weights).sum().backward()
    assert module.gate_up_proj.grad is not None and module.gate_up_proj.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_routing_guard_routes_bad_ids_away_from_the_kernel(fakes: Path, backend: str) -> None:
    """An id outside [0, E) reaches no kernel (the fakes assert in-range ids): its token turns NaN, the others stay."""
    from selector import guard

    module = make_experts(4, 16, 8, Layout(), seed=6)
    x = torch.randn(4, 16)
    index, weights = random_routing(4, 4, 2)
    bad = index.clone()
    bad[1, 0] = 9
    out = _forward(backend)(module, x, bad, weights)
    assert torch.isnan(out[1]).all()
    keep = [0, 2, 3]
    ref = reference_experts(module, x[keep], index[keep], weights[keep])
    assert relative_error(out[keep], ref) < 1e-5
    guard.clear()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens(fakes: Path, backend: str) -> None:
    module = make_experts(4, 16, 8, Layout(), seed=7)
    out = _forward(backend)(module, torch.randn(0, 16), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 16)


@pytest.mark.parametrize(("backend", "phrases"), [
    ("liger", ("liger-kernel >= 0.8.5", "LigerFusedMoEFunction", "docs/offline-kernels.md#liger-kernel")),
    ("flashinfer_cutlass", ("flashinfer-python >= 0.6.13", "cutlass_fused_moe", "offline-kernels.md")),
    ("triton_kernels", ("triton_kernels", "matmul_ogs", "offline-kernels.md#openai-triton_kernels")),
])  # fmt: skip
def test_forward_without_the_library_is_an_import_error(backend: str, phrases: tuple[str, ...]) -> None:
    module = make_experts(4, 16, 8, Layout(), seed=8)
    index, weights = random_routing(2, 4, 2)
    with pytest.raises(ImportError) as caught:
        _forward(backend)(module, torch.randn(2, 16), index, weights)
    for phrase in phrases:
        assert phrase in str(caught.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_check_passes_on_the_fakes(fakes: Path, backend: str) -> None:
    """selector.testing's contract check over every layout the backend declares, with the CPU admitted (the
    fakes run there) and everything else as declared."""
    spec = get_registry().get(backend)
    on_cpu = replace(spec, requirements=replace(spec.requirements, devices=frozenset({"cpu", "cuda"}),
                                                dtypes=spec.requirements.dtypes | {"float32"}))  # fmt: skip
    set_environment(make_env())
    report = check_backend_contract(on_cpu, device="cpu", token_counts=(0, 1, 5))
    assert report.ok, report.describe()
    declared = ["plain"] + [flag for flag in ("non_gated", "bias", "transposed", "interleaved", "expert_parallel")
                            if getattr(spec.requirements, flag)]  # fmt: skip
    assert all(report.results[name] == "ok" for name in declared), report.describe()
    assert report.results["post_expert_norm"] == "not declared"


# --- the real kernels on the GPU ---------------------------------------------------------------------------------

LIBRARIES = {"liger": "liger_kernel.ops.fused_moe", "flashinfer_cutlass": "flashinfer.fused_moe",
             "triton_kernels": "triton_kernels.matmul_ogs"}  # fmt: skip
GPU_TOL = 1e-2


def _needs_library(backend: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        importlib.import_module(LIBRARIES[backend])
    except Exception as exc:  # noqa: BLE001 - any failure to import means the real kernel is not here
        pytest.skip(f"{LIBRARIES[backend]} not importable: {type(exc).__name__}: {exc}")


def _run_requested(backend: str, module: torch.nn.Module, x: torch.Tensor, index: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    selector.set_experts_implementation(module, backend)
    with torch.no_grad():
        out = module(x, index, weights)
    assert last_backend(module) == backend
    return out


GPU_CASES = [(name, layout) for name, layouts in LAYOUTS.items() for layout in layouts]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(("backend", "layout"), GPU_CASES, ids=[f"{b}-{layout}" for b, layout in GPU_CASES])
def test_real_kernel_small_shape_matches_reference(backend: str, layout: Layout) -> None:
    _needs_library(backend)
    module = make_experts(8, 256, 128, layout, dtype=torch.bfloat16, device="cuda", seed=11)
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    index, weights = random_routing(33, 8, 2, device="cuda", sentinel=layout.expert_parallel)
    out = _run_requested(backend, module, x, index, weights)
    assert relative_error(out, reference_experts(module, x, index, weights)) < GPU_TOL


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_kernel_qwen3_30b_shape_at_64_tokens(backend: str) -> None:
    _needs_library(backend)
    from selector.bench import make_layer, random_routing as bench_routing, reference
    from selector.presets import preset

    problem = replace(preset("qwen3-30b-a3b"), dtype="bfloat16", device="cuda")
    layer = make_layer(torch, problem, torch.bfloat16, torch.device("cuda"), seed=0)
    index, weights = bench_routing(torch, 64, problem.num_experts, problem.top_k, torch.device("cuda"), seed=1)
    x = torch.randn(64, problem.hidden_size, device="cuda", dtype=torch.bfloat16)
    out = _run_requested(backend, layer, x, index, weights)
    rows = 16
    assert relative_error(out[:rows], reference(torch, layer, x, index, weights, rows)) < GPU_TOL


@pytest.mark.gpu
@pytest.mark.sm90
def test_real_triton_kernels_gpt_oss_like_layout() -> None:
    """Transposed, interleaved gate/up with biases (GPT-OSS's storage), the default SiLU gate."""
    _needs_library("triton_kernels")
    layout = Layout(bias=True, transposed=True, interleaved=True)
    module = make_experts(32, 2880 // 8, 2880 // 8, layout, dtype=torch.bfloat16, device="cuda", seed=12)
    x = torch.randn(64, 360, device="cuda", dtype=torch.bfloat16)
    index, weights = random_routing(64, 32, 4, device="cuda")
    out = _run_requested("triton_kernels", module, x, index, weights)
    assert relative_error(out, reference_experts(module, x, index, weights)) < GPU_TOL
