"""Checks the inputs of an experts layer at the boundary, before any backend sees them.

Level from SELECTOR_VALIDATE:
- "full": shapes, dtypes, and the values of ids and weights on every call (one device sync per call);
- "first" (the default on GPUs): values on the first call of each module and input shape, shapes after;
  a sync per layer per decode step would stall the host that feeds the GPU;
- "shapes": no value checks on the host; "off": nothing, the device-side guard included.
Without the variable, CPU tensors get "full" (a sync costs nothing there). Value checks are skipped while
torch.compile traces or a CUDA graph captures, where reading values is impossible.

At every level but "off" the backends also guard the values on the device, on every call and without a sync
(selector.guard): bad slots turn their tokens' rows NaN and are raised at the next call or `selector.check()`.

Expert ids must be int64 or int32 at every level but "off": uint8, bool, int8, int16, float and complex ids
are refused with the fix (`.long()`), never read as a mask or converted behind the caller's back.
"""

from __future__ import annotations

import torch

from selector import settings
from selector.errors import ExpertsInputError

LEVEL_VARIABLE = "SELECTOR_VALIDATE"
LEVELS = settings.SETTINGS[LEVEL_VARIABLE].choices


# A constant under torch.compile: run once while tracing, the result baked in. Read in traced code, the
# environment lookup adds guards that the compiled model checks on every call; the level that shapes the
# traced checks is the one set when the model was compiled (values are never checked there).
@torch.compiler.assume_constant_result
def validation_level(on_gpu: bool = False) -> str:
    level = settings.get(LEVEL_VARIABLE)  # a ValueError naming the variable for a value outside LEVELS
    return level or ("first" if on_gpu else "full")


# Expert ids index weight stacks (`w[ids]`), which torch reads as positions only for int32 and int64: a uint8 or
# bool tensor is read as a mask (silently the wrong experts when its length matches), int8/int16 raise deep in a
# backend, floats are no ids at all. Converting here would hide a copy on every call; the caller converts once.
ID_DTYPES = (torch.int32, torch.int64)


def _id_dtype_message(dtype: torch.dtype) -> str:
    if dtype in (torch.uint8, torch.bool):
        why = "torch indexes with it as a mask, not as expert positions"
    elif dtype.is_floating_point or dtype.is_complex:
        why = "expert ids are integers"
    else:
        why = "backends index the weight stacks with it, which torch allows only for int32 and int64"
    return f"top_k_index must be an integer tensor of int64 or int32, got {dtype} ({why}); fix: pass top_k_index.long()"


def _capturing(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def validate_inputs(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    hidden_size: int,
    expert_parallel: bool = False,
    level: str | None = None,
    seen: set[tuple[object, ...]] | None = None,
) -> None:
    """Raise ExpertsInputError with a precise message for inputs that would give garbage.

    `seen`: the call signatures (shapes, dtypes, devices, sizes, level) already checked as fully as their level
    asks, owned by the caller (one set per module); updated here. A signature in it returns at once: the shape
    checks are a function of the signature alone, and at level "first" its values were checked once.
    """
    level = level or validation_level(on_gpu=hidden_states.device.type != "cpu")
    if level == "off":
        return
    signature = None
    if seen is not None and level != "full":
        signature = (hidden_states.shape, top_k_index.shape, top_k_weights.shape, hidden_states.dtype,
                     top_k_index.dtype, top_k_weights.dtype, hidden_states.device, top_k_index.device,
                     top_k_weights.device, num_experts, hidden_size, expert_parallel, level)  # fmt: skip
        if signature in seen:
            return
    _check_shapes(hidden_states, top_k_index, top_k_weights, hidden_size)
    if level in ("shapes", "off") or top_k_index.numel() == 0:
        _remember(seen, signature)
        return
    if _capturing(hidden_states):  # values unreadable now: a later call of this signature checks them
        return
    _check_values(top_k_index, top_k_weights, num_experts, expert_parallel)
    _remember(seen, signature)


def _remember(seen: set[tuple[object, ...]] | None, signature: tuple[object, ...] | None) -> None:
    if seen is not None and signature is not None:
        if len(seen) >= 256:  # a caller cycling through many shapes: start again rather than grow
            seen.clear()
        seen.add(signature)


def _check_shapes(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, hidden_size: int
) -> None:
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size:
        raise ExpertsInputError(
            f"hidden_states must be [num_tokens, {hidden_size}], got {list(hidden_states.shape)}"
        )
    if not hidden_states.is_floating_point():
        raise ExpertsInputError(f"hidden_states must be floating point, got {hidden_states.dtype}")
    tokens = hidden_states.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens:
        raise ExpertsInputError(f"top_k_index must be [{tokens}, k], got {list(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ExpertsInputError(
            f"top_k_weights {list(top_k_weights.shape)} must have the shape of top_k_index {list(top_k_index.shape)}"
        )
    if top_k_index.dtype not in ID_DTYPES:
        raise ExpertsInputError(_id_dtype_message(top_k_index.dtype))
    if not top_k_weights.is_floating_point():
        raise ExpertsInputError(f"top_k_weights must be floating point, got {top_k_weights.dtype}")
    # compared pairwise, not as a set of devices: plain comparisons are what torch.compile folds everywhere
    if top_k_index.device != hidden_states.device or top_k_weights.device != hidden_states.device:
        devices = sorted({str(t.device) for t in (hidden_states, top_k_index, top_k_weights)})
        raise ExpertsInputError(f"inputs are on different devices: {devices}")


def _check_values(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int, expert_parallel: bool) -> None:
    # One sync for all value checks: min id, max id, count of non-finite weights.
    stats = torch.stack(
        [
            top_k_index.min().to(torch.float64),
            top_k_index.max().to(torch.float64),
            (~torch.isfinite(top_k_weights)).sum().to(torch.float64),
        ]
    ).tolist()
    low, high, bad_weights = stats
    limit = num_experts if expert_parallel else num_experts - 1
    if low < 0 or high > limit:
        allowed = f"[0, {num_experts})" + (f" or the expert-parallel sentinel {num_experts}" if expert_parallel else "")
        raise ExpertsInputError(
            f"expert ids must lie in {allowed}; got ids from {int(low)} to {int(high)}"
        )
    if bad_weights:
        raise ExpertsInputError(f"top_k_weights holds {int(bad_weights)} NaN or infinite value(s)")
