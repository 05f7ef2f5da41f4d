"""Launching Triton kernels from the host: a cache of compiled kernels, host arithmetic, scratch buffers."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:  # host-side TMA descriptors (Triton >= 3.4), keyed by the fast launch path
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

# Triton decides at decoration time whether its kernels run in the interpreter; so do the kernels' host sides.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Tests set this to fill every buffer with garbage (NaN / out-of-range ids) before the kernels run, so that
# any element a kernel fails to write shows up in the result. Costs extra fill launches: off by default.
POISON = False


def empty(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device, poison: Any) -> torch.Tensor:
    """torch.empty, filled with `poison` while POISON is set."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        t.fill_(poison)
    return t


def repoison(t: torch.Tensor, poison: Any) -> None:
    """Fill `t` with `poison` while POISON is set: a buffer that takes over another's memory starts as garbage
    too."""
    if POISON:
        t.fill_(poison)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division: triton.cdiv is a constexpr function, whose wrapper costs microseconds per call."""
    return -(-a // b)


# Launch through a cache of compiled kernels keyed by everything Triton specialises on (constexprs, launch
# options, argument dtypes, 16-byte pointer alignment, ints ==1 / %16 / 32-bit), skipping the JIT's own
# dispatch: at decode the launches are host-bound.
_LAUNCH_CACHE: dict = {}


def _spec(a: Any) -> Any:
    if type(a) is int:  # most arguments (sizes, strides): the cheapest test first
        return a == 1, a & 15 == 0, -(1 << 31) <= a < (1 << 31)
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if TensorDescriptor is not None and isinstance(a, TensorDescriptor):  # what Triton specialises a TMA one on
        return "desc", a.base.dtype, tuple(a.block_shape), a.padding
    if hasattr(a, "layout") and hasattr(a, "block_shape"):  # a Gluon descriptor: its shared-memory layout too
        return "gluon desc", a.base.dtype, tuple(a.block_shape), a.padding, a.layout
    return a


_CAPABILITY: dict[int, tuple[int, int]] = {}


def tma_device(device: torch.device) -> bool:
    """Whether host-side TMA descriptors run on `device`: a Triton that has them and an NVIDIA GPU of compute
    capability 9.0 or more (ROCm reports its own architectures as (9, x)), or the interpreter, for the tests."""
    if TensorDescriptor is None:
        return False
    if device.type != "cuda":
        return INTERPRET
    if torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index] >= (9, 0)


def tma_weights(w: torch.Tensor) -> bool:
    """Whether a descriptor over the 2-D view [E * rows, K] of weights `w` [E, rows, K] can read them: stored
    contiguously, rows of a multiple of 16 bytes from a 16-byte aligned start, fewer than 2^31 rows in all (int32
    coordinates)."""
    return (
        w.is_contiguous()
        and (w.shape[2] * w.element_size()) % 16 == 0
        and w.data_ptr() % 16 == 0
        and w.shape[0] * w.shape[1] < 2**31
    )


def launch(fn: Callable, grid: tuple, args: tuple, consts: dict, num_warps: int, num_stages: int = 3) -> None:
    """fn[grid](*args, **consts): runtime arguments positional, every constexpr in `consts`. Repeated launches
    skip Triton's own argument dispatch (tens of us; TMA descriptors too: the compiled kernel's launcher encodes
    them)."""
    if INTERPRET or torch.compiler.is_compiling():  # Dynamo cannot trace data_ptr()
        fn[grid](*args, **consts, num_warps=num_warps, num_stages=num_stages)
        return
    dev = args[0].device if isinstance(args[0], torch.Tensor) else args[0].base.device  # a tensor or a descriptor
    key = (fn, dev.index, num_warps, num_stages, *consts.values(), *map(_spec, args))
    kernel = _LAUNCH_CACHE.get(key)
    if kernel is None:
        kernel = fn[grid](*args, **consts, num_warps=num_warps, num_stages=num_stages)
        if kernel is not None and hasattr(kernel, "__getitem__"):
            _LAUNCH_CACHE[key] = kernel
        return
    names = fn.arg_names[len(args) :]  # the constexprs, declared after the runtime arguments, in order
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    kernel[grid3](*args, *[consts[n] for n in names], stream=current_stream(dev))


def current_stream(device: torch.device) -> int:
    """The handle of `device`'s current CUDA stream, read as Triton's own launcher reads it: torch.cuda.current_stream
    builds a Stream object on every call, a good part of a launch's host time on a slow host."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
