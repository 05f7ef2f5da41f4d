"""The device-side routing guard (selector.guard, plugins/triton_common/guard.py, the align and combine guard).

After a module's first call per shape (whose values the host checks), bad routing input is caught on the device:
ids outside [0, E) (bar the expert-parallel sentinel) and NaN / infinite weights. The affected tokens' rows are
NaN, every other token's row is bit for bit what a clean run gives with those slots dropped (the same module
marked expert-parallel, the bad slots set to the sentinel id E with weight 0: `_dropped`; the backends that put a
bad slot on expert 0 instead, the quantised kernels, SonicMoE and DeepGEMM: the run with the bad slots on expert 0),
and the fault is raised as ExpertsInputError at the next call through selector or at `selector.check()`.

Lanes: the torch sanitiser's tests run in the fast lane; tests that take the `guard_interpreter` fixture run the
Triton pieces (the Triton interpreter on a CPU, the compiled kernels on a GPU); `gpu` tests need CUDA, among them
`test_guard_cost_on_gpu`, which prints what the guard costs per call (its H200 figures: benchmarks/results/h200/routing_guard_cost.txt).
"""

from __future__ import annotations

import re

import pytest
import torch
from experts_fixtures import Layout, make_experts, same_rows

import selector
from selector import guard
from selector.errors import ExpertsInputError
from selector.validation import validate_inputs

E, H, I, K, T = 8, 16, 8, 2, 6
TORCH_BACKENDS = ("eager", "grouped_mm", "batched_mm")
INT32_MAX = (1 << 31) - 1
# (case name, bad slot value: an id, or a weight when it is a float)
BAD_CASES = [("id_E", E), ("id_E_plus_1000", E + 1000), ("id_minus_1", -1), ("id_int32_max", INT32_MAX),
             ("weight_nan", float("nan")), ("weight_inf", float("inf"))]  # fmt: skip
BAD_SLOTS = ((2, 1), (4, 0))  # (token, slot) pairs made bad
UNKNOWN_TAG = 1 << 30  # a layer tag no module holds


@pytest.fixture(autouse=True)
def _level_first(monkeypatch: pytest.MonkeyPatch):
    """Host value checks on the first call per shape only (the GPU default), so later calls reach the guard."""
    monkeypatch.setenv("SELECTOR_VALIDATE", "first")


@pytest.fixture
def guard_interpreter():
    """The Triton pieces run: the interpreter on a CPU (tests/conftest.py sets it), the kernels on a GPU."""
    pytest.importorskip("triton")


def _inputs(device="cpu", dtype=torch.float32, tokens=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)] or [torch.zeros(0, K).long()])
    ids = ids.reshape(tokens, K).to(device)
    w = torch.rand(tokens, K, generator=g).to(device, dtype)
    return x, ids, w


def _make_bad(ids, w, value, slots=BAD_SLOTS):
    ids, w = ids.clone(), w.clone()
    for t, j in slots:
        if isinstance(value, float):
            w[t, j] = value
        else:
            ids[t, j] = value
    return ids, w


def _on_expert_zero(ids, w, value, slots=BAD_SLOTS):
    """The routing the guard runs instead: bad slots on expert 0 (their weight does not matter to other rows)."""
    ids = ids.clone()
    if not isinstance(value, float):
        for t, j in slots:
            ids[t, j] = 0
    return ids, w


def _dropped(m, x, ids, w, slots=BAD_SLOTS):
    """The reference of a guard that drops bad slots: a clean run of `m` where those slots are dropped, i.e. `m`
    marked expert-parallel with the slots' ids set to the sentinel E and their weights to 0."""
    ids, w = ids.clone(), w.clone()
    for t, j in slots:
        ids[t, j], w[t, j] = m.num_experts, 0.0
    m._is_expert_parallel = True
    try:
        return m(x, ids, w)
    finally:
        m._is_expert_parallel = False


def _bad_tokens(slots=BAD_SLOTS, tokens=T):
    rows = torch.zeros(tokens, dtype=torch.bool)
    for t, _ in slots:
        rows[t] = True
    return rows


def _expect_fault(message: str, value, count: int, layer: str = "Experts #") -> None:
    assert f"experts layer {layer}" in message
    if isinstance(value, float):
        assert f"{count} NaN or infinite routing weight(s)" in message
    else:
        assert f"{count} expert id(s) outside [0, {E})" in message
        assert f"(one was {value})" in message
    assert "NaN outputs" in message


# ---- the torch sanitiser (CPU): the torch backends on later calls ------------------------------------------------


@pytest.mark.parametrize("case,value", BAD_CASES, ids=[c for c, _ in BAD_CASES])
@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_later_call_poisons_only_bad_tokens_and_raises_next_call(backend, case, value):
    m = make_experts(E, H, I, seed=1)
    selector.set_experts_implementation(m, backend)
    x, ids, w = _inputs()
    clean = m(x, ids, w)  # the first call of the shape: its values are checked on the host
    reference = _dropped(m, x, ids, w)
    bad_ids, bad_w = _make_bad(ids, w, value)
    out = m(x, bad_ids, bad_w)  # a later call: the device guard
    poisoned = torch.isnan(out).all(dim=1)
    assert torch.equal(poisoned.cpu(), _bad_tokens())
    assert torch.equal(out[~poisoned], reference[~poisoned])  # bit for bit
    torch.testing.assert_close(out[~poisoned], clean[~poisoned])
    with pytest.raises(ExpertsInputError) as caught:
        m(x, ids, w)  # the next call raises what the device recorded
    _expect_fault(str(caught.value), value, len(BAD_SLOTS))
    torch.testing.assert_close(m(x, ids, w), clean)  # reported once, then cleared


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_first_call_is_checked_on_the_host(backend):
    m = make_experts(E, H, I, seed=1)
    selector.set_experts_implementation(m, backend)
    x, ids, w = _inputs()
    bad_ids, _ = _make_bad(ids, w, -1)
    with pytest.raises(ExpertsInputError, match=re.escape(f"expert ids must lie in [0, {E}); got ids from -1")):
        m(x, bad_ids, w)


def test_check_raises_and_clears():
    m = make_experts(E, H, I, seed=1)
    selector.set_experts_implementation(m, "batched_mm")
    x, ids, w = _inputs()
    m(x, ids, w)
    m(x, *_make_bad(ids, w, E + 3))
    with pytest.raises(ExpertsInputError, match=r"2 expert id\(s\) outside \[0, 8\) \(one was 11\)"):
        selector.check()
    selector.check()  # nothing left


def test_check_names_the_layer_by_its_place_in_the_model():
    inner = make_experts(E, H, I, seed=1)
    model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.ModuleDict({"experts": inner}))
    selector.set_experts_implementation(inner, "grouped_mm")
    x, ids, w = _inputs()
    inner(x, ids, w)
    inner(x, *_make_bad(ids, w, float("nan")))
    with pytest.raises(ExpertsInputError, match=r"experts layer 1\.experts: .*2 NaN or infinite routing weight"):
        selector.check(model)


def test_counts_ids_and_weights_of_one_call_together():
    m = make_experts(E, H, I, seed=1)
    selector.set_experts_implementation(m, "eager")
    x, ids, w = _inputs()
    m(x, ids, w)
    bad_ids, bad_w = _make_bad(ids, w, 42, slots=((0, 0),))
    bad_ids, bad_w = _make_bad(bad_ids, bad_w, float("inf"), slots=((5, 1), (3, 0)))
    out = m(x, bad_ids, bad_w)
    assert torch.isnan(out).all(dim=1).tolist() == [True, False, False, True, False, True]
    assert guard.pending_faults("cpu") == {"bad_ids": 1, "bad_weights": 2, "layer": guard.layer_tag(m), "value": 42}
    with pytest.raises(ExpertsInputError, match=r"1 expert id\(s\) .* \(one was 42\) and 2 NaN or infinite"):
        selector.check()


def test_expert_parallel_sentinel_is_no_fault_but_beyond_it_is():
    m = make_experts(E, H, I, Layout(expert_parallel=True), seed=1)
    m._is_expert_parallel = True
    selector.set_experts_implementation(m, "grouped_mm")
    x, ids, w = _inputs()
    m(x, ids, w)
    sentinel_ids, _ = _make_bad(ids, w, E)
    out = m(x, sentinel_ids, w)
    assert torch.isfinite(out).all()
    selector.check()
    out = m(x, *_make_bad(ids, w, E + 1))
    assert torch.equal(torch.isnan(out).all(dim=1), _bad_tokens())
    with pytest.raises(ExpertsInputError, match=rf"outside \[0, {E}\) or the expert-parallel sentinel {E}"):
        selector.check()


def test_a_copied_module_gets_its_own_tag_despite_the_cached_guard():
    import copy

    m = make_experts(E, H, I, seed=1)
    selector.set_experts_implementation(m, "grouped_mm")
    x, ids, w = _inputs()
    m(x, ids, w)
    m(x, ids, w)  # the guard is now cached in m.__dict__, which a copy carries along
    twin = copy.deepcopy(m)
    twin(x, ids, w)
    twin(x, *_make_bad(ids, w, -1))
    assert guard.pending_faults("cpu")["layer"] == guard.layer_tag(twin) != guard.layer_tag(m)
    with pytest.raises(ExpertsInputError, match=rf"experts layer Experts #{guard.layer_tag(twin)}:"):
        selector.check()


def test_level_off_turns_the_guard_off(monkeypatch):
    monkeypatch.setenv("SELECTOR_VALIDATE", "off")
    m = make_experts(E, H, I, seed=1)
    selector.set_experts_implementation(m, "batched_mm")
    x, ids, w = _inputs()
    assert guard.guard_code(m, x.device) == 0
    out = m(x, ids, w.masked_fill(torch.zeros_like(w, dtype=torch.bool).index_fill(0, torch.tensor([1]), True), 1e30))
    assert torch.isfinite(out[0]).all()
    before = guard.pending_faults("cpu")
    m(x, ids, _make_bad(ids, w, float("nan"))[1])
    assert guard.pending_faults("cpu") == before
    selector.check()


def test_sanitize_torch_routes_bad_slots_to_expert_zero_with_nan_weight():
    g = guard.resolve(2 * UNKNOWN_TAG, torch.device("cpu"), E)
    ids = torch.tensor([[1, -1], [E, 3], [INT32_MAX, 2]], dtype=torch.int64)
    w = torch.tensor([[0.5, 0.5], [0.1, float("inf")], [0.3, 0.7]])
    clean_ids, clean_w = guard.sanitize_torch(ids, w, g)
    assert clean_ids.tolist() == [[1, 0], [0, 3], [0, 2]]
    assert torch.isnan(clean_w).tolist() == [[False, True], [True, True], [True, False]]
    assert guard.pending_faults("cpu") == {"bad_ids": 3, "bad_weights": 1, "layer": UNKNOWN_TAG, "value": -1}
    with pytest.raises(ExpertsInputError, match=rf"experts layer #{UNKNOWN_TAG}: "):
        selector.check()


def test_sanitize_torch_drop_sends_every_bad_slot_to_the_dropped_id():
    g = guard.resolve(2 * UNKNOWN_TAG, torch.device("cpu"), E)
    ids = torch.tensor([[1, -1], [E, 3], [INT32_MAX, 2]], dtype=torch.int64)
    w = torch.tensor([[0.5, 0.5], [0.1, float("inf")], [0.3, 0.7]])
    clean_ids, clean_w = guard.sanitize_torch(ids, w, g, drop=True)
    assert clean_ids.tolist() == [[1, E], [E, E], [E, 2]]  # the bad weight's slot (1, 1) leaves its expert too
    assert torch.isnan(clean_w).tolist() == [[False, True], [True, True], [True, False]]
    assert clean_w[0, 0] == 0.5 and clean_w[2, 1] == 0.7
    with pytest.raises(ExpertsInputError, match=r"3 expert id\(s\) .* and 1 NaN or infinite"):
        selector.check()


def test_expert_parallel_drop_keeps_the_sentinel_and_drops_beyond_it():
    g = guard.resolve(2 * UNKNOWN_TAG + 1, torch.device("cpu"), E)
    ids = torch.tensor([[E, 1], [E + 1, 2]])
    w = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    clean_ids, clean_w = guard.sanitize_torch(ids, w, g, drop=True)
    assert clean_ids.tolist() == [[E, 1], [E, 2]]
    assert torch.isnan(clean_w).tolist() == [[False, False], [True, False]]
    with pytest.raises(ExpertsInputError, match=r"1 expert id\(s\)"):
        selector.check()


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_dropped_bad_slot_changes_no_expert_batch(backend):
    """The bad slot's expert would otherwise get one row more: with the guard it gets none, as in the reference."""
    m = make_experts(E, H, I, seed=2)
    selector.set_experts_implementation(m, backend)
    x, ids, w = _inputs(tokens=16, seed=5)
    m(x, ids, w)
    slots = ((3, 0),)
    reference = _dropped(m, x, ids, w, slots)
    out = m(x, *_make_bad(ids, w, float("nan"), slots))
    poisoned = torch.isnan(out).all(dim=1)
    assert poisoned.tolist() == [t == 3 for t in range(16)]
    assert torch.equal(out[~poisoned], reference[~poisoned])
    with pytest.raises(ExpertsInputError, match=r"1 NaN or infinite routing weight"):
        selector.check()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int8, torch.bool])
@pytest.mark.parametrize("level", ["full", "first", "shapes"])
def test_narrow_id_dtypes_are_refused_with_the_fix(monkeypatch, dtype, level):
    monkeypatch.setenv("SELECTOR_VALIDATE", level)
    x, ids, w = _inputs()
    with pytest.raises(ExpertsInputError, match=re.escape("fix: pass top_k_index.long()")):
        validate_inputs(x, ids.to(dtype), w, num_experts=E, hidden_size=H)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int32_and_int64_ids_are_guarded_alike(dtype):
    m = make_experts(E, H, I, seed=1)
    selector.set_experts_implementation(m, "grouped_mm")
    x, ids, w = _inputs()
    ids = ids.to(dtype)
    m(x, ids, w)
    out = m(x, *_make_bad(ids, w, -1))
    assert torch.equal(torch.isnan(out).all(dim=1), _bad_tokens())
    with pytest.raises(ExpertsInputError, match=r"\(one was -1\)"):
        selector.check()


# ---- the Triton pieces: the interpreter on a CPU, the kernels on a GPU -------------------------------------------

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.interpreter
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_sanitize_kernel_matches_the_torch_sanitiser(guard_interpreter, ids_dtype):
    from selector.plugins.triton_common.guard import sanitize_triton

    device = torch.device(DEV)
    g = guard.resolve(2 * UNKNOWN_TAG, device, E)
    ids = torch.tensor([[1, -1], [E, 3], [INT32_MAX, 2], [E + 1000, 7]], dtype=ids_dtype, device=device)
    w = torch.tensor([[0.5, 0.5], [0.1, float("inf")], [0.3, 0.7], [float("nan"), 0.2]], device=device)
    got_ids, got_w = sanitize_triton(ids, w, g)
    faults = guard.pending_faults(device)
    assert faults["bad_ids"] == 4 and faults["bad_weights"] == 2 and faults["layer"] == UNKNOWN_TAG
    assert faults["value"] == INT32_MAX  # the largest bad id of the block
    with pytest.raises(ExpertsInputError, match=rf"experts layer #{UNKNOWN_TAG}: .*4 expert id\(s\) .*and 2 NaN"):
        guard.check()
    want_ids, want_w = guard.sanitize_torch(ids, w, g)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(torch.isnan(got_w), torch.isnan(want_w))
    assert torch.equal(got_w[~torch.isnan(got_w)], want_w[~torch.isnan(want_w)])
    with pytest.raises(ExpertsInputError):
        guard.check()  # the torch sanitiser recorded the same faults


@pytest.mark.interpreter
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_sanitize_kernel_drop_matches_the_torch_sanitiser(guard_interpreter, ids_dtype):
    from selector.plugins.triton_common.guard import sanitize_triton

    device = torch.device(DEV)
    g = guard.resolve(2 * UNKNOWN_TAG, device, E)
    ids = torch.tensor([[1, -1], [E, 3], [INT32_MAX, 2], [5, 7]], dtype=ids_dtype, device=device)
    w = torch.tensor([[0.5, 0.5], [0.1, float("inf")], [0.3, 0.7], [float("nan"), 0.2]], device=device)
    got_ids, got_w = sanitize_triton(ids, w, g, drop=True)
    assert got_ids.cpu().tolist() == [[1, E], [E, E], [E, 2], [E, 7]]
    with pytest.raises(ExpertsInputError, match=r"3 expert id\(s\) .*and 2 NaN"):
        guard.check()
    want_ids, want_w = guard.sanitize_torch(ids, w, g, drop=True)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(torch.isnan(got_w), torch.isnan(want_w))
    assert torch.equal(got_w[~torch.isnan(got_w)], want_w[~torch.isnan(want_w)])
    guard.clear()


@pytest.mark.interpreter
@pytest.mark.parametrize("tokens,hidden", [(1, 200), (5, 200), (70, 200), (3, 2100)])  # 2100: two column blocks
def test_grouped_mm_triton_combine_matches_the_torch_tail(guard_interpreter, tokens, hidden):
    """The one-launch combine of grouped_mm on a GPU against the torch tail it replaces: the same fp32 sums (up to
    their order), the rows of ids >= E (sentinel, dropped) counting 0 * weight: 0, or NaN for a NaN weight."""
    from selector.plugins.grouped_mm.combine import weighted_combine

    g = torch.Generator().manual_seed(tokens)
    k = 3  # not a power of two; H not a multiple of the column block
    ids = torch.randint(0, E + 1, (tokens, k), generator=g)  # E: the sentinel
    w = torch.rand(tokens, k, generator=g)
    ids[0, 1], w[0, 1] = E, float("nan")  # a slot the guard dropped
    flat = ids.reshape(-1).to(DEV)
    sorted_ids, order = torch.sort(flat, stable=True)
    h = torch.randn(flat.numel(), hidden, generator=g).to(DEV)
    h[sorted_ids >= E] = float("nan")  # never written: any bits
    got = weighted_combine(h, order, flat, w.reshape(-1).to(DEV), tokens, E, torch.float32)
    masked = h.masked_fill((sorted_ids >= E).unsqueeze(-1), 0.0)
    unsorted = torch.empty_like(masked)
    unsorted[order] = masked * w.reshape(-1).to(DEV)[order].unsqueeze(-1)
    want = unsorted.view(tokens, k, hidden).sum(dim=1)
    assert torch.isnan(got).all(dim=1).tolist() == [t == 0 for t in range(tokens)]
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("case,value", BAD_CASES, ids=[c for c, _ in BAD_CASES])
# one token: no align or combine launch (the decode pair blocks check in gate_up, poison in down's epilogue);
# one align program; several chunks (T*k > SINGLE_ALIGN_MAX)
@pytest.mark.parametrize("tokens", [1, T, 600])
def test_fused_align_and_combine_guard(guard_interpreter, case, value, tokens):
    from selector.plugins.triton_fused.forward import triton_fused_experts_forward

    m = make_experts(E, H, I, seed=1, device=DEV)
    x, ids, w = _inputs(DEV, tokens=tokens)
    slots = ((0, 0), (0, 1)) if tokens == 1 else BAD_SLOTS + ((tokens - 1, 1),)  # one token: both its slots
    clean = triton_fused_experts_forward(m, x, ids, w)
    bad_ids, bad_w = _make_bad(ids, w, value, slots)
    out = triton_fused_experts_forward(m, x, bad_ids, bad_w)
    poisoned = torch.isnan(out).all(dim=1)
    assert torch.equal(poisoned.cpu(), _bad_tokens(slots, tokens))
    assert same_rows(out[~poisoned], clean[~poisoned])  # other tokens: the same bits on a GPU
    with pytest.raises(ExpertsInputError) as caught:
        selector.check()
    _expect_fault(str(caught.value), value, len(slots))


@pytest.mark.interpreter
@pytest.mark.parametrize("case,value", BAD_CASES, ids=[c for c, _ in BAD_CASES])
def test_one_token_down_by_output_tile_guard(guard_interpreter, case, value, monkeypatch):
    """One token whose down projection runs _token_down_kernel (large K-contiguous experts): gate_up's first
    program records the faults, the down launch poisons the token."""
    from selector.plugins.triton_fused import configs as C
    from selector.plugins.triton_fused.forward import triton_fused_experts_forward

    monkeypatch.setattr(C, "TOKEN_DOWN_MIN_I", 1)
    C.clear_caches()
    m = make_experts(E, H, I, seed=1, device=DEV)
    x, ids, w = _inputs(DEV, tokens=1)
    clean = triton_fused_experts_forward(m, x, ids, w)
    assert torch.isfinite(clean).all()
    bad_ids, bad_w = _make_bad(ids, w, value, ((0, 1),))
    out = triton_fused_experts_forward(m, x, bad_ids, bad_w)
    assert torch.isnan(out).all()
    with pytest.raises(ExpertsInputError) as caught:
        selector.check()
    _expect_fault(str(caught.value), value, 1)
    C.clear_caches()


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["grouped", "batched"])
@pytest.mark.parametrize("case,value", [("id_minus_1", -1), ("id_E_plus_1000", E + 1000), ("weight_nan", float("nan"))],
                         ids=["id_minus_1", "id_E_plus_1000", "weight_nan"])  # fmt: skip
def test_quantised_kernels_guard(guard_interpreter, case, value, mode):
    """fp8 experts through the quantised kernels (the sanitiser before their routing): the same contract."""
    from selector.plugins.quant_kernels.forward import quant_experts_forward

    from selector import quant

    m = quant.quantize_experts(make_experts(E, 64, 32, seed=4, device=DEV), "fp8_block", "float32", (32, 32))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, 64, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(DEV)
    w = torch.rand(T, K, generator=g).to(DEV)
    reference = quant_experts_forward(m, x, *_on_expert_zero(ids, w, value), mode=mode)
    out = quant_experts_forward(m, x, *_make_bad(ids, w, value), mode=mode)
    poisoned = torch.isnan(out).all(dim=1)
    assert torch.equal(poisoned.cpu(), _bad_tokens())
    assert torch.equal(out[~poisoned], reference[~poisoned])
    with pytest.raises(ExpertsInputError) as caught:
        selector.check()
    _expect_fault(str(caught.value), value, len(BAD_SLOTS))


# ---- GPU: every CUDA backend, eager and under CUDA-graph replay ------------------------------------------------

# (name, what selector is asked for, weight format, reference for the other tokens' bits)
# "dropped": `_dropped`; "expert0": the bad slots on expert 0 (backends whose guard computes them there);
# None: auto, whose choice may differ between the module and its expert-parallel reference (tolerance only)
GPU_CASES = {
    "triton_fused": ("triton_fused", "dense", "dropped"),
    "grouped_mm": ("grouped_mm", "dense", "dropped"),
    "grouped_mm_autograd": ("grouped_mm", "dense", "dropped"),  # its torch tail: autograd records the call
    "batched_mm": ("batched_mm", "dense", "dropped"),
    "eager": ("eager", "dense", "dropped"),
    "auto": ("auto", "dense", None),
    "quant_grouped": ("grouped_mm", "fp8_block", "expert0"),  # fp8 experts run plugins/quant_kernels
    "quant_batched": ("batched_mm", "fp8_block", "expert0"),
}
GRAPH_CASES = tuple(name for name in GPU_CASES if name != "eager")  # eager reads the experts hit on the host
GPU_TOKENS = 64


def _gpu_case(name: str):
    """(module, inputs dtype, hidden size) of one GPU case, its backend requested; inference (no parameter wants
    a gradient) but for the autograd case."""
    request, fmt, _ = GPU_CASES[name]
    if fmt == "dense":
        m, dtype, hidden = make_experts(E, H, I, dtype=torch.bfloat16, device="cuda", seed=3), torch.bfloat16, H
    else:
        from selector import quant

        base = make_experts(E, 64, 32, seed=4, device="cuda")
        m, dtype, hidden = quant.quantize_experts(base, fmt, "float32", (32, 32)), torch.float32, 64
    if not name.endswith("_autograd"):
        m.requires_grad_(False)
    selector.set_experts_implementation(m, request)
    return m, dtype, hidden


def _gpu_inputs(hidden: int, dtype, tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to("cuda", dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).cuda()
    w = torch.rand(tokens, K, generator=g).to("cuda", dtype)
    return x, ids, w


def _reference(name: str, m, x, ids, w, value, slots=BAD_SLOTS):
    kind = GPU_CASES[name][2]
    if kind == "dropped":
        return _dropped(m, x, ids, w, slots)
    if kind == "expert0":
        return m(x, *_on_expert_zero(ids, w, value, slots))
    return None


def _check_rows(out, reference, clean, tokens: int, slots=BAD_SLOTS) -> None:
    poisoned = torch.isnan(out).all(dim=1)
    assert torch.equal(poisoned.cpu(), _bad_tokens(slots, tokens))
    assert torch.isfinite(out[~poisoned]).all()
    if reference is not None:
        assert torch.equal(out[~poisoned], reference[~poisoned])  # bit for bit
    torch.testing.assert_close(out[~poisoned], clean[~poisoned], atol=2e-2, rtol=2e-2)


def _same(out, want, exact: bool) -> None:
    if exact:
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out, want)


@pytest.mark.smoke
@pytest.mark.gpu
@pytest.mark.parametrize("case,value", BAD_CASES, ids=[c for c, _ in BAD_CASES])
@pytest.mark.parametrize("name", tuple(GPU_CASES))
def test_gpu_backend_guard_eager(name, case, value):
    """First call of a shape: the host check raises before any kernel runs. Later calls: the device guard, twice
    (the first faulty call and a later one; triton_fused's own graph records at first use and replays after)."""
    m, dtype, hidden = _gpu_case(name)
    x, ids, w = _gpu_inputs(hidden, dtype, GPU_TOKENS)
    with pytest.raises(ExpertsInputError, match=r"expert ids must lie in|NaN or infinite value"):
        m(x, *_make_bad(ids, w, value))  # the first call of this shape
    selector.check()  # the host check raised before the backend ran: nothing recorded on the device
    clean = m(x, ids, w)
    reference = _reference(name, m, x, ids, w, value)
    for _ in range(2):
        out = m(x, *_make_bad(ids, w, value))
        _check_rows(out, reference, clean, GPU_TOKENS)
        torch.cuda.synchronize()
        with pytest.raises(ExpertsInputError) as caught:
            m(x, ids, w)  # the next call raises what the device recorded
        _expect_fault(str(caught.value), value, len(BAD_SLOTS))
        assert torch.equal(m(x, ids, w), clean)  # reported once, cleared; the clean call unchanged
        selector.check()


@pytest.mark.gpu
@pytest.mark.parametrize("case,value", BAD_CASES, ids=[c for c, _ in BAD_CASES])
@pytest.mark.parametrize("name", GRAPH_CASES)
def test_gpu_backend_guard_under_graph_replay(name, case, value):
    """A CUDA graph captured on clean inputs: the first faulty replay and a later one (a clean replay between)
    each poison only the bad tokens' rows and are raised by `selector.check()`; clean replays record nothing."""
    m, dtype, hidden = _gpu_case(name)
    x, ids, w = _gpu_inputs(hidden, dtype, 8)
    clean = m(x, ids, w)
    reference = _reference(name, m, x, ids, w, value)
    m(x, ids, w)
    static = (x.clone(), ids.clone(), w.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(*static)
    graph.replay()
    torch.cuda.synchronize()
    selector.check()  # a clean replay records nothing
    exact = GPU_CASES[name][2] is not None  # auto may choose anew while the stream captures
    _same(out, clean, exact)
    bad_ids, bad_w = _make_bad(ids, w, value)
    for _ in range(2):
        static[1].copy_(bad_ids)
        static[2].copy_(bad_w)
        graph.replay()
        with pytest.raises(ExpertsInputError) as caught:
            selector.check()
        _expect_fault(str(caught.value), value, len(BAD_SLOTS))
        _check_rows(out, reference, clean, 8)
        static[1].copy_(ids)
        static[2].copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        selector.check()
        _same(out, clean, exact)


def _time_calls(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls  # microseconds per call


# case -> (requested backend, weight format, token counts); batched_mm: 39 GB of gathered weights at T=512, too
# many above; the fp8 cases run plugins/quant_kernels (fp8 blocks of 128, bf16 activations)
COST_CASES = {"triton_fused": ("triton_fused", "dense", (1, 8, 512, 4096)),
              "grouped_mm": ("grouped_mm", "dense", (1, 8, 512, 4096)),
              "batched_mm": ("batched_mm", "dense", (1, 8, 512)), "eager": ("eager", "dense", (1, 8, 512)),
              "quant_grouped": ("grouped_mm", "fp8_block", (1, 8, 512, 4096)),
              "quant_batched": ("batched_mm", "fp8_block", (1, 8, 512))}  # fmt: skip
COST_ROUNDS = 7
SANITIZER_KERNEL = "_sanitize_kernel"  # the guard's own launch where it is not fused into the backend's routing


def _guard_kernel_share(run, monkeypatch) -> float | None:  # noqa: ANN001
    """The guard kernel's share of the device time of a few calls (torch.profiler, the backends' own graphs off so
    that every kernel is seen; None where no kernel of its own ran: the guard is fused into the backend's align)."""
    from torch.profiler import ProfilerActivity, profile

    with monkeypatch.context() as patch:
        for variable in ("SELECTOR_TRITON_FUSED_GRAPHS", "SELECTOR_QUANT_GRAPHS"):
            patch.setenv(variable, "0")
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in kernels)
    guard_time = sum(e.device_time_total for e in kernels if SANITIZER_KERNEL in e.name)
    return None if guard_time == 0 or total == 0 else guard_time / total


def _cost_layer(fmt: str):
    m = make_experts(128, 2048, 768, dtype=torch.bfloat16, device="cuda", seed=5).requires_grad_(False)  # inference
    if fmt == "dense":
        return m
    from selector import quant

    return quant.quantize_experts(m, fmt, "float32", (128, 128))


@pytest.mark.gpu
def test_guard_cost_on_gpu(monkeypatch, capsys):
    """Prints the guard's cost per call, Qwen3-30B-A3B experts (H 2048, I 768, E 128, k 8), bf16, inference (no
    gradient recorded), per backend and T: T <= 8 under CUDA-graph replay of the whole call (eager, which cannot
    be captured, back to back), larger T back to back; guard on ("first") against off in interleaved rounds of
    ~40 ms each, median and spread (max - min) of the rounds; and the guard kernel's share of the device time
    (profiled, free of host noise). Asserts the guarded clean output equals the unguarded one bit for bit."""
    rows = []
    for case, (backend, fmt, token_counts) in COST_CASES.items():
        m = _cost_layer(fmt)
        selector.set_experts_implementation(m, backend)
        for tokens in token_counts:
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, 2048, generator=g).to("cuda", torch.bfloat16)
            ids = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(tokens)]).cuda()
            w = torch.rand(tokens, 8, generator=g).to("cuda", torch.bfloat16)
            runs, outs = {}, {}
            for level in ("off", "first"):
                monkeypatch.setenv("SELECTOR_VALIDATE", level)
                outs[level] = m(x, ids, w)
                if tokens <= 8 and backend != "eager":
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        captured = m(x, ids, w)
                    graph.replay()
                    torch.cuda.synchronize()
                    outs[level] = captured.clone()
                    runs[level] = graph.replay
                else:
                    runs[level] = lambda: m(x, ids, w)  # noqa: B023 - timed before the next iteration
            assert torch.equal(outs["off"], outs["first"]), (case, tokens)
            monkeypatch.setenv("SELECTOR_VALIDATE", "first")
            share = _guard_kernel_share(lambda: m(x, ids, w), monkeypatch)  # noqa: B023
            probe = _time_calls(runs["first"], 3)
            calls = max(5, min(500, int(40e3 / max(probe, 1.0))))
            times = {"off": [], "first": []}
            for _ in range(COST_ROUNDS):
                for level in ("off", "first"):
                    monkeypatch.setenv("SELECTOR_VALIDATE", level)
                    times[level].append(_time_calls(runs[level], calls))
            rows.append((case, tokens, times["off"], times["first"], share))
    selector.check()
    with capsys.disabled():
        print(f"\nrouting guard cost (us per call; T <= 8 graph replay but eager, else back to back; median of "
              f"{COST_ROUNDS} interleaved rounds, spread = max - min; guard kernel: its share of the profiled "
              f"device time, 'fused' where it runs inside the backend's own routing kernel):")
        print(f"{'case':<15}{'T':>6}{'off':>10}{'spread':>8}{'guarded':>10}{'spread':>8}{'extra':>9}{'extra %':>9}"
              f"{'guard kernel':>14}")
        for case, tokens, off_t, on_t, share in rows:
            off, on = sorted(off_t)[len(off_t) // 2], sorted(on_t)[len(on_t) // 2]
            kernel = "fused" if share is None else f"{100 * share:.2f}%"
            print(f"{case:<15}{tokens:>6}{off:>10.1f}{max(off_t) - min(off_t):>8.1f}{on:>10.1f}"
                  f"{max(on_t) - min(on_t):>8.1f}{on - off:>9.2f}{100 * (on - off) / off:>8.1f}%{kernel:>14}")
    assert all(min(off_t) > 0 and min(on_t) > 0 for _, _, off_t, on_t, _ in rows)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_no_tokens_pass_through_the_guard(backend):
    m = make_experts(E, H, I, seed=1)
    selector.set_experts_implementation(m, backend)
    x, ids, w = _inputs(tokens=0)
    assert m(x, ids, w).shape == (0, H)
    selector.check()
