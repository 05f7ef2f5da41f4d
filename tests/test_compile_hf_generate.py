"""benchmarks/hf_generate.py --interleave-compiled on a tiny model on the CPU: the compiled cells of a setting
take their rounds in turn, each backend's compiled decode step cached beside the others (nothing compiled while
timed), and the summary sets auto against the best Transformers backend of the same rounds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_generate.py"
NAME = "hf_generate_interleaved_under_test"


@pytest.fixture
def harness(monkeypatch):  # noqa: ANN001, ANN201
    spec = importlib.util.spec_from_file_location(NAME, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, NAME, module)  # Dynamo looks up the globals of traced functions by module name
    spec.loader.exec_module(module)
    return module


ARGV = ["hf_generate.py", "--tiny", "--device", "cpu", "--settings", "1x6", "--backends", "batched_mm",
        "--compiled-backends", "auto,batched_mm", "--new-tokens", "3", "--compiled-new-tokens", "3", "--repeats", "2",
        "--skip-steps", "1", "--compile-on-cpu", "--compile-backend", "eager", "--compiled-cell-s", "0",
        "--budget-s", "600", "--interleave-compiled"]  # fmt: skip


def test_interleaved_compiled_cells_reuse_their_graphs(harness, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(sys, "argv", [*ARGV, "--out", str(tmp_path)])
    assert harness.main() == 0
    result = json.loads((tmp_path / "hf_generate.json").read_text())
    compiled = [c for c in result["cells"] if c["mode"] == "compiled"]
    assert [c["backend"] for c in compiled] == ["auto", "batched_mm"]
    for cell in compiled:
        assert cell["status"] == "ok", cell
        assert not any(cell["timed_counts"].values()), cell  # both graphs cached: no recompile while timed
    summary = (tmp_path / "hf_generate.md").read_text().split("auto vs the best Transformers backend")[1]
    row = next(line for line in summary.splitlines() if line.startswith("| compiled | 1x6 |"))
    assert "(batched_mm" in row


def test_a_cell_that_resets_dynamo_has_the_cells_before_it_warmed_again(harness, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Transformers' eager loop cannot compile as one graph (a data-dependent size: UserError under fullgraph): its
    cell falls back to graph breaks after a reset, which dropped batched_mm's graphs; batched_mm is warmed again,
    so no timed round compiles."""
    argv = [a if a != "auto,batched_mm" else "batched_mm,eager" for a in ARGV]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path)])
    assert harness.main() == 0
    result = json.loads((tmp_path / "hf_generate.json").read_text())
    compiled = {c["backend"]: c for c in result["cells"] if c["mode"] == "compiled"}
    assert set(compiled) == {"batched_mm", "eager"}
    for cell in compiled.values():
        assert cell["status"] == "ok", cell
        assert not any(cell["timed_counts"].values()), cell
    assert "fullgraph_error" in compiled["eager"] and compiled["eager"]["fullgraph"] is False
    assert compiled["batched_mm"].get("warmed_again") is True and "warmed_again" not in compiled["eager"]


def test_interleaving_refuses_skipped_module_guards(harness, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(sys, "argv", [*ARGV, "--out", str(tmp_path), "--skip-module-guards"])
    with pytest.raises(SystemExit, match="needs Dynamo's module guards"):
        harness.main()
