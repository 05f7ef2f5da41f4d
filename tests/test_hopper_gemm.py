"""The persistent warp-specialised Hopper GEMM (plugins/triton_fused/hopper_gemm.py, Gluon) and how the fused
layer takes it: the PERSISTENT tile-table flag, where the kernel applies, the fall-back to the Triton kernel when
it does not compile, an offline sm_90 compile with the installed Triton, and on an sm_90 GPU the float64 reference.

On a CPU nothing here runs the Gluon kernel (Gluon has no interpreter): the fall-back test stands a fake kernel in
its place, and the wiring test runs the Triton kernel through the interpreter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from selector.plugins.triton_fused import configs as C
from selector.plugins.triton_fused import hopper_gemm as HG
from selector.plugins.triton_fused import kernels as K
from test_triton_fused_kernels import make_case, reference

CUDA = torch.cuda.is_available()
SM90 = CUDA and torch.cuda.get_device_capability()[0] == 9
PERSISTENT = {"BLOCK_M": 128, "PERSISTENT": 1}


# --------------------------------------------------------------------------------------------------------------
# the flag and where it applies
# --------------------------------------------------------------------------------------------------------------


def test_persistent_flag_roundtrips_and_needs_blocks_of_128_rows():
    full = C.normalize(PERSISTENT)
    assert full["PERSISTENT"] == 1 and C.normalize({"BLOCK_M": 64})["PERSISTENT"] == 0
    assert C.decode_config(C.encode_config(PERSISTENT)) == full
    for bad in ({"BLOCK_M": 64, "PERSISTENT": 1}, {"BLOCK_M": 128, "PERSISTENT": 2}):
        with pytest.raises(ValueError, match="PERSISTENT"):
            C.normalize(bad)


def _on(capability, monkeypatch, dtype=torch.bfloat16):
    """A stand-in for hidden states on a CUDA device of this compute capability (the check reads dtype and
    device only)."""
    monkeypatch.setattr(K.torch.cuda, "get_device_capability", lambda device=None: capability)
    return types.SimpleNamespace(dtype=dtype, device=torch.device("cuda", 0))


@pytest.mark.skipif(not HG.AVAILABLE, reason="this Triton has no Gluon Hopper API")
def test_persistent_runs_only_where_asked_on_sm90_with_16_bit_inputs(monkeypatch):
    cfg = C.normalize(PERSISTENT)

    def fits(hidden, **kw):
        return K.persistent_fits(hidden, cfg, **{"gated": True, "interleaved": False, "gate": 0, "tma": True, **kw})

    assert fits(_on((9, 0), monkeypatch))
    assert fits(_on((9, 0), monkeypatch, torch.float16))
    assert fits(_on((9, 0), monkeypatch), gated=False, interleaved=True)  # nothing interleaved without a gate
    declined = {
        "not asked": K.persistent_fits(_on((9, 0), monkeypatch), C.normalize({"BLOCK_M": 128}), gated=True,
                                       interleaved=False, gate=0, tma=True),  # fmt: skip
        "Blackwell (no wgmma)": fits(_on((10, 0), monkeypatch)),
        "Ampere": fits(_on((8, 0), monkeypatch)),
        "fp32": fits(_on((9, 0), monkeypatch, torch.float32)),
        "weights not through TMA": fits(_on((9, 0), monkeypatch), tma=False),
        "interleaved gate and up": fits(_on((9, 0), monkeypatch), interleaved=True),
        "the clamped SwiGLU": fits(_on((9, 0), monkeypatch), gate=1),
        "a CPU tensor": fits(torch.empty(2, 2, dtype=torch.bfloat16)),
    }
    assert not any(declined.values()), [name for name, v in declined.items() if v]


@pytest.mark.parametrize("E,H,I,k,T,whole_blocks_fit", [
    (128, 2048, 768, 8, 4096, False),  # 128 experts: padded to whole blocks, the copies are 1.5x the pairs
    (128, 2048, 768, 8, 16384, True),
    (60, 2048, 1408, 4, 4096, True),
    (60, 2048, 1408, 4, 16384, True),
])  # fmt: skip
def test_the_copies_pad_experts_to_half_blocks_which_keeps_the_grid_within_the_bound(E, H, I, k, T,
                                                                                      whole_blocks_fit):  # fmt: skip
    assert K.x_copy_fits(T, k, H, I, HG.compact_rows(T * k, E))
    assert K.x_copy_fits(T, k, H, I, K.max_blocks_for(T * k, E, 128) * 128) is whole_blocks_fit
    assert HG.compact_rows(T * k, E) == T * k + E * (HG.ROW_GRAIN - 1) and HG.ROW_GRAIN == C.PERSISTENT_BLOCK_M // 2
    assert not K.x_copy_fits(16, 1, 64, 32, HG.compact_rows(16, 16)), "16 experts' padding over 16 pairs"


def test_tiles_hold_a_128_by_128_accumulator_per_consumer():
    gate_up, down, up_only = HG.tiles("gate_up", True), HG.tiles("down", False), HG.tiles("gate_up", False)
    assert 2 * gate_up["BLOCK_N"] == down["BLOCK_N"] == up_only["BLOCK_N"] == 128
    assert all(t["BLOCK_K"] * 2 <= 128 for t in (gate_up, down))  # one 128-byte swizzled TMA box along K


# --------------------------------------------------------------------------------------------------------------
# a Triton whose Gluon differs: the layer runs the Triton kernel
# --------------------------------------------------------------------------------------------------------------


class _FakeKernel:
    """Stands in for the Gluon kernel: counts launches, raises where `broken(constexprs)` says so."""

    def __init__(self):
        self.calls = 0
        self.broken = lambda consts: True

    def __getitem__(self, grid):
        def launch(*args, **consts):
            self.calls += 1
            if self.broken(consts):
                raise RuntimeError("PassManager::run failed")

        return launch


@pytest.fixture
def fake_kernel(monkeypatch):
    if not HG.AVAILABLE:
        pytest.skip("this Triton has no Gluon Hopper API")
    fake = _FakeKernel()
    monkeypatch.setattr(HG, "_grouped_gemm_kernel", fake)
    monkeypatch.setattr(HG, "_COMPILED", set())
    monkeypatch.setattr(HG, "_FAILED", set())
    return fake


def _launch(gated=True):
    a = torch.zeros(256, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 128 if gated else 64, 64, dtype=torch.bfloat16)
    out = torch.zeros(256, 64, dtype=torch.bfloat16)
    rows = (torch.zeros(256, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    return HG._launch(HG._compile_key("gate_up", 128, gated, 1, False, a.dtype), a, w, None, out, rows, None,
                      num_valid=200, n_out=64, up_offset=64)  # fmt: skip


def test_a_kernel_that_does_not_compile_is_warned_once_then_skipped(fake_kernel):
    with pytest.warns(RuntimeWarning, match="did not compile"):
        assert _launch() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _launch() is False  # remembered: no second try, no second warning
    assert fake_kernel.calls == 1
    fake_kernel.broken = lambda consts: False
    assert _launch(gated=False) is True  # another compile key is tried on its own


def test_a_kernel_that_compiled_raises_as_usual(fake_kernel):
    fake_kernel.broken = lambda consts: False
    assert _launch() is True
    fake_kernel.broken = lambda consts: True
    with pytest.raises(RuntimeError, match="PassManager"):
        _launch()


def test_a_down_gemm_that_does_not_compile_sends_later_calls_to_the_triton_kernel_at_once(fake_kernel,
                                                                                          monkeypatch):  # fmt: skip
    """The first call's gate_up compiled and its down did not: that call returns None after one launch each; the
    next returns None before launching anything (the copies are this kernel's layout, the Triton kernel cannot
    take over one GEMM)."""
    fake_kernel.broken = lambda consts: consts["MUL_W"]  # the down GEMM scales by the routing weights
    monkeypatch.setattr(HG, "rows_in_compact_order", lambda x, rows, **kw: torch.zeros(300, 64, dtype=x.dtype))
    x = torch.zeros(100, 64, dtype=torch.bfloat16)
    rows = (torch.zeros(256, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    args = (x, torch.zeros(2, 128, 64, dtype=torch.bfloat16), None, torch.zeros(2, 64, 64, dtype=torch.bfloat16),
            None, rows, torch.ones(200))  # fmt: skip
    with pytest.warns(RuntimeWarning, match="did not compile"):
        assert HG.layer_gemms(*args, num_experts=2, top_k=2, gated=True, act=1) is None
    assert fake_kernel.calls == 2
    assert HG.layer_gemms(*args, num_experts=2, top_k=2, gated=True, act=1) is None
    assert fake_kernel.calls == 2, "nothing launched once a GEMM of the layer is known not to compile"


@pytest.mark.interpreter
@pytest.mark.skipif(CUDA, reason="the interpreter's TMA path; on a GPU the real kernel runs (tests below)")
def test_the_layer_runs_the_triton_kernel_where_the_persistent_one_does_not_compile(monkeypatch):
    """persistent_fits said yes, so the align also gave the copies' block rows; the Gluon GEMMs did not compile
    (layer_gemms None): the Triton GEMMs run on the same blocks, x and the intermediate in whole-block order."""
    calls = []
    monkeypatch.setattr(K, "persistent_fits", lambda *a, **kw: True)
    monkeypatch.setattr(K, "x_copy_fits", lambda *a: True)  # tiny experts: the padding would exceed the bound
    monkeypatch.setattr(K.hopper_gemm, "layer_gemms", lambda *a, **kw: calls.append(a[5][2]))
    case = make_case(150, 32, 24, 3, 2, routing="skewed")
    cfg = {**PERSISTENT, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32}, "down": {"BLOCK_N": 32, "BLOCK_K": 32}}
    out = K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=3, config=cfg)
    ref = reference(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], 3)
    assert len(calls) == 1 and int(calls[0][0]) == 0, "asked once, with the align's block rows"
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("T,E,k", [(150, 3, 2), (300, 40, 4)])
def test_x_is_copied_into_blocks_that_pad_each_expert_to_half_a_block(T, E, k):
    """Block b's slots from row block_row[b] of the copy: a whole block's 128, or 64 where its second half is
    padding alone; a padding slot holds row 0. Skewed routing, and experts with no pairs."""
    from selector.plugins.triton_common import align as A

    case = make_case(T, 64, 32, E, k, routing="skewed")
    x, ids = case["x"], case["ids"].reshape(-1)
    plan = A.plan_align(ids, E, 128, row_grain=HG.ROW_GRAIN)
    A.run_align(plan)
    rows = (plan.sorted_rows, plan.block_expert, plan.block_row)
    copy = HG.rows_in_compact_order(x, rows, num_experts=E, top_k=k)
    assert copy.shape == (HG.compact_rows(T * k, E), 64)
    n = T * k
    slots, blocks, first = (t.cpu().tolist() for t in rows)
    end = 0
    for b, e in enumerate(blocks):
        if e < 0:
            continue
        height = 64 if slots[b * 128 + 64] >= n else 128
        assert first[b] == end, "blocks back to back, an expert's padding at most half a block"
        for m in range(height):
            src = slots[b * 128 + m]
            assert torch.equal(copy[first[b] + m], x[src // k if src < n else 0]), (b, m)
        end += height
    assert end <= copy.shape[0]


# --------------------------------------------------------------------------------------------------------------
# the installed Triton builds the kernel for sm_90 (no GPU needed)
# --------------------------------------------------------------------------------------------------------------


def _compile_sm90(gated: bool, out_blocked: bool):
    compiler = pytest.importorskip("triton.compiler")
    target = pytest.importorskip("triton.backends.compiler").GPUTarget("cuda", 90, 32)
    source = pytest.importorskip("triton.experimental.gluon._runtime").GluonASTSource
    t = HG.tiles("gate_up" if out_blocked else "down", gated)
    bm, bn, bk = 128, t["BLOCK_N"], t["BLOCK_K"]

    def desc(rows):
        return f"tensordesc<bf16[{rows}, {bk}],{HG.gl.NVMMASharedLayout.get_default_for([rows, bk], HG.gl.bfloat16)!r}>"

    sig = {"a_desc": desc(bm), "a_half_desc": desc(bm // 2), "w_desc": desc(bn), "out_ptr": "*bf16",
           "bias_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "block_row_ptr": "*i32",
           "topk_w_ptr": "*fp32",
           "num_valid": "i32", "max_blocks": "i32", "N": "i32", "K": "i32", "up_offset": "i32", "w_rows": "i32",
           "stride_om": "i32", "stride_be": "i32"}  # fmt: skip
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=t["num_stages"], GROUP_M=t["GROUP_M"], GATED=gated,
                  ACT=1 if gated else 0, HAS_BIAS=False, MUL_W=not out_blocked, OUT_BLOCKED=out_blocked)  # fmt: skip
    sig.update(dict.fromkeys(consts, "constexpr"))
    names = list(sig)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n[0] in "NKsw"}
    return compiler.compile(source(HG._grouped_gemm_kernel, sig, consts, aligned), target=target,
                            options={"num_warps": HG.CONSUMER_WARPS})  # fmt: skip


_BUILD = """
import json, os, subprocess, sys, tempfile
import pytest
import triton
from test_hopper_gemm import _compile_sm90
try:
    kernel = _compile_sm90(gated=sys.argv[1] == "1", out_blocked=sys.argv[2] == "1")
except pytest.skip.Exception as exc:
    print(json.dumps({"skip": str(exc)}))
else:
    # ptxas assigns registers, so spills show in the machine code only: Triton ships nvdisasm beside ptxas
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    sass = None
    if os.path.exists(nvdisasm):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            sass = subprocess.run([nvdisasm, "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    print(json.dumps({"ptx": kernel.asm["ptx"], "sass": sass, "shared": kernel.metadata.shared}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not HG.AVAILABLE, reason="this Triton has no Gluon Hopper API")
@pytest.mark.parametrize("gated,out_blocked", [(True, True), (False, False)], ids=["gate_up", "down"])
def test_the_kernel_builds_for_sm90_with_wgmma_and_no_local_memory(gated, out_blocked):
    """In a process of its own: the tests' interpreter switch (conftest) turns every jit function into an
    interpreted one at import, and the interpreter does not compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-c", _BUILD, str(int(gated)), str(int(out_blocked))]
    done = subprocess.run(argv, env=env, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    ptx = result["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx, "one 128-wide wgmma (gate and up)"
    assert "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx, "warp-specialised, TMA loads"
    assert "ld.local" not in ptx and "st.local" not in ptx, "no local arrays"
    if result["sass"] is not None:
        spills = [line for line in result["sass"].splitlines() if re.search(r"\b(STL|LDL)\b", line)]
        assert not spills, f"{len(spills)} spill instructions: the consumers ran out of registers"
    assert result["shared"] <= 227 * 1024


# --------------------------------------------------------------------------------------------------------------
# the real kernel on an sm_90 GPU
# --------------------------------------------------------------------------------------------------------------

GPU_CASES = [
    # id, (T, H, I, E, k), make_case kwargs, fused_experts kwargs
    ("plain", (1500, 1024, 384, 16, 4), {}, {}),
    ("skewed", (2048, 1024, 512, 64, 4), dict(routing="skewed"), {}),
    ("k_and_n_tails", (999, 520, 200, 16, 2), {}, {}),
    ("bias", (1500, 1024, 384, 16, 4), dict(bias=True), {}),
    ("not_gated_relu", (1200, 1024, 512, 16, 2), dict(gated=False), dict(gated=False, activation="relu")),
    ("x_in_block_order", (600, 512, 4096, 8, 2), {}, {}),
]


def _spy(monkeypatch):
    """Records what each persistent launch returned; the small test shapes' padding is let past the bound."""
    monkeypatch.setattr(K, "x_copy_fits", lambda *a: True)
    ran = []
    real = HG._launch

    def spy(*args, **kwargs):
        ran.append(real(*args, **kwargs))
        return ran[-1]

    monkeypatch.setattr(HG, "_launch", spy)
    return ran


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the persistent kernel is for sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape,make_kw,run_kw", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def test_gpu_persistent_matches_the_reference_and_the_triton_kernel(shape, make_kw, run_kw, dtype, monkeypatch):
    T, H, I, E, k = shape
    case = make_case(T, H, I, E, k, dtype=dtype, **make_kw)
    args = (case["x"], case["w1"], case["w2"], case["ids"], case["wts"])
    kw = dict(num_experts=E, gate_up_bias=case["b1"], down_bias=case["b2"], **run_kw)
    ran = _spy(monkeypatch)
    out = K.fused_experts(*args, config=PERSISTENT, **kw)
    again = K.fused_experts(*args, config=PERSISTENT, **kw)
    assert ran == [True] * 4, "both GEMMs through the persistent kernel, both calls"
    ref = reference(*args, E, run_kw.get("activation", "silu"), run_kw.get("gated", True), False, False, case["b1"],
                    case["b2"])  # fmt: skip
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < {torch.bfloat16: 2e-2, torch.float16: 1e-2}[dtype], err
    assert torch.equal(out, again), "deterministic: the same bits on every call"
    triton = K.fused_experts(*args, config={"BLOCK_M": 128}, **kw)
    assert torch.allclose(out.float(), triton.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the persistent kernel is for sm_90")
def test_gpu_persistent_leaves_sentinels_out_and_replays_in_a_cuda_graph(monkeypatch):
    ran = _spy(monkeypatch)
    case = make_case(777, 512, 256, 32, 4, dtype=torch.bfloat16)
    ids = case["ids"].clone()
    ids[torch.rand(ids.shape, device=ids.device) < 0.1] = -1  # the expert-parallel sentinel
    args = (case["x"], case["w1"], case["w2"], ids, case["wts"])
    eager = K.fused_experts(*args, num_experts=32, config=PERSISTENT)
    ref = reference(*args, 32)
    assert ((eager.double().cpu() - ref).norm() / ref.norm()).item() < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = K.fused_experts(*args, num_experts=32, config=PERSISTENT)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
    assert ran == [True] * 4, "both GEMMs through the persistent kernel, eager and captured"


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the persistent kernel is for sm_90")
@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_gpu_persistent_layer_treats_dropped_and_bad_slots_as_the_triton_layer_does(guarded, monkeypatch):
    """Against the Triton layer and the float64 reference: tokens whose slots all route elsewhere get zeros, a bad
    slot (guarded) a NaN row for its token alone, every other row its k slots added up; the same bits on a second
    call, with skewed routing's half-height tiles."""
    from selector import guard

    ran = _spy(monkeypatch)
    E, k = 32, 4
    case = make_case(1500, 512, 256, E, k, dtype=torch.bfloat16, routing="skewed")
    ids, wts = case["ids"].clone(), case["wts"].clone()
    g = torch.Generator().manual_seed(3)
    ids[(torch.rand(ids.shape, generator=g) < 0.1).to(ids.device)] = E  # the expert-parallel drop id
    ids[10:20] = E  # tokens with no slot on this rank
    code = 0
    if guarded:
        code = 2 * (1 << 30) + 1  # a tag no module holds, expert-parallel (E is the sentinel, E + 1 a fault)
        ids[30, 1] = E + 1
        wts[40, 2] = float("nan")
    args = (case["x"], case["w1"], case["w2"], ids, wts)
    out = K.fused_experts(*args, num_experts=E, config=PERSISTENT, guard=code)
    again = K.fused_experts(*args, num_experts=E, config=PERSISTENT, guard=code)
    triton = K.fused_experts(*args, num_experts=E, config={"BLOCK_M": 128}, guard=code)
    if guarded:
        assert guard.pending_faults(ids.device)["bad_ids"] > 0
        guard.clear()
    assert ran == [True] * 4, "both GEMMs through the persistent kernel, both calls"
    assert torch.equal(out.view(torch.int16), again.view(torch.int16)), "deterministic: the same bits every call"
    nan_rows = out.isnan().any(1).cpu()
    expected = torch.zeros(1500, dtype=torch.bool)
    if guarded:
        expected[[30, 40]] = True
        assert out[[30, 40]].isnan().all()
    assert torch.equal(nan_rows, expected), "NaN rows for the bad tokens only"
    assert torch.equal(out[10:20], torch.zeros_like(out[10:20])), "no slot here: zeros"
    good = ~expected.to(out.device)
    assert torch.allclose(out[good].float(), triton[good].float(), rtol=1e-2, atol=1e-2)
    ref = reference(case["x"], case["w1"], case["w2"], torch.where(ids < E, ids, -1), wts, E)[~expected]
    err = ((out[good].double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
