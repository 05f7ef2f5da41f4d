"""Plugin loading through entry points: fake third-party distributions on sys.path, no core change."""

from __future__ import annotations

import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from selector.registry import ALLOW_VARIABLE, BLOCK_VARIABLE, build_registry

GOOD_PLUGIN = '''
from selector import BackendSpec, Requirements, hookimpl

def _load():
    def forward(module, hidden_states, top_k_index, top_k_weights):
        return hidden_states * 0 + 42.0
    return forward

@hookimpl
def selector_backends():
    return [BackendSpec(name="fake_third_party", load=_load, description="a fake kernel for tests",
                        requirements=Requirements(devices=frozenset({"cpu"})))]
'''


def make_distribution(root: Path, dist: str, module: str, source: str, entry_points: dict[str, str]) -> None:
    """Write `module.py` and a `dist-0.1.dist-info` with METADATA and entry_points.txt under root."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[selector.backends]\n{lines}\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("fake_plugin_good", "fake_plugin_broken", "fake_plugin_dup"):
        sys.modules.pop(name, None)


def _ours(site: Path) -> list[metadata.EntryPoint]:
    return [ep for ep in metadata.entry_points(group="selector.backends") if ep.dist and "fake" in ep.dist.metadata["Name"]]


def test_third_party_distribution_adds_a_backend(site: Path) -> None:
    make_distribution(site, "fake-good", "fake_plugin_good", GOOD_PLUGIN, {"fake_good": "fake_plugin_good"})
    registry = build_registry(environ={})
    assert "fake_third_party" in registry.names
    assert {"eager", "batched_mm", "grouped_mm"} <= set(registry.names)  # built-ins take the same road
    info = next(p for p in registry.plugins if p.name == "fake_good")
    assert info.distribution == "fake-good 0.1" and info.backends == ("fake_third_party",)
    assert registry.providers["fake_third_party"] == "fake_good"


def test_plugin_whose_import_raises_is_reported_not_fatal(site: Path) -> None:
    make_distribution(site, "fake-good", "fake_plugin_good", GOOD_PLUGIN, {"fake_good": "fake_plugin_good"})
    make_distribution(site, "fake-broken", "fake_plugin_broken", "raise RuntimeError('boom at import')\n",
                      {"fake_broken": "fake_plugin_broken"})
    registry = build_registry(environ={})
    broken = next(p for p in registry.plugins if p.name == "fake_broken")
    assert broken.error and "RuntimeError: boom at import" in broken.error
    assert broken.distribution == "fake-broken 0.1"
    assert "fake_third_party" in registry.names and "eager" in registry.names


def test_duplicate_names_report_both_providers(site: Path) -> None:
    make_distribution(site, "fake-good", "fake_plugin_good", GOOD_PLUGIN, {"fake_good": "fake_plugin_good"})
    make_distribution(site, "fake-dup", "fake_plugin_dup", GOOD_PLUGIN, {"fake_dup": "fake_plugin_dup"})
    registry = build_registry(entry_points=_ours(site), environ={})
    assert len(registry.problems) == 1
    assert "'fake_third_party'" in registry.problems[0]
    assert "'fake_dup'" in registry.problems[0] and "'fake_good'" in registry.problems[0]


def test_allow_and_block_lists(site: Path) -> None:
    make_distribution(site, "fake-good", "fake_plugin_good", GOOD_PLUGIN, {"fake_good": "fake_plugin_good"})
    blocked = build_registry(environ={BLOCK_VARIABLE: "fake_good, batched_mm"})
    assert "fake_third_party" not in blocked.names and "batched_mm" not in blocked.names
    assert next(p for p in blocked.plugins if p.name == "fake_good").skipped == f"in {BLOCK_VARIABLE}"
    allowed = build_registry(environ={ALLOW_VARIABLE: "eager"})
    assert allowed.names == ["eager"]


def test_malformed_specs_are_rejected(site: Path) -> None:
    bad = GOOD_PLUGIN.replace('name="fake_third_party"', 'name="Bad Name"')
    make_distribution(site, "fake-good", "fake_plugin_good", bad, {"fake_good": "fake_plugin_good"})
    registry = build_registry(entry_points=_ours(site), environ={})
    assert registry.names == []
    assert "not allowed" in (registry.plugins[0].error or "")


def test_unknown_backend_lists_registered_names() -> None:
    registry = build_registry(environ={})
    with pytest.raises(ValueError, match="registered backends: .*eager.*grouped_mm"):
        registry.get("no_such_backend")


@pytest.mark.parametrize("returned", ["None", "'eager'", "3"])
def test_a_hook_that_returns_no_list_is_reported_broken(site: Path, returned: str) -> None:
    source = f"from selector import hookimpl\n\n@hookimpl\ndef selector_backends():\n    return {returned}\n"
    make_distribution(site, "fake-dup", "fake_plugin_dup", source, {"fake_none": "fake_plugin_dup"})
    registry = build_registry(environ={})
    info = next(p for p in registry.plugins if p.name == "fake_none")
    kind = {"None": "NoneType", "'eager'": "str", "3": "int"}[returned]
    assert info.error == f"hook selector_backends returned {kind}, not a list of BackendSpec" and not info.backends
    assert "eager" in registry.names
