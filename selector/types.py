"""The types every part of selector speaks: what a backend declares, what a layer asks, what the ranking says.

None of these import torch: `selector doctor` must stay fast on a machine where torch takes a second to load.
"""

from __future__ import annotations

import enum
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
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


def _accepts_older_keywords(fold: Callable[[dict[str, Any], dict[str, Any]], None]) -> Callable[[type], type]:
    """Let a dataclass's constructor take the older keywords (its `_older_keywords`) of flags now grouped in
    records: `fold(kwargs, older)` applies them to the records in `kwargs` (those passed too, or the defaults),
    so ``Cls(old_flag=...)`` and ``dataclasses.replace(obj, old_flag=...)`` keep working."""

    def wrap(cls: type) -> type:
        init = cls.__init__
        names = cls._older_keywords  # type: ignore[attr-defined]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            older = {name: kwargs.pop(name) for name in names if name in kwargs}
            if older:
                fold(kwargs, older)
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return wrap


@dataclass(frozen=True)
class CallSupport:
    """How a backend may be called: under torch.compile (which modes, fullgraph), inside CUDA-graph capture, and
    with autograd recording (which inputs its backward differentiates, for which weight formats)."""

    compile_auto: bool = True  # "auto" picks it while torch.compile traces (an explicit request may graph-break)
    # the torch.compile modes it runs and matches eager in (graph breaks allowed); None: every mode, less the
    # CUDA-graph ones unless cuda_graphs (`supported_compile_modes`)
    compile_modes: frozenset[str] | None = None
    fullgraph: bool | None = None  # torch.compile(fullgraph=True) traces it; None: as compile_auto
    cuda_graphs: bool = True  # runs inside CUDA-graph capture (no host synchronisation)
    # the inputs its backward differentiates (GRAD_INPUTS); empty: no backward, refused while autograd records;
    # None: undeclared (a third-party backend from before the field): never refused, its backward is its own
    differentiable: frozenset[str] | None = None
    # the weight formats its backward covers (quantised experts run kernels without one)
    grad_weight_formats: frozenset[str] = frozenset({"dense"})

    def supported_compile_modes(self) -> frozenset[str]:
        """The torch.compile modes the backend declares, or those `cuda_graphs` implies."""
        if self.compile_modes is not None:
            return self.compile_modes
        return frozenset(m for m in COMPILE_MODES if self.cuda_graphs or m not in GRAPH_MODES)

    def traces_fullgraph(self) -> bool:
        """Whether torch.compile(fullgraph=True) traces the backend without a graph break."""
        return self.compile_auto if self.fullgraph is None else self.fullgraph


def _fold_call_support(kwargs: dict[str, Any], older: dict[str, Any]) -> None:
    """BackendSpec's older keywords: compile_compatible is compile_auto, cuda_graph_safe is cuda_graphs, and
    compile_modes / fullgraph / differentiable / grad_weight_formats keep their names."""
    calls = kwargs.get("calls") or CallSupport()
    changes = {name: older[name] for name in ("compile_modes", "fullgraph", "differentiable", "grad_weight_formats")
               if name in older}
    if "cuda_graph_safe" in older:
        changes["cuda_graphs"] = bool(older["cuda_graph_safe"])
    if "compile_compatible" in older:
        changes["compile_auto"] = bool(older["compile_compatible"])
    kwargs["calls"] = replace(calls, **changes)


@dataclass(frozen=True)
class CallMode:
    """How one call runs: traced by torch.compile (in which mode, fullgraph or not), captured in a CUDA graph,
    and what autograd records a gradient for. It describes the call, not the layer."""

    compile: bool = False  # traced by torch.compile
    cuda_graph: bool = False  # captured in a CUDA graph
    compile_mode: str | None = None  # torch.compile's mode where known (one of COMPILE_MODES)
    fullgraph: bool = False  # traced with fullgraph=True: a graph break is an error
    grad_inputs: tuple[str, ...] = ()  # what autograd records a gradient for, in GRAD_INPUTS' order

    @property
    def requires_grad(self) -> bool:
        """Whether the call needs a backward (autograd records and some input or expert weight requires grad)."""
        return bool(self.grad_inputs)


@dataclass(frozen=True)
class GateSupport:
    """The gates a backend runs between its projections: gated layouts (act(gate) * up over gate_up_proj) and/or
    non-gated ones (act(up) over up_proj), the activations, the gates of selector.gates, and whether its torch
    code calls a module's own `_apply_gate` (`custom`)."""

    gated: bool = True  # act(gate) * up over gate_up_proj [E, 2I, H]
    non_gated: bool = False  # act(up) over up_proj [E, I, H] (has_gate False)
    activations: frozenset[str] | None = None  # None: any activation (the module's act_fn is called)
    custom: bool = False  # a module-specific _apply_gate the selector does not recognise is called
    # the gates of selector.gates it runs (closed world); None: act_mul only, or every gate when custom is
    # True (its torch code calls the module's _apply_gate, whatever that computes)
    gates: frozenset[str] | None = None


def _fold_gate_support(kwargs: dict[str, Any], older: dict[str, Any]) -> None:
    """Requirements' older keywords: custom_gate is `custom`, the others keep their names."""
    changes = dict(older)
    if "custom_gate" in changes:
        changes["custom"] = changes.pop("custom_gate")
    kwargs["gating"] = replace(kwargs.get("gating") or GateSupport(), **changes)


def _fold_problem(kwargs: dict[str, Any], older: dict[str, Any]) -> None:
    """Problem's older keywords: activation / custom_gate / gate_source go to its gate (activation, custom,
    source), compile / cuda_graph / compile_mode / fullgraph / grad_inputs to its call mode."""
    gate = {new: older[old] for old, new in (("activation", "activation"), ("custom_gate", "custom"),
                                             ("gate_source", "source")) if old in older}
    if gate:
        kwargs["gate"] = replace(kwargs.get("gate") or DEFAULT_GATE, **gate)
    call = {name: older[name] for name in ("compile", "cuda_graph", "compile_mode", "fullgraph", "grad_inputs")
            if name in older}
    if call:
        if "grad_inputs" in call:
            call["grad_inputs"] = tuple(call["grad_inputs"])
        kwargs["call"] = replace(kwargs.get("call") or CallMode(), **call)


@dataclass(frozen=True)
class ToolkitRule:
    """nvcc needed by GPUs whose compute capability lies in [min_cc, max_cc): e.g. Hopper needs nvcc >= 12.3."""

    min_cc: tuple[int, int]
    max_cc: tuple[int, int] | None
    nvcc: tuple[int, int]
    family: str = ""


@_accepts_older_keywords(_fold_gate_support)
@dataclass(frozen=True)
class Requirements:
    """What a backend needs, declared as data so the ranking can explain every exclusion.

    Closed world: a backend runs only the layouts it declares. The defaults describe the plain layout, gated
    experts with concatenated ``[gate | up]`` weights ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, no
    bias, no custom gate, no post-expert norm, no expert-parallel sentinel ids; a backend whose forward runs
    more sets each flag it really runs to True (docs/plugins.md). A flag left False means "auto" never picks
    the backend for such a layer and an explicit request of it raises ValueError before the forward is called.

    The gate flags are one record, `gating` (GateSupport); the older keywords ``activations=``, ``gated=``,
    ``non_gated=``, ``custom_gate=`` and ``gates=`` are still accepted and read back as properties.
    """

    _older_keywords = ("activations", "gated", "non_gated", "custom_gate", "gates")

    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    min_compute_capability: tuple[int, int] | None = None
    max_compute_capability: tuple[int, int] | None = None  # exclusive
    toolkit: tuple[ToolkitRule, ...] = ()  # empty: no CUDA toolkit needed
    packages: Mapping[str, str] = field(default_factory=dict)  # distribution -> minimum version ("" = any)
    dtypes: frozenset[str] = frozenset(DTYPES)
    weight_formats: frozenset[str] = frozenset({"dense"})
    scale_formats: frozenset[str] = frozenset(SCALE_FORMATS)
    activation_quant: frozenset[str] = frozenset({"dynamic"})
    gating: GateSupport = GateSupport()  # gated / non-gated, activations, gates, a module's own _apply_gate
    bias: bool = False  # gate_up_proj_bias / up_proj_bias [E, 2I] and down_proj_bias [E, H]
    transposed: bool = False  # is_transposed: gate_up_proj [E, H, 2I], down_proj [E, I, H]
    interleaved: bool = False  # is_concatenated False: gate/up channels [g0, u0, g1, u1, ...]
    post_expert_norm: bool = False  # module.post_expert_norm is applied to each expert's output
    expert_parallel: bool = False  # the sentinel expert id (== num_experts) is honoured: it contributes nothing
    needs_process_group: bool = False

    @property
    def activations(self) -> frozenset[str] | None:
        """The older spelling of ``gating.activations``."""
        return self.gating.activations

    @property
    def gated(self) -> bool:
        """The older spelling of ``gating.gated``."""
        return self.gating.gated

    @property
    def non_gated(self) -> bool:
        """The older spelling of ``gating.non_gated``."""
        return self.gating.non_gated

    @property
    def custom_gate(self) -> bool:
        """The older spelling of ``gating.custom``."""
        return self.gating.custom

    @property
    def gates(self) -> frozenset[str] | None:
        """The older spelling of ``gating.gates``."""
        return self.gating.gates


# Requirements(**EVERY_LAYOUT, ...): a backend whose torch code runs every layout of selector.layers (the gate,
# activation and norm between its matmuls, sentinel slots skipped). The older gate keywords (gates=,
# activations=) still combine with it: they apply to its `gating`.
EVERY_LAYOUT: Mapping[str, Any] = {
    "gating": GateSupport(non_gated=True, custom=True),
    "bias": True,
    "transposed": True,
    "interleaved": True,
    "post_expert_norm": True,
    "expert_parallel": True,
}


@_accepts_older_keywords(_fold_problem)
@dataclass(frozen=True)
class Problem:
    """One experts layer as the selector sees it. Built from a module (model API) or from flags (doctor, bench).

    The gate between the projections is one record, `gate` (selector.gates.Gate: the gate, its parameters, the
    activation, a custom `_apply_gate` and its name), and how the layer is called is another, `call` (CallMode:
    torch.compile, CUDA-graph capture, autograd). The older keywords ``activation=``, ``custom_gate=``,
    ``gate_source=``, ``compile=``, ``cuda_graph=``, ``compile_mode=``, ``fullgraph=`` and ``grad_inputs=`` are
    still accepted and read back as properties.
    """

    _older_keywords = ("activation", "custom_gate", "gate_source", "compile", "cuda_graph", "compile_mode",
                       "fullgraph", "grad_inputs")

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    dtype: str = "bfloat16"
    device: str = "cuda"
    device_index: int = 0
    gate: Gate = DEFAULT_GATE  # the gate and its parameters, the activation, a custom _apply_gate
    gated: bool = True
    has_bias: bool = False
    is_transposed: bool = False
    interleaved: bool = False
    post_expert_norm: bool = False
    weight_format: str = "dense"
    scale_format: str | None = None
    activation_quant: str = "dynamic"
    expert_parallel: bool = False
    num_tokens: int | None = None  # None: unknown (rank for a typical mix)
    call: CallMode = CallMode()  # torch.compile, CUDA-graph capture, autograd

    @property
    def activation(self) -> str:
        """The older spelling of ``gate.activation``."""
        return self.gate.activation

    @property
    def custom_gate(self) -> bool:
        """The older spelling of ``gate.custom``."""
        return self.gate.custom

    @property
    def gate_source(self) -> str:
        """The older spelling of ``gate.source``."""
        return self.gate.source

    @property
    def compile(self) -> bool:
        """The older spelling of ``call.compile``."""
        return self.call.compile

    @property
    def cuda_graph(self) -> bool:
        """The older spelling of ``call.cuda_graph``."""
        return self.call.cuda_graph

    @property
    def compile_mode(self) -> str | None:
        """The older spelling of ``call.compile_mode``."""
        return self.call.compile_mode

    @property
    def fullgraph(self) -> bool:
        """The older spelling of ``call.fullgraph``."""
        return self.call.fullgraph

    @property
    def grad_inputs(self) -> tuple[str, ...]:
        """The older spelling of ``call.grad_inputs``."""
        return self.call.grad_inputs

    @property
    def requires_grad(self) -> bool:
        """The older spelling of ``call.requires_grad``."""
        return self.call.requires_grad

    def _identity(self) -> tuple[Any, ...]:
        """Every field, and the gate's layer facts its own equality leaves out (activation, custom, source)."""
        gate = self.gate
        return (*(getattr(self, f.name) for f in fields(self)), gate.activation, gate.custom, gate.source)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._identity() == other._identity()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._identity())

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
            ("custom gate", self.gate.custom),
            ("post-norm", self.post_expert_norm),
        )
        flags = [name for name, on in layout if on]
        act = self.gate.describe()  # the activation, or a gate with its parameters
        text = f"E={self.num_experts} H={self.hidden_size} I={self.intermediate_size} k={self.top_k} {self.dtype} {act}"
        text += f" on {self.device}"
        if tokens:
            text += " T=?" if self.num_tokens is None else f" T={self.num_tokens}"
        if self.weight_format != "dense":
            text += f" {self.weight_format}/{self.scale_format}"
        return text + (f" ({', '.join(flags)})" if flags else "")

    def to_dict(self) -> dict[str, Any]:
        """The flat layout JSON reports have always written (schema-stable): the gate's and the call's flags
        at the top level under their older names, `gate` with its name and parameters only."""
        data = asdict(self)
        gate, call = data.pop("gate"), data.pop("call")
        out: dict[str, Any] = {}
        for name, value in data.items():
            out[name] = value
            if name == "device_index":
                out["activation"] = gate["activation"]
            elif name == "interleaved":
                out["custom_gate"] = gate["custom"]
                out["gate"] = {"name": gate["name"], "alpha": gate["alpha"], "limit": gate["limit"]}
                out["gate_source"] = gate["source"]
            elif name == "num_tokens":
                out.update(call)
        return out


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
    "tuned" (tuned on this node), "nearest" (neither: borrowed from the nearest shape a table holds) or
    "heuristic" (built-in defaults) — for these two the core tells the user once, with the command that tunes the
    shape; "" for a backend without tunable kernels.
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


@_accepts_older_keywords(_fold_call_support)
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
    `calls` says how it may be called (torch.compile, CUDA-graph capture, autograd); the older keywords
    ``compile_compatible=``, ``cuda_graph_safe=``, ``compile_modes=``, ``fullgraph=``, ``differentiable=`` and
    ``grad_weight_formats=`` are still accepted and read back as properties.
    """

    _older_keywords = ("compile_compatible", "cuda_graph_safe", "compile_modes", "fullgraph", "differentiable",
                       "grad_weight_formats")

    name: str
    load: Callable[[], ExpertsForward]
    requirements: Requirements = field(default_factory=Requirements)
    description: str = ""
    check: Callable[[Problem, Environment], Availability | None] | None = None
    estimate: Callable[[Problem, Environment], float] | None = None
    calls: CallSupport = CallSupport()  # torch.compile modes, fullgraph, CUDA graphs, autograd
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

    @property
    def compile_compatible(self) -> bool:
        """The older spelling of ``calls.compile_auto``."""
        return self.calls.compile_auto

    @property
    def cuda_graph_safe(self) -> bool:
        """The older spelling of ``calls.cuda_graphs``."""
        return self.calls.cuda_graphs

    @property
    def compile_modes(self) -> frozenset[str] | None:
        """The older spelling of ``calls.compile_modes``."""
        return self.calls.compile_modes

    @property
    def fullgraph(self) -> bool | None:
        """The older spelling of ``calls.fullgraph``."""
        return self.calls.fullgraph

    @property
    def differentiable(self) -> frozenset[str] | None:
        """The older spelling of ``calls.differentiable``."""
        return self.calls.differentiable

    @property
    def grad_weight_formats(self) -> frozenset[str]:
        """The older spelling of ``calls.grad_weight_formats``."""
        return self.calls.grad_weight_formats

    def supported_compile_modes(self) -> frozenset[str]:
        """The older spelling of ``calls.supported_compile_modes()``."""
        return self.calls.supported_compile_modes()

    def traces_fullgraph(self) -> bool:
        """The older spelling of ``calls.traces_fullgraph()``."""
        return self.calls.traces_fullgraph()

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
