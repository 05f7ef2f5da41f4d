"""`selector tune` on the CPU: config files to layers, the plan from injected timings, a whole run on the CPU
backends (eager, batched_mm, grouped_mm) and fakes with a kernel-tuning hook, skip-if-measured, the lock, and
the one-line errors. The GPU run is the `gpu`-marked test at the end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import selector
from selector import tuning
from selector.tune import (
    TuneInputError,
    TuneOptions,
    TuneStore,
    TuneUnavailable,
    build_plan,
    preset_targets,
    read_config,
    render_plan,
    run_tune,
    token_counts,
)
from selector.tune.inputs import flag_target, with_overrides
from selector.tune.plan import Timed

QWEN3_MOE = {"model_type": "qwen3_moe", "num_experts": 128, "hidden_size": 2048, "moe_intermediate_size": 768,
             "intermediate_size": 6144, "num_experts_per_tok": 8, "torch_dtype": "bfloat16", "hidden_act": "silu"}  # fmt: skip
MIXTRAL = {"model_type": "mixtral", "num_local_experts": 8, "hidden_size": 4096, "intermediate_size": 14336,
           "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}  # fmt: skip
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "n_routed_experts": 256, "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_experts_per_tok": 8, "torch_dtype": "bfloat16",
               "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]}}  # fmt: skip
GPT_OSS = {"model_type": "gpt_oss", "num_local_experts": 32, "hidden_size": 2880, "intermediate_size": 2880,
           "num_experts_per_tok": 4, "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "mxfp4"}}  # fmt: skip


def _write(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# --- inputs ----------------------------------------------------------------------------------------------------


def test_configs_become_the_layers_they_describe(tmp_path: Path) -> None:
    qwen = read_config(_write(tmp_path / "Qwen3-30B-A3B", QWEN3_MOE))  # a model directory
    assert qwen.name == "Qwen3-30B-A3B"
    p = qwen.problem
    assert (p.num_experts, p.hidden_size, p.intermediate_size, p.top_k, p.dtype) == (128, 2048, 768, 8, "bfloat16")
    mixtral = read_config(_write(tmp_path / "mixtral", MIXTRAL) / "config.json").problem  # the file itself
    assert (mixtral.num_experts, mixtral.intermediate_size, mixtral.top_k) == (8, 14336, 2)
    deepseek = read_config(_write(tmp_path / "ds", DEEPSEEK_V3)).problem
    assert (deepseek.num_experts, deepseek.intermediate_size) == (256, 2048)  # moe_intermediate_size wins
    assert (deepseek.weight_format, deepseek.scale_format) == ("fp8_block", "float32")
    ue8m0 = {**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0"}}
    assert read_config(_write(tmp_path / "ds31", ue8m0)).problem.scale_format == "ue8m0"
    oss = read_config(_write(tmp_path / "gpt-oss", GPT_OSS))
    assert (oss.problem.has_bias, oss.problem.is_transposed, oss.problem.interleaved, oss.problem.custom_gate) == (
        True, True, True, False)  # fmt: skip
    assert oss.problem.gate.label() == "clamped_swiglu(alpha=1.702,limit=7)"  # the config's swiglu_* or GPT-OSS's
    assert oss.problem.weight_format == "dense" and "'mxfp4' is not one selector runs" in oss.notes[0]
    from selector.presets import PRESETS

    layout = ("has_bias", "is_transposed", "interleaved", "custom_gate", "gate", "activation")
    assert all(getattr(oss.problem, f) == getattr(PRESETS["gpt-oss-20b"], f) for f in layout)
    vl = read_config(_write(tmp_path / "vl", {"model_type": "qwen3_vl_moe", "text_config": QWEN3_MOE}))
    assert vl.problem.num_experts == 128  # a multimodal config's experts live in text_config


def test_bad_config_files_say_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(TuneInputError, match="does not exist: give a Transformers config.json"):
        read_config(tmp_path / "missing.json")
    with pytest.raises(TuneInputError, match="has no config.json"):
        read_config(tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TuneInputError, match="is not readable JSON"):
        read_config(tmp_path / "broken.json")
    dense = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008}
    with pytest.raises(TuneInputError, match=r"no expert count \(num_experts / num_local_experts / n_routed_experts\)"):
        read_config(_write(tmp_path / "llama", dense))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(TuneInputError, match="holds a JSON list"):
        read_config(tmp_path / "list.json")


def test_presets_flags_and_token_counts() -> None:
    assert [t.name for t in preset_targets(["grid"])] == ["qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "mixtral-8x7b",
                                                           "deepseek-v3", "gpt-oss-20b"]  # fmt: skip
    with pytest.raises(TuneInputError, match="unknown preset 'qwen9'.*grid, qwen1.5-moe-a2.7b"):
        preset_targets(["qwen9"])
    with pytest.raises(TuneInputError, match="--top-k 9 is more than the 8 experts"):
        flag_target(8, 64, 32, 9)
    target = with_overrides(flag_target(8, 64, 32, 2), "float32", "fp8-ue8m0", "cpu")
    assert (target.problem.dtype, target.problem.weight_format, target.problem.scale_format) == (
        "float32", "fp8_block", "ue8m0")  # fmt: skip
    assert token_counts(None) == [2**i for i in range(15)]
    assert token_counts([1, 64], batch_sizes=[3, 64]) == [1, 3, 64]
    with pytest.raises(TuneInputError, match="at least 1"):
        token_counts([0])


# --- the plan --------------------------------------------------------------------------------------------------


def test_plan_ranges_crossovers_and_gain_from_injected_timings() -> None:
    times = {
        1: {"fused": Timed(30e-6, 0.02), "grouped": Timed(90e-6)},
        8: {"fused": Timed(50e-6, 0.02), "grouped": Timed(60e-6)},
        64: {"fused": Timed(200e-6, 0.05), "grouped": Timed(100e-6)},
        512: {"fused": Timed(400e-6), "grouped": Timed(300e-6, 0.01)},
        4096: {"fused": Timed(1e-3, 0.03), "grouped": Timed(1.02e-3)},  # within the best's spread
    }
    static = {1: "fused", 8: "fused", 64: "fused", 512: "fused", 4096: "fused"}
    plan = build_plan("shape", "E8-H64-I32-k2/bfloat16/dense/silu/gated", "eager", times, static)
    assert [(r.backend, r.low, r.high) for r in plan.ranges] == [("fused", 1, 8), ("grouped", 9, 512), ("fused", 513, None)]
    assert [(c.earlier, c.later, c.after, c.before) for c in plan.crossovers] == [
        ("fused", "grouped", 8, 64), ("grouped", "fused", 512, 4096)]  # fmt: skip
    gains = {r.tokens: r.gain for r in plan.rows}
    assert gains[1] == 1.0 and gains[64] == pytest.approx(2.0) and gains[512] == pytest.approx(4 / 3)
    assert plan.gain == pytest.approx((2.0 * 4 / 3) ** (1 / 5))  # geometric mean over the five counts
    last = plan.rows[-1]
    assert last.margin == pytest.approx(0.02) and last.within_spread
    text = render_plan(plan)
    assert "T 1-8: fused, T 9-512: grouped, T 513-…: fused" in text
    assert "fused -> grouped between T=8 and T=64" in text and "+2.0% (within spread)" in text
    assert plan.to_dict()["gain_over_static"] == pytest.approx(plan.gain)
    unmeasured = build_plan("shape", "k", "graph", {1: {"grouped": Timed(1e-5)}}, {1: "fused"})
    assert unmeasured.gain is None and unmeasured.rows[0].static_s is None  # the static pick was not timed


# --- a whole run on the CPU ------------------------------------------------------------------------------------


class _TunableFake:
    """Test-only CPU backends: `fake_tunable` runs the eager backend's forward and has a kernel-tuning hook that
    records its calls; `fake_wrong` returns zeros (a wrong result); `fake_broken_tuner`'s hook raises."""

    calls: list[tuple[Any, tuple[int, ...], float]] = []

    @staticmethod
    @selector.hookimpl
    def selector_backends():
        from selector.types import BackendSpec, Requirements

        def eager_forward():
            from selector.dispatch import backend_forward

            return backend_forward("eager")

        def zeros():
            return lambda module, x, index, weights: x * 0

        def tune(problem, tokens, budget_s):
            _TunableFake.calls.append((problem, tuple(tokens), budget_s))
            return {"configs": len(tokens), "best_tile": "16x32"}

        def broken(problem, tokens, budget_s):
            raise RuntimeError("tuner fell over")

        cpu = Requirements(devices=frozenset({"cpu"}))
        return [
            BackendSpec(name="fake_tunable", load=eager_forward, requirements=cpu, tune_kernels=tune),
            BackendSpec(name="fake_wrong", load=zeros, requirements=cpu),
            BackendSpec(name="fake_broken_tuner", load=eager_forward, requirements=cpu, tune_kernels=broken),
        ]


def _tiny(device: str = "cpu"):
    return with_overrides(flag_target(4, 64, 32, 2), "float32", None, device)


FIXED_S = {"eager": 4e-4, "batched_mm": 2e-4, "grouped_mm": 3e-4, "fake_tunable": 1e-4, "fake_broken_tuner": 5e-4}


@pytest.fixture
def fixed_timings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The interleaved timer made deterministic (a loaded CPU's host clock is not): every runner still runs once
    per round, in the real rotated order, and reads its FIXED_S time. Returns the names in the order run."""
    from selector.bench import timing

    ran: list[str] = []

    def fake(torch, runners, mode, rounds=5, sample_s=0.02, device="cuda", errors=None, clock=None):
        names = list(runners)
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                runners[name]()
                ran.append(name)
        return {name: timing.timing_of([FIXED_S[name]] * rounds) for name in names}

    monkeypatch.setattr(timing, "time_interleaved", fake)
    return ran


@pytest.mark.slow
def test_a_cpu_run_measures_tunes_saves_and_plans(tmp_path: Path, fresh_registry, fixed_timings: list[str]) -> None:
    fresh_registry(fake_tune_backends=_TunableFake)
    _TunableFake.calls.clear()
    store = TuneStore(tmp_path / "tuning.sqlite3")
    backends = ["eager", "batched_mm", "grouped_mm", "fake_tunable", "fake_wrong", "fake_broken_tuner"]
    seen: list[tuple[str, int, int]] = []
    result = run_tune(
        [_tiny()],
        TuneOptions(tokens=[1, 4], backends=backends, device="cpu", rounds=3, sample_s=1e-3, kernel_budget_s=30),
        store=store,
        progress=lambda what, done, total: seen.append((what, done, total)),
    )
    assert seen == [("E4-H64-I32-k2 T=1 eager", 1, 2), ("E4-H64-I32-k2 T=4 eager", 2, 2)]  # no graph mode on a CPU
    (problem, counts, budget), = _TunableFake.calls
    assert counts == (1, 4) and 0 < budget <= 30 and problem.num_tokens is None
    tuned = {e["backend"]: e for e in result.kernel_tuning}
    assert tuned["fake_tunable"]["summary"] == {"configs": 2, "best_tile": "16x32"} and tuned["fake_tunable"]["seconds"] >= 0
    assert tuned["fake_broken_tuner"]["error"] == "RuntimeError: tuner fell over"
    wrong = [e for e in result.errors if e["backend"] == "fake_wrong"]
    assert len(wrong) == 2 and all(e["error"].startswith("wrong result: relative error 1") for e in wrong)
    from selector.tuning_store import TuningStore

    records = TuningStore(tmp_path / "tuning.sqlite3").records()
    assert result.stored == len(records) == 2 * 5  # two counts, five backends with a right result
    assert all(tuning.check_record(r) is None for r in records)
    from selector.tuning_store import current_fingerprints

    r = records[0]
    assert r["fingerprint"] == current_fingerprints().of(r["backend"])  # its backend's own fingerprint
    assert r["gpu"] == "cpu" and r["tool"] == "selector tune"
    assert r["problem"] == tuning.problem_key(_tiny().problem) and r["rounds"] == 3 and r["mode"] == "eager"
    assert {rec["backend"] for rec in records} == {"eager", "batched_mm", "grouped_mm", "fake_tunable", "fake_broken_tuner"}
    assert set(result.first_calls["E4-H64-I32-k2"]) >= {"eager", "batched_mm", "grouped_mm"}
    assert fixed_timings[:5] == ["eager", "batched_mm", "grouped_mm", "fake_tunable", "fake_broken_tuner"]
    assert {r["time_s"] for r in records if r["backend"] == "grouped_mm"} == {3e-4}
    (plan,) = result.plans
    assert [row.tokens for row in plan.rows] == [1, 4]
    assert [(r.backend, r.low, r.high) for r in plan.ranges] == [("fake_tunable", 1, None)] and not plan.crossovers
    assert all(row.static in FIXED_S and row.gain == pytest.approx(FIXED_S[row.static] / 1e-4) for row in plan.rows)
    assert result.durations["E4-H64-I32-k2"] > 0 and result.total_s >= result.durations["E4-H64-I32-k2"]
    data = result.to_dict()
    assert data["schema"] == "selector.tune/1" and data["plans"][0]["mode"] == "eager"
    assert len(data["timings"]) == 10 and {t["backend"] for t in data["timings"]} >= {"eager", "fake_tunable"}
    from selector.tune.cli import summary_lines

    text = "\n".join(summary_lines(result))
    assert "E4-H64-I32-k2 (E4-H64-I32-k2/float32/dense/silu/gated), eager" in text and "| T | best |" in text
    assert "first call (JIT, autotuning) on E4-H64-I32-k2: " in text
    assert "kernel tuning E4-H64-I32-k2 fake_tunable: " in text and "best_tile=16x32" in text
    assert "kernel tuning E4-H64-I32-k2 fake_broken_tuner: failed after" in text
    assert "dropped fake_wrong from E4-H64-I32-k2 T=1 eager: wrong result" in text
    assert "tuning time: " in text and "10 records stored for cpu" in text

    # again without the backend that gave a wrong result (it has no record, so its cells would be measured again):
    # every cell is measured under this fingerprint, so nothing is timed or tuned
    _TunableFake.calls.clear()
    again = run_tune(
        [_tiny()],
        TuneOptions(
            tokens=[1, 4], backends=[b for b in backends if b != "fake_wrong"], device="cpu", rounds=3, sample_s=0.0
        ),
        store=TuneStore(tmp_path / "tuning.sqlite3"),
    )
    assert again.stored == 0 and not _TunableFake.calls and all(c.measured for c in again.cells)
    assert not again.records and not again.kernel_tuning
    assert [row.tokens for row in again.plans[0].rows] == [1, 4]  # the plan from the stored records
    # a new token count is measured, the old ones are not; --force measures them all again
    more = run_tune(
        [_tiny()],
        TuneOptions(tokens=[1, 4, 8], backends=["eager", "grouped_mm"], device="cpu", rounds=2, sample_s=0.0),
        store=TuneStore(tmp_path / "tuning.sqlite3"),
    )
    assert {rec["tokens"] for rec in more.records} == {8}
    forced = run_tune(
        [_tiny()],
        TuneOptions(tokens=[1], backends=["eager"], device="cpu", rounds=2, sample_s=0.0, force=True),
        store=TuneStore(tmp_path / "tuning.sqlite3"),
    )
    assert [(rec["tokens"], rec["backend"]) for rec in forced.records] == [(1, "eager")]


def test_a_gpt_oss_layout_is_built_checked_and_timed(tmp_path: Path) -> None:
    """Biases, transposed weights, interleaved gate/up and the clamped SwiGLU: every backend that runs the layout
    agrees with the float64 reference written from the definition, so none is dropped."""
    from dataclasses import replace

    from selector.presets import PRESETS

    oss = replace(PRESETS["gpt-oss-20b"], num_experts=4, hidden_size=64, intermediate_size=32, top_k=2)
    target = with_overrides(flag_target(4, 64, 32, 2), "float32", None, "cpu")
    target = replace(target, name="oss", problem=replace(oss, dtype="float32", device="cpu"))
    result = run_tune(
        [target],
        TuneOptions(tokens=[3], backends=["eager", "batched_mm", "grouped_mm"], device="cpu", rounds=1, sample_s=0.0),
        store=TuneStore(tmp_path / "tuning.sqlite3"),
    )
    assert not result.errors and {r["backend"] for r in result.records} == {"eager", "batched_mm", "grouped_mm"}
    key = result.records[0]["problem"]
    assert key.endswith("/clamped_swiglu(alpha=1.702,limit=7)/gated+has_bias+is_transposed+interleaved")


def test_a_quantised_gpt_oss_layer_is_a_usage_error(tmp_path: Path) -> None:
    oss = with_overrides(preset_targets(["gpt-oss-20b"])[0], None, "fp8-f32", "cpu")
    with pytest.raises(TuneInputError, match="gpt-oss-20b: quantised weights .* plain layout only.*--format dense"):
        run_tune(
            [oss], TuneOptions(tokens=[1], device="cpu", dry_run=True), store=TuneStore(tmp_path / "tuning.sqlite3")
        )


def test_dry_run_lists_cells_and_measures_nothing(tmp_path: Path) -> None:
    result = run_tune(
        [_tiny()],
        TuneOptions(tokens=[2, 1024], backends=["eager", "grouped_mm"], device="cpu", dry_run=True),
        store=TuneStore(tmp_path / "tuning.sqlite3"),
    )
    assert [(c.tokens, c.mode, c.backends) for c in result.cells] == [(2, "eager", ["eager", "grouped_mm"]),
                                                                      (1024, "eager", ["eager", "grouped_mm"])]  # fmt: skip
    assert not result.records and not (tmp_path / "tuning.sqlite3").exists()
    twice = run_tune(
        [_tiny(), _tiny()],
        TuneOptions(tokens=[2], backends=["eager"], device="cpu", dry_run=True),
        store=TuneStore(tmp_path / "tuning.sqlite3"),
    )
    assert [t.name for t in twice.targets] == ["E4-H64-I32-k2", "E4-H64-I32-k2#2"]  # reports are keyed by name


def test_graph_cells_stop_at_graph_max_tokens(tmp_path: Path) -> None:
    from selector.probes import collect_environment

    from selector.environment import set_environment
    from selector.registry import get_registry
    from selector.tune import plan_cells

    set_environment(collect_environment({"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "PATH": ""}))
    from selector.environment import current_environment

    cells = plan_cells([_tiny("cuda")], [1, 512, 4096], ["eager", "graph"], 512, ["grouped_mm", "eager"],
                       current_environment(), get_registry(), TuneStore(tmp_path / "unused.sqlite3"), "fp", "NVIDIA H200")  # fmt: skip
    assert [(c.tokens, c.mode) for c in cells] == [(1, "eager"), (1, "graph"), (512, "eager"), (512, "graph"), (4096, "eager")]
    graph = next(c for c in cells if c.mode == "graph")
    assert "eager" not in graph.backends and graph.problem.cuda_graph  # eager reads ids on the host: not capturable
    assert graph.static is not None


def test_a_held_gpu_lock_stops_the_run_with_the_fix(tmp_path: Path) -> None:
    store = TuneStore(tmp_path / "tuning.sqlite3")
    with store.measurement_lock("cpu", 1.0) as got:
        assert got
        with pytest.raises(TuneUnavailable, match="another process is measuring on cpu .*raise --lock-timeout"):
            run_tune(
                [_tiny()],
                TuneOptions(tokens=[1], backends=["eager"], device="cpu", lock_timeout_s=0.0, sample_s=0.0),
                store=TuneStore(tmp_path / "tuning.sqlite3"),
            )
    assert not (tmp_path / "tuning.sqlite3").exists()


# --- the command -----------------------------------------------------------------------------------------------


def test_cli_errors_are_one_line_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from selector.cli import main

    assert main(["tune", "--preset", "qwen9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selector tune: unknown preset 'qwen9'") and "\n" not in err and "Traceback" not in err
    assert main(["tune", str(tmp_path / "nowhere")]) == 2
    assert "does not exist: give a Transformers config.json" in capsys.readouterr().err
    assert main(["tune", "--experts", "8"]) == 2
    assert "give all of --experts --hidden --intermediate --top-k" in capsys.readouterr().err
    assert main(["tune", "--preset", "qwen3-30b-a3b", "--backends", "nope", "--dry-run"]) == 2
    assert "--backends nope: no such backend; registered:" in capsys.readouterr().err
    assert main(["tune", "--preset", "qwen3-30b-a3b", "--tokens", "1,x"]) == 2
    assert main(["tune"]) == 2
    assert "nothing to tune" in capsys.readouterr().err


def test_cli_without_cuda_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from selector.cli import main

    assert main(["tune", "--preset", "qwen3-30b-a3b", "--tokens", "1"]) == 1
    assert "selector tune: needs a CUDA GPU and none is visible" in capsys.readouterr().err


def test_cli_dry_run_prints_the_cells(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from selector.cli import main

    folder = _write(tmp_path / "Mixtral-8x7B", MIXTRAL)
    out = tmp_path / "plan.json"
    assert main(["tune", str(folder), "--tokens", "1,64", "--dry-run", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Mixtral-8x7B T=1 eager" in text and "Mixtral-8x7B T=64 graph" in text
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["targets"][0]["problem"]["num_experts"] == 8


# --- on the GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_run_times_both_modes_and_saves_records(tmp_path: Path) -> None:
    target = with_overrides(flag_target(8, 1024, 512, 2), "bfloat16", None, "cuda")
    result = run_tune(
        [target],
        TuneOptions(tokens=[1, 64], backends=["grouped_mm", "batched_mm"], device="cuda", rounds=3),
        store=TuneStore(tmp_path / "tuning.sqlite3"),
    )
    keys = {(r["tokens"], r["mode"], r["backend"]) for r in result.records}
    assert keys == {(t, m, b) for t in (1, 64) for m in ("eager", "graph") for b in ("grouped_mm", "batched_mm")}
    assert all(0 < r["time_s"] < 0.1 and r["spread"] >= 0 for r in result.records)
    assert {p.mode for p in result.plans} == {"eager", "graph"} and not result.errors


def test_a_backend_over_the_memory_cap_is_left_out_when_planning(tmp_path: Path) -> None:
    """Left out before measuring, so the cell still counts as measured next time (a dropped backend has no record)."""
    cap = 10 * 2 * 3 * 64 * 32 * 4  # dense batched_mm copies 3·H·I float32 weights per (token, slot): 10 tokens' worth
    result = run_tune(
        [_tiny()],
        TuneOptions(
            tokens=[1, 64], backends=["eager", "batched_mm"], device="cpu", dry_run=True, memory_cap_gb=cap / 2**30
        ),
        store=TuneStore(tmp_path / "tuning.sqlite3"),
    )
    by_t = {c.tokens: c for c in result.cells}
    assert by_t[1].backends == ["eager", "batched_mm"] and not by_t[1].left_out
    assert by_t[64].backends == ["eager"] and "more than" in by_t[64].left_out["batched_mm"]


def test_a_record_the_schema_refuses_is_reported_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample that hit a pause can make a spread of 100x, which the schema refuses: reported, the others kept."""
    from selector.bench import timing

    real = timing.time_interleaved

    def spiky(*args, **kwargs):
        out = real(*args, **kwargs)
        return {name: replace(t, spread=150.0) if name == "eager" else t for name, t in out.items()}

    monkeypatch.setattr(timing, "time_interleaved", spiky)
    result = run_tune(
        [_tiny()],
        TuneOptions(tokens=[2], backends=["eager", "grouped_mm"], device="cpu", rounds=1, sample_s=0.0),
        store=TuneStore(tmp_path / "tuning.sqlite3"),
    )
    assert [r["backend"] for r in result.records] == ["grouped_mm"] and result.stored == 1
    (error,) = result.errors
    assert error["backend"] == "eager" and error["error"] == "record refused: spread or first_call_s out of range"
    assert not result.cells[0].measured


def test_auto_follows_what_tune_measured(tmp_path: Path, fresh_registry, fixed_timings: list[str]) -> None:
    """The loop a user runs: `selector tune` stores times, and the next auto choice for that layer takes the
    measured fastest and says it was measured (here batched_mm, which the static estimate ranks last)."""
    from experts_fixtures import make_experts, random_routing

    from selector.dispatch import explain_module, last_backend, reset_selection_caches
    from selector.tuning_store import reload

    fresh_registry()
    module = make_experts(4, 64, 32, seed=1)  # the layer of _tiny(): E=4 H=64 I=32 k=2, float32 on the CPU
    x = torch_randn(3, 64)
    index, weights = random_routing(3, 4, 2)
    static = explain_module(module, num_tokens=3, top_k=2)
    assert static.best != "batched_mm" and all(c.source == "estimate" for c in static.candidates)
    run_tune(
        [_tiny()],
        TuneOptions(
            tokens=[1, 4], backends=["eager", "batched_mm", "grouped_mm"], device="cpu", rounds=2, sample_s=0.0
        ),
    )  # into the process's store (SELECTOR_TUNING_STORE, a temp folder in tests)
    reload()
    reset_selection_caches()
    module(x, index, weights)
    assert last_backend(module) == "batched_mm"  # FIXED_S: 2e-4 against 3e-4 and 4e-4
    ranking = explain_module(module, num_tokens=3, top_k=2)
    assert [(c.name, c.source, c.measured_tokens) for c in ranking.candidates] == [
        ("batched_mm", "measured", 4), ("grouped_mm", "measured", 4), ("eager", "measured", 4)]


def test_auto_switches_backend_at_the_measured_crossover(fresh_registry) -> None:
    """Per token bucket: grouped_mm measured fastest at T <= 8, eager from T = 64 on."""
    from experts_fixtures import make_experts, random_routing

    from selector.dispatch import last_backend, problem_of, reset_selection_caches
    from selector.tuning_store import current_fingerprints, reload, save_records

    fresh_registry()
    module = make_experts(4, 64, 32, seed=2)
    key = tuning.problem_key(problem_of(module, 2))
    times = {1: (1e-5, 5e-5), 8: (2e-5, 6e-5), 64: (9e-5, 7e-5), 512: (5e-4, 2e-4)}  # (grouped_mm, eager)
    save_records([{"fingerprint": current_fingerprints().of(name), "gpu": "cpu", "problem": key, "mode": "eager",
                   "tokens": t, "backend": name, "time_s": s} for t, pair in times.items()
                  for name, s in zip(("grouped_mm", "eager"), pair)])  # fmt: skip
    reload()
    reset_selection_caches()
    picks = {}
    for t in (1, 2, 8, 40, 64, 300, 512):
        index, weights = random_routing(t, 4, 2)
        module(torch_randn(t, 64), index, weights)
        picks[t] = last_backend(module)
    assert picks == {1: "grouped_mm", 2: "grouped_mm", 8: "grouped_mm", 40: "eager", 64: "eager", 300: "eager",
                     512: "eager"}  # 40 -> bucket 64; the nearest measured count in log scale decides


def torch_randn(*shape: int):  # noqa: ANN201
    import torch

    return torch.randn(*shape)
