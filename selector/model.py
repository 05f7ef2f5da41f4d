"""Model API for any nn.Module tree: decorate an experts class, then choose its backend by name, "auto" or dict.

    @selector.experts(has_bias=True)
    class MyExperts(nn.Module): ...            # gate_up_proj, down_proj, act_fn, num_experts as Transformers'

    selector.set_experts_implementation(model, "auto")               # or "grouped_mm"
    selector.set_experts_implementation(model, {"": "auto", "vision_config": "eager"})
    selector.get_experts_implementation(model)  -> {"": "auto", "vision_config": "eager"}

A name is checked against the registry at once (unknown -> ValueError listing the names). Whether it can
run on this machine and this layer is checked at the first forward, which raises ImportError or ValueError
with the reason and the fix; "auto" picks the best runnable backend per token-count bucket instead.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import wraps
from typing import Any, TypeVar

import torch

from selector import layers
from selector.config import SelectorConfig, load_config
from selector.environment import current_environment
from selector.errors import unavailable_error
from selector.problem import problem_from_module
from selector.ranking import rank
from selector.registry import Registry, get_registry
from selector.requirements import evaluate
from selector.tuning import measured_for
from selector.types import ExpertsForward, Problem, Ranking, Status
from selector.validation import validate_inputs

AUTO = "auto"
REQUEST_ATTR = "_selector_implementation"  # what the user asked for this module
BACKBONE_ATTR = "_selector_backbone"  # the sub-config key this module answers to
LAST_ATTR = "_selector_last_backend"  # the backend that ran the last forward (observability, tests)
TOP_K_ATTR = "_selector_top_k"  # k of the last eager forward: what a choice made under torch.compile uses

M = TypeVar("M", bound=type)


def experts(
    cls: M | None = None,
    *,
    has_gate: bool = True,
    has_bias: bool = False,
    is_transposed: bool = False,
    is_concatenated: bool = True,
    has_post_expert_norm: bool = False,
    gate_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
    backbone: str | None = None,
) -> Any:
    """Class decorator: the module's forward(hidden_states, top_k_index, top_k_weights) runs the chosen backend.

    Flags as Transformers' `use_experts_implementation`: `is_concatenated=False` means interleaved gate/up
    channels; `gate_fn(module, gate_up_out) -> gated` replaces act(gate) * up (GPT-OSS style gates);
    `backbone` names the sub-config key that dict requests use for this module.
    """

    def wrap(klass: M) -> M:
        original_init = klass.__init__

        @wraps(original_init)
        def __init__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            self.has_gate = has_gate
            self.has_bias = has_bias
            self.is_transposed = is_transposed
            self.is_concatenated = is_concatenated
            self.has_post_expert_norm = has_post_expert_norm
            self._is_expert_parallel = getattr(self, "_is_expert_parallel", False)
            if backbone is not None:
                setattr(self, BACKBONE_ATTR, backbone)
            track(self)

        def forward(
            self: torch.nn.Module,
            hidden_states: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
        ) -> torch.Tensor:
            return run_experts(self, hidden_states, top_k_index, top_k_weights)

        klass.__init__ = __init__
        klass.forward = forward
        if gate_fn is not None:
            klass._apply_gate = gate_fn
        elif not hasattr(klass, "_apply_gate"):
            klass._apply_gate = layers.default_apply_gate
        klass._selector_experts = True
        return klass

    return wrap(cls) if cls is not None else wrap


class _Resolver:
    """Caches what resolution needs: registry, probe facts, config, loaded forwards, verdicts, auto picks."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.registry: Registry | None = None
        self.config: SelectorConfig | None = None
        self.forwards: dict[str, ExpertsForward] = {}
        self.auto: dict[tuple[Problem, int], str] = {}
        self.verdicts: dict[tuple[str, Problem], Any] = {}
        self.generation = getattr(self, "generation", 0) + 1  # invalidates the per-module choice caches

    def get_registry(self) -> Registry:
        if self.registry is None:
            self.registry = get_registry()
        return self.registry

    def get_config(self) -> SelectorConfig:
        if self.config is None:
            self.config = load_config()
        return self.config

    def forward_of(self, name: str) -> ExpertsForward:
        if name not in self.forwards:
            self.forwards[name] = self.get_registry().get(name).load()
        return self.forwards[name]

    def rank(self, problem: Problem) -> Ranking:
        env = current_environment()
        return rank(problem, env, self.get_registry(), self.get_config(), measured=measured_for(problem, env))

    def choose(
        self,
        module: torch.nn.Module,
        num_tokens: int | None,
        top_k: int,
        requested: str | None = None,
        capturing: bool = False,
    ) -> str:
        if requested is None:
            requested = getattr(module, REQUEST_ATTR, AUTO)
        # how the call runs is part of the problem: traced by torch.compile, captured in a CUDA graph
        problem = replace(_static_problem(module, top_k), compile=torch.compiler.is_compiling(), cuda_graph=capturing)
        if requested == AUTO:
            key = (problem, None if num_tokens is None else token_bucket(num_tokens))
            if key not in self.auto:
                ranking = self.rank(problem.with_tokens(key[1]))
                failed = [f"{n}: {a.reason}" for n, a in ranking.excluded.items()]
                for candidate in ranking.candidates:
                    try:  # a backend whose implementation fails to load is skipped, as auto promises
                        self.forward_of(candidate.name)
                    except Exception as exc:
                        failed.append(f"{candidate.name}: load failed ({type(exc).__name__}: {exc})")
                        continue
                    self.auto[key] = candidate.name
                    break
                else:
                    raise ImportError(f"no experts backend can run this layer here ({'; '.join(failed)})")
            return self.auto[key]
        # an explicit name may graph-break under torch.compile (the user's call); only auto avoids that
        problem = replace(problem, compile=False)
        key2 = (requested, problem)
        if key2 not in self.verdicts:
            spec = self.get_registry().get(requested)
            self.verdicts[key2] = evaluate(spec, problem, current_environment())
        verdict = self.verdicts[key2]
        if not verdict.ok:
            raise unavailable_error(requested, verdict)
        return requested


_RESOLVER = _Resolver()


def reset_selection_caches() -> None:
    """Forget cached registry, config, verdicts and auto picks (after installing a plugin, editing config)."""
    _RESOLVER.reset()


def token_bucket(num_tokens: int) -> int:
    """Round the token count up to a power of two: auto re-ranks per bucket, not per exact count."""
    return 1 << max(0, int(num_tokens) - 1).bit_length()


def _static_problem(module: torch.nn.Module, top_k: int) -> Problem:
    weight = layers.up_weight(module)
    key = (weight.dtype, weight.device, tuple(weight.shape), top_k, layers.is_expert_parallel(module))
    cached = module.__dict__.get("_selector_problem")
    if cached is None or cached[0] != key:
        cached = (key, problem_from_module(module, top_k=top_k))
        module.__dict__["_selector_problem"] = cached
    return cached[1]


def _declared_top_k(module: torch.nn.Module) -> int:
    """k as the module or its config declares it (for symbolic shapes), else 1."""
    config = getattr(module, "config", None)
    return int(getattr(module, "top_k", 0) or getattr(config, "num_experts_per_tok", 0) or 1)


_TRACKED: weakref.WeakValueDictionary[str, torch.nn.Module] = weakref.WeakValueDictionary()
_NEXT_UID = itertools.count()


def track(module: torch.nn.Module) -> str:
    """Give a module a string id that torch.compile can pass as a constant (call it outside tracing)."""
    uid = module.__dict__.get("_selector_uid")
    if uid is None or _TRACKED.get(uid) is not module:  # new, or a deep copy that kept its original's id
        uid = f"experts-{next(_NEXT_UID)}"
        module.__dict__["_selector_uid"] = uid
        _TRACKED[uid] = module
    return uid


# Attributes that selector and the backends read as getattr(module, name, default). Under torch.compile an
# absent one becomes a NO_HASATTR guard per layer, checked on every call of the compiled model through
# nn.Module.__getattr__ raising AttributeError (~1 us each on a CPU, Python code); a present one is a C++
# dict lookup and compare. Set eagerly, to the value every reader assumes when it is absent.
PINNED_DEFAULTS: tuple[tuple[str, object], ...] = (("selector_weight_format", "dense"),)


def _pin_defaults(module: torch.nn.Module) -> None:
    """Store the defaults of PINNED_DEFAULTS on the module where it lacks them (call outside tracing)."""
    for name, value in PINNED_DEFAULTS:
        if name not in module.__dict__ and not hasattr(type(module), name):
            module.__dict__[name] = value


def _traced_top_k(module: torch.nn.Module) -> int:
    """k for a choice made while tracing: that of the module's last eager call, else as the module declares it.

    Not the index's width: it may be symbolic (dynamic=True), and only constants cross into the choice.
    The eager call stores it (TOP_K_ATTR); read back while tracing it costs one C++ guard, where reading
    `top_k` / the config's `num_experts_per_tok` costs a NO_HASATTR guard per layer (see PINNED_DEFAULTS).
    """
    k = getattr(module, TOP_K_ATTR, None)
    return _declared_top_k(module) if k is None else k


@torch.compiler.assume_constant_result
def _choose_constant(uid: str, top_k: int, requested: str) -> str:
    # Runs eagerly while torch.compile traces, its result a constant: one choice per compiled layer.
    module = _TRACKED.get(uid)
    if module is None:
        raise RuntimeError("an experts module reached torch.compile before selector saw it: run it once first")
    return _RESOLVER.choose(module, None, top_k, None if requested == "" else requested)


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
    weight = layers.up_weight(module)
    weight_key = (weight.dtype, weight.device, weight.shape)
    facts = module.__dict__.get("_selector_facts")
    if facts is None or facts[0] != weight_key:  # (E, H) read off the weights once per weight layout
        facts = (weight_key, *layers.dims(module)[:2])
        module.__dict__["_selector_facts"] = facts
        _pin_defaults(module)
    expert_parallel = layers.is_expert_parallel(module)
    validate_inputs(
        hidden_states,
        top_k_index,
        top_k_weights,
        num_experts=facts[1],
        hidden_size=facts[2],
        expert_parallel=expert_parallel,
        seen=module.__dict__.setdefault("_selector_checked", set()),
    )
    num_tokens, top_k = hidden_states.shape[0], top_k_index.shape[1]
    track(module)
    if module.__dict__.get(TOP_K_ATTR) != top_k:
        module.__dict__[TOP_K_ATTR] = top_k
    capturing = hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()
    requested = implementation or module.__dict__.get(REQUEST_ATTR, AUTO)
    bucket = token_bucket(num_tokens) if requested == AUTO else 0
    key = (requested, top_k, bucket, capturing, expert_parallel, weight_key, _RESOLVER.generation)
    choices = module.__dict__.setdefault("_selector_choices", {})
    name = choices.get(key)
    if name is None:  # decided once per key; a request that cannot run raises here every time
        name = _RESOLVER.choose(module, num_tokens, top_k, implementation, capturing)
        if len(choices) > 64:
            choices.clear()
        choices[key] = name
    module.__dict__[LAST_ATTR] = name
    return _RESOLVER.forward_of(name)(module, hidden_states, top_k_index, top_k_weights)


def _run_traced(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    implementation: str | None,
) -> torch.Tensor:
    """run_experts while torch.compile traces: shape checks, one constant choice per layer, the backend.

    Nothing here reads or writes the module's __dict__ or caches: Dynamo (torch 2.11) cannot trace calls on a
    module's __dict__ (`setdefault` broke the graph at every layer), and every write would be a side effect
    replayed after the graph. Attribute reads are plain getattr, which Dynamo guards like any other.
    """
    num_experts, hidden_size, _ = layers.dims(module)
    validate_inputs(
        hidden_states,
        top_k_index,
        top_k_weights,
        num_experts=num_experts,
        hidden_size=hidden_size,
        expert_parallel=layers.is_expert_parallel(module),
    )
    # Shapes may be symbolic while tracing and only constants can cross into the choice: under torch.compile
    # auto chooses once per layer, for a typical token count and the k of the last eager call (else the
    # declared k).
    uid = getattr(module, "_selector_uid", None)
    if uid is None:
        raise RuntimeError(
            "selector cannot choose a backend inside torch.compile for an experts module it has not seen: "
            "call the model once before compiling, or selector.set_experts_implementation(model, ...)"
        )
    name = _choose_constant(uid, _traced_top_k(module), implementation or "")
    return _RESOLVER.forward_of(name)(module, hidden_states, top_k_index, top_k_weights)


def is_experts_module(module: torch.nn.Module) -> bool:
    return bool(getattr(type(module), "_selector_experts", False))


def _scope_of(model: torch.nn.Module, module: torch.nn.Module) -> str:
    """The sub-config key of an experts module: its declared backbone, or the sub-config its config is."""
    declared = getattr(module, BACKBONE_ATTR, None)
    if declared is not None:
        return declared
    root_config, own_config = getattr(model, "config", None), getattr(module, "config", None)
    if root_config is None or own_config is None or own_config is root_config:
        return ""
    for key in getattr(root_config, "sub_configs", {}) or {}:
        if getattr(root_config, key, None) is own_config:
            return key
    return ""


def experts_scopes(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Module]]]:
    """{sub-config key: [(module path, experts module), ...]}; "" is the model's own scope."""
    scopes: dict[str, list[tuple[str, torch.nn.Module]]] = {}
    for path, module in model.named_modules():
        if is_experts_module(module):
            scopes.setdefault(_scope_of(model, module), []).append((path, module))
    return scopes


def _check_name(name: object, registry: Registry) -> str:
    if not isinstance(name, str):
        raise ValueError(f"an experts implementation must be a backend name, got {name!r}")
    if name != AUTO:
        registry.get(name)  # ValueError listing the registered names
    return name


def set_experts_implementation(model: torch.nn.Module, implementation: str | Mapping[str, str]) -> None:
    """Choose the backend of every experts module, at any time, without reloading.

    `implementation`: a name, "auto", or {sub-config key: name} with "" for the whole model.
    A Transformers model (no selector-decorated modules, Transformers' experts interface) is handed to
    `selector.hf.set_experts_implementation`, which sets the same through Transformers' own call.
    """
    if not any(is_experts_module(m) for m in model.modules()) and hasattr(model, "set_experts_implementation"):
        from selector import hf

        hf.set_experts_implementation(model, implementation)
        return
    registry = _RESOLVER.get_registry()
    request = {"": implementation} if isinstance(implementation, str) else dict(implementation)
    scopes = experts_scopes(model)
    unknown = sorted(k for k in request if k != "" and k not in scopes)
    if unknown:
        known = ", ".join(repr(k) for k in sorted(scopes) if k) or "none (only the '' key applies)"
        raise ValueError(f"no experts modules under sub-config key(s) {unknown}; this model's keys: {known}")
    for name in request.values():
        _check_name(name, registry)
    for key, members in scopes.items():
        name = request.get(key, request.get(""))
        if name is None:
            continue
        for _, module in members:
            setattr(module, REQUEST_ATTR, name)
            track(module)
    previous = model.__dict__.get("_selector_request", {})
    model.__dict__["_selector_request"] = {**previous, **request}


def get_experts_implementation(model: torch.nn.Module) -> dict[str, str]:
    """{"": whole-model choice, sub-config key: its choice, ...} as currently set."""
    request = model.__dict__.get("_selector_request", {})
    result = {"": request.get("", AUTO)}
    for key, members in experts_scopes(model).items():
        result[key] = getattr(members[0][1], REQUEST_ATTR, AUTO)
    return result


def explain_model(model: torch.nn.Module, num_tokens: int | None = None) -> dict[str, Ranking]:
    """The ranking behind each experts module's choice: {module path: Ranking}, for logs and `doctor`."""
    out: dict[str, Ranking] = {}
    for members in experts_scopes(model).values():
        for path, module in members:
            top_k = _declared_top_k(module)
            out[path] = _RESOLVER.rank(_static_problem(module, top_k).with_tokens(num_tokens))
    return out


def explain_module(module: torch.nn.Module, num_tokens: int | None = None, top_k: int | None = None) -> Ranking:
    """The ranking "auto" uses for one experts module (decorated, or a Transformers experts module)."""
    if top_k is None:
        top_k = _declared_top_k(module)
    problem = _static_problem(module, top_k)
    return _RESOLVER.rank(problem.with_tokens(None if num_tokens is None else token_bucket(num_tokens)))


__all__ = [
    "AUTO",
    "Status",
    "experts",
    "experts_scopes",
    "explain_model",
    "explain_module",
    "get_experts_implementation",
    "reset_selection_caches",
    "run_experts",
    "set_experts_implementation",
]
