"""benchmarks/hf_generate.py on a tiny model on the CPU: every cell measured, compiled cells one graph.

The GPU numbers come from the same code; this checks the harness itself (per-step clock, reused static cache,
interleaved rounds, the counters it reports), not speed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_generate.py"


def _harness():
    spec = importlib.util.spec_from_file_location("hf_generate_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_measures_every_cell_and_compiles_one_graph(tmp_path, monkeypatch):
    harness = _harness()
    argv = ["hf_generate.py", "--out", str(tmp_path), "--tiny", "--device", "cpu", "--settings", "1x6,2x4",
            "--backends", "auto,batched_mm", "--compiled-backends", "auto,batched_mm", "--new-tokens", "3",
            "--compiled-new-tokens", "3", "--repeats", "2", "--skip-steps", "1", "--compile-on-cpu",
            "--compile-backend", "eager", "--compiled-cell-s", "0", "--budget-s", "600"]
    monkeypatch.setattr(sys, "argv", argv)
    assert harness.main() == 0
    result = json.loads((tmp_path / "hf_generate.json").read_text())
    cells = result["cells"]
    assert {(c["mode"], c["backend"], c["batch"]) for c in cells} == {
        (mode, backend, batch) for mode in ("uncompiled", "compiled") for backend in ("auto", "batched_mm")
        for batch in (1, 2)
    }
    for cell in cells:
        assert cell["status"] == "ok", cell
        assert [len(run) for run in cell["step_ms"]] == [3, 3]  # 3 decode steps in each of 2 rounds
        assert cell["decode_ms_per_token"] > 0 and cell["prefill_ms"] > 0
        assert not any(cell["timed_counts"].values()), cell["timed_counts"]  # nothing compiled or recorded while timed
    for cell in (c for c in cells if c["mode"] == "compiled"):
        assert cell["fullgraph"] and "fullgraph_error" not in cell
        assert cell["warmup_counts"]["graph_breaks"] == 0
        assert cell["cache"] == "one static cache, reset per call"
    assert "| compiled | 1x6 | auto |" in (tmp_path / "hf_generate.md").read_text()
