"""`selector doctor`'s one report in three renderings (text, markdown, JSON) that agree, the settings and layer
flags it checks, and the argument checks of `selector bench` / `tune` that run before anything is measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from selector import cli, tuning_store
from selector.doctor import DoctorReport, build_report
from selector.probes import collect_environment
from selector.registry import build_registry
from selector.render import render_json, render_markdown, render_text
from selector.tuning import TuningTable
from selector.tuning_store import current_fingerprints

# An injected H200 (the GPU check warns: its facts are overridden) and a toolkit search that finds nothing.
H200 = {"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""}
NO_GPU = {"SELECTOR_GPUS": "", "PATH": ""}
MARKS = {"✓": "ok", "!": "warning", "✗": "failed"}


def _report(environ: dict[str, str] = H200) -> DoctorReport:
    env = collect_environment(environ)
    registry = build_registry(environ={})
    table = TuningTable.from_records([], current_fingerprints(env, registry))  # no times: the tuning check warns
    return build_report(env, registry, tuning=table, tuning_store="a store")


def _text_view(text: str) -> tuple[dict[str, str], list[str]]:
    """The text checklist as {title: status} and its warnings list."""
    checks = {m[2]: MARKS[m[1]] for m in re.finditer(r"^\[(.)\] (.*)$", text, re.M)}
    block = re.search(r"^! \d+ warning\(s\):\n((?:  - .*\n?)*)", text, re.M)
    return checks, [line[4:] for line in block[1].splitlines()] if block else []


def _markdown_view(markdown: str) -> tuple[dict[str, str], list[str]]:
    """The markdown check table as {title: status} and its warnings section."""
    rows = re.findall(r"^\| (.*?) \| (✓|!|✗) \| .* \|$", markdown, re.M)
    section = re.search(r"^## Warnings\n\n((?:- .*\n?)*)", markdown, re.M)
    return {title: MARKS[mark] for title, mark in rows}, [line[2:] for line in section[1].splitlines()] if section else []


def _json_view(data: dict) -> tuple[dict[str, str], list[str]]:
    return {c["title"]: c["status"] for c in data["checks"]}, data["warnings"]


def test_text_markdown_and_json_show_the_same_checks_statuses_and_warnings() -> None:
    report = _report()
    text, markdown, data = _text_view(render_text(report)), _markdown_view(render_markdown(report)), \
        _json_view(json.loads(render_json(report)))  # fmt: skip
    assert text == markdown == data
    checks, warnings = data
    assert len(checks) == len(report.checks) and {"ok", "warning", "failed"} & set(checks.values()) >= {"warning"}
    assert len(warnings) == sum(status == "warning" for status in checks.values()) >= 2


def test_markdown_marks_a_warning_check_as_text_does() -> None:
    report = _report()
    tuning = next(c for c in report.checks if c.section == "tuning")
    assert f"[!] {tuning.title}" in render_text(report)
    assert f"| {tuning.title} | ! |" in render_markdown(report)


def test_json_warnings_name_every_check_that_warns() -> None:
    data = json.loads(render_json(_report()))
    warning_checks = [c for c in data["checks"] if c["warning"]]
    assert {c["section"] for c in warning_checks} >= {"gpu", "tuning"}
    for check in warning_checks:
        assert check["status"] == "warning" and any(w.startswith(f"{check['section']}: ") for w in data["warnings"])


def test_the_store_line_names_only_folders_that_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "tuning_data"
    monkeypatch.setattr(tuning_store, "DATA_DIR", missing)
    assert str(missing) not in tuning_store.describe_sources()
    missing.mkdir()
    assert f"shipped files in {missing}" in tuning_store.describe_sources()


def test_a_malformed_setting_is_a_failed_check_and_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELECTOR_VALIDATE", "bogus")
    monkeypatch.setenv("SELECTOR_DAEMON_TIMEOUT", "-1")  # read as its default, but still not what was meant
    report = _report()
    settings = next(c for c in report.checks if c.section == "settings")
    assert not settings.ok and report.exit_code == 1
    detail = " ".join(settings.detail)
    assert "SELECTOR_VALIDATE='bogus': expected one of full, first, shapes, off" in detail
    assert "SELECTOR_DAEMON_TIMEOUT='-1'" in detail
    assert any("SELECTOR_VALIDATE" in b for b in report.broken)
    monkeypatch.setenv("SELECTOR_VALIDATE", "first")
    monkeypatch.delenv("SELECTOR_DAEMON_TIMEOUT")
    report = _report()
    assert next(c for c in report.checks if c.section == "settings").ok and report.exit_code == 0


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_doctor_takes_the_projects_own_gpt_oss_preset(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in NO_GPU.items():
        monkeypatch.setenv(name, value)
    code, out, err = _main(capsys, "doctor", "--json", "--preset", "gpt-oss-20b")
    assert code == 0, err
    problem = json.loads(out)["ranking"]["problem"]
    assert (problem["num_experts"], problem["has_bias"], problem["is_transposed"]) == (32, True, True)
    code, _, err = _main(capsys, "doctor", "--preset", "mixtral-8x7b", "--activation", "clamped_swiglu")
    assert code == 2 and "--activation 'clamped_swiglu' is not one of" in err  # a gate, not an activation flag


def test_layout_flags_without_a_layer_are_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SELECTOR_GPUS", "")
    code, out, err = _main(capsys, "doctor", "--transposed", "--bias")
    assert code == 2 and out == ""
    assert "--bias, --transposed describe a layer" in err and "missing: --experts, --hidden, --intermediate, --top-k" in err
    code, _, err = _main(capsys, "doctor", "--experts", "8", "--top-k", "2", "--tokens", "4")
    assert code == 2 and "missing: --hidden, --intermediate" in err


def test_bench_reports_an_unknown_preset_or_backend_before_the_missing_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _main(capsys, "bench", "--preset", "nope")
    assert code == 2 and "unknown preset 'nope'" in err and "CUDA" not in err
    code, _, err = _main(capsys, "bench", "--backends", "eager,nope")
    assert code == 2 and "--backends nope: no such backend" in err and "CUDA" not in err
    code, _, err = _main(capsys, "bench", "--compile", "default", "--merge")
    assert code == 2 and "--merge and --resume go with the grid" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--rounds", "-3"], "argument --rounds: -3: expected a whole number >= 1"),
        (["bench", "--rounds", "0"], "argument --rounds: 0: expected a whole number >= 1"),
        (["bench", "--tokens", "1,0,8"], "argument --tokens: '1,0,8': expected a comma list of whole numbers >= 1"),
        (["bench", "--graph-max-tokens", "-1"], "argument --graph-max-tokens: -1: expected a whole number >= 0"),
        (["bench", "--memory-cap-gb", "0"], "argument --memory-cap-gb: 0: expected a number > 0"),
        (["tune", "--preset", "grid", "--rounds", "-3"], "argument --rounds: -3: expected a whole number >= 1"),
        (["tune", "--preset", "grid", "--tokens", "x"], "argument --tokens: 'x': expected a comma list"),
        (["tune", "--preset", "grid", "--batch-sizes", "-2"], "argument --batch-sizes: '-2': expected a comma list"),
        (["tune", "--preset", "grid", "--kernel-budget-s", "-1"], "argument --kernel-budget-s: -1: expected a number >= 0"),
        (["tune", "--preset", "grid", "--lock-timeout", "nan"], "argument --lock-timeout: nan: expected a number >= 0"),
        (["tune", "--preset", "grid", "--experts", "0"], "argument --experts: 0: expected a whole number >= 1"),
        (["doctor", "--ep-size", "0"], "--ep-size must be at least 1, got 0"),
        (["doctor", "--preset", "mixtral-8x7b", "--tokens", "-1"], "--tokens must be at least 1, got -1"),
    ],
)
def test_count_flags_reject_values_below_their_minimum(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _main(capsys, *argv)
    assert code == 2 and out == "" and message in err


# A plain wheel install has no NumPy: torch's import says so once; nothing selector runs may touch NumPy again.
NO_NUMPY_FORWARD = """
import sys, warnings

sys.modules["numpy"] = None  # as if not installed: importing it raises, importlib.util.find_spec finds nothing
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch's own import, not ours
    import torch
warnings.simplefilter("error")

import selector
from selector.doctor import build_report
from selector.environment import current_environment
from selector.registry import get_registry
from selector.render import render_json


@selector.experts
class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = 8
        self.gate_up_proj = torch.nn.Parameter(torch.randn(8, 64, 32))
        self.down_proj = torch.nn.Parameter(torch.randn(8, 32, 32))
        self.act_fn = torch.nn.SiLU()


experts = Experts()
weights, index = torch.softmax(torch.randn(5, 8), dim=-1).topk(2)
with torch.no_grad():
    experts(torch.randn(5, 32), index, weights)
assert selector.last_backend(experts)
selector.explain_model(experts)
render_json(build_report(current_environment(), get_registry()))
print("clean")
"""


@pytest.mark.slow  # a fresh interpreter imports torch (about 5 s on a CPU)
def test_the_forward_and_the_probes_never_touch_numpy() -> None:
    environ = {**os.environ, "SELECTOR_GPUS": "", "SELECTOR_VALIDATE": "full"}
    result = subprocess.run([sys.executable, "-c", NO_NUMPY_FORWARD], capture_output=True, text=True, env=environ,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "clean", result.stderr
