"""Correctness of the fused Triton experts kernels (plugins/triton_fused/kernels.py, plugins/triton_common).

Reference: a float64 loop over (token, slot) pairs, written here from the definition.
Error measure: ||out - ref|| / ||ref||. Tolerances (justification):
- CPU (Triton interpreter, fp32, numpy dots): ~1e-7 observed; 1e-5.
- GPU fp32 with torch's default matmul precision "highest": Triton uses exact fp32 FMA dots: 1e-5.
- GPU fp32 under "high" (tf32 operands, 10-bit mantissa, ~5e-4 per rounding, two GEMMs): 1e-2.
- GPU fp16 (inputs, intermediate and per-slot outputs rounded to 11-bit mantissa, ~5e-4 each): 1e-2.
- GPU bf16 (8-bit mantissa, ~4e-3 per rounding: intermediate, per-slot output, final output): 2e-2.
On CPU the interpreter is used (tests/conftest.py sets TRITON_INTERPRET=1), where bf16 dots are wrong, so CPU
cases are fp32 and tiny. Every buffer is poisoned (NaN / out-of-range ids) before the kernels run
(triton_common.launch.POISON), so an element a kernel does not write turns the result into NaN and the test fails.
"""

from __future__ import annotations

import collections

import json
import math

import pytest
import torch

from experts_fixtures import same_rows
from selector.plugins.triton_fused import configs as C
from selector.plugins.triton_common import align as A
from selector.plugins.triton_common import launch as L
from selector.plugins.triton_fused import kernels as K

pytestmark = pytest.mark.interpreter

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(L, "POISON", True)


def _act(name):
    f = torch.nn.functional
    return {
        "silu": f.silu,
        "gelu": f.gelu,
        "gelu_tanh": lambda z: f.gelu(z, approximate="tanh"),
        "relu": torch.relu,
    }[name]


def reference(x, w1, w2, ids, wts, num_experts, activation="silu", gated=True, interleaved=False,
              transposed=False, b1=None, b2=None):  # fmt: skip
    """float64, one (token, slot) pair at a time, straight from the definition."""
    x, w1, w2 = x.double().cpu(), w1.double().cpu(), w2.double().cpu()
    ids, wts = ids.cpu(), wts.double().cpu()
    b1 = None if b1 is None else b1.double().cpu()
    b2 = None if b2 is None else b2.double().cpu()
    if transposed:
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    act = _act(activation)
    out = torch.zeros(x.shape, dtype=torch.float64)
    t_count, k = ids.shape
    for e in range(num_experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1[e].T
        if b1 is not None:
            h = h + b1[e]
        if gated:
            g, u = (h[:, 0::2], h[:, 1::2]) if interleaved else h.chunk(2, dim=-1)
            h = act(g) * u
        else:
            h = act(h)
        o = h @ w2[e].T
        if b2 is not None:
            o = o + b2[e]
        out.index_add_(0, tok, o * wts[tok, slot, None])
    return out


def make_case(T, H, I, E, k, *, dtype=torch.float32, gated=True, transposed=False, bias=False, device=DEV,
              routing="uniform", seed=0):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    c = 2 * I if gated else I
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E, c, H, generator=g) / math.sqrt(H)
    w2 = torch.randn(E, H, I, generator=g) / math.sqrt(I)
    if transposed:
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    if routing == "uniform":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    elif routing == "skewed":  # expert 0 in (almost) every token, the rest uniform
        ids = torch.stack([torch.cat([torch.tensor([0]), 1 + torch.randperm(E - 1, generator=g)[: k - 1]])
                           for _ in range(T)])  # fmt: skip
    else:
        raise ValueError(routing)
    ids = ids.long()
    wts = torch.rand(T, k, generator=g)
    b1 = torch.randn(E, c, generator=g) if bias else None
    b2 = torch.randn(E, H, generator=g) if bias else None

    def to(t):
        return None if t is None else t.to(device=device, dtype=dtype)

    return dict(x=to(x), w1=to(w1), w2=to(w2), ids=ids.to(device), wts=wts.to(device), b1=to(b1), b2=to(b2))


def run_and_check(case, E, tol, *, activation="silu", gated=True, interleaved=False, transposed=False,
                  config=None, ids=None):  # fmt: skip
    ids = case["ids"] if ids is None else ids
    out = K.fused_experts(
        case["x"], case["w1"], case["w2"], ids, case["wts"], num_experts=E, activation=activation, gated=gated,
        interleaved=interleaved, transposed=transposed, gate_up_bias=case["b1"], down_bias=case["b2"],
        config=config,
    )  # fmt: skip
    assert out.shape == case["x"].shape and out.dtype == case["x"].dtype
    ref = reference(case["x"], case["w1"], case["w2"], ids, case["wts"], E, activation, gated, interleaved,
                    transposed, case["b1"], case["b2"])  # fmt: skip
    assert torch.isfinite(out).all(), "unwritten (poisoned) or non-finite output"
    err = ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    return err


# ------------------------------------------------------------------------------------------------------------
# CPU (interpreter) and GPU: tiny fp32 cases covering every layout / option
# ------------------------------------------------------------------------------------------------------------

SMALL = [
    # id, (T, H, I, E, k), kwargs
    ("basic", (5, 32, 24, 4, 2), {}),
    ("T1", (1, 32, 16, 4, 2), {}),
    ("E1", (4, 32, 16, 1, 1), {}),
    ("k_eq_E", (3, 32, 16, 3, 3), {}),
    ("odd", (7, 40, 24, 5, 2), {}),
    ("interleaved", (6, 48, 40, 5, 3), dict(interleaved=True)),
    ("transposed", (5, 32, 24, 4, 2), dict(transposed=True)),
    ("transposed_interleaved_bias", (4, 40, 24, 3, 2), dict(transposed=True, interleaved=True, bias=True)),
    ("bias", (5, 32, 24, 4, 2), dict(bias=True)),
    ("gelu", (4, 32, 16, 4, 2), dict(activation="gelu")),
    ("gelu_tanh", (4, 32, 16, 4, 2), dict(activation="gelu_tanh")),
    ("relu", (4, 32, 16, 4, 2), dict(activation="relu")),
    ("not_gated", (6, 40, 24, 5, 2), dict(gated=False, activation="gelu")),
    ("not_gated_bias_transposed", (5, 32, 16, 4, 2), dict(gated=False, bias=True, transposed=True)),
]


@pytest.mark.parametrize("shape,kw", [(s, kw) for _, s, kw in SMALL], ids=[n for n, _, _ in SMALL])
def test_small_fp32(shape, kw):
    T, H, I, E, k = shape
    kw = dict(kw)
    bias = kw.pop("bias", False)
    case = make_case(T, H, I, E, k, gated=kw.get("gated", True), transposed=kw.get("transposed", False), bias=bias)
    run_and_check(case, E, 1e-5, **kw)


@pytest.mark.parametrize(
    "config",
    [
        {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1},
        {"BLOCK_M": 32, "gate_up": {"BLOCK_N": 32, "BLOCK_K": 32}, "down": {"BLOCK_N": 16, "BLOCK_K": 16}},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4},
    ],
    ids=["bm16", "bm32_split", "bm64"],
)
def test_explicit_configs_odd_sizes(config):
    # H, I not multiples of the tiles: exercises the K and N masks
    case = make_case(9, 40, 24, 5, 2, bias=True)
    run_and_check(case, 5, 1e-5, config=config)


def test_skewed_and_empty_experts():
    # expert 0 gets every token (> BLOCK_M pairs: several blocks); experts 5..7 get none
    case = make_case(20, 32, 16, 8, 3, routing="skewed", seed=3)
    ids = case["ids"].clone()
    ids[ids >= 5] = ids[ids >= 5] % 5
    ids[:, 1:][ids[:, 1:] == 0] = 1  # keep distinct within a token
    run_and_check(case, 8, 1e-5, ids=ids, config={"BLOCK_M": 16})


def test_sentinel_ids_contribute_nothing():
    case = make_case(6, 32, 16, 4, 2)
    ids = case["ids"].clone()
    ids[0, 0] = 4  # == E: the expert-parallel sentinel
    ids[2, 1] = 7
    ids[3, :] = 4  # a token with only sentinels gets zeros
    out = run_and_check(case, 4, 1e-5, ids=ids)
    assert out < 1e-5


def test_all_sentinel():
    case = make_case(3, 32, 16, 4, 2)
    ids = torch.full_like(case["ids"], 4)
    out = K.fused_experts(case["x"], case["w1"], case["w2"], ids, case["wts"], num_experts=4)
    assert torch.equal(out, torch.zeros_like(out))


def test_zero_tokens():
    case = make_case(0, 32, 16, 4, 2)
    out = K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=4)
    assert out.shape == (0, 32)


def test_deterministic():
    case = make_case(8, 32, 16, 4, 3)
    a = K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=4)
    b = K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=4)
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------------------
# The TMA path (blocks of >= TMA_MIN_BLOCK_M rows on sm_90+; the interpreter runs its descriptors too)
# ------------------------------------------------------------------------------------------------------------

TMA_CONFIG = {"BLOCK_M": 128, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 16}, "down": {"BLOCK_N": 32, "BLOCK_K": 16}}
TMA_CASES = [
    # id, (T, H, I, E, k), kwargs: K-contiguous weights (transposed storage keeps pointer loads)
    ("plain", (150, 32, 24, 3, 2), {}),
    ("interleaved", (150, 48, 40, 3, 2), dict(interleaved=True)),
    ("interleaved_bias", (150, 32, 32, 3, 2), dict(interleaved=True, bias=True)),
    ("not_gated", (150, 32, 24, 3, 2), dict(gated=False, activation="gelu")),
]


def _gemm_launches(monkeypatch, record=lambda args, consts: (consts["W_TMA"], consts["A_TMA"], consts["OUT_BLOCKED"])):
    """Records `record(args, consts)` of every GEMM launch: by default its TMA switches."""
    seen = []
    real = K.launch

    def spy(fn, grid, args, consts, *rest):
        if fn is K._moe_gemm_kernel:
            seen.append(record(args, consts))
        return real(fn, grid, args, consts, *rest)

    monkeypatch.setattr(K, "launch", spy)
    return seen


def _run(case, E, **kw):
    return K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=E,
                           gate_up_bias=case["b1"], down_bias=case["b2"], config=TMA_CONFIG, **kw)  # fmt: skip


@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() < (9, 0), reason="TMA needs sm_90+")
@pytest.mark.parametrize("shape,kw", [(s, kw) for _, s, kw in TMA_CASES], ids=[n for n, _, _ in TMA_CASES])
def test_tma_path_matches_the_reference_and_the_pointer_path_bit_for_bit(shape, kw, monkeypatch):
    T, H, I, E, k = shape
    kw = dict(kw)
    case = make_case(T, H, I, E, k, bias=kw.pop("bias", False), gated=kw.get("gated", True), routing="skewed")
    seen = _gemm_launches(monkeypatch)
    run_and_check(case, E, 1e-5, config=TMA_CONFIG, **kw)
    assert seen == [(True, False, True), (True, True, False)], "gate_up writes block order, down reads it by TMA"
    via_tma = _run(case, E, **kw)
    seen.clear()
    monkeypatch.setattr(K, "_tma_device", lambda device: False)
    via_pointers = _run(case, E, **kw)
    assert seen == [(False, False, False)] * 2
    assert torch.equal(via_tma, via_pointers), "same tiles, same K order: the same bits"


@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() < (9, 0), reason="TMA needs sm_90+")
def test_tma_with_x_in_block_order(monkeypatch):
    case = make_case(150, 32, 24, 3, 2, routing="skewed")
    monkeypatch.setattr(K, "SORTED_X_MIN_I", 16)  # the rule is for large intermediates; the path is the same
    seen = _gemm_launches(monkeypatch)
    run_and_check(case, 3, 1e-5, config=TMA_CONFIG)
    assert seen == [(True, True, True), (True, True, False)]
    via_tma = _run(case, 3)
    monkeypatch.setattr(K, "_tma_device", lambda device: False)
    assert torch.equal(via_tma, _run(case, 3))


@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() < (9, 0), reason="TMA needs sm_90+")
def test_tma_is_both_gemms_or_neither(monkeypatch):
    # fp32: gate_up's BLOCK_K 32 (128 bytes) fits a TMA box, down's 64 (256 bytes) does not: both keep pointers,
    # since down would otherwise read an intermediate that gate_up wrote in pair order
    case = make_case(150, 64, 64, 3, 2, routing="skewed")
    cfg = {"BLOCK_M": 128, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32}, "down": {"BLOCK_N": 32, "BLOCK_K": 64}}
    assert K.part_layout("gate_up", case["w1"], 128, cfg["gate_up"] | {"GROUP_M": 8}, i_dim=64)["w_tma"]
    seen = _gemm_launches(monkeypatch)
    run_and_check(case, 3, 1e-5, config=cfg)
    assert seen == [(False, False, False)] * 2


def test_tma_declined_where_a_descriptor_cannot_read_the_tiles(monkeypatch):
    monkeypatch.setattr(K, "_tma_device", lambda device: True)
    cfg = {"BLOCK_N": 64, "BLOCK_K": 64}
    w = torch.empty(4, 256, 512, dtype=torch.bfloat16)
    assert K.part_layout("down", w, 128, cfg, i_dim=512) == {"w_tma": True, "a_tma": True, "out_blocked": False}
    assert K.part_layout("gate_up", w, 128, cfg, i_dim=128)["out_blocked"]
    declined = {
        "blocks of 64 rows (measured slower)": K.part_layout("down", w, 64, cfg, i_dim=512),
        "intermediate rows not a multiple of 16 bytes": K.part_layout("down", w, 128, cfg, i_dim=500),
        "weights not contiguous": K.part_layout("down", w.transpose(1, 2), 128, cfg, i_dim=256),
        "rows not a multiple of 16 bytes": K.part_layout("down", torch.empty(4, 256, 500, dtype=torch.bfloat16), 128,
                                                         cfg, i_dim=512),  # fmt: skip
        "a box side over 256": K.part_layout("down", w, 128, {"BLOCK_N": 512, "BLOCK_K": 64}, i_dim=512),
        "a contiguous side over 128 bytes": K.part_layout("down", w, 128, {"BLOCK_N": 64, "BLOCK_K": 128},
                                                          i_dim=512),  # fmt: skip
        "transposed storage": K.part_layout("down", w, 128, cfg, i_dim=512, transposed=True),
    }
    assert all(v == K.NO_TMA for v in declined.values()), {k: v for k, v in declined.items() if v != K.NO_TMA}
    monkeypatch.setattr(K, "_tma_device", lambda device: False)
    assert K.part_layout("down", w, 128, cfg, i_dim=512) == K.NO_TMA


# ------------------------------------------------------------------------------------------------------------
# Half-height tail tiles (blocks of >= HALF_TAIL_MIN_BLOCK_M rows: a block at most half full runs half the rows)
# ------------------------------------------------------------------------------------------------------------


def _tail_case(**kw):
    """Pairs per expert 130, 201, 40, 30, 0, 65, 64, 0. At 128-row blocks: expert 0's blocks hold 128 and 2 pairs
    (the second a half-height tile), expert 1's 128 and 73 (both full), experts 2, 3 and 6 one block at most half
    full, expert 5 one block of 65 (one past half: full)."""
    case = make_case(265, 32, 24, 8, 2, seed=5, **kw)
    ids = torch.ones(265, 2, dtype=torch.long)
    ids[:130, 0] = 0
    ids[130:170, 0] = 2
    ids[170:200, 0] = 3
    ids[200:, 0] = 5
    ids[200:264, 1] = 6
    case["ids"] = ids.to(case["x"].device)
    return case


def _inter_launches(monkeypatch):
    """The (HALF_TAIL, output buffer, OUT_BLOCKED) of every GEMM launch."""
    return _gemm_launches(monkeypatch, lambda args, consts: (consts["HALF_TAIL"], args[3], consts["OUT_BLOCKED"]))


@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() < (9, 0), reason="TMA needs sm_90+")
@pytest.mark.parametrize("kw", [{}, dict(interleaved=True, bias=True), dict(gated=False, activation="gelu")],
                         ids=["plain", "interleaved_bias", "not_gated"])  # fmt: skip
def test_half_empty_blocks_run_half_height_tiles(kw, monkeypatch):
    kw = dict(kw)
    case = _tail_case(bias=kw.pop("bias", False), gated=kw.get("gated", True))
    assert torch.bincount(case["ids"].reshape(-1).cpu(), minlength=8).tolist() == [130, 201, 40, 30, 0, 65, 64, 0]
    seen = _inter_launches(monkeypatch)
    run_and_check(case, 8, 1e-5, config=TMA_CONFIG, **kw)
    assert [s[0] for s in seen] == [True, True]
    inter, blocked = seen[0][1], seen[0][2]
    assert blocked, "the intermediate in block order shows which rows the tiles computed"
    sorted_rows, block_expert = A.align(case["ids"].reshape(-1), 8, 128)
    n_pairs = case["ids"].numel()
    rows = inter.reshape(-1, 128, inter.shape[1]).cpu()
    real = (sorted_rows < n_pairs).reshape(-1, 128).cpu()
    for b, e in enumerate(block_expert.cpu().tolist()):
        if e < 0:
            continue
        written = torch.isfinite(rows[b]).all(dim=1)
        if real[b, 64:].any():
            assert written.all(), f"block {b} (expert {e}) is over half full: every row computed"
        else:
            assert written[:64].all() and not written[64:].any(), f"block {b} (expert {e}): a half-height tile"
    half = K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=8,
                           gate_up_bias=case["b1"], down_bias=case["b2"], config=TMA_CONFIG, **kw)  # fmt: skip
    seen.clear()
    monkeypatch.setattr(C, "HALF_TAIL_MIN_BLOCK_M", 1 << 30)
    full = K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=8,
                           gate_up_bias=case["b1"], down_bias=case["b2"], config=TMA_CONFIG, **kw)  # fmt: skip
    assert [s[0] for s in seen] == [False, False]
    assert same_rows(half, full), "a half-height tile computes its rows as the full tile does"


@pytest.mark.parametrize("block_m", [128, 64])
def test_half_height_tiles_on_the_pointer_path(block_m, monkeypatch):
    # transposed weights keep pointer loads; 64-row blocks run 32-row tails (the same bits on the H200 too)
    monkeypatch.setattr(K, "_tma_device", lambda device: False)
    case = _tail_case(transposed=True)
    cfg = dict(TMA_CONFIG, BLOCK_M=block_m)
    seen = _inter_launches(monkeypatch)
    run_and_check(case, 8, 1e-5, config=cfg, transposed=True)
    assert [(s[0], s[2]) for s in seen] == [(True, False)] * 2
    args = (case["x"], case["w1"], case["w2"], case["ids"], case["wts"])
    half = K.fused_experts(*args, num_experts=8, transposed=True, config=cfg)
    monkeypatch.setattr(C, "HALF_TAIL_MIN_BLOCK_M", 1 << 30)
    assert same_rows(half, K.fused_experts(*args, num_experts=8, transposed=True, config=cfg))


def test_blocks_under_the_half_tail_size_run_whole(monkeypatch):
    case = _tail_case()
    seen = _inter_launches(monkeypatch)
    run_and_check(case, 8, 1e-5, config=dict(TMA_CONFIG, BLOCK_M=32))
    assert [s[0] for s in seen] == [False, False], "blocks under HALF_TAIL_MIN_BLOCK_M rows run whole"


def _check_align(ids_flat, E, bm):
    sorted_rows, block_expert = A.align(ids_flat, E, bm)
    n = ids_flat.numel()
    s, b = sorted_rows.cpu().tolist(), block_expert.cpu().tolist()
    flat = ids_flat.cpu().tolist()
    assert len(b) == A.max_blocks_for(n, E, bm)
    used = [e for e in b if e >= 0]
    assert b[: len(used)] == used and all(e == -1 for e in b[len(used) :]), "unused blocks must come last"
    assert used == sorted(used)
    seen = []
    for bi, e in enumerate(used):
        for r in s[bi * bm : (bi + 1) * bm]:
            if r == n:
                continue
            assert 0 <= r < n and flat[r] == e
            seen.append(r)
    assert sorted(seen) == [i for i in range(n) if 0 <= flat[i] < E]
    for bi in range(len(used)):  # an expert's pairs fill its blocks from the first slot (the half-height tails)
        real = [r != n for r in s[bi * bm : (bi + 1) * bm]]
        assert real == sorted(real, reverse=True), f"block {bi}: a padding slot before a pair"
    # inside one expert the pairs keep their order (deterministic layout)
    per_expert: dict[int, list[int]] = {}
    for bi, e in enumerate(used):
        per_expert.setdefault(e, []).extend(r for r in s[bi * bm : (bi + 1) * bm] if r != n)
    for rows in per_expert.values():
        assert rows == sorted(rows)


@pytest.mark.parametrize(
    "n,E,bm",
    [(8, 256, 16), (1, 1, 16), (700, 60, 64), (2500, 8, 128), (1500, 256, 16), (1100, 128, 32)],
)
def test_align(n, E, bm):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, E + 2, (n,), generator=g).to(DEV)  # includes sentinels E, E+1
    _check_align(ids, E, bm)


@pytest.mark.parametrize("n,E,bm", [(2600, 8, 128), (1500, 256, 16)])
def test_align_prefix_pass_over_several_steps(n, E, bm, monkeypatch):
    # 4 chunks per step of the prefix pass (its shipped step covers 256 at once); 2600 pairs: 41 chunks, so the
    # last step is a partial one
    monkeypatch.setattr(A, "PREFIX_ELEMS", 4 * A.PREFIX_E_TILE)
    g = torch.Generator().manual_seed(n + 1)
    _check_align(torch.randint(0, E + 1, (n,), generator=g).to(DEV), E, bm)


def _check_block_rows(ids_flat, E, bm):
    """With a row grain of half a block the align gives each block its first row in a copy that pads each expert
    to the grain only: experts in order, their blocks bm rows apart; the blocks themselves as without it."""
    plan = A.plan_align(ids_flat, E, bm, row_grain=bm // 2)
    A.run_align(plan)
    sorted_rows, block_expert = A.align(ids_flat, E, bm)
    used = int((block_expert >= 0).sum())
    assert torch.equal(plan.block_expert, block_expert)
    assert torch.equal(plan.sorted_rows[: used * bm], sorted_rows[: used * bm])
    flat, blocks, rows = ids_flat.cpu().tolist(), block_expert.cpu().tolist(), plan.block_row.cpu().tolist()
    counts = collections.Counter(flat)
    expected, start = [], 0
    for e in range(E):
        expected += [start + j * bm for j in range(-(-counts[e] // bm))]
        start += -(-counts[e] // (bm // 2)) * (bm // 2)
    assert rows[:used] == expected and all(r == -1 for r in rows[used:])
    assert start <= ids_flat.numel() + min(ids_flat.numel(), E) * (bm // 2 - 1)


@pytest.mark.parametrize("n,E,bm", [(700, 60, 64), (2500, 8, 128), (1100, 128, 32)])
def test_align_block_rows_pad_each_expert_to_half_a_block(n, E, bm):
    g = torch.Generator().manual_seed(n + 2)
    _check_block_rows(torch.randint(0, E + 1, (n,), generator=g).to(DEV), E, bm)


def test_align_row_grain_is_half_a_block():
    with pytest.raises(ValueError, match="row_grain"):
        A.plan_align(torch.zeros(4, dtype=torch.int32), 2, 64, row_grain=16)


@pytest.mark.gpu
@pytest.mark.parametrize("n,E,bm", [(70000, 256, 64), (131072, 128, 128), (5000, 60, 16)])
def test_gpu_align_large(n, E, bm):
    g = torch.Generator().manual_seed(n)
    _check_align(torch.randint(0, E + 1, (n,), generator=g).to("cuda"), E, bm)
    _check_block_rows(torch.randint(0, E + 1, (n,), generator=g).to("cuda"), E, bm)


def test_validation_errors():
    case = make_case(2, 32, 16, 4, 2)
    args = (case["x"], case["w1"], case["w2"], case["ids"], case["wts"])
    with pytest.raises(ValueError, match="activation"):
        K.fused_experts(*args, num_experts=4, activation="tanh")
    with pytest.raises(ValueError, match="experts"):
        K.fused_experts(*args, num_experts=5)
    with pytest.raises(ValueError, match="shapes"):
        K.fused_experts(*args, num_experts=4, gated=False)
    with pytest.raises(ValueError, match="dtype"):
        K.fused_experts(case["x"].double(), case["w1"], case["w2"], case["ids"], case["wts"], num_experts=4)
    with pytest.raises(ValueError, match="top_k"):
        K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"][:1], case["wts"], num_experts=4)
    with pytest.raises(ValueError, match="BLOCK"):
        K.fused_experts(*args, num_experts=4, config={"BLOCK_M": 24})


def test_api_constants():
    assert K.SUPPORTED_ACTIVATIONS == frozenset({"silu", "gelu", "gelu_tanh", "relu"})
    assert K.SUPPORTED_DTYPES == frozenset({torch.bfloat16, torch.float16, torch.float32})
    assert hasattr(torch.ops.selector, "triton_fused_experts")


def test_custom_op_path_matches_direct(monkeypatch):
    case = make_case(5, 32, 24, 4, 2, bias=True)
    args = (case["x"], case["w1"], case["w2"], case["ids"], case["wts"])
    direct = K.fused_experts(*args, num_experts=4, gate_up_bias=case["b1"], down_bias=case["b2"])
    via_op = torch.ops.selector.triton_fused_experts(*args, 4, "silu", True, False, False, case["b1"], case["b2"],
                                                     C.encode_config({"BLOCK_M": 16}))  # fmt: skip
    assert torch.equal(direct, via_op) or torch.allclose(direct, via_op, rtol=1e-6, atol=1e-6)
    op = torch.ops.selector.triton_fused_experts(*args, 4, "silu", True, False, False, case["b1"], case["b2"], None)
    assert torch.allclose(direct, op, rtol=1e-6, atol=1e-6)


def test_autograd_goes_through_the_op():
    """While autograd records, the eager bypass stands aside: the output stays attached to x, and the op's
    backward (plugins/triton_fused/backward.py, registered by the adapter) gives x its gradient."""
    import selector.plugins.triton_fused.forward  # noqa: F401 - registers the backward

    case = make_case(4, 32, 16, 4, 2)
    x = case["x"].clone().requires_grad_(True)
    out = K.fused_experts(x, case["w1"], case["w2"], case["ids"], case["wts"], num_experts=4)
    assert out.requires_grad
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 32)
        out = torch.ops.selector.triton_fused_experts(
            x, torch.empty(4, 32, 32), torch.empty(4, 32, 16), torch.zeros(5, 2, dtype=torch.long),
            torch.empty(5, 2), 4, "silu", True, False, False, None, None, None,
        )  # fmt: skip
        assert out.shape == (5, 32) and out.dtype == x.dtype


# ------------------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------------------


def test_config_roundtrip_and_flat():
    cfg = {"BLOCK_M": 32, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 128}, "down": {"num_warps": 8}}
    full = C.normalize(cfg)
    assert C.decode_config(C.encode_config(cfg)) == full
    flat = C.normalize({"BLOCK_M": 16, "BLOCK_N": 32, "num_stages": 2})
    assert flat["gate_up"]["BLOCK_N"] == flat["down"]["BLOCK_N"] == 32
    with pytest.raises(ValueError):
        C.normalize({"BLOCK_M": 8})


@pytest.mark.parametrize("E,H,I,k", [(60, 2048, 1408, 4), (128, 2048, 768, 8), (8, 4096, 14336, 2),
                                     (256, 7168, 2048, 8)])  # fmt: skip
@pytest.mark.parametrize("T", [1, 8, 64, 512, 4096, 16384])
def test_default_config_valid(E, H, I, k, T):
    for dt in (torch.bfloat16, torch.float32):
        cfg = C.normalize(C.default_config(E, H, I, T, k, dt))
        assert cfg["BLOCK_M"] in (16, 32, 64, 128)
        for part in ("gate_up", "down"):
            p = cfg[part]
            n_b = 2 if part == "gate_up" else 1
            smem = (cfg["BLOCK_M"] * p["BLOCK_K"] + n_b * p["BLOCK_N"] * p["BLOCK_K"]) * (4 if dt == torch.float32 else 2)
            assert smem * (p["num_stages"] - 1) <= 227 * 1024


def test_config_table_lookup(tmp_path, monkeypatch):
    doc = {
        "version": 1,
        "device": "Fake GPU",
        "configs": {
            C.shape_key(8, 64, 32, 2): {
                "1": {"BLOCK_M": 16, "BLOCK_N": 16},
                "512": {"BLOCK_M": 64, "BLOCK_N": 64},
                "bad": {"BLOCK_M": 16},
            }
        },
    }
    (tmp_path / C.config_file_name("Fake GPU")).write_text(json.dumps(doc))
    table = C.load_table("Fake GPU", str(tmp_path))
    key = C.shape_key(8, 64, 32, 2)
    assert C.lookup(table, key, 1)["BLOCK_M"] == 16
    assert C.lookup(table, key, 8)["BLOCK_M"] == 16
    assert C.lookup(table, key, 300)["BLOCK_M"] == 64
    assert C.lookup(table, "E=1,H=1,I=1,k=1", 8) is None
    assert C.load_table("No Such GPU", str(tmp_path)) == {}


def test_shipped_config_files_parse():
    for path in C.CONFIG_DIR.glob("*.json"):
        doc = json.loads(path.read_text())
        for per_t in doc["configs"].values():
            for cfg in per_t.values():
                C.normalize(cfg)


# ------------------------------------------------------------------------------------------------------------
# GPU only
# ------------------------------------------------------------------------------------------------------------

GPU_SHAPES = [
    # (T, H, I, E, k)
    (1, 256, 128, 8, 2),
    (33, 512, 256, 16, 4),
    (257, 384, 320, 8, 2),
    (64, 1000, 333, 6, 3),  # odd H, I: unaligned rows, masks
    (600, 512, 256, 60, 4),  # multi-chunk align
    (2048, 256, 128, 32, 8),  # large T: BLOCK_M 64/128 (wgmma)
]


# ---- decode: a block per (token, slot) pair, no align and no combine launch ------------------------------------


def _decode_launches(monkeypatch):
    """The kernels a call launches from kernels.py; align and combine (their own modules) refuse to run."""
    seen = []
    real = K.launch

    def spy(fn, grid, args, consts, *rest):
        seen.append(fn)
        return real(fn, grid, args, consts, *rest)

    def refuse(*args, **kwargs):
        raise AssertionError("a one-token call ran the align or the combine")

    monkeypatch.setattr(K, "launch", spy)
    monkeypatch.setattr(K, "align", refuse)
    monkeypatch.setattr(K, "combine", refuse)
    return seen


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(bias=True), dict(gated=False), dict(transposed=True, interleaved=True, bias=True)],
    ids=["plain", "bias", "ungated", "transposed_interleaved_bias"],
)
def test_one_token_is_two_launches_that_match_the_reference(kw, k, monkeypatch):
    """The down launch's counters come poisoned (launch.POISON): unless gate_up's first program zeroes them, no
    slot is the last to arrive and the output stays NaN."""
    kw = dict(kw)
    case = make_case(1, 32, 16, 8, k, bias=kw.pop("bias", False), gated=kw.get("gated", True),
                     transposed=kw.get("transposed", False))  # fmt: skip
    seen = _decode_launches(monkeypatch)
    run_and_check(case, 8, TOL[torch.float32], **kw)
    assert seen == [K._pair_gemm_kernel, K._pair_gemm_kernel]


def test_one_token_takes_int32_and_repeated_ids():
    case = make_case(1, 40, 16, 8, 3)  # H not a multiple of the tiles' BLOCK_N
    ids = torch.tensor([[2, 2, 5]], dtype=torch.int32, device=case["x"].device)  # expert 2 twice: both count
    run_and_check(case, 8, TOL[torch.float32], ids=ids)


def test_one_token_skips_sentinel_slots():
    case = make_case(1, 32, 16, 8, 4)
    ids = case["ids"].clone()
    ids[0, 1] = 8  # the expert-parallel sentinel: another rank's expert
    run_and_check(case, 8, TOL[torch.float32], ids=ids)
    ids[0, :] = 8  # every slot elsewhere: this rank adds nothing
    out = K.fused_experts(case["x"], case["w1"], case["w2"], ids, case["wts"], num_experts=8)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.fixture
def down_by_token(monkeypatch):
    """Every one-token call with K-contiguous down weights runs _token_down_kernel (not only I >= 2048)."""
    from selector.plugins.triton_fused import configs as C

    monkeypatch.setattr(C, "TOKEN_DOWN_MIN_I", 1)
    C.clear_caches()
    yield
    C.clear_caches()


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("kw", [dict(), dict(bias=True), dict(gated=False), dict(interleaved=True, bias=True)],
                         ids=["plain", "bias", "ungated", "interleaved_bias"])  # fmt: skip
def test_one_token_down_by_output_tile_matches_the_reference(down_by_token, kw, k, monkeypatch):
    """The down launch is one program per output tile with one K loop over the k experts, the routing weights
    applied by gate_up (no counters, no fp32 rows)."""
    kw = dict(kw)
    case = make_case(1, 32, 16, 8, k, bias=kw.pop("bias", False), gated=kw.get("gated", True))
    seen = _decode_launches(monkeypatch)
    run_and_check(case, 8, TOL[torch.float32], **kw)
    assert seen == [K._pair_gemm_kernel, K._token_down_kernel]


@pytest.mark.parametrize("bk", [16, 32])
def test_one_token_down_by_output_tile_masks_each_experts_k_tail(down_by_token, bk):
    """I = 40 is not a multiple of BLOCK_K: each slot's last K step reads past its expert's rows only under a
    mask, and the next slot starts at its own row 0; H = 40 is not a multiple of BLOCK_N either."""
    case = make_case(1, 40, 40, 8, 3)
    tiles = {"BLOCK_N": 16, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}
    run_and_check(case, 8, TOL[torch.float32], config={"BLOCK_M": 16, "gate_up": tiles, "down": tiles})


def test_one_token_down_by_output_tile_skips_sentinels_and_repeats(down_by_token):
    case = make_case(1, 32, 16, 8, 4)
    ids = case["ids"].clone()
    ids[0, 1] = 8  # the expert-parallel sentinel
    run_and_check(case, 8, TOL[torch.float32], ids=ids)
    run_and_check(case, 8, TOL[torch.float32], ids=torch.tensor([[2, 2, 5, 5]], dtype=torch.int32, device=DEV))
    ids[0, :] = 8  # every slot elsewhere: this rank adds nothing
    out = K.fused_experts(case["x"], case["w1"], case["w2"], ids, case["wts"], num_experts=8)
    assert torch.equal(out, torch.zeros_like(out))


def test_one_token_down_by_output_tile_only_for_large_k_contiguous_experts(monkeypatch):
    from selector.plugins.triton_fused import configs as C

    assert K.token_down(C.TOKEN_DOWN_MIN_I, 1) and not K.token_down(C.TOKEN_DOWN_MIN_I - 1, 1)
    assert not K.token_down(C.TOKEN_DOWN_MIN_I, 4096), "transposed (N-contiguous) down weights keep pair blocks"
    case = make_case(1, 32, 16, 8, 2, transposed=True, bias=True)
    monkeypatch.setattr(C, "TOKEN_DOWN_MIN_I", 1)
    seen = _decode_launches(monkeypatch)
    run_and_check(case, 8, TOL[torch.float32], transposed=True)
    assert seen == [K._pair_gemm_kernel, K._pair_gemm_kernel]


@pytest.mark.parametrize("split", [2, 4, 8])
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(bias=True), dict(gated=False, bias=True), dict(transposed=True, interleaved=True, bias=True)],
    ids=["plain", "bias", "ungated_bias", "transposed_interleaved_bias"],
)  # fmt: skip
def test_one_token_split_down_matches_the_reference(split, kw, monkeypatch):
    """The down GEMM's SPLIT_K at one token: each (pair, tile) is SPLIT_K programs over runs of whole K steps,
    the weighted bias added by the first only, and the last of the token's k * SPLIT_K programs to arrive adds
    them all. I = 40 with BLOCK_K 16 is 3 K steps: the last run is short, and an 8-way split leaves programs
    with no steps at all (they add zero rows and still count)."""
    kw = dict(kw)
    case = make_case(1, 40, 40, 8, 3, bias=kw.pop("bias", False), gated=kw.get("gated", True),
                     transposed=kw.get("transposed", False))  # fmt: skip
    tiles = {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}
    config = {"BLOCK_M": 16, "gate_up": tiles, "down": dict(tiles, SPLIT_K=split)}
    seen = _decode_launches(monkeypatch)
    run_and_check(case, 8, TOL[torch.float32], config=config, **kw)
    assert seen == [K._pair_gemm_kernel, K._pair_gemm_kernel]


def test_one_token_split_down_skips_sentinels_and_counts_every_split():
    case = make_case(1, 32, 32, 8, 4)
    tiles = {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}
    config = {"BLOCK_M": 16, "gate_up": tiles, "down": dict(tiles, SPLIT_K=2)}
    ids = case["ids"].clone()
    ids[0, 1] = 8  # the expert-parallel sentinel
    run_and_check(case, 8, TOL[torch.float32], config=config, ids=ids)
    ids[0, :] = 8  # every slot elsewhere: the last of the 8 programs per tile still writes the zeros
    out = K.fused_experts(case["x"], case["w1"], case["w2"], ids, case["wts"], num_experts=8, config=config)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("part,split", [("down", 3), ("down", 0), ("gate_up", 2)])
def test_split_k_is_a_power_of_two_for_down_only(part, split):
    with pytest.raises(ValueError, match="SPLIT_K"):
        C.normalize({"BLOCK_M": 16, part: {"SPLIT_K": split}})


def test_two_tokens_take_the_sorted_blocks(monkeypatch):
    seen = _gemm_launches(monkeypatch, record=lambda args, consts: consts["BLOCK_M"])
    run_and_check(make_case(2, 32, 16, 8, 2), 8, TOL[torch.float32])
    assert len(seen) == 2  # both GEMMs through the grouped kernel, after an align


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 2, 4])
def test_gpu_one_token_is_deterministic_and_matches_the_reference(split):
    """Qwen3-30B-A3B's experts at one token, bf16: the down epilogue's last-arriving program adds the k * SPLIT_K
    rows in a fixed order, so repeated calls give the same bits whatever order the programs ran in."""
    case = make_case(1, 2048, 768, 128, 8, dtype=torch.bfloat16, device="cuda", seed=3)
    cfg = C.get_config(128, 2048, 768, 1, 8, torch.bfloat16, device="cuda")
    cfg = dict(cfg, down=dict(cfg["down"], SPLIT_K=split))
    run_and_check(case, 128, TOL[torch.bfloat16], config=cfg)
    args = (case["x"], case["w1"], case["w2"], case["ids"], case["wts"])
    outs = [K.fused_experts(*args, num_experts=128, config=cfg) for _ in range(50)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_shapes(shape, dtype):
    T, H, I, E, k = shape
    case = make_case(T, H, I, E, k, dtype=dtype, device="cuda", seed=T)
    run_and_check(case, E, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(interleaved=True),
        dict(transposed=True),
        dict(transposed=True, interleaved=True, bias=True),
        dict(bias=True),
        dict(activation="gelu"),
        dict(activation="gelu_tanh"),
        dict(activation="relu"),
        dict(gated=False, activation="gelu"),
        dict(gated=False, bias=True, transposed=True),
    ],
    ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()),
)
@pytest.mark.parametrize("T", [3, 300])
def test_gpu_options(kw, dtype, T):
    kw = dict(kw)
    bias = kw.pop("bias", False)
    case = make_case(T, 384, 192, 8, 2, dtype=dtype, device="cuda", bias=bias, gated=kw.get("gated", True),
                     transposed=kw.get("transposed", False), seed=T)  # fmt: skip
    run_and_check(case, 8, TOL[dtype], **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 40, 700])
def test_gpu_skewed_sentinel_empty(T):
    E, k = 16, 4
    case = make_case(T, 256, 128, E, k, dtype=torch.bfloat16, device="cuda", routing="skewed", seed=T)
    ids = case["ids"].clone()
    ids[ids >= 12] += E  # experts 12..15 get nothing; those slots become sentinels (>= E)
    run_and_check(case, E, TOL[torch.bfloat16], ids=ids)


class _NoCache(dict):
    """A launch cache that never holds a kernel."""

    def get(self, key, default=None):  # noqa: ANN001, ANN201
        return default

    def __setitem__(self, key, value) -> None:  # noqa: ANN001
        pass


@pytest.mark.gpu
def test_gpu_repeated_calls_fast_launch(monkeypatch):
    # the second and later calls with the same shapes go through the compiled-kernel cache (kernels.launch)
    outs = []
    for seed in range(3):
        case = make_case(70, 512, 256, 16, 4, dtype=torch.bfloat16, device="cuda", seed=seed, bias=seed == 2)
        outs.append(run_and_check(case, 16, TOL[torch.bfloat16]))
    case = make_case(70, 512, 256, 16, 4, dtype=torch.bfloat16, device="cuda", seed=9)
    args = (case["x"], case["w1"], case["w2"], case["ids"], case["wts"])
    fast = K.fused_experts(*args, num_experts=16)
    monkeypatch.setattr(L, "_LAUNCH_CACHE", _NoCache())  # every launch through Triton's own dispatch
    slow = K.fused_experts(*args, num_experts=16)
    assert torch.equal(fast, slow)


def test_fast_launches_go_to_the_current_stream_of_the_tensors_device(monkeypatch):
    """The cached launch path reads the raw handle of the current stream (Triton's own launcher does the same);
    a device without an index means the current device."""
    asked = []
    monkeypatch.setattr(L, "_RAW_STREAM", lambda index: asked.append(index) or 1000 + index)
    monkeypatch.setattr(L.torch.cuda, "current_device", lambda: 3)
    assert L.current_stream(torch.device("cuda", 1)) == 1001
    assert L.current_stream(torch.device("cuda")) == 1003
    assert asked == [1, 3]


@pytest.mark.gpu
def test_gpu_repeated_calls_on_a_side_stream_run_there():
    """A repeated call (the cached launch path) inside `torch.cuda.stream(side)` runs on that stream, after the
    side stream's own earlier work: its input is written there behind a long sleep, so kernels sent to another
    stream would read the NaN it held before."""
    case = make_case(70, 512, 256, 16, 4, dtype=torch.bfloat16, device="cuda", seed=4)
    args = (case["w1"], case["w2"], case["ids"], case["wts"])
    expected = K.fused_experts(case["x"], *args, num_experts=16)
    x = torch.full_like(case["x"], float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.copy_(case["x"])
        out = K.fused_experts(x, *args, num_experts=16)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (9, 0), reason="TMA needs sm_90+")
@pytest.mark.parametrize("kw", [{}, dict(interleaved=True, bias=True)], ids=str)
def test_gpu_tma_large_intermediate(kw, monkeypatch):
    # I >= SORTED_X_MIN_I: x copied into block order too
    kw = dict(kw)
    case = make_case(1200, 1024, 4096, 4, 2, dtype=torch.bfloat16, device="cuda", bias=kw.pop("bias", False),
                     routing="skewed")  # fmt: skip
    cfg = {"BLOCK_M": 128, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8},
           "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8}}  # fmt: skip
    seen = _gemm_launches(monkeypatch)
    run_and_check(case, 4, TOL[torch.bfloat16], config=cfg, **kw)
    assert seen[:2] == [(True, True, True), (True, True, False)], "x, weights and intermediate through TMA"
    via_tma = K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=4,
                              gate_up_bias=case["b1"], down_bias=case["b2"], config=cfg, **kw)  # fmt: skip
    monkeypatch.setattr(K, "_tma_device", lambda device: False)
    via_pointers = K.fused_experts(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=4,
                                   gate_up_bias=case["b1"], down_bias=case["b2"], config=cfg, **kw)  # fmt: skip
    assert torch.equal(via_tma, via_pointers)


@pytest.mark.gpu
def test_gpu_tf32():
    case = make_case(200, 512, 256, 8, 2, dtype=torch.float32, device="cuda")
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        run_and_check(case, 8, 1e-2)
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_cuda_graph(T, monkeypatch):
    monkeypatch.setattr(L, "POISON", False)
    E, k = 16, 4
    case = make_case(T, 512, 256, E, k, dtype=torch.bfloat16, device="cuda", seed=T)
    x, ids, wts = case["x"].clone(), case["ids"].clone(), case["wts"].clone()

    def f():
        return K.fused_experts(x, case["w1"], case["w2"], ids, wts, num_experts=E)

    f()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f()
    for seed in range(3):  # new routing and inputs each replay
        new = make_case(T, 512, 256, E, k, dtype=torch.bfloat16, device="cuda", seed=100 + seed)
        x.copy_(new["x"])
        ids.copy_(new["ids"])
        wts.copy_(new["wts"])
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = reference(x, case["w1"], case["w2"], ids, wts, E)
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert err < TOL[torch.bfloat16], err


@pytest.mark.compile
@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph(monkeypatch):
    monkeypatch.setattr(L, "POISON", False)
    E, k = 8, 2
    case = make_case(37, 256, 128, E, k, dtype=torch.bfloat16, device="cuda")

    @torch.compile(fullgraph=True)
    def f(x, w1, w2, ids, wts):
        return K.fused_experts(x * 1.0, w1, w2, ids, wts, num_experts=E) + 0.0

    out = f(case["x"], case["w1"], case["w2"], case["ids"], case["wts"])
    ref = reference(case["x"], case["w1"], case["w2"], case["ids"], case["wts"], E)
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < TOL[torch.bfloat16], err
