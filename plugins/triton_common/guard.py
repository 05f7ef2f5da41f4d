"""The routing guard's device side (selector.guard): finding bad expert ids and weights inside a kernel.

- ``check_slots`` / ``record_faults`` / ``check_pairs``: jitted pieces the align kernels (and the fused decode
  kernel) call on the pairs they read anyway (no launch of their own on the fused path);
- ``sanitize_triton(ids, weights, guard)``: what ``selector.guard.sanitize_routing`` runs on a GPU (registered
  when this module is imported), one launch: bad slots get weight NaN and ``selector.guard.safe_id`` (E, the
  dropped id, for backends that skip it; else expert 0): their token's output turns NaN, nobody else's changes;
  the flag records them. On a CPU, and without Triton, the same runs in torch ops
  (``selector.guard.sanitize_torch``).
"""

from __future__ import annotations

import torch

from selector.guard import RoutingGuard, register_cuda_sanitizer, safe_id, sanitize_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch backends run without Triton
    triton = None

SANITIZE_BLOCK = 1024

if triton is not None:
    from .launch import cdiv, launch, next_pow2

    @triton.jit
    def check_slots(ids, w, in_range, limit):
        """(bad id mask, bad weight mask) of one block of slots; ids as loaded (any integer width), w any float."""
        bad_id = in_range & ((ids < 0) | (ids >= limit))
        bad_w = in_range & ~(tl.abs(w.to(tl.float32)) < float("inf"))  # NaN compares false too
        return bad_id, bad_w

    @triton.jit
    def reported_value(ids, bad_id):
        """The largest bad id of a block, clamped to int32 (-2**31 where there is none)."""
        clamped = tl.minimum(tl.maximum(ids, -2147483648), 2147483647).to(tl.int32)
        return tl.max(tl.where(bad_id, clamped, -2147483648), axis=0)

    @triton.jit
    def record_faults(flag_ptr, host_ptr, tag, n_ids, n_weights, value):
        """Add a program's counts to the flag; the first layer to claim the flag also leaves its tag and value."""
        if n_ids + n_weights > 0:
            tl.atomic_add(flag_ptr, n_ids)
            tl.atomic_add(flag_ptr + 1, n_weights)
            old = tl.atomic_cas(flag_ptr + 2, 0, tag)
            tl.store(flag_ptr + 3, tl.where(n_ids > 0, value, 0), mask=old == 0)
            tl.store(host_ptr, tag)  # pinned host memory: the host sees it without a sync

    @triton.jit
    def check_pairs(ids_ptr, wts_ptr, num_pairs, flag_ptr, host_ptr, limit, tag, CHUNK: tl.constexpr):
        """One program's guard work over the flat routing: checks pairs 0 .. num_pairs - 1, CHUNK at a time, and
        records their faults once."""
        n_ids = tl.full([], 0, tl.int32)
        n_w = tl.full([], 0, tl.int32)
        value = tl.full([], -2147483648, tl.int32)
        for s in range(0, num_pairs, CHUNK):
            offs = s + tl.arange(0, CHUNK)
            in_range = offs < num_pairs
            raw = tl.load(ids_ptr + offs, mask=in_range, other=0)
            bad_id, bad_w = check_slots(raw, tl.load(wts_ptr + offs, mask=in_range, other=0.0), in_range, limit)
            n_ids += tl.sum(bad_id.to(tl.int32), axis=0)
            n_w += tl.sum(bad_w.to(tl.int32), axis=0)
            value = tl.maximum(value, reported_value(raw, bad_id))
        record_faults(flag_ptr, host_ptr, tag, n_ids, n_w, value)

    @triton.jit(do_not_specialize=["n", "limit", "tag", "safe"])
    def _sanitize_kernel(
        ids_ptr,
        w_ptr,
        ids_out_ptr,
        w_out_ptr,
        flag_ptr,
        host_ptr,
        n,
        limit,
        tag,
        safe,
        BLOCK: tl.constexpr,
        DROP: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < n
        ids = tl.load(ids_ptr + offs, mask=in_range, other=0)
        w = tl.load(w_ptr + offs, mask=in_range, other=0.0)
        bad_id, bad_w = check_slots(ids, w, in_range, limit)
        moved = bad_id
        if DROP:  # a bad weight's slot leaves the matmuls too
            moved = bad_id | bad_w
        tl.store(ids_out_ptr + offs, tl.where(moved, tl.zeros_like(ids) + safe, ids), mask=in_range)
        nan = tl.full([BLOCK], float("nan"), w.dtype)
        tl.store(w_out_ptr + offs, tl.where(bad_id | bad_w, nan, w), mask=in_range)
        n_ids = tl.sum(bad_id.to(tl.int32), axis=0)
        n_w = tl.sum(bad_w.to(tl.int32), axis=0)
        record_faults(flag_ptr, host_ptr, tag, n_ids, n_w, reported_value(ids, bad_id))


def sanitize_triton(
    ids: torch.Tensor, weights: torch.Tensor, guard: RoutingGuard, drop: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sanitize_torch`` in one Triton launch (the GPU path; the interpreter runs it on a CPU in tests)."""
    shape = ids.shape
    flat_ids, flat_w = ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    n = flat_ids.numel()
    clean_ids, clean_w = torch.empty_like(flat_ids), torch.empty_like(flat_w)
    if n:
        limit = guard.num_experts + 1 if guard.sentinel else guard.num_experts
        block = min(SANITIZE_BLOCK, max(16, next_pow2(n)))  # decode: one small program, not 1024 lanes
        launch(
            _sanitize_kernel,
            (cdiv(n, block),),
            (flat_ids, flat_w, clean_ids, clean_w, guard.flag, guard.host, n, limit, guard.tag, safe_id(guard, drop)),
            dict(BLOCK=block, DROP=drop),
            1 if block <= 128 else 4,
        )
    return clean_ids.view(shape), clean_w.view(shape)


def sanitize_with(
    guard: RoutingGuard | None, ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``selector.guard.sanitize_routing`` with a guard resolved ahead (a backend's plan holds the layer's guard
    code, not the module): bad slots get expert 0 and weight NaN, recorded in the device flag."""
    if guard is None or ids.numel() == 0:
        return ids, weights
    if not (ids.is_cuda and triton is not None):
        return sanitize_torch(ids, weights, guard)
    clean_ids, clean_w = sanitize_triton(ids, weights, guard)
    if weights.requires_grad and torch.is_grad_enabled():
        # the kernel's copy is not differentiable: its values with the input's gradient path
        clean_w = weights + (clean_w - weights).detach()
    return clean_ids, clean_w


if triton is not None:
    register_cuda_sanitizer(sanitize_triton)
