"""The types every part of selector speaks: what a backend declares, what a layer asks, what the ranking says.

None of these import torch: `selector doctor` must stay fast on a machine where torch takes a second to load.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from selector.gates import DEFAULT_GATE, Gate

if TYPE_CHECKING:  # only for annotations
    import torch

    from selector.probes import Environment


class ExpertsForward(Protocol):
    """Transformers' experts function: ``fn(module, hidden_states[T,H], top_k_index[T,k], top_k_weights[T,k]) -> [T,H]``."""

    def __call__(
        self,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor: ...


class Status(str, enum.Enum):
    """Why a backend can or cannot run. `ok` is the only runnable status."""

    OK = "ok"
    MISSING_PACKAGE = "missing_package"
    PACKAGE_TOO_OLD = "package_too_old"
    UNSUPPORTED_DEVICE = "unsupported_device"
    UNSUPPORTED_HARDWARE = "unsupported_hardware"
    TOOLKIT_MISSING = "toolkit_missing"
    TOOLKIT_TOO_OLD = "toolkit_too_old"
    UNSUPPORTED_CONFIG = "unsupported_config"
    DENIED_BY_CONFIG = "denied_by_config"
    PLUGIN_ERROR = "plugin_error"

    @property
    def error_type(self) -> type[Exception]:
        """The exception an explicit request raises: something missing -> ImportError, a bad config -> ValueError."""
        if self in (Status.UNSUPPORTED_CONFIG, Status.DENIED_BY_CONFIG):
            return ValueError
        return ImportError


@dataclass(frozen=True)
class Availability:
    """A verdict with its reason and the fix; never a bare bool."""

    status: Status
    reason: str = ""
    remedy: str = ""
    found: str = ""  # what was found and where it was looked for, for error messages

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def to_dict(self) -> dict[str, str]:
        return {"status": self.status.value, "reason": self.reason, "remedy": self.remedy, "found": self.found}


AVAILABLE = Availability(Status.OK)

WEIGHT_FORMATS = ("dense", "fp8_block", "fp4")
SCALE_FORMATS = ("float32", "ue8m0")
DTYPES = ("float32", "bfloat16", "float16")
# torch.compile's modes; the first and the last run without CUDA graphs, the middle two capture them
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})
# what a backward can differentiate: the layer's input, the router's top-k weights, the experts' weights
GRAD_INPUTS = ("hidden_states", "routing_weights", "expert_weights")


@dataclass(frozen=True)
class ToolkitRule:
    """nvcc needed by GPUs whose compute capability lies in [min_cc, max_cc): e.g. Hopper needs nvcc >= 12.3."""

    min_cc: tuple[int, int]
    max_cc: tuple[int, int] | None
    nvcc: tuple[int, int]
    family: str = ""


@dataclass(frozen=True)
class Requirements:
    """What a backend needs, declared as data so the ranking can explain every exclusion.

    Closed world: a backend runs only the layouts it declares. The defaults describe the plain layout, gated
    experts with concatenated ``[gate | up]`` weights ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, no
    bias, no custom gate, no post-expert norm, no expert-parallel sentinel ids; a backend whose forward runs
    more sets each flag it really runs to True (docs/plugins.md). A flag left False means "auto" never picks
    the backend for such a layer and an explicit request of it raises ValueError before the forward is called.
    """

    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    min_compute_capability: tuple[int, int] | None = None
    max_compute_capability: tuple[int, int] | None = None  # exclusive
    toolkit: tuple[ToolkitRule, ...] = ()  # empty: no CUDA toolkit needed
    packages: Mapping[str, str] = field(default_factory=dict)  # distribution -> minimum version ("" = any)
    dtypes: frozenset[str] = frozenset(DTYPES)
    weight_formats: frozenset[str] = frozenset({"dense"})
    scale_formats: frozenset[str] = frozenset(SCALE_FORMATS)
    activation_quant: frozenset[str] = frozenset({"dynamic"})
    activations: frozenset[str] | None = None  # None: any activation (the module's act_fn is called)
    gated: bool = True  # act(gate) * up over gate_up_proj [E, 2I, H]
    non_gated: bool = False  # act(up) over up_proj [E, I, H] (has_gate False)
    bias: bool = False  # gate_up_proj_bias / up_proj_bias [E, 2I] and down_proj_bias [E, H]
    transposed: bool = False  # is_transposed: gate_up_proj [E, H, 2I], down_proj [E, I, H]
    interleaved: bool = False  # is_concatenated False: gate/up channels [g0, u0, g1, u1, ...]
    custom_gate: bool = False  # a module-specific _apply_gate the selector does not recognise is called
    # the gates of selector.gates it runs (closed world); None: act_mul only, or every gate when custom_gate is
    # True (its torch code calls the module's _apply_gate, whatever that computes)
    gates: frozenset[str] | None = None
    post_expert_norm: bool = False  # module.post_expert_norm is applied to each expert's output
    expert_parallel: bool = False  # the sentinel expert id (== num_experts) is honoured: it contributes nothing
    needs_process_group: bool = False


# Requirements(**EVERY_LAYOUT, ...): a backend whose torch code runs every layout of selector.layers (the gate,
# activation and norm between its matmuls, sentinel slots skipped).
EVERY_LAYOUT: Mapping[str, bool] = {
    "non_gated": True,
    "bias": True,
    "transposed": True,
    "interleaved": True,
    "custom_gate": True,
    "post_expert_norm": True,
    "expert_parallel": True,
}


@dataclass(frozen=True)
class Problem:
    """One experts layer as the selector sees it. Built from a module (model API) or from flags (doctor, bench)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    dtype: str = "bfloat16"
    device: str = "cuda"
    device_index: int = 0
    activation: str = "silu"
    gated: bool = True
    has_bias: bool = False
    is_transposed: bool = False
    interleaved: bool = False
    custom_gate: bool = False  # an _apply_gate that is not a gate of selector.gates: only torch code runs it
    gate: Gate = DEFAULT_GATE  # the recognised gate and its parameters (activation names act_mul's act)
    gate_source: str = ""  # a custom gate's function (e.g. "MyExperts._apply_gate"), named in the reasons
    post_expert_norm: bool = False
    weight_format: str = "dense"
    scale_format: str | None = None
    activation_quant: str = "dynamic"
    expert_parallel: bool = False
    num_tokens: int | None = None  # None: unknown (rank for a typical mix)
    compile: bool = False  # traced by torch.compile
    cuda_graph: bool = False  # captured in a CUDA graph
    compile_mode: str | None = None  # torch.compile's mode where known (one of COMPILE_MODES)
    fullgraph: bool = False  # traced with fullgraph=True: a graph break is an error
    grad_inputs: tuple[str, ...] = ()  # what autograd records a gradient for, in GRAD_INPUTS' order

    @property
    def requires_grad(self) -> bool:
        """Whether the call needs a backward (autograd records and some input or expert weight requires grad)."""
        return bool(self.grad_inputs)

    def with_tokens(self, num_tokens: int | None) -> Problem:
        return replace(self, num_tokens=num_tokens)

    def describe(self, tokens: bool = True) -> str:
        """The layer in one line, as reports and logs show it:
        "E=.. H=.. I=.. k=.. dtype activation on device [T=..] [format/scales] (layout flags)"."""
        layout = (
            ("non-gated", not self.gated),
            ("bias", self.has_bias),
            ("transposed", self.is_transposed),
            ("interleaved", self.interleaved),
            ("custom gate", self.custom_gate),
            ("post-norm", self.post_expert_norm),
        )
        flags = [name for name, on in layout if on]
        act = self.activation if self.gate.is_default else self.gate.label()  # a gate with its parameters
        text = f"E={self.num_experts} H={self.hidden_size} I={self.intermediate_size} k={self.top_k} {self.dtype} {act}"
        text += f" on {self.device}"
        if tokens:
            text += " T=?" if self.num_tokens is None else f" T={self.num_tokens}"
        if self.weight_format != "dense":
            text += f" {self.weight_format}/{self.scale_format}"
        return text + (f" ({', '.join(flags)})" if flags else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GraphPolicy:
    """Calls a plan lets the dispatch core replay from recorded CUDA graphs (selector.graphs): up to `max_tokens`
    tokens, outside autograd, torch.compile and a caller's own capture, unless the setting `variable` is 0."""

    max_tokens: int
    variable: str


@dataclass(frozen=True, kw_only=True)
class ExpertsPlan:
    """What a backend read off one experts module for one kind of call, once: the weights in its kernel's layout,
    the gate, the guard code, its tile choice, format records. `run` is all that happens per call.

    A backend returns one from `BackendSpec.prepare(module, problem)`; the dispatch core keeps it per module under a
    key that covers the weights (storage and in-place version), the layout and the call mode (`problem`: autograd,
    CUDA-graph capture, torch.compile), so `run` asks none of those again. A plan that holds no module state of its
    own (a subclass adds frozen fields) must not write to the module either: the core's cache is the only one.

    `graphs`: where the core may replay `run` from recorded CUDA graphs (the plan's launches must not synchronise
    the host, and `run` must depend on nothing but its arguments and the plan). `opaque_when_compiled`: under
    torch.compile without autograd, the core runs the plan eagerly inside its opaque op rather than tracing it.
    `tiles`: where its kernel parameters come from, for a backend that has any: "table" (shipped for this GPU),
    "tuned" (tuned on this node), "heuristic" (neither: the core tells the user once, with the command that tunes
    the shape); "" for a backend without tunable kernels.
    """

    backend: str
    graphs: GraphPolicy | None = None
    opaque_when_compiled: bool = False
    tiles: str = ""

    def run(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        top_k_index: torch.Tensor,  # [T, k]
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H]
        raise NotImplementedError(f"{type(self).__name__}.run")


@dataclass(frozen=True, kw_only=True)
class ForwardPlan(ExpertsPlan):
    """The plan of a backend that declares only a forward (`BackendSpec.load`): its forward called on the module.

    The module is held weakly: the plan lives in the module's own cache, and a strong reference would make a cycle.
    """

    forward: ExpertsForward
    module: weakref.ref

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        module = self.module()
        if module is None:
            raise RuntimeError(f"experts backend {self.backend!r}: the module this plan was prepared for is gone")
        return self.forward(module, hidden_states, top_k_index, top_k_weights)


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin declares for one backend.

    `load` imports the implementation only when it runs, so listing and ranking backends stays cheap.
    `check` covers what `requirements` cannot say; it returns None when it has nothing against the problem.
    `estimate` returns a relative cost (lower is faster) used to order the runnable backends.
    `format_loads` names the forward for each quantised weight format the backend runs with another function
    than its dense one (`requirements.weight_formats` lists which formats it runs at all): the dispatch core
    picks (backend, format) -> forward once per module, so no forward branches on the format per call.
    `prepare(module, problem)` turns a module into an `ExpertsPlan` once per weights and call mode (the problem
    says which format, layout, autograd, capture and compile); without it, or where it returns None for a problem,
    the plan calls the loaded forward (`ForwardPlan`), so a backend that declares only `load` keeps working.
    """

    name: str
    load: Callable[[], ExpertsForward]
    requirements: Requirements = field(default_factory=Requirements)
    description: str = ""
    check: Callable[[Problem, Environment], Availability | None] | None = None
    estimate: Callable[[Problem, Environment], float] | None = None
    compile_compatible: bool = True  # "auto" picks it while torch.compile traces
    cuda_graph_safe: bool = True  # runs inside CUDA-graph capture (no host synchronisation)
    # the torch.compile modes it runs and matches eager in (graph breaks allowed); None: every mode, less the
    # CUDA-graph ones unless cuda_graph_safe (`supported_compile_modes`)
    compile_modes: frozenset[str] | None = None
    fullgraph: bool | None = None  # torch.compile(fullgraph=True) traces it; None: as compile_compatible
    # the inputs its backward differentiates (GRAD_INPUTS); empty: no backward, refused while autograd records;
    # None: undeclared (a third-party backend from before the field): never refused, its backward is its own
    differentiable: frozenset[str] | None = None
    # the weight formats its backward covers (quantised experts run kernels without one)
    grad_weight_formats: frozenset[str] = frozenset({"dense"})
    first_call_cost: str = ""  # e.g. "JIT-compiles 25-144 s on the first call of a shape"
    url: str = ""
    format_loads: Mapping[str, Callable[[], ExpertsForward]] = field(default_factory=dict)
    # seconds of one-time work (JIT compile, download) still ahead in this process before the backend runs
    # `problem` at its steady speed; added to a measured time, spread over SELECTOR_JIT_AMORTIZE_CALLS calls
    pending_cost: Callable[[Problem, Environment], float] | None = None
    # tunes the backend's kernel parameters (tiles) for `problem` at these token counts on this GPU within a
    # budget of seconds, keeps them where the backend finds them, and returns a summary for `selector tune`
    tune_kernels: Callable[[Problem, Sequence[int], float], Mapping[str, Any]] | None = None
    prepare: Callable[[torch.nn.Module, Problem], ExpertsPlan | None] | None = None

    def supported_compile_modes(self) -> frozenset[str]:
        """The torch.compile modes the backend declares, or those its older flags imply."""
        if self.compile_modes is not None:
            return self.compile_modes
        return frozenset(m for m in COMPILE_MODES if self.cuda_graph_safe or m not in GRAPH_MODES)

    def traces_fullgraph(self) -> bool:
        """Whether torch.compile(fullgraph=True) traces the backend without a graph break."""
        return self.compile_compatible if self.fullgraph is None else self.fullgraph

    def loader(self, weight_format: str = "dense") -> Callable[[], ExpertsForward]:
        """What imports the forward this backend runs for `weight_format`."""
        return self.format_loads.get(weight_format, self.load)


@dataclass(frozen=True)
class Candidate:
    """A runnable backend, with the cost estimate it was ordered by."""

    name: str
    estimate: float  # seconds per call the order used: measured (plus one-time cost still ahead) or estimated
    pinned: bool = False
    preferred: bool = False
    source: str = "estimate"  # "measured" (the tuning store's time for this problem) or "estimate" (static)
    measured_tokens: int | None = None  # the token count the measurement was taken at
    spread: float | None = None  # the measurement's relative spread over its rounds


@dataclass(frozen=True)
class Ranking:
    """The ordered candidates for one problem, and every backend left out with its reason.

    `verdicts`: every registered backend's verdict on this machine, config aside (what an explicit request of
    it gets, and what `selector doctor` shows); `excluded` adds what the config denies.
    """

    problem: Problem
    candidates: tuple[Candidate, ...]
    excluded: Mapping[str, Availability]
    verdicts: Mapping[str, Availability] = field(default_factory=dict)

    @property
    def best(self) -> str | None:
        return self.candidates[0].name if self.candidates else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "problem": self.problem.to_dict(),
            "candidates": [asdict(c) for c in self.candidates],
            "excluded": {name: a.to_dict() for name, a in self.excluded.items()},
        }
