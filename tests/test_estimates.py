"""The static estimates against the curated measurements. On a fresh store `auto` ranks by the backends' estimates
(selector/costmodel.py and each plugin's `estimate`); for every dense cell that each GPU's curated results measured,
the backend the estimates rank first must have run within 5% of the fastest of the torch and Triton backends measured
in the same interleaved run (H200: `bench.json`, selector's own backends; H100: `untuned.json`, untuned `auto`,
which ran triton_fused in every cell, beside Transformers' grouped_mm and batched_mm, the same algorithms as
selector's). SonicMoE and the other hub kernels are left out: their estimates carry the first call's JIT build,
which a curated (warm) run does not show."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from selector.environment import collect_environment
from selector.presets import preset
from selector.registry import build_registry

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
BACKENDS = ("triton_fused", "grouped_mm", "batched_mm")
WITHIN = 1.05
# per result file: the GPU it was measured on and how its runners map to selector's backends
CURATED = {
    "h200/bench.json": ("NVIDIA H200:9.0:141", {name: name for name in BACKENDS}),
    "h100/untuned.json": ("NVIDIA H100 80GB HBM3:9.0:80",
                          {"untuned": "triton_fused", "hf:grouped_mm": "grouped_mm", "hf:batched_mm": "batched_mm"}),
}  # fmt: skip


def _cells(path: Path, runners: dict[str, str]) -> dict[tuple[str, int, str], dict[str, float]]:
    """{(shape, tokens, mode): {backend: seconds}} of the dense cells with two backends or more."""
    doc = json.loads(path.read_text())
    found: dict[tuple[str, int, str], dict[str, float]] = {}
    if "rows" in doc:  # benchmarks/untuned.py
        for row in doc["rows"]:
            times = {runners[k]: us * 1e-6 for k, us in row["us"].items() if k in runners}
            found[(row["shape"], row["tokens"], row["mode"])] = times
    else:  # selector bench
        for cell in doc["cells"]:
            if cell["format"] == "dense" and cell["time_s"] and not cell["skipped"] and cell["backend"] in runners:
                key = (cell["shape"], cell["tokens"], cell["mode"])
                found.setdefault(key, {})[runners[cell["backend"]]] = cell["time_s"]
    return {k: v for k, v in found.items() if len(v) >= 2}


@pytest.mark.parametrize("name", sorted(CURATED))
def test_the_estimates_pick_what_the_curated_runs_measured_fastest(name: str) -> None:
    gpu, runners = CURATED[name]
    env = collect_environment({"SELECTOR_GPUS": gpu, "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""})
    specs = build_registry(environ={}).specs
    cells = _cells(RESULTS / name, runners)
    assert len(cells) >= 40, f"{name}: {len(cells)} cells"
    misses = []
    for (shape, tokens, mode), measured in sorted(cells.items()):
        problem = replace(preset(shape).with_tokens(tokens), device="cuda", dtype="bfloat16")
        estimated = {b: specs[b].estimate(problem, env) for b in measured}
        pick = min(estimated, key=estimated.__getitem__)
        if measured[pick] > WITHIN * min(measured.values()):
            misses.append(f"{shape} T={tokens} {mode}: {pick} {measured[pick] / min(measured.values()):.2f}x")
    assert not misses, misses
