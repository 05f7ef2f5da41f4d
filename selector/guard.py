"""The routing guard on the device: bad expert ids and weights found without a host sync, and reported.

Values of ids and weights are checked on the host only on a module's first call per shape (selector.validation:
a sync per call would stall the host that feeds the GPU). Every later call is guarded on the device: the
backend's routing step (fused into the Triton align, or one small kernel before a torch backend) finds ids
outside [0, E) (other than the expert-parallel sentinel E on an expert-parallel module) and NaN / infinite
weights, takes those slots out of every other token's computation (grouped_mm and eager: the dropped id E, which
they skip like an expert-parallel sentinel; the rest: expert 0), sets their tokens' outputs to NaN (never
another token's, never an out-of-bounds read, never a device assert) and records the fault in a small flag per
device:

- ``flag`` (int32 [FLAG_WORDS], device memory, atomics): bad ids, bad weights, the tag of the layer whose fault
  was recorded first and one bad id value of that fault;
- ``host`` (int32 [1], pinned host memory the kernels write straight into): nonzero once any fault was recorded.

``raise_pending(device)`` reads ``host`` (a plain memory read, no sync, no launch) at the start of every call
through selector and, when set, syncs once and raises ExpertsInputError naming the layer, a bad value and the
counts; ``check()`` syncs and raises the same (after CUDA-graph replays, whose captured kernels update the flag
too). The flag is then cleared. Levels (SELECTOR_VALIDATE): the guard runs at every level but "off"; it does
not run while torch.compile traces a torch backend (the fused Triton backends guard inside their custom ops).
"""

from __future__ import annotations

import ctypes
import itertools
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.compiler import is_compiling

from selector import layers
from selector.errors import ExpertsInputError, routing_fault_message
from selector.validation import validation_level

FLAG_WORDS = 8
BAD_IDS, BAD_WEIGHTS, LAYER, VALUE = 0, 1, 2, 3  # words of the device flag
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1  # a reported id value is clamped to int32
_TAG = "_selector_guard_tag"  # the module's layer tag, in its __dict__
_CACHED = "_selector_guard"  # the module's last resolved guard and what it was resolved for, in its __dict__


class Flags(NamedTuple):
    """One device's fault flag and its host mirror (``host_word`` reads the mirror without torch)."""

    flag: torch.Tensor
    host: torch.Tensor
    host_word: ctypes._Pointer  # type: ignore[type-arg]


class RoutingGuard(NamedTuple):
    """What a routing step needs to guard one layer's call: where to record, which layer, what is allowed."""

    flag: torch.Tensor
    host: torch.Tensor
    tag: int
    num_experts: int
    sentinel: bool  # an id equal to num_experts is the expert-parallel sentinel (not a fault)


_FLAGS: dict[torch.device, Flags] = {}
_GUARDS: dict[tuple[int, torch.device, int], RoutingGuard] = {}
_LAYERS: dict[int, tuple[weakref.ref, str]] = {}  # tag -> (module, name)
_NEXT_TAG = itertools.count(1)
_NO_LAYER = (lambda: None, "")  # what _LAYERS.get gives for a tag it does not hold


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def flags_for(device: torch.device, create: bool = True) -> Flags | None:
    """The device's flag, allocated on first use (never while a CUDA graph captures: the memory would belong
    to the graph's pool; None then, and the call goes unguarded)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _FLAGS.get(device)
    if found is not None or not create or _capturing(device):
        return found
    flag = torch.zeros(FLAG_WORDS, dtype=torch.int32, device=device)
    # on a CPU the flag is host memory already: its layer word is the mirror
    host = flag[LAYER : LAYER + 1] if device.type == "cpu" else torch.zeros(1, dtype=torch.int32).pin_memory()
    word = ctypes.cast(host.data_ptr(), ctypes.POINTER(ctypes.c_int32))
    _FLAGS[device] = Flags(flag, host, word)
    return _FLAGS[device]


def layer_tag(module: torch.nn.Module) -> int:
    """The module's tag in the flag (assigned on first use; 0 while torch.compile traces a module without one)."""
    if torch.compiler.is_compiling():
        return int(getattr(module, _TAG, 0))
    tag = module.__dict__.get(_TAG)
    if tag is None or _LAYERS.get(tag, _NO_LAYER)[0]() is not module:  # new, or a copy that kept the tag
        tag = next(_NEXT_TAG)
        module.__dict__[_TAG] = tag
        _LAYERS[tag] = (weakref.ref(module), f"{type(module).__name__} #{tag}")
    return tag


def name_layers(model: torch.nn.Module) -> None:
    """Name every tagged experts module of `model` by its qualified name in errors (else class name and tag)."""
    for name, module in model.named_modules():
        tag = module.__dict__.get(_TAG)
        if tag is not None and tag in _LAYERS and _LAYERS[tag][0]() is module:
            _LAYERS[tag] = (_LAYERS[tag][0], name or type(module).__name__)


def guard_code(module: torch.nn.Module, device: torch.device) -> int:
    """The guard of the module's call as one int a custom op can carry: 0 off, else 2 * tag + sentinel."""
    if validation_level(on_gpu=device.type != "cpu") == "off":
        return 0
    if is_compiling():
        # each global or helper read here is one more guard on every call of a compiled model: attributes only
        # (the tag was given by an eager call; a constant per layer in the traced code)
        tag = getattr(module, "_selector_guard_tag", 0)
        return 0 if tag == 0 else 2 * tag + int(bool(getattr(module, "_is_expert_parallel", False)))
    return 2 * layer_tag(module) + int(layers.is_expert_parallel(module))


def resolve(code: int, device: torch.device, num_experts: int) -> RoutingGuard | None:
    """The RoutingGuard for a `guard_code` on `device` (None: unguarded). Cached: this runs on every call."""
    if code == 0:
        return None
    key = (code, device, num_experts)
    found = _GUARDS.get(key)
    if found is None:
        flags = flags_for(device)
        if flags is None:
            return None
        found = RoutingGuard(flags.flag, flags.host, code // 2, num_experts, bool(code & 1))
        if len(_GUARDS) > 4096:
            _GUARDS.clear()
        _GUARDS[key] = found
    return found


def routing_guard(
    module: torch.nn.Module, device: torch.device, num_experts: int | None = None
) -> RoutingGuard | None:
    """The guard of one eager call of `module` on `device`, or None (level "off", tracing, or no flag yet).
    `num_experts`: the size of the id space when it is not the module's own (global ids across ranks)."""
    if torch.compiler.is_compiling():
        return None
    if validation_level(on_gpu=device.type != "cpu") == "off":  # read per call: the level may change between calls
        return None
    count = int(module.num_experts if num_experts is None else num_experts)
    # the lookup cached on the module: id() tells a copy, which keeps the __dict__ but needs a tag of its own
    key = (id(module), device, count, layers.is_expert_parallel(module))
    cached = module.__dict__.get(_CACHED)
    if cached is not None and cached[0] == key:
        return cached[1]
    found = resolve(guard_code(module, device), device, count)
    if found is not None:
        module.__dict__[_CACHED] = (key, found)
    return found


def safe_id(guard: RoutingGuard, drop: bool) -> int:
    """The id a bad slot gets: E (dropped: the backend skips it like an expert-parallel sentinel, so no matmul
    batch changes) or 0 (a backend without a sentinel path computes it on expert 0)."""
    return guard.num_experts if drop else 0


def sanitize_torch(
    ids: torch.Tensor, weights: torch.Tensor, guard: RoutingGuard, drop: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing guard in torch ops (CPU, or no Triton): bad slots get weight NaN and `safe_id` (with `drop`,
    bad-weight slots are dropped too), which makes their token's output NaN in every backend and leaves every
    other token's untouched; the flag records them. No host sync: the counts and the recorded value stay tensors."""
    if ids.numel() == 0:
        return ids, weights
    limit = guard.num_experts + 1 if guard.sentinel else guard.num_experts
    bad_id = (ids < 0) | (ids >= limit)
    bad_w = ~torch.isfinite(weights)
    bad = bad_id | bad_w
    clean_ids = ids.masked_fill(bad if drop else bad_id, safe_id(guard, drop))
    clean_weights = weights.masked_fill(bad, float("nan"))
    flag = guard.flag
    n_ids = bad_id.sum(dtype=torch.int32)
    n_bad = bad.sum(dtype=torch.int32)
    flag[BAD_IDS : BAD_WEIGHTS + 1] += torch.stack([n_ids, bad_w.sum(dtype=torch.int32)])
    claim = (flag[LAYER] == 0) & (n_bad > 0)
    flat_ids, flat_bad = ids.reshape(-1), bad_id.reshape(-1)
    first = flat_ids[flat_bad.to(torch.int32).argmax()].clamp(INT32_MIN, INT32_MAX).to(torch.int32)
    value = torch.where(n_ids > 0, first, torch.zeros_like(first))
    flag[VALUE] = torch.where(claim, value, flag[VALUE])
    flag[LAYER] = torch.where(claim, torch.full_like(flag[LAYER], guard.tag), flag[LAYER])
    if guard.host.data_ptr() != flag[LAYER:].data_ptr():  # a CUDA device without Triton: mirror by a copy
        guard.host.copy_(flag[LAYER : LAYER + 1], non_blocking=True)
    return clean_ids, clean_weights


Sanitizer = Callable[[torch.Tensor, torch.Tensor, RoutingGuard, bool], tuple[torch.Tensor, torch.Tensor]]
_CUDA_SANITIZER: Sanitizer | None = None


def register_cuda_sanitizer(kernel: Sanitizer) -> None:
    """Let `sanitize_routing` run `kernel(ids, weights, guard, drop)` (one launch) on CUDA tensors instead of the
    torch ops (about a dozen launches). plugins/triton_common/guard.py registers its Triton kernel when imported."""
    global _CUDA_SANITIZER
    _CUDA_SANITIZER = kernel


def guard_routing(
    module: torch.nn.Module,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    drop: bool = False,
    num_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`sanitize_routing`, and whether the guard ran (a backend that drops bad slots then treats id E as a
    sentinel on a module that is not expert-parallel too)."""
    guard = routing_guard(module, top_k_index.device, num_experts)
    if guard is None or top_k_index.numel() == 0:
        return top_k_index, top_k_weights, False
    if top_k_index.is_cuda and _CUDA_SANITIZER is not None:
        ids, weights = _CUDA_SANITIZER(top_k_index, top_k_weights, guard, drop)
        if top_k_weights.requires_grad and torch.is_grad_enabled():
            # the kernel's copy is not differentiable: keep its values (equal to the input's on every clean
            # slot, NaN on a bad one) and the input's gradient path
            weights = top_k_weights + (weights - top_k_weights).detach()
        return ids, weights, True
    return (*sanitize_torch(top_k_index, top_k_weights, guard, drop), True)


def sanitize_routing(
    module: torch.nn.Module,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    drop: bool = False,
    num_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) a backend can run whatever the router produced: bad slots get weight NaN and `safe_id`
    (E with `drop`: out of every matmul, for backends that skip id E; else expert 0), recorded in the device flag.
    `num_experts`: the id space when it is not the module's (global ids). Unchanged where the guard is off
    (SELECTOR_VALIDATE=off, tracing)."""
    return guard_routing(module, top_k_index, top_k_weights, drop, num_experts)[:2]


def _layer(tag: int) -> tuple[str, int | None, bool]:
    entry = _LAYERS.get(tag)
    module = entry[0]() if entry is not None else None
    name = entry[1] if entry is not None else f"#{tag}"
    if module is None:
        return name, None, False
    return name, int(module.num_experts), layers.is_expert_parallel(module)


def _raise_from(flags: Flags) -> None:
    words = flags.flag.tolist()  # the one sync, on the fault path only
    flags.flag.zero_()
    flags.host.zero_()
    if words[BAD_IDS] == 0 and words[BAD_WEIGHTS] == 0:
        return
    name, num_experts, expert_parallel = _layer(words[LAYER])
    raise ExpertsInputError(
        routing_fault_message(name, words[BAD_IDS], words[BAD_WEIGHTS], words[VALUE], num_experts, expert_parallel)
    )


def raise_pending(device: torch.device) -> None:
    """Raise ExpertsInputError for a fault the device recorded in an earlier call (no sync unless there is one)."""
    flags = _FLAGS.get(device)
    if flags is None or flags.host_word[0] == 0 or _capturing(device):
        return
    _raise_from(flags)


def check(model: torch.nn.Module | None = None) -> None:
    """Wait for the work queued so far and raise ExpertsInputError if any guarded call saw bad routing input
    (bad expert ids, NaN / infinite weights) since the last report; `model` names its layers in the message."""
    if model is not None:
        name_layers(model)
    for device, flags in list(_FLAGS.items()):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _raise_from(flags)


def clear() -> None:
    """Forget every fault recorded so far, unreported (waits for the queued work first)."""
    for device, flags in list(_FLAGS.items()):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        flags.flag.zero_()
        flags.host.zero_()


def pending_faults(device: torch.device) -> dict[str, int]:
    """The device flag's counts as they stand (syncs; for tests and `selector doctor`-style reports)."""
    flags = flags_for(device, create=False)  # "cuda" means the current device, as where the flag was made
    if flags is None:
        return {"bad_ids": 0, "bad_weights": 0, "layer": 0, "value": 0}
    words = flags.flag.tolist()
    return {"bad_ids": words[BAD_IDS], "bad_weights": words[BAD_WEIGHTS], "layer": words[LAYER], "value": words[VALUE]}


__all__ = [
    "FLAG_WORDS",
    "Flags",
    "RoutingGuard",
    "Sanitizer",
    "check",
    "clear",
    "flags_for",
    "guard_code",
    "guard_routing",
    "layer_tag",
    "name_layers",
    "pending_faults",
    "raise_pending",
    "register_cuda_sanitizer",
    "resolve",
    "routing_guard",
    "safe_id",
    "sanitize_routing",
    "sanitize_torch",
]
