"""Installed Python distributions, read from their metadata.

Nothing is imported: importing torch alone takes seconds and may initialise
CUDA, so torch's CUDA build is read from the text of torch/version.py.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path
from typing import Mapping, Sequence

from .facts import PackageFacts, normalize_package_name
from .overrides import is_package_version, overridden_source, package_variable, read_override

DEFAULT_PACKAGES: tuple[str, ...] = (
    "torch",
    "triton",
    "kernels",
    "nvidia-cutlass-dsl",
    "transformers",
    "nvidia-ml-py",
    "pluggy",
    "pyyaml",
)
METADATA_SOURCE = "importlib.metadata"

# `cuda = '13.0'`, `cuda: Optional[str] = None`, `cuda = "12.8"  # comment`
_TORCH_CUDA_LINE = re.compile(
    r"""^cuda\s*(?::[^=\n]*)?=\s*(?P<value>None|'[^'\n]*'|"[^"\n]*")\s*(?:\#.*)?$""",
    re.MULTILINE,
)
_CUDA_VERSION = re.compile(r"\d+\.\d+(\.\d+)?")


def probe_packages(
    names: Sequence[str] = DEFAULT_PACKAGES, environ: Mapping[str, str] | None = None
) -> tuple[PackageFacts, ...]:
    """One fact per name, in the order given; never raises."""
    env = os.environ if environ is None else environ
    return tuple(_probe_safely(name, env) for name in names)


def _probe_safely(name: str, env: Mapping[str, str]) -> PackageFacts:
    try:
        return _probe_one(name, env)
    except Exception as exc:  # a probe reports, it does not fail
        return PackageFacts(name, None, METADATA_SOURCE, problem=f"package probe failed: {exc!r}")


def _probe_one(name: str, env: Mapping[str, str]) -> PackageFacts:
    variable = package_variable(name)
    forced = read_override(env, variable)
    dist: importlib.metadata.Distribution | None = None
    problem = None
    if forced is not None:
        source, overridden = overridden_source(variable), True
        version = forced if is_package_version(forced) else None
        if forced and version is None:
            problem = f"{variable}={forced!r} is not a version"
    else:
        source, overridden = METADATA_SOURCE, False
        try:
            dist = importlib.metadata.distribution(name)
            version = dist.version
        except importlib.metadata.PackageNotFoundError:
            version = None

    facts = PackageFacts(name, version, source, overridden, {}, problem)
    # A torch that is not installed (or overridden away) has no CUDA build to report.
    if normalize_package_name(name) == "torch" and version is not None:
        facts = _with_torch_cuda(facts, dist, env)
    return facts


def _with_torch_cuda(
    facts: PackageFacts, dist: importlib.metadata.Distribution | None, env: Mapping[str, str]
) -> PackageFacts:
    variable = "SELECTOR_TORCH_CUDA"
    forced = read_override(env, variable)
    if forced is not None:
        source = f"{facts.source}; cuda {overridden_source(variable)}"
        if forced == "" or _CUDA_VERSION.fullmatch(forced):
            return _replace(facts, source=source, overridden=True, detail={"cuda": forced})
        bad = f"{variable}={forced!r} is not a CUDA version like 13.0 (or empty for a CPU build)"
        return _replace(facts, source=source, overridden=True, problem=_join(facts.problem, bad))
    if dist is None:
        # An overridden torch version describes a torch that is not the one on
        # disk, so the disk's build must not leak into it.
        return facts
    path = torch_version_file(dist)
    if path is None:
        return _replace(facts, problem=_join(facts.problem, "torch/version.py not found"))
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return _replace(facts, problem=_join(facts.problem, f"cannot read {path}: {exc.strerror}"))
    cuda = parse_torch_cuda(text)
    if cuda is None:
        return _replace(facts, problem=_join(facts.problem, f"no `cuda = ...` line in {path}"))
    return _replace(facts, detail={"cuda": cuda})


def torch_version_file(dist: importlib.metadata.Distribution) -> Path | None:
    """torch/version.py of this distribution, found without importing torch."""
    located = Path(str(dist.locate_file("torch/version.py")))
    if located.is_file():
        return located
    # Editable and unusual installs: ask the import system where torch lives;
    # find_spec on a top-level name locates it without executing it.
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "version.py"
        if candidate.is_file():
            return candidate
    return None


def parse_torch_cuda(text: str) -> str | None:
    """The `cuda` value of a torch/version.py: "13.0", "" for a CPU build, None if absent."""
    match = _TORCH_CUDA_LINE.search(text)
    if match is None:
        return None
    value = match.group("value")
    return "" if value == "None" else value[1:-1]


def _join(*problems: str | None) -> str | None:
    return "; ".join(p for p in problems if p) or None


def _replace(facts: PackageFacts, **changes: object) -> PackageFacts:
    return dataclasses.replace(facts, **changes)  # type: ignore[arg-type]
