"""`selector doctor` and `selector plugins` as a user runs them: a subprocess, exit codes, parsed JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

H200 = {
    "SELECTOR_GPUS": "NVIDIA H200:9.0:141",
    "SELECTOR_DRIVER_VERSION": "580.159.04",
    "SELECTOR_DRIVER_CUDA_VERSION": "13.0",
    "SELECTOR_PACKAGE_TRITON": "3.6.0",
}
NO_GPU = {"SELECTOR_GPUS": ""}


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-m", "selector.cli", *args], capture_output=True, text=True, env=environ, timeout=120
    )


def doctor_json(*args: str, **env: str) -> tuple[int, dict]:
    result = run("doctor", "--json", *args, **env)
    return result.returncode, json.loads(result.stdout)


def test_doctor_json_on_a_cpu_only_machine() -> None:
    code, report = doctor_json(**NO_GPU)
    assert code == 0 and report["schema"] == "selector.doctor/1" and report["exit_code"] == 0
    gpu = next(c for c in report["checks"] if c["section"] == "gpu")
    assert gpu["ok"] is False
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["eager"]["status"] == "ok"
    assert backends["triton_fused"]["status"] == "unsupported_device"
    assert backends["triton_fused"]["remedy"]
    assert report["environment"]["gpu"]["devices"] == []


def test_doctor_with_injected_h200_ranks_a_preset() -> None:
    code, report = doctor_json("--preset", "qwen3-30b-a3b", "--tokens", "1", **H200)
    assert code == 0
    gpu = next(c for c in report["checks"] if c["section"] == "gpu")
    assert gpu["ok"] and "NVIDIA H200" in gpu["title"] and "580.159.04" in gpu["title"]
    ranking = report["ranking"]
    assert ranking["problem"]["num_experts"] == 128 and ranking["problem"]["num_tokens"] == 1
    assert ranking["candidates"][0]["name"] == "triton_fused"
    assert {b["name"]: b["status"] for b in report["backends"]}["triton_fused"] == "ok"


def test_doctor_text_is_a_checklist() -> None:
    result = run("doctor", "--preset", "mixtral-8x7b", **NO_GPU)
    assert result.returncode == 0
    assert "[✗] GPU:" in result.stdout and "✓ eager" in result.stdout
    assert "✗ triton_fused" in result.stdout and "fix:" in result.stdout
    assert "Ranking for E=8 H=4096 I=14336 k=2" in result.stdout


def test_doctor_markdown() -> None:
    result = run("doctor", "--markdown", **NO_GPU)
    assert result.returncode == 0 and result.stdout.startswith("# selector") and "| backend | status |" in result.stdout


@pytest.mark.slow
def test_required_backend_that_cannot_run_exits_1() -> None:
    code, report = doctor_json("--require", "triton_fused", **NO_GPU)
    assert code == 1 and any("triton_fused" in b for b in report["broken"])
    code, _ = doctor_json("--require", "eager", **NO_GPU)
    assert code == 0


@pytest.mark.parametrize("args", [["doctor", "--preset", "nope"], ["doctor", "--experts", "8"], ["frobnicate"]])
def test_usage_errors_exit_2(args: list[str]) -> None:
    assert run(*args, **NO_GPU).returncode == 2


def test_broken_config_file_exits_1_and_names_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("deny: [eager\n")
    code, report = doctor_json(SELECTOR_CONFIG=str(bad), **NO_GPU)
    assert code == 1 and any("bad.yaml:" in b and "malformed YAML" in b for b in report["broken"])


def test_plugins_json_lists_built_ins_with_their_distribution() -> None:
    result = run("plugins", "--json")
    assert result.returncode == 0
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert plugins["eager"]["distribution"].startswith("moe-selector ")
    assert plugins["grouped_mm"]["backends"] == ["grouped_mm"]


def test_doctor_does_not_import_torch() -> None:
    code = "import sys; from selector.cli import main; main(['doctor', '--json']); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **NO_GPU})
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_doctor_lines_are_the_rankings_verdicts() -> None:
    """One judgement: the backend lines are Ranking.verdicts; a denied backend keeps its machine verdict."""
    from selector.config import SelectorConfig
    from selector.doctor import build_report
    from selector.probes import collect_environment
    from selector.ranking import rank
    from selector.registry import build_registry
    from selector.types import Status

    env, registry = collect_environment({**NO_GPU, "PATH": ""}), build_registry(environ={})
    config = SelectorConfig(deny=frozenset({"eager"}))
    report = build_report(env, registry, config=config, required=["eager"])
    assert report.ranking is None and report.exit_code == 0  # no problem given: no ranking section
    lines = {b.name: b.verdict for b in report.backends}
    assert lines["eager"].ok and not lines["triton_fused"].ok
    ranking = rank(report.backend_problem, env, registry, config)
    assert ranking.verdicts == lines and ranking.excluded["eager"].status is Status.DENIED_BY_CONFIG


def SIZES(e: str, h: str, i: str, k: str) -> list[str]:  # noqa: N802 - reads as a table row
    return ["--experts", e, "--hidden", h, "--intermediate", i, "--top-k", k]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (SIZES("4", "8", "8", "9"), "--top-k 9 is more than the 4 experts"),
        (SIZES("0", "8", "8", "1"), "--experts must be at least 1, got 0"),
        (SIZES("4", "-12", "8", "1"), "--hidden must be at least 1, got -12"),
        (["--preset", "mixtral-8x7b", "--tokens", "0"], "--tokens must be at least 1, got 0"),
        (["--preset", "nope"], "unknown preset 'nope'; known:"),
        (["--experts", "4"], "give --preset, or all of"),
        (["--preset", "mixtral-8x7b", "--activation", "swish"], "--activation 'swish' is not one of silu, gelu"),
        (["--require", "nope"], "--require nope: no such backend; registered: "),
    ],
)
def test_doctor_flags_are_validated(flags: list[str], message: str) -> None:
    result = run("doctor", *flags, **NO_GPU)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("selector doctor: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_doctor_exits_1_for_a_pin_that_cannot_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "c.yaml"
    config.write_text("pin: triton_fused\n")
    result = run("doctor", SELECTOR_CONFIG=str(config), **NO_GPU)
    assert result.returncode == 1 and "pinned backend 'triton_fused' cannot run here" in result.stdout
    config.write_text("prefer: [nope]\n")
    result = run("doctor", SELECTOR_CONFIG=str(config), **NO_GPU)
    assert result.returncode == 1 and "'prefer' names unknown backend 'nope'" in result.stdout


def test_bench_without_a_gpu_is_one_line() -> None:
    result = run("bench", "--out", "/nonexistent/never-written", **NO_GPU)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("selector bench: needs a CUDA GPU and none is visible")
    assert "run it on a GPU node" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(  # type: ignore[no-untyped-def]
    monkeypatch, capsys
) -> None:
    import selector.cli as cli

    def boom(args):  # type: ignore[no-untyped-def]
        raise OSError("disk on fire")

    parser = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with(parser(), boom))
    assert cli.main(["plugins"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "selector plugins: OSError: disk on fire (rerun with --debug for the traceback)"
    with pytest.raises(OSError, match="disk on fire"):
        cli.main(["--debug", "plugins"])


def _with(parser, func):  # type: ignore[no-untyped-def]
    for action in parser._subparsers._group_actions:
        action.choices["plugins"].set_defaults(func=func)
    return parser


def test_hub_download_offline_is_one_line(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import selector.hub as hub

    def offline(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ConnectionError("Name or service not known\nsecond line.")

    monkeypatch.setattr(hub, "download", offline)
    assert hub.main(["download"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("selector.hub download: ConnectionError: Name or service not known second line. ")
    assert "run it on a machine with internet" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ConnectionError):
        hub.main(["--debug", "download"])


@pytest.mark.parametrize("module", ["selector.plugins.triton_fused.tune", "selector.plugins.quant_kernels.tune"])
def test_tune_mains_without_a_gpu_are_one_line(  # type: ignore[no-untyped-def]
    module: str, monkeypatch, capsys
) -> None:
    pytest.importorskip("triton")
    import importlib

    import torch

    tune = importlib.import_module(module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main([]) == 1
    err = capsys.readouterr().err
    assert "tune: needs a CUDA GPU and none is visible" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        tune.main(["--tokens", "x"])
    assert info.value.code == 2 and "comma list" in capsys.readouterr().err


def test_tune_main_failure_is_one_line_and_debug_raises(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    import torch

    from selector.plugins.triton_fused import tune

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of\nresources")

    monkeypatch.setattr(tune, "tune_table", fails)
    assert tune.main(["--out", "/nonexistent/t.json"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "triton_fused tune: RuntimeError: out of resources (rerun with --debug for the traceback)"
    with pytest.raises(RuntimeError):
        tune.main(["--out", "/nonexistent/t.json", "--debug"])
