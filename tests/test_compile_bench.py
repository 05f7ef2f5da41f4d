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


@pytest.mark.compile
def test_a_stack_of_layers_is_compiled_as_one_and_timed_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    from selector.bench import compiled
    from selector.bench.timing import Timing

    timed: list[dict[str, object]] = []
    real = compiled.time_interleaved

    def per_call(torch, runners, mode, **kwargs):  # noqa: ANN001, ANN003, ANN202
        timed.append(dict(runners))
        real(torch, runners, mode, **kwargs)  # every runner really runs (an error would drop it)...
        return {name: Timing(6e-6, 0.1, (6e-6,)) for name in runners}  # ... and takes 6 us a call

    monkeypatch.setattr(compiled, "time_interleaved", per_call)
    tiny = Problem(4, 16, 8, 2, dtype="float32", device="cpu")
    result = run_compiled_bench(presets={"tiny": tiny}, tokens=(1, 5), modes=("default",), backends=("auto", "grouped_mm"),
                                dtype_name="float32", rounds=2, sample_s=0.0, device="cpu", compiler="aot_eager",
                                stack=3)  # fmt: skip
    assert len(timed) == 2 and set(timed[0]) == {"auto|uncompiled", "auto|default", "grouped_mm|uncompiled",
                                                 "grouped_mm|default"}  # fmt: skip
    rows = {(r.tokens, r.backend): r for r in result.rows}
    assert set(rows) == {(1, "auto"), (1, "grouped_mm"), (5, "auto"), (5, "grouped_mm")}
    for row in rows.values():
        assert not row.errors
        assert row.times_s == {UNCOMPILED: pytest.approx(2e-6), "default": pytest.approx(2e-6)}  # 6 us / 3 layers
    assert rows[(5, "grouped_mm")].ran == {UNCOMPILED: "grouped_mm", "default": "grouped_mm"}
    assert rows[(5, "auto")].ran["default"] not in (None, "eager")
    data = json.loads(json.dumps(result.to_dict()))
    assert data["stack"] == 3 and data["times_per"] == "layer"
    table = compiled_table(result)
    assert table.startswith("A stack of 3 experts layers per call") and "uncompiled µs/layer" in table
    assert "| tiny | 5 | grouped_mm | 2 (±10%) | 2 (±10%) | 1.00 |" in table


@pytest.mark.compile
def test_a_stack_matches_its_layers_run_one_after_another() -> None:
    """What the stack bench times is what a decoder stack computes: x = x + layer_i(x) for each layer."""
    import torch

    from selector.bench import compiled
    from selector.bench.layer import make_layer, random_routing

    tiny = Problem(4, 16, 8, 2, dtype="float32", device="cpu")
    layers = [make_layer(torch, tiny, torch.float32, "cpu", seed=i) for i in range(3)]
    index, weights = random_routing(torch, 5, 4, 2, "cpu", seed=0)
    x = torch.randn(5, 16)
    with torch.no_grad():
        want = x
        for layer in layers:
            want = want + layer(want, index, weights)
        stack = compiled.experts_stack(torch, layers)
        assert torch.allclose(stack(x, index, weights), want)
        torch._dynamo.reset()
        out = torch.compile(stack, backend="aot_eager", fullgraph=True, dynamic=True)(x, index, weights)
        torch._dynamo.reset()
    assert torch.allclose(out, want, atol=1e-5)
    assert layers[0].gate_up_proj.data_ptr() != layers[1].gate_up_proj.data_ptr()  # each layer its own weights


def test_bench_stack_flag_needs_compile_and_a_positive_count(capsys: pytest.CaptureFixture[str]) -> None:
    from selector.cli import main

    assert main(["bench", "--compile", "default", "--stack", "0"]) == 2
    assert "expected a whole number of layers, at least 1" in capsys.readouterr().err
    assert main(["bench", "--stack", "4"]) == 2
    assert "--stack goes with --compile" in capsys.readouterr().err
    assert main(["bench", "--compile", "default", "--modes", "eager,train"]) == 2
    assert "with --compile, --modes is train" in capsys.readouterr().err


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


@pytest.mark.gpu
def test_gpu_compiled_bench_of_a_stack(tmp_path) -> None:  # noqa: ANN001
    from selector.cli import main

    assert main(["bench", "--compile", "default", "--stack", "2", "--preset", "qwen1.5-moe-a2.7b", "--tokens", "1",
                 "--backends", "auto", "--rounds", "2", "--out", str(tmp_path)]) == 0  # fmt: skip
    data = json.loads((tmp_path / "compiled.json").read_text())
    assert data["stack"] == 2 and data["times_per"] == "layer"
    (row,) = data["rows"]
    assert set(row["times_s"]) == {"uncompiled", "default"} and not row["errors"], row


@pytest.mark.compile
def test_training_steps_are_timed_compiled_and_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--modes train` with `--compile`: each timed call is a forward under autograd and its backward, compiled
    with autograd (auto is traced then, a differentiable backend)."""
    from selector.bench import grid

    steps: list[tuple] = []
    real = grid.train_step
    monkeypatch.setattr(grid, "train_step", lambda fn, layer, x, i, w, g, params: steps.append((x, w, params))
                        or real(fn, layer, x, i, w, g, params))  # fmt: skip
    tiny = Problem(4, 16, 8, 2, dtype="float32", device="cpu")
    result = run_compiled_bench(presets={"tiny": tiny}, tokens=(1, 5), modes=("default",),
                                backends=("auto", "grouped_mm"), dtype_name="float32", rounds=2, sample_s=0.0,
                                device="cpu", compiler="aot_eager", train=True)  # fmt: skip
    rows = {(r.tokens, r.backend): r for r in result.rows}
    assert set(rows) == {(1, "auto"), (1, "grouped_mm"), (5, "auto"), (5, "grouped_mm")}
    from selector.dispatch import get_backend_registry

    for row in rows.values():
        assert set(row.times_s) == {UNCOMPILED, "default"} and not row.errors, row
        for ran in row.ran.values():  # whatever ran trains every input
            assert {"hidden_states", "routing_weights", "expert_weights"} <= get_backend_registry().get(ran).differentiable
    assert result.to_dict()["call"] == "train step"
    assert steps and all(params for _, _, params in steps)  # the expert weights train too
    for x, w, params in steps:  # every step ran its backward: its leaves hold gradients
        assert x.grad is not None and w.grad is not None and all(p.grad is not None for p in params)
    assert "Each call is a training step" in compiled_table(result)
