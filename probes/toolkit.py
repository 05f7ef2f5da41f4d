"""The CUDA toolkit (nvcc), needed by kernels that compile at run time.

The search follows the order most build tools (torch.utils.cpp_extension,
CuPy) use: CUDA_HOME, CUDA_PATH, nvcc on PATH, then the conventional install
directory. Every rule tried is recorded so `selector doctor` can say why a
toolkit was or was not found.

An nvcc on PATH that fails or prints no version (a wrapper script, a stub)
does not end the search: the conventional directory is tried next and taken
when it holds an nvcc that reports its version (a warning says so); otherwise
the PATH answer stands, with its problem. CUDA_HOME and CUDA_PATH are the
user's explicit choice and stay final.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Mapping

from .facts import ToolkitFacts
from .overrides import overridden_source, parse_major_minor, read_override

# Module constants rather than literals so tests (and odd installs) can change them.
DEFAULT_CUDA_ROOT = "/usr/local/cuda"
NVCC_TIMEOUT_S = 10.0
NVCC_NAME = "nvcc.exe" if os.name == "nt" else "nvcc"

_RELEASE = re.compile(r"release\s+(\d+)\.(\d+)")


def probe_toolkit(environ: Mapping[str, str] | None = None) -> ToolkitFacts:
    """Find the CUDA toolkit and the version of its nvcc; never raises."""
    env = os.environ if environ is None else environ
    try:
        return _probe(env)
    except Exception as exc:  # a probe reports, it does not fail
        return ToolkitFacts(
            None, None, None, None, False, (), problem=f"toolkit probe failed: {exc!r}"
        )


@dataclasses.dataclass
class _Search:
    """Where the search stands; becomes a ToolkitFacts at the end."""

    searched: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    root: str | None = None
    found_by: str | None = None
    problem: str | None = None
    # `nvcc --version` results already had while searching, so no nvcc runs (or times out) twice.
    nvcc_results: dict[str, tuple[tuple[int, int] | None, str | None]] = dataclasses.field(default_factory=dict)

    def try_directory(self, label: str, path: str, found_by: str) -> bool:
        verdict = _directory_verdict(path)
        self.searched.append(f"{label}: {verdict}")
        if verdict == "found":
            self.root, self.found_by = os.path.normpath(path), found_by
        return verdict == "found"


def _probe(env: Mapping[str, str]) -> ToolkitFacts:
    forced_root = read_override(env, "SELECTOR_CUDA_TOOLKIT")
    search = _search_override(forced_root) if forced_root is not None else _search(env)
    facts = ToolkitFacts(
        root=search.root,
        found_by=search.found_by,
        nvcc_path=None,
        nvcc_version=None,
        runtime_only=False,
        searched=tuple(search.searched),
        warnings=tuple(search.warnings),
        overridden=forced_root is not None,
        problem=search.problem,
    )
    forced_nvcc = read_override(env, "SELECTOR_NVCC_VERSION")
    if forced_nvcc is not None:
        return _with_forced_nvcc(facts, forced_nvcc)
    if facts.root is None:
        return facts
    return _with_nvcc(facts, facts.root, env, search.nvcc_results)


def _search_override(path: str) -> _Search:
    variable = "SELECTOR_CUDA_TOOLKIT"
    search = _Search()
    if path == "":
        search.searched.append(f"{variable}: empty, so no toolkit")
        search.problem = f"no CUDA toolkit ({variable} is empty)"
    elif not search.try_directory(f"{variable}={path}", path, overridden_source(variable)):
        search.problem = search.searched[-1]
    return search


def _search(env: Mapping[str, str]) -> _Search:
    search = _Search(warnings=_disagreement(env))
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        value = (env.get(variable) or "").strip()
        if not value:
            search.searched.append(f"{variable}: not set")
        elif search.try_directory(f"{variable}={value}", value, variable):
            return search
    if _nvcc_on_path(env, search):
        if not _nvcc_on_path_gives_no_version(env, search):
            return search
        # An nvcc that fails or prints no version (a wrapper script, a stub) says nothing about where the
        # toolkit is: go on to the next rule, and keep this answer only if that finds no full toolkit.
        _full_toolkit_at(DEFAULT_CUDA_ROOT, env, search)  # changes root and found_by only when it finds one
        return search
    if not search.try_directory(DEFAULT_CUDA_ROOT, DEFAULT_CUDA_ROOT, DEFAULT_CUDA_ROOT):
        search.problem = "no CUDA toolkit found"
    return search


def _disagreement(env: Mapping[str, str]) -> list[str]:
    home = (env.get("CUDA_HOME") or "").strip()
    path = (env.get("CUDA_PATH") or "").strip()
    if not home or not path or os.path.normpath(home) == os.path.normpath(path):
        return []
    if os.path.realpath(home) == os.path.realpath(path):  # two spellings of one directory
        return []
    return [f"CUDA_HOME={home} and CUDA_PATH={path} disagree; CUDA_HOME is searched first"]


def _nvcc_on_path(env: Mapping[str, str], search: _Search) -> bool:
    path = env.get("PATH")
    if not path:
        search.searched.append("nvcc on PATH: PATH not set")
        return False
    found = shutil.which(NVCC_NAME, path=path)
    if found is None:
        search.searched.append("nvcc on PATH: not found")
        return False
    real = os.path.realpath(found)  # a symlink from /usr/bin points into the toolkit
    root = os.path.dirname(os.path.dirname(real))
    shown = found if real == found else f"{found} -> {real}"
    search.searched.append(f"nvcc on PATH: {shown}, root {root}")
    search.root, search.found_by = root, "nvcc on PATH"
    if not os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
        # A wrapper script (not a symlink) leaves the real toolkit unknown.
        search.warnings.append(
            f"nvcc on PATH at {found} has no include/cuda_runtime.h under {root}: "
            "probably a wrapper script; set CUDA_HOME to the real toolkit"
        )
    return True


def _nvcc_on_path_gives_no_version(env: Mapping[str, str], search: _Search) -> bool:
    nvcc = _nvcc_in(search.root) if search.root else None
    if nvcc is None:
        return False  # reported as runtime-only by _with_nvcc, as before
    version, problem = search.nvcc_results.setdefault(nvcc, nvcc_version(nvcc, env))
    if version is not None:
        return False
    search.searched.append(f"nvcc on PATH: {nvcc} gives no version ({problem}), so the search goes on")
    return True


def _full_toolkit_at(path: str, env: Mapping[str, str], search: _Search) -> bool:
    """Take `path` when it holds a bin/nvcc that reports its version; record the verdict either way."""
    path_nvcc = search.root
    verdict = _directory_verdict(path)
    nvcc = _nvcc_in(path) if verdict == "found" else None
    if verdict == "found" and nvcc is None:
        verdict = f"no bin/{NVCC_NAME}, not a full toolkit"
    elif nvcc is not None:
        version, problem = search.nvcc_results.setdefault(nvcc, nvcc_version(nvcc, env))
        if version is None:
            verdict = f"{nvcc} gives no version either ({problem})"
    search.searched.append(f"{path}: {verdict}")
    if verdict != "found":
        return False
    search.root, search.found_by = os.path.normpath(path), path
    search.warnings = [w for w in search.warnings if not w.startswith("nvcc on PATH at ")]
    search.warnings.append(
        f"nvcc on PATH under {path_nvcc} gives no version (probably a wrapper script): "
        f"used the full toolkit at {path} instead; set CUDA_HOME to choose another"
    )
    return True


def _directory_verdict(path: str) -> str:
    if os.path.isdir(path):
        return "found"
    if os.path.exists(path):
        return "not a directory"
    return "no such directory"


def _with_forced_nvcc(facts: ToolkitFacts, value: str) -> ToolkitFacts:
    variable = "SELECTOR_NVCC_VERSION"
    changes: dict[str, object] = {
        "overridden": True,
        "searched": facts.searched + (f"{variable}={value!r}: nvcc not run",),
    }
    if value == "":
        # "No nvcc": whatever directory was found is runtime libraries only.
        if facts.root is not None:
            changes.update(runtime_only=True, problem=_runtime_only_problem(facts.root))
        return _replace(facts, **changes)
    version = parse_major_minor(value)
    if version is None:
        bad = f"{variable}={value!r} not understood: expected MAJOR.MINOR such as 12.4"
        changes["problem"] = "; ".join(p for p in (facts.problem, bad) if p)
        return _replace(facts, **changes)
    nvcc = _nvcc_in(facts.root) if facts.root else None
    # The user vouches for an nvcc, so a missing root is not a problem.
    changes.update(nvcc_path=nvcc, nvcc_version=version, problem=None)
    return _replace(facts, **changes)


def _with_nvcc(
    facts: ToolkitFacts,
    root: str,
    env: Mapping[str, str],
    known: Mapping[str, tuple[tuple[int, int] | None, str | None]] | None = None,
) -> ToolkitFacts:
    nvcc = _nvcc_in(root)
    if nvcc is None:
        return _replace(facts, runtime_only=True, problem=_runtime_only_problem(root))
    version, problem = (known or {}).get(nvcc) or nvcc_version(nvcc, env)
    return _replace(facts, nvcc_path=nvcc, nvcc_version=version, problem=problem)


def _nvcc_in(root: str) -> str | None:
    nvcc = os.path.join(root, "bin", NVCC_NAME)
    return nvcc if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK) else None


def _runtime_only_problem(root: str) -> str:
    return (
        f"runtime-only CUDA install at {root} (no bin/{NVCC_NAME}): "
        "kernels that compile at run time cannot work"
    )


def nvcc_version(
    nvcc: str, environ: Mapping[str, str] | None = None
) -> tuple[tuple[int, int] | None, str | None]:
    """Run `nvcc --version`; return ((major, minor), None) or (None, problem)."""
    env = dict(os.environ if environ is None else environ)
    try:
        result = subprocess.run(
            [nvcc, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=NVCC_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return None, f"{nvcc} --version did not answer within {NVCC_TIMEOUT_S:g} s"
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        return None, f"could not run {nvcc}: {reason}"
    if result.returncode != 0:
        said = _first_line(result.stderr) or _first_line(result.stdout) or "no output"
        return None, f"{nvcc} --version exited with status {result.returncode}: {said}"
    match = _RELEASE.search(result.stdout)
    if match is None:
        said = _first_line(result.stdout) or _first_line(result.stderr) or "no output"
        return None, f"nvcc --version output not understood: {said}"
    return (int(match.group(1)), int(match.group(2))), None


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:200]
    return ""


def _replace(facts: ToolkitFacts, **changes: object) -> ToolkitFacts:
    return dataclasses.replace(facts, **changes)  # type: ignore[arg-type]
