"""DeepGEMM adapter: the M-grouped contiguous layout around the hub kernel's grouped GEMMs.

Shapes: T tokens, k slots, S = T*k (token, slot) pairs, E experts, H hidden, I intermediate, M padded rows.

1. Sort the S pairs by expert (stable; expert-parallel sentinels, id == E, sort to the tail).
2. Give each expert a block of rows that starts on the kernel's M alignment (128 by default): pair j goes to
   row j + (padding of the experts before it). M is a static upper bound, so no host sync is needed.
3. Tell the kernel which rows belong to which expert. Hopper (SM90): one expert id per row, -1 for padding
   and sentinels. Blackwell (SM100, `use_psum_layout=True`): the cumulative sum of the aligned block sizes.
4. Each pair's token row is written to its padded row (padding rows stay unwritten: computed or skipped by the
   kernel, never read back). Up GEMM, then the real rows only through the activation/gate (in torch, any
   activation), down GEMM; then gather each (token, slot) pair's row back, zero sentinels, and one batched
   [1, k] x [k, H] product per token sums the slots in a fixed order. (The first version padded, gathered and combined through S x H float32 temporaries: on the H200
   that glue took 3.3 ms of a 3.5 ms Qwen3-30B T=4096 FP8 call; docs/design/hub_kernels.md.)

FP8/FP4 experts add dynamic per-row activation quantisation (the kernel's `per_token_cast_to_fp8`, once per
token before the gather, and once per row for the intermediate) and hand scales to the kernel in the layout
each architecture wants: float32 as they are on Hopper (UE8M0 widened to float32), packed UE8M0 in an MN-major
TMA-aligned layout on Blackwell.

On CUDA tensors the architecture is the device's; on other devices (only the fake kernels of the tests run
there) it is the compute capability the probe facts report for GPU 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from selector.plugins.adapter import KernelPlan, forward_of
from selector.plugins.deepgemm import COMPILED, KERNEL, problem_key
import selector.plugins.triton_common.guard  # noqa: F401 - registers the one-launch sanitiser

from selector import hub, layers
from selector.environment import current_environment
from selector.guard import sanitize_routing
from selector.quant import is_ue8m0_tensor, ue8m0_bytes, ue8m0_to_float
from selector.types import ExpertsForward, Problem

BF16_SYMBOLS = (
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nn_contiguous",
    "get_mk_alignment_for_contiguous_layout",
)
QUANTISED_SYMBOLS = ("utils.per_token_cast_to_fp8",)
# DeepGEMM renamed its FP8 grouped GEMMs when it added FP4: current builds (the hub kernel) export
# `m_grouped_fp8_fp4_gemm_*`, earlier releases (e.g. the DeepGEMM inside sgl-kernel 0.3) `m_grouped_fp8_gemm_*`,
# FP8 only. Either name is taken; FP4 experts run on Blackwell only, where builds have the new name.
QUANTISED_GEMMS = {
    "nt": ("m_grouped_fp8_fp4_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_contiguous"),
    "nn": ("m_grouped_fp8_fp4_gemm_nn_contiguous", "m_grouped_fp8_gemm_nn_contiguous"),
}


@dataclass(frozen=True)
class DeepGemm:
    """The entry points of `kernels-community/deep-gemm` this adapter calls."""

    bf16_nt: Callable
    bf16_nn: Callable
    fp8_fp4_nt: Callable | None  # None: this build has no FP8 grouped GEMM under either name
    fp8_fp4_nn: Callable | None
    per_token_cast_to_fp8: Callable
    alignment: int  # M alignment of the contiguous layout (the build's default; never changed here)
    module: object


_DEEPGEMM: DeepGemm | None = None


def _first_symbol(module: object, names: tuple[str, ...]) -> Callable | None:
    for name in names:
        found = hub.resolve_symbol(module, name)
        if found is not None:
            return found
    return None


def load_deepgemm(extra: tuple[str, ...] = ()) -> DeepGemm:
    global _DEEPGEMM
    module = hub.load_kernel(KERNEL, BF16_SYMBOLS + QUANTISED_SYMBOLS + extra, backend="deepgemm")
    if _DEEPGEMM is None or _DEEPGEMM.module is not module:
        get = lambda name: hub.resolve_symbol(module, name)  # noqa: E731
        _DEEPGEMM = DeepGemm(
            bf16_nt=get("m_grouped_bf16_gemm_nt_contiguous"),
            bf16_nn=get("m_grouped_bf16_gemm_nn_contiguous"),
            fp8_fp4_nt=_first_symbol(module, QUANTISED_GEMMS["nt"]),
            fp8_fp4_nn=_first_symbol(module, QUANTISED_GEMMS["nn"]),
            per_token_cast_to_fp8=get("utils.per_token_cast_to_fp8"),
            alignment=int(get("get_mk_alignment_for_contiguous_layout")()),
            module=module,
        )
    return _DEEPGEMM


def arch_major(device: torch.device) -> int:
    """9 on Hopper, 10 on Blackwell: the device's, or the probe facts' for non-CUDA tensors (fakes in tests)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0]
    cc = current_environment().compute_capability(0)
    if cc is None:
        raise RuntimeError("DeepGEMM runs on CUDA GPUs; no GPU is visible and the tensors are not on CUDA")
    return cc[0]


# --- the contiguous layout -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupedLayout:
    order: torch.Tensor  # [S] int64: sorted position -> flat (token, slot) index
    expert_ids: torch.Tensor  # [S] int64: expert of each sorted pair (sentinels == E kept)
    rows: torch.Tensor  # [S] int64: padded row of each sorted pair
    layout: torch.Tensor  # int32; Hopper [M]: expert per row, -1 = skip; Blackwell [E]: cumulative aligned ends
    num_rows: int  # M
    psum: bool
    pair_row: torch.Tensor  # [S] int64: padded row of each pair, in (token, slot) order (the combine's gather)

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """[S, ...] in sorted order -> [M, ...] on each pair's padded row. Padding rows are left unwritten: the
        kernel computes them (inside an expert's aligned block) or skips them, and nothing reads them back."""
        padded = rows.new_empty(self.num_rows, *rows.shape[1:])
        padded[self.rows] = rows
        return padded


def contiguous_layout(top_k_index: torch.Tensor, num_experts: int, alignment: int, psum: bool) -> GroupedLayout:
    ids = top_k_index.reshape(-1).long()
    expert_ids, order = torch.sort(ids, stable=True)
    pairs = ids.numel()
    # histc, not bincount: no host sync; ids above E-1 (sentinels) fall outside and are not counted
    counts_in = expert_ids.float() if ids.device.type == "cpu" else expert_ids.int()
    counts = torch.histc(counts_in, bins=num_experts, min=0, max=num_experts - 1).long()
    aligned = (counts + alignment - 1) // alignment * alignment
    # padding before each expert's block; entry E is all the padding, so sentinels land past every block
    pad_before = torch.nn.functional.pad((aligned - counts).cumsum(0), (1, 0))
    rows = torch.arange(pairs, device=ids.device) + pad_before[expert_ids]
    bound = pairs + min(pairs, num_experts) * (alignment - 1)
    num_rows = -(-bound // alignment) * alignment
    pair_row = torch.empty_like(rows)
    pair_row[order] = rows
    if psum:
        layout = aligned.cumsum(0).to(torch.int32)
    else:
        layout = torch.full((num_rows,), -1, dtype=torch.int32, device=ids.device)
        layout[rows] = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return GroupedLayout(order, expert_ids, rows, layout, num_rows, psum, pair_row)


def combine(
    out: torch.Tensor,  # [M, H] per padded row
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
    lay: GroupedLayout,
    module: torch.nn.Module,
    dtype: torch.dtype,
) -> torch.Tensor:  # [T, H]
    """Each pair's row gathered back in (token, slot) order, then one batched [1, k] x [k, H] product per token:
    a fixed-order sum over the k slots (deterministic, fp32 accumulation). For a bf16 result the routing weights
    are rounded to bf16 too (2^-9 relative, the size of the result's own rounding) so no [S, H] float32 copy is
    made; any other result dtype gets the product in float32."""
    num_tokens, top_k = top_k_weights.shape
    num_experts = module.num_experts
    y = out[lay.pair_row]  # [S, H]
    down_b = layers.down_bias(module)
    if down_b is not None:
        y = y + down_b[top_k_index.reshape(-1).clamp(max=num_experts - 1)].to(y.dtype)
    y = layers.post_norm(module, y)
    if layers.is_expert_parallel(module):  # sentinel rows were never computed: zero them (NaN * 0 is NaN)
        y = y.masked_fill((top_k_index.reshape(-1, 1) >= num_experts), 0.0)
    if dtype != y.dtype:
        y = y.float()
    weights = top_k_weights.to(y.dtype).view(num_tokens, 1, top_k)
    return torch.bmm(weights, y.view(num_tokens, top_k, -1)).view(num_tokens, -1).to(dtype)


# --- scales ----------------------------------------------------------------------------------------------


def weight_format(module: torch.nn.Module) -> str:
    dtype = layers.up_weight(module).dtype
    if dtype == torch.int8 or dtype == torch.uint8:
        return "fp4"
    if dtype == torch.float8_e4m3fn:
        return "fp8_block"
    return "dense"


def _scale_of(module: torch.nn.Module, name: str) -> torch.Tensor:
    scale = getattr(module, f"{name}_scale_inv", None)
    if scale is None:
        raise ValueError(f"quantised experts need `{name}_scale_inv` next to `{name}`; the module has none")
    return scale


def check_quantised(module: torch.nn.Module, scale: torch.Tensor, blackwell: bool) -> None:
    """The same rules the requirement check applies, for modules whose Problem could not say them."""
    if getattr(module, "activation_scheme", "dynamic") == "static":
        raise ValueError(
            "experts backend 'deepgemm' cannot run static activation quantisation: DeepGEMM quantises activations "
            "per row at run time (dynamic). fix: use a checkpoint with dynamic activation scales, or pick grouped_mm."
        )
    if weight_format(module) == "fp4" and not blackwell:
        raise ImportError(
            "experts backend 'deepgemm' runs FP4 experts on Blackwell only (compute capability >= 10.0). "
            "fix: use an FP8 or bf16 checkpoint on this GPU, or pick grouped_mm."
        )
    if blackwell and not is_ue8m0_tensor(scale) and scale.dtype != torch.int32:
        raise ValueError(
            "experts backend 'deepgemm' has no float32 block-scale path on Blackwell: rounding these scales to "
            "UE8M0 would silently corrupt the output. fix: use a checkpoint quantised with UE8M0 scales "
            "(scale_fmt='ue8m0'), or pick grouped_mm or batched_mm, which read float32 block scales."
        )


def cast_options(module: torch.nn.Module, blackwell: bool) -> dict[str, object]:
    """Arguments of per_token_cast_to_fp8 for this module's weights on this architecture."""
    if weight_format(module) == "fp4":
        return {"use_ue8m0": True, "gran_k": 32, "use_packed_ue8m0": True}
    block = getattr(module, "selector_block_size", None) or getattr(module, "block_size", None) or (128, 128)
    block = tuple(int(b) for b in block)
    if block not in ((128, 128), (1, 128)):
        raise ValueError(f"DeepGEMM reads FP8 blocks of (128, 128) or (1, 128), got block_size={block}")
    if blackwell:  # UE8M0 only (float32 was refused before)
        return {"use_ue8m0": True, "gran_k": 128, "use_packed_ue8m0": True}
    return {"use_ue8m0": False}  # gran_k defaults to 128; older releases take no gran_k at all


def _tma_aligned_mn_major(sf: torch.Tensor) -> torch.Tensor:
    """Same values, strides DeepGEMM's Blackwell path checks: MN-major, MN padded to 16 bytes."""
    mn, kf = sf.shape[-2], sf.shape[-1]
    step = 16 // sf.element_size()
    aligned_mn = -(-mn // step) * step
    strides = (1, aligned_mn) if sf.dim() == 2 else (kf * aligned_mn, 1, aligned_mn)
    if tuple(sf.stride()) == strides:
        return sf
    out = torch.empty_strided(sf.shape, strides, dtype=sf.dtype, device=sf.device)
    out.copy_(sf)
    return out


def scales_for_kernel(sf: torch.Tensor, blackwell: bool, rows: int) -> torch.Tensor:
    """Hopper: float32, row-major (DeepGEMM lays it out itself). Blackwell: per-row UE8M0 packed 4 to an int32."""
    if is_ue8m0_tensor(sf):  # float8_e8m0fnu, or uint8 holding the same exponent byte
        if not blackwell:  # Hopper reads float32: widening a power of two is exact
            sf = ue8m0_to_float(sf)
        else:
            if sf.shape[-2] < rows:  # block scales (one per 128 rows) -> one per row, as the packed path wants
                sf = sf.repeat_interleave(-(-rows // sf.shape[-2]), dim=-2)[..., :rows, :]
            sf = ue8m0_bytes(sf).contiguous().view(torch.int32)
    elif sf.dtype == torch.float32 and blackwell:
        raise ValueError("float32 scales cannot be handed to DeepGEMM on Blackwell (see check_quantised)")
    if sf.dim() not in (2, 3):
        raise ValueError(f"DeepGEMM scales must be 2-D or 3-D, got {sf.dim()}-D")
    return _tma_aligned_mn_major(sf) if blackwell else sf.contiguous()


# --- forward ---------------------------------------------------------------------------------------------


def _gemm(dg: DeepGemm, quantised: bool, transposed: bool) -> Callable:
    # weights [E, N, K] -> the NT kernel; transposed [E, K, N] -> the NN kernel
    if not quantised:
        return dg.bf16_nn if transposed else dg.bf16_nt
    gemm = dg.fp8_fp4_nn if transposed else dg.fp8_fp4_nt
    if gemm is None:
        names = " or ".join(QUANTISED_GEMMS["nn" if transposed else "nt"])
        raise ImportError(
            f"experts backend 'deepgemm': the loaded DeepGEMM build has no FP8 grouped GEMM ({names}). "
            f"fix: use a current {KERNEL} build, or pick grouped_mm for quantised experts."
        )
    return gemm


def kernel_weights(module: torch.nn.Module, blackwell: bool) -> tuple:
    """(up weight, down weight, up scales, down scales): the weights as they are, quantised experts' block scales in
    the layout the kernel reads on this architecture (None for dense experts)."""
    up_w, down_w = layers.up_weight(module), module.down_proj
    if weight_format(module) == "dense":
        return up_w, down_w, None, None
    transposed = bool(getattr(module, "is_transposed", False))
    up_name = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"

    def rows(weight: torch.Tensor) -> int:
        return weight.shape[-1] if transposed else weight.shape[-2]

    return (up_w, down_w, scales_for_kernel(_scale_of(module, up_name), blackwell, rows(up_w)),
            scales_for_kernel(_scale_of(module, "down_proj"), blackwell, rows(down_w)))  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DeepGemmPlan(KernelPlan):
    dg: DeepGemm
    gemm: Callable  # the NT or NN grouped GEMM, bf16 or FP8/FP4
    blackwell: bool
    transposed: bool
    cast: dict | None  # per_token_cast_to_fp8's arguments; None for dense experts
    num_experts: int

    def project(self, lay: GroupedLayout, a: torch.Tensor, a_sf: torch.Tensor | None, weight: torch.Tensor,
                scale: torch.Tensor | None, out_dim: int) -> torch.Tensor:  # fmt: skip
        """[M, K] padded rows (FP8 with per-row scales when quantised) -> [M, out_dim] bf16."""
        out = torch.empty(lay.num_rows, out_dim, dtype=torch.bfloat16, device=a.device)
        # Hopper calls pass no `use_psum_layout`: releases before the Blackwell psum layout do not take it.
        psum = {"use_psum_layout": True} if self.blackwell else {}
        if scale is None:
            self.gemm(a, weight, out, lay.layout, **psum)
            return out
        recipe = (1, 1, self.cast["gran_k"]) if self.cast.get("use_packed_ue8m0") else None
        self.gemm((a, scales_for_kernel(a_sf, self.blackwell, lay.num_rows)), (weight, scale), out, lay.layout,
                  recipe=recipe, **psum)  # fmt: skip
        return out

    def launch(self, module: torch.nn.Module, weights: tuple, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        up_w, down_w, up_s, down_s = weights
        (num_tokens, top_k), hidden = top_k_index.shape, hidden_states.shape[-1]
        quantised = self.cast is not None
        # bad slots -> expert 0 with weight NaN (selector.guard): an id of -1 would sort first and shift other rows
        top_k_index, top_k_weights = sanitize_routing(module, top_k_index, top_k_weights)
        lay = contiguous_layout(top_k_index, self.num_experts, self.dg.alignment, psum=self.blackwell)
        # Quantise each token once (T rows, not T*k), then place its rows on the expert blocks. Only the S real
        # rows are written: M can be ~E*128 rows at decode (33k for DeepSeek-V3 at T=64), far more than S.
        x = hidden_states.to(torch.bfloat16)
        token_of = lay.order // top_k  # [S] token of each sorted pair
        if quantised:
            xq, x_sf = self.dg.per_token_cast_to_fp8(x, **self.cast)
            a, a_sf = lay.scatter(xq[token_of]), lay.scatter(x_sf[token_of])
        else:
            a, a_sf = lay.scatter(x[token_of]), None
        up_dim = up_w.shape[-1] if self.transposed else up_w.shape[-2]
        h = self.project(lay, a, a_sf, up_w, up_s, up_dim)[lay.rows]  # [S, up_dim]: real rows only
        up_b = layers.up_bias(module)
        if up_b is not None:  # sentinels read E-1, zeroed later
            h = h + up_b[lay.expert_ids.clamp(max=self.num_experts - 1)].to(h.dtype)
        h = layers.activate(module, h).to(torch.bfloat16)
        if quantised:
            hq, h_sf = self.dg.per_token_cast_to_fp8(h, **self.cast)
            out = self.project(lay, lay.scatter(hq), lay.scatter(h_sf), down_w, down_s, hidden)  # [M, H]
        else:
            out = self.project(lay, lay.scatter(h), None, down_w, None, hidden)
        return combine(out, top_k_index, top_k_weights, lay, module, hidden_states.dtype)


def prepare(module: torch.nn.Module, problem: Problem) -> KernelPlan:
    """The kernel loaded, the format checked, the GEMM picked and the weight scales in the kernel's layout, once
    per weights and call mode (forward only)."""
    quantised = weight_format(module) != "dense"
    up_w = layers.up_weight(module)
    if not quantised and up_w.dtype != torch.bfloat16:
        raise ValueError(f"experts backend 'deepgemm' runs dense experts in bfloat16 only, got {up_w.dtype}")
    blackwell = arch_major(up_w.device) >= 10
    if quantised:
        check_quantised(module, _scale_of(module, "down_proj"), blackwell)
    dg = load_deepgemm()
    transposed = bool(getattr(module, "is_transposed", False))
    return DeepGemmPlan.prepared(
        module, functools.partial(kernel_weights, blackwell=blackwell), False, backend="deepgemm", dg=dg,
        gemm=_gemm(dg, quantised, transposed), blackwell=blackwell, transposed=transposed,
        cast=cast_options(module, blackwell) if quantised else None, num_experts=int(module.num_experts),
        ledger=COMPILED, shape=problem_key(problem),
    )  # fmt: skip


deepgemm_experts_forward = forward_of(prepare)


def load() -> ExpertsForward:
    return deepgemm_experts_forward
