"""FAKE `kernels-community/deep-gemm` for CPU tests: DeepGEMM's grouped-GEMM and Mega MoE entry points in torch.

Same names and signatures as DeepGEMM's Python API (pybind `m_grouped_*_contiguous`, `utils.per_token_cast_to_fp8`,
`transform_sf_into_required_layout`, `mega.*`); loops in float32. The contracts the real kernels impose are
asserted: dtypes and shapes, the M-grouped contiguous layout (per-row expert ids with -1 = skip, or with
`use_psum_layout` the cumulative aligned block ends), every expert block starting on the M alignment. Output
rows the kernel does not compute are set to NaN, so an adapter that reads them fails.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from . import utils
from .utils import per_token_cast_to_fp8  # noqa: F401  (DeepGEMM re-exports its utils)

FAKE = True
ALIGNMENT = int(os.environ.get("FAKE_DEEPGEMM_ALIGNMENT", "128"))
CALLS: list[dict] = []  # what each GEMM call saw, for tests to inspect


def get_mk_alignment_for_contiguous_layout() -> int:
    return ALIGNMENT


def _blocks(layout: torch.Tensor, num_rows: int, num_groups: int, psum: bool) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert block, after checking the layout contract."""
    assert layout.dtype == torch.int32 and layout.is_contiguous(), "grouped_layout must be contiguous int32"
    blocks = []
    if psum:
        assert layout.shape == (num_groups,), f"psum layout must be [E={num_groups}], got {tuple(layout.shape)}"
        start = 0
        for expert, end in enumerate(layout.tolist()):
            assert end % ALIGNMENT == 0 and end >= start, f"psum ends must be aligned and non-decreasing: {end}"
            if end > start:
                blocks.append((expert, start, end))
            start = end
        assert start <= num_rows, "psum layout runs past the rows of A"
        return blocks
    assert layout.shape == (num_rows,), f"per-row layout must be [M={num_rows}], got {tuple(layout.shape)}"
    ids = layout.tolist()
    seen = set()
    row = 0
    while row < num_rows:
        expert = ids[row]
        if expert < 0:
            row += 1
            continue
        assert 0 <= expert < num_groups, f"expert id {expert} out of range"
        assert expert not in seen, f"rows of expert {expert} are not contiguous"
        assert row % ALIGNMENT == 0, f"expert {expert} starts at row {row}, not on the {ALIGNMENT}-row alignment"
        seen.add(expert)
        end = row
        while end < num_rows and ids[end] == expert:
            end += 1
        blocks.append((expert, row, end))
        row = end
    return blocks


def _check_out(d: torch.Tensor, rows: int, cols: int) -> None:
    assert d.dtype == torch.bfloat16 and d.is_contiguous(), "D must be a contiguous bf16 tensor"
    assert d.shape == (rows, cols), f"D must be [{rows}, {cols}], got {tuple(d.shape)}"


def _grouped(a: torch.Tensor, weights: torch.Tensor, d: torch.Tensor, layout: torch.Tensor, psum: bool, nn: bool,
             name: str) -> None:
    num_groups = weights.shape[0]
    m, k = a.shape
    n = weights.shape[2] if nn else weights.shape[1]
    assert (weights.shape[1] if nn else weights.shape[2]) == k, f"K mismatch: A {tuple(a.shape)}, B {tuple(weights.shape)}"
    _check_out(d, m, n)
    blocks = _blocks(layout, m, num_groups, psum)
    CALLS.append({"name": name, "m": m, "psum": psum, "blocks": blocks})
    d.fill_(float("nan"))  # rows the real kernel skips hold garbage; make it loud
    for expert, start, end in blocks:
        w = weights[expert] if nn else weights[expert].transpose(0, 1)  # [K, N]
        d[start:end] = (a[start:end] @ w).to(torch.bfloat16)


def m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, compiled_dims="nk", use_psum_layout=False,
                                      expected_m_for_psum_layout=None):
    """D[M, N] = A[M, K] @ B[E, N, K]^T per expert block."""
    assert a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16, "bf16 GEMM takes bf16 A and B"
    assert a.is_contiguous(), "A must be K-major (contiguous)"
    _grouped(a.float(), b.float(), d, grouped_layout, use_psum_layout, nn=False, name="bf16_nt")


def m_grouped_bf16_gemm_nn_contiguous(a, b, d, grouped_layout, compiled_dims="nk", use_psum_layout=False,
                                      expected_m_for_psum_layout=None):
    """D[M, N] = A[M, K] @ B[E, K, N] per expert block."""
    assert a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16, "bf16 GEMM takes bf16 A and B"
    assert a.is_contiguous(), "A must be K-major (contiguous)"
    _grouped(a.float(), b.float(), d, grouped_layout, use_psum_layout, nn=True, name="bf16_nn")


# --- FP8 / FP4 -----------------------------------------------------------------------------------------------


def _unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 holding 4 UE8M0 bytes (little end first) -> float32 powers of two, 4x wider."""
    assert packed.dtype == torch.int32
    dense = torch.empty_like(packed, memory_format=torch.contiguous_format).copy_(packed)  # row-major strides
    exps = dense.view(torch.uint8).to(torch.int32)
    return torch.ldexp(torch.ones_like(exps, dtype=torch.float32), exps - 127)


def _scale_grid(sf: torch.Tensor, rows: int, cols: int, gran_k: int | None) -> torch.Tensor:
    """Expand a scale tensor to one scale per element of a [..., rows, cols] operand."""
    if sf.dtype == torch.int32:
        assert gran_k is not None, "packed UE8M0 scales need a recipe with gran_k"
        sf = _unpack_ue8m0(sf)
        assert sf.shape[-2] == rows, "packed UE8M0 scales must be per row"
        return sf.repeat_interleave(gran_k, dim=-1)[..., :cols]
    assert sf.dtype == torch.float32, f"scales must be float32 or packed UE8M0 int32, got {sf.dtype}"
    gran_rows = -(-rows // sf.shape[-2])
    gran_cols = gran_k if (gran_k and sf.shape[-2] == rows) else -(-cols // sf.shape[-1])
    return sf.repeat_interleave(gran_rows, dim=-2)[..., :rows, :].repeat_interleave(gran_cols, dim=-1)[..., :cols]


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., C/2] of two e2m1 codes (low nibble first) -> float32 [..., C]."""
    codes = torch.stack([packed & 0x0F, (packed >> 4) & 0x0F], dim=-1).flatten(-2).to(torch.int64)
    value = _E2M1[codes & 0x07]
    return torch.where((codes & 0x08) != 0, -value, value)


def _dequant(q: torch.Tensor, sf: torch.Tensor, gran_k: int | None) -> torch.Tensor:
    values = _fp4_values(q) if q.dtype == torch.int8 else q.float()
    return values * _scale_grid(sf, values.shape[-2], values.shape[-1], gran_k)


def _quantised_grouped(a, b, d, grouped_layout, recipe, use_psum_layout, nn, name):
    (aq, a_sf), (bq, b_sf) = a, b
    assert aq.dtype == torch.float8_e4m3fn, "A must be FP8 (e4m3)"
    assert bq.dtype in (torch.float8_e4m3fn, torch.int8), "B must be FP8 (e4m3) or FP4 packed in int8"
    gran_k = recipe[-1] if recipe is not None else 128
    if use_psum_layout:  # Blackwell: packed UE8M0 scales, MN-major, TMA-aligned
        for sf in (a_sf, b_sf):
            assert sf.dtype == torch.int32, "Blackwell reads packed UE8M0 (int32) scales only"
            assert sf.stride(-2) == 1, "Blackwell scales must be MN-major"
    else:
        for sf in (a_sf, b_sf):
            assert sf.dtype == torch.float32, "Hopper reads float32 scales"
    if bq.dtype == torch.int8:
        assert use_psum_layout, "FP4 has no Hopper kernel"
    _grouped(_dequant(aq, a_sf, gran_k), _dequant(bq, b_sf, gran_k if b_sf.dtype == torch.int32 else None), d,
             grouped_layout, use_psum_layout, nn=nn, name=name)


def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                         compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                         ensure_zero_padding=True, expected_m_for_psum_layout=None):
    _quantised_grouped(a, b, d, grouped_layout, recipe, use_psum_layout, nn=False, name="fp8_fp4_nt")


def m_grouped_fp8_fp4_gemm_nn_contiguous(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                         compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                         ensure_zero_padding=True):
    _quantised_grouped(a, b, d, grouped_layout, recipe, use_psum_layout, nn=True, name="fp8_fp4_nn")


# --- Mega MoE ------------------------------------------------------------------------------------------------


def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, is_sfa=None, disable_ue8m0_cast=False,
                                      psum_layout=None):
    """float32 UE8M0-valued scales [G, mn, k/gran] -> packed int32 [G, mn, k/gran/4] (MN-major)."""
    assert sf.dtype == torch.float32 and sf.shape[-2] == mn
    exps = ((sf.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    assert (sf.view(torch.int32) & ((1 << 23) - 1) == 0).all(), "scales must be powers of two (UE8M0)"
    packed = exps.contiguous().view(torch.int32)
    out = torch.empty_strided(packed.shape, (packed.shape[-1] * mn, 1, mn), dtype=torch.int32)
    out.copy_(packed)
    return out


def _interleave(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    """[gate | up] rows -> [gate 0..7, up 0..7, gate 8..15, up 8..15, ...] (DeepGEMM's documented L1 layout)."""
    g, n, *rest = t.shape
    half = n // 2
    gate = t[:, :half].reshape(g, half // gran, gran, *rest)
    up = t[:, half:].reshape(g, half // gran, gran, *rest)
    return torch.stack([gate, up], dim=2).reshape(g, n, *rest).contiguous()


def _deinterleave(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    g, n, *rest = t.shape
    pairs = t.reshape(g, n // (2 * gran), 2, gran, *rest)
    return torch.cat([pairs[:, :, 0].reshape(g, n // 2, *rest), pairs[:, :, 1].reshape(g, n // 2, *rest)], dim=1)


def _utccp(sf: torch.Tensor) -> torch.Tensor:
    g, mn, kp = sf.shape
    assert sf.dtype == torch.int32 and mn % 128 == 0, "UTCCP transpose needs int32 scales and mn % 128 == 0"
    return sf.reshape(g, -1, 4, 32, kp).transpose(2, 3).reshape(g, mn, kp).contiguous()


def _un_utccp(sf: torch.Tensor) -> torch.Tensor:
    g, mn, kp = sf.shape
    return sf.reshape(g, -1, 32, 4, kp).transpose(2, 3).reshape(g, mn, kp).contiguous()


def transform_weights_for_mega_moe(l1_weights, l2_weights, activation="swiglu"):
    assert activation == "swiglu"
    (w1, sf1), (w2, sf2) = l1_weights, l2_weights
    return (_interleave(w1), _utccp(_interleave(sf1))), (w2, _utccp(sf2))


class SymmBuffer:
    """FAKE symmetric buffer: plain tensors, one rank (no communication)."""

    def __init__(self, group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden):
        self.group = group
        self.num_experts = num_experts
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_topk = num_topk
        self.hidden = hidden
        self.intermediate_hidden = intermediate_hidden
        self.x = torch.zeros(num_max_tokens_per_rank, hidden, dtype=torch.float8_e4m3fn)
        self.x_sf = torch.zeros(num_max_tokens_per_rank, hidden // 32 // 4, dtype=torch.int32)
        self.topk_idx = torch.full((num_max_tokens_per_rank, num_topk), -1, dtype=torch.int64)
        self.topk_weights = torch.zeros(num_max_tokens_per_rank, num_topk, dtype=torch.float32)
        self.destroyed = False

    def destroy(self):
        self.destroyed = True


def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                 intermediate_hidden, use_fp8_dispatch=None, mma_type="fp8xfp4", activation="swiglu"):
    assert group is not None, "the symmetric buffer rendezvous over a process group"
    aligned = -(-num_max_tokens_per_rank // 16) * 16
    return SymmBuffer(group, num_experts, aligned, num_topk, hidden, intermediate_hidden)


def fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                     recipe=(1, 1, 32), activation="swiglu", activation_clamp=None, fast_math=True):
    """The fused EP MoE, for one rank: dequantise, SwiGLU (optionally clamped), weighted sum over top-k."""
    assert sym_buffer.group.size() == 1, "FAKE Mega MoE runs a single rank (no NVLink here)"
    (w1, sf1), (w2, sf2) = l1_weights, l2_weights
    assert w1.dtype == torch.int8 and w2.dtype == torch.int8, "Mega MoE weights are FP4 packed in int8"
    tokens = y.shape[0]
    x = _dequant(sym_buffer.x[:tokens], sym_buffer.x_sf[:tokens], recipe[-1])
    w1 = _dequant(_deinterleave(w1), _deinterleave(_un_utccp(sf1)), recipe[-1])  # [E, 2I, H]
    w2 = _dequant(w2, _un_utccp(sf2), recipe[-1])  # [E, H, I]
    out = torch.zeros(tokens, y.shape[1])
    idx, weights = sym_buffer.topk_idx[:tokens], sym_buffer.topk_weights[:tokens]
    for t in range(tokens):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < 0:
                continue
            gate, up = (w1[e] @ x[t]).chunk(2)
            if activation_clamp is not None:
                gate, up = gate.clamp(max=activation_clamp), up.clamp(-activation_clamp, activation_clamp)
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    y.copy_(out.to(y.dtype))
