"""benchmarks/hf_generate.py's compile options on a tiny model on the CPU: --skip-module-guards goes through
selector.hf.compile_config and each compiled cell compiles afresh through the filter.

test_hf_generate_bench.py covers the harness itself; this checks what the option claims.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_generate.py"
NAME = "hf_generate_script_under_test"


@pytest.fixture
def harness(monkeypatch):
    spec = importlib.util.spec_from_file_location(NAME, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, NAME, module)  # Dynamo looks up the globals of traced functions by module name
    spec.loader.exec_module(module)
    return module


def test_module_guards_go_through_compile_config_options(harness):
    plain = harness.make_compile_config("inductor", "reduce-overhead", True, False)
    assert plain.mode == "reduce-overhead" and plain.options is None
    filtered = harness.make_compile_config("inductor", "reduce-overhead", True, True)
    # torch.compile refuses a mode beside options: the mode's Inductor options stand in for it
    assert filtered.mode is None and filtered.fullgraph
    assert filtered.options == {"triton.cudagraphs": True,
                                "guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe}


def test_skip_module_guards_compiles_every_cell_afresh(harness, tmp_path, monkeypatch):
    seen = []
    original = torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe

    def spy(entries):
        seen.append(len(entries))
        return original(entries)

    monkeypatch.setattr(torch.compiler, "skip_guard_on_inbuilt_nn_modules_unsafe", spy)
    argv = ["hf_generate.py", "--out", str(tmp_path), "--tiny", "--device", "cpu", "--settings", "1x6,2x4",
            "--backends", "batched_mm", "--compiled-backends", "auto,batched_mm", "--new-tokens", "3",
            "--compiled-new-tokens", "3", "--repeats", "2", "--skip-steps", "1", "--compile-on-cpu",
            "--compile-backend", "eager", "--compiled-cell-s", "0", "--budget-s", "600", "--skip-module-guards"]
    monkeypatch.setattr(sys, "argv", argv)
    assert harness.main() == 0
    result = json.loads((tmp_path / "hf_generate.json").read_text())
    assert result["options"]["skip_module_guards"] is True
    assert [f"{c['mode']}:{c['backend']}:{c['batch']}x{c['prompt']}" for c in result["cells"]] == [
        "uncompiled:batched_mm:1x6", "uncompiled:batched_mm:2x4", "compiled:auto:1x6", "compiled:batched_mm:1x6",
        "compiled:auto:2x4", "compiled:batched_mm:2x4"]
    for cell in result["cells"]:
        assert cell["status"] == "ok", cell
        assert not any(cell["timed_counts"].values()), cell  # nothing compiled or recorded while timed
    compiled = [c for c in result["cells"] if c["mode"] == "compiled"]
    for cell in compiled:
        assert cell["skip_module_guards"] and cell["warmup_counts"]["graph_breaks"] == 0
    assert len(seen) >= len(compiled)  # each compiled cell compiled afresh through the filter
    table = (tmp_path / "hf_generate.md").read_text()
    assert table.startswith("Run with: skip_module_guards.")
    summary = table.split("auto vs the best Transformers backend")[1]
    row = next(line for line in summary.splitlines() if line.startswith("| compiled | 1x6 |"))
    assert "(batched_mm" in row
