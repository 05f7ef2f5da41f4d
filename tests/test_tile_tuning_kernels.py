"""Tile tuning with real kernels: the Triton interpreter on a CPU (tiny shapes), the compiled kernels on a GPU.

The search logic itself is tested with fake timers in test_tile_tuning.py.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch
from selector.plugins.triton_fused import configs as C
from selector.plugins.triton_fused import tune as TU

from selector.types import Problem

pytestmark = pytest.mark.interpreter

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(autouse=True)
def _tables(tmp_path, monkeypatch):
    monkeypatch.delenv("SELECTOR_TRITON_FUSED_CONFIG_DIR", raising=False)
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", str(tmp_path / "user"))
    C.clear_caches()
    yield
    C.clear_caches()


def _wall_timer(fn) -> float:
    """One call, timed on the host: the interpreter has no events, and one call is enough to rank nothing."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.skipif(not INTERPRETER, reason="runs the kernels on CPU tensors through TRITON_INTERPRET=1")
def test_one_real_tuning_call_in_the_interpreter(tmp_path):
    problem = Problem(num_experts=4, hidden_size=32, intermediate_size=32, top_k=2, dtype="float16", device="cpu")
    bench = TU.LayerBench(problem, torch.device("cpu"), _wall_timer)
    summary = TU.tune_kernels(problem, (2, 16), 60.0, measure=bench, device_name="Interpreter GPU")
    assert summary["skipped"] is None and not summary["cut_short"]
    assert summary["tokens_tuned"] == [16, 2]
    path = tmp_path / "user" / C.config_file_name("Interpreter GPU")
    assert summary["written_to"] == str(path)
    table = C.load_user_table("Interpreter GPU")[C.shape_key(4, 32, 32, 2)]
    assert set(table) == {2, 16}
    assert all(table[t] == summary["configs"][t] for t in (2, 16))
    assert json.loads(path.read_text())["tuned"][C.shape_key(4, 32, 32, 2)] == [2, 16]


def _reference(x, w1, w2, ids, wts):
    """float64 on the GPU, expert by expert, from the definition: sum_j w_j * down(silu(gate(x)) * up(x))."""
    x, w1, w2, wts = x.double(), w1.double(), w2.double(), wts.double()
    i_dim = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1[e].T
        inter = torch.nn.functional.silu(h[:, :i_dim]) * h[:, i_dim:]
        out.index_add_(0, tok, (inter @ w2[e].T) * wts[tok, slot][:, None])
    return out


@pytest.mark.gpu
def test_tune_a_shape_without_a_shipped_table_within_a_minute():
    """E=40, H=1536, I=896, k=6 has no shipped entry: tuned within 60 s, the tiles it chose are the ones that run,
    and the layer is right against float64."""
    from selector.plugins.triton_fused import selector_backends
    from selector.plugins.triton_fused.kernels import fused_experts

    e, h, i_dim, k = 40, 1536, 896, 6
    problem = Problem(num_experts=e, hidden_size=h, intermediate_size=i_dim, top_k=k)
    spec = selector_backends()[0]
    t0 = time.perf_counter()
    summary = spec.tune_kernels(problem, TU.TOKEN_COUNTS, 60.0)
    wall = time.perf_counter() - t0
    assert summary["skipped"] is None, summary
    assert wall <= 62.0 and summary["seconds"] <= 60.0, summary
    large = [t for t in TU.TOKEN_COUNTS if t >= TU.LARGE_TOKENS]
    assert set(large) <= set(summary["tokens_tuned"]) | set(summary["tokens_partial"]), summary
    for t in summary["tokens_tuned"]:
        assert summary["time_us"][t] <= summary["default_us"].get(t, math.inf) * 1.05, summary  # noise: one rep set

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    w1 = torch.randn(e, 2 * i_dim, h, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(h)
    w2 = torch.randn(e, h, i_dim, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(i_dim)
    for t in (512, 4096):
        assert C.get_config(e, h, i_dim, t, k, torch.bfloat16, device=dev) == summary["configs"][t]
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
        wts, ids = torch.topk(torch.rand(t, e, device=dev, generator=g), k, dim=-1)
        wts = wts / wts.sum(-1, keepdim=True)
        out = fused_experts(x, w1, w2, ids, wts, num_experts=e)
        ref = _reference(x, w1, w2, ids, wts)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (t, err)


@pytest.mark.gpu
@pytest.mark.sm90
def test_tune_a_quantised_shape_without_a_shipped_table_within_a_minute(tmp_path, monkeypatch):
    """The same shape as fp8 experts: the backend sends it to the quantised search, which keeps to the budget
    (one candidate may finish past a share's end: START_MARGIN_S covers it) and the layer then reads its tiles."""
    from selector.plugins.quant_kernels import configs as QC
    from selector.plugins.quant_kernels.tiles import resolve_config
    from selector.plugins.triton_fused import selector_backends

    monkeypatch.setenv("SELECTOR_QUANT_USER_CONFIG_DIR", str(tmp_path / "quant"))
    QC.clear_caches()
    problem = Problem(num_experts=40, hidden_size=1536, intermediate_size=896, top_k=6, weight_format="fp8_block")
    t0 = time.perf_counter()
    summary = selector_backends()[0].tune_kernels(problem, (1, 64, 512, 4096), 60.0)
    wall = time.perf_counter() - t0
    assert summary["skipped"] is None and summary["kernels"] == "quant_kernels", summary
    assert wall <= 62.0, summary
    assert 4096 in summary["tokens_tuned"] + summary["tokens_partial"], summary
    got = resolve_config(None, torch.device("cuda"), False, 40, 1536, 896, 4096, 6)
    assert got == summary["configs"][4096]
    QC.clear_caches()


@pytest.mark.skipif(not INTERPRETER, reason="runs the kernels on CPU tensors through TRITON_INTERPRET=1")
@pytest.mark.parametrize("sorted_x", [False, True])
def test_layer_bench_times_tiles_in_the_layout_the_layer_runs(monkeypatch, sorted_x):
    """At BLOCK_M 128 the layer runs its GEMMs through TMA (kernels.part_layout): the tuner's timings must too,
    the intermediate written in block order by gate_up and read back by down, x in block order where the layer
    copies it; in the interpreter the descriptors run, so a wrong buffer size or flag fails here."""
    from selector.plugins.triton_fused import kernels as K

    monkeypatch.setattr(K, "SORTED_X_MIN_I", 16 if sorted_x else 1 << 30)
    launched = []
    real_launch = K._launch_gemm

    def spy(gemm, a, out, blocks, *rest, **kw):
        launched.append((kw["tma"], a.shape[0], out.shape[0], blocks.sorted_rows.numel()))
        return real_launch(gemm, a, out, blocks, *rest, **kw)

    monkeypatch.setattr(K, "_launch_gemm", spy)
    problem = Problem(num_experts=3, hidden_size=32, intermediate_size=32, top_k=2, dtype="float16", device="cpu")
    bench = TU.LayerBench(problem, torch.device("cpu"), _wall_timer)
    tiles = (("BLOCK_K", 16), ("BLOCK_N", 16), ("GROUP_M", 1), ("num_stages", 2), ("num_warps", 4))
    for part in ("gate_up", "down"):
        bench(TU.Task(200, 128, part, tiles))
    (up, up_a, up_out, slots), (down, down_a, _, _) = launched
    assert (up["w_tma"], up["a_tma"], up["out_blocked"]) == (True, sorted_x, True)
    assert (down["w_tma"], down["a_tma"], down["out_blocked"]) == (True, True, False)
    assert up_out >= slots and down_a >= slots, "the intermediate holds every block's rows"
    assert up_a == (slots if sorted_x else 200), "x in block order: one row per slot"
    launched.clear()
    bench(TU.Task(200, 64, "down", tiles))  # 64-row blocks keep pointer loads
    assert [(kw["w_tma"], kw["a_tma"]) for kw, *_ in launched] == [(False, False)]


@pytest.mark.skipif(not INTERPRETER, reason="runs the kernels on CPU tensors through TRITON_INTERPRET=1")
def test_layer_bench_times_one_token_on_the_pair_kernel(monkeypatch):
    """At one token the layer runs _pair_gemm_kernel without an align: the tuner times that kernel, and the
    align costs nothing."""
    from selector.plugins.triton_fused import kernels as K

    launched = []
    real = K.launch

    def spy(fn, grid, args, consts, *rest):
        launched.append((fn, consts["FIRST"], consts["COMBINE"]) if fn is K._pair_gemm_kernel else (fn,))
        return real(fn, grid, args, consts, *rest)

    monkeypatch.setattr(K, "launch", spy)
    monkeypatch.setattr(K, "align", lambda *a, **k: pytest.fail("one token needs no align"))
    problem = Problem(num_experts=4, hidden_size=32, intermediate_size=32, top_k=2, dtype="float16", device="cpu")
    bench = TU.LayerBench(problem, torch.device("cpu"), _wall_timer)
    tiles = (("BLOCK_K", 16), ("BLOCK_N", 16), ("GROUP_M", 1), ("num_stages", 2), ("num_warps", 4))
    assert bench(TU.Task(1, 16, "align")) == 0.0
    for part in ("gate_up", "down", "down"):  # down twice: its counters are left at zero for the next call
        bench(TU.Task(1, 16, part, tiles))
        if part == "down":
            cell = bench._cell[1]
            out = cell["out"].clone()
            cell["out"].fill_(float("nan"))
    assert set(launched) == {(K._pair_gemm_kernel, True, False), (K._pair_gemm_kernel, False, True)}
    cell = bench._cell[1]
    want = K.fused_experts(cell["x"], bench.w1, bench.w2, cell["ids"].view(1, -1), cell["tw"].view(1, -1),
                           num_experts=4)  # fmt: skip
    assert torch.isfinite(out).all(), "the timed down launch wrote the layer's output"
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not INTERPRETER, reason="runs the kernels on CPU tensors through TRITON_INTERPRET=1")
def test_layer_bench_times_one_token_split_down(monkeypatch):
    """The tuner offers the one-token down GEMM at each of PAIR_DOWN_SPLITS and times a split one as the layer
    runs it: its part rows fit every split it offers, and the output is the layer's."""
    from selector.plugins.triton_fused import kernels as K

    splits = []
    real = K.launch

    def spy(fn, grid, args, consts, *rest):
        splits.append(consts["SPLIT"])
        return real(fn, grid, args, consts, *rest)

    monkeypatch.setattr(K, "launch", spy)
    problem = Problem(num_experts=4, hidden_size=32, intermediate_size=32, top_k=2, dtype="float16", device="cpu")
    bench = TU.LayerBench(problem, torch.device("cpu"), _wall_timer)
    tiles = (("BLOCK_K", 16), ("BLOCK_N", 16), ("GROUP_M", 1), ("num_stages", 2), ("num_warps", 4))
    bench(TU.Task(1, 16, "gate_up", tiles))
    bench(TU.Task(1, 16, "down", tiles + (("SPLIT_K", max(TU.PAIR_DOWN_SPLITS)),)))
    assert splits == [1, max(TU.PAIR_DOWN_SPLITS)]
    cell = bench._cell[1]
    want = K.fused_experts(cell["x"], bench.w1, bench.w2, cell["ids"].view(1, -1), cell["tw"].view(1, -1),
                           num_experts=4)  # fmt: skip
    torch.testing.assert_close(cell["out"], want, rtol=1e-2, atol=1e-2)
    one, many = TU.candidate_plan(4, 32, 32, 2, 1), TU.candidate_plan(4, 32, 32, 2, 64)
    assert {c["SPLIT_K"] for c in one[16]["down"]} == set(TU.PAIR_DOWN_SPLITS)
    assert all(c.get("SPLIT_K", 1) == 1 for bm in many for part in many[bm].values() for c in part)
    assert all(c.get("SPLIT_K", 1) == 1 for c in one[16]["gate_up"])


@pytest.mark.skipif(not INTERPRETER, reason="runs the kernels on CPU tensors through TRITON_INTERPRET=1")
def test_layer_bench_times_one_token_down_by_output_tile(monkeypatch):
    """Where the layer's one-token down projection runs _token_down_kernel, the tuner times that kernel (after a
    gate_up that applies the routing weights) and offers its tiles."""
    from selector.plugins.triton_fused import configs as C
    from selector.plugins.triton_fused import kernels as K

    monkeypatch.setattr(C, "TOKEN_DOWN_MIN_I", 1)
    launched = []
    real = K.launch

    def spy(fn, grid, args, consts, *rest):
        launched.append((fn, consts.get("MUL_W")))
        return real(fn, grid, args, consts, *rest)

    monkeypatch.setattr(K, "launch", spy)
    problem = Problem(num_experts=4, hidden_size=32, intermediate_size=32, top_k=2, dtype="float16", device="cpu")
    bench = TU.LayerBench(problem, torch.device("cpu"), _wall_timer)
    tiles = (("BLOCK_K", 16), ("BLOCK_N", 16), ("GROUP_M", 1), ("num_stages", 2), ("num_warps", 4))
    for part in ("gate_up", "down"):
        bench(TU.Task(1, 16, part, tiles))
    assert set(launched) == {(K._pair_gemm_kernel, True), (K._token_down_kernel, None)}
    cell = bench._cell[1]
    want = K.fused_experts(cell["x"], bench.w1, bench.w2, cell["ids"].view(1, -1), cell["tw"].view(1, -1),
                           num_experts=4)  # fmt: skip
    torch.testing.assert_close(cell["out"], want, rtol=1e-2, atol=1e-2)
    plan = TU.candidate_plan(4, 32, 32, 2, 1)
    assert TU.token_down_candidates()[0] in plan[16]["down"]
