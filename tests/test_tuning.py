"""The tuning record format and the pure lookup: validation, fingerprints, nearest token count, and how the
ranking uses measured times (source, one-time costs, warmth)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from selector import tuning
from selector.presets import preset
from selector.probes import collect_environment
from selector.ranking import rank
from selector.registry import build_registry
from selector.tuning import Measurement, TuningTable, check_record, measured_for, problem_key

ENV = {"SELECTOR_GPUS": "NVIDIA H200:9.0", "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""}
QWEN3 = preset("qwen3-30b-a3b")
FP = "a" * 32


def record(**kw: object) -> dict[str, object]:
    base = {"fingerprint": FP, "gpu": "NVIDIA H200", "problem": problem_key(QWEN3), "mode": "eager", "tokens": 1,
            "backend": "grouped_mm", "time_s": 3e-4}
    return {**base, **kw}


def test_problem_key_names_what_a_time_depends_on() -> None:
    assert problem_key(QWEN3) == "E128-H2048-I768-k8/bfloat16/dense/silu/gated"
    assert problem_key(QWEN3.with_tokens(4096)) == problem_key(QWEN3)  # tokens are a field of their own
    gpt_oss = problem_key(preset("gpt-oss-20b"))
    assert gpt_oss.endswith("/clamped_swiglu(alpha=1.702,limit=7)/gated+has_bias+is_transposed+interleaved")
    fp8 = problem_key(replace(QWEN3, weight_format="fp8_block", scale_format="ue8m0"))
    assert "/fp8_block:ue8m0:dynamic/" in fp8


def test_fingerprint_changes_with_versions_and_gpu_memory() -> None:
    env = collect_environment(ENV)
    base = tuning.legacy_fingerprint(env, {"moe-selector": "0.1.0"})
    assert base == tuning.legacy_fingerprint(env, {"moe-selector": "0.1.0"})
    assert base != tuning.legacy_fingerprint(env, {"moe-selector": "0.2.0"})
    bigger = collect_environment({**ENV, "SELECTOR_GPUS": "NVIDIA H200:9.0:141"})
    assert base != tuning.legacy_fingerprint(bigger, {"moe-selector": "0.1.0"})
    # a record's own fingerprint: its backend's distribution and the machine, gpu memory included
    record_fp = tuning.backend_fingerprint(tuning.backend_facts(env, "moe-selector 0.1.0"))
    assert record_fp == tuning.backend_fingerprint(tuning.backend_facts(env, "moe-selector 0.1.0"))
    assert record_fp != tuning.backend_fingerprint(tuning.backend_facts(env, "moe-selector 0.2.0"))
    assert record_fp != tuning.backend_fingerprint(tuning.backend_facts(bigger, "moe-selector 0.1.0"))
    assert record_fp != base


@pytest.mark.parametrize(
    ("broken", "reason"),
    [
        ({"gpu": "NVIDIA H200"}, "missing field"),
        (record(time_s=None), "time_s"),
        (record(time_s="fast"), "time_s"),
        (record(time_s=float("nan")), "not finite"),
        (record(time_s=-1.0), "outside"),
        (record(tokens="many"), "tokens"),
        (record(tokens=True), "tokens"),
        (record(tokens=0), "outside"),
        (record(mode="turbo"), "mode"),
        (record(backend="x" * 600), "longer than"),
        (["not", "a", "record"], "JSON object"),
    ],
)
def test_a_record_that_does_not_validate_says_why(broken: object, reason: str) -> None:
    found = check_record(broken)
    assert found is not None and reason in found
    with pytest.raises(ValueError, match="tuning record refused"):
        tuning.clean_record(broken)  # type: ignore[arg-type]


def test_clean_record_keeps_known_fields_only() -> None:
    assert tuning.clean_record(record(extra="dropped", spread=0.05)) == record(spread=0.05)


def test_lookup_takes_the_nearest_measured_count_and_skips_bad_records() -> None:
    env = collect_environment(ENV)
    rows = [record(), record(backend="triton_fused", time_s=3e-5), record(time_s=1e-5),  # a later one replaces
            record(tokens=64, time_s=9e-4), {"bad": 1}, record(fingerprint="b" * 32)]
    table = TuningTable.from_records(rows, FP)
    assert table.invalid == 1 and table.stale == 1 and len(table) == 3
    got = measured_for(QWEN3.with_tokens(2), env, table)
    assert got is not None and {n: m.time_s for n, m in got.items()} == {"grouped_mm": 1e-5, "triton_fused": 3e-5}
    assert got["grouped_mm"].tokens == 1
    assert {n: m.time_s for n, m in measured_for(QWEN3.with_tokens(32), env, table).items()} == {"grouped_mm": 9e-4}
    assert measured_for(replace(QWEN3, cuda_graph=True), env, table) is None  # graph mode measured apart
    a100 = collect_environment({**ENV, "SELECTOR_GPUS": "NVIDIA A100:8.0"})
    assert measured_for(QWEN3, a100, table) is None


def test_stale_records_are_never_trusted() -> None:
    table = TuningTable.from_records([record()], "another fingerprint")
    assert table.stale == 1 and measured_for(QWEN3, collect_environment(ENV), table) is None


def test_ranking_uses_measurements_and_says_so() -> None:
    env = collect_environment(ENV)
    registry = build_registry(environ={})
    problem = QWEN3.with_tokens(1)
    static = rank(problem, env, registry)
    assert all(c.source == "estimate" for c in static.candidates)
    measured = {"grouped_mm": Measurement(1e-5, spread=0.03, tokens=1)}
    ranking = rank(problem, env, registry, measured=measured)
    assert ranking.best == "grouped_mm"
    best = ranking.candidates[0]
    assert (best.source, best.estimate, best.spread, best.measured_tokens) == ("measured", 1e-5, 0.03, 1)
    assert {c.source for c in ranking.candidates[1:]} == {"estimate"}


def test_a_cold_backend_pays_its_first_call_unless_warm() -> None:
    env = collect_environment(ENV)
    registry = build_registry(environ={})
    problem = QWEN3.with_tokens(16384)
    measured = {"grouped_mm": Measurement(2.7e-3), "triton_fused": Measurement(2.4e-3, first_call_s=100.0)}
    cold = rank(problem, env, registry, measured=measured, amortize_calls=1000)
    assert cold.best == "grouped_mm"  # 2.4 ms + 100 s / 1000 calls loses
    warm = rank(problem, env, registry, measured=measured, warm={"triton_fused"}, amortize_calls=1000)
    assert warm.best == "triton_fused"


def test_doctor_ranks_by_measurements_and_reports_stale_ones() -> None:
    from selector.doctor import build_report
    from selector.render import render_text

    env = collect_environment(ENV)
    registry = build_registry(environ={})
    problem = QWEN3.with_tokens(512)
    rows = [record(tokens=512, time_s=2e-4, spread=0.04), record(tokens=512, backend="triton_fused", time_s=4e-4),
            record(fingerprint="old" * 8)]
    report = build_report(env, registry, problem=problem, tuning=TuningTable.from_records(rows, FP), tuning_store="t")
    check = next(c for c in report.checks if c.section == "tuning")
    assert check.title == "Tuning: 2 measured time(s) for this environment" and check.warning
    assert any("1 record(s) measured in another environment" in d for d in check.detail)
    assert report.usable[:2] == ["grouped_mm", "triton_fused"]
    text = render_text(report)
    assert "grouped_mm       measured 200 µs at T=512 (±2%)" in text
    empty = build_report(env, registry, problem=problem, tuning=TuningTable(FP))
    assert "no measured times" in next(c for c in empty.checks if c.section == "tuning").title
    assert all(c.source == "estimate" for c in empty.ranking.candidates)
