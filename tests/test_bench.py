"""The bench's bookkeeping on CPU (timing itself needs a GPU: `selector bench` there), and tuning data use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selector.probes import collect_environment
from selector import tuning_store as tuning
from selector.tuning import Fingerprints
from selector.bench import (
    BenchOptions,
    BenchResult,
    Cell,
    fill_peer_ratios,
    markdown_table,
    run_bench,
    write_outputs,
)
from selector.presets import preset
from selector.ranking import rank
from selector.registry import build_registry

CEILINGS = {"bandwidth_Bps": 4.25e12, "bf16_flops": 782e12}


def _result() -> BenchResult:
    cells = [
        Cell("qwen3-30b-a3b", 1, "bfloat16", "triton_fused", "eager", time_s=30e-6, floor_s=18e-6),
        Cell("qwen3-30b-a3b", 1, "bfloat16", "grouped_mm", "eager", time_s=300e-6, floor_s=18e-6),
        Cell("qwen3-30b-a3b", 1, "bfloat16", "hf:grouped_mm", "eager", time_s=310e-6, floor_s=18e-6),
        Cell("qwen3-30b-a3b", 1, "bfloat16", "hf:batched_mm", "eager", time_s=200e-6, floor_s=18e-6),
        Cell("qwen3-30b-a3b", 1, "bfloat16", "auto", "eager", time_s=40e-6, floor_s=18e-6, picked="triton_fused"),
        Cell("qwen3-30b-a3b", 1, "bfloat16", "eager", "graph", skipped="cannot be captured"),
    ]
    return BenchResult(device="NVIDIA H200", ceilings=CEILINGS, command="selector bench", cells=cells)


def test_peer_ratio_and_table() -> None:
    result = _result()
    fill_peer_ratios(result.cells)
    auto = next(c for c in result.cells if c.backend == "auto")
    assert auto.vs_best_peer == pytest.approx(200e-6 / 40e-6)
    table = markdown_table(result)
    assert "4.25 TB/s" in table and "782 TFLOP/s" in table
    row = next(line for line in table.splitlines() if line.startswith("| qwen3-30b-a3b | 1 | eager"))
    assert "40µs (2.22x) [triton_fused]" in row and row.rstrip().endswith("| triton_fused | 5.00x faster |")


def test_outputs_written(tmp_path: Path) -> None:
    paths = write_outputs(_result(), tmp_path)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["schema"] == "selector.bench/2" and len(data["cells"]) == 6
    assert data["cells"][0]["time_over_floor"] == pytest.approx(30 / 18)
    assert (tmp_path / "bench.md").read_text().startswith("Device: NVIDIA H200")
    assert tmp_path / "bench.json" in paths


def test_bench_needs_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        run_bench(["qwen3-30b-a3b"], [1])


def _use_as_tuning(result: BenchResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `result` the only measured timings selector reads (callers tuning.reload() when done)."""
    from selector.bench.grid import records_from_bench

    monkeypatch.setattr(tuning, "current_fingerprints", lambda: Fingerprints.uniform("test-fingerprint"))
    records = records_from_bench(result)
    monkeypatch.setattr(tuning, "known_records", lambda fingerprint=None: records)
    tuning.reload()


def _times(measured: dict | None) -> dict | None:
    return None if measured is None else {name: m.time_s for name, m in measured.items()}


def test_measured_timings_steer_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _result()
    # pretend grouped_mm measured faster than triton_fused at T=1 on this GPU
    result.cells[1].time_s = 10e-6
    _use_as_tuning(result, tmp_path, monkeypatch)
    try:
        env = collect_environment({"SELECTOR_GPUS": "NVIDIA H200:9.0", "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""})
        problem = preset("qwen3-30b-a3b").with_tokens(2)
        measured = tuning.measured_for(problem, env)
        assert _times(measured) == {"triton_fused": 30e-6, "grouped_mm": 10e-6}
        assert rank(problem, env, build_registry(environ={}), measured=measured).best == "grouped_mm"
        other_gpu = collect_environment({"SELECTOR_GPUS": "NVIDIA A100:8.0", "PATH": ""})
        assert tuning.measured_for(problem, other_gpu) is None
    finally:
        tuning.reload()


def test_graph_mode_timings_apply_only_while_capturing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    result = _result()
    result.cells.append(Cell("qwen3-30b-a3b", 1, "bfloat16", "grouped_mm", "graph", time_s=1e-6, floor_s=18e-6))
    _use_as_tuning(result, tmp_path, monkeypatch)
    try:
        env = collect_environment({"SELECTOR_GPUS": "NVIDIA H200:9.0", "PATH": ""})
        problem = preset("qwen3-30b-a3b").with_tokens(1)
        assert _times(tuning.measured_for(problem, env)) == {"triton_fused": 30e-6, "grouped_mm": 300e-6}
        assert _times(tuning.measured_for(replace(problem, cuda_graph=True), env)) == {"grouped_mm": 1e-6}
    finally:
        tuning.reload()


def _quant_cells() -> list[Cell]:
    shape = "qwen3-30b-a3b"
    return [
        Cell(shape, 1, "bfloat16", "triton_fused", "graph", time_s=34e-6, floor_s=18e-6),
        Cell(shape, 1, "bfloat16", "grouped_mm", "graph", time_s=100e-6, floor_s=18e-6),
        Cell(shape, 1, "bfloat16", "triton_fused", "graph", format="fp8-f32", time_s=22e-6, floor_s=9e-6),
        Cell(shape, 1, "bfloat16", "batched_mm", "graph", format="fp8-f32", time_s=45e-6, floor_s=9e-6),
        Cell(shape, 1, "bfloat16", "auto", "graph", format="fp8-f32", time_s=1e-6, floor_s=9e-6),  # not a backend
        Cell(shape, 1, "bfloat16", "eager", "graph", format="fp8-f32", skipped="cannot be captured"),
    ]


def test_quantised_cells_beside_dense_in_the_table() -> None:
    table = markdown_table(BenchResult(device="NVIDIA H200", ceilings=CEILINGS, command="", cells=_quant_cells()))
    rows = [line for line in table.splitlines() if line.startswith("| qwen3-30b-a3b | 1 | graph |")]
    assert [r.split(" | ")[3] for r in rows[:2]] == ["dense", "fp8-f32"]  # one row per format, dense first
    summary = rows[-1]  # the second table: best per format, and fp8 over dense
    assert "34µs (1.89x) triton_fused" in summary and "22µs (2.44x) triton_fused" in summary
    assert summary.rstrip().endswith("| 0.65 |")


def test_quantised_cells_do_not_become_dense_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    from selector.bench.grid import records_from_bench

    monkeypatch.setattr(tuning, "current_fingerprints", lambda: Fingerprints.uniform("test-fingerprint"))
    records = records_from_bench(BenchResult("NVIDIA H200", CEILINGS, "", _quant_cells()))
    assert {(r["backend"], r["time_s"]) for r in records} == {("triton_fused", 34e-6), ("grouped_mm", 100e-6)}


@pytest.mark.slow
def test_format_layers_and_their_floor_bytes() -> None:
    torch = pytest.importorskip("torch")
    from dataclasses import replace

    from selector import quant
    from selector.bench import FORMATS, bytes_moved, format_layer, make_layer

    problem = replace(preset("qwen3-30b-a3b"), num_experts=4, hidden_size=256, intermediate_size=128)
    dense = make_layer(torch, problem, torch.bfloat16, "cpu", seed=0)
    before = dense.gate_up_proj.detach().clone()
    assert format_layer(torch, dense, problem, "dense") is dense
    dense_bytes = bytes_moved(dense, problem, experts_hit=3, tokens=2, elem=2)
    assert dense_bytes == 3 * 3 * 256 * 128 * 2 + 2 * 2 * 256 * 2
    activations = 2 * 2 * 256 * 2
    for name, (wf, sf) in ((n, f) for n, f in FORMATS.items() if f):
        layer = format_layer(torch, dense, problem, name)
        assert quant.quant_format(layer).weight_format == wf and quant.quant_format(layer).scale_format == sf
        per_weight = quant.bytes_per_weight(quant.quant_format(layer))
        expected = 3 * 3 * 256 * 128 * per_weight + activations
        assert bytes_moved(layer, problem, 3, 2, 2) == pytest.approx(expected, rel=1e-3)
    assert torch.equal(dense.gate_up_proj, before) and not quant.is_quantised(dense)  # the dense layer untouched
    with pytest.raises(ValueError, match="unknown format"):
        format_layer(torch, dense, problem, "int4")


def test_bench_rejects_an_unknown_format(capsys: pytest.CaptureFixture[str]) -> None:
    from selector.cli import main

    with pytest.raises(ValueError, match="unknown format"):
        run_bench(["qwen3-30b-a3b"], [1], BenchOptions(formats=["fp8"]))
    assert main(["bench", "--formats", "fp8"]) == 2  # a usage error, before anything runs
    assert "expected some of dense, fp8-f32, fp8-ue8m0, fp4" in capsys.readouterr().err


def test_quantised_floors_use_the_fp8_matmul_rate_and_peers_compare_like_with_like() -> None:
    from dataclasses import replace

    from selector.bench import compute_ceiling

    dense = preset("qwen3-30b-a3b")
    fp8 = replace(dense, weight_format="fp8_block", scale_format="ue8m0")
    with_fp8 = {**CEILINGS, "fp8_flops": 1500e12}
    assert compute_ceiling(with_fp8, dense) == 782e12 and compute_ceiling(with_fp8, fp8) == 1500e12
    assert compute_ceiling(CEILINGS, fp8) == 782e12  # not measured (no fp8 matmul there): bf16's
    cells = _quant_cells() + [Cell("qwen3-30b-a3b", 1, "bfloat16", "hf:batched_mm", "graph", time_s=80e-6)]
    fill_peer_ratios(cells)
    assert cells[0].vs_best_peer == pytest.approx(80 / 34)  # dense against the dense peer
    assert cells[2].vs_best_peer is None  # fp8: Transformers' backends ran no fp8 cell


@pytest.mark.interpreter
def test_bench_formats_runs_on_the_cpu_through_the_interpreter(tmp_path: Path) -> None:
    """`selector bench --formats` end to end on a tiny layer on the CPU (the quantised Triton kernels under the
    interpreter): every format timed on each path, every checked cell within 1e-2 of float64 (quantised: from
    the dequantised weights), quantised floors at the e4m3 rate (below the bf16-rate floor), the tables written.
    The times mean nothing here; the harness is what is checked."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from dataclasses import replace

    from selector.bench import run_bench

    if torch.cuda.is_available():
        pytest.skip("the GPU run is tests/test_gpu_kernels_real.py::test_bench_formats_end_to_end")
    tiny = replace(preset("qwen3-30b-a3b"), num_experts=4, hidden_size=256, intermediate_size=128, top_k=2)
    ceilings = {**CEILINGS, "fp8_flops": 1500e12}
    result = run_bench(
        {"tiny": tiny},
        [3],
        BenchOptions(
            dtype_name="float32",
            backends=["grouped_mm", "batched_mm"],
            modes=["eager", "graph"],
            with_peers=False,
            formats=["dense", "fp8-f32", "fp8-ue8m0", "fp4"],
            rounds=1,
            device="cpu",
            ceilings=ceilings,
        ),
    )
    timed = {(c.format, c.backend) for c in result.cells if c.time_s}
    assert {("dense", "grouped_mm"), ("fp8-f32", "grouped_mm"), ("fp8-ue8m0", "batched_mm"), ("fp4", "grouped_mm"),
            ("fp8-f32", "auto")} <= timed, sorted(timed)  # fmt: skip
    checked = [c for c in result.cells if c.rel_error is not None]
    assert checked and all(c.rel_error < 1e-2 for c in checked)
    assert all(c.skipped == "graph mode needs CUDA" for c in result.cells if c.mode == "graph")
    dense = next(c for c in result.cells if c.format == "dense" and c.floor_s)
    for fmt in ("fp8-f32", "fp4"):  # fewer bytes and the e4m3 rate: a lower floor than dense's
        quantised = next(c for c in result.cells if c.format == fmt and c.floor_s)
        assert quantised.floor_s < dense.floor_s
    write_outputs(result, tmp_path)
    table = (tmp_path / "bench.md").read_text()
    assert "| tiny | 3 | eager | fp8-f32 |" in table and "Quantised against dense" in table


def test_a_cpu_bench_run_needs_its_ceilings() -> None:
    with pytest.raises(ValueError, match="pass the ceilings"):
        run_bench(["qwen3-30b-a3b"], [1], BenchOptions(device="cpu"))


class _FakeClock:
    """A host clock that moves only when a fake runner says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_interleaved_rounds_rotate_the_order_and_drop_a_failing_runner() -> None:
    from selector.bench import time_interleaved

    clock, calls = _FakeClock(), []

    def runner(name: str, seconds: list[float], fail_on: int | None = None):
        def run() -> None:
            calls.append(name)
            if fail_on is not None and calls.count(name) == fail_on:
                raise RuntimeError("boom in the kernel")
            clock.now += seconds[(calls.count(name) - 1) % len(seconds)]

        return run

    errors: dict[str, str] = {}
    timings = time_interleaved(None, {"a": runner("a", [1.0, 2.0, 3.0]), "b": runner("b", [2.0]),
                                      "c": runner("c", [1.0], fail_on=2)},
                               "eager", rounds=3, sample_s=0, device="cpu", errors=errors, clock=clock)  # fmt: skip
    assert calls == ["a", "b", "c", "b", "c", "a", "a", "b"]  # A B C, B C A, C A B with c dropped after failing
    assert list(timings) == ["a", "b"] and errors == {"c": "RuntimeError: boom in the kernel"}
    assert timings["a"].median_s == 2.0 and timings["a"].spread == pytest.approx(1.0)  # (3 - 1) / 2
    assert timings["b"].samples == (2.0, 2.0, 2.0) and timings["b"].spread == 0.0 and timings["b"].rounds == 3


def test_interleaved_samples_fill_the_sample_time() -> None:
    from selector.bench import time_interleaved

    clock, calls = _FakeClock(), []

    def run() -> None:
        calls.append(1)
        clock.now += 0.001

    timings = time_interleaved(None, {"a": run}, "eager", rounds=2, sample_s=0.01, device="cpu", clock=clock)
    assert len(calls) == 2 + 2 * 10  # one warm call, one timed call, then two samples of 10 calls
    assert timings["a"].median_s == pytest.approx(0.001)
    with pytest.raises(ValueError, match="graph mode needs CUDA"):
        time_interleaved(None, {"a": run}, "graph", device="cpu")
    with pytest.raises(ValueError, match="expected eager, graph or compile"):
        time_interleaved(None, {"a": run}, "replay", device="cpu")


def test_choice_quality_compares_auto_with_the_fastest_of_its_run() -> None:
    from selector.bench import choice_quality

    def cells(t: int, auto: float, fused: float, grouped: float) -> list[Cell]:
        shape = "qwen3-30b-a3b"
        return [
            Cell(shape, t, "bfloat16", "triton_fused", "eager", time_s=fused, floor_s=1e-5, spread=0.02),
            Cell(shape, t, "bfloat16", "grouped_mm", "eager", time_s=grouped, floor_s=1e-5, spread=0.04),
            Cell(shape, t, "bfloat16", "hf:grouped_mm", "eager", time_s=grouped / 10, floor_s=1e-5),  # a peer
            Cell(shape, t, "bfloat16", "auto", "eager", time_s=auto, floor_s=1e-5, picked="triton_fused", spread=0.01),
        ]

    q = choice_quality(cells(1, 31e-6, 30e-6, 90e-6) + cells(512, 130e-6, 120e-6, 100e-6) + cells(8, 1e-4, 1e-4, 2e-4))
    assert q["cells"] == 3 and q["within_count"] == 2 and q["share_within"] == pytest.approx(2 / 3)
    (worst,) = q["worst"]
    assert (worst["tokens"], worst["fastest"], worst["picked"]) == (512, "grouped_mm", "triton_fused")
    # the choice: the picked backend's own time (120 µs) over the fastest's; the auto row adds its dispatch
    assert worst["ratio"] == pytest.approx(1.2) and worst["auto_ratio"] == pytest.approx(1.3)
    assert worst["spread"] == 0.04 and q["auto_share_within"] == pytest.approx(2 / 3)
    result = BenchResult("NVIDIA H200", CEILINGS, "", cells(512, 130e-6, 120e-6, 100e-6))
    assert result.to_dict()["choice_quality"]["worst"][0]["ratio"] == pytest.approx(1.2)
    table = markdown_table(result)
    assert "auto's pick within 5% of the fastest selector backend of the same interleaved run in 0 of 1 cells" in table
    assert "| qwen3-30b-a3b | 512 | eager | dense | 120µs triton_fused | 130µs | 100µs grouped_mm | 1.20 | 4% |" in table


def test_bench_times_every_backend_and_auto_interleaved_on_the_cpu() -> None:
    """A dense CPU run: every cell of a mode timed in the same rounds, auto's row after each backend's first call,
    its pick read off the layer, and the choice quality computed from that run."""
    pytest.importorskip("torch")
    from dataclasses import replace

    tiny = replace(preset("qwen3-30b-a3b"), num_experts=4, hidden_size=64, intermediate_size=32, top_k=2)
    result = run_bench(
        {"tiny": tiny},
        [4],
        BenchOptions(
            dtype_name="float32",
            backends=["eager", "batched_mm", "grouped_mm"],
            modes=["eager"],
            with_peers=False,
            device="cpu",
            ceilings=CEILINGS,
            rounds=3,
        ),
    )
    rows = {c.backend: c for c in result.cells}
    assert set(rows) == {"eager", "batched_mm", "grouped_mm", "auto"}
    assert all(c.rounds == 3 and c.spread is not None and c.time_s for c in rows.values())
    assert all(c.rel_error is not None and c.rel_error < 1e-4 for c in rows.values())
    picked = rows["auto"].picked
    assert picked in ("eager", "batched_mm", "grouped_mm") and rows[picked].auto_pick
    q = result.to_dict()["choice_quality"]
    assert q["cells"] == 1 and q["rows"][0]["picked"] == picked


@pytest.mark.gpu
def test_interleaved_on_the_gpu_in_both_modes() -> None:
    torch = pytest.importorskip("torch")
    from selector.bench import time_interleaved

    small = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def broken() -> None:
        raise RuntimeError("a kernel that fails")

    runners = {"small": lambda: small @ small, "big": lambda: big @ big, "broken": broken}
    for mode in ("eager", "graph"):
        errors: dict[str, str] = {}
        timings = time_interleaved(torch, runners, mode, rounds=3, sample_s=0.005, errors=errors)
        assert set(timings) == {"small", "big"} and errors["broken"] == "RuntimeError: a kernel that fails"
        assert timings["big"].median_s > 4 * timings["small"].median_s  # 8x the FLOPs
        assert all(t.rounds == 3 and 0 <= t.spread < 1 for t in timings.values())


def test_a_run_merged_into_an_older_result_replaces_its_rows_and_keeps_the_rest(tmp_path: Path) -> None:
    older = _result()
    newer = BenchResult(device="NVIDIA H200", ceilings={**CEILINGS, "bandwidth_Bps": 4.0e12},
                        command="selector bench --tokens 1 --merge", cells=[
        Cell("qwen3-30b-a3b", 1, "bfloat16", "triton_fused", "eager", time_s=20e-6, floor_s=18e-6),
        Cell("qwen3-30b-a3b", 8, "bfloat16", "triton_fused", "eager", time_s=90e-6, floor_s=80e-6),
    ])  # fmt: skip
    merged = newer.merged_into(older)
    eager_1 = [c for c in merged.cells if (c.tokens, c.mode) == (1, "eager")]
    assert [c.time_s for c in eager_1] == [20e-6], "the whole row replaced: its backends come from one run"
    assert {(c.tokens, c.mode) for c in merged.cells} == {(1, "eager"), (8, "eager"), (1, "graph")}
    assert [r["command"] for r in merged.runs] == ["selector bench", "selector bench --tokens 1 --merge"]
    again = BenchResult.from_dict(json.loads(json.dumps(merged.to_dict())))
    assert again.cells == merged.cells and again.runs == merged.runs
    table = markdown_table(merged)
    assert table.startswith("Device: NVIDIA H200. Merged from 2 runs") and "4.00 TB/s" in table and "4.25 TB/s" in table
    assert "Merged" not in markdown_table(older) and "runs" not in older.to_dict(), "a single run reads as before"
    third = BenchResult(device="NVIDIA H200", ceilings=CEILINGS, command="selector bench --tokens 8 --merge")
    assert len(third.merged_into(merged).runs) == 3


def test_a_result_of_another_kind_is_refused_when_read_back() -> None:
    for data in ({"schema": "selector.bench/1", "cells": []}, [1, 2]):
        with pytest.raises(ValueError, match="not a selector.bench/2 result"):
            BenchResult.from_dict(data)


def test_measured_rows_are_those_held_in_every_asked_mode() -> None:
    from selector.bench import measured_rows

    result = _result()  # T=1: eager timed, graph recorded as skipped
    assert measured_rows(result, "bfloat16", ["eager", "graph"]) == {("qwen3-30b-a3b", "dense", 1)}
    assert measured_rows(result, "bfloat16", ["eager", "train"]) == set()
    assert measured_rows(result, "float16", ["eager"]) == set()


def test_a_resumed_run_skips_measured_rows_and_hands_over_each_finished_shape() -> None:
    """On the CPU: the skipped shape builds nothing and is not handed over; the other is measured, then handed
    over with what was measured so far."""
    pytest.importorskip("torch")
    from dataclasses import replace

    tiny = replace(preset("qwen3-30b-a3b"), num_experts=4, hidden_size=64, intermediate_size=32, top_k=2)
    handed: list[set] = []

    def hand_over(partial: BenchResult) -> None:
        handed.append({(c.shape, c.tokens) for c in partial.cells})

    result = run_bench(
        {"done": tiny, "todo": tiny},
        [2, 3],
        BenchOptions(
            dtype_name="float32",
            backends=["eager"],
            modes=["eager"],
            with_peers=False,
            device="cpu",
            ceilings=CEILINGS,
            rounds=1,
        ),
        skip={("done", "dense", 2), ("done", "dense", 3), ("todo", "dense", 3)},
        after_shape=hand_over,
    )
    assert {(c.shape, c.tokens) for c in result.cells} == {("todo", 2)}
    assert handed == [{("todo", 2)}]


def test_merging_needs_a_result_of_this_gpu(tmp_path: Path) -> None:
    from selector.bench.cli import previous_result

    assert previous_result(tmp_path, "NVIDIA H200") is None, "nothing there yet: a fresh result"
    write_outputs(_result(), tmp_path)
    assert isinstance(previous_result(tmp_path, "NVIDIA H200"), BenchResult)
    assert "measured on NVIDIA H200, this GPU is NVIDIA H100" in previous_result(tmp_path, "NVIDIA H100")
    (tmp_path / "bench.json").write_text("{not json")
    assert "cannot be merged into" in previous_result(tmp_path, "NVIDIA H200")
