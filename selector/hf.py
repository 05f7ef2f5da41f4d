"""Hugging Face Transformers drop-in: selector's backends and "auto" as Transformers experts implementations.

    import selector
    model = selector.from_pretrained(AutoModelForCausalLM, "Qwen/Qwen1.5-MoE-A2.7B", dtype=torch.bfloat16)
    print(selector.hf.selection_report(model))      # per sub-config: the choice, and why not the others

or, with Transformers' own loader once `selector.hf` is imported:

    AutoModelForCausalLM.from_pretrained(name, experts_implementation="auto")
    model.set_experts_implementation({"text_config": "selector:grouped_mm", "vision_config": "eager"})

Names (decided once, in `register_with_transformers`):
- "auto": selector picks the backend per layer and per token-count bucket, from the layer's experts config
  (E, H, I, k, dtype, activation, bias and layout, weight format) and the probes of this machine.
- "selector:<backend>" for every backend in selector's registry (built-in and third-party).
- "<backend>" as well, for every selector backend whose name Transformers does not already use
  (e.g. "triton_fused"). Transformers' own names ("eager", "batched_mm", "grouped_mm", "deepgemm",
  "sonicmoe", ...) keep meaning Transformers' own functions: importing selector never changes what an
  existing name runs. "eager" is always the module's original loop.

Every selector name runs through `selector.dispatch.run_experts`: input validation, then the same resolution
as the decorator API (an explicit backend that cannot run here raises ImportError/ValueError at the first
forward, naming what is missing and the fix; "auto" skips it and records why).

Decode phase of `generate()`: Transformers (>= 5.14) already swaps its own "grouped_mm" for "batched_mm"
during the decode steps on non-CPU devices. selector extends that same hook (`_optimize_model_for_decode`)
so "selector:grouped_mm" swaps to "selector:batched_mm" the same way, per sub-config, restored when
generation ends or raises. "auto" needs no swap: it re-ranks per token-count bucket on every call.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from selector import layers
from selector import dispatch
from selector.costmodel import TYPICAL_TOKENS
from selector.types import Availability, Problem, Ranking

logger = logging.getLogger("selector.hf")

MIN_TRANSFORMERS = "5.14"  # first release whose validation reads the experts interface and that has
# get_experts_implementation / per-sub-config set_experts_implementation
PREFIX = "selector:"
AUTO = dispatch.AUTO
EAGER = "eager"  # Transformers' name for the module's own forward: never registered, never shadowed
# decode-phase swaps this module performs (Transformers performs "grouped_mm" -> "batched_mm" itself)
DECODE_SWAPS: Mapping[str, str] = {PREFIX + "grouped_mm": PREFIX + "batched_mm"}
# token counts shown in reports for "auto": a decode step, small batches, a prefill
REPORT_TOKENS: tuple[int, ...] = (1, 16, 256, 4096)

_LOCK = threading.RLock()
_FORWARDS: dict[tuple[bool, str], Callable[..., torch.Tensor]] = {}  # (fp8 interface?, name) -> our function
_LOGGED: set[tuple[Any, ...]] = set()


# ---------------------------------------------------------------------------------------------------------
# Transformers version check
# ---------------------------------------------------------------------------------------------------------


def _transformers_error(found: str) -> ImportError:
    return ImportError(
        f"selector's Transformers integration needs transformers>={MIN_TRANSFORMERS} (the experts interface "
        "`transformers.integrations.moe.ExpertsInterface` that validates registered names, and "
        "`PreTrainedModel.get_experts_implementation` / per-sub-config `set_experts_implementation`); "
        f"found: {found}. fix: pip install -U 'transformers>={MIN_TRANSFORMERS}' "
        "(or: pip install 'selector[transformers]')."
    )


def check_transformers() -> Any:
    """The `transformers.integrations.moe` module, or ImportError naming the version this integration needs."""
    try:
        import transformers
    except ImportError:
        raise _transformers_error("transformers is not installed") from None
    version = getattr(transformers, "__version__", "?")
    where = f"transformers {version} at {getattr(transformers, '__file__', '?')}"
    try:
        from transformers.integrations import moe
        from transformers.modeling_utils import PreTrainedModel
    except ImportError as exc:
        raise _transformers_error(f"{where} ({exc})") from None
    needed = {
        "integrations.moe.ExpertsInterface": hasattr(moe, "ExpertsInterface"),
        "integrations.moe.ALL_EXPERTS_FUNCTIONS": hasattr(moe, "ALL_EXPERTS_FUNCTIONS"),
        "PreTrainedModel.get_experts_implementation": hasattr(PreTrainedModel, "get_experts_implementation"),
        "PreTrainedModel.set_experts_implementation": hasattr(PreTrainedModel, "set_experts_implementation"),
    }
    missing = [name for name, ok in needed.items() if not ok]
    if missing:
        raise _transformers_error(f"{where}, which lacks {', '.join(missing)}")
    return moe


# ---------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------


def _make_forward(request: str, quantized: bool = False) -> Callable[..., torch.Tensor]:
    """The function Transformers calls for one name: selector's dispatch with that request.

    `quantized`: the function for Transformers' FP8 experts interface (FP8Experts modules, fp8 or fp4
    weights): the module is marked with the selector_* quantisation attributes first, and "auto" falls back
    to Transformers' own FP8 functions where no selector backend takes the format.
    """

    def selector_experts_forward(
        module: torch.nn.Module,
        hidden_states: torch.Tensor,  # [T, H]
        top_k_index: torch.Tensor,  # [T, k]
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H]
        if quantized:
            _adopt_quantized(module, hidden_states.dtype)
            if request == AUTO:
                return _quantized_auto(module, hidden_states, top_k_index, top_k_weights)
        out = dispatch.run_experts(module, hidden_states, top_k_index, top_k_weights, implementation=request)
        if request == AUTO and not torch.compiler.is_compiling() and logger.isEnabledFor(logging.INFO):
            _log_auto_choice(module, hidden_states.shape[0], top_k_index.shape[1])
        return out

    kind = "fp8 " if quantized else ""
    selector_experts_forward.__qualname__ = selector_experts_forward.__name__ = (
        f"selector_experts_forward[{kind}{request}]"
    )
    selector_experts_forward._selector_request = request  # type: ignore[attr-defined]
    return selector_experts_forward


def _log_auto_choice(module: torch.nn.Module, num_tokens: int, top_k: int) -> None:
    name = dispatch.last_backend(module)
    problem = dispatch.problem_of(module, top_k)
    key = (problem, dispatch.token_bucket(num_tokens), name)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    logger.info(
        "selector auto: %s experts layer (%s), %d tokens (bucket %d) -> %s",
        type(module).__name__,
        _describe(problem),
        num_tokens,
        key[1],
        name,
    )


def _ours(fn: object) -> str | None:
    return getattr(fn, "_selector_request", None)


def _interfaces(moe: Any) -> list[tuple[Any, bool]]:
    """[(experts interface, holds quantised modules)]: the dense one, and the FP8 one where it exists."""
    out = [(moe.ALL_EXPERTS_FUNCTIONS, False)]
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:  # pragma: no cover - a Transformers without FP8 experts
        return out
    return out + [(ALL_FP8_EXPERTS_FUNCTIONS, True)]


def transformers_names() -> dict[str, str]:
    """{name Transformers accepts: selector request it runs} for every name selector registered."""
    return register_with_transformers()


def register_with_transformers() -> dict[str, str]:
    """Register "auto" and every selector backend into Transformers' experts interfaces. Idempotent.

    Both interfaces get the same names: the dense one and, where Transformers has it, the FP8 one (its
    FP8Experts modules dispatch through it). Calling it again after a plugin was added registers the new
    names and drops those of backends that left. Returns {Transformers name: selector request}.
    Raises ImportError when Transformers is missing or too old.
    """
    moe = check_transformers()
    interfaces = _interfaces(moe)
    registry = dispatch.get_backend_registry()
    with _LOCK:
        existing = [dict(interface.items()) for interface, _ in interfaces]
        wanted: dict[str, str] = {AUTO: AUTO}
        for backend in registry.names:
            wanted[PREFIX + backend] = backend
            # the bare name only where no interface of Transformers uses it for its own function
            if backend != EAGER and all(backend not in held or _ours(held[backend]) == backend for held in existing):
                wanted[backend] = backend
        for (interface, quantized), held in zip(interfaces, existing):
            mapping = type(interface)._global_mapping
            for key in [k for k in _FORWARDS if k[0] == quantized and k[1] not in wanted]:  # backend gone
                if _ours(mapping.get(key[1])) is not None:
                    del mapping[key[1]]
                del _FORWARDS[key]
            for name, request in wanted.items():
                fn = _FORWARDS.get((quantized, name))
                if fn is None or _ours(fn) != request:
                    fn = _FORWARDS[(quantized, name)] = _make_forward(request, quantized)
                if held.get(name) is not fn:
                    type(interface).register(name, fn)
        _install_decode_hook()
        return dict(wanted)


# ---------------------------------------------------------------------------------------------------------
# Quantised experts (Transformers' FP8Experts: fp8 block-scaled or fp4 weights)
# ---------------------------------------------------------------------------------------------------------

_DECODING: contextvars.ContextVar[bool] = contextvars.ContextVar("selector_hf_decoding", default=False)
_QUANT_PLANS: dict[tuple[Any, ...], str] = {}
TRANSFORMERS_FALLBACK = "transformers:"  # prefix of a plan that runs Transformers' own FP8 function


def _adopt_quantized(module: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """Mark an FP8Experts module with the selector_* attributes the ranking reads (once)."""
    # getattr, not a look into module.__dict__: this also runs while torch.compile traces, and Dynamo
    # (torch 2.11) cannot trace calls on a module's __dict__
    if getattr(module, "selector_weight_format", None) is not None:
        return
    try:
        from selector.quant import adopt_transformers_experts

        adopt_transformers_experts(module, compute_dtype=compute_dtype)
        return
    except (ImportError, ValueError) as exc:  # no quantisation module, or a format selector does not describe
        logger.debug("selector: %s: weight format described by dtype only (%s)", type(module).__name__, exc)
    weight = layers.up_weight(module)
    module.selector_weight_format = "fp4" if weight.dtype in (torch.int8, torch.uint8) else "fp8_block"
    module.__dict__.pop("_selector_problem", None)


def _quantized_plan(module: torch.nn.Module, num_tokens: int, top_k: int, decoding: bool) -> str:
    """A selector backend for this quantised layer, or Transformers' own FP8 function where none takes it.

    The fallback is what Transformers itself runs: grouped_mm, and batched_mm for the decode steps on an
    accelerator (its own decode-phase rule)."""
    problem = dispatch.problem_of(module, top_k)
    bucket = dispatch.token_bucket(num_tokens)
    swap = decoding and _accelerator_check(layers.up_weight(module).device)
    key = (problem, bucket, swap)
    plan = _QUANT_PLANS.get(key)
    if plan is None:
        best = dispatch.explain_module(module, num_tokens=bucket, top_k=top_k).best
        if best is None:
            best = TRANSFORMERS_FALLBACK + ("batched_mm" if swap else "grouped_mm")
        plan = _QUANT_PLANS[key] = best
    return plan


@torch.compiler.assume_constant_result
def _quantized_plan_constant(uid: str, top_k: int) -> str:
    # only constants cross into a function dynamo runs eagerly: the module goes by its tracked id. The decode
    # flag is read here, not in the traced caller: Dynamo cannot trace ContextVar.get (a graph break per layer).
    return _quantized_plan(dispatch.tracked_module(uid), TYPICAL_TOKENS, top_k, _DECODING.get())


def _quantized_auto(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    num_tokens, top_k = hidden_states.shape[0], top_k_index.shape[1]
    if torch.compiler.is_compiling():
        uid = dispatch.tracked_id(module)  # a getattr: traceable
        if uid is None:
            raise RuntimeError(
                "selector cannot choose a backend inside torch.compile for an experts module it has not seen: "
                "call the model once before compiling, or selector.set_experts_implementation(model, ...)"
            )
        plan = _quantized_plan_constant(uid, dispatch.traced_top_k(module))
    else:
        dispatch.track(module)
        plan = _quantized_plan(module, num_tokens, top_k, _DECODING.get())
    if plan.startswith(TRANSFORMERS_FALLBACK):
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

        if not torch.compiler.is_compiling():
            dispatch.note_backend(module, plan)
        fn = FP8ExpertsInterface._global_mapping[plan[len(TRANSFORMERS_FALLBACK) :]]
        return fn(module, hidden_states, top_k_index, top_k_weights)
    return dispatch.run_experts(module, hidden_states, top_k_index, top_k_weights, implementation=plan)


# ---------------------------------------------------------------------------------------------------------
# Finding experts modules of a Transformers model, and their sub-config
# ---------------------------------------------------------------------------------------------------------


def is_transformers_experts(module: torch.nn.Module) -> bool:
    """A module built by Transformers' `use_experts_implementation` (or following its convention)."""
    config = getattr(module, "config", None)
    return (
        config is not None
        and hasattr(config, "_experts_implementation")
        and "is_concatenated" in module.__dict__
        and hasattr(module, "down_proj")
        and (hasattr(module, "gate_up_proj") or hasattr(module, "up_proj"))
    )


def sub_config_keys(config: Any) -> list[str]:
    return [k for k in (getattr(config, "sub_configs", None) or {}) if getattr(config, k, None) is not None]


def _scope_of(root_config: Any, module_config: Any) -> str:
    if module_config is root_config:
        return ""
    for key in sub_config_keys(root_config):
        if getattr(root_config, key) is module_config:
            return key
    return ""


def experts_modules(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Module]]]:
    """{sub-config key ("" for the model's own config): [(module path, experts module), ...]}."""
    root_config = getattr(model, "config", None)
    out: dict[str, list[tuple[str, torch.nn.Module]]] = {}
    for path, module in model.named_modules():
        if is_transformers_experts(module):
            dispatch.track(module)  # so torch.compile can name it (see selector.dispatch.track)
            out.setdefault(_scope_of(root_config, module.config), []).append((path, module))
    return out


# ---------------------------------------------------------------------------------------------------------
# Requests: validation, set / get
# ---------------------------------------------------------------------------------------------------------


def accepted_names() -> list[str]:
    """Every name Transformers' experts interface accepts now (after registering selector's)."""
    moe = check_transformers()
    names = {EAGER, *moe.ALL_EXPERTS_FUNCTIONS.keys()}
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

        names |= set(ALL_FP8_EXPERTS_FUNCTIONS.keys())
    except ImportError:  # pragma: no cover - older layouts
        pass
    return sorted(names)


def validate_request(config: Any, request: str | Mapping[str, str]) -> dict[str, str]:
    """Check names and sub-config keys before anything loads; returns the request as a dict.

    Raises ValueError for an unknown name (listing the accepted ones) and for a dict key that matches no
    sub-config of `config` (listing its keys). A name that is known but cannot run here is not an error
    yet: the first forward raises, as for Transformers' own names.
    """
    register_with_transformers()
    request_dict = {"": request} if isinstance(request, str) else dict(request)
    keys = sub_config_keys(config) if config is not None else []
    unknown_keys = sorted(k for k in request_dict if k != "" and k not in keys)
    if unknown_keys:
        known = ", ".join(repr(k) for k in keys) or "none"
        raise ValueError(
            f"experts_implementation key(s) {', '.join(map(repr, unknown_keys))} match no sub-config of "
            f"{type(config).__name__}; its sub-config keys: {known} (and '' for the whole model)"
        )
    names = accepted_names()
    for key, name in request_dict.items():
        if not isinstance(name, str) or name not in names:
            where = f" for key {key!r}" if key else ""
            raise ValueError(
                f"unknown experts implementation {name!r}{where}; accepted: {', '.join(names)}. "
                "Third-party selector backends register through the 'selector.backends' entry points; "
                "`selector plugins` lists what loaded."
            )
    return request_dict


def set_experts_implementation(model: torch.nn.Module, implementation: str | Mapping[str, str]) -> None:
    """`model.set_experts_implementation(...)` with selector's checks: unknown names or sub-config keys raise."""
    request = validate_request(getattr(model, "config", None), implementation)
    model.set_experts_implementation(request if not isinstance(implementation, str) else implementation)


def get_experts_implementation(model: torch.nn.Module) -> dict[str, str | None]:
    """{"": the model's own, sub-config key: its own, ...}, as Transformers reports it."""
    return dict(model.get_experts_implementation())


# ---------------------------------------------------------------------------------------------------------
# Decode phase
# ---------------------------------------------------------------------------------------------------------


def _default_accelerator_check(device: torch.device) -> bool:
    return device.type != "cpu"


_accelerator_check: Callable[[torch.device], bool] = _default_accelerator_check


def set_accelerator_check(check: Callable[[torch.device], bool] | None) -> None:
    """Decide which devices get the decode swap (default: every device but the CPU). None restores it.

    Tests use it to run the GPU branch on a CPU; nothing else should need it.
    """
    global _accelerator_check
    _accelerator_check = check or _default_accelerator_check


def _scope_device(model: torch.nn.Module, members: Sequence[tuple[str, torch.nn.Module]]) -> torch.device:
    for _, module in members:
        weight = getattr(module, "gate_up_proj", None)
        if weight is None:
            weight = getattr(module, "up_proj", None)
        if isinstance(weight, torch.Tensor):
            return weight.device
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def decode_request(model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """(current request, request for the decode steps): selector's grouped_mm -> batched_mm on accelerators."""
    current = dict(model.get_experts_implementation())
    target = dict(current)
    if not any(isinstance(name, str) and name in DECODE_SWAPS for name in current.values()):
        return current, target  # the common case: nothing to walk
    scopes = experts_modules(model)
    for key, name in current.items():
        swap = DECODE_SWAPS.get(name) if isinstance(name, str) else None
        if swap is None:
            continue
        members = scopes.get(key, [])
        if key == "" and not members:  # the model's own key: follow the experts it holds, else its device
            members = [m for group in scopes.values() for m in group]
        if _accelerator_check(_scope_device(model, members)):
            target[key] = swap
    return current, target


@contextmanager
def decode_phase(model: torch.nn.Module) -> Iterator[None]:
    """The decode steps of generate(): selector's grouped_mm runs as batched_mm, restored on exit or error."""
    current, target = decode_request(model)
    if target == current:
        yield
        return
    logger.info("selector: decode steps: %s", _changes(current, target))
    model.set_experts_implementation(target)
    try:
        yield
    finally:
        model.set_experts_implementation(current)


def _changes(current: Mapping[str, Any], target: Mapping[str, Any]) -> str:
    return ", ".join(f"{k or '(model)'}: {current[k]} -> {v}" for k, v in target.items() if current.get(k) != v)


def _install_decode_hook() -> None:
    """Wrap GenerationMixin._optimize_model_for_decode: ours outside, Transformers' own swap inside."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:  # pragma: no cover
        return
    original = GenerationMixin.__dict__.get("_optimize_model_for_decode")
    if original is None:
        logger.warning(
            "selector: this Transformers has no GenerationMixin._optimize_model_for_decode; "
            "selector's grouped_mm is not swapped for batched_mm during decode ('auto' still adapts per call)"
        )
        return
    if getattr(original, "_selector_wraps", None) is not None:
        return

    def _optimize_model_for_decode(self: Any) -> Any:
        return _composed_decode(self, original)

    _optimize_model_for_decode._selector_wraps = original  # type: ignore[attr-defined]
    _optimize_model_for_decode.__doc__ = getattr(original, "__doc__", None)
    GenerationMixin._optimize_model_for_decode = _optimize_model_for_decode  # type: ignore[assignment]


@contextmanager
def _composed_decode(model: Any, original: Callable[[Any], Any]) -> Iterator[None]:
    token = _DECODING.set(True)  # read by quantised "auto" when it falls back to Transformers' FP8 functions
    try:
        with decode_phase(model), original(model):
            yield
    finally:
        _DECODING.reset(token)


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def _describe(problem: Problem) -> str:
    flags = [
        f"E={problem.num_experts}",
        f"H={problem.hidden_size}",
        f"I={problem.intermediate_size}",
        f"k={problem.top_k}",
        problem.dtype,
        problem.device,
        problem.activation,
    ]
    flags += [name for name, on in (("bias", problem.has_bias), ("transposed", problem.is_transposed),
                                    ("interleaved", problem.interleaved), ("custom-gate", problem.custom_gate),
                                    ("post-norm", problem.post_expert_norm)) if on]
    if problem.weight_format != "dense":
        flags.append(f"{problem.weight_format}/{problem.scale_format}")
    return " ".join(flags)


@dataclass(frozen=True)
class ScopeSelection:
    """What runs the experts layers of one sub-config (one entry per distinct layer shape)."""

    scope: str  # "" for the model's own config, else the sub-config key
    requested: str | None  # the name the config holds
    runs: str  # "selector" or "transformers"
    modules: tuple[str, ...]
    problem: Problem | None
    chosen: str | None  # the backend for a typical token count ("auto"), or the named one
    by_tokens: Mapping[int, str | None] = field(default_factory=dict)  # "auto": the pick per token count
    ranking: Ranking | None = None
    error: str | None = None  # an explicit backend that cannot run here: what the first forward raises

    @property
    def excluded(self) -> Mapping[str, Availability]:
        return self.ranking.excluded if self.ranking is not None else {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "requested": self.requested,
            "runs": self.runs,
            "modules": list(self.modules),
            "problem": self.problem.to_dict() if self.problem else None,
            "chosen": self.chosen,
            "by_tokens": {str(k): v for k, v in self.by_tokens.items()},
            "ranking": self.ranking.to_dict() if self.ranking else None,
            "error": self.error,
        }

    def lines(self) -> list[str]:
        scope = self.scope or "(model)"
        shape = _describe(self.problem) if self.problem else "?"
        chosen = self.chosen or "nothing runnable"
        head = f"{scope}: {self.requested} -> {chosen} [{len(self.modules)} layer(s), {shape}]"
        if self.runs == "transformers" and self.requested == AUTO:
            head += " (no selector backend takes this weight format: Transformers' own FP8 function)"
        elif self.runs == "transformers":
            head += " (Transformers' own implementation)"
        out = [head]
        if self.by_tokens:
            out.append("  per token count: " + ", ".join(f"T={t}: {n}" for t, n in self.by_tokens.items()))
        if self.ranking is not None:
            others = [f"{c.name} (est. {c.estimate * 1e6:.0f} us)" for c in self.ranking.candidates]
            if others:
                out.append("  runnable, best first: " + ", ".join(others))
            for name, why in self.ranking.excluded.items():
                fix = f" (fix: {why.remedy})" if why.remedy else ""
                out.append(f"  not {name}: {why.status.value}: {why.reason}{fix}")
        if self.error:
            out.append(f"  the first forward will raise: {self.error}")
        return out


@dataclass(frozen=True)
class SelectionReport:
    """Per sub-config: what was asked, what runs, and why not the other backends."""

    entries: tuple[ScopeSelection, ...]

    @property
    def scopes(self) -> dict[str, list[ScopeSelection]]:
        out: dict[str, list[ScopeSelection]] = {}
        for entry in self.entries:
            out.setdefault(entry.scope, []).append(entry)
        return out

    def __getitem__(self, scope: str) -> ScopeSelection:
        return self.scopes[scope][0]

    def __contains__(self, scope: object) -> bool:
        return scope in self.scopes

    def chosen(self) -> dict[str, str | None]:
        return {scope: entries[0].chosen for scope, entries in self.scopes.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [e.to_dict() for e in self.entries]}

    def __str__(self) -> str:
        if not self.entries:
            return "no experts layers that use Transformers' experts interface"
        return "\n".join(line for e in self.entries for line in e.lines())


def is_quantized(module: torch.nn.Module) -> bool:
    """Experts with one-byte weights (Transformers' FP8Experts: fp8, or fp4 packed in int8)."""
    return layers.up_weight(module).element_size() == 1


def _config_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    usable = isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize > 1
    return dtype if usable else torch.bfloat16


def _top_k(module: torch.nn.Module) -> int:
    return int(getattr(module, "top_k", 0) or getattr(module.config, "num_experts_per_tok", 0) or 1)


def selection_report(model: torch.nn.Module, tokens: Sequence[int] = REPORT_TOKENS) -> SelectionReport:
    """What each sub-config's experts layers run on this machine, at their current device and dtype."""
    names = register_with_transformers()
    entries: list[ScopeSelection] = []
    for scope, members in experts_modules(model).items():
        groups: dict[Problem, list[str]] = {}
        first: dict[Problem, torch.nn.Module] = {}
        requested: dict[Problem, str | None] = {}
        for path, module in members:
            if is_quantized(module):
                _adopt_quantized(module, _config_dtype(module.config))
            problem = dispatch.problem_of(module, _top_k(module))
            groups.setdefault(problem, []).append(path)
            first.setdefault(problem, module)
            requested.setdefault(problem, module.config._experts_implementation)
        for problem, paths in groups.items():
            module, req = first[problem], requested[problem]
            entries.append(_scope_entry(scope, req, tuple(paths), problem, module, names, tokens))
    return SelectionReport(tuple(entries))


def _scope_entry(
    scope: str,
    requested: str | None,
    paths: tuple[str, ...],
    problem: Problem,
    module: torch.nn.Module,
    names: Mapping[str, str],
    tokens: Sequence[int],
) -> ScopeSelection:
    request = names.get(requested) if isinstance(requested, str) else None
    if request is None:  # Transformers' own ("eager", "grouped_mm", ...)
        return ScopeSelection(scope, requested, "transformers", paths, problem, requested)
    ranking = dispatch.explain_module(module, top_k=problem.top_k)
    if request == AUTO and is_quantized(module):  # no selector backend for the format: Transformers' FP8 one
        by_tokens = {t: _quantized_plan(module, t, problem.top_k, decoding=False) for t in tokens}
        chosen = ranking.best or TRANSFORMERS_FALLBACK + "grouped_mm"
        runs = "selector" if ranking.best else "transformers"
        return ScopeSelection(scope, requested, runs, paths, problem, chosen, by_tokens, ranking)
    if request == AUTO:
        by_tokens = {t: dispatch.explain_module(module, num_tokens=t, top_k=problem.top_k).best for t in tokens}
        return ScopeSelection(scope, requested, "selector", paths, problem, ranking.best, by_tokens, ranking)
    error = None
    if request in ranking.excluded:
        why = ranking.excluded[request]
        error = f"{why.status.error_type.__name__}: {why.reason}"
    return ScopeSelection(scope, requested, "selector", paths, problem, request, {}, ranking, error)


def log_selection(model: torch.nn.Module, level: int = logging.INFO) -> SelectionReport:
    report = selection_report(model)
    if logger.isEnabledFor(level):
        for entry in report.entries:
            logger.log(level, "selector: %s", entry.lines()[0])
    if not report.entries:
        logger.warning(
            "selector: %s has no experts layers built with Transformers' experts interface; "
            "experts_implementation has no effect on it",
            type(model).__name__,
        )
    return report


# ---------------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------------

_HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "revision",
    "subfolder",
    "trust_remote_code",
    "proxies",
)


def from_pretrained(
    model_class: Any,
    pretrained_model_name_or_path: Any,
    *model_args: Any,
    experts_implementation: str | Mapping[str, str] = AUTO,
    **kwargs: Any,
) -> Any:
    """`model_class.from_pretrained(...)` with `experts_implementation="auto"` (or a name, or a dict per sub-config).

    Checks names and sub-config keys before loading, logs the choice, returns the model.
    `selection_report(model)` shows the choice per sub-config and why the other backends were not taken.
    """
    register_with_transformers()
    if not isinstance(experts_implementation, str):
        config = kwargs.get("config")
        if config is None or isinstance(config, (str, bytes)) or not hasattr(config, "sub_configs"):
            from transformers import AutoConfig

            hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path, **hub)
        validate_request(config, experts_implementation)
        experts_implementation = dict(experts_implementation)
    else:
        validate_request(None, experts_implementation)
    model = model_class.from_pretrained(
        pretrained_model_name_or_path, *model_args, experts_implementation=experts_implementation, **kwargs
    )
    log_selection(model)
    return model


def from_config(
    model_class: Any,
    config: Any,
    experts_implementation: str | Mapping[str, str] = AUTO,
    **kwargs: Any,
) -> Any:
    """`model_class.from_config(config, ...)` with selector's experts implementation (randomly initialised)."""
    register_with_transformers()
    validate_request(config, experts_implementation)
    request = experts_implementation if isinstance(experts_implementation, str) else dict(experts_implementation)
    # Auto classes have from_config; a concrete model class has _from_config (the same path, no hub access)
    build = getattr(model_class, "from_config", None) or model_class._from_config
    model = build(config, experts_implementation=request, **kwargs)
    log_selection(model)
    return model


def compile_config(
    mode: str = "reduce-overhead", *, fullgraph: bool = True, skip_module_guards: bool = False, backend: str = "inductor"
) -> Any:
    """A Transformers CompileConfig for generate()'s compiled decode step (pass it as `compile_config=`).

    skip_module_guards: Dynamo stops guarding the attributes of torch's own nn modules
    (torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe), which the compiled step otherwise checks on every
    call. On an H200, Qwen1.5-MoE-A2.7B at batch 1 with "auto": 5.30 -> 4.48 ms/token (benchmarks/README.md).
    Only for a model whose modules stay as they are between calls: a changed attribute is no longer noticed.
    torch.compile takes a mode or options, not both, so with the filter the mode goes in as its Inductor options.
    """
    check_transformers()
    from transformers import CompileConfig

    if not skip_module_guards:
        return CompileConfig(backend=backend, mode=mode, fullgraph=fullgraph)
    guard_filter = getattr(torch.compiler, "skip_guard_on_inbuilt_nn_modules_unsafe", None)
    if guard_filter is None:
        raise ImportError(f"skip_module_guards needs torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe "
                          f"(torch >= 2.7); this is torch {torch.__version__}")  # fmt: skip
    options: dict[str, Any] = {}
    if backend == "inductor":
        from torch._inductor import list_mode_options

        options.update(list_mode_options(mode or "default"))
    options["guard_filter_fn"] = guard_filter
    return CompileConfig(backend=backend, mode=None, options=options, fullgraph=fullgraph)


def _register_on_import() -> None:
    try:
        register_with_transformers()
    except ImportError as exc:  # from_pretrained and friends raise it again, with the same message
        logger.debug("selector.hf: not registered with Transformers: %s", exc)


_register_on_import()

__all__ = [
    "AUTO",
    "DECODE_SWAPS",
    "MIN_TRANSFORMERS",
    "PREFIX",
    "ScopeSelection",
    "SelectionReport",
    "accepted_names",
    "check_transformers",
    "compile_config",
    "decode_phase",
    "decode_request",
    "experts_modules",
    "from_config",
    "from_pretrained",
    "get_experts_implementation",
    "log_selection",
    "register_with_transformers",
    "selection_report",
    "set_accelerator_check",
    "set_experts_implementation",
    "transformers_names",
    "validate_request",
]
