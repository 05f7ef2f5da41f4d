"""An outside kernel package, as a plugin author ships one: a distribution with a `selector.backends` entry point,
written to a folder on sys.path (selector.testing.write_distribution) and loaded by the registry the way it
loads every plugin. Its backends run a combined layout (biases on transposed weights), and the contract check
passes the right one and fails the one that drops the biases there and the one that runs nothing."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from selector.registry import build_registry
from selector.testing import check_backend_contract, write_distribution

PACKAGE = "outside_moe"

PLUGIN = '''
import torch

from selector import Availability, BackendSpec, Requirements, Status, hookimpl, layers


def _forward(module, hidden_states, top_k_index, top_k_weights, with_bias):
    """A loop over the top-k slots; transposed weights are [E, in, out], the others [E, out, in]."""
    up_w, down_w = layers.up_weight(module), layers.down_weight(module)
    up_b, down_b = layers.up_bias(module), layers.down_bias(module)
    matmul = "ti,tio->to" if module.is_transposed else "ti,toi->to"
    # the bug of the second backend: it adds the biases of [E, out, in] weights only
    with_bias = with_bias or not module.is_transposed
    out = torch.zeros_like(hidden_states)
    for slot in range(top_k_index.shape[1]):
        e = top_k_index[:, slot]
        h = torch.einsum(matmul, hidden_states, up_w[e])
        h = h + up_b[e] if up_b is not None and with_bias else h
        y = torch.einsum(matmul, layers.activate(module, h), down_w[e])
        y = y + down_b[e] if down_b is not None and with_bias else y
        out += top_k_weights[:, slot, None].to(y.dtype) * y
    return out


def forward(module, hidden_states, top_k_index, top_k_weights):
    return _forward(module, hidden_states, top_k_index, top_k_weights, with_bias=True)


def forward_without_transposed_bias(module, hidden_states, top_k_index, top_k_weights):
    return _forward(module, hidden_states, top_k_index, top_k_weights, with_bias=False)


def refuse(problem, env):
    return Availability(Status.UNSUPPORTED_CONFIG, "this build runs no layer yet")


BIAS_TRANSPOSED = Requirements(bias=True, transposed=True)


@hookimpl
def selector_backends():
    return [
        BackendSpec("outside_right", load=lambda: forward, requirements=BIAS_TRANSPOSED),
        BackendSpec("outside_drops_bias", load=lambda: forward_without_transposed_bias, requirements=BIAS_TRANSPOSED),
        BackendSpec("outside_runs_nothing", load=lambda: forward, requirements=BIAS_TRANSPOSED, check=refuse),
    ]
'''


@pytest.fixture
def outside_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The outside distribution on sys.path for this test only."""
    files = {f"{PACKAGE}/__init__.py": "", f"{PACKAGE}/selector_plugin.py": PLUGIN}
    info = write_distribution(tmp_path, "outside-moe", {"outside_moe": f"{PACKAGE}.selector_plugin"}, files=files)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield info
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
        del sys.modules[name]


def test_the_distribution_is_laid_out_as_pip_installs_one(outside_plugin: Path) -> None:
    assert outside_plugin.name == "outside_moe-0.1.dist-info"
    assert (outside_plugin / "entry_points.txt").read_text() == (
        "[selector.backends]\noutside_moe = outside_moe.selector_plugin\n")
    assert "Name: outside-moe\nVersion: 0.1" in (outside_plugin / "METADATA").read_text()


def test_the_contract_check_judges_an_outside_plugin_on_its_combined_layout(outside_plugin: Path) -> None:
    registry = build_registry(environ={})  # the entry points of every distribution on sys.path, built-ins too
    info = next(p for p in registry.plugins if p.name == "outside_moe")
    assert info.error is None and info.distribution == "outside-moe 0.1"
    assert info.backends == ("outside_right", "outside_drops_bias", "outside_runs_nothing")

    right = check_backend_contract(registry.get("outside_right"), device="cpu")
    assert right.ok, right.describe()
    assert right.checked == ["plain", "bias", "transposed", "bias+transposed"]

    drops = check_backend_contract(registry.get("outside_drops_bias"), device="cpu")
    assert drops.checked == right.checked and not drops.ok
    assert [drops.results[n] for n in ("plain", "bias", "transposed")] == ["ok", "ok", "ok"]
    assert drops.failures[0].startswith(
        "outside_drops_bias declares bias=True, transposed=True but T=1: differs from the float64 reference")

    nothing = check_backend_contract(registry.get("outside_runs_nothing"), device="cpu")
    assert nothing.checked == [] and not nothing.ok
    assert nothing.results["bias+transposed"] == "cannot run here: this build runs no layer yet"
    assert nothing.failures[0].startswith(
        "outside_runs_nothing checked no layout on cpu (float32): this build runs no layer yet. A check that runs "
        "nothing proves nothing")
