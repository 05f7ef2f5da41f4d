"""What every adapter of another library's MoE kernel shares, so each adapter is about one page of its own.

Declaring (no torch: `selector doctor` reads it without loading a kernel):
- `Package` and `package_verdict`: the Python packages a kernel needs beside the ones `Requirements.packages`
  lists, judged from the probe facts (SELECTOR_PACKAGE_<NAME> overrides), with the install command as the fix;
- `declare`, `backends_hook`: the declaration (`load` and `prepare` from the adapter's forward module) and
  the plugin hook; `packages_check`, `steady_estimate`, `UNTRACED`: the check, estimate and flags most share;
- `FirstCalls`: which layer shapes already paid their first-call cost (JIT compile, autotune) in this process,
  which `pending_cost` reads; `shape_key` is the ledger's key, read off the `Problem`;
- `Library`: the lazy import of the library, an ImportError naming the package, the version and the fix.

Running (torch imported inside the functions only):
- `KernelPlan`: the frozen plan `BackendSpec.prepare` returns; the weights in the kernel's layout are converted
  once at prepare time (`KernelPlan.prepared`), or per run where autograd records the experts' weights'
  gradient (a kept copy would cut it). The module is held weakly: the plan lives in the module's own cache.
  A subclass adds what its kernel reads and `launch`; `run` does the rest (no tokens, the ledger).
- `kernel_routing`: the routing guard and the int32 ids / float32 weights the kernels read, sentinels to expert 0;
- `forward_of(prepare)`: the `load()` forward of a backend that prepares plans (prepare, then run, every call).
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from selector.probes import Environment, probe_packages

from selector import Availability, BackendSpec, Requirements, Status, hookimpl, hub
from selector.costmodel import floor_seconds
from selector.requirements import version_tuple
from selector.types import CallMode, CallSupport, ExpertsForward, ExpertsPlan, Problem

if TYPE_CHECKING:  # only for annotations
    import torch

T = TypeVar("T")


# --- declaring ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Package:
    """A Python distribution a kernel needs, at least `minimum` ("" = any version)."""

    name: str
    minimum: str = ""
    why: str = ""  # what the kernel needs it for, in the reason
    doc: str = ""  # the offline-install section, in the fix

    def install(self, upgrade: bool = False) -> str:
        """The pip command that fixes a missing (or, `upgrade`, too old) package."""
        command = f"pip install {'-U ' if upgrade else ''}'{self.name}{'>=' + self.minimum if self.minimum else ''}'"
        return command + (f" (offline nodes: {self.doc})" if self.doc else "")

    def verdict(self, env: Environment) -> Availability | None:
        """None when installed and new enough: the environment's facts, else a probe of this one package."""
        facts = env.package(self.name) or probe_packages((self.name,))[0]
        why = f" ({self.why})" if self.why else ""
        if facts.version is None:
            return Availability(
                Status.MISSING_PACKAGE,
                f"needs the Python package {self.name!r}{' >= ' + self.minimum if self.minimum else ''}{why}, which "
                "is not installed",
                self.install(),
                found=f"{self.name}: not found ({facts.source})",
            )
        if self.minimum and version_tuple(facts.version) < version_tuple(self.minimum):
            return Availability(
                Status.PACKAGE_TOO_OLD,
                f"needs {self.name} >= {self.minimum}{why}; {facts.version} is installed",
                self.install(upgrade=True),
                found=f"{self.name} {facts.version} ({facts.source})",
            )
        return None


def package_verdict(packages: Iterable[Package], env: Environment) -> Availability | None:
    """The first package that is missing or too old, or None."""
    for package in packages:
        verdict = package.verdict(env)
        if verdict is not None:
            return verdict
    return None


def packages_check(packages: Sequence[Package]) -> Callable[[Problem, Environment], Availability | None]:
    """A `BackendSpec.check` that judges these packages only."""
    return lambda problem, env: package_verdict(packages, env)


def steady_estimate(host_seconds: float, efficiency: float, pending: Callable[[Problem, Environment], float]
                    ) -> Callable[[Problem, Environment], float]:  # fmt: skip
    """A `BackendSpec.estimate`: max(host time per call, `efficiency` x the floor), plus the one-time cost still
    ahead (`pending`) spread over SELECTOR_JIT_AMORTIZE_CALLS calls."""

    def estimate(problem: Problem, env: Environment) -> float:
        steady = max(host_seconds, efficiency * floor_seconds(problem, env))
        return steady + pending(problem, env) / hub.amortize_calls()

    return estimate


def declare(name: str, forward: str, requirements: Requirements, **fields: Any) -> BackendSpec:
    """The declaration of backend `name` whose module `forward` (imported on first use) defines `load()` and
    `prepare(module, problem)`; `fields`: the rest of `BackendSpec`."""
    return BackendSpec(name=name, load=lazy(forward, "load"), prepare=lazy(forward, "prepare"),
                       requirements=requirements, **fields)  # fmt: skip


def backends_hook(*specs: BackendSpec) -> Callable[[], Sequence[BackendSpec]]:
    """The `selector_backends` hook of a plugin module that declares these backends:
    `selector_backends = backends_hook(SPEC)`."""

    @hookimpl
    def selector_backends() -> Sequence[BackendSpec]:
        return list(specs)

    return selector_backends


# BackendSpec(calls=replace(UNTRACED_CALLS, differentiable=...)): run neither under torch.compile nor inside CUDA-graph capture
# (until verified). The older BackendSpec(**UNTRACED, differentiable=...) still works: UNTRACED maps "calls".
UNTRACED_CALLS = CallSupport(compile_auto=False, compile_modes=frozenset(), fullgraph=False, cuda_graphs=False)
UNTRACED: Mapping[str, Any] = {"calls": UNTRACED_CALLS}


def shape_key(problem: Problem, names: Sequence[str]) -> tuple:
    """The ledger key of a layer: the `Problem` fields its kernel compiles or tunes per (same for the estimate,
    which reads the ranking's problem, and the plan, which reads the problem it was prepared for)."""
    return tuple(getattr(problem, name) for name in names)


class FirstCalls:
    """The keys (layer shapes, architectures) whose one-time cost this process already paid: a plan records its
    key after the kernel ran, the estimate reads `pending`. In-process only: a library's disk cache is not seen."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds  # the cost still ahead of a key not paid yet
        self._paid: set[Hashable] = set()

    def record(self, key: Hashable) -> None:
        self._paid.add(key)

    def paid(self, key: Hashable) -> bool:
        return key in self._paid

    def pending(self, key: Hashable) -> float:
        """Seconds of one-time work still ahead of `key`: 0 once it ran here."""
        return 0.0 if key in self._paid else self.seconds

    def forget(self) -> None:
        self._paid.clear()


def lazy(module: str, name: str) -> Callable[..., Any]:
    """`module.name`, imported when first called: declaring a backend imports neither torch nor its kernel."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class Library(Generic[T]):
    """A kernel library imported on first use and kept: `get()` imports it (an ImportError naming the backend,
    what it needs and the fix when that fails), `forget()` drops it (tests swap fakes in)."""

    def __init__(self, backend: str, needs: str, install: str, bind: Callable[[Callable[[str], Any]], T]) -> None:
        self.backend = backend
        self.needs = needs  # e.g. "liger-kernel >= 0.8.5 with liger_kernel.ops.fused_moe.LigerFusedMoEFunction"
        self.install = install
        self.bind = bind  # import_module -> the entry points the adapter calls
        self._loaded: T | None = None

    def get(self) -> T:
        if self._loaded is None:
            try:
                self._loaded = self.bind(importlib.import_module)
            except (ImportError, AttributeError) as exc:
                raise ImportError(
                    f"experts backend {self.backend!r} needs {self.needs}; importing it failed "
                    f"({type(exc).__name__}: {exc}). fix: {self.install}"
                ) from exc
        return self._loaded

    def forget(self) -> None:
        self._loaded = None


# --- running -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class KernelPlan(ExpertsPlan):
    """A plan of another library's kernel: its weights in the kernel's layout, its ledger key, the module weakly.

    `weights`: converted once at prepare time; None where the call differentiates the experts' weights, then
    `convert` builds them on each run, on the autograd tape. Subclasses add what their kernel reads and `launch`.
    """

    module: weakref.ref
    convert: Callable[[torch.nn.Module], tuple]
    weights: tuple | None
    ledger: FirstCalls | None = None  # where a run records that this layer's first call was paid
    shape: Hashable = None  # the ledger's key of this layer

    @classmethod
    def prepared(cls, module: torch.nn.Module, convert: Callable[[torch.nn.Module], tuple], per_run: bool,
                 **fields: Any) -> KernelPlan:  # fmt: skip
        """The plan with the weights converted now (under no_grad), or on each run where `per_run`
        (`differentiates_weights(problem)`, so the gradient reaches the parameters)."""
        import torch

        weights = None
        if not per_run:
            with torch.no_grad():
                weights = convert(module)
        return cls(module=weakref.ref(module), convert=convert, weights=weights, **fields)

    def layer(self) -> torch.nn.Module:
        """The module this plan was prepared for (its gate, guard tag and expert-parallel flag are read per run)."""
        module = self.module()
        if module is None:
            raise RuntimeError(f"experts backend {self.backend!r}: the module this plan was prepared for is gone")
        return module

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if top_k_index.shape[0] == 0:
            return hidden_states.new_zeros(0, hidden_states.shape[-1])
        module = self.layer()
        weights = self.weights if self.weights is not None else self.convert(module)
        out = self.launch(module, weights, hidden_states, top_k_index, top_k_weights)
        if self.ledger is not None:
            self.ledger.record(self.shape)
        return out

    def launch(self, module: torch.nn.Module, weights: tuple, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The kernel's call for T > 0 tokens: hidden [T, H], ids and routing weights [T, k] -> [T, H]."""
        raise NotImplementedError(f"{type(self).__name__}.launch")


def differentiates_weights(problem: Problem) -> bool:
    """Whether the call records a gradient for the experts' weights (a kept copy of them would cut it)."""
    return "expert_weights" in problem.call.grad_inputs


def kernel_routing(
    module: torch.nn.Module,
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [T, k] int32, weights [T, k] float32
    """What a fused kernel reads: bad slots to expert 0 with weight NaN (the routing guard, so no kernel reads an
    expert out of bounds), expert-parallel sentinel slots to expert 0 with weight 0, int32 ids, float32 weights."""
    import torch

    import selector.plugins.triton_common.guard  # noqa: F401 - registers the one-launch sanitiser
    from selector import layers
    from selector.guard import sanitize_routing

    ids, weights = sanitize_routing(module, top_k_index, top_k_weights)
    ids, weights = ids.to(torch.int32), weights.float()
    if layers.is_expert_parallel(module):
        sentinel = ids >= module.num_experts
        ids, weights = ids.masked_fill(sentinel, 0), weights.masked_fill(sentinel, 0.0)
    return ids, weights


def call_problem(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> Problem:  # fmt: skip
    """The problem of one direct forward call (no dispatch core): the module's layout, its k and what autograd
    records, read off the module without writing to it."""
    import torch

    from selector.dispatch import grad_inputs
    from selector.problem import problem_from_module

    problem = problem_from_module(module, top_k=int(top_k_index.shape[1]))
    recorded = grad_inputs(module, hidden_states, top_k_weights)
    call = CallMode(compile=torch.compiler.is_compiling(), grad_inputs=recorded)
    return replace(problem, call=call)


def forward_of(prepare: Callable[[torch.nn.Module, Problem], ExpertsPlan]) -> ExpertsForward:
    """The `load()` forward of a backend that prepares plans: prepare for this call, then run. Used while
    torch.compile traces and by direct callers; the dispatch core keeps the plan instead."""

    def forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        plan = prepare(module, call_problem(module, hidden_states, top_k_index, top_k_weights))
        return plan.run(hidden_states, top_k_index, top_k_weights)

    forward.__name__ = forward.__qualname__ = f"{getattr(prepare, '__name__', 'prepare')}_forward"
    return forward


def refuse_unless_silu_gated(module: torch.nn.Module, backend: str, runs: str, instead: str) -> None:
    """ValueError for a layer a fused SiLU-gated kernel has no path for (the dispatch core never sends one: closed
    world); `runs` says what the kernel runs, `instead` the backends to pick."""
    from selector.problem import activation_name, has_custom_gate

    act = activation_name(getattr(module, "act_fn", None))
    what = None
    if not getattr(module, "has_gate", True):
        what = "non-gated experts"
    elif has_custom_gate(module):
        what = "a custom gate function"
    elif act != "silu":
        what = f"the activation {act!r}"
    elif getattr(module, "has_bias", False):
        what = "expert biases"
    elif getattr(module, "has_post_expert_norm", False):
        what = "a post-expert norm"
    if what is not None:
        raise ValueError(
            f"experts backend {backend!r} cannot run {what}: {runs}. fix: pick another experts backend for this "
            f"layer, e.g. {instead}."
        )


__all__ = [
    "UNTRACED", "UNTRACED_CALLS", "FirstCalls", "KernelPlan", "Library", "Package", "declare", "backends_hook", "call_problem",
    "differentiates_weights", "forward_of", "kernel_routing", "lazy", "package_verdict", "packages_check",
    "refuse_unless_silu_gated", "shape_key", "steady_estimate",
]  # fmt: skip
