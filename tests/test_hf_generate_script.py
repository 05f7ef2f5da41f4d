"""benchmarks/hf_generate.py's diagnostics on a tiny model on the CPU: the "null" experts backend, the
forward-only timing of the compiled decode step, --guard-filter, --cells, --defer-stop's patch.

test_hf_generate_bench.py covers the harness itself; this checks what the diagnostics claim.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_generate.py"
NAME = "hf_generate_script_under_test"


@pytest.fixture
def harness(monkeypatch):
    spec = importlib.util.spec_from_file_location(NAME, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, NAME, module)  # Dynamo looks up the globals of null_experts by module name
    spec.loader.exec_module(module)
    return module


def test_null_experts_returns_zeros_without_reading_the_module(harness):
    hidden = torch.randn(5, 16, dtype=torch.bfloat16)
    weights = torch.rand(5, 2).softmax(-1)
    out = harness.null_experts(None, hidden, torch.zeros(5, 2, dtype=torch.long), weights)  # no module at all
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    assert not out.any()


def test_parse_cell_keeps_a_colon_in_the_backend(harness):
    assert harness.parse_cell("compiled:selector:grouped_mm:4x128") == ("compiled", "selector:grouped_mm", 4, 128)
    assert harness.parse_cell("uncompiled:null:1x16") == ("uncompiled", "null", 1, 16)
    for bad in ("compiled:auto", "eager:auto:1x16", "compiled:auto:1by16"):
        with pytest.raises(SystemExit):
            harness.parse_cell(bad)


def test_guard_filter_goes_through_compile_config_options(harness):
    plain = harness.make_compile_config("inductor", "reduce-overhead", True, "off")
    assert plain.mode == "reduce-overhead" and plain.options is None
    filtered = harness.make_compile_config("inductor", "reduce-overhead", True, "inbuilt")
    # torch.compile refuses a mode beside options: the mode's Inductor options stand in for it
    assert filtered.mode is None and filtered.fullgraph
    assert filtered.options == {"triton.cudagraphs": True,
                                "guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe}
    other = harness.make_compile_config("eager", "reduce-overhead", False, "all")
    assert other.options == {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


def test_defer_stop_relaxes_only_the_device_rule(harness, monkeypatch):
    from transformers.generation import utils as gen

    check = getattr(gen, "DeferredStopCheck", None)
    if check is None:
        pytest.skip("this Transformers has no DeferredStopCheck")
    monkeypatch.setattr(check, "is_supported", check.__dict__["is_supported"])  # undone after the test
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not check.is_supported(cuda, None, False, is_assistant=False)  # Transformers: MPS only
    assert "events" in harness.allow_deferred_stop(cpu)  # refused off CUDA, nothing patched
    assert not check.is_supported(cuda, None, False, is_assistant=False)
    assert harness.allow_deferred_stop(cuda) is None
    assert check.is_supported(cuda, None, False, is_assistant=False)
    assert not check.is_supported(cuda, None, False, is_assistant=True)  # its other rules still hold
    assert not check.is_supported(cpu, None, False, is_assistant=False)


def test_forward_timer_repeats_one_decode_step_and_leaves_generate_unchanged(harness, monkeypatch):
    import selector.hf as hf

    argv = ["hf_generate.py", "--out", "unused", "--tiny", "--device", "cpu", "--compile-on-cpu",
            "--compile-backend", "eager", "--compiled-new-tokens", "4", "--repeats", "2", "--forward-steps", "3"]
    monkeypatch.setattr(sys, "argv", argv)
    args = harness.parse_args()
    harness.ensure_backends()
    hf.register_with_transformers()
    cpu = torch.device("cpu")
    model, cfg = harness.build_model(args, cpu, torch.float32)
    run = harness.CellRun(model, cfg, args, cpu, "compiled", "batched_mm", 1, 6)
    run.warm()
    assert run.ok, run.cell

    def generate() -> torch.Tensor:
        run.extra[harness.cache_kwarg(model)].reset()
        with torch.no_grad():
            return model.generate(input_ids=run.ids, attention_mask=run.mask, max_new_tokens=1 + run.n,
                                  min_new_tokens=1 + run.n, do_sample=False, **run.extra)

    expected = generate()
    compiled = model.__dict__["_compiled_call"]
    timer = harness.ForwardTimer(compiled, run.n, 3, 2, cpu)
    model._compiled_call = timer
    try:
        got = generate()
    finally:
        model._compiled_call = compiled
    assert timer.calls == run.n  # the timer ran inside generate(), at its last decode step
    assert len(timer.step_ms) == len(timer.host_ms) == 2 and min(timer.step_ms) > 0
    # 1 + 2 x 3 extra calls of one step: the same tokens, so each call redid that step in the same KV slot
    assert torch.equal(got, expected)


def test_cells_in_order_null_forward_only_and_guard_filter(harness, tmp_path, monkeypatch):
    seen = []
    original = torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe

    def spy(entries):
        seen.append(len(entries))
        return original(entries)

    monkeypatch.setattr(torch.compiler, "skip_guard_on_inbuilt_nn_modules_unsafe", spy)
    cells = ["compiled:null:1x6", "compiled:auto:1x6", "compiled:batched_mm:1x6", "compiled:batched_mm:2x4",
             "uncompiled:null:1x6", "uncompiled:batched_mm:1x6"]
    argv = ["hf_generate.py", "--out", str(tmp_path), "--tiny", "--device", "cpu", "--cells", ",".join(cells),
            "--new-tokens", "3", "--compiled-new-tokens", "3", "--repeats", "2", "--skip-steps", "1",
            "--compile-on-cpu", "--compile-backend", "eager", "--compiled-cell-s", "0", "--budget-s", "600",
            "--forward-steps", "4", "--guard-filter", "inbuilt"]
    monkeypatch.setattr(sys, "argv", argv)
    assert harness.main() == 0
    result = json.loads((tmp_path / "hf_generate.json").read_text())
    assert [f"{c['mode']}:{c['backend']}:{c['batch']}x{c['prompt']}" for c in result["cells"]] == cells
    assert result["options"]["guard_filter"] == "skip_guard_on_inbuilt_nn_modules_unsafe"
    for cell in result["cells"]:
        assert cell["status"] == "ok", cell
        assert not any(cell["timed_counts"].values()), cell  # the forward-only calls compiled nothing new
    compiled = [c for c in result["cells"] if c["mode"] == "compiled"]
    for cell in compiled:
        assert cell["guard_filter"] == "inbuilt" and cell["warmup_counts"]["graph_breaks"] == 0
        assert cell["forward_ms_per_step"] > 0 and cell["forward_host_ms_per_call"] > 0
        assert cell["generate_adds_ms_per_step"] == pytest.approx(
            cell["decode_ms_per_token"] - cell["forward_ms_per_step"])
        assert cell["forward_steps"] == "2 x 4 calls at decode step 3"
    assert len(seen) >= len(compiled)  # each compiled cell compiled afresh through the filter
    for cell in (c for c in result["cells"] if c["backend"] == "null"):
        assert cell["note"] == harness.NULL_NOTE and cell["decode_ms_per_token"] > 0
    assert all("forward_ms_per_step" not in c for c in result["cells"] if c["mode"] == "uncompiled")
    table = (tmp_path / "hf_generate.md").read_text()
    assert "Run with: guard filter skip_guard_on_inbuilt_nn_modules_unsafe." in table
    assert "| fwd-only ms/step |" in table
    assert "| compiled | 1x6 | null |" in table and "output wrong by design" in table
    summary = table.split("null: the bound for any experts backend")[1]
    row = next(line for line in summary.splitlines() if line.startswith("| compiled | 1x6 |"))
    assert "(batched_mm" in row and "(null" not in row  # null is the bound, never the best peer
    assert row.rstrip(" |").endswith("(-)")  # null's decode beside it (no floor on a CPU)
