"""The dispatch core: which backend runs an experts module's call, and running it.

Everything that runs experts goes through here: the decorator API (`selector.model`), the Transformers
adapter (`selector.hf`), `selector bench` and the tests. Its public functions are the only way in; the
per-module state it keeps (the request, the backend that ran last, and the one cache: `ModuleCache`) lives in
the module's `__dict__` under names nobody else reads, and nobody else writes there.

An eager call is a pipeline with named stages, each decided once per key:
1. **choose**: for the module, its call mode (autograd, capture, compile) and token bucket, which backend
   (`choose_backend`: the module's request, or auto's ranking, measured else estimated);
2. **prepare**: the backend turns the module into an `ExpertsPlan` (`BackendSpec.prepare`, or `ForwardPlan` around
   its forward), once per key: the weights' fingerprint (storage and in-place version of every parameter and buffer),
   the layout, the validation level and the call mode;
3. **run**: `plan.run(hidden, ids, weights)`, or, where the plan's `GraphPolicy` allows, its replay from a CUDA graph
   recorded here (selector.graphs): the core never calls back into a plugin.

- `run_experts(module, hidden_states, top_k_index, top_k_weights)`: validate, choose, run. Under torch.compile
  "auto" without autograd runs as one opaque op, `selector::experts`, whose implementation is this eager path:
  the choice per token bucket and the backends' own CUDA graphs happen at run time (docs/design/compile.md).
- `grad_inputs(module, hidden_states, top_k_weights)`: what autograd differentiates in a call.
- `choose_backend(...)`: the backend for one call (a name the module asked for, or "auto"'s pick per
  token-count bucket). A named backend that cannot run raises ImportError / ValueError naming the fix.
- `backend_forward(name, weight_format)`: the forward a backend declared for that weight format, loaded
  once (what torch.compile traces). `backend_runner(name)`: a forward that runs the backend's prepared plan as
  the core does (what bench and tune time).
- `last_backend(module)`, `requested_implementation(module)`, `set_requested_implementation(...)`.
- `problem_of(module, top_k)`, `rank_problem(problem)`, `explain_module(module, ...)`: what the choice saw.
"""

from __future__ import annotations

import itertools
import logging
import warnings
import weakref
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from selector import graphs, guard, layers, settings
from selector.config import SelectorConfig, load_config
from selector.environment import current_environment
from selector.errors import ExpertsInputError, unavailable_error
from selector.problem import problem_from_module
from selector.ranking import rank
from selector.registry import Registry, get_registry
from selector.requirements import evaluate
from selector.tuning import measured_for
from selector.tuning_store import tuning_table
from selector.types import (
    Availability,
    CallMode,
    ExpertsForward,
    ExpertsPlan,
    ForwardPlan,
    GraphPolicy,
    Problem,
    Ranking,
    Status,
)
from selector.validation import validate_inputs, validation_level

AUTO = "auto"
# A backend's forward with this attribute set to True runs, under torch.compile and without autograd, through the
# opaque `selector::experts` like auto does: its eager call (its own recorded CUDA graphs) beats what inductor
# makes of its trace. A forward that replays graphs of its own sets it.
OPAQUE_WHEN_COMPILED = "selector_opaque_when_compiled"

# Per-module state, in the module's __dict__ (plain attributes would be registered as submodule state).
_REQUEST = "_selector_implementation"  # what the user asked for this module
_LAST = "_selector_last_backend"  # the backend that ran the last forward
_TOP_K = "_selector_top_k"  # k of the last eager forward: what a choice made under torch.compile uses
_UID = "_selector_uid"
_OWNER = "_selector_uid_owner"  # id() of the module the uid was given to: a deep copy keeps the uid, not the id
_CACHE = "_selector_cache"  # the one per-module cache (ModuleCache), written here alone
# Older backends kept what they read off a module under this prefix; forget_module still drops such keys.
MODULE_CACHE_PREFIX = "_selector_cached_"
PLANS_PER_MODULE = 64  # (request, bucket, call mode) plans kept per set of weights; all dropped beyond


class ModuleCache:
    """What dispatch keeps per module, one object in its `__dict__`: the facts read off its weights, the input
    signatures already validated, and the prepared plans.

    `plans` maps (request, k, bucket, capture, expert-parallel, autograd, compiled, validation level, generation)
    to `Prepared` for the weights whose fingerprint is `fingerprint`; other weights (a new storage, an in-place
    update) empty it. A deep copy or an unpickled module starts with an empty cache: the plans hold the original's
    weights (and may hold kernels and graphs that cannot be copied).
    """

    __slots__ = ("owner", "fingerprint", "facts", "problems", "checked", "plans")

    def __init__(self, owner: int) -> None:
        self.owner = owner  # id() of the module: a deep copy keeps the __dict__ entry, not the id
        self.fingerprint: tuple | None = None
        self.facts: tuple | None = None  # (weight key, E, H, weight format)
        self.problems: dict[tuple, Problem] = {}  # (weight key, k, expert-parallel) -> the layer as ranked
        self.checked: set[tuple[object, ...]] = set()  # validate_inputs' memo
        self.plans: dict[tuple, Prepared] = {}

    def __deepcopy__(self, memo: dict) -> ModuleCache:
        return ModuleCache(-1)

    def __reduce__(self) -> tuple:
        return (ModuleCache, (-1,))


class Prepared(NamedTuple):
    """One key's choice: the backend, its plan, and a serial that names the plan in recorded graphs' keys."""

    name: str
    plan: ExpertsPlan
    serial: int
    graphs: GraphPolicy | None  # the plan's policy, None while autograd records (a replay records nothing)


_SERIALS = itertools.count(1)


def module_cache(module: torch.nn.Module) -> ModuleCache:
    """The module's cache, made on first use (and anew for a copy that carried its original's)."""
    cache = module.__dict__.get(_CACHE)
    if cache is None or cache.owner != id(module):
        cache = module.__dict__[_CACHE] = ModuleCache(id(module))
    return cache


def weights_fingerprint(module: torch.nn.Module) -> tuple:
    """What tells the module's weights apart without reading them: each parameter's and buffer's storage and in-place
    version (an optimizer step, a `copy_` or a `resize_` bumps the version), and the up weight's shape (a view swapped
    in through `.data` may keep both). Runs on every call: flat, no tuple per tensor (a third of the host time)."""
    parts: list = [layers.up_weight(module).shape]
    for tensors in (module._parameters, module._buffers):
        for t in tensors.values():
            if t is not None:
                parts += (t.data_ptr(), t._version)
    return tuple(parts)


class _Resolver:
    """What resolution caches: registry, config, loaded forwards, verdicts, auto picks."""

    def __init__(self) -> None:
        self.generation = 0
        self.reset()

    def reset(self) -> None:
        self.registry: Registry | None = None
        self.config: SelectorConfig | None = None
        self.forwards: dict[tuple[str, str], ExpertsForward] = {}
        self.auto: dict[tuple[Problem, int | None], str] = {}
        self.verdicts: dict[tuple[str, Problem], Any] = {}
        self.ran: set[tuple[str, Problem]] = set()  # (backend, problem at its token bucket) run in this process
        # (backend, layer) -> why the backend auto picked raised at a first forward of that layer in this process
        self.failed: dict[tuple[str, Problem], str] = {}
        self.generation += 1  # invalidates the per-module choice caches

    def get_registry(self) -> Registry:
        if self.registry is None:
            self.registry = get_registry()
        return self.registry

    def get_config(self) -> SelectorConfig:
        if self.config is None:
            self.config = load_config()
        return self.config

    def forward_of(self, name: str, weight_format: str = "dense") -> ExpertsForward:
        key = (name, weight_format)
        if key not in self.forwards:
            self.forwards[key] = self.get_registry().get(name).loader(weight_format)()
        return self.forwards[key]

    def rank(self, problem: Problem) -> Ranking:
        env = current_environment()
        measured = measured_for(problem, env, tuning_table())
        warm = {name for name, seen in self.ran if seen == problem}
        amortize = float(settings.get("SELECTOR_JIT_AMORTIZE_CALLS"))
        ranking = rank(problem, env, self.get_registry(), self.get_config(), measured, warm, amortize)
        failed = {n: why for (n, layer), why in self.failed.items() if layer == failure_key(problem)}
        if not failed:
            return ranking
        excluded = dict(ranking.excluded)
        for name, why in failed.items():
            excluded[name] = Availability(
                Status.PLUGIN_ERROR,
                f"raised at its first forward of this layer in this process ({why})",
                "report it to the backend's authors; auto runs the next candidate",
            )
        kept = tuple(c for c in ranking.candidates if c.name not in failed)
        return replace(ranking, candidates=kept, excluded=excluded)

    def note_failure(self, name: str, problem: Problem, exc: BaseException) -> None:
        """Auto's pick `name` raised at a first forward of this layer: warn once, rank it out for the layer."""
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        self.failed[(name, failure_key(problem))] = why
        self.auto.clear()  # picks made before this failure are made again, without it
        warnings.warn(
            f"selector: experts backend {name!r}, auto's pick, raised at its first forward of a layer "
            f"(E={problem.num_experts}, H={problem.hidden_size}, I={problem.intermediate_size}, k={problem.top_k}): "
            f"{why}; auto runs the next candidate for this layer from now on",
            RuntimeWarning,
            stacklevel=4,
        )


def failure_key(problem: Problem) -> Problem:
    """The layer a first-forward failure is remembered for: its shape and layout, whatever the call mode."""
    return replace(problem, num_tokens=None, call=CallMode())


_RESOLVER = _Resolver()


def get_backend_registry() -> Registry:
    """The registry the dispatch core resolves names against (built once, until `reset_selection_caches`)."""
    return _RESOLVER.get_registry()


def reset_selection_caches() -> None:
    """Forget cached registry, config, verdicts and auto picks (after installing a plugin, editing config)."""
    _RESOLVER.reset()


def token_bucket(num_tokens: int) -> int:
    """Round the token count up to a power of two: auto re-ranks per bucket, not per exact count."""
    return 1 << max(0, int(num_tokens) - 1).bit_length()


def check_backend_name(name: object) -> str:
    """`name` if it is "auto" or a registered backend; ValueError listing the names otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"an experts implementation must be a backend name, got {name!r}")
    if name != AUTO:
        get_backend_registry().get(name)
    return name


def backend_forward(name: str, weight_format: str = "dense") -> ExpertsForward:
    """The forward backend `name` declared for `weight_format`, imported on first use."""
    return _RESOLVER.forward_of(name, weight_format)


def backend_runner(name: str) -> ExpertsForward:
    """A forward that runs backend `name` on a module as the core runs it: the module's plan for `name` (prepared
    once per key), replayed from recorded graphs where the plan allows. What `selector bench` and `selector tune`
    time for a backend; it raises as an explicit request of `name` does where the backend cannot run."""
    check_backend_name(name)

    def run(module: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run_experts(module, hidden, ids, weights, implementation=name)

    return run


def problem_of(module: torch.nn.Module, top_k: int) -> Problem:
    """The module as the ranking sees it (token count unknown), cached per weight layout and k."""
    weight = layers.up_weight(module)
    key = (weight.dtype, weight.device, tuple(weight.shape), top_k, layers.is_expert_parallel(module))
    problems = module_cache(module).problems
    problem = problems.get(key)
    if problem is None:
        if len(problems) > 8:
            problems.clear()
        problem = problems[key] = problem_from_module(module, top_k=top_k)
    return problem


def rank_problem(problem: Problem) -> Ranking:
    """The ranking for one problem on this machine, measured times included where the tuning store has them."""
    return _RESOLVER.rank(problem)


def declared_top_k(module: torch.nn.Module) -> int:
    """k as the module or its config declares it, else 1."""
    config = getattr(module, "config", None)
    return int(getattr(module, "top_k", 0) or getattr(config, "num_experts_per_tok", 0) or 1)


def traced_top_k(module: torch.nn.Module) -> int:
    """k for a choice made while tracing: that of the module's last eager call, else as the module declares it.

    Not the index's width: it may be symbolic (dynamic=True), and only constants cross into the choice.
    The eager call stores it; read back while tracing it costs one C++ guard, where reading `top_k` / the
    config's `num_experts_per_tok` costs a NO_HASATTR guard per layer (see PINNED_DEFAULTS).
    """
    k = getattr(module, _TOP_K, None)
    return declared_top_k(module) if k is None else k


def explain_module(module: torch.nn.Module, num_tokens: int | None = None, top_k: int | None = None) -> Ranking:
    """The ranking "auto" uses for one experts module (decorated, or a Transformers experts module), for an
    inference call (no autograd: under it the ranking also leaves out backends without a backward)."""
    problem = problem_of(module, declared_top_k(module) if top_k is None else top_k)
    return rank_problem(problem.with_tokens(None if num_tokens is None else token_bucket(num_tokens)))


def requested_implementation(module: torch.nn.Module) -> str:
    """What the user asked this module to run: a backend name, or "auto" (the default)."""
    return module.__dict__.get(_REQUEST, AUTO)


def set_requested_implementation(module: torch.nn.Module, name: str) -> None:
    """Ask this module to run `name` (checked against the registry) or "auto" from its next call on."""
    module.__dict__[_REQUEST] = check_backend_name(name)
    track(module)


def last_backend(module: torch.nn.Module) -> str | None:
    """The backend that ran the module's last eager call through selector (None before the first)."""
    return module.__dict__.get(_LAST)


def note_backend(module: torch.nn.Module, name: str) -> None:
    """Record that `name` ran the module's call (for adapters that decide a call themselves)."""
    module.__dict__[_LAST] = name


def clear_last_backend(module: torch.nn.Module) -> None:
    """Forget which backend ran last, so the next call's record stands alone."""
    module.__dict__.pop(_LAST, None)


def forget_module(module: torch.nn.Module) -> None:
    """Drop what the core cached about the module (after its weights change format or layout): its problem, its
    plans and their recorded graphs."""
    module.__dict__.pop(_CACHE, None)
    for key in [k for k in module.__dict__ if k.startswith(MODULE_CACHE_PREFIX)]:
        del module.__dict__[key]
    graphs.forget(module)


def grad_inputs(
    module: torch.nn.Module, hidden_states: torch.Tensor | None = None, top_k_weights: torch.Tensor | None = None
) -> tuple[str, ...]:
    """What autograd records a gradient for in this call (names of `selector.types.GRAD_INPUTS`); () under no_grad."""
    if not torch.is_grad_enabled():
        return ()
    weights = (layers.up_weight(module), module.down_proj, layers.up_bias(module), layers.down_bias(module))
    wanted = (
        ("hidden_states", hidden_states is not None and hidden_states.requires_grad),
        ("routing_weights", top_k_weights is not None and top_k_weights.requires_grad),
        ("expert_weights", any(w is not None and w.requires_grad for w in weights)),
    )
    return tuple(name for name, on in wanted if on)


def call_problem(
    module: torch.nn.Module,
    top_k: int,
    capturing: bool = False,
    needs_grad: tuple[str, ...] | None = None,
    compiled: bool = False,
) -> Problem:
    """The module's problem with how this call runs: traced by torch.compile, captured in a CUDA graph,
    differentiated (`needs_grad`: `grad_inputs`; None: the module's weights under the current grad mode)."""
    if needs_grad is None:
        needs_grad = grad_inputs(module)
    compiling = compiled or torch.compiler.is_compiling()
    call = CallMode(compile=compiling, cuda_graph=capturing, grad_inputs=tuple(needs_grad))
    return replace(problem_of(module, top_k), call=call)


def choose_backend(
    module: torch.nn.Module,
    num_tokens: int | None,
    top_k: int,
    requested: str | None = None,
    capturing: bool = False,
    needs_grad: tuple[str, ...] | None = None,
    compiled: bool = False,
) -> str:
    """The backend for one call: `requested` (default: the module's request) if it can run, else raises.

    `needs_grad`: what the call's backward differentiates (`grad_inputs`); None: the module's weights under the
    current grad mode. A backend whose backward does not cover it is refused (auto skips it). `compiled`: the call
    belongs to a compiled model (run by its opaque op), so auto keeps to backends declared for torch.compile.
    """
    if requested is None:
        requested = requested_implementation(module)
    problem = call_problem(module, top_k, capturing, needs_grad, compiled)
    return _choose(problem, requested, None if num_tokens is None else token_bucket(num_tokens))


def _choose(problem: Problem, requested: str, bucket: int | None) -> str:
    if requested == AUTO:
        name = _auto_pick(problem, bucket)
        _RESOLVER.ran.add((name, problem.with_tokens(bucket)))
        return name
    # an explicit name may graph-break under torch.compile (the user's call); only auto avoids that
    problem = replace(problem, call=replace(problem.call, compile=False))
    key = (requested, problem)
    if key not in _RESOLVER.verdicts:
        spec = _RESOLVER.get_registry().get(requested)
        _RESOLVER.verdicts[key] = evaluate(spec, problem, current_environment())
    verdict = _RESOLVER.verdicts[key]
    if not verdict.ok:
        raise unavailable_error(requested, verdict)
    _RESOLVER.ran.add((requested, problem.with_tokens(bucket)))  # its first-call cost for this shape is paid
    return requested


def prepare_plan(name: str, module: torch.nn.Module, problem: Problem) -> ExpertsPlan:
    """Backend `name`'s plan for the module and this kind of call: its `prepare`, else (no prepare, or one that
    returns None for this problem) its forward for the weight format on the module."""
    spec = _RESOLVER.get_registry().get(name)
    plan = None if spec.prepare is None else spec.prepare(module, problem)
    if plan is not None:  # None: the backend prepares nothing of its own for this problem
        return plan
    forward = _RESOLVER.forward_of(name, problem.weight_format)
    return ForwardPlan(
        backend=name,
        forward=forward,
        module=weakref.ref(module),
        opaque_when_compiled=bool(getattr(forward, OPAQUE_WHEN_COMPILED, False)),
    )


def _auto_pick(problem: Problem, bucket: int | None) -> str:
    key = (problem, bucket)
    if key not in _RESOLVER.auto:
        ranking = _RESOLVER.rank(problem.with_tokens(bucket))
        config = _RESOLVER.get_config()
        if config.pin is not None and config.pin not in {c.name for c in ranking.candidates}:
            unavailable = _RESOLVER.get_registry().unavailable
            verdict = ranking.excluded.get(config.pin) or unavailable.get(config.pin)
            if verdict is not None:
                _warn_pin_skipped(config, verdict)
        failed = [f"{n}: {a.reason}" for n, a in ranking.excluded.items()]
        for candidate in ranking.candidates:
            try:  # a backend whose implementation fails to load is skipped, as auto promises
                _RESOLVER.forward_of(candidate.name, problem.weight_format)
            except Exception as exc:
                failed.append(f"{candidate.name}: load failed ({type(exc).__name__}: {exc})")
                continue
            _RESOLVER.auto[key] = candidate.name
            break
        else:
            raise ImportError(f"no experts backend can run this layer here ({'; '.join(failed)})")
    return _RESOLVER.auto[key]


_PINS_WARNED: set[tuple[str, str]] = set()  # (pin, reason) already warned about in this process


def _warn_pin_skipped(config: SelectorConfig, verdict: Availability) -> None:
    """A config pin that cannot run a layer here: auto ranks the others, as the config promises; say so once."""
    key = (str(config.pin), verdict.reason)
    if key in _PINS_WARNED:
        return
    _PINS_WARNED.add(key)
    where = config.sources.get("pin") or ", ".join(config.files) or "the config"
    fix = f"{verdict.remedy}, or remove the pin" if verdict.remedy else "remove the pin"
    warnings.warn(
        f"selector: pinned backend {config.pin!r} (from {where}) cannot run here ({verdict.status.value}: "
        f"{verdict.reason}); auto picks from the other backends. Fix: {fix}",
        UserWarning,
        stacklevel=5,
    )


_TRACKED: weakref.WeakValueDictionary[str, torch.nn.Module] = weakref.WeakValueDictionary()
_NEXT_UID = itertools.count()


def track(module: torch.nn.Module) -> str:
    """Give a module a string id that torch.compile can pass as a constant (call it outside tracing)."""
    uid = module.__dict__.get(_UID)
    if uid is None or _TRACKED.get(uid) is not module:  # new, or a deep copy that kept its original's id
        uid = f"experts-{next(_NEXT_UID)}"
        module.__dict__[_UID] = uid
        module.__dict__[_OWNER] = id(module)
        _TRACKED[uid] = module
        if layers.up_weight(module).element_size() > 1:  # one-byte weights get their format from selector.hf
            _pin_defaults(module)  # before any trace: pinned by a first call inside a compiled model, a recompile
    return uid


def tracked_id(module: torch.nn.Module) -> str | None:
    """The id `track` gave the module (None if never tracked); readable while torch.compile traces."""
    return getattr(module, _UID, None)


def tracked_module(uid: str) -> torch.nn.Module | None:
    return _TRACKED.get(uid)


# Attributes that selector and the backends read as getattr(module, name, default). Under torch.compile an
# absent one becomes a NO_HASATTR guard per layer, checked on every call of the compiled model through
# nn.Module.__getattr__ raising AttributeError (~1 us each on a CPU, Python code); a present one is a C++
# dict lookup and compare. Set eagerly, to the value every reader assumes when it is absent.
PINNED_DEFAULTS: tuple[tuple[str, object], ...] = (("selector_weight_format", "dense"),)


def _pin_defaults(module: torch.nn.Module) -> None:
    for name, value in PINNED_DEFAULTS:
        if name not in module.__dict__ and not hasattr(type(module), name):
            module.__dict__[name] = value


def weight_format(module: torch.nn.Module) -> str:
    """'dense', 'fp8_block' or 'fp4': how the module's expert weights are stored (selector.quant)."""
    return getattr(module, "selector_weight_format", None) or "dense"


def _traced_module(uid: str) -> torch.nn.Module:
    module = _TRACKED.get(uid)
    if module is None:
        raise RuntimeError("an experts module reached torch.compile before selector saw it: run it once first")
    return module


@torch.compiler.assume_constant_result
def _auto_at_run_time(uid: str, requested: str) -> bool:
    # Runs eagerly while torch.compile traces, its result a constant: whether the call is "auto" (the module's
    # request unless the caller names one), which the opaque `selector::experts` chooses per call.
    return (requested or requested_implementation(_traced_module(uid))) == AUTO


@torch.compiler.assume_constant_result
def _choose_constant(uid: str, top_k: int, requested: str, needs_grad: str) -> str:
    # Runs eagerly while torch.compile traces, its result a constant: one choice per compiled layer, traced.
    grads = tuple(needs_grad.split(",")) if needs_grad else ()
    return choose_backend(_traced_module(uid), None, top_k, requested or None, needs_grad=grads)


def run_experts(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    implementation: str | None = None,
) -> torch.Tensor:
    """Validate the inputs, pick the backend for this module and token count, run it.

    `implementation`: a backend name or "auto" that overrides the module's own request (the Transformers
    adapter passes the name the model's config holds).
    """
    if torch.compiler.is_compiling():
        return _run_traced(module, hidden_states, top_k_index, top_k_weights, implementation)
    return _run_eager(module, hidden_states, top_k_index, top_k_weights, implementation, compiled=False)


def _run_eager(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    implementation: str | None,
    compiled: bool,
) -> torch.Tensor:
    """run_experts outside tracing; `compiled`: called by the opaque op of a compiled model (see choose_backend).

    This runs on every call of every layer, and at decode its Python is a good part of the step: it reads its
    state from the module's cache directly, allocates nothing on a repeat call but the key, and leaves the checks a
    call signature already passed to validate_inputs' memo.
    """
    state = module.__dict__
    cache = state.get(_CACHE)
    if cache is None or cache.owner != id(module):
        cache = module_cache(module)
    fingerprint = weights_fingerprint(module)
    if fingerprint != cache.fingerprint:  # new weights, or updated in place: every plan is prepared again
        if cache.plans:
            cache.plans.clear()
            graphs.forget(module)
        cache.fingerprint = fingerprint
        _pin_defaults(module)  # (E, H, format) read off the weights once per set of weights
        cache.facts = (*layers.dims(module)[:2], weight_format(module))
    facts = cache.facts
    expert_parallel = layers.is_expert_parallel(module)
    level = validation_level(on_gpu=hidden_states.device.type != "cpu")
    validate_inputs(
        hidden_states,
        top_k_index,
        top_k_weights,
        num_experts=facts[0],
        hidden_size=facts[1],
        expert_parallel=expert_parallel,
        level=level,
        seen=cache.checked,
    )
    guard.raise_pending(hidden_states.device)  # a fault the device guard recorded in an earlier call (no sync)
    top_k = top_k_index.shape[1]
    track(module)  # new, a deep copy that kept its original's id, or one unpickled where a dead module lived
    if state.get(_TOP_K) != top_k:
        state[_TOP_K] = top_k
    capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
    requested = implementation or state.get(_REQUEST, AUTO)
    bucket = token_bucket(hidden_states.shape[0]) if requested == AUTO else 0
    needs_grad = grad_inputs(module, hidden_states, top_k_weights)
    key = (requested, top_k, bucket, capturing, expert_parallel, needs_grad, compiled, level, _RESOLVER.generation)
    prepared = cache.plans.get(key)
    if prepared is None:  # decided once per key; a request that cannot run raises here every time
        prepared, out = _first_call(module, key, hidden_states, top_k_index, top_k_weights)
        if len(cache.plans) >= PLANS_PER_MODULE:
            cache.plans.clear()
        cache.plans[key] = prepared
        state[_LAST] = prepared.name
        return out
    state[_LAST] = prepared.name
    return _run_plan(module, prepared, hidden_states, top_k_index, top_k_weights)


def _run_plan(
    module: torch.nn.Module,
    prepared: Prepared,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The run stage: the plan, replayed from a graph recorded here where its policy allows."""
    policy = prepared.graphs
    if policy is not None and graphs.graphs_enabled(hidden_states, policy.max_tokens, policy.variable):
        graph_key = (
            hidden_states.shape,
            hidden_states.dtype,
            top_k_index.shape,
            top_k_index.dtype,
            top_k_weights.dtype,
            hidden_states.device,
            prepared.serial,
        )
        inputs = (hidden_states, top_k_index, top_k_weights)
        return graphs.replay(module, prepared.name, graph_key, prepared.plan.run, inputs)
    return prepared.plan.run(hidden_states, top_k_index, top_k_weights)


def _first_call(
    module: torch.nn.Module,
    key: tuple,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> tuple[Prepared, torch.Tensor]:
    """Choose, prepare and run for a new cache key. Where auto's pick raises on this first forward (bad input
    aside), the failure is recorded and warned about once and the next candidate runs; a named backend raises."""
    requested, top_k, bucket, capturing, _, needs_grad, compiled = key[:7]
    problem = call_problem(module, top_k, capturing, needs_grad, compiled)
    while True:
        name = _choose(problem, requested, token_bucket(hidden_states.shape[0]))
        try:
            plan = prepare_plan(name, module, problem.with_tokens(bucket or None))
            policy = plan.graphs if not needs_grad else None  # a replayed graph records nothing for autograd
            prepared = Prepared(name, plan, next(_SERIALS), policy)
            out = _run_plan(module, prepared, hidden_states, top_k_index, top_k_weights)
            if plan.tiles in ESTIMATED_TILES:
                note_untuned(name, problem, plan.tiles)
            return prepared, out
        except ExpertsInputError:
            raise
        except Exception as exc:
            if requested != AUTO:
                raise
            _RESOLVER.note_failure(name, problem, exc)


_log = logging.getLogger("selector")
_TOLD: set[tuple] = set()  # shapes the user was told run on estimated tiles, once per process
# ExpertsPlan.tiles of a layer whose kernel parameters no table or tuning holds: borrowed from the nearest tabled
# shape, or the backend's built-in defaults
ESTIMATED_TILES = {"nearest": "tiles borrowed from the nearest shape a table holds", "heuristic": "default tiles"}


def untuned_message(name: str, problem: Problem, tiles: str = "heuristic") -> str:
    """The one line that says a layer runs on estimated kernel parameters, and the command that tunes it."""
    shape = f"E={problem.num_experts} H={problem.hidden_size} I={problem.intermediate_size} k={problem.top_k}"
    command = (f"selector tune --experts {problem.num_experts} --hidden {problem.hidden_size} "
               f"--intermediate {problem.intermediate_size} --top-k {problem.top_k} --dtype {problem.dtype}")
    return (f"selector: experts layer {shape} ({problem.dtype}, {problem.weight_format}) runs {name} on "
            f"{ESTIMATED_TILES.get(tiles, tiles)}: no table for this GPU holds it and it was not tuned here; "
            f"`{command}` tunes it, or set SELECTOR_TUNE_ON_LOAD=<seconds> to tune a model's layers when it loads")


def note_untuned(name: str, problem: Problem, tiles: str = "heuristic") -> None:
    """Log `untuned_message` once per shape per process."""
    key = (name, failure_key(problem))
    if key not in _TOLD:
        _TOLD.add(key)
        _log.warning(untuned_message(name, problem, tiles))


def _run_traced(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    implementation: str | None,
) -> torch.Tensor:
    """run_experts while torch.compile traces: the opaque op for auto, else shape checks, one constant choice per
    layer, the backend.

    Nothing here reads or writes the module's __dict__ or caches: Dynamo (torch 2.11) cannot trace calls on a
    module's __dict__ (`setdefault` broke the graph at every layer), and every write would be a side effect
    replayed after the graph. Attribute reads are plain getattr, which Dynamo guards like any other.
    """
    # Shapes may be symbolic while tracing and only constants can cross into the choice. "auto" without autograd
    # becomes one opaque op that chooses per call at run time; a named backend, or auto under autograd (whose
    # backward AOTAutograd must trace), is chosen once per layer for a typical token count and the k of the last
    # eager call (else the declared k), and traced.
    uid = tracked_id(module)
    if uid is None:
        raise RuntimeError(
            "selector cannot choose a backend inside torch.compile for an experts module it has not seen: "
            "call the model once before compiling, or selector.set_experts_implementation(model, ...)"
        )
    needs_grad = ",".join(grad_inputs(module, hidden_states, top_k_weights))
    # a deep copy compiled before selector saw it run still carries its original's id: traced, by its own weights
    opaque = not needs_grad and getattr(module, _OWNER, None) == id(module)
    # The op's path reads nothing its run-time eager call writes (the k it records, the weight format it pins):
    # no recompile after the first call. Its implementation checks the inputs, every call, as uncompiled.
    if opaque and _auto_at_run_time(uid, implementation or ""):
        return torch.ops.selector.experts(
            uid, implementation or "", hidden_states, top_k_index, top_k_weights, layers.up_weight(module)
        )
    num_experts, hidden_size, _ = layers.dims(module)
    validate_inputs(
        hidden_states,
        top_k_index,
        top_k_weights,
        num_experts=num_experts,
        hidden_size=hidden_size,
        expert_parallel=layers.is_expert_parallel(module),
    )
    name = _choose_constant(uid, traced_top_k(module), implementation or "", needs_grad)
    forward = _RESOLVER.forward_of(name, weight_format(module))
    if opaque and getattr(forward, OPAQUE_WHEN_COMPILED, False):  # its eager call beats its trace
        return torch.ops.selector.experts(uid, name, hidden_states, top_k_index, top_k_weights, layers.up_weight(module))
    return forward(module, hidden_states, top_k_index, top_k_weights)


# The opaque op a compiled model calls for "auto": inductor sees one extern kernel whose output is shaped like
# hidden_states; its implementation is the eager path, so the backend is chosen per token bucket from the real
# token count, and a backend that replays its own recorded CUDA graph at small T does so (the compiled graph
# alone would launch each kernel from Python). Defined on the raw library, not torch.library.custom_op: no
# Python autograd wrapper on every call (the op runs only where autograd records nothing). The module's up
# weight goes in too, unused by the implementation: inductor then knows the op reads it.
_LIBRARY = torch.library.Library("selector", "FRAGMENT")
_LIBRARY.define(
    "experts(str layer, str implementation, Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, "
    "Tensor up_weight) -> Tensor"
)


# Device index -> the default stream's (stream id, device index, device type), as torch._C reports a stream. The
# default stream of a device never changes (stream id 0 in c10's encoding); only the current one does.
_DEFAULT_STREAMS: dict[int, tuple[int, int, int]] = {}


def _own_graphs_allowed(hidden_states: torch.Tensor) -> bool:
    """Whether a backend may record its own graph in this compiled call: on the device's default stream only.
    torch.compile's CUDA-graph modes warm up on a side stream with the thread's allocations routed into their
    pool, then capture (where graphs_enabled says no by itself).

    Compares the raw (id, device index, device type) tuples torch._C gives for the current and default streams:
    what `torch.cuda.current_stream(d) == torch.cuda.default_stream(d)` compares, without building two Stream
    objects and resolving the device in Python on every call of every compiled layer.
    """
    if not hidden_states.is_cuda:
        return True
    index = hidden_states.get_device()
    default = _DEFAULT_STREAMS.get(index)
    if default is None:
        default = _DEFAULT_STREAMS[index] = tuple(torch._C._cuda_getDefaultStream(index))
    return tuple(torch._C._cuda_getCurrentStream(index)) == default


def _experts_op(
    layer: str,
    implementation: str,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    up_weight: torch.Tensor,
) -> torch.Tensor:
    module = _TRACKED.get(layer)
    if module is None:
        raise RuntimeError(f"selector::experts: the experts module {layer!r} no longer exists; compile its model again")
    if _own_graphs_allowed(hidden_states):  # the usual case: no context manager on the hot path
        out = _run_eager(module, hidden_states, top_k_index, top_k_weights, implementation or None, compiled=True)
    else:
        with graphs.own_graphs(False):
            out = _run_eager(module, hidden_states, top_k_index, top_k_weights, implementation or None, compiled=True)
    # inductor takes the fake's layout (contiguous, hidden_states' dtype) as the output's; a backend's output
    # nearly always has it already, and checking is cheaper than `.to()` and `.contiguous()` returning it as is
    if out.dtype != hidden_states.dtype:
        out = out.to(hidden_states.dtype)
    return out if out.is_contiguous() else out.contiguous()


def _experts_fake(
    layer: str,
    implementation: str,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    up_weight: torch.Tensor,
) -> torch.Tensor:
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format)


_LIBRARY.impl("experts", _experts_op, "CompositeExplicitAutograd")
torch.library.register_fake("selector::experts", _experts_fake, lib=_LIBRARY)


__all__ = [
    "AUTO",
    "MODULE_CACHE_PREFIX",
    "ModuleCache",
    "OPAQUE_WHEN_COMPILED",
    "PINNED_DEFAULTS",
    "backend_forward",
    "backend_runner",
    "call_problem",
    "check_backend_name",
    "choose_backend",
    "clear_last_backend",
    "declared_top_k",
    "explain_module",
    "forget_module",
    "get_backend_registry",
    "grad_inputs",
    "last_backend",
    "module_cache",
    "note_backend",
    "prepare_plan",
    "problem_of",
    "rank_problem",
    "requested_implementation",
    "reset_selection_caches",
    "run_experts",
    "set_requested_implementation",
    "token_bucket",
    "traced_top_k",
    "weights_fingerprint",
    "track",
    "tracked_id",
    "tracked_module",
    "weight_format",
]
