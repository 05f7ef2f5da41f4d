"""Plugins claim only what they run, and one broken plugin never bricks the tool.

Every plugin here is a fake third-party distribution built in the test (a `*.dist-info` with `entry_points.txt`
on sys.path), loaded through the same entry-point road as the built-ins.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from test_registry import make_distribution

from selector import cli
from selector.probes import collect_environment
from selector.ranking import rank
from selector.registry import ALLOW_VARIABLE, TIMEOUT_VARIABLE, build_registry, reset_registry
from selector.requirements import evaluate
from selector.types import Problem, Requirements, Status

PLAIN_PLUGIN = '''
from selector import BackendSpec, Requirements, hookimpl

def _load():
    def forward(module, hidden_states, top_k_index, top_k_weights):
        return hidden_states * 0
    return forward

@hookimpl
def selector_backends():
    # written from the README: only the devices said, every layout flag left at its default
    return [BackendSpec(name="plain_third_party", load=_load, requirements=Requirements(devices=frozenset({"cpu"})),
                        estimate=lambda problem, env: 0.0)]  # claims to beat every built-in
'''

EXITING_PLUGIN = '''
import sys
from selector import hookimpl

@hookimpl
def selector_backends():
    sys.exit(4)
'''

RAISING_PLUGIN = '''
from selector import hookimpl

@hookimpl
def selector_backends():
    raise RuntimeError("boom in the hook")
'''

IMPOSTOR_PLUGIN = '''
from selector import BackendSpec, hookimpl

def _load():
    raise AssertionError("the impostor's forward must never be loaded")

@hookimpl
def selector_backends():
    return [BackendSpec(name="eager", load=_load, estimate=lambda problem, env: 0.0)]
'''

HANGING_PLUGIN = '''
import threading
from selector import hookimpl

@hookimpl
def selector_backends():
    threading.Event().wait()  # never returns
'''

EXIT_AT_IMPORT = "import sys\nsys.exit(5)\n"

MODULES = ("fake_safety_plain", "fake_safety_exit", "fake_safety_raise", "fake_safety_impostor", "fake_safety_hang",
           "fake_safety_exit_import")
CPU = collect_environment(environ={"SELECTOR_GPUS": "", "PATH": ""})
PLAIN = Problem(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2, dtype="float32", device="cpu")
LAYOUTS = {
    "transposed": replace(PLAIN, is_transposed=True),
    "biased": replace(PLAIN, has_bias=True),
    "interleaved": replace(PLAIN, interleaved=True),
    "custom gate": replace(PLAIN, custom_gate=True),
    "expert parallel": replace(PLAIN, expert_parallel=True),
    "post-expert norm": replace(PLAIN, post_expert_norm=True),
    "non-gated": replace(PLAIN, gated=False),
    # GPT-OSS's experts: everything at once
    "gpt-oss": replace(PLAIN, is_transposed=True, interleaved=True, has_bias=True, custom_gate=True),
}


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    reset_registry()  # `selector plugins` / `doctor` leave a process-wide registry that holds these plugins
    for name in MODULES:
        sys.modules.pop(name, None)


def _install(site: Path, dist: str, module: str, source: str) -> None:
    make_distribution(site, dist, module, source, {dist.replace("-", "_"): module})


def _install_broken(site: Path) -> None:
    _install(site, "fake-exit", "fake_safety_exit", EXITING_PLUGIN)
    _install(site, "fake-raise", "fake_safety_raise", RAISING_PLUGIN)
    _install(site, "fake-impostor", "fake_safety_impostor", IMPOSTOR_PLUGIN)


def test_requirements_default_to_the_plain_layout() -> None:
    req = Requirements()
    assert req.gated and not req.non_gated
    assert not (req.bias or req.transposed or req.interleaved or req.custom_gate or req.post_expert_norm
                or req.expert_parallel)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_default_requirements_never_run_another_layout(site: Path, layout: str) -> None:
    _install(site, "fake-plain", "fake_safety_plain", PLAIN_PLUGIN)
    registry = build_registry(environ={})
    spec = registry.get("plain_third_party")
    verdict = evaluate(spec, LAYOUTS[layout], CPU)
    assert verdict.status is Status.UNSUPPORTED_CONFIG and verdict.status.error_type is ValueError
    assert verdict.reason.startswith("does not support ")
    ranking = rank(LAYOUTS[layout], CPU, registry)
    assert "plain_third_party" not in [c.name for c in ranking.candidates]
    assert ranking.excluded["plain_third_party"].status is Status.UNSUPPORTED_CONFIG
    assert ranking.best == "eager" or ranking.best in registry.names  # a built-in that runs it is chosen


def test_default_requirements_run_the_plain_layout(site: Path) -> None:
    _install(site, "fake-plain", "fake_safety_plain", PLAIN_PLUGIN)
    registry = build_registry(environ={})
    assert evaluate(registry.get("plain_third_party"), PLAIN, CPU).ok
    assert rank(PLAIN, CPU, registry).best == "plain_third_party"  # its estimate of 0 wins


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reference_backend_still_runs_every_layout(layout: str) -> None:
    registry = build_registry(environ={})
    assert evaluate(registry.get("eager"), LAYOUTS[layout], CPU).ok


def test_broken_hooks_are_reported_and_skipped(site: Path) -> None:
    _install_broken(site)
    registry = build_registry(environ={})  # sys.exit(4) in a hook does not end the process
    info = {p.name: p for p in registry.plugins}
    assert info["fake_exit"].error == (
        f"hook failed: called sys.exit(4) (at {site / 'fake_safety_exit.py'}:7)"
    )
    assert info["fake_raise"].error and "hook failed: RuntimeError: boom in the hook" in info["fake_raise"].error
    impostor = info["fake_impostor"]
    assert impostor.backends == ()
    assert impostor.error and "'eager' is a built-in backend's name; keeping the built-in 'eager'" in impostor.error
    assert ALLOW_VARIABLE in impostor.error
    assert registry.providers["eager"] == "eager"
    assert registry.specs["eager"].load.__module__ == "selector.plugins.eager"
    assert rank(PLAIN, CPU, registry).best != "fake_impostor"


def test_eager_that_runs_is_the_built_in(site: Path) -> None:
    pytest.importorskip("torch")
    import selector
    from experts_fixtures import Layout, make_experts, random_routing, reference_experts, relative_error
    from selector.dispatch import last_backend
    from selector.registry import get_registry

    _install_broken(site)
    reset_registry()  # the process-wide registry now loads the broken plugins too
    try:
        assert get_registry().providers["eager"] == "eager"
        module = make_experts(4, 16, 8, Layout(bias=True, transposed=True), seed=0)
        x = torch_randn(5, 16)
        index, weights = random_routing(5, 4, 2)
        selector.set_experts_implementation(module, "eager")
        out = module(x, index, weights)  # the impostor's load() would raise AssertionError
        assert last_backend(module) == "eager"
        assert relative_error(out, reference_experts(module, x, index, weights)) < 1e-5
    finally:
        reset_registry()


def torch_randn(*shape: int):  # noqa: ANN201 - torch is imported only where the test runs it
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def test_allow_listed_plugin_may_replace_a_built_in(site: Path) -> None:
    _install(site, "fake-impostor", "fake_safety_impostor", IMPOSTOR_PLUGIN)
    registry = build_registry(environ={ALLOW_VARIABLE: "eager,fake_impostor"})
    assert registry.providers["eager"] == "fake_impostor"
    assert any("the built-in is replaced by 'fake_impostor'" in p for p in registry.problems)


def test_sys_exit_at_import_is_reported(site: Path) -> None:
    _install(site, "fake-exit-import", "fake_safety_exit_import", EXIT_AT_IMPORT)
    registry = build_registry(environ={})
    info = next(p for p in registry.plugins if p.name == "fake_exit_import")
    assert info.error and info.error.startswith("import failed: called sys.exit(5)")
    assert "eager" in registry.names


def test_a_hanging_hook_is_bounded(site: Path) -> None:
    _install(site, "fake-hang", "fake_safety_hang", HANGING_PLUGIN)
    registry = build_registry(environ={TIMEOUT_VARIABLE: "0.2"})
    info = next(p for p in registry.plugins if p.name == "fake_hang")
    assert info.error == f"hook failed: did not answer within 0.2 s (raise {TIMEOUT_VARIABLE} if it is only slow)"
    assert "eager" in registry.names


def test_plugins_json_reports_them(site: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _install_broken(site)
    monkeypatch.delenv(ALLOW_VARIABLE, raising=False)
    code = cli.main(["plugins", "--json"])
    report = json.loads(capsys.readouterr().out)
    errors = {p["name"]: p["error"] for p in report["plugins"]}
    assert "sys.exit(4)" in errors["fake_exit"] and "boom in the hook" in errors["fake_raise"]
    assert "built-in backend's name" in errors["fake_impostor"]
    assert next(p for p in report["plugins"] if p["name"] == "eager")["backends"] == ["eager"]
    assert code == 1  # `selector plugins` exits 1 while a plugin is broken


def _doctor(site: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict]:
    _install_broken(site)
    monkeypatch.setenv("SELECTOR_GPUS", "")
    monkeypatch.delenv(ALLOW_VARIABLE, raising=False)
    code = cli.main(["doctor", "--json"])  # sys.exit(4) in a hook would have ended the command with 4
    return code, json.loads(capsys.readouterr().out)


def test_doctor_still_runs_with_them_installed(site: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    code, report = _doctor(site, capsys, monkeypatch)
    errors = {p["name"]: p["error"] for p in report["plugins"]}
    assert "sys.exit(4)" in errors["fake_exit"] and "boom in the hook" in errors["fake_raise"]
    assert "built-in backend's name" in errors["fake_impostor"]
    # the three broken plugins are reported as warnings, nothing is broken: the built-ins are whole
    assert sorted(w.split(":")[0] for w in report["warnings"] if w.startswith("plugin ")) == [
        "plugin fake_exit", "plugin fake_impostor", "plugin fake_raise"]
    assert report["broken"] == []
    assert code == report["exit_code"]
    plugins = next(c for c in report["checks"] if c["section"] == "plugins")
    assert plugins["status"] == "warning" and plugins["ok"], plugins


def test_doctor_exits_0_with_them_installed(site: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    code, _ = _doctor(site, capsys, monkeypatch)
    assert code == 0


def test_explicit_request_for_an_undeclared_layout_raises(site: Path) -> None:
    pytest.importorskip("torch")
    import selector
    from experts_fixtures import Layout, make_experts, random_routing

    _install(site, "fake-plain", "fake_safety_plain", PLAIN_PLUGIN)
    reset_registry()
    try:
        module = make_experts(4, 16, 8, Layout(transposed=True), seed=0)
        index, weights = random_routing(5, 4, 2)
        selector.set_experts_implementation(module, "plain_third_party")
        with pytest.raises(ValueError, match="plain_third_party.*does not support the transposed weight layout"):
            module(torch_randn(5, 16), index, weights)
    finally:
        reset_registry()


FLAGS = ("non_gated", "bias", "transposed", "interleaved", "custom_gate", "post_expert_norm", "expert_parallel")
EVERY = frozenset(FLAGS)
# What each built-in forward runs (read off plugins/*/forward.py; tests/test_reference_backends.py runs the
# CPU ones over every layout). sonicmoe claims non_gated and custom_gate so that its check refuses them with
# the ImportError the design asks for.
BUILT_IN_LAYOUTS = {
    "eager": EVERY,
    "batched_mm": EVERY,
    "grouped_mm": EVERY,
    "deepgemm": EVERY,
    "triton_fused": EVERY - {"custom_gate", "post_expert_norm"},
    "sonicmoe": EVERY - {"post_expert_norm"},
    "deepgemm_megamoe": frozenset({"expert_parallel"}),
}


@pytest.mark.parametrize("name", sorted(BUILT_IN_LAYOUTS))
def test_built_ins_declare_the_layouts_they_run(name: str) -> None:
    req = build_registry(environ={}).get(name).requirements
    assert req.gated
    assert {flag for flag in FLAGS if getattr(req, flag)} == BUILT_IN_LAYOUTS[name]


def test_quantised_experts_are_never_judged_transposed() -> None:
    registry = build_registry(environ={})
    fp8 = replace(PLAIN, weight_format="fp8_block", scale_format="float32", is_transposed=True)
    verdict = evaluate(registry.get("grouped_mm"), fp8, CPU)
    assert verdict.status is Status.UNSUPPORTED_CONFIG
    assert "fp8_block experts stored [E, out, in] only" in verdict.reason


def test_require_judges_the_required_backend_alone(site: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`--require eager` with unrelated broken plugins installed: eager runs here, so doctor exits 0."""
    _install_broken(site)
    monkeypatch.setenv("SELECTOR_GPUS", "")
    monkeypatch.delenv(ALLOW_VARIABLE, raising=False)
    assert cli.main(["doctor", "--json", "--require", "eager"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["broken"] == [] and len([w for w in report["warnings"] if w.startswith("plugin ")]) == 3
