"""`selector bench --compile`: the harness on the CPU (aot_eager, host clock; its times mean nothing)."""

from __future__ import annotations

import json

import pytest

from selector.bench.compiled import UNCOMPILED, compiled_table, run_compiled_bench
from selector.types import Problem


@pytest.mark.compile
def test_compiled_bench_times_every_backend_compiled_and_not() -> None:
    tiny = Problem(4, 16, 8, 2, dtype="float32", device="cpu")
    result = run_compiled_bench(presets={"tiny": tiny}, tokens=(1, 5), modes=("default",),
                                backends=("auto", "grouped_mm", "triton_fused"), dtype_name="float32", rounds=2,
                                sample_s=0.0, device="cpu", compiler="aot_eager")  # fmt: skip
    assert "tiny/triton_fused" in result.skipped  # a CUDA backend, reported rather than timed
    rows = {(r.tokens, r.backend): r for r in result.rows}
    assert set(rows) == {(1, "auto"), (1, "grouped_mm"), (5, "auto"), (5, "grouped_mm")}
    for row in rows.values():
        assert set(row.times_s) == {UNCOMPILED, "default"} and not row.errors
        assert row.ratio("default") is not None and row.ratio("default") > 0
    assert rows[(5, "grouped_mm")].ran == {UNCOMPILED: "grouped_mm", "default": "grouped_mm"}
    # compiled, auto keeps to backends declared for torch.compile: not eager (it breaks graphs), which it may
    # pick uncompiled on a CPU
    assert rows[(5, "auto")].ran["default"] not in (None, "eager")
    assert set(result.compile_s) == {"tiny/auto/default", "tiny/grouped_mm/default"}
    table = compiled_table(result)
    assert "| tiny | 5 | auto (" in table and "default ÷ uncompiled" in table
    assert json.loads(json.dumps(result.to_dict()))["schema"] == "selector.bench.compiled/1"


def test_bench_compile_flag_checks_the_modes(capsys: pytest.CaptureFixture[str]) -> None:
    from selector.cli import main

    assert main(["bench", "--compile", "default,fastest"]) == 2
    assert "fastest: expected some of default, reduce-overhead" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_compiled_bench_on_one_small_preset(tmp_path) -> None:  # noqa: ANN001
    from selector.cli import main

    assert main(["bench", "--compile", "default,reduce-overhead", "--preset", "qwen1.5-moe-a2.7b", "--tokens", "1,64",
                 "--backends", "auto", "--rounds", "2", "--out", str(tmp_path)]) == 0  # fmt: skip
    data = json.loads((tmp_path / "compiled.json").read_text())
    rows = [r for r in data["rows"] if r["backend"] == "auto"]
    assert {r["tokens"] for r in rows} == {1, 64}
    assert all(set(r["times_s"]) == {"uncompiled", "default", "reduce-overhead"} for r in rows), rows
