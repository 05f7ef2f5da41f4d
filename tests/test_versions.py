"""Version windows: the extras, the docs and CI agree with the table of Transformers releases and `kernels` ranges.

`selector.compat.KERNELS_PINS` is the table (each Transformers release's own requirement of `kernels`). The
`kernels` and `test` extras must admit every `kernels` a supported Transformers release needs, except what the
hub backends refuse (below `selector.hub.KERNELS_MIN_VERSION`), and nothing newer than the newest release needs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from selector.compat import KERNELS_PINS, kernels_for_transformers
from selector.hf.version import MIN_TRANSFORMERS
from selector.hub import KERNELS_MIN_VERSION
from selector.requirements import version_tuple

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    """[project.optional-dependencies] of pyproject.toml, without a TOML library (Python 3.10 has none)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    section = "\n".join(line.split("#", 1)[0] for line in section.splitlines())
    return {
        name: re.findall(r'"([^"]+)"', body)
        for name, body in re.findall(r"^(\w[\w-]*)\s*=\s*\[(.*?)\]", section, flags=re.S | re.M)
    }


def _range(requirements: list[str], package: str) -> tuple[str | None, str | None]:
    """(lower bound >=, upper bound <) of `package` in a list of requirement strings."""
    (spec,) = [r for r in requirements if re.match(rf"{package}\s*[<>=!~]", r)]
    low = re.search(r">=\s*([\w.]+)", spec)
    high = re.search(r"<\s*([\w.]+)", spec)
    return (low.group(1) if low else None, high.group(1) if high else None)


def _expected_kernels_range() -> tuple[str, str]:
    floor = min((low for _, _, low, _ in KERNELS_PINS), key=version_tuple)
    low = max(floor, KERNELS_MIN_VERSION, key=version_tuple)
    high = max((high for _, _, _, high in KERNELS_PINS), key=version_tuple)
    return low, high


@pytest.mark.parametrize("extra", ["kernels", "test"])
def test_the_kernels_extras_follow_the_supported_transformers_releases(extra: str) -> None:
    assert _range(_extras()[extra], "kernels") == _expected_kernels_range()


@pytest.mark.parametrize("extra", ["transformers", "test"])
def test_the_transformers_floor_is_the_integrations(extra: str) -> None:
    assert _range(_extras()[extra], "transformers") == (MIN_TRANSFORMERS, None)


def test_every_release_in_the_table_has_kernels_the_extras_admit_or_says_why_not() -> None:
    low, high = _expected_kernels_range()
    for first, last, pin_low, pin_high in KERNELS_PINS:
        assert first <= last and version_tuple(pin_low) < version_tuple(pin_high)
        overlaps = version_tuple(pin_low) < version_tuple(high) and version_tuple(low) < version_tuple(pin_high)
        # a release whose whole range is below the hub backends' floor shares no `kernels` with them
        assert overlaps or version_tuple(pin_high) <= version_tuple(KERNELS_MIN_VERSION), (first, last)


def test_the_newest_release_in_the_table_sets_the_cap() -> None:
    newest = max(KERNELS_PINS, key=lambda row: row[1])
    assert newest[3] == _expected_kernels_range()[1]
    assert kernels_for_transformers(f"{newest[1][0]}.{newest[1][1]}.0") == (newest[2], newest[3])


def test_docs_list_every_release_of_the_table() -> None:
    text = (ROOT / "docs" / "transformers.md").read_text()
    table = text.split("| Transformers | `kernels` |", 1)[1].split("\n\n", 1)[0]
    for first, last, low, high in KERNELS_PINS:
        assert f"`>={low},<{high}`" in table, (first, last)
        assert f"{first[0]}.{first[1]}" in table and f"{last[0]}.{last[1]}" in table, (first, last)


def test_ci_tests_both_ends_of_the_window() -> None:
    """.ci/run's second environment pins the oldest Transformers the integration supports, and a `kernels` that
    the test extra admits (the main environment takes the newest, as pip resolves `.[test]`)."""
    run = (ROOT / ".ci" / "run").read_text()
    oldest = re.search(r"OLDEST_TRANSFORMERS='([\d.]+)\.\*'", run)
    kernels = re.search(r"OLDEST_KERNELS='>=([\d.]+),<([\d.]+)'", run)
    assert oldest and kernels, "the oldest-Transformers environment is missing from .ci/run"
    assert oldest.group(1) == MIN_TRANSFORMERS
    low, high = _expected_kernels_range()
    assert version_tuple(low) <= version_tuple(kernels.group(1)) < version_tuple(high)


@pytest.mark.parametrize(
    "transformers_version, torch_version, swaps_on_mps",
    [("5.25.0", "2.15.0", False), ("5.25.0", "2.14.1", True), ("5.24.0", "2.15.0", True)],
)
def test_the_decode_swap_follows_the_installed_transformers_rule(
    monkeypatch: pytest.MonkeyPatch, transformers_version: str, torch_version: str, swaps_on_mps: bool
) -> None:
    """Transformers 5.25+ keeps grouped_mm for the decode steps on MPS with torch >= 2.15; earlier ones swap."""
    import torch
    import transformers

    from selector.hf import decode

    monkeypatch.setattr(transformers, "__version__", transformers_version)
    monkeypatch.setattr(torch, "__version__", torch_version)
    assert decode._default_accelerator_check(torch.device("mps")) is swaps_on_mps
    assert decode._default_accelerator_check(torch.device("cuda")) is True
    assert decode._default_accelerator_check(torch.device("cpu")) is False
