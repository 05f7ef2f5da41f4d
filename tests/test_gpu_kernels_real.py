"""Real kernels on a GPU, checked against the float64 reference:

- SonicMoE and DeepGEMM as selector's `sonicmoe` / `deepgemm` backends load them: through `kernels`' local-kernel
  path (`LOCAL_KERNELS`, `HF_HUB_OFFLINE=1`), from a kernel directory wrapping the installed package (how a node
  without the Hub runs them: docs/offline-kernels.md). Skipped unless CUDA and the package are there;
- Transformers' own FP8 experts on the quantised layer's own tensors, with the `finegrained-fp8` hub kernel's
  package importable (its source on `sys.path`);
- `selector bench --formats` end to end on one shape: every path's error within the GPU bound, quantised floors at
  the e4m3 rate.

The kernel directories and the Transformers FP8 wiring are checked on the CPU too, with fake packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()
FAKES = Path(__file__).parent / "fake_kernels"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# fp8 e4m3 intermediates land on a neighbouring code for a few values: 1.5-2e-2 against float64 on the H200
QUANT_GPU_TOL = 2.5e-2
DENSE_GPU_TOL = 1e-2

SONIC_SHIM = '''"""Local kernel for `kernels`: the installed sonic-moe package's functional API, as the hub kernel exposes it."""
import sonicmoe as _package
from sonicmoe import enums
from sonicmoe.functional import moe_general_routing_inputs

__version__ = getattr(_package, "__version__", "unknown")
__all__ = ["enums", "moe_general_routing_inputs"]
'''


def sonicmoe_kernel_dir(dest: Path, variant: str = "torch-cuda") -> Path:
    """<dest>/build/<variant>/{metadata.json,__init__.py} re-exporting the importable `sonicmoe`; returns dest."""
    from selector.hub import write_local_kernel

    target = write_local_kernel(dest, "sonic-moe", "Apache-2.0", variant)
    (target / "__init__.py").write_text(SONIC_SHIM)
    return dest


def deepgemm_kernel_dir(package: Path, dest: Path, variant: str = "torch-cuda") -> Path:
    """<dest>/build/<variant>/ = the `deep_gemm` package's files (linked) + metadata.json; returns dest."""
    from selector.hub import write_local_kernel

    target = write_local_kernel(dest, "deep-gemm", "MIT", variant)
    for entry in package.iterdir():
        link = target / entry.name
        if not link.exists():
            link.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return dest


def install_finegrained_fp8(kernel: ModuleType) -> ModuleType:
    """Make Transformers' FP8 experts use `kernel` (the `finegrained_fp8` package), as its hub loader would."""
    from transformers.integrations import finegrained_fp8 as hf

    hf._FINEGRAINED_FP8 = hf.FineGrainedFP8(
        matmul=kernel.matmul_2d, batched_matmul=kernel.matmul_batched, grouped_matmul=kernel.matmul_grouped
    )
    return hf


def hf_fp8_experts(hf: ModuleType, layer: Any, h: int, i: int) -> Any:
    """A Transformers FP8Experts module holding the quantised layer's tensors (built small, then given them)."""
    config = SimpleNamespace(hidden_size=128, num_experts=1, moe_intermediate_size=128, hidden_act="silu")
    mod = hf.FP8Experts(config, block_size=(128, 128))
    mod.num_experts, mod.hidden_dim, mod.intermediate_dim = layer.num_experts, h, i
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        setattr(mod, name, torch.nn.Parameter(getattr(layer, name).data, requires_grad=False))
    if not hasattr(mod, "_is_expert_parallel"):  # newer Transformers read it in these functions (their loader sets it)
        mod._is_expert_parallel = False
    return mod


def relative_error(out: Any, ref: Any) -> float:
    return float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm().clamp_min(1e-30))


@pytest.fixture
def local_kernel(monkeypatch: pytest.MonkeyPatch):
    """Point `kernels` at a local kernel directory for one repo id, offline; selector's kernel and selection caches
    are cleared before and after."""
    from selector import hub
    from selector.dispatch import reset_selection_caches

    def use(repo: str, directory: Path) -> None:
        monkeypatch.setenv("LOCAL_KERNELS", f"{repo}={directory}")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        hub.forget_loaded()
        reset_selection_caches()

    yield use
    hub.forget_loaded()
    reset_selection_caches()


def _layer(preset_name: str, weight_format: str | None = None, scale_format: str | None = None) -> Any:
    from dataclasses import replace

    from selector import quant
    from selector.bench import make_layer
    from selector.presets import preset

    problem = replace(preset(preset_name), dtype="bfloat16", device="cuda")
    layer = make_layer(torch, problem, torch.bfloat16, torch.device("cuda"), seed=0)
    if weight_format:
        quant.quantize_experts(layer, weight_format, scale_format)
    return problem, layer


def _check_backend(backend: str, preset_name: str, tokens: int, weight_format: str | None = None,
                   scale_format: str | None = None) -> None:  # fmt: skip
    """The layer through selector's model API with `backend` requested: it ran, and matches the float64 reference
    (first 16 tokens) as closely as grouped_mm does on the same inputs."""
    import selector
    from selector import quant
    from selector.bench import random_routing, reference
    from selector.dispatch import last_backend

    problem, layer = _layer(preset_name, weight_format, scale_format)
    index, weights = random_routing(torch, tokens, problem.num_experts, problem.top_k, torch.device("cuda"), seed=1)
    x = torch.randn(tokens, problem.hidden_size, device="cuda", dtype=torch.bfloat16)
    selector.set_experts_implementation(layer, backend)
    with torch.no_grad():
        out = layer(x, index, weights)
        assert last_backend(layer) == backend
        rows = min(tokens, 16)
        ref = reference(torch, layer, x, index, weights, rows)
        selector.set_experts_implementation(layer, "grouped_mm")
        peer = layer(x, index, weights)
    bound = QUANT_GPU_TOL if quant.is_quantised(layer) else DENSE_GPU_TOL
    assert relative_error(out[:rows], ref) < bound
    assert relative_error(peer[:rows], ref) < bound


# --- kernel directories and wiring, on the CPU with fake packages ------------------------------------------------


@pytest.mark.slow
def test_sonicmoe_kernel_dir_loads_through_kernels(tmp_path: Path) -> None:
    """The SonicMoE kernel directory wraps an importable package so that `kernels` loads it; on a fake package."""
    pytest.importorskip("kernels")
    site_dir = tmp_path / "site"
    package = site_dir / "sonicmoe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("FAKE = True\nfrom . import enums\n")
    (package / "functional").mkdir()
    (package / "functional" / "__init__.py").write_text("def moe_general_routing_inputs(*a, **k):\n    return 'fake'\n")
    (package / "enums.py").write_text((FAKES / "sonic-moe" / "build" / "torch-cpu" / "enums.py").read_text())
    code = (
        f"import sys, site, json, pathlib; site.addsitedir({str(site_dir)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_gpu_kernels_real as t, kernels; "
        f"d = t.sonicmoe_kernel_dir(pathlib.Path({str(tmp_path / 'kdir')!r}), variant='torch-cpu'); "
        "m = kernels.get_local_kernel(d); assert m.moe_general_routing_inputs() == 'fake'; "
        "assert m.enums.ActivationType.SWIGLU.value == 'swiglu'; print(json.dumps(sorted(p.name for p in d.rglob('*'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    names = json.loads(done.stdout.strip().splitlines()[-1])
    assert "metadata.json" in names and "__init__.py" in names


def test_deepgemm_kernel_dir_links_the_package(tmp_path: Path) -> None:
    package = tmp_path / "site" / "deep_gemm"
    (package / "include").mkdir(parents=True)
    (package / "__init__.py").write_text("FAKE = True\n")
    directory = deepgemm_kernel_dir(package, tmp_path / "kdir", variant="torch-cpu")
    target = directory / "build" / "torch-cpu"
    assert (target / "metadata.json").is_file()
    assert (target / "__init__.py").resolve() == (package / "__init__.py").resolve()
    assert (target / "include").is_symlink() and (target / "include").resolve() == package / "include"


def test_hf_fp8_wiring_hands_transformers_the_layers_own_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformers' FP8 experts, given a `finegrained_fp8` package and an FP8Experts module holding the quantised
    layer's tensors, read the same storage (no copies) and reproduce the float64 reference. With the FAKE kernel
    (tests/fake_kernels: plain torch, activations quantised as the kernels do) on any device."""
    pytest.importorskip("transformers")
    from transformers.integrations import finegrained_fp8 as hf

    from selector import quant
    from selector.bench import random_routing
    from selector.presets import preset

    if not hasattr(hf, "_FINEGRAINED_FP8"):
        pytest.skip("this Transformers loads its FP8 experts kernel another way")
    monkeypatch.setattr(hf, "_FINEGRAINED_FP8", None)
    monkeypatch.syspath_prepend(str(FAKES / "finegrained-fp8"))
    assert "finegrained_fp8" not in sys.modules
    try:
        import finegrained_fp8 as kernel

        assert install_finegrained_fp8(kernel) is hf and hf._FINEGRAINED_FP8 is not None
        from dataclasses import replace

        from selector.bench import make_layer

        problem = replace(preset("qwen3-30b-a3b"), num_experts=6, hidden_size=256, intermediate_size=128, top_k=2)
        dense = make_layer(torch, problem, torch.bfloat16, "cpu", seed=61)
        layer = quant.quantize_experts(dense, "fp8_block", "float32")
        mod = hf_fp8_experts(hf, layer, 256, 128)
        assert mod.gate_up_proj.data_ptr() == layer.gate_up_proj.data_ptr()
        assert mod.down_proj_scale_inv.data_ptr() == layer.down_proj_scale_inv.data_ptr()
        idx, w = random_routing(torch, 5, 6, 2, "cpu", seed=3)
        x = torch.randn(5, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))  # not the global RNG
        ref = quant.reference_forward(layer, x, idx, w)
        for fn in (hf.fp8_grouped_mm_experts_forward, hf.fp8_batched_mm_experts_forward):
            out = fn(mod, x, idx, w)
            assert out.shape == x.shape and relative_error(out, ref) < 3e-2, fn.__name__  # fp8 activations, bf16 out
    finally:
        sys.modules.pop("finegrained_fp8", None)  # the FAKE: no later import may find it


# --- the real kernels on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_real_sonicmoe_matches_the_reference(tokens: int, tmp_path: Path, local_kernel: Any) -> None:
    """Qwen3-30B-A3B shape, bf16 (the first call of a shape JIT-compiles for 25-144 s)."""
    pytest.importorskip("kernels")
    pytest.importorskip("sonicmoe")
    from selector.plugins import sonicmoe

    local_kernel(str(sonicmoe.KERNEL.repo_id), sonicmoe_kernel_dir(tmp_path / "sonic-moe"))
    _check_backend("sonicmoe", "qwen3-30b-a3b", tokens)


@pytest.mark.gpu
@pytest.mark.sm90
@needs_cuda
@pytest.mark.parametrize(("preset_name", "weight_format", "scale_format", "tokens"), [
    ("qwen3-30b-a3b", None, None, 64),
    ("qwen3-30b-a3b", "fp8_block", "float32", 4096),
    ("qwen3-30b-a3b", "fp8_block", "ue8m0", 64),
    ("qwen3-30b-a3b", "fp8_block", "float32", 1),
])  # fmt: skip
def test_real_deepgemm_matches_the_reference(preset_name: str, weight_format: str | None, scale_format: str | None,
                                             tokens: int, tmp_path: Path, local_kernel: Any) -> None:  # fmt: skip
    """DeepGEMM's JIT calls the node's nvcc (found as selector's toolkit probe reports)."""
    pytest.importorskip("kernels")
    deep_gemm = pytest.importorskip("deep_gemm")
    from selector.plugins import deepgemm

    os.environ.setdefault("DG_JIT_CACHE_DIR", str(tmp_path / "jit-cache"))
    package = Path(deep_gemm.__file__).resolve().parent
    local_kernel(str(deepgemm.KERNEL.repo_id), deepgemm_kernel_dir(package, tmp_path / "deep-gemm"))
    _check_backend("deepgemm", preset_name, tokens, weight_format, scale_format)


@pytest.mark.gpu
@needs_cuda
def test_real_hf_fp8_experts_match_the_reference() -> None:
    """Transformers' FP8 experts with the real `finegrained_fp8` kernel on selector's quantised tensors."""
    pytest.importorskip("transformers")
    kernel = pytest.importorskip("finegrained_fp8")
    from selector import quant
    from selector.bench import random_routing

    hf = install_finegrained_fp8(kernel)
    problem, layer = _layer("qwen3-30b-a3b", "fp8_block", "float32")
    mod = hf_fp8_experts(hf, layer, problem.hidden_size, problem.intermediate_size)
    idx, w = random_routing(torch, 64, problem.num_experts, problem.top_k, torch.device("cuda"), seed=2)
    x = torch.randn(64, problem.hidden_size, device="cuda", dtype=torch.bfloat16)
    ref = quant.reference_forward(layer, x[:8], idx[:8], w[:8], device=x.device)
    for fn in (hf.fp8_grouped_mm_experts_forward, hf.fp8_batched_mm_experts_forward):
        out = fn(mod, x, idx, w)
        assert relative_error(out[:8], ref) < QUANT_GPU_TOL, fn.__name__


@pytest.mark.gpu
@needs_cuda
def test_bench_formats_end_to_end(tmp_path: Path) -> None:
    """`selector bench --formats` on one shape: every format timed on each path, every checked cell within the
    GPU bound against float64 (quantised: from the dequantised weights), quantised floors at the e4m3 rate where
    it was measured (never above the bf16-rate floor), and the tables and tuning records written."""
    from selector.bench import BenchOptions, run_bench, write_outputs
    from selector.bench.grid import records_from_bench

    result = run_bench(
        ["qwen3-30b-a3b"],
        [1, 64],
        BenchOptions(
            backends=["triton_fused", "grouped_mm", "batched_mm"],
            modes=["eager", "graph"],
            formats=["dense", "fp8-f32", "fp8-ue8m0", "fp4"],
        ),
    )
    timed = {(c.format, c.backend) for c in result.cells if c.time_s}
    assert {("dense", "grouped_mm"), ("fp8-f32", "triton_fused"), ("fp8-ue8m0", "batched_mm"),
            ("fp4", "triton_fused"), ("fp8-f32", "auto")} <= timed, sorted(timed)  # fmt: skip
    checked = [c for c in result.cells if c.rel_error is not None]
    assert checked and all(c.rel_error < DENSE_GPU_TOL for c in checked), [
        (c.format, c.backend, c.mode, c.tokens, c.rel_error) for c in checked if c.rel_error >= DENSE_GPU_TOL]
    if "fp8_flops" in result.ceilings:
        assert result.ceilings["fp8_flops"] > result.ceilings["bf16_flops"]
        for fmt in ("fp8-f32", "fp4"):
            quantised = next(c for c in result.cells if c.format == fmt and c.floor_s and c.tokens == 64)
            dense = next(c for c in result.cells if c.format == "dense" and c.floor_s and c.tokens == 64)
            assert quantised.floor_s < dense.floor_s  # fewer bytes, a faster matmul rate
    paths = write_outputs(result, tmp_path)
    assert "| qwen3-30b-a3b | 1 | eager | fp8-f32 |" in (tmp_path / "bench.md").read_text()
    assert "Quantised against dense" in (tmp_path / "bench.md").read_text() and tmp_path / "bench.json" in paths
    assert records_from_bench(result)  # dense cells become tuning records
