"""Config files are untrusted input: size, aliases, nesting, bytes and backend names are checked at load."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from selector.config import MAX_BYTES, MAX_DEPTH, ConfigError, SelectorConfig, load_config, read_config_file
from selector.doctor import build_report
from selector.probes import collect_environment
from selector.registry import build_registry
from selector.render import format_seconds, render_text

NAMES = ("eager", "batched_mm", "grouped_mm", "triton_fused")
NO_GPU = {"SELECTOR_GPUS": "", "PATH": ""}

# 479 bytes that expand to 9**9 strings under a plain yaml.safe_load
ALIAS_BOMB = (
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + "".join(
        f"{n}: &{n} [{','.join(['*' + p] * 9)}]\n"
        for p, n in zip("abcdefgh", "bcdefghi")
    )
)


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "selector.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, ALIAS_BOMB)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"selector\.yaml:2:\d+: malformed YAML: YAML aliases .* not allowed"):
        read_config_file(path)
    assert time.perf_counter() - start < 1.0


def test_a_single_alias_is_refused_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r":2:\d+: .*aliases"):
        read_config_file(write(tmp_path, "prefer: &p [eager]\ndeny: *p\n"))


def test_oversized_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "# " + "x" * MAX_BYTES + "\n")
    with pytest.raises(ConfigError, match=r"selector\.yaml: larger than 64 KiB"):
        read_config_file(path)


def test_deep_nesting_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "prefer: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=rf"selector\.yaml:1:\d+: .*nesting deeper than {MAX_DEPTH}") as info:
        read_config_file(path)
    assert "\n" not in str(info.value)


def test_non_utf8_bytes_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"selector\.yaml:2: not UTF-8 \(byte 0xff\), save the file as UTF-8"):
        read_config_file(write(tmp_path, b"prefer: [eager]\npin: \xff\n"))


def test_syntax_error_is_one_line_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"selector\.yaml:\d+:\d+: malformed YAML: .*, fix the YAML syntax") as info:
        read_config_file(write(tmp_path, "prefer: [eager\ndeny: x\n"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "key", "name"),
    [("prefer: [nope]\n", "prefer", "nope"), ("deny: nope\n", "deny", "nope"), ("pin: nope\n", "pin", "nope")],
)
def test_unknown_backend_names_are_errors_at_load(tmp_path: Path, text: str, key: str, name: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"selector\.yaml: '{key}' names unknown backend '{name}'; "
                                          r"registered: batched_mm, eager, grouped_mm, triton_fused"):
        load_config(paths=[path], registered=NAMES)
    assert isinstance(ConfigError("x"), ValueError)


def test_unknown_name_names_the_file_that_set_the_key(tmp_path: Path) -> None:
    user, project = tmp_path / "user.yaml", tmp_path / "project.yaml"
    user.write_text("pin: nope\n")
    project.write_text("prefer: [eager]\n")
    with pytest.raises(ConfigError, match=r"user\.yaml: 'pin' names unknown backend 'nope'"):
        load_config(paths=[user, project], registered=NAMES)


def test_default_check_uses_the_process_registry(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="registered: .*eager"):
        load_config(paths=[write(tmp_path, "prefer: [eagr]\n")])
    assert load_config(paths=[write(tmp_path, "prefer: [eager]\n")]).prefer == ("eager",)


def _report(config: SelectorConfig, problem: object = None):  # type: ignore[no-untyped-def]
    env, registry = collect_environment(NO_GPU), build_registry(environ={})
    return build_report(env, registry, problem=problem, config=config)  # type: ignore[arg-type]


def test_doctor_reports_a_pin_that_cannot_run_here() -> None:
    report = _report(SelectorConfig(pin="triton_fused", files=("p.yaml",), sources={"pin": "p.yaml"}))
    assert report.exit_code == 1
    assert any(b.startswith("p.yaml: pinned backend 'triton_fused' cannot run here (unsupported_device")
               and "remove the pin" in b for b in report.broken)


def test_doctor_reports_a_pin_that_is_denied_or_unknown() -> None:
    both = _report(SelectorConfig(pin="eager", deny=frozenset({"eager"})))
    assert both.exit_code == 1 and any("both pinned and denied" in b for b in both.broken)
    unknown = _report(SelectorConfig(pin="nope"))
    assert unknown.exit_code == 1 and any("pinned backend 'nope' is not registered" in b for b in unknown.broken)


def test_doctor_with_every_runnable_backend_denied_says_broken_not_usable() -> None:
    from selector.presets import preset

    config = SelectorConfig(deny=frozenset({"eager", "batched_mm", "grouped_mm", "triton_fused"}), files=("c.yaml",))
    problem = preset("mixtral-8x7b")
    from dataclasses import replace

    report = _report(config, replace(problem, device="cpu", dtype="float32"))
    text = render_text(report)
    assert report.exit_code == 1 and report.usable == []
    assert "no backend can run this layer here" in text and "usable:" not in text
    assert any("the config denies every runnable one" in b and "c.yaml" in b for b in report.broken)


def test_doctor_usable_line_leaves_out_denied_backends() -> None:
    report = _report(SelectorConfig(deny=frozenset({"eager"})))
    assert "eager" not in report.usable and report.usable
    assert f"usable: {', '.join(report.usable)}" in render_text(report)


def test_large_estimates_are_times() -> None:
    assert format_seconds(12e-6) == "12 µs"
    assert format_seconds(0.0125) == "12.5 ms"
    assert format_seconds(3.0) == "3.0 s"


def test_no_estimate_only_when_the_backend_gives_none() -> None:
    from selector.presets import preset
    from selector.render import ranking_lines
    from selector.types import Candidate, Ranking

    r = Ranking(problem=preset("mixtral-8x7b"), candidates=(Candidate("slow", 2.5), Candidate("blank", 1.0)),
                excluded={}, verdicts={})
    lines = ranking_lines(r, ["blank"])
    assert "slow             estimated 2.5 s" in lines[1] and lines[2].endswith("blank            (no estimate)")


def test_a_key_given_twice_is_refused_naming_the_line(tmp_path: Path) -> None:
    """YAML would keep the last `pin` silently; the file means two things, so it is refused."""
    with pytest.raises(ConfigError, match=r"selector\.yaml:3:1: malformed YAML: the key 'pin' is given twice"):
        read_config_file(write(tmp_path, "pin: eager\nprefer: [grouped_mm]\npin: batched_mm\n"))
    assert load_config(paths=[write(tmp_path, "pin: eager\nprefer: [grouped_mm]\n")], registered=NAMES).pin == "eager"
