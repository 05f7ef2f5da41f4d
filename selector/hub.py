"""Hub kernels for backend plugins: version pins, whether a pinned kernel is here, and a loader that explains.

Backends whose kernels come from the Hugging Face kernel hub through the `kernels` package (DeepGEMM,
SonicMoE, third-party ones) share three needs that this module answers:

- **Pins.** Every hub kernel is pinned by `version=` (a branch `vN` the publisher keeps API-compatible) or by
  `revision=` (a branch, tag or commit); `kernels` refuses a call without one. `PINS` is the table of the
  kernels the built-in backends use; `kernels_pyproject()` writes it in the `[tool.kernels.dependencies]`
  form that `kernels lock` / `kernels download` read, for pre-fetching (docs/offline-kernels.md).
- **Is it here?** `locate()` answers from the file system only (no torch, no `kernels` import, no network):
  a `LOCAL_KERNELS` directory, or a snapshot in the hub cache (`KERNELS_CACHE`, `HF_HUB_CACHE`, `HF_HOME`,
  ~/.cache/huggingface/hub, in that order), and which of its build variants this machine's torch can load.
  `kernel_availability()` turns that into the `Availability` doctor and the ranking show, and `kernel_check()`
  wraps it into a `BackendSpec.check`.
- **Load it lazily.** `load_kernel()` imports `kernels` and the kernel only at the first forward. A node
  without internet that has the kernel cached but not `HF_HUB_OFFLINE=1` set would fail in `kernels`'
  publisher check; the loader then falls back to the cached snapshot through `kernels.get_local_kernel`.
  Every failure becomes an `ImportError` that says what was tried and how to fix it offline.

The directory facts mirror `kernels` 0.17 (variant names, cache layout, `LOCAL_KERNELS` syntax); the
`kernels` package itself still decides at load time.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from selector import settings
from selector.types import Availability, Problem, Status

if TYPE_CHECKING:
    from selector.probes import Environment

KERNELS_MIN_VERSION = "0.17"  # the `kernels` release whose loading rules this module mirrors
DOCS = "docs/offline-kernels.md"


@dataclass(frozen=True)
class HubKernel:
    """One pinned hub kernel: exactly one of `version` (branch vN) or `revision` (branch, tag or commit)."""

    repo_id: str
    version: int | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        if (self.version is None) == (self.revision is None):
            raise ValueError(f"pin {self.repo_id!r} with exactly one of version= or revision=")
        if "/" not in self.repo_id:
            raise ValueError(f"hub kernel ids look like 'org/name', got {self.repo_id!r}")

    @property
    def ref(self) -> str:
        return f"v{self.version}" if self.version is not None else str(self.revision)

    def kwargs(self) -> dict[str, int | str]:
        """The pin as `kernels.get_kernel` takes it."""
        return {"version": self.version} if self.version is not None else {"revision": str(self.revision)}

    def __str__(self) -> str:
        return f"{self.repo_id} {self.ref}"


# The hub kernels the built-in backends use. Versions as Transformers 5.x and the design notes name them:
# deep-gemm v2 JIT-compiles with nvcc at run time; sonic-moe v2 needs nvidia-cutlass-dsl and apache-tvm-ffi.
PINS: dict[str, HubKernel] = {
    "deep-gemm": HubKernel("kernels-community/deep-gemm", version=2),
    "sonic-moe": HubKernel("kernels-community/sonic-moe", version=2),
}


# --- where kernels live ------------------------------------------------------------------------------------


def hub_offline(environ: Mapping[str, str] | None = None) -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value, as huggingface_hub reads it."""
    env = os.environ if environ is None else environ
    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_root(environ: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """(hub cache directory, the variable that chose it), in the order `kernels` and huggingface_hub use."""
    env = os.environ if environ is None else environ
    for variable in ("KERNELS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(variable):
            return Path(os.path.expanduser(env[variable])), variable
    if env.get("HF_HOME"):
        return Path(os.path.expanduser(env["HF_HOME"])) / "hub", "HF_HOME"
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "huggingface" / "hub", "the default cache"


def write_local_kernel(dest: Path, name: str, license: str, variant: str = "torch-cuda", version: int = 2) -> Path:
    """Lay out <dest>/build/<variant>/metadata.json for a kernel wrapped by hand (a PyPI package, a patched
    build) and return the variant directory, where its __init__.py (or the package's files) go. Then
    LOCAL_KERNELS=<repo id>=<dest> makes `kernels` (and `locate`) find it."""
    target = Path(dest) / "build" / variant
    target.mkdir(parents=True, exist_ok=True)
    backend = variant.rsplit("-", 1)[-1] if variant.startswith("torch-") else "cuda"
    metadata = {
        "id": f"{name.replace('-', '_')}_local_{variant.replace('-', '_')}",
        "name": name,
        "version": version,
        "license": license,
        "backend": {"type": backend},
        "python-depends": [],
    }
    (target / "metadata.json").write_text(json.dumps(metadata, indent=2))
    return target


def local_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Path]:
    """LOCAL_KERNELS="org/a=/path/a:org/b=/path/b" as a dict; malformed entries are skipped."""
    env = os.environ if environ is None else environ
    out: dict[str, Path] = {}
    for entry in (env.get("LOCAL_KERNELS") or "").split(":"):
        if "=" in entry:
            repo_id, path = entry.split("=", 1)
            out[repo_id.strip()] = Path(path.strip())
    return out


LOCK_VARIABLE = "SELECTOR_KERNELS_LOCK"  # a kernels.lock (from `kernels lock`): pins resolve to its commits


def lock_commit(kernel: HubKernel, environ: Mapping[str, str] | None = None) -> str | None:
    """The commit a kernels.lock named by SELECTOR_KERNELS_LOCK gives this pin, or None."""
    path = settings.get(LOCK_VARIABLE, environ)
    if path is None:
        return None
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    for entry in entries if isinstance(entries, list) else []:
        dep = entry.get("dependency", {}) if isinstance(entry, dict) else {}
        if dep.get("repo-id") != kernel.repo_id:
            continue
        if dep.get("version") == kernel.version or (kernel.revision and dep.get("revision") == kernel.revision):
            commit = entry.get("lock", {}).get("commit")
            return commit if isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit) else None
    return None


@dataclass(frozen=True)
class SystemBuild:
    """What a build variant must match: torch's version and backend, the CPU and OS (as `kernels` names them)."""

    torch: tuple[int, int] | None
    cuda: tuple[int, int] | None  # None: a CPU build of torch (or unknown)
    cpu: str
    os: str
    tvm_ffi: tuple[int, int] | None = None

    @property
    def backend(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def describe(self) -> str:
        torch = f"torch {self.torch[0]}.{self.torch[1]}" if self.torch else "torch (not installed)"
        backend = f"CUDA {self.cuda[0]}.{self.cuda[1]}" if self.cuda else "CPU build"
        return f"{torch} ({backend}), {self.cpu}-{self.os}"


def _major_minor(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def system_build(env: Environment) -> SystemBuild:
    """The facts a build variant is matched against, from the probes (no torch import)."""
    torch = env.package("torch")
    cuda = _major_minor((torch.detail or {}).get("cuda")) if torch and torch.version else None
    os_name, _, cpu = env.platform.partition("-")
    os_name = {"win32": "windows"}.get(os_name, os_name)
    cpu = {"amd64": "x86_64", "arm64": "aarch64" if os_name == "darwin" else "arm64"}.get(cpu, cpu)
    tvm = env.package("apache-tvm-ffi")
    if tvm is None:  # not among the default probes: ask once, honouring SELECTOR_PACKAGE_APACHE_TVM_FFI
        from selector.probes import probe_packages

        tvm = probe_packages(("apache-tvm-ffi",))[0]
    return SystemBuild(
        torch=_major_minor(torch.version) if torch else None,
        cuda=cuda,
        cpu=cpu,
        os=os_name,
        tvm_ffi=_major_minor(tvm.version),
    )


_TORCH = re.compile(r"torch(\d)(\d+)(?:-(cxx11|cxx98))?-(.+)")
_STABLE = re.compile(r"torch-stable-abi(\d)(\d+)-(.+)")
_TVM = re.compile(r"tvm-ffi(\d+?)(\d+)-(.+)")
_CU = re.compile(r"cu(\d+)(\d)")


def _arch_verdict(arch: str, build: SystemBuild) -> str | None:
    parts = arch.split("-")
    if len(parts) != 3:
        return f"arch part {arch!r} not understood"
    backend, cpu, os_name = parts
    if cpu != build.cpu or os_name != build.os:
        return f"built for {cpu}-{os_name}, this is {build.cpu}-{build.os}"
    cu = _CU.fullmatch(backend)
    if cu:
        want = (int(cu.group(1)), int(cu.group(2)))
        if build.cuda is None:
            return f"built for CUDA {want[0]}.{want[1]}, torch here is a CPU build"
        if want[0] != build.cuda[0] or want[1] > build.cuda[1]:
            return f"built for CUDA {want[0]}.{want[1]}, torch here has CUDA {build.cuda[0]}.{build.cuda[1]}"
        return None
    if backend != build.backend:
        return f"built for {backend}, torch here is a {build.backend} build"
    return None


def variant_verdict(name: str, build: SystemBuild) -> str | None:
    """None when `kernels` would accept build variant `name` on this machine, else why not."""
    if name.startswith("torch-stable-abi"):
        match = _STABLE.fullmatch(name)
        if not match:
            return "not a build variant name"
        abi = (int(match.group(1)), int(match.group(2)))
        if build.torch is None or abi > build.torch:
            return f"needs torch >= {abi[0]}.{abi[1]}"
        return _arch_verdict(match.group(3), build)
    if name.startswith("torch-"):  # noarch: torch-cuda, torch-cpu, torch-universal
        backend = name[len("torch-") :]
        return None if backend in (build.backend, "universal") else f"for {backend}, torch here is {build.backend}"
    if name.startswith("tvm-ffi"):
        match = _TVM.fullmatch(name)
        if not match:
            return "not a build variant name"
        want = (int(match.group(1)), int(match.group(2)))
        if build.tvm_ffi != want:
            have = f"{build.tvm_ffi[0]}.{build.tvm_ffi[1]}" if build.tvm_ffi else "not installed"
            return f"needs apache-tvm-ffi {want[0]}.{want[1]}, here {have}"
        return _arch_verdict(match.group(3), build)
    match = _TORCH.fullmatch(name)
    if not match:
        return "not a build variant name"
    want = (int(match.group(1)), int(match.group(2)))
    if build.torch != want:
        have = f"{build.torch[0]}.{build.torch[1]}" if build.torch else "none"
        return f"built for torch {want[0]}.{want[1]}, torch here is {have}"
    if match.group(3) == "cxx98":
        return "built for the pre-C++11 ABI, which current torch wheels do not use"
    return _arch_verdict(match.group(4), build)


def _variants(directory: Path) -> list[str]:
    try:
        return sorted(p.name for p in directory.iterdir() if p.is_dir() and (p / "metadata.json").is_file())
    except OSError:
        return []


@dataclass(frozen=True)
class KernelLocation:
    """Where a pinned kernel is on this machine, and the build variant `kernels` would load."""

    kernel: HubKernel
    state: str  # "local" (LOCAL_KERNELS), "cached" (hub cache), "absent", or "unusable" (found, no variant fits)
    found_by: str  # "LOCAL_KERNELS", "KERNELS_CACHE", "HF_HUB_CACHE", "HF_HOME", "the default cache"
    path: Path | None = None  # the directory that holds the variant directories (or the variant itself)
    variant: str | None = None
    searched: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()  # "variant: why" for each variant that does not fit

    @property
    def loadable_offline(self) -> bool:
        return self.state in ("local", "cached")

    def where(self) -> str:
        if self.path is None:
            return "; ".join(self.searched)
        return f"{self.path / self.variant if self.variant else self.path} (found by {self.found_by})"


def _local(kernel: HubKernel, path: Path, build: SystemBuild) -> KernelLocation:
    searched = (f"LOCAL_KERNELS: {kernel.repo_id}={path}",)
    rejected: list[str] = []
    for base in (path, path / "build"):
        for name in _variants(base):
            why = variant_verdict(name, build)
            if why is None:
                return KernelLocation(kernel, "local", "LOCAL_KERNELS", base, name, searched)
            rejected.append(f"{name}: {why}")
    if (path / "metadata.json").is_file():  # LOCAL_KERNELS may point at one variant directly
        return KernelLocation(kernel, "local", "LOCAL_KERNELS", path, None, searched)
    if not path.is_dir():
        rejected.append(f"{path}: no such directory")
    elif not rejected:
        rejected.append(f"{path}: no build/<variant>/metadata.json and no metadata.json")
    return KernelLocation(kernel, "unusable", "LOCAL_KERNELS", path, None, searched, tuple(rejected))


def _snapshot(kernel: HubKernel, root: Path, locked: str | None = None) -> tuple[Path | None, list[str]]:
    """The cached snapshot directory of the pin (or of its locked commit), and what was looked at."""
    looked: list[str] = []
    slug = kernel.repo_id.replace("/", "--")
    for prefix in ("kernels", "models"):  # newer huggingface_hub uses the 'kernel' repo type; older caches 'model'
        repo = root / f"{prefix}--{slug}"
        if not repo.is_dir():
            looked.append(f"{repo}: absent")
            continue
        ref = locked or kernel.ref
        commit = ref if re.fullmatch(r"[0-9a-f]{40}", ref) else None
        if commit is None:
            try:
                commit = (repo / "refs" / ref).read_text().strip()
            except OSError:
                looked.append(f"{repo}: no refs/{ref}")
                continue
        snapshot = repo / "snapshots" / commit
        if snapshot.is_dir():
            return snapshot, looked
        looked.append(f"{repo}: refs/{ref} -> {commit[:12]}, snapshot missing")
    return None, looked


def locate(kernel: HubKernel, env: Environment, environ: Mapping[str, str] | None = None) -> KernelLocation:
    """Where `kernel` is: LOCAL_KERNELS first, then the hub cache. File system only; never raises."""
    try:
        build = system_build(env)
        local = local_overrides(environ).get(kernel.repo_id)
        if local is not None:
            return _local(kernel, local, build)
        root, found_by = cache_root(environ)
        locked = lock_commit(kernel, environ)
        snapshot, looked = _snapshot(kernel, root, locked)
        searched = (f"hub cache {root} (from {found_by})", *looked)
        if locked:
            searched += (f"commit {locked[:12]} from {LOCK_VARIABLE}",)
        if snapshot is None:
            return KernelLocation(kernel, "absent", found_by, None, None, searched)
        rejected = []
        for name in _variants(snapshot / "build"):
            why = variant_verdict(name, build)
            if why is None:
                return KernelLocation(kernel, "cached", found_by, snapshot / "build", name, searched)
            rejected.append(f"{name}: {why}")
        return KernelLocation(kernel, "unusable", found_by, snapshot, None, searched, tuple(rejected or ["no variants"]))
    except Exception as exc:  # a probe reports, it does not fail
        return KernelLocation(kernel, "absent", "nothing", None, None, (f"lookup failed: {exc!r}",))


# --- verdicts for doctor and the ranking -------------------------------------------------------------------


def _prefetch_remedy(kernel: HubKernel) -> str:
    return (
        f"on a machine with internet, pre-fetch it (`python -m selector.hub download`, or `kernels lock DIR && "
        f"kernels download DIR` with the pins from `python -m selector.hub pyproject` and {LOCK_VARIABLE}=DIR/"
        f"kernels.lock) and copy the hub cache here, or point LOCAL_KERNELS={kernel.repo_id}=/path/to/kernel "
        f"at a local kernel directory ({DOCS})"
    )


def kernel_availability(
    kernel: HubKernel, env: Environment, environ: Mapping[str, str] | None = None
) -> Availability:
    """Whether the pinned kernel can be loaded here. An ok verdict still says where it is (or that it will be
    downloaded), so doctor can show it; not loadable -> MISSING_PACKAGE (an ImportError when requested)."""
    loc = locate(kernel, env, environ)
    offline = hub_offline(environ)
    build = system_build(env)
    if loc.state == "local":
        return Availability(Status.OK, f"{kernel}: local kernel directory", found=loc.where())
    if loc.state == "cached":
        note = "" if offline else "; on a node without internet selector loads this snapshot itself"
        return Availability(Status.OK, f"{kernel}: cached, variant {loc.variant}{note}", found=loc.where())
    if loc.state == "unusable" and loc.found_by == "LOCAL_KERNELS":
        return Availability(
            Status.MISSING_PACKAGE,
            f"LOCAL_KERNELS points {kernel.repo_id} at {loc.path}, which holds no build variant for this machine "
            f"({build.describe()})",
            f"put a build/<variant>/ with metadata.json and __init__.py there, named for this machine "
            f"(e.g. torch-{build.backend}), or fix LOCAL_KERNELS ({DOCS})",
            found="; ".join(loc.rejected),
        )
    if not offline:
        what = "cached snapshot has no variant for this machine" if loc.state == "unusable" else "not cached"
        return Availability(
            Status.OK,
            f"{kernel}: {what}; downloaded from the Hub at the first forward (needs internet)",
            found=loc.where() if loc.state == "unusable" else "; ".join(loc.searched),
        )
    if loc.state == "unusable":
        return Availability(
            Status.MISSING_PACKAGE,
            f"the cached {kernel} has no build variant for this machine ({build.describe()}) and HF_HUB_OFFLINE "
            "forbids downloading one",
            _prefetch_remedy(kernel),
            found=f"{loc.path}: " + "; ".join(loc.rejected),
        )
    return Availability(
        Status.MISSING_PACKAGE,
        f"the hub kernel {kernel} is not in the local cache and HF_HUB_OFFLINE forbids downloading it",
        _prefetch_remedy(kernel),
        found="searched " + "; ".join(loc.searched),
    )


CheckFn = Callable[[Problem, "Environment"], "Availability | None"]


def kernel_check(
    kernel: HubKernel,
    machine: CheckFn | None = None,
    config: CheckFn | None = None,
    environ: Mapping[str, str] | None = None,
) -> CheckFn:
    """A `BackendSpec.check`: `machine` (hardware facts), then the kernel's availability, then `config`.

    The order keeps selector's rule: what is missing on this machine (ImportError) before what is wrong with
    the layer (ValueError). The returned function carries `hub_kernel`, so tools can list every pinned kernel.
    Its ok verdict carries where the kernel is (see `kernel_availability`).
    """

    def check(problem: Problem, env: Environment) -> Availability | None:
        if machine is not None:
            verdict = machine(problem, env)
            if verdict is not None and not verdict.ok:
                return verdict
        found = kernel_availability(kernel, env, environ)
        if not found.ok:
            return found
        if config is not None:
            verdict = config(problem, env)
            if verdict is not None and not verdict.ok:
                return verdict
        return found

    check.hub_kernel = kernel  # type: ignore[attr-defined]
    return check


# --- first-call cost in the ranking ------------------------------------------------------------------------

AMORTIZE_VARIABLE = "SELECTOR_JIT_AMORTIZE_CALLS"
DEFAULT_AMORTIZE_CALLS: float = settings.SETTINGS[AMORTIZE_VARIABLE].default
DOWNLOAD_SECONDS = 30.0  # a guess for fetching one kernel variant from the Hub (tens to hundreds of MB)


def amortize_calls(environ: Mapping[str, str] | None = None) -> float:
    """Over how many calls a one-time cost (download, JIT compile) is spread in an estimate (bad value: the
    default, as an estimate that raised would only hide the backend)."""
    return float(settings.get(AMORTIZE_VARIABLE, environ))


def pending_download_seconds(kernel: HubKernel, env: Environment) -> float:
    """DOWNLOAD_SECONDS unless the kernel is already loaded, local or cached; 0 otherwise."""
    if kernel in _LOADED:
        return 0.0
    return 0.0 if locate(kernel, env).loadable_offline else DOWNLOAD_SECONDS


# --- loading ---------------------------------------------------------------------------------------------

_LOADED: dict[HubKernel, ModuleType] = {}


def forget_loaded() -> None:
    """Drop the modules loaded so far (tests switch fake kernels; `kernels` keeps its own cache per path)."""
    _LOADED.clear()


def resolve_symbol(module: ModuleType, dotted: str) -> object | None:
    """module.a.b for "a.b", or None."""
    obj: object | None = module
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def load_kernel(kernel: HubKernel, required: Sequence[str] = (), backend: str = "") -> ModuleType:
    """Import the pinned kernel (once per process) and check it has `required` symbols; ImportError otherwise.

    Order: `kernels.get_kernel` with the pin (it honours LOCAL_KERNELS and HF_HUB_OFFLINE itself); if that
    fails and the pin's snapshot is in the hub cache, `kernels.get_local_kernel` on that snapshot (no network).
    """
    if kernel in _LOADED:
        return _LOADED[kernel]
    who = f"experts backend {backend!r}" if backend else "selector"
    try:
        import kernels
    except ImportError as exc:
        raise ImportError(
            f"{who} loads {kernel} through the `kernels` package, which is not importable ({exc}). "
            f"fix: pip install 'kernels>={KERNELS_MIN_VERSION}'."
        ) from exc

    tried: list[str] = []
    module: ModuleType | None = None
    locked = lock_commit(kernel)
    pin_kwargs = {"revision": locked} if locked else kernel.kwargs()
    try:
        module = kernels.get_kernel(kernel.repo_id, **pin_kwargs)
        where = "LOCAL_KERNELS" if kernel.repo_id in local_overrides() else "the hub (or its cache)"
    except Exception as exc:  # ValueError (publisher check without network), FileNotFoundError, OSError, ...
        tried.append(f"kernels.get_kernel({kernel.repo_id!r}, {pin_kwargs}): {type(exc).__name__}: {exc}")
        from selector.environment import current_environment

        loc = locate(kernel, current_environment())
        if loc.state == "cached" and loc.path is not None:
            try:
                module = kernels.get_local_kernel(loc.path)
                where = f"the cached snapshot {loc.path}"
            except Exception as exc2:
                tried.append(f"kernels.get_local_kernel({str(loc.path)!r}): {type(exc2).__name__}: {exc2}")
        else:
            tried.append(f"hub cache: {loc.state} ({loc.where()})")
    if module is None:
        raise ImportError(
            f"{who} could not load the hub kernel {kernel}. tried: " + " | ".join(tried) + f". fix: with internet, "
            f"let it download once; without, {_prefetch_remedy(kernel)}; with the kernel cached, set "
            "HF_HUB_OFFLINE=1."
        )
    missing = [name for name in required if resolve_symbol(module, name) is None]
    if missing:
        raise ImportError(
            f"the kernel loaded for {kernel} from {where} lacks {', '.join(missing)}: it is not the API "
            f"{who} was written against. fix: load the pinned version ({kernel.ref}), or check LOCAL_KERNELS."
        )
    _LOADED[kernel] = module
    return module


# --- pre-fetching ----------------------------------------------------------------------------------------


def kernels_pyproject(pins: Iterable[HubKernel] | None = None) -> str:
    """A pyproject.toml that `kernels lock DIR` and `kernels download DIR` understand (version pins only)."""
    lines = [
        "# Hub kernels of selector's backends, for `kernels lock DIR && kernels download DIR`",
        "[project]",
        'name = "selector-kernels"',
        'version = "0"',
        "",
        "[tool.kernels.dependencies]",
    ]
    revisions = []
    for pin in pins if pins is not None else PINS.values():
        if pin.version is not None:
            lines.append(f'"{pin.repo_id}" = {pin.version}')
        else:
            revisions.append(pin)
    lines += [f"# {p.repo_id} is pinned to revision {p.revision}: fetch it with huggingface-cli" for p in revisions]
    return "\n".join(lines) + "\n"


def download(pins: Iterable[HubKernel], variants: Sequence[str] = (), cache_dir: str | None = None) -> list[Path]:
    """On a machine with internet: fetch each pin's build variants (all, or `variants`) into the hub cache.

    Downloads by the pin's branch (vN), so the cache keeps the refs/vN pointer that `kernels.get_kernel(...,
    version=N)` reads offline. Copy the cache directory to the GPU nodes and set HF_HUB_OFFLINE=1 there.
    """
    from huggingface_hub import snapshot_download

    env_cache = os.environ.get("KERNELS_CACHE")
    patterns = [f"build/{v}/*" for v in variants] or ["build/*"]
    paths = []
    for pin in pins:
        path = snapshot_download(
            pin.repo_id,
            repo_type="kernel",
            revision=pin.ref,
            allow_patterns=patterns,
            ignore_patterns=["*.pyc", "**/__pycache__/**"],
            cache_dir=cache_dir or env_cache,
        )
        paths.append(Path(path))
    return paths


def pinned_kernels() -> dict[str, HubKernel]:
    """{backend name: its pin} for every registered backend whose check came from `kernel_check`."""
    from selector.registry import get_registry

    registry = get_registry()
    out = {}
    for name in registry.names:
        pin = getattr(registry.specs[name].check, "hub_kernel", None)
        if isinstance(pin, HubKernel):
            out[name] = pin
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """python -m selector.hub [--debug] [status | pyproject | download [VARIANT ...]].

    status: where each backend's hub kernel is (exit 1 when one cannot be loaded); pyproject: the pins as
    `kernels lock` reads them; download: fetch the pinned kernels into the hub cache (needs internet; a
    failed fetch is one line and exit 1, `--debug` shows the traceback).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"] or ["status"]
    pins = list(dict.fromkeys(pinned_kernels().values())) or list(PINS.values())
    if args[0] == "pyproject":
        sys.stdout.write(kernels_pyproject(pins))
        return 0
    if args[0] == "download":
        try:
            paths = download(pins, variants=args[1:])
        except Exception as exc:  # offline, a missing revision, a full disk: one line with the fix
            if debug:
                raise
            what = " ".join(str(exc).split())[:300].rstrip(".") or type(exc).__name__
            sys.stderr.write(
                f"selector.hub download: {type(exc).__name__}: {what}. This fetches from the Hugging Face Hub: run "
                "it on a machine with internet (HF_HUB_OFFLINE unset), then copy the cache to this one "
                "(docs/offline-kernels.md); --debug shows the traceback\n"
            )
            return 1
        for path in paths:
            sys.stdout.write(f"{path}\n")
        return 0
    if args[0] != "status":
        sys.stderr.write("usage: python -m selector.hub [--debug] [status | pyproject | download [VARIANT ...]]\n")
        return 2
    from selector.environment import current_environment

    env = current_environment()
    broken = 0
    for backend, pin in pinned_kernels().items():
        verdict = kernel_availability(pin, env)
        mark = "ok" if verdict.ok else verdict.status.value
        sys.stdout.write(f"{backend:<18} {mark:<16} {verdict.reason}\n")
        if verdict.found:
            sys.stdout.write(f"{'':<18} found: {verdict.found}\n")
        if verdict.remedy:
            sys.stdout.write(f"{'':<18} fix: {verdict.remedy}\n")
        broken += not verdict.ok
    return 1 if broken else 0


if __name__ == "__main__":  # run the imported module's main: plugins hold selector.hub's classes, not __main__'s
    from selector.hub import main as _main

    raise SystemExit(_main())
