"""Tile tuning for triton_fused (plugins/triton_fused/tune.py `tune_kernels`, the user tile table in configs.py).

No kernels run here: the search is driven by fake timers (a function from a timing task to seconds) and a fake
clock that each timing advances, so budget and pruning are exact. Real kernels: test_tile_tuning_kernels.py.
"""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from selector.plugins.triton_fused import configs as C
from selector.plugins.triton_fused import tune as TU

from selector.types import Problem

FAKE_GPU = "Fake GPU"  # no shipped table has this name
SHAPE = (40, 1536, 896, 6)  # E, H, I, k: not in the shipped H200 table
PROBLEM = Problem(num_experts=40, hidden_size=1536, intermediate_size=896, top_k=6)


@pytest.fixture(autouse=True)
def _tables(tmp_path, monkeypatch):
    """Every test reads and writes tables under tmp_path only; the caches start and end empty."""
    monkeypatch.delenv("SELECTOR_TRITON_FUSED_CONFIG_DIR", raising=False)
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", str(tmp_path / "user"))
    C.clear_caches()
    yield
    C.clear_caches()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_kernel_seconds(task: TU.Task) -> float:
    """A made-up kernel time with one clear optimum per BLOCK_M and GEMM, BLOCK_M 128 fastest overall."""
    if task.part == "align":
        return 10e-6
    c = task.config
    base = 100e-6 if task.part == "gate_up" else 60e-6
    fit = abs(math.log2(c["BLOCK_N"] / 128)) + abs(math.log2(c["BLOCK_K"] / 64)) + (c["num_warps"] != 8)
    return base * (1 + 0.1 * fit + 0.1 * c["num_stages"] / 4) * (64 / task.block_m) ** 0.1


class FakeGpu:
    """measure(task): advances the fake clock by a compile for a new tile config, less for a seen one."""

    def __init__(self, clock: FakeClock, compile_s: float = 1.0, repeat_s: float = 0.05, seconds=fake_kernel_seconds):
        self.clock, self.compile_s, self.repeat_s, self.seconds = clock, compile_s, repeat_s, seconds
        self.compiled: set[tuple] = set()
        self.tasks: list[TU.Task] = []

    def __call__(self, task: TU.Task) -> float:
        self.tasks.append(task)
        self.clock.now += self.repeat_s if task.kernel in self.compiled else self.compile_s
        self.compiled.add(task.kernel)
        return self.seconds(task)


def _cells(tokens=(4096,), shape=SHAPE):
    e, h, i, k = shape
    return [TU.CellSearch(t, TU.candidate_plan(e, h, i, k, t, prior=TU._prior()), TU.token_weight(t))
            for t in TU.token_order(tokens)]  # fmt: skip


def _brute_force(cell: TU.CellSearch) -> tuple[dict, float]:
    best = None
    for bm, parts in cell.plan.items():
        total = fake_kernel_seconds(TU.Task(cell.num_tokens, bm, "align"))
        chosen = {"BLOCK_M": bm}
        for part in TU.GEMM_PARTS:
            t, cfg = min(((fake_kernel_seconds(TU.Task(cell.num_tokens, bm, part, TU._cfg_items(c))), c)
                          for c in parts[part]), key=lambda timed: timed[0])  # fmt: skip
            total += t
            chosen[part] = cfg
        if best is None or total < best[1]:
            best = (C.normalize(chosen), total)
    return best


# --- candidates and order -------------------------------------------------------------------------------------


def test_token_counts_are_tuned_largest_first_and_large_ones_get_more_budget():
    assert TU.token_order([1, 4096, 64, 4096, 512, 16384, 8]) == [16384, 4096, 512, 64, 8, 1]
    assert TU.token_weight(4096) > TU.token_weight(64) > TU.token_weight(1)


def test_plan_times_the_heuristics_tiles_first_then_shipped_winners():
    e, h, i, k = SHAPE
    default = C.normalize(C.default_config(e, h, i, 4096, k))
    plan = TU.candidate_plan(e, h, i, k, 4096, prior=TU._prior())
    assert next(iter(plan)) == default["BLOCK_M"]
    assert set(plan) == {default["BLOCK_M"], *TU.block_m_candidates(4096, k, e)}
    for part in TU.GEMM_PARTS:
        tiles = plan[default["BLOCK_M"]][part]
        assert tiles[0] == default[part]
        assert len({TU._cfg_items(c) for c in tiles}) == len(tiles)  # nothing timed twice
    # the shipped H200 table's BLOCK_M 128 down tile is (256, 64, 8 warps, 3 stages): timed right after the baseline
    winners = TU.prior_winners(TU._prior(), 128, "down")
    assert winners and plan[128]["down"].index(winners[0]) <= 1
    # a tile the tuner's own list would never allow here is not taken from the priors
    fake_prior = {"x": {1: C.normalize({"BLOCK_M": 128, "down": {"BLOCK_N": 16, "BLOCK_K": 16}})}}
    odd = C.normalize({"BLOCK_M": 128, "down": {"BLOCK_N": 16, "BLOCK_K": 16}})["down"]
    assert odd not in TU.candidate_plan(e, h, i, k, 4096, prior=fake_prior)[128]["down"]


# --- the search with a fake timer -----------------------------------------------------------------------------


def test_search_with_room_times_everything_and_keeps_the_best():
    clock = FakeClock()
    gpu = FakeGpu(clock)
    cells = _cells((4096,))
    out = TU.run_search(cells, gpu, 10_000.0, clock=clock)
    cell = out.cells[4096]
    assert cell.done and not out.cut_short
    want_cfg, want_s = _brute_force(cell)
    got_cfg, got_s = cell.result()
    assert got_cfg == want_cfg
    assert got_s == pytest.approx(want_s)
    assert cell.default_s() is not None and cell.default_s() >= got_s
    assert len({t for t in gpu.tasks}) == len(gpu.tasks)  # no timing repeated


def test_search_never_starts_a_timing_that_would_end_past_the_budget():
    clock = FakeClock()
    gpu = FakeGpu(clock, compile_s=1.0)
    start = clock.now
    out = TU.run_search(_cells((16384, 4096, 512)), gpu, 12.0, clock=clock)
    assert clock.now - start <= 12.0
    assert out.cut_short
    assert 0 < out.measured == len(gpu.tasks)
    assert len(gpu.compiled) <= 12  # each new tile config costs a 1 s compile; seen ones are cheap
    # what was found is kept: each cell's choice is the best of what it measured
    for t, cell in out.cells.items():
        if cell.result() is None:
            continue
        cfg, _ = cell.result()
        measured = [x for x in gpu.tasks if x.num_tokens == t]
        for part in TU.GEMM_PARTS:
            mine = [fake_kernel_seconds(x) for x in measured if x.part == part and x.block_m == cfg["BLOCK_M"]]
            chosen = TU.Task(t, cfg["BLOCK_M"], part, TU._cfg_items(cfg[part]))
            assert fake_kernel_seconds(chosen) == min(mine)


def test_tight_budget_goes_to_large_token_counts_first():
    clock = FakeClock()
    gpu = FakeGpu(clock, compile_s=1.0)
    out = TU.run_search(_cells((1, 8, 4096)), gpu, 6.0, clock=clock)
    assert out.cells[4096].result() is not None  # its first round (align + two GEMMs) fits
    assert out.cells[1].result() is None  # never reached: left on the heuristics' tiles
    assert gpu.tasks[0].num_tokens == 4096


def test_unused_share_goes_to_later_token_counts_and_cached_kernels_cost_little():
    clock = FakeClock()
    gpu = FakeGpu(clock, compile_s=1.0, repeat_s=0.01)
    out = TU.run_search(_cells((4096, 16384)), gpu, 200.0, clock=clock)
    assert not out.cut_short
    # the same BLOCK_M and tiles compile once for both token counts
    assert len(gpu.compiled) < len(gpu.tasks)


def test_tiles_that_fail_to_run_are_skipped():
    clock = FakeClock()

    def seconds(task):
        if task.part == "down" and task.config.get("BLOCK_N") == 256:
            raise RuntimeError("out of resources: shared memory")
        return fake_kernel_seconds(task)

    out = TU.run_search(_cells((4096,)), FakeGpu(clock, seconds=seconds), 10_000.0, clock=clock)
    cfg, _ = out.cells[4096].result()
    assert cfg["down"]["BLOCK_N"] != 256


def test_a_block_m_far_behind_gets_no_more_timings():
    clock = FakeClock()

    def seconds(task):
        return fake_kernel_seconds(task) * (3.0 if task.block_m == 64 else 1.0)

    gpu = FakeGpu(clock, seconds=seconds)
    out = TU.run_search(_cells((4096,)), gpu, 10_000.0, clock=clock)
    assert out.cells[4096].result()[0]["BLOCK_M"] == 128
    timed_64 = [t for t in gpu.tasks if t.block_m == 64 and t.part != "align"]
    assert len(timed_64) == 4  # two rounds of gate_up + down, then dropped
    assert len([t for t in gpu.tasks if t.block_m == 128 and t.part != "align"]) > 4


def test_zero_budget_measures_nothing():
    clock = FakeClock()
    gpu = FakeGpu(clock)
    out = TU.run_search(_cells((4096,)), gpu, 0.0, clock=clock)
    assert gpu.tasks == [] and out.cut_short and out.cells[4096].result() is None


# --- tune_kernels: what is tuned, what is written -------------------------------------------------------------


def _tune(problem=PROBLEM, tokens=(1, 512, 4096), budget=10_000.0, compile_s=0.5, **kw):
    clock = FakeClock()
    gpu = FakeGpu(clock, compile_s=compile_s)
    kw.setdefault("device_name", FAKE_GPU)
    return TU.tune_kernels(problem, tokens, budget, measure=gpu, clock=clock, **kw), gpu


def test_tune_kernels_writes_the_user_table_and_get_config_reads_it_first(tmp_path, monkeypatch):
    summary, _ = _tune()
    path = tmp_path / "user" / C.config_file_name(FAKE_GPU)
    assert summary["written_to"] == str(path) and path.exists()
    assert summary["tokens_tuned"] == [4096, 512, 1] and not summary["cut_short"] and summary["skipped"] is None
    assert summary["seconds"] <= summary["budget_s"]
    assert all(summary["time_us"][t] <= summary["default_us"][t] for t in summary["tokens_tuned"])
    doc = json.loads(path.read_text())
    key = C.shape_key(*SHAPE)
    assert doc["device"] == FAKE_GPU and doc["tuned"][key] == [1, 512, 4096]
    assert {int(t) for t in doc["configs"][key]} == {1, 512, 4096}
    # get_config on this GPU: the tuned tiles, in the same process (caches were cleared by the write)
    monkeypatch.setattr(C, "_device_name", lambda index: FAKE_GPU)
    e, h, i, k = SHAPE
    for t in (1, 512, 4096):
        assert C.get_config(e, h, i, t, k, torch.bfloat16, device="cuda") == summary["configs"][t]
    assert C.get_config(e, h, i, 4096, k, torch.bfloat16, device="cpu") == C.normalize(
        C.default_config(e, h, i, 4096, k))  # fmt: skip


def test_user_table_wins_over_the_shipped_one_for_its_shapes(tmp_path, monkeypatch):
    shipped_dir = tmp_path / "shipped"
    shipped_dir.mkdir()
    key_a, key_b = C.shape_key(8, 64, 32, 2), C.shape_key(4, 64, 32, 2)
    shipped = {"configs": {key_a: {"64": {"BLOCK_M": 32}}, key_b: {"64": {"BLOCK_M": 32}}}}
    (shipped_dir / C.config_file_name(FAKE_GPU)).write_text(json.dumps(shipped))
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_CONFIG_DIR", str(shipped_dir))
    monkeypatch.setattr(C, "_device_name", lambda index: FAKE_GPU)
    C.write_user_entries(FAKE_GPU, key_a, {64: {"BLOCK_M": 128}}, [64])
    assert C.get_config(8, 64, 32, 64, 2, device="cuda")["BLOCK_M"] == 128  # user table
    assert C.get_config(4, 64, 32, 64, 2, device="cuda")["BLOCK_M"] == 32  # shipped table
    # a shape neither holds borrows the nearest tabled cell's tiles: key_a's (16 rows per expert against 8), the user's
    assert C.get_config(16, 64, 32, 64, 2, device="cuda")["BLOCK_M"] == 128


def test_user_table_merges_and_is_replaced_atomically(tmp_path, monkeypatch):
    key_a, key_b = C.shape_key(8, 64, 32, 2), C.shape_key(4, 64, 32, 2)
    path = C.write_user_entries(FAKE_GPU, key_a, {1: {"BLOCK_M": 16}, 64: {"BLOCK_M": 32}}, [1, 64])
    C.write_user_entries(FAKE_GPU, key_a, {64: {"BLOCK_M": 64}, 512: {"BLOCK_M": 128}}, [512])
    C.write_user_entries(FAKE_GPU, key_b, {8: {"BLOCK_M": 16}}, [8])
    table = C.load_user_table(FAKE_GPU)
    assert {t: c["BLOCK_M"] for t, c in table[key_a].items()} == {1: 16, 64: 64, 512: 128}
    assert set(table[key_b]) == {8}
    assert C.user_tuned_tokens(FAKE_GPU, key_a) == {1, 64, 512}
    before = path.read_text()

    replaced = []
    real_replace = os.replace

    def failing_replace(src, dst):
        replaced.append((src, dst))
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        C.write_user_entries(FAKE_GPU, key_b, {8: {"BLOCK_M": 64}}, [8])
    assert path.read_text() == before  # the old table stays whole
    assert replaced and os.path.dirname(replaced[0][0]) == str(path.parent)  # temp file beside it, then replace
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left behind
    monkeypatch.setattr(os, "replace", real_replace)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"configs": [1]}'])
def test_malformed_user_table_is_ignored_with_a_warning(tmp_path, monkeypatch, text):
    path = C.user_table_path(FAKE_GPU)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    monkeypatch.setattr(C, "_device_name", lambda index: FAKE_GPU)
    with pytest.warns(RuntimeWarning, match="ignoring the tuned tile table"):
        cfg = C.get_config(8, 64, 32, 64, 2, device="cuda")
    assert cfg == C.normalize(C.default_config(8, 64, 32, 64, 2))
    # tuning again replaces it with a good table (with a warning that it did)
    with pytest.warns(RuntimeWarning) as seen:
        summary, _ = _tune(tokens=(64,))
    assert any("replacing the unreadable" in str(w.message) for w in seen)
    assert summary["written_to"] == str(path)
    assert C.shape_key(*SHAPE) in json.loads(path.read_text())["configs"]


def test_malformed_entries_are_skipped_with_a_warning(monkeypatch):
    path = C.user_table_path(FAKE_GPU)
    path.parent.mkdir(parents=True)
    key = C.shape_key(8, 64, 32, 2)
    path.write_text(json.dumps({"configs": {key: {"64": {"BLOCK_M": 48}, "512": {"BLOCK_M": 128}}}}))
    with pytest.warns(RuntimeWarning, match="1 malformed entry"):
        table = C.load_user_table(FAKE_GPU)
    assert set(table[key]) == {512}


def test_budget_cut_keeps_what_was_found_and_defaults_the_rest(tmp_path):
    summary, _ = _tune(tokens=(1, 64, 4096), budget=6.0, compile_s=1.0)
    assert summary["cut_short"] and summary["seconds"] <= 6.0
    assert 4096 in summary["tokens_partial"]  # measured, not finished: tuned again next time
    assert 1 in summary["tokens_default"]
    e, h, i, k = SHAPE
    assert summary["configs"][1] == C.normalize(C.default_config(e, h, i, 1, k))
    doc = json.loads((tmp_path / "user" / C.config_file_name(FAKE_GPU)).read_text())
    assert doc["tuned"][C.shape_key(*SHAPE)] == []
    # a second run with room picks them up again
    again, _ = _tune(tokens=(1, 64, 4096))
    assert again["tokens_tuned"] == [4096, 64, 1]


def test_tuned_token_counts_are_not_tuned_again_unless_forced():
    _tune(tokens=(512, 4096))
    second, gpu = _tune(tokens=(64, 512, 4096))
    assert second["tokens_tuned"] == [64] and {t.num_tokens for t in gpu.tasks} == {64}
    third, gpu = _tune(tokens=(512, 4096))
    assert third["skipped"] and "already holds tuned tiles" in third["skipped"] and gpu.tasks == []
    forced, gpu = _tune(tokens=(512, 4096), force=True)
    assert forced["tokens_tuned"] == [4096, 512] and gpu.tasks


def test_shapes_with_a_shipped_entry_are_left_alone_unless_forced(tmp_path):
    shipped = Problem(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8)
    summary, gpu = _tune(shipped, tokens=(4096,), device_name="NVIDIA H200")
    assert "shipped tile table" in summary["skipped"] and gpu.tasks == [] and summary["written_to"] is None
    forced, gpu = _tune(shipped, tokens=(4096,), device_name="NVIDIA H200", force=True)
    assert forced["tokens_tuned"] == [4096] and gpu.tasks
    assert forced["written_to"] == str(tmp_path / "user" / "NVIDIA_H200.json")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"weight_format": "fp8"}, "quant_kernels"),
        ({"gated": False}, "gated experts only"),
        ({"dtype": "float32"}, "bfloat16 / float16"),
    ],
)
def test_layers_without_tile_tables_are_skipped_with_the_reason(change, why):
    from dataclasses import replace

    summary, gpu = _tune(replace(PROBLEM, **change))
    assert why in summary["skipped"] and gpu.tasks == [] and summary["written_to"] is None


# --- the backend and the CPU ----------------------------------------------------------------------------------


def test_backend_spec_exposes_tune_kernels(monkeypatch):
    from selector.plugins.triton_fused import selector_backends

    spec = selector_backends()[0]
    assert spec.name == "triton_fused" and callable(spec.tune_kernels)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        spec.tune_kernels(PROBLEM, [4096], 60.0)


def test_tune_kernels_without_cuda_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU and none is visible"):
        TU.tune_kernels(PROBLEM, [4096], 60.0)


def test_cli_without_cuda_prints_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert TU.main(["--preset", "grid"]) == 1
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
def test_cli_without_triton_prints_one_line():
    """The module loads without triton (the kernels are imported where they run), so a CPU box that lacks it
    gets the same one line, not an ImportError traceback."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['triton'] = None; import torch; torch.cuda.is_available = lambda: False; "
            "from selector.plugins.triton_fused import tune; sys.exit(tune.main([]))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    assert "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr


def test_get_config_caches_are_cleared_by_a_write(monkeypatch):
    monkeypatch.setattr(C, "_device_name", lambda index: FAKE_GPU)
    key = C.shape_key(8, 64, 32, 2)
    first = C.get_config(8, 64, 32, 64, 2, device="cuda")
    C.write_user_entries(FAKE_GPU, key, {64: {"BLOCK_M": 128}}, [64])
    assert first["BLOCK_M"] != 128 and C.get_config(8, 64, 32, 64, 2, device="cuda")["BLOCK_M"] == 128
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an absent user table is no warning
        C.clear_caches()
        C.get_config(8, 64, 32, 64, 4, device="cuda")


# --- the quantised grouped kernels (plugins/quant_kernels/tune.py `tune_kernels`) -----------------------------

FP8 = Problem(num_experts=40, hidden_size=1536, intermediate_size=896, top_k=6, weight_format="fp8_block")


@pytest.fixture
def quant(tmp_path, monkeypatch):
    from selector.plugins.quant_kernels import configs as QC
    from selector.plugins.quant_kernels import tune as QT

    monkeypatch.setenv("SELECTOR_QUANT_USER_CONFIG_DIR", str(tmp_path / "quant"))
    QC.clear_caches()
    yield QC, QT
    QC.clear_caches()


class FakeTime:
    """Stands in for the `time` module inside quant_kernels.tune: perf_counter reads a fake clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _fake_cell(clock: FakeTime, seconds: float, seen: list):
    def cell(tokens, deadline):
        seen.append((tokens, deadline))
        clock.now += seconds
        return {"config": {"BLOCK_M": 128 if tokens >= 512 else 16, "ROUTE": "sorted"}, "time_s": 1e-4}

    return cell


def test_quantised_tiles_are_tuned_into_the_user_table_and_read_first(quant, monkeypatch, tmp_path):
    QC, QT = quant
    clock, seen = FakeTime(), []
    monkeypatch.setattr(QT, "time", clock)
    summary = QT.tune_kernels(FP8, (1, 512, 4096), 60.0, cell=_fake_cell(clock, 5.0, seen), device_name=FAKE_GPU)
    assert summary["tokens_tuned"] == [4096, 512, 1] and not summary["cut_short"] and summary["seconds"] <= 60
    assert [t for t, _ in seen] == [4096, 512, 1]
    assert all(deadline <= 60.0 - QT.START_MARGIN_S for _, deadline in seen)
    key = QC.shape_key(False, 40, 1536, 896, 6)
    assert summary["written_to"] == str(tmp_path / "quant" / "Fake_GPU.json")
    assert QC.tuned(FAKE_GPU, key, 4096)["BLOCK_M"] == 128 and QC.tuned(FAKE_GPU, key, 2)["BLOCK_M"] == 16
    again = QT.tune_kernels(FP8, (512, 4096), 60.0, cell=_fake_cell(clock, 5.0, seen), device_name=FAKE_GPU)
    assert "already holds tuned tiles" in again["skipped"]


def test_quantised_budget_cut_keeps_what_was_found(quant, monkeypatch):
    QC, QT = quant
    clock = FakeTime()
    monkeypatch.setattr(QT, "time", clock)

    def cell(tokens, deadline):  # as tune_cell: searches until its deadline, ending the candidate it is in
        clock.now = max(clock.now, deadline) + 1.0
        return {"config": {"BLOCK_M": 128 if tokens >= 512 else 16}, "time_s": 1e-4}

    summary = QT.tune_kernels(FP8, (1, 64, 4096), 12.0, cell=cell, device_name=FAKE_GPU)
    assert summary["cut_short"] and clock.now <= 12.0 and summary["seconds"] <= 12.0
    assert summary["tokens_partial"][0] == 4096 and not summary["tokens_tuned"]
    key = QC.shape_key(False, 40, 1536, 896, 6)
    assert QC.tuned(FAKE_GPU, key, 4096)["BLOCK_M"] == 128
    assert json.loads(open(summary["written_to"]).read())["tuned"][key] == []  # tuned again next time
    none = QT.tune_kernels(FP8, (1, 4096), 0.0, cell=cell, device_name=FAKE_GPU)
    assert none["tokens_default"] == [4096, 1] and none["written_to"] is None


def test_quantised_shipped_shapes_and_other_formats_are_skipped(quant):
    QC, QT = quant
    shipped = Problem(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8, weight_format="fp8_block")
    if not QC.load_table("NVIDIA H200").get(QC.shape_key(False, 128, 2048, 768, 8)):
        pytest.skip("no shipped fp8 entry for the Qwen3 shape")
    summary = QT.tune_kernels(shipped, (4096,), 60.0, cell=lambda t, d: pytest.fail("tuned"), device_name="NVIDIA H200")
    assert "shipped tile table" in summary["skipped"]
    dense = QT.tune_kernels(PROBLEM, (4096,), 60.0, cell=lambda t, d: pytest.fail("tuned"), device_name=FAKE_GPU)
    assert "no quantised tiles" in dense["skipped"]


def test_backend_sends_quantised_layers_to_the_quantised_search(monkeypatch):
    from selector.plugins.quant_kernels import tune as QT
    from selector.plugins.triton_fused import selector_backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="quant_kernels tune: needs a CUDA GPU"):
        selector_backends()[0].tune_kernels(FP8, [4096], 60.0)
    with pytest.raises(RuntimeError, match="triton_fused tune: needs a CUDA GPU"):
        selector_backends()[0].tune_kernels(PROBLEM, [4096], 60.0)
    assert QT.NEEDS_CUDA.startswith("quant_kernels tune")


def test_malformed_quantised_user_table_is_ignored_with_a_warning(quant):
    QC, _ = quant
    path = QC.user_table_file(FAKE_GPU)
    path.parent.mkdir(parents=True)
    path.write_text("{broken")
    with pytest.warns(RuntimeWarning, match="ignoring the tuned tile table"):
        assert QC.tuned(FAKE_GPU, QC.shape_key(False, 8, 64, 32, 2), 64) is None


# --- the persistent Hopper GEMM: a whole-layer choice after the tiles ------------------------------------------


def _layer_seconds(persistent_s: float, plain_s: float = 500e-6, best_bm_128: bool = True):
    """Fake kernel times: the GEMMs as fake_kernel_seconds (BLOCK_M 128 fastest) or with 64 fastest, the whole
    layer plain_s without the persistent GEMM and persistent_s with it."""

    def seconds(task: TU.Task) -> float:
        if task.part in TU.LAYER_PARTS:
            return persistent_s if task.part == "layer_persistent" else plain_s
        s = fake_kernel_seconds(task)
        return s if best_bm_128 or task.part == "align" else s * (task.block_m / 64) ** 0.5

    return seconds


def _search(persistent: bool, seconds) -> tuple[TU.CellSearch, FakeGpu]:
    clock = FakeClock()
    gpu = FakeGpu(clock, seconds=seconds)
    e, h, i, k = SHAPE
    cell = TU.CellSearch(4096, TU.candidate_plan(e, h, i, k, 4096, prior=TU._prior()), 1.0, persistent=persistent)
    TU.run_search([cell], gpu, 10_000.0, clock=clock)
    return cell, gpu


def test_the_layer_is_timed_with_and_without_the_persistent_gemm_after_its_tiles_and_kept_where_faster():
    cell, gpu = _search(True, _layer_seconds(450e-6))
    layer = [t for t in gpu.tasks if t.part in TU.LAYER_PARTS]
    assert [t.part for t in layer] == list(TU.LAYER_PARTS) and gpu.tasks[-2:] == layer, "once, last"
    tiles, _ = cell._tiles()
    assert tiles["BLOCK_M"] == 128 and C.decode_config(list(layer[0].layer)) == tiles
    assert cell.done and cell.takes_persistent()
    assert cell.result()[0] == C.normalize({**tiles, "PERSISTENT": 1})
    # the persistent kernel is built once for every configuration; its first timing is budgeted as a build
    assert TU.Task(4096, 128, "layer_persistent", layer=(1,)).kernel == TU.Task(512, 128, "layer_persistent").kernel
    cost = TU.CostGuess()
    assert cost.expect(layer[1]) == TU.PERSISTENT_BUILD_GUESS_S
    cost.observe(layer[1], 40.0)
    assert cost.expect(layer[1]) == cost.repeat and cost.new == TU.NEW_KERNEL_GUESS_S, "tile guesses unchanged"


@pytest.mark.parametrize("persistent_s", [495e-6, 520e-6, math.inf], ids=["within 2%", "slower", "failed"])
def test_the_persistent_gemm_is_not_kept_unless_clearly_faster(persistent_s):
    cell, _ = _search(True, _layer_seconds(persistent_s))
    assert not cell.takes_persistent() and cell.result()[0]["PERSISTENT"] == 0


@pytest.mark.parametrize("persistent,best_bm_128", [(False, True), (True, False)],
                         ids=["not a candidate", "best tiles with 64-row blocks"])  # fmt: skip
def test_the_layer_is_not_timed_where_the_persistent_gemm_cannot_take_it(persistent, best_bm_128):
    cell, gpu = _search(persistent, _layer_seconds(1e-6, best_bm_128=best_bm_128))
    assert not [t for t in gpu.tasks if t.part in TU.LAYER_PARTS]
    assert cell.result()[0]["PERSISTENT"] == 0 and (best_bm_128 or cell.result()[0]["BLOCK_M"] != 128)


def test_tune_kernels_writes_the_persistent_flag_where_the_layer_timed_faster_with_it(monkeypatch):
    clock = FakeClock()
    gpu = FakeGpu(clock, compile_s=0.5, seconds=_layer_seconds(450e-6))
    from selector.plugins.triton_fused import hopper_gemm

    monkeypatch.setattr(hopper_gemm, "AVAILABLE", True)
    summary = TU.tune_kernels(PROBLEM, (1, 4096), 10_000.0, measure=gpu, clock=clock, device_name=FAKE_GPU,
                              capability=(9, 0))  # fmt: skip
    assert summary["configs"][4096]["PERSISTENT"] == 1 and summary["configs"][1]["PERSISTENT"] == 0
    assert summary["layer_us"] == {4096: {"layer": 500.0, "layer_persistent": 450.0}}
    monkeypatch.setattr(C, "_device_name", lambda index: FAKE_GPU)
    e, h, i, k = SHAPE
    assert C.get_config(e, h, i, 4096, k, torch.bfloat16, device="cuda")["PERSISTENT"] == 1
    elsewhere = TU.tune_kernels(PROBLEM, (4096,), 10_000.0, measure=FakeGpu(clock, seconds=_layer_seconds(450e-6)),
                                clock=clock, device_name="Other GPU", capability=(10, 0))  # fmt: skip
    assert elsewhere["configs"][4096]["PERSISTENT"] == 0 and not elsewhere["layer_us"]


def test_persistent_candidates_are_the_layers_the_kernel_runs_within_the_temporaries_bound():
    from dataclasses import replace

    from selector.gates import clamped_swiglu

    qwen3 = Problem(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8)
    assert TU.persistent_candidate(qwen3, 4096, (9, 0), True)
    assert TU.persistent_candidate(replace(qwen3, dtype="float16"), 16384, (9, 0), True)
    declined = {
        "one token (pair blocks)": TU.persistent_candidate(qwen3, 1, (9, 0), True),
        "no Gluon": TU.persistent_candidate(qwen3, 4096, (9, 0), False),
        "no GPU": TU.persistent_candidate(qwen3, 4096, None, True),
        "Blackwell": TU.persistent_candidate(qwen3, 4096, (10, 0), True),
        "Ampere": TU.persistent_candidate(qwen3, 4096, (8, 0), True),
        "transposed": TU.persistent_candidate(replace(qwen3, is_transposed=True), 4096, (9, 0), True),
        "interleaved": TU.persistent_candidate(replace(qwen3, interleaved=True), 4096, (9, 0), True),
        "clamped SwiGLU": TU.persistent_candidate(replace(qwen3, gate=clamped_swiglu()), 4096, (9, 0), True),
        "fp32": TU.persistent_candidate(replace(qwen3, dtype="float32"), 4096, (9, 0), True),
        "padding over the bound": TU.persistent_candidate(replace(qwen3, num_experts=4096), 512, (9, 0), True),
    }
    assert not any(declined.values()), [name for name, v in declined.items() if v]


def test_the_user_table_folder_follows_the_cache_variables_although_it_is_remembered(tmp_path, monkeypatch):
    """The layer asks for the folder on every call, so platformdirs' answer is kept; a changed XDG_CACHE_HOME (or
    the variable naming the folder) still moves it."""
    from selector.plugins import tile_tables

    for variable in ("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", "SELECTOR_QUANT_USER_CONFIG_DIR"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    assert C.user_config_dir() == tmp_path / "a" / "selector" / "triton_fused"
    assert C.user_config_dir() is C.user_config_dir(), "remembered"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert C.user_config_dir() == tmp_path / "b" / "selector" / "triton_fused"
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", str(tmp_path / "mine"))
    assert C.user_config_dir() == tmp_path / "mine"
    quant = tile_tables.user_table_dir("SELECTOR_QUANT_USER_CONFIG_DIR", "quant_kernels")
    assert quant == tmp_path / "b" / "selector" / "quant_kernels"


def test_a_budget_cut_before_the_layer_timings_keeps_the_persistent_choice_of_the_tiles_it_replaces(monkeypatch):
    """Tune-on-load in a new process cannot afford the persistent kernel's build guess: the tiles it found keep the
    persistent GEMM where the configuration that ran before (a table's, or the nearest tabled shape's) had it."""
    from selector.plugins.triton_fused import hopper_gemm

    monkeypatch.setattr(hopper_gemm, "AVAILABLE", True)
    monkeypatch.setattr(C, "_device_name", lambda index: FAKE_GPU)
    e, h, i, k = SHAPE
    C.write_user_entries(FAKE_GPU, C.shape_key(e * 2, h, i, k), {4096: {"BLOCK_M": 128, "PERSISTENT": 1}}, [4096])
    assert C.get_config(e, h, i, 4096, k, torch.bfloat16, device="cuda")["PERSISTENT"] == 1  # borrowed
    clock = FakeClock()
    gpu = FakeGpu(clock, compile_s=0.5, seconds=_layer_seconds(450e-6))
    summary = TU.tune_kernels(PROBLEM, (4096,), TU.PERSISTENT_BUILD_GUESS_S / 2, measure=gpu, clock=clock,
                              device_name=FAKE_GPU, capability=(9, 0))  # fmt: skip
    assert "layer_persistent" not in [t.part for t in gpu.tasks], "the persistent build did not fit the budget"
    assert summary["configs"][4096]["BLOCK_M"] == 128 and summary["configs"][4096]["PERSISTENT"] == 1
