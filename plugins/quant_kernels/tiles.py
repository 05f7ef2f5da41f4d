"""How the quantised layer's launches are shaped: tile sizes, K splits, routing block rows, the TMA and in-kernel
combine choices, and the tuned table lookup (configs.py). Host arithmetic only; nothing is launched here."""

from __future__ import annotations

import functools

import torch
from selector.plugins.quant_kernels import configs as _configs
from selector.plugins.triton_common.launch import cdiv, next_pow2, tma_device, tma_weights


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # the interpreter: as few programs as possible
    return 2 * _num_sms(device.index or 0)


TMA_MIN_BLOCK_M = 64
TMA_MAX_BOX = 256  # rows of one TMA copy (the hardware's limit per box dimension)


def grouped_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per expert block: close to the mean rows per expert hit (decode: 16, the smallest fp8 dot), at most
    64: with 128 rows the gated tiles spill registers on sm90 unless they shrink to 32 columns."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    for bm in (16, 32):
        if per_expert <= bm * 1.5:
            return bm
    return 64


# (BLOCK_N, num_warps) per BLOCK_M, widest first, for sm90 (ptxas: no register spills, bf16 activations, 3 stages).
# "wide": gated layers, whose gate_up program holds two accumulators (gate and up) or one 2 x BLOCK_N wide.
_GROUPED_TILES = {
    True: {16: ((128, 8), (64, 4), (32, 4)), 32: ((64, 8), (32, 4)), 64: ((64, 8), (32, 4)), 128: ((32, 8),)},
    False: {16: ((128, 8), (64, 4), (32, 4)), 32: ((64, 4), (32, 4)), 64: ((128, 8), (64, 8)), 128: ((64, 8), (32, 8))},
}
_ROWS_TILES = ((128, 8), (64, 8), (32, 4))


def _pick(
    options: tuple[tuple[int, int], ...], programs_per_n: int, n_out: int, device: torch.device
) -> tuple[int, int]:
    """The widest tile that still gives every SM two programs; the narrowest when none does."""
    target = _target_programs(device)
    if target == 0:  # interpreter: few, wide programs
        bn = max(16, min(64, next_pow2(n_out)))
        return bn, 4
    for bn, warps in options:
        if programs_per_n * cdiv(n_out, bn) >= target:
            return bn, warps
    return options[-1]


def split_k(
    mode: str, config: dict | None, routing: tuple, n_out: int, k_dim: int, block_k: int, device: torch.device
) -> int:
    """Shares of K for a linear grouped projection: the config's SPLIT_K, else enough to give every SM two
    programs when few (block, N tile) programs each walk a long K loop (>= 32 steps; each share keeps >= 8)."""
    if mode != "grouped":
        return 1
    asked = _asked_split(config, k_dim, block_k)
    if asked:
        return asked
    target = _target_programs(device)
    steps = cdiv(k_dim, block_k)
    if target == 0 or steps < 32:
        return 1
    programs = grouped_tiles(routing, n_out, device, config or {}, False)[1]
    split = 1
    while programs * split < target and steps // (2 * split) >= 8 and split < 8:
        split *= 2
    return split


def finish_split(mode: str, config: dict | None, k_dim: int, block_k: int) -> int:
    """Shares of K for a projection whose epilogue needs the whole sum (gate, activation, quantised output): only
    where the config asks (SPLIT_K); the kernel's last share to finish adds them (FINISH). Decode: more programs
    for a latency-bound K loop (Qwen gate_up at T=1: 96 programs of 16 K steps)."""
    return max(1, _asked_split(config, k_dim, block_k)) if mode == "grouped" else 1


def _asked_split(config: dict | None, k_dim: int, block_k: int) -> int:
    """The config's SPLIT_K, from 1 to one share per K tile; 0 when it does not say."""
    asked = int((config or {}).get("SPLIT_K") or 0)
    return max(1, min(asked, cdiv(k_dim, block_k))) if asked else 0


def gemm_config(mode: str, rows: int, n_out: int, device: torch.device, config: dict | None, wide: bool) -> dict:
    """One GEMM's launch parameters: those `config` sets (flat keys), the heuristics for the rest."""
    cfg = {k: v for k, v in (config or {}).items() if v and not isinstance(v, dict)}
    if mode == "grouped":
        bm = cfg.setdefault("BLOCK_M", 16)
        options = _GROUPED_TILES[wide].get(bm, ((64, 8), (32, 4)))
        bn, warps = _pick(options, rows // bm, n_out, device)
        cfg.setdefault("GROUP_M", 8)
    else:
        bn, warps = _pick(_ROWS_TILES, rows, n_out, device)
    cfg.setdefault("BLOCK_N", bn)
    cfg.setdefault("num_warps", warps)
    cfg.setdefault("num_stages", 3)
    return cfg


def combine_in_kernel(routing: tuple, config: dict | None) -> bool:
    """Whether the down kernel adds the slots (COMBINE) rather than a combine launch: the config's "COMBINE" where it
    says, else for pair blocks only. The caller never combines in the kernel on the TMA path (layer.run_layer)."""
    asked = (config or {}).get("COMBINE")
    return asked == "kernel" if asked else routing[0] is None


def use_tma(routing: tuple, fp4: bool, device: torch.device, *weights: torch.Tensor, tile_rows: int = 0) -> bool:
    """Whether a layer runs its projections through TMA descriptors (``run_projection`` with
    ``Activations(sorted=True)``): sorted blocks
    of TMA_MIN_BLOCK_M to TMA_MAX_BOX rows, weight tiles and K tiles of at most TMA_MAX_BOX (`tile_rows`: the
    largest), fp8 weights stored contiguously with rows of a multiple of 16 bytes (TMA's alignment) and fewer than
    2^31 rows in all (int32 coordinates), on sm_90+ (or the interpreter, for the tests), with a Triton that has
    host descriptors."""
    if fp4 or routing[0] is None:
        return False
    if not TMA_MIN_BLOCK_M <= routing[2] <= TMA_MAX_BOX or tile_rows > TMA_MAX_BOX:
        return False
    return tma_device(device) and all(tma_weights(w) for w in weights)


def grouped_tiles(routing: tuple, n_out: int, device: torch.device, config: dict, wide: bool) -> tuple[int, int]:
    """A grouped projection's (BLOCK_N, number of (block, N tile) programs per K share), as the launcher will pick."""
    blocks, bm = routing[1].numel(), routing[2]
    bn = gemm_config("grouped", blocks * bm, n_out, device, {**config, "BLOCK_M": bm}, wide)["BLOCK_N"]
    return bn, blocks * cdiv(n_out, bn)


def resolve_config(
    config: dict | None,
    device: torch.device,
    fp4: bool,
    num_experts: int,
    hidden: int,
    inter: int,
    tokens: int,
    top_k: int,
) -> dict:
    """Nested config of the grouped path: the caller's, else this GPU's tuned table entry, else {} (heuristics)."""
    if config:
        return _configs.normalize(config)
    if device.type == "cuda":
        key = _configs.shape_key(fp4, num_experts, hidden, inter, top_k)
        found = _configs.tuned(_device_name(device.index or 0), key, tokens)
        if found is not None:
            return found
    return _configs.normalize(None)


@functools.cache
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)
