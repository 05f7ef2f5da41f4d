"""The settings module: every SELECTOR_* variable declared once, typed, documented, read when used."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from selector import hub, settings
from selector.cli import main
from selector.probes import OVERRIDE_VARIABLES
from selector.settings import KINDS, PACKAGE_PATTERN, SETTINGS, Setting

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("selector", "plugins", "probes")
_NAME = re.compile(r"SELECTOR_[A-Z0-9_]*[A-Z0-9]")


def _sources() -> dict[Path, str]:
    return {
        path: path.read_text()
        for folder in SOURCE_FOLDERS
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
    }


def _names_in_sources() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path, text in _sources().items():
        for name in _NAME.findall(text):
            found.setdefault(name, []).append(str(path.relative_to(REPO_ROOT)))
    return found


def test_every_variable_the_code_names_is_declared() -> None:
    undeclared = {
        name: where
        for name, where in _names_in_sources().items()
        if not name.startswith("SELECTOR_PACKAGE") and name not in SETTINGS
    }
    assert not undeclared, f"declare these in selector/settings.py: {undeclared}"


def test_every_declared_variable_is_used_somewhere() -> None:
    """No dead declarations: a switch that the code stopped reading leaves the table too."""
    used: set[str] = set()
    for path, text in _sources().items():
        if path.name == "settings.py" and path.parent.name == "selector":
            continue
        if path.name == "overrides.py" and path.parent.name == "probes":  # the probes' own declarations
            text = text.split("OVERRIDE_VARIABLES", 1)[0]
        used.update(_NAME.findall(text))
    unused = sorted(s.name for s in SETTINGS.values() if s.name != PACKAGE_PATTERN and s.name not in used)
    assert not unused, f"declared but read nowhere: {unused}"


def test_the_probe_overrides_are_part_of_the_table() -> None:
    assert set(OVERRIDE_VARIABLES) <= set(SETTINGS)
    assert all(SETTINGS[name].probe and SETTINGS[name].doc == OVERRIDE_VARIABLES[name] for name in OVERRIDE_VARIABLES)


@pytest.mark.parametrize("declared", list(SETTINGS.values()), ids=list(SETTINGS))
def test_every_setting_is_typed_and_documented(declared: Setting) -> None:
    assert declared.name.startswith("SELECTOR_")
    assert declared.kind in KINDS
    assert declared.doc.strip() and "\n" not in declared.doc
    assert declared.on_bad in ("error", "default")
    assert declared.kind != "choice" or declared.choices
    if declared.default is not None and declared.kind != "names":
        expected = {"bool": bool, "int": int, "float": float, "str": str, "path": Path, "choice": str}
        assert isinstance(declared.default, expected[declared.kind])
    if declared.kind == "choice" and declared.default is not None:
        assert declared.default in declared.choices


def test_values_are_parsed_by_kind() -> None:
    get = settings.get
    assert get("SELECTOR_SONICMOE_PAD_TOKENS", {}) is True
    for text, value in (("0", False), ("off", False), ("No", False), ("1", True), ("TRUE", True), (" yes ", True)):
        assert get("SELECTOR_SONICMOE_PAD_TOKENS", {"SELECTOR_SONICMOE_PAD_TOKENS": text}) is value
    assert settings.Setting("SELECTOR_EXAMPLE", "int", 0, "an int", minimum=0).parse(" 32 ") == 32
    assert get("SELECTOR_JIT_AMORTIZE_CALLS", {"SELECTOR_JIT_AMORTIZE_CALLS": "250"}) == 250.0
    assert get("SELECTOR_VALIDATE", {"SELECTOR_VALIDATE": "shapes"}) == "shapes"
    assert get("SELECTOR_PLUGINS_BLOCK", {"SELECTOR_PLUGINS_BLOCK": " a, b ,,"}) == frozenset({"a", "b"})
    assert get("SELECTOR_CONFIG", {"SELECTOR_CONFIG": "x/y.yaml"}) == Path("x/y.yaml")


def test_an_empty_value_is_unset_except_for_probe_overrides() -> None:
    assert settings.get("SELECTOR_VALIDATE", {"SELECTOR_VALIDATE": ""}) is None
    assert settings.get("SELECTOR_CONFIG", {"SELECTOR_CONFIG": ""}) is None
    assert settings.get("SELECTOR_SONICMOE_PAD_TOKENS", {"SELECTOR_SONICMOE_PAD_TOKENS": ""}) is True
    assert settings.get("SELECTOR_GPUS", {"SELECTOR_GPUS": ""}) == ""  # "no GPU", not "probe"
    assert settings.get("SELECTOR_GPUS", {}) is None
    assert settings.get("SELECTOR_NVCC_VERSION", {"SELECTOR_NVCC_VERSION": " 12.4 "}) == "12.4"


@pytest.mark.parametrize(
    ("name", "value", "expects"),
    [
        ("SELECTOR_VALIDATE", "sometimes", "one of full, first, shapes, off"),
        ("SELECTOR_SONICMOE_PAD_TOKENS", "maybe", "1/true/yes/on or 0/false/no/off"),
        ("SELECTOR_TRITON_FUSED_GRAPHS", "2", "1/true/yes/on or 0/false/no/off"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable(name: str, value: str, expects: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}: expected {expects}")):
        settings.get(name, {name: value})


@pytest.mark.parametrize("value", ["many", "-1"])
def test_a_bad_integer_is_an_error_naming_the_variable(value: str) -> None:
    declared = settings.Setting("SELECTOR_EXAMPLE", "int", 0, "an int", minimum=0)
    with pytest.raises(ValueError, match=re.escape(f"SELECTOR_EXAMPLE={value!r}: expected an integer >= 0")):
        declared.parse(value)


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_amortize_calls_falls_back_to_its_documented_default(value: str) -> None:
    declared = SETTINGS["SELECTOR_JIT_AMORTIZE_CALLS"]
    assert declared.on_bad == "default" and "default" in declared.doc
    assert hub.amortize_calls({"SELECTOR_JIT_AMORTIZE_CALLS": value}) == hub.DEFAULT_AMORTIZE_CALLS == 1000.0


def test_the_package_pattern_covers_every_distribution() -> None:
    assert settings.setting("SELECTOR_PACKAGE_APACHE_TVM_FFI") is SETTINGS[PACKAGE_PATTERN]
    assert settings.get("SELECTOR_PACKAGE_TRITON", {"SELECTOR_PACKAGE_TRITON": "3.6.0"}) == "3.6.0"
    with pytest.raises(KeyError, match="SELECTOR_NOT_A_SETTING"):
        settings.get("SELECTOR_NOT_A_SETTING", {})


def test_values_are_read_when_used_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    from selector.plugins import sonicmoe
    from selector.registry import build_registry
    from selector.validation import validation_level

    monkeypatch.setenv("SELECTOR_VALIDATE", "off")
    assert validation_level() == "off"
    monkeypatch.setenv("SELECTOR_VALIDATE", "bogus")
    with pytest.raises(ValueError, match="SELECTOR_VALIDATE='bogus'"):
        validation_level()
    monkeypatch.delenv("SELECTOR_VALIDATE")
    assert validation_level(on_gpu=True) == "first" and validation_level() == "full"

    monkeypatch.setenv("SELECTOR_SONICMOE_PAD_TOKENS", "0")
    assert sonicmoe.padded_tokens(9) == 9
    monkeypatch.setenv("SELECTOR_SONICMOE_PAD_TOKENS", "1")
    assert sonicmoe.padded_tokens(9) == 10

    monkeypatch.setenv("SELECTOR_JIT_AMORTIZE_CALLS", "10")
    assert hub.amortize_calls() == 10.0

    monkeypatch.setenv("SELECTOR_PLUGINS_ALLOW", "eager")
    assert build_registry().names == ["eager"]


def test_doctor_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    missing = [name for name in SETTINGS if name not in out]
    assert not missing, f"`selector doctor --help` lacks {missing}"


def test_readme_lists_every_setting() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    configuration = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    stale = [row for row in settings.markdown_rows() if row not in configuration]
    assert not stale, (
        "README's Configuration section lacks (or has an old version of) these rows; paste the output of "
        "`python -m selector.settings`:\n" + "\n".join(stale)
    )


def test_settings_import_no_torch() -> None:
    code = "import sys, selector.settings; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.stdout.strip() == "False", result.stderr


def test_the_cheap_environment_read_sees_every_change_os_environ_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """settings reads POSIX os.environ's own dict on the hot path: setenv, a changed value, delenv and a mapping
    that replaces os.environ are all seen at the next read, as os.environ.get sees them."""
    import os

    name = "SELECTOR_TRITON_FUSED_GRAPHS"
    monkeypatch.delenv(name, raising=False)
    assert settings.environ_text(name) is None and settings.get(name) is True
    monkeypatch.setenv(name, "0")
    assert settings.environ_text(name) == "0" and settings.get(name) is False
    monkeypatch.setenv(name, "yes")
    assert settings.get(name) is True
    os.environ[name] = "off"
    assert settings.get(name) is False
    del os.environ[name]
    assert settings.get(name) is True
    monkeypatch.setenv(name, "bogus")
    with pytest.raises(ValueError, match="SELECTOR_TRITON_FUSED_GRAPHS='bogus'"):  # a bad value is never memoised
        settings.get(name)
    monkeypatch.setenv("SELECTOR_VALIDATE", "caf\u00e9")  # non-ASCII text round-trips as os.environ decodes it
    assert settings.environ_text("SELECTOR_VALIDATE") == os.environ.get("SELECTOR_VALIDATE") == "caf\u00e9"
    monkeypatch.setattr(os, "environ", {name: "0"})  # a caller's own mapping in place of os.environ
    assert settings.environ_text(name) == "0" and settings.get(name) is False
