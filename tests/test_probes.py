"""Tests of the machine probes. No GPU is needed: NVML is replaced by a fake
module and the CUDA toolkit by shell scripts in temporary directories."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from selector import probes
from selector.probes import (
    OVERRIDE_VARIABLES,
    Environment,
    GpuDevice,
    GpuFacts,
    PackageFacts,
    ToolkitFacts,
    collect_environment,
    probe_gpus,
    probe_packages,
    probe_toolkit,
)
from selector.probes import toolkit as toolkit_module
from selector.probes.packages import parse_torch_cuda

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30

needs_sh = pytest.mark.skipif(os.name == "nt", reason="fake nvcc is a POSIX shell script")

NVCC_12_4 = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2024 NVIDIA Corporation
Built on Thu_Mar_28_02:18:24_PDT_2024
Cuda compilation tools, release 12.4, V12.4.131
Build cuda_12.4.r12.4/compiler.34097967_0
"""


def nvcc_text(major: int, minor: int) -> str:
    return NVCC_12_4.replace("12.4", f"{major}.{minor}")


def make_toolkit(root: Path, nvcc: str | None = NVCC_12_4, exit_code: int = 0) -> Path:
    """A toolkit directory; `nvcc` is what bin/nvcc prints (None: no bin/nvcc)."""
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    (root / "lib64").mkdir()
    if nvcc is not None:
        (root / "bin").mkdir()
        script = root / "bin" / "nvcc"
        # Only shell builtins: the probe runs nvcc with the test's own (tiny) PATH.
        lines = " ".join(f"'{line}'" for line in nvcc.splitlines())
        script.write_text(f"#!/bin/sh\nprintf '%s\\n' {lines}\nexit {exit_code}\n")
        script.chmod(0o755)
    return root


@pytest.fixture(autouse=True)
def no_default_toolkit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep this machine's /usr/local/cuda out of every test; tests may create it."""
    default = tmp_path / "usr-local-cuda"
    monkeypatch.setattr(toolkit_module, "DEFAULT_CUDA_ROOT", str(default))
    return default


# --- toolkit search order -----------------------------------------------------


@needs_sh
def test_cuda_home_wins_over_cuda_path(tmp_path: Path) -> None:
    home = make_toolkit(tmp_path / "home", nvcc_text(12, 4))
    path = make_toolkit(tmp_path / "path", nvcc_text(12, 8))
    facts = probe_toolkit({"CUDA_HOME": str(home), "CUDA_PATH": str(path)})
    assert facts.root == str(home)
    assert facts.found_by == "CUDA_HOME"
    assert facts.nvcc_path == str(home / "bin" / "nvcc")
    assert facts.nvcc_version == (12, 4)
    assert facts.usable_for_jit and not facts.runtime_only
    assert facts.problem is None and not facts.overridden
    assert facts.searched == (f"CUDA_HOME={home}: found",)


@needs_sh
def test_cuda_home_and_cuda_path_disagree_warns(tmp_path: Path) -> None:
    home = make_toolkit(tmp_path / "home")
    path = make_toolkit(tmp_path / "path")
    facts = probe_toolkit({"CUDA_HOME": str(home), "CUDA_PATH": str(path)})
    assert len(facts.warnings) == 1
    assert "disagree" in facts.warnings[0]
    assert str(home) in facts.warnings[0] and str(path) in facts.warnings[0]


@needs_sh
def test_same_directory_spelled_differently_does_not_warn(tmp_path: Path) -> None:
    home = make_toolkit(tmp_path / "home")
    facts = probe_toolkit({"CUDA_HOME": f"{home}/", "CUDA_PATH": f"{home}/bin/.."})
    assert facts.warnings == ()
    assert facts.root == str(home)


@needs_sh
def test_cuda_path_used_when_cuda_home_unset(tmp_path: Path) -> None:
    path = make_toolkit(tmp_path / "path", nvcc_text(12, 8))
    facts = probe_toolkit({"CUDA_PATH": str(path), "CUDA_HOME": ""})
    assert facts.found_by == "CUDA_PATH"
    assert facts.root == str(path)
    assert facts.nvcc_version == (12, 8)
    assert facts.searched == ("CUDA_HOME: not set", f"CUDA_PATH={path}: found")
    assert facts.warnings == ()


@needs_sh
def test_missing_cuda_home_directory_falls_through(tmp_path: Path) -> None:
    path = make_toolkit(tmp_path / "path")
    missing = tmp_path / "nowhere"
    facts = probe_toolkit({"CUDA_HOME": str(missing), "CUDA_PATH": str(path)})
    assert facts.found_by == "CUDA_PATH"
    assert facts.searched[0] == f"CUDA_HOME={missing}: no such directory"


@needs_sh
def test_nvcc_on_path(tmp_path: Path) -> None:
    root = make_toolkit(tmp_path / "cuda-12.4")
    facts = probe_toolkit({"PATH": f"{tmp_path / 'empty'}{os.pathsep}{root / 'bin'}"})
    assert facts.found_by == "nvcc on PATH"
    assert facts.root == str(root)
    assert facts.nvcc_version == (12, 4)
    assert facts.searched[:2] == ("CUDA_HOME: not set", "CUDA_PATH: not set")
    assert facts.searched[2].startswith("nvcc on PATH: ")
    assert len(facts.searched) == 3  # the default directory was not needed
    assert facts.warnings == ()


@needs_sh
def test_nvcc_on_path_through_a_symlink_finds_the_real_toolkit(tmp_path: Path) -> None:
    root = make_toolkit(tmp_path / "cuda-12.4")
    links = tmp_path / "usr-bin"
    links.mkdir()
    (links / "nvcc").symlink_to(root / "bin" / "nvcc")
    facts = probe_toolkit({"PATH": str(links)})
    assert facts.root == str(root.resolve())
    assert facts.nvcc_version == (12, 4)
    assert facts.warnings == ()


@needs_sh
def test_nvcc_wrapper_script_on_path_warns(tmp_path: Path) -> None:
    real = make_toolkit(tmp_path / "cuda")
    wrappers = tmp_path / "wrappers" / "bin"
    wrappers.mkdir(parents=True)
    wrapper = wrappers / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {real / "bin" / "nvcc"} "$@"\n')
    wrapper.chmod(0o755)
    facts = probe_toolkit({"PATH": str(wrappers)})
    assert facts.root == str(tmp_path / "wrappers")
    assert facts.nvcc_version == (12, 4)
    assert any("wrapper" in w for w in facts.warnings)


def _wrapper_on_path(tmp_path: Path, body: str) -> Path:
    """bin/nvcc in a directory that is no toolkit (no include/), running `body`."""
    wrappers = tmp_path / "wrappers" / "bin"
    wrappers.mkdir(parents=True)
    wrapper = wrappers / "nvcc"
    wrapper.write_text(f"#!/bin/sh\n{body}\n")
    wrapper.chmod(0o755)
    return wrappers


@needs_sh
@pytest.mark.parametrize(
    "body, said",
    [("echo 'wrapper: no backend configured' >&2; exit 1", "exited with status 1: wrapper: no backend configured"),
     ("exit 0", "output not understood: no output")],  # fmt: skip
    ids=["fails", "no-version"],
)
def test_nvcc_wrapper_without_a_version_falls_through_to_the_default_toolkit(
    tmp_path: Path, no_default_toolkit: Path, body: str, said: str
) -> None:
    make_toolkit(no_default_toolkit, nvcc_text(12, 8))
    wrappers = _wrapper_on_path(tmp_path, body)
    facts = probe_toolkit({"PATH": str(wrappers)})
    assert facts.root == str(no_default_toolkit) and facts.found_by == str(no_default_toolkit)
    assert facts.nvcc_path == str(no_default_toolkit / "bin" / "nvcc")
    assert facts.nvcc_version == (12, 8) and facts.problem is None and facts.usable_for_jit
    assert facts.searched[2] == f"nvcc on PATH: {wrappers / 'nvcc'}, root {wrappers.parent}"
    assert facts.searched[3].startswith(f"nvcc on PATH: {wrappers / 'nvcc'} gives no version (")
    assert said in facts.searched[3] and facts.searched[3].endswith("so the search goes on")
    assert facts.searched[4] == f"{no_default_toolkit}: found"
    assert facts.warnings == (
        f"nvcc on PATH under {wrappers.parent} gives no version (probably a wrapper script): used the full "
        f"toolkit at {no_default_toolkit} instead; set CUDA_HOME to choose another",
    )


@needs_sh
@pytest.mark.parametrize("default", ["missing", "runtime-only", "broken-nvcc"])
def test_nvcc_wrapper_without_a_version_and_no_full_default_keeps_the_path_answer(
    tmp_path: Path, no_default_toolkit: Path, default: str
) -> None:
    if default == "runtime-only":
        make_toolkit(no_default_toolkit, nvcc=None)
        verdict = "no bin/nvcc, not a full toolkit"
    elif default == "broken-nvcc":
        make_toolkit(no_default_toolkit, "garbage\n")
        verdict = f"{no_default_toolkit / 'bin' / 'nvcc'} gives no version either (nvcc --version output not understood: garbage)"
    else:
        verdict = "no such directory"
    wrappers = _wrapper_on_path(tmp_path, "exit 2")
    facts = probe_toolkit({"PATH": str(wrappers)})
    assert facts.root == str(wrappers.parent) and facts.found_by == "nvcc on PATH"
    assert facts.nvcc_version is None and not facts.usable_for_jit
    assert facts.problem == f"{wrappers / 'nvcc'} --version exited with status 2: no output"
    assert facts.searched[-1] == f"{no_default_toolkit}: {verdict}"
    assert any("probably a wrapper script; set CUDA_HOME" in w for w in facts.warnings)


@needs_sh
def test_broken_nvcc_under_cuda_home_stays_final(tmp_path: Path, no_default_toolkit: Path) -> None:
    make_toolkit(no_default_toolkit, nvcc_text(12, 8))
    home = make_toolkit(tmp_path / "home", NVCC_12_4, exit_code=3)
    facts = probe_toolkit({"CUDA_HOME": str(home)})
    assert facts.root == str(home) and facts.nvcc_version is None
    assert facts.problem is not None and "exited with status 3" in facts.problem


@needs_sh
def test_nvcc_on_path_runs_once(tmp_path: Path) -> None:
    root = make_toolkit(tmp_path / "cuda")
    count = tmp_path / "count"
    (root / "bin" / "nvcc").write_text(
        f"#!/bin/sh\necho x >> {count}\nprintf '%s\\n' 'Cuda compilation tools, release 12.4, V12.4.131'\n"
    )
    facts = probe_toolkit({"PATH": str(root / "bin")})
    assert facts.nvcc_version == (12, 4)
    assert count.read_text().count("x") == 1


@needs_sh
def test_default_directory_is_the_last_resort(tmp_path: Path, no_default_toolkit: Path) -> None:
    make_toolkit(no_default_toolkit, nvcc_text(13, 0))
    empty = tmp_path / "empty"
    empty.mkdir()
    facts = probe_toolkit({"PATH": str(empty)})
    assert facts.found_by == str(no_default_toolkit)
    assert facts.root == str(no_default_toolkit)
    assert facts.nvcc_version == (13, 0)
    assert facts.searched == (
        "CUDA_HOME: not set",
        "CUDA_PATH: not set",
        "nvcc on PATH: not found",
        f"{no_default_toolkit}: found",
    )


def test_nothing_found(tmp_path: Path, no_default_toolkit: Path) -> None:
    facts = probe_toolkit({"CUDA_HOME": str(tmp_path / "gone"), "PATH": str(tmp_path)})
    assert facts.root is None and facts.found_by is None and facts.nvcc_path is None
    assert facts.nvcc_version is None and not facts.usable_for_jit
    assert not facts.runtime_only
    assert facts.problem == "no CUDA toolkit found"
    assert facts.searched == (
        f"CUDA_HOME={tmp_path / 'gone'}: no such directory",
        "CUDA_PATH: not set",
        "nvcc on PATH: not found",
        f"{no_default_toolkit}: no such directory",
    )


def test_runtime_only_install(tmp_path: Path) -> None:
    root = make_toolkit(tmp_path / "runtime", nvcc=None)
    facts = probe_toolkit({"CUDA_HOME": str(root)})
    assert facts.root == str(root)
    assert facts.runtime_only
    assert facts.nvcc_path is None and facts.nvcc_version is None
    assert not facts.usable_for_jit
    assert facts.problem == (
        f"runtime-only CUDA install at {root} (no bin/nvcc): "
        "kernels that compile at run time cannot work"
    )


# --- running nvcc -------------------------------------------------------------


@needs_sh
def test_unparseable_nvcc_output(tmp_path: Path) -> None:
    root = make_toolkit(tmp_path / "odd", "Totally Different Compiler 7\nsecond line\n")
    facts = probe_toolkit({"CUDA_HOME": str(root)})
    assert facts.nvcc_path == str(root / "bin" / "nvcc")
    assert facts.nvcc_version is None and not facts.usable_for_jit
    assert facts.problem == "nvcc --version output not understood: Totally Different Compiler 7"


@needs_sh
def test_nvcc_exiting_non_zero(tmp_path: Path) -> None:
    root = make_toolkit(tmp_path / "broken", NVCC_12_4, exit_code=3)
    facts = probe_toolkit({"CUDA_HOME": str(root)})
    assert facts.nvcc_version is None
    assert facts.problem is not None
    assert "exited with status 3" in facts.problem


@needs_sh
def test_nvcc_that_cannot_be_executed(tmp_path: Path) -> None:
    root = make_toolkit(tmp_path / "badexec")
    (root / "bin" / "nvcc").write_text("#!/nonexistent/interpreter\n")
    facts = probe_toolkit({"CUDA_HOME": str(root)})
    assert facts.nvcc_version is None
    assert facts.problem is not None and facts.problem.startswith("could not run ")


@needs_sh
def test_nvcc_that_hangs_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_toolkit(tmp_path / "slow")
    (root / "bin" / "nvcc").write_text("#!/bin/sh\nexec sleep 30\n")
    monkeypatch.setattr(toolkit_module, "NVCC_TIMEOUT_S", 0.3)
    facts = probe_toolkit({"CUDA_HOME": str(root)})
    assert facts.nvcc_version is None
    assert facts.problem is not None and "did not answer within 0.3 s" in facts.problem


# --- toolkit overrides ----------------------------------------------------------


@needs_sh
def test_selector_cuda_toolkit_replaces_the_search(tmp_path: Path) -> None:
    chosen = make_toolkit(tmp_path / "chosen", nvcc_text(12, 6))
    home = make_toolkit(tmp_path / "home")
    facts = probe_toolkit({"SELECTOR_CUDA_TOOLKIT": str(chosen), "CUDA_HOME": str(home)})
    assert facts.root == str(chosen)
    assert facts.found_by == "SELECTOR_CUDA_TOOLKIT (overridden)"
    assert facts.overridden
    assert facts.nvcc_version == (12, 6)
    assert facts.searched == (f"SELECTOR_CUDA_TOOLKIT={chosen}: found",)


@needs_sh
def test_empty_selector_cuda_toolkit_means_no_toolkit(tmp_path: Path) -> None:
    home = make_toolkit(tmp_path / "home")
    facts = probe_toolkit({"SELECTOR_CUDA_TOOLKIT": "", "CUDA_HOME": str(home)})
    assert facts.root is None and facts.nvcc_version is None
    assert facts.overridden
    assert facts.problem == "no CUDA toolkit (SELECTOR_CUDA_TOOLKIT is empty)"


def test_selector_cuda_toolkit_pointing_nowhere(tmp_path: Path) -> None:
    facts = probe_toolkit({"SELECTOR_CUDA_TOOLKIT": str(tmp_path / "nope")})
    assert facts.root is None and facts.overridden
    assert facts.problem == f"SELECTOR_CUDA_TOOLKIT={tmp_path / 'nope'}: no such directory"


@needs_sh
def test_selector_nvcc_version_is_used_without_running_nvcc(tmp_path: Path) -> None:
    # This nvcc would fail if it were run.
    root = make_toolkit(tmp_path / "cuda", "garbage\n", exit_code=1)
    facts = probe_toolkit({"CUDA_HOME": str(root), "SELECTOR_NVCC_VERSION": "12.8"})
    assert facts.nvcc_version == (12, 8)
    assert facts.nvcc_path == str(root / "bin" / "nvcc")
    assert facts.overridden and facts.usable_for_jit
    assert facts.problem is None
    assert facts.found_by == "CUDA_HOME"


def test_selector_nvcc_version_without_any_toolkit(tmp_path: Path) -> None:
    facts = probe_toolkit({"SELECTOR_NVCC_VERSION": "13.0", "PATH": str(tmp_path)})
    assert facts.root is None
    assert facts.nvcc_version == (13, 0) and facts.usable_for_jit
    assert facts.problem is None


@needs_sh
def test_empty_selector_nvcc_version_makes_a_runtime_only_install(tmp_path: Path) -> None:
    root = make_toolkit(tmp_path / "cuda")
    facts = probe_toolkit({"CUDA_HOME": str(root), "SELECTOR_NVCC_VERSION": ""})
    assert facts.runtime_only and not facts.usable_for_jit
    assert facts.nvcc_version is None and facts.nvcc_path is None
    assert facts.overridden
    assert facts.problem is not None and facts.problem.startswith("runtime-only CUDA install at")


@pytest.mark.parametrize("value", ["twelve", "12", "12.4.1", "v12.4"])
def test_malformed_selector_nvcc_version_is_a_problem(tmp_path: Path, value: str) -> None:
    root = make_toolkit(tmp_path / "cuda")
    facts = probe_toolkit({"CUDA_HOME": str(root), "SELECTOR_NVCC_VERSION": value})
    assert facts.nvcc_version is None and facts.overridden
    assert facts.problem is not None
    assert "SELECTOR_NVCC_VERSION" in facts.problem and "not understood" in facts.problem


# --- GPU overrides --------------------------------------------------------------


def test_selector_gpus_with_and_without_memory() -> None:
    facts = probe_gpus({"SELECTOR_GPUS": "NVIDIA H200:9.0:141, NVIDIA B200:10.0"})
    assert facts.source == "SELECTOR_GPUS (overridden)"
    assert facts.overridden and facts.available and facts.problem is None
    assert facts.devices == (
        GpuDevice(0, "NVIDIA H200", (9, 0), memory_total_bytes=141 * GIB),
        GpuDevice(1, "NVIDIA B200", (10, 0)),
    )
    assert facts.driver_version is None and facts.driver_cuda_version is None


def test_selector_gpus_does_not_touch_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it would now fail
    facts = probe_gpus({"SELECTOR_GPUS": "NVIDIA H200:9.0"})
    assert facts.problem is None and len(facts.devices) == 1


def test_empty_selector_gpus_means_no_gpu() -> None:
    facts = probe_gpus({"SELECTOR_GPUS": ""})
    assert not facts.available and facts.overridden
    assert facts.problem == "no GPU (SELECTOR_GPUS is empty)"


@pytest.mark.parametrize(
    "value",
    [
        "NVIDIA H200",
        "NVIDIA H200:9",
        "NVIDIA H200:nine.zero",
        "NVIDIA H200:9.0:lots",
        "NVIDIA H200:9.0:-1",
        ":9.0",
        "NVIDIA H200:9.0,",
        "NVIDIA H200:9.0:141:extra",
    ],
)
def test_malformed_selector_gpus_is_a_problem_not_an_exception(value: str) -> None:
    facts = probe_gpus({"SELECTOR_GPUS": value})
    assert facts.devices == ()
    assert facts.overridden
    assert facts.problem is not None
    assert facts.problem.startswith("SELECTOR_GPUS entry ")
    assert "NAME:MAJOR.MINOR" in facts.problem


def test_driver_overrides() -> None:
    facts = probe_gpus(
        {
            "SELECTOR_GPUS": "NVIDIA H200:9.0:141",
            "SELECTOR_DRIVER_VERSION": "580.159.04",
            "SELECTOR_DRIVER_CUDA_VERSION": "13.0",
        }
    )
    assert facts.driver_version == "580.159.04"
    assert facts.driver_cuda_version == "13.0"
    assert "SELECTOR_DRIVER_VERSION (overridden)" in facts.source
    assert "SELECTOR_DRIVER_CUDA_VERSION (overridden)" in facts.source
    assert facts.problem is None


def test_malformed_driver_overrides() -> None:
    facts = probe_gpus(
        {
            "SELECTOR_GPUS": "NVIDIA H200:9.0",
            "SELECTOR_DRIVER_VERSION": "latest",
            "SELECTOR_DRIVER_CUDA_VERSION": "thirteen",
        }
    )
    assert facts.driver_version is None and facts.driver_cuda_version is None
    assert facts.available  # the GPUs themselves were fine
    assert facts.problem is not None
    assert "SELECTOR_DRIVER_VERSION='latest'" in facts.problem
    assert "SELECTOR_DRIVER_CUDA_VERSION='thirteen'" in facts.problem


# --- GPUs through a fake NVML ---------------------------------------------------


class FakeNvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class FakeLibraryNotFound(FakeNvmlError):
    def __init__(self) -> None:
        super().__init__(12)


FAKE_UUIDS = (
    "GPU-aaaa1111-2222-3333-4444-555566667777",
    "GPU-bbbb1111-2222-3333-4444-555566667777",
)


def fake_pynvml(
    names: tuple[str | bytes, ...] = ("NVIDIA H200", "NVIDIA H200"),
    init_error: Exception | None = None,
    count_error: Exception | None = None,
) -> types.ModuleType:
    """A stand-in for pynvml with len(names) devices and a shutdown counter."""
    module = types.ModuleType("pynvml")
    module.calls = {"init": 0, "shutdown": 0}  # type: ignore[attr-defined]
    module.NVMLError = FakeNvmlError  # type: ignore[attr-defined]
    module.NVMLError_LibraryNotFound = FakeLibraryNotFound  # type: ignore[attr-defined]

    def init() -> None:
        module.calls["init"] += 1
        if init_error is not None:
            raise init_error

    def shutdown() -> None:
        module.calls["shutdown"] += 1

    def count() -> int:
        if count_error is not None:
            raise count_error
        return len(names)

    def memory(handle: int) -> types.SimpleNamespace:
        total = (141 - handle) * GIB
        return types.SimpleNamespace(total=total, free=total - GIB, used=GIB)

    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    module.nvmlSystemGetDriverVersion = lambda: b"580.159.04"  # type: ignore[attr-defined]
    module.nvmlSystemGetCudaDriverVersion = lambda: 13000  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = count  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: names[h]  # type: ignore[attr-defined]
    module.nvmlDeviceGetUUID = lambda h: FAKE_UUIDS[h]  # type: ignore[attr-defined]
    module.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    return module


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = fake_pynvml(names=(b"NVIDIA H200", "NVIDIA H200"))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_nvml_reports_every_device_when_nothing_is_hidden(nvml: types.ModuleType) -> None:
    facts = probe_gpus({})
    assert facts.source == "NVML" and not facts.overridden and facts.problem is None
    assert facts.driver_version == "580.159.04"  # bytes decoded
    assert facts.driver_cuda_version == "13.0"
    first, second = facts.devices
    assert first == GpuDevice(
        index=0,
        name="NVIDIA H200",  # bytes decoded
        compute_capability=(9, 0),
        memory_total_bytes=141 * GIB,
        memory_free_bytes=140 * GIB,
        uuid=FAKE_UUIDS[0],
        nvml_index=0,
    )
    assert (second.index, second.nvml_index, second.uuid) == (1, 1, FAKE_UUIDS[1])
    assert nvml.calls == {"init": 1, "shutdown": 1}


@pytest.mark.parametrize(
    ("visible", "expected_nvml_indices"),
    [
        ("1", [1]),
        ("1,0", [1, 0]),
        (" 1 , 0 ", [1, 0]),
        ("GPU-bbbb", [1]),
        ("GPU-BBBB1111,0", [1, 0]),
        ("0,7,1", [0]),  # CUDA stops at the first entry that is no GPU
        ("0,0,1", [0]),  # a repeat counts as invalid
        ("GPU-cccc,0", []),
        ("GPU-,1", []),  # a prefix matching both GPUs is ambiguous
        ("MIG-abcd", []),
        ("", []),
        ("-1", []),
    ],
)
def test_cuda_visible_devices_filters_and_renumbers(
    nvml: types.ModuleType, visible: str, expected_nvml_indices: list[int]
) -> None:
    facts = probe_gpus({"CUDA_VISIBLE_DEVICES": visible})
    assert [d.nvml_index for d in facts.devices] == expected_nvml_indices
    assert [d.index for d in facts.devices] == list(range(len(expected_nvml_indices)))
    assert [d.uuid for d in facts.devices] == [FAKE_UUIDS[i] for i in expected_nvml_indices]
    assert facts.source == "NVML, filtered by CUDA_VISIBLE_DEVICES"
    if not expected_nvml_indices:
        assert facts.problem is not None and facts.problem.startswith("no GPU visible (NVML sees 2)")
    assert nvml.calls["shutdown"] == 1


def test_cuda_visible_devices_notes_the_entry_it_dropped(nvml: types.ModuleType) -> None:
    facts = probe_gpus({"CUDA_VISIBLE_DEVICES": "0,7,1"})
    assert facts.available
    assert facts.problem is not None
    assert "entry '7'" in facts.problem and "every entry after it" in facts.problem


def test_mixed_gpu_models_note_the_numbering(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(("NVIDIA H200", "NVIDIA L4")))
    facts = probe_gpus({})
    assert [d.name for d in facts.devices] == ["NVIDIA H200", "NVIDIA L4"]
    assert facts.problem is not None and "CUDA_DEVICE_ORDER" in facts.problem
    assert probe_gpus({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}).problem is None


def test_no_nvidia_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_pynvml(init_error=FakeLibraryNotFound())
    monkeypatch.setitem(sys.modules, "pynvml", module)
    facts = probe_gpus({})
    assert not facts.available
    assert facts.problem == "no NVIDIA driver (NVML library not found)"
    assert facts.driver_version is None
    assert module.calls["shutdown"] == 0  # nothing to shut down after a failed init


def test_driver_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=FakeNvmlError(9)))
    assert probe_gpus({}).problem == "no NVIDIA driver (driver not loaded)"


def test_pynvml_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    facts = probe_gpus({})
    assert not facts.available
    assert facts.problem == "nvidia-ml-py not installed"


def test_nvml_failing_mid_query_is_reported_and_shut_down(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_pynvml(count_error=RuntimeError("GPU is lost"))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    facts = probe_gpus({})
    assert not facts.available
    assert facts.problem == "NVML query failed: RuntimeError: GPU is lost"
    assert module.calls == {"init": 1, "shutdown": 1}


def test_driver_override_on_top_of_nvml(nvml: types.ModuleType) -> None:
    facts = probe_gpus({"SELECTOR_DRIVER_VERSION": "570.1.2"})
    assert facts.driver_version == "570.1.2"
    assert facts.driver_cuda_version == "13.0"  # still NVML's
    assert facts.overridden
    assert facts.source.startswith("NVML; ")


def test_real_nvml_never_raises() -> None:
    # Whatever this machine has: GPUs, or a problem that says why not.
    facts = probe_gpus({})
    assert facts.available or facts.problem


# --- packages -------------------------------------------------------------------


def test_installed_and_missing_packages() -> None:
    import importlib.metadata

    pytest_facts, missing = probe_packages(["pytest", "surely-not-installed-pkg"], {})
    assert pytest_facts == PackageFacts("pytest", importlib.metadata.version("pytest"), "importlib.metadata")
    assert missing == PackageFacts("surely-not-installed-pkg", None, "importlib.metadata")


def test_package_names_are_normalised() -> None:
    import importlib.metadata

    try:
        expected = importlib.metadata.version("PyYAML")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("PyYAML is not installed here")
    for spelling in ("PyYAML", "pyyaml", "PYYAML"):
        (facts,) = probe_packages([spelling], {})
        assert facts.version == expected and facts.name == spelling


def test_package_override() -> None:
    cutlass, yaml_ = probe_packages(
        ["nvidia-cutlass-dsl", "pyyaml"],
        {"SELECTOR_PACKAGE_NVIDIA_CUTLASS_DSL": "4.4.2", "SELECTOR_PACKAGE_PYYAML": ""},
    )
    assert cutlass == PackageFacts(
        "nvidia-cutlass-dsl", "4.4.2", "SELECTOR_PACKAGE_NVIDIA_CUTLASS_DSL (overridden)", True
    )
    assert yaml_.version is None and yaml_.overridden and yaml_.problem is None
    assert yaml_.source == "SELECTOR_PACKAGE_PYYAML (overridden)"


def test_malformed_package_override_is_a_problem() -> None:
    (facts,) = probe_packages(["triton"], {"SELECTOR_PACKAGE_TRITON": "the new one"})
    assert facts.version is None and facts.overridden
    assert facts.problem == "SELECTOR_PACKAGE_TRITON='the new one' is not a version"


def test_package_variable_names() -> None:
    assert probes.package_variable("nvidia-cutlass-dsl") == "SELECTOR_PACKAGE_NVIDIA_CUTLASS_DSL"
    assert probes.package_variable("zope.interface") == "SELECTOR_PACKAGE_ZOPE_INTERFACE"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("__version__ = '2.9.0+cu130'\ncuda = '13.0'\n", "13.0"),
        ('cuda = "12.8"  # set by setup.py\n', "12.8"),
        ("from typing import Optional\ncuda: Optional[str] = None\nhip = None\n", ""),
        ("cuda: str = '12.6'\n", "12.6"),
        ("hip = '6.2'\n", None),
        ("cudnn = '9'\n", None),
    ],
)
def test_parse_torch_cuda(text: str, expected: str | None) -> None:
    assert parse_torch_cuda(text) == expected


def fake_torch_site(base: Path, version: str, version_py: str | None) -> Path:
    site = base / "site"
    info = site / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    if version_py is not None:
        (site / "torch").mkdir()
        (site / "torch" / "version.py").write_text(version_py)
    return site


def test_torch_cuda_build_read_from_version_py(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = fake_torch_site(
        tmp_path, "9.9.0+cu130", "__version__ = '9.9.0+cu130'\ncuda: Optional[str] = '13.0'\n"
    )
    monkeypatch.syspath_prepend(str(site))
    (torch,) = probe_packages(["torch"], {})
    assert torch == PackageFacts("torch", "9.9.0+cu130", "importlib.metadata", False, {"cuda": "13.0"})


def test_torch_cpu_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = fake_torch_site(tmp_path, "9.9.0+cpu", "cuda: Optional[str] = None\n")
    monkeypatch.syspath_prepend(str(site))
    (torch,) = probe_packages(["torch"], {})
    assert torch.detail == {"cuda": ""} and torch.problem is None


def test_torch_version_py_without_a_cuda_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = fake_torch_site(tmp_path, "9.9.0", "__version__ = '9.9.0'\n")
    monkeypatch.syspath_prepend(str(site))
    (torch,) = probe_packages(["torch"], {})
    assert torch.version == "9.9.0" and torch.detail == {}
    assert torch.problem is not None and "no `cuda = ...` line" in torch.problem


def test_torch_cuda_override() -> None:
    (torch,) = probe_packages(
        ["torch"], {"SELECTOR_PACKAGE_TORCH": "2.9.0", "SELECTOR_TORCH_CUDA": "13.0"}
    )
    assert torch.version == "2.9.0" and torch.detail == {"cuda": "13.0"}
    assert torch.overridden
    assert "SELECTOR_TORCH_CUDA (overridden)" in torch.source

    (cpu,) = probe_packages(["torch"], {"SELECTOR_PACKAGE_TORCH": "2.9.0", "SELECTOR_TORCH_CUDA": ""})
    assert cpu.detail == {"cuda": ""}

    (bad,) = probe_packages(["torch"], {"SELECTOR_PACKAGE_TORCH": "2.9.0", "SELECTOR_TORCH_CUDA": "yes"})
    assert bad.detail == {} and bad.problem is not None and "SELECTOR_TORCH_CUDA='yes'" in bad.problem


def test_overridden_torch_version_does_not_borrow_the_installed_build() -> None:
    (torch,) = probe_packages(["torch"], {"SELECTOR_PACKAGE_TORCH": "2.9.0"})
    assert torch.detail == {} and torch.problem is None


def test_installed_torch_build_is_read_without_importing_it() -> None:
    (torch,) = probe_packages(["torch"], {})
    if torch.version is None:
        pytest.skip("torch is not installed here")
    assert set(torch.detail) == {"cuda"}
    if torch.version.endswith("+cpu"):
        assert torch.detail["cuda"] == ""


# --- the whole environment --------------------------------------------------------

H200_ENVIRON = {
    "SELECTOR_GPUS": "NVIDIA H200:9.0:141,NVIDIA H200:9.0:141",
    "SELECTOR_DRIVER_VERSION": "580.159.04",
    "SELECTOR_DRIVER_CUDA_VERSION": "13.0",
    "SELECTOR_CUDA_TOOLKIT": "",
    "SELECTOR_NVCC_VERSION": "12.4",
    "SELECTOR_PACKAGE_TORCH": "2.9.0",
    "SELECTOR_TORCH_CUDA": "13.0",
    "SELECTOR_PACKAGE_NVIDIA_CUTLASS_DSL": "4.4.2",
}


def test_a_cpu_box_can_pretend_to_be_an_h200_host() -> None:
    env = collect_environment(H200_ENVIRON, packages=("torch", "nvidia-cutlass-dsl", "PyYAML"))
    assert env.gpu.available and len(env.gpu.devices) == 2
    assert env.compute_capability() == (9, 0)
    assert env.compute_capability(1) == (9, 0)
    assert env.compute_capability(2) is None
    assert env.gpu.driver_cuda_version == "13.0"
    assert env.toolkit.usable_for_jit and env.toolkit.nvcc_version == (12, 4)
    assert env.package_version("nvidia_cutlass_dsl") == "4.4.2"
    assert env.package("NVIDIA-Cutlass.DSL") is env.packages[1]
    assert env.package("pyyaml") is env.packages[2]
    assert env.package("not-asked-for") is None and env.package_version("not-asked-for") is None
    torch = env.package("torch")
    assert torch is not None and torch.detail == {"cuda": "13.0"}
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", env.python)
    assert env.platform.count("-") >= 1


def test_environment_round_trips_through_json() -> None:
    env = collect_environment(H200_ENVIRON)
    data = json.loads(json.dumps(env.to_dict()))
    assert Environment.from_dict(data) == env
    assert data["gpu"]["devices"][0]["compute_capability"] == [9, 0]
    assert data["toolkit"]["nvcc_version"] == [12, 4]


def test_this_machines_environment_round_trips() -> None:
    env = collect_environment()
    assert Environment.from_dict(json.loads(json.dumps(env.to_dict()))) == env


def test_from_dict_rejects_a_future_schema() -> None:
    data = collect_environment(H200_ENVIRON).to_dict()
    data["schema_version"] = 99
    with pytest.raises(ValueError):
        Environment.from_dict(data)


def _environment(
    free: int = 100 * GIB,
    nvcc: tuple[int, int] | None = (12, 4),
    uuid: str = "GPU-1",
    cutlass: str | None = "4.4.2",
    source: str = "NVML",
) -> Environment:
    device = GpuDevice(0, "NVIDIA H200", (9, 0), 141 * GIB, free, uuid, 0)
    return Environment(
        gpu=GpuFacts((device,), "580.159.04", "13.0", source),
        toolkit=ToolkitFacts("/usr/local/cuda", "CUDA_HOME", "/usr/local/cuda/bin/nvcc", nvcc, False, ()),
        packages=(
            PackageFacts("torch", "2.9.0", "importlib.metadata", detail={"cuda": "13.0"}),
            PackageFacts("nvidia-cutlass-dsl", cutlass, "importlib.metadata"),
        ),
        python="3.11.7",
        platform="linux-x86_64",
    )


def test_fingerprint_is_stable_and_ignores_what_does_not_matter() -> None:
    base = _environment().fingerprint()
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    assert _environment().fingerprint() == base
    assert _environment(free=1 * GIB).fingerprint() == base
    assert _environment(uuid="GPU-2").fingerprint() == base
    assert _environment(source="SELECTOR_GPUS (overridden)").fingerprint() == base
    reordered = _environment()
    reordered = Environment(
        reordered.gpu, reordered.toolkit, reordered.packages[::-1], reordered.python, reordered.platform
    )
    assert reordered.fingerprint() == base


def test_fingerprint_changes_with_what_matters() -> None:
    base = _environment().fingerprint()
    assert _environment(nvcc=(12, 8)).fingerprint() != base
    assert _environment(nvcc=None).fingerprint() != base
    assert _environment(cutlass=None).fingerprint() != base
    assert _environment(cutlass="4.5.0").fingerprint() != base


def test_environment_problems_are_collected() -> None:
    env = collect_environment(
        {"SELECTOR_GPUS": "", "SELECTOR_CUDA_TOOLKIT": "", "SELECTOR_PACKAGE_TORCH": "?"},
        packages=("torch",),
    )
    assert env.problems == (
        "gpu: no GPU (SELECTOR_GPUS is empty)",
        "toolkit: no CUDA toolkit (SELECTOR_CUDA_TOOLKIT is empty)",
        "package torch: SELECTOR_PACKAGE_TORCH='?' is not a version",
    )


def test_garbage_everywhere_never_raises() -> None:
    garbage = {name: "\x00 nonsense ::: ,,," for name in OVERRIDE_VARIABLES if "<" not in name}
    garbage.update({"CUDA_VISIBLE_DEVICES": "x,y", "CUDA_HOME": "\x00", "PATH": "\x00"})
    garbage["SELECTOR_PACKAGE_TORCH"] = "1.0"
    env = collect_environment(garbage)
    assert env.gpu.problem and env.toolkit.problem
    assert env.package("torch") is not None and env.package("torch").problem  # type: ignore[union-attr]


def test_every_override_variable_is_documented() -> None:
    used: set[str] = set()
    for source in (REPO_ROOT / "probes").glob("*.py"):
        used.update(re.findall(r"SELECTOR_[A-Z_]+[A-Z]", source.read_text()))
    documented = {name for name in OVERRIDE_VARIABLES if "<" not in name}
    assert {"SELECTOR_GPUS", "SELECTOR_CUDA_TOOLKIT", "SELECTOR_NVCC_VERSION"} <= documented
    undocumented = {u for u in used - documented if not u.startswith("SELECTOR_PACKAGE")}
    assert undocumented == set()
    assert "SELECTOR_PACKAGE_<NAME>" in OVERRIDE_VARIABLES
    assert all(isinstance(text, str) and text for text in OVERRIDE_VARIABLES.values())


def test_probing_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom selector import probes\n"
        "env = probes.collect_environment()\n"
        "assert env.package('torch') is not None\n"
        "print('torch' in sys.modules, any(m.startswith('torch.') for m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


# --- transformers / kernels pairs -----------------------------------------------


@pytest.mark.parametrize(
    "transformers, expected",
    [
        ("5.24.0", ("0.18.2", "0.19")),
        ("5.23.1", ("0.18.2", "0.19")),
        ("5.22.0", ("0.17.2", "0.18")),
        ("5.20.3.dev0", ("0.17.2", "0.18")),
        ("5.17.0", ("0.16", "0.17")),
        ("5.18.0", ("0.17", "0.18")),
        ("5.14.1", ("0.15.2", "0.16")),
        ("5.13.0", None),  # pin not known here: not judged
        ("5.25.0", ("0.19.1", "0.20")),
        ("5.26.0", None),
        ("4.57.1", None),
        ("garbage", None),
    ],
)
def test_kernels_for_transformers(transformers: str, expected: tuple[str, str] | None) -> None:
    from selector.compat import kernels_for_transformers

    assert kernels_for_transformers(transformers) == expected


def _with_packages(**versions: str | None) -> Environment:
    env = _environment()
    extra = tuple(PackageFacts(name, version, "importlib.metadata") for name, version in versions.items())
    return Environment(env.gpu, env.toolkit, env.packages + extra, env.python, env.platform)


@pytest.mark.parametrize(
    "transformers, kernels",
    [("5.23.0", "0.18.2"), ("5.24.1", "0.18.9"), ("5.25.0", "0.19.1"), ("5.21.0", "0.17.2"), ("5.17.0", "0.16.0"),
     ("5.23.0", None), (None, "0.12.0"), ("5.13.0", "0.1.0")],  # fmt: skip
)
def test_hub_kernels_verdict_none_for_a_working_or_unjudged_pair(transformers: str | None, kernels: str | None) -> None:
    from selector.compat import hub_kernels_verdict

    assert hub_kernels_verdict(_with_packages(transformers=transformers, kernels=kernels)) is None


@pytest.mark.parametrize(
    "transformers, kernels, pin",
    [("5.23.0", "0.17.2", ">=0.18.2,<0.19"), ("5.24.0", "0.19.0", ">=0.18.2,<0.19"),
     ("5.25.0", "0.18.3", ">=0.19.1,<0.20"),
     ("5.22.0", "0.18.2", ">=0.17.2,<0.18"), ("5.20.0", "0.17.1", ">=0.17.2,<0.18"),
     ("5.17.0", "0.17.0", ">=0.16,<0.17")],  # fmt: skip
)
def test_hub_kernels_verdict_names_the_mismatch_and_the_fix(transformers: str, kernels: str, pin: str) -> None:
    from selector.compat import hub_kernels_verdict

    verdict = hub_kernels_verdict(_with_packages(transformers=transformers, kernels=kernels))
    assert verdict is not None and "\n" not in verdict
    assert f"transformers {transformers} loads hub kernels only with kernels{pin}" in verdict
    assert f"kernels {kernels} is installed" in verdict
    assert verdict.endswith(f"fix: pip install 'kernels{pin}'")


def test_compat_imports_no_torch() -> None:
    code = "import sys, selector.compat; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
