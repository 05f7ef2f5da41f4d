"""The routing guard on the hub-kernel backends: Mega MoE (CPU, against the FAKE DeepGEMM kernel), SonicMoE and
DeepGEMM (GPU, the real packages; skipped without them).

Their guard puts a bad slot (an id outside [0, E) other than the expert-parallel sentinel, a NaN / infinite
weight) on expert 0 with weight NaN before the kernel: the bad tokens' rows turn NaN, every other token's row is
what the run with the bad slots on expert 0 gives (bit for bit where the kernel is deterministic: two runs of that
reference agree), and the fault is raised as ExpertsInputError at the next call or at `selector.check()`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from experts_fixtures import make_experts, random_routing

import selector
from selector import hub
from selector.errors import ExpertsInputError

FAKES = Path(__file__).parent / "fake_kernels"
CUDA = torch.cuda.is_available()
INT32_MAX = (1 << 31) - 1
BAD_SLOTS = ((1, 1), (4, 0))


@pytest.fixture(autouse=True)
def _level_first(monkeypatch: pytest.MonkeyPatch):
    """Host value checks on the first call per shape only, so later calls reach the device guard."""
    monkeypatch.setenv("SELECTOR_VALIDATE", "first")


@pytest.fixture
def isolated_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """No real hub cache, no LOCAL_KERNELS from the shell; loaded kernels forgotten before and after."""
    import selector.plugins.deepgemm as deepgemm
    import selector.plugins.sonicmoe as sonic
    from selector.dispatch import reset_selection_caches

    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)

    def forget() -> None:
        reset_selection_caches()
        hub.forget_loaded()
        sonic.forget_compiled()
        deepgemm.forget_compiled()

    forget()
    yield monkeypatch
    forget()


def bad_cases(num_experts: int) -> list[tuple[str, float | int]]:
    return [("id_E", num_experts), ("id_E_plus_1000", num_experts + 1000), ("id_minus_1", -1),
            ("id_int32_max", INT32_MAX), ("weight_nan", float("nan")), ("weight_inf", float("inf"))]  # fmt: skip


def make_bad(ids: torch.Tensor, w: torch.Tensor, value: float | int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, w = ids.clone(), w.clone()
    for t, j in BAD_SLOTS:
        if isinstance(value, float):
            w[t, j] = value
        else:
            ids[t, j] = value
    return ids, w


def on_expert_zero(ids: torch.Tensor, w: torch.Tensor, value: float | int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = ids.clone()
    if not isinstance(value, float):
        for t, j in BAD_SLOTS:
            ids[t, j] = 0
    return ids, w


def expect_guarded(run, x, ids, w, value, clean, tol: float) -> None:  # noqa: ANN001
    """One later call with bad slots: NaN rows for the bad tokens only, the rest as the expert-0 reference,
    then the fault raised by `selector.check()`."""
    first, second = run(x, *on_expert_zero(ids, w, value)), run(x, *on_expert_zero(ids, w, value))
    out = run(x, *make_bad(ids, w, value))
    poisoned = torch.isnan(out).all(dim=1).cpu()
    assert poisoned.tolist() == [t in {s for s, _ in BAD_SLOTS} for t in range(x.shape[0])]
    if torch.equal(first, second):  # a deterministic kernel: the other rows bit for bit
        assert torch.equal(out[~poisoned], first[~poisoned])
    torch.testing.assert_close(out[~poisoned].float(), clean[~poisoned].float(), atol=tol, rtol=tol)
    kind = "NaN or infinite routing weight" if isinstance(value, float) else "expert id(s) outside"
    with pytest.raises(ExpertsInputError, match=re.escape(f"{len(BAD_SLOTS)} {kind}")):
        selector.check()


# ---- Mega MoE, FAKE kernel on the CPU -----------------------------------------------------------------------


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    from selector.plugins.deepgemm_megamoe.forward import destroy_buffers

    destroy_buffers()
    dist.destroy_process_group()


def test_megamoe_guard_reports_bad_slots_the_kernel_would_skip_or_misread(isolated_hub, world_of_one):
    """-1 is the kernel's own skip value and E its sentinel on a world of one: without the guard both were
    silently dropped (a wrong row), ids past E read as another rank's experts."""
    from selector.plugins import deepgemm
    from selector.plugins.deepgemm_megamoe.forward import megamoe_experts_forward

    from selector.quant import quantize_experts

    isolated_hub.setenv("LOCAL_KERNELS", f"{deepgemm.KERNEL.repo_id}={FAKES / 'deep-gemm'}")
    module = quantize_experts(make_experts(4, 256, 256, dtype=torch.bfloat16, seed=1), "fp4")
    x = torch.randn(6, 256).bfloat16()
    ids, w = random_routing(6, 4, 2)
    with torch.no_grad():
        clean = megamoe_experts_forward(module, x, ids, w)
        for _, value in bad_cases(4):
            expect_guarded(lambda *a: megamoe_experts_forward(module, *a), x, ids, w, value, clean, 0.0)


# ---- SonicMoE and DeepGEMM, the real kernels on a GPU ---------------------------------------------------------


def _hub_layer(backend: str):  # noqa: ANN202
    """Qwen3-30B-A3B experts in bf16 on the GPU, `backend` requested, inference."""
    from dataclasses import replace

    from selector.bench import make_layer
    from selector.presets import preset

    problem = replace(preset("qwen3-30b-a3b"), dtype="bfloat16", device="cuda")
    layer = make_layer(torch, problem, torch.bfloat16, torch.device("cuda"), seed=0).requires_grad_(False)
    selector.set_experts_implementation(layer, backend)
    return problem, layer


def _check_hub_backend(backend: str) -> None:
    from selector.dispatch import last_backend

    problem, layer = _hub_layer(backend)
    tokens = 64
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, problem.hidden_size, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(problem.num_experts, generator=g)[: problem.top_k] for _ in range(tokens)])
    ids = ids.cuda()
    w = torch.rand(tokens, problem.top_k, generator=g).to("cuda", torch.bfloat16)
    with pytest.raises(ExpertsInputError, match="expert ids must lie in"):
        layer(x, *make_bad(ids, w, -1))  # the first call of the shape: the host check
    clean = layer(x, ids, w)
    assert last_backend(layer) == backend
    for index, (_, value) in enumerate(bad_cases(problem.num_experts)):
        if index % 2:  # the next call through selector raises too
            out = layer(x, *make_bad(ids, w, value))
            assert torch.isnan(out).all(dim=1).sum().item() == len(BAD_SLOTS)
            torch.cuda.synchronize()  # the kernel's word in pinned host memory is then visible to the host
            with pytest.raises(ExpertsInputError):
                layer(x, ids, w)
        else:
            expect_guarded(layer, x, ids, w, value, clean, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_real_sonicmoe_guard(isolated_hub, tmp_path: Path) -> None:
    pytest.importorskip("kernels")
    pytest.importorskip("sonicmoe")
    from test_gpu_kernels_real import sonicmoe_kernel_dir

    from selector.plugins import sonicmoe

    isolated_hub.setenv("LOCAL_KERNELS", f"{sonicmoe.KERNEL.repo_id}={sonicmoe_kernel_dir(tmp_path / 'sonic-moe')}")
    isolated_hub.setenv("HF_HUB_OFFLINE", "1")
    _check_hub_backend("sonicmoe")


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_real_deepgemm_guard(isolated_hub, tmp_path: Path) -> None:
    pytest.importorskip("kernels")
    deep_gemm = pytest.importorskip("deep_gemm")
    from test_gpu_kernels_real import deepgemm_kernel_dir

    from selector.plugins import deepgemm

    os.environ.setdefault("DG_JIT_CACHE_DIR", str(tmp_path / "jit-cache"))
    package = Path(deep_gemm.__file__).resolve().parent
    directory = deepgemm_kernel_dir(package, tmp_path / "deep-gemm")
    isolated_hub.setenv("LOCAL_KERNELS", f"{deepgemm.KERNEL.repo_id}={directory}")
    isolated_hub.setenv("HF_HUB_OFFLINE", "1")
    _check_hub_backend("deepgemm")
