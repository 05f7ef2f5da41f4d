"""GPUs and driver, through NVML.

NVML is used rather than the CUDA runtime because it answers in milliseconds
and does not create a CUDA context (which would pin memory on every GPU and
break a later fork). Its cost is that it ignores CUDA_VISIBLE_DEVICES, so
that filter is applied here the way the CUDA driver applies it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

from .facts import GpuDevice, GpuFacts
from .overrides import (
    is_driver_version,
    overridden_source,
    parse_major_minor,
    read_override,
)

NVML_SOURCE = "NVML"
_GIB = 1 << 30
# pynvml's error codes, repeated so a stand-in module need not define them.
_NVML_ERROR_NO_PERMISSION = 4
_NVML_ERROR_DRIVER_NOT_LOADED = 9
_NVML_ERROR_LIBRARY_NOT_FOUND = 12


def probe_gpus(environ: Mapping[str, str] | None = None) -> GpuFacts:
    """Visible GPUs and the driver; never raises."""
    env = os.environ if environ is None else environ
    try:
        gpus = read_override(env, "SELECTOR_GPUS")
        facts = _from_override(gpus) if gpus is not None else _from_nvml(env)
        return _apply_driver_overrides(facts, env)
    except Exception as exc:  # a probe reports, it does not fail
        return GpuFacts((), None, None, NVML_SOURCE, problem=f"GPU probe failed: {_describe(exc)}")


# --- SELECTOR_GPUS -----------------------------------------------------------


def _from_override(value: str) -> GpuFacts:
    source = overridden_source("SELECTOR_GPUS")
    if value == "":
        return GpuFacts((), None, None, source, True, "no GPU (SELECTOR_GPUS is empty)")
    devices = []
    for index, entry in enumerate(value.split(",")):
        parsed = parse_gpu_entry(entry)
        if parsed is None:
            problem = (
                f"SELECTOR_GPUS entry {entry.strip()!r} not understood: expected "
                "NAME:MAJOR.MINOR or NAME:MAJOR.MINOR:MEMORY_GIB"
            )
            # Half an override would silently describe a different machine.
            return GpuFacts((), None, None, source, True, problem)
        name, capability, memory = parsed
        devices.append(GpuDevice(index, name, capability, memory_total_bytes=memory))
    return GpuFacts(tuple(devices), None, None, source, True)


def parse_gpu_entry(entry: str) -> tuple[str, tuple[int, int], int | None] | None:
    """"NVIDIA H200:9.0:141" -> ("NVIDIA H200", (9, 0), 141 GiB in bytes).

    Fields are taken from the right, so a name may itself contain ':'.
    """
    parts = entry.strip().split(":")
    if len(parts) >= 3:
        name = ":".join(parts[:-2]).strip()
        capability = parse_major_minor(parts[-2])
        memory = _parse_gib(parts[-1])
        if name and capability is not None and memory is not None:
            return name, capability, memory
    if len(parts) >= 2:
        name = ":".join(parts[:-1]).strip()
        capability = parse_major_minor(parts[-1])
        if name and capability is not None:
            return name, capability, None
    return None


def _parse_gib(text: str) -> int | None:
    try:
        gib = float(text)
    except ValueError:
        return None
    if not math.isfinite(gib) or gib <= 0:
        return None
    return int(round(gib * _GIB))


def _apply_driver_overrides(facts: GpuFacts, env: Mapping[str, str]) -> GpuFacts:
    changes: dict[str, Any] = {}
    sources = [facts.source]
    problems = [facts.problem] if facts.problem else []

    version = read_override(env, "SELECTOR_DRIVER_VERSION")
    if version is not None:
        sources.append("driver " + overridden_source("SELECTOR_DRIVER_VERSION"))
        if version == "" or is_driver_version(version):
            changes["driver_version"] = version or None
        else:
            changes["driver_version"] = None
            problems.append(
                f"SELECTOR_DRIVER_VERSION={version!r} is not a driver version like 580.95.05"
            )

    cuda = read_override(env, "SELECTOR_DRIVER_CUDA_VERSION")
    if cuda is not None:
        sources.append("driver CUDA " + overridden_source("SELECTOR_DRIVER_CUDA_VERSION"))
        parsed = parse_major_minor(cuda) if cuda else None
        changes["driver_cuda_version"] = None if parsed is None else f"{parsed[0]}.{parsed[1]}"
        if cuda and parsed is None:
            problems.append(
                f"SELECTOR_DRIVER_CUDA_VERSION={cuda!r} is not a version like 13.0"
            )

    if not changes:
        return facts
    return dataclasses.replace(
        facts,
        **changes,
        source="; ".join(sources),
        overridden=True,
        problem="; ".join(problems) or None,
    )


# --- NVML --------------------------------------------------------------------


def _from_nvml(env: Mapping[str, str]) -> GpuFacts:
    try:
        import pynvml  # lazy: only this probe needs it
    except ImportError:
        return GpuFacts((), None, None, NVML_SOURCE, problem="nvidia-ml-py not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return GpuFacts((), None, None, NVML_SOURCE, problem=_init_problem(exc))
    try:
        return _read_nvml(pynvml, env)
    except Exception as exc:
        return GpuFacts((), None, None, NVML_SOURCE, problem=f"NVML query failed: {_describe(exc)}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _init_problem(exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    kind = type(exc).__name__
    if code == _NVML_ERROR_LIBRARY_NOT_FOUND or "LibraryNotFound" in kind:
        return "no NVIDIA driver (NVML library not found)"
    if code == _NVML_ERROR_DRIVER_NOT_LOADED or "DriverNotLoaded" in kind:
        return "no NVIDIA driver (driver not loaded)"
    if code == _NVML_ERROR_NO_PERMISSION or "NoPermission" in kind:
        return "NVML refused access (insufficient permissions)"
    return f"NVML failed to start: {_describe(exc)}"


def _read_nvml(pynvml: Any, env: Mapping[str, str]) -> GpuFacts:
    driver_version = _soft(lambda: _text(pynvml.nvmlSystemGetDriverVersion()))
    driver_cuda = _soft(lambda: cuda_version_text(int(pynvml.nvmlSystemGetCudaDriverVersion())))

    count = int(pynvml.nvmlDeviceGetCount())
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [_soft(lambda h=h: _text(pynvml.nvmlDeviceGetUUID(h))) for h in handles]
    names = [_soft(lambda h=h: _text(pynvml.nvmlDeviceGetName(h))) or "unknown GPU" for h in handles]

    visible_setting = env.get("CUDA_VISIBLE_DEVICES")
    visible, note = visible_nvml_indices(visible_setting, uuids)
    notes = [note] if note else []

    devices = []
    for cuda_index, nvml_index in enumerate(visible):
        handle = handles[nvml_index]
        try:
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        except Exception as exc:
            # Kept out of `devices` (a device without a capability cannot be
            # matched to kernels), but the CUDA numbering of the rest stands.
            notes.append(
                f"GPU {cuda_index} ({names[nvml_index]}): compute capability unreadable: "
                f"{_describe(exc)}"
            )
            continue
        memory = _soft(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
        devices.append(
            GpuDevice(
                index=cuda_index,
                name=names[nvml_index],
                compute_capability=(int(major), int(minor)),
                memory_total_bytes=None if memory is None else int(memory.total),
                memory_free_bytes=None if memory is None else int(memory.free),
                uuid=uuids[nvml_index],
                nvml_index=nvml_index,
            )
        )

    if count == 0:
        notes.insert(0, "NVML found no GPUs")
    elif not visible:
        notes.insert(0, f"no GPU visible (NVML sees {count})")
    elif len(set(names)) > 1 and env.get("CUDA_DEVICE_ORDER", "").strip() != "PCI_BUS_ID":
        # CUDA numbers fastest-first by default; NVML numbers by PCI bus. They
        # only agree for identical GPUs or when CUDA is told to use bus order.
        notes.append(
            "mixed GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may number "
            "them differently from NVML"
        )

    source = NVML_SOURCE if visible_setting is None else "NVML, filtered by CUDA_VISIBLE_DEVICES"
    return GpuFacts(tuple(devices), driver_version, driver_cuda, source, False, "; ".join(notes) or None)


def visible_nvml_indices(
    setting: str | None, uuids: Sequence[str | None]
) -> tuple[list[int], str | None]:
    """NVML indices in CUDA's order under CUDA_VISIBLE_DEVICES, and a note on any entry dropped.

    Like the CUDA driver: entries are indices or "GPU-" UUID prefixes, and the
    first entry that names no GPU (or one already named) ends the list.
    """
    if setting is None:
        return list(range(len(uuids))), None
    if setting.strip() == "":
        return [], "CUDA_VISIBLE_DEVICES is empty, which hides every GPU"
    chosen: list[int] = []
    for raw in setting.split(","):
        entry = raw.strip()
        index, reason = _resolve_visible_entry(entry, uuids)
        if index is not None and index in chosen:
            index, reason = None, "repeats an earlier entry"
        if index is None:
            return chosen, (
                f"CUDA_VISIBLE_DEVICES entry {entry!r} {reason}; CUDA ignores it and "
                "every entry after it"
            )
        chosen.append(index)
    return chosen, None


def _resolve_visible_entry(entry: str, uuids: Sequence[str | None]) -> tuple[int | None, str]:
    if entry.isdigit():
        index = int(entry)
        if index < len(uuids):
            return index, ""
        return None, f"is not a GPU index (NVML sees {len(uuids)})"
    lowered = entry.lower()
    if lowered.startswith("mig-"):
        return None, "is a MIG device, which this probe does not resolve"
    if lowered.startswith("gpu-"):
        matches = [i for i, u in enumerate(uuids) if u and u.lower().startswith(lowered)]
        if len(matches) == 1:
            return matches[0], ""
        return None, "matches no GPU UUID" if not matches else "matches several GPU UUIDs"
    return None, "is not a GPU index or UUID"


def cuda_version_text(version: int) -> str:
    """NVML's integer CUDA version to text: 13000 -> "13.0", 12040 -> "12.4"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _text(value: Any) -> str:
    # Older pynvml releases return bytes.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _soft(read: Any) -> Any:
    """Optional details (memory, UUID, ...) may be unsupported; they become None."""
    try:
        return read()
    except Exception:
        return None


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # pynvml's __str__ calls back into the library
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
