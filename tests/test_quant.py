"""Quantised experts (selector/quant/, plugins/quant_kernels, selector/checkpoints.py).

What is compared, and the bounds (relative error = ||out - ref|| / ||ref||):

1. Kernels against `reference_forward`: float64 math from the DEQUANTISED weights, with the activations of both
   projections quantised to e4m3 exactly as the kernels do (per row and group, scale = amax / 448, in float32)
   and the intermediate rounded to the compute dtype. The kernels multiply the same e4m3 operands, so what is
   left is fp32 accumulation order (about K * 2^-24 ~ 1e-5 at worst for these K; observed ~1e-7) and, rarely,
   an element of the intermediate whose fp32 value lies within that of an e4m3 rounding boundary:
   bound 1e-4 with fp32 compute (observed ~1e-7). With bf16 compute the per-slot outputs and the final output
   are rounded to bf16 (2^-9 relative each, ~2.4e-3 observed), and a bf16 rounding of the intermediate that
   lands on the other side of an e4m3 rounding boundary moves that element by one e4m3 step: bound 1e-2.
2. The same kernels against the float64 forward with UNQUANTISED activations (still the dequantised weights):
   the error is then the activation format's. e4m3 has 3 mantissa bits: unit roundoff u = 2^-4, so each
   quantised vector is within u in relative L2 norm; two quantisations (input and intermediate) through
   roughly norm-preserving random layers: bound 2u = 0.125. Observed 0.03-0.05 (rounding errors are random:
   ~u/sqrt(3) each).
3. The formats themselves: fp8 block quantisation of a weight is within u = 2^-4 relative per element (ue8m0
   scales are up to 2x larger, which can push small elements into the subnormal range: bound 2u in L2);
   fp4 e2m1 with power-of-two scales (amax / scale in (3, 6]): the gaps of {0, .5, 1, 1.5, 2, 3, 4, 6} are at
   most 25% of the lower value, measured ~10% in L2 on Gaussian weights: bound 0.2.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1): fp8 dots are right
there, and the kernels never use a bf16 dot (the activations are quantised to e4m3 first), so bf16 inputs are
tested too. Shapes are tiny (interpreter runs are slow). GPU tests are marked `gpu`.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch
from experts_fixtures import Layout, make_experts, random_routing, relative_error

import selector
from selector.probes import collect_environment
from selector import checkpoints as C
from selector import quant as Q
from selector.dispatch import clear_last_backend, last_backend, reset_selection_caches
from selector.problem import problem_from_module
from selector.registry import build_registry
from selector.requirements import evaluate
from selector.types import Problem, Status

pytestmark = pytest.mark.interpreter

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
U = 2.0**-4  # e4m3 unit roundoff
EMULATED_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
FORMAT_TOL = 2 * U

FORMATS = [
    pytest.param(("fp8_block", "float32", (32, 32)), id="fp8-f32"),
    pytest.param(("fp8_block", "ue8m0", (32, 32)), id="fp8-ue8m0"),
    pytest.param(("fp4", "ue8m0", None), id="fp4"),
]
MODES = ("grouped", "batched")


@pytest.fixture(autouse=True)
def fresh_caches():
    torch.manual_seed(0)  # routing and inputs come from the global generator: the same data every run
    reset_selection_caches()
    yield
    reset_selection_caches()


def quantised(e, h, i, fmt, layout=Layout(), dtype=torch.float32, seed=0, act=None, **kw):
    module = make_experts(e, h, i, layout, dtype=dtype, device=DEV, seed=seed, act=act)
    wf, sf, bs = fmt
    return Q.quantize_experts(module, wf, sf, bs, **kw)


def run(module, x, idx, w, mode, config=None):
    from selector.plugins.quant_kernels.forward import quant_experts_forward

    return quant_experts_forward(module, x, idx, w, mode=mode, config=config)


def check(module, x, idx, w, mode, dtype=torch.float32):
    out = run(module, x, idx, w, mode)
    assert out.shape == x.shape and out.dtype == x.dtype
    emulated = relative_error(out, Q.reference_forward(module, x, idx, w))
    assert emulated < EMULATED_TOL[dtype], f"vs emulated-quantisation reference: {emulated:.2e}"
    fmt_err = relative_error(out, Q.reference_forward(module, x, idx, w, quantize_activations_as_kernel=False))
    assert fmt_err < FORMAT_TOL, f"vs unquantised activations: {fmt_err:.3f}"
    return out


# ----------------------------------------------------------------------------------------------------------------
# Formats (pure torch).
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
def test_fp8_block_quantisation_error_and_scales(scale_format):
    w = torch.randn(3, 200, 129) * 0.05
    q, s = Q.quantize_fp8_block(w, (64, 32), scale_format)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (3, 4, 5)
    sf = Q.scales_to_float(s)
    if scale_format == "ue8m0":
        assert s.dtype == Q.ue8m0_dtype()
        assert torch.equal(sf, torch.exp2(torch.log2(sf).round()))  # powers of two
    deq = Q.dequantize_fp8_block(q, s, (64, 32))
    err = ((deq - w).norm() / w.norm()).item()
    assert err < (U if scale_format == "float32" else 2 * U), err
    assert torch.isfinite(deq).all() and q.float().abs().max() <= Q.FP8_MAX
    # zero blocks stay zero with scale 1
    q0, s0 = Q.quantize_fp8_block(torch.zeros(1, 32, 32), (32, 32), scale_format)
    assert q0.float().abs().sum() == 0 and Q.scales_to_float(s0).item() == 1.0


def test_fp4_codes_round_to_nearest_even_and_pack_low_nibble_first():
    grid = torch.tensor(Q.E2M1_VALUES)
    w = torch.cat([grid, -grid, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])]).reshape(1, -1)
    w = torch.nn.functional.pad(w, (0, 32 - w.shape[1]))
    w[0, 0] = 6.0  # amax 6 in the group: scale 1 (the smallest power of two with amax / scale <= 6)
    packed, scale = Q.quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (1, w.shape[1] // 2)
    got = Q.unpack_fp4(packed) * Q.scales_to_float(scale).repeat_interleave(32, dim=-1)
    n = len(Q.E2M1_VALUES)
    assert torch.equal(got[0, 1:n], grid[1:]) and torch.equal(got[0, n + 1 : 2 * n], -grid[1:])
    ties = got[0, 2 * n : 2 * n + 7].tolist()
    assert ties == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # ties go to the even code
    assert Q.scales_to_float(scale).item() == 1.0
    _, scale7 = Q.quantize_fp4(torch.full((1, 32), 7.0))
    assert Q.scales_to_float(scale7).item() == 2.0  # nothing saturates: 7 -> 3.5 * 2
    u = packed.view(torch.uint8)
    assert (u[0, 0] & 0xF).item() == 7  # element 0 (6.0, code 7) in the low nibble


def test_fp4_error_and_scales():
    w = torch.randn(2, 48, 200)
    packed, scale = Q.quantize_fp4(w)
    assert scale.shape == (2, 48, 7) and scale.dtype == Q.ue8m0_dtype()
    deq = Q.dequantize_fp4(packed, scale)
    assert ((deq - w).norm() / w.norm()).item() < 0.2
    groups = torch.nn.functional.pad(w, (0, 24)).reshape(2, 48, 7, 32).abs().amax(-1)
    ratio = groups / Q.scales_to_float(scale)
    assert (ratio <= 6).all() and (ratio > 3).all()  # the smallest power of two that fits
    with pytest.raises(ValueError, match="even"):
        Q.quantize_fp4(torch.randn(4, 33))


def test_formats_match_transformers_dequantisation():
    """Our layouts read the same through Transformers' own Fp8Dequantize (fp8 blocks, and fp4 nibble order)."""
    fd = pytest.importorskip("transformers.integrations.finegrained_fp8")
    deq = fd.Fp8Dequantize(None)
    w = torch.randn(256, 384)
    for fmt in ("float32", "ue8m0"):
        q, s = Q.quantize_fp8_block(w, (128, 128), fmt)
        ours = Q.dequantize_fp8_block(q, s, (128, 128))
        assert torch.equal(deq._dequantize_one(q, s, output_dtype=torch.float32), ours)
    packed, scale = Q.quantize_fp4(w)
    assert torch.equal(deq._dequantize_one(packed, scale, output_dtype=torch.float32), Q.dequantize_fp4(packed, scale))


def test_quantise_and_dequantise_experts_in_place():
    module = make_experts(3, 64, 40, Layout(transposed=True), seed=3)
    dense_up = module.gate_up_proj.detach().transpose(1, 2).clone()
    Q.quantize_experts(module, "fp8_block", "float32", (32, 32))
    assert module.selector_weight_format == "fp8_block" and not module.is_transposed
    assert module.gate_up_proj.dtype == torch.float8_e4m3fn
    # gate and up blocked separately: I = 40 is not a multiple of 32 -> 2 + 2 scale rows, not ceil(80 / 32) = 3
    assert module.gate_up_proj_scale_inv.shape == (3, 4, 2)
    up, _ = Q.dequantized_weights(module)
    assert ((up - dense_up).norm() / dense_up.norm()).item() < U
    with pytest.raises(ValueError, match="already quantised"):
        Q.quantize_experts(module)
    Q.dequantize_experts(module)
    assert module.gate_up_proj.dtype == torch.float32 and module.selector_weight_format == "dense"
    assert torch.equal(module.gate_up_proj, up) and not hasattr(module, "gate_up_proj_scale_inv")
    with pytest.raises(ValueError, match="float32 scales are not supported"):
        Q.quantize_experts(make_experts(2, 32, 16), "fp4", "float32")
    with pytest.raises(ValueError, match="static activation quantisation needs"):
        Q.quantize_experts(make_experts(2, 32, 16), "fp8_block", activation_quant="static")


# ----------------------------------------------------------------------------------------------------------------
# Kernels (Triton interpreter on CPU).
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_odd_sizes_skewed_routing(fmt, mode):
    """H = 200, I = 72: neither a multiple of the blocks; 9 tokens, most routed to expert 0."""
    module = quantised(5, 200, 72, fmt, seed=11)
    idx, w = random_routing(9, 5, 2, device=DEV, skew=True)
    check(module, torch.randn(9, 200, device=DEV), idx, w, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_one_token(fmt, mode):
    module = quantised(4, 96, 40, fmt, seed=12)
    idx, w = random_routing(1, 4, 3, device=DEV)
    check(module, torch.randn(1, 96, device=DEV), idx, w, mode)


@pytest.mark.parametrize("mode", MODES)
def test_fp8_odd_hidden_and_default_block(mode):
    """fp8 allows an odd K; the default 128x128 block larger than every dim (one partial block)."""
    module = quantised(3, 129, 48, ("fp8_block", "ue8m0", None), seed=13)
    idx, w = random_routing(6, 3, 2, device=DEV)
    check(module, torch.randn(6, 129, device=DEV), idx, w, mode)


@pytest.mark.parametrize(
    "layout",
    [
        Layout(bias=True),
        Layout(interleaved=True, bias=True),
        Layout(gated=False),
        Layout(expert_parallel=True),
        Layout(custom_gate=True, interleaved=True),
        Layout(post_norm=True),
    ],
    ids=str,
)
@pytest.mark.parametrize("mode", MODES)
def test_kernels_layouts(layout, mode):
    """Epilogue variants in the kernels; a custom gate and a post-expert norm run in torch between them."""
    fmt = ("fp4", "ue8m0", None) if layout.interleaved else ("fp8_block", "float32", (32, 32))
    module = quantised(4, 64, 40, fmt, layout=layout, seed=14)
    idx, w = random_routing(5, 4, 2, device=DEV, sentinel=layout.expert_parallel)
    out = check(module, torch.randn(5, 64, device=DEV), idx, w, mode)
    if layout.expert_parallel:  # a token whose both slots are the sentinel gets exactly 0
        idx2 = idx.clone()
        idx2[0] = 4
        assert run(module, torch.randn(5, 64, device=DEV), idx2, w, mode)[0].abs().max() == 0
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("act", [torch.nn.GELU(), torch.nn.GELU(approximate="tanh"), torch.nn.ReLU()], ids=str)
def test_kernel_activations(act):
    module = quantised(3, 64, 32, ("fp8_block", "float32", (32, 32)), act=act, seed=15)
    idx, w = random_routing(4, 3, 2, device=DEV)
    check(module, torch.randn(4, 64, device=DEV), idx, w, "grouped")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_static_activation_quantisation(fmt, mode):
    module = make_experts(4, 64, 40, dtype=torch.float32, device=DEV, seed=16)
    x = torch.randn(7, 64, device=DEV)
    idx, w = random_routing(7, 4, 2, device=DEV)
    scales = Q.calibrate_activation_scales(module, x, idx)
    Q.quantize_experts(module, fmt[0], fmt[1], fmt[2], activation_quant="static", activation_scales=scales)
    assert problem_from_module(module).activation_quant == "static"
    check(module, x, idx, w, mode)
    # inputs beyond the calibrated range saturate at +-448 * scale, exactly as the reference does
    big = x * 3
    out = run(module, big, idx, w, mode)
    assert relative_error(out, Q.reference_forward(module, big, idx, w)) < 1e-4


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_compute(fmt):
    """bf16 activations: quantised to e4m3 in the kernel, so no bf16 dot runs (fine in the interpreter)."""
    module = quantised(4, 64, 40, fmt, dtype=torch.bfloat16, seed=17)
    assert module.selector_compute_dtype == torch.bfloat16
    idx, w = random_routing(5, 4, 2, device=DEV)
    check(module, torch.randn(5, 64, device=DEV, dtype=torch.bfloat16), idx, w, "grouped", dtype=torch.bfloat16)


def test_fp4_exponent_spread_folding():
    """The grouped kernel folds four 32-groups into one e4m3 tile: exact while exponents differ by <= 14."""
    module = quantised(2, 128, 32, ("fp4", "ue8m0", None), seed=18)
    s = module.down_proj_scale_inv.view(torch.uint8)
    s[:, :, 0] = (s[:, :, 0].int() + 9).clamp(max=254).to(torch.uint8)  # spread 9: still exact
    idx, w = random_routing(3, 2, 1, device=DEV)
    x = torch.randn(3, 128, device=DEV)
    ref = Q.reference_forward(module, x, idx, w)
    for mode in MODES:
        assert relative_error(run(module, x, idx, w, mode), ref) < 1e-4


@pytest.mark.compile
def test_torch_compile_fullgraph_through_the_model_api():
    """The whole in-kernel path is one custom op: torch.compile traces the module without a graph break."""
    module = quantised(4, 64, 32, ("fp8_block", "ue8m0", (32, 32)))
    idx, w = random_routing(3, 4, 2, device=DEV)
    x = torch.randn(3, 64, device=DEV)
    selector.set_experts_implementation(module, "grouped_mm")
    compiled = torch.compile(lambda a, b, c: module(a, b, c), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, idx, w), run(module, x, idx, w, "grouped"))


def test_empty_and_zero_inputs():
    module = quantised(3, 64, 32, ("fp8_block", "ue8m0", (32, 32)))
    idx, w = random_routing(0, 3, 2, device=DEV)
    assert run(module, torch.randn(0, 64, device=DEV), idx, w, "grouped").shape == (0, 64)
    idx, w = random_routing(2, 3, 2, device=DEV)
    assert run(module, torch.zeros(2, 64, device=DEV), idx, w, "batched").abs().max() == 0  # amax 0: no NaN


def test_bad_modules_raise_clear_errors():
    module = quantised(3, 64, 32, ("fp8_block", "float32", (32, 32)))
    idx, w = random_routing(2, 3, 2, device=DEV)
    x = torch.randn(2, 64, device=DEV)
    broken = copy.deepcopy(module)
    broken.gate_up_proj_scale_inv = torch.nn.Parameter(broken.gate_up_proj_scale_inv[:, :1], requires_grad=False)
    with pytest.raises(ValueError, match=r"gate_up_proj_scale_inv must be \[3, 2, 2\]"):
        run(broken, x, idx, w, "grouped")
    broken = copy.deepcopy(module)
    broken.selector_scale_format = "ue8m0"
    with pytest.raises(ValueError, match="UE8M0 bytes"):
        run(broken, x, idx, w, "grouped")
    broken = copy.deepcopy(module)
    broken.selector_activation_quant = "static"
    with pytest.raises(ValueError, match="static activation quantisation needs"):
        run(broken, x, idx, w, "batched")


# ----------------------------------------------------------------------------------------------------------------
# The ranking sees the format; explicit requests fail at the first forward.
# ----------------------------------------------------------------------------------------------------------------


def test_problem_from_module_sees_the_format():
    module = quantised(4, 96, 40, ("fp4", "ue8m0", None), dtype=torch.bfloat16)
    p = problem_from_module(module, top_k=2)
    assert (p.weight_format, p.scale_format, p.activation_quant) == ("fp4", "ue8m0", "dynamic")
    assert p.dtype == "bfloat16" and p.hidden_size == 96 and p.intermediate_size == 40  # fp4 bytes hold 2 inputs


def test_ranking_excludes_backends_that_cannot_run_the_format():
    module = quantised(4, 64, 32, ("fp8_block", "ue8m0", (32, 32)))
    ranking = selector.explain_model(module, num_tokens=4)[""]
    names = [c.name for c in ranking.candidates]
    if not CUDA:
        assert set(names) == {"batched_mm", "grouped_mm"}
    assert "does not run fp8_block expert weights" in ranking.excluded["eager"].reason
    x = torch.randn(4, 64, device=DEV)
    idx, w = random_routing(4, 4, 2, device=DEV)
    out = module(x, idx, w)  # auto
    assert last_backend(module) in ("batched_mm", "grouped_mm", "triton_fused")  # triton_fused: with a GPU
    assert relative_error(out, Q.reference_forward(module, x, idx, w)) < 1e-4
    selector.set_experts_implementation(module, "eager")
    with pytest.raises(ValueError, match="'eager' cannot run here: does not run fp8_block expert weights"):
        module(x, idx, w)


def test_quantising_in_place_after_a_dense_forward_re_chooses():
    module = make_experts(4, 64, 32, device=DEV, seed=8)
    selector.set_experts_implementation(module, "eager")
    x = torch.randn(3, 64, device=DEV)
    idx, w = random_routing(3, 4, 2, device=DEV)
    module(x, idx, w)
    Q.quantize_experts(module, "fp8_block", "float32", (32, 32))
    with pytest.raises(ValueError, match="'eager' cannot run here"):
        module(x, idx, w)
    selector.set_experts_implementation(module, "auto")
    assert relative_error(module(x, idx, w), Q.reference_forward(module, x, idx, w)) < 1e-4
    Q.dequantize_experts(module)
    selector.set_experts_implementation(module, "eager")
    module(x, idx, w)  # dense again
    assert last_backend(module) == "eager"


# Runs in a fresh interpreter where `import triton` fails: what the dense forwards of the pure-torch backends
# import, and whether they work without Triton (torch itself treats a failed triton import as "not installed").
_NO_TRITON = """
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("blocked: " + name)

sys.meta_path.insert(0, _Block())
import torch
from experts_fixtures import make_experts, random_routing, reference_experts, relative_error
from selector.dispatch import backend_forward

module = make_experts(4, 32, 16)
idx, w = random_routing(3, 4, 2)
x = torch.randn(3, 32)
ref = reference_experts(module, x, idx, w)
for name in ("eager", "batched_mm", "grouped_mm"):
    assert relative_error(backend_forward(name, "dense")(module, x, idx, w), ref) < 1e-5, name
kernels = [m for m in sys.modules if m.startswith(("triton", "selector.plugins.triton_common",
           "selector.plugins.triton_fused.", "selector.plugins.quant_kernels."))]
assert not kernels, kernels
"""


def test_dense_torch_backends_import_no_triton():
    """eager, batched_mm and grouped_mm run dense experts without Triton: their specs and dense forwards import
    neither triton nor the Triton backends' kernel modules (only a quantised format's forward loads those)."""
    import subprocess
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _NO_TRITON], cwd=tests, capture_output=True, text=True, timeout=300,
                         env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]


def _env(**variables):
    base = {"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""}
    return collect_environment(environ={**base, **variables})


@pytest.fixture(scope="module")
def registry():
    return build_registry(environ={})


def _problem(**kw):
    base = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2, dtype="bfloat16", device="cuda",
                weight_format="fp8_block", scale_format="ue8m0")  # fmt: skip
    return Problem(**{**base, **kw})


@pytest.mark.parametrize("name", ["batched_mm", "grouped_mm", "triton_fused"])
def test_quantised_requirements_and_checks(registry, name, monkeypatch):
    spec = registry.get(name)
    assert evaluate(spec, _problem(), _env()).ok
    assert evaluate(spec, _problem(weight_format="fp4"), _env()).ok
    assert evaluate(spec, _problem(activation_quant="static"), _env()).ok
    if name != "triton_fused":  # its dense kernels are Triton too
        assert evaluate(spec, _problem(weight_format="dense", scale_format=None), _env(SELECTOR_PACKAGE_TRITON="")).ok
    v = evaluate(spec, _problem(), _env(SELECTOR_PACKAGE_TRITON=""))
    assert v.status is Status.MISSING_PACKAGE and "triton" in v.reason and v.status.error_type is ImportError
    v = evaluate(spec, _problem(), _env(SELECTOR_GPUS="NVIDIA A100-SXM4-80GB:8.0:80"))
    assert v.status is Status.UNSUPPORTED_HARDWARE and "8.9" in v.reason and "A100" in v.found
    v = evaluate(spec, _problem(weight_format="fp4", scale_format="float32"), _env())
    assert v.status is Status.UNSUPPORTED_CONFIG and "UE8M0" in v.reason and v.status.error_type is ValueError
    if name == "triton_fused":  # CUDA only, dense or not (tests call its forward directly under the interpreter)
        assert evaluate(spec, _problem(device="cpu"), _env()).status is Status.UNSUPPORTED_DEVICE
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    v = evaluate(spec, _problem(device="cpu"), _env())
    assert v.status is Status.UNSUPPORTED_DEVICE and "TRITON_INTERPRET=1" in v.reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert evaluate(spec, _problem(device="cpu"), _env()).ok


def test_dense_only_backends_exclude_quantised_formats(registry):
    for fmt in ("fp8_block", "fp4"):
        v = evaluate(registry.get("eager"), _problem(weight_format=fmt), _env())
        assert v.status is Status.UNSUPPORTED_CONFIG and f"does not run {fmt} expert weights" in v.reason


@pytest.mark.skipif(CUDA, reason="CPU-only: the interpreter switch")
def test_named_backend_without_interpreter_raises_import_error_at_first_forward(monkeypatch):
    module = quantised(3, 64, 32, ("fp8_block", "float32", (32, 32)))
    selector.set_experts_implementation(module, "grouped_mm")  # naming it does not raise
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    idx, w = random_routing(2, 3, 2)
    with pytest.raises(ImportError, match="'grouped_mm' cannot run here.*TRITON_INTERPRET=1.*fix:"):
        module(torch.randn(2, 64), idx, w)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints.
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, static",
    [(FORMATS[0].values[0], False), (FORMATS[1].values[0], True), (FORMATS[2].values[0], False)],
    ids=["fp8-f32", "fp8-ue8m0-static", "fp4"],
)
def test_round_trip_quantise_save_load_same_outputs(tmp_path, fmt, static):
    module = make_experts(4, 64, 40, dtype=torch.bfloat16, device=DEV, seed=21)
    x = torch.randn(6, 64, device=DEV, dtype=torch.bfloat16)
    idx, w = random_routing(6, 4, 2, device=DEV)
    kw = {}
    if static:
        kw = dict(activation_quant="static", activation_scales=Q.calibrate_activation_scales(module, x, idx))
    Q.quantize_experts(module, *fmt, **kw)
    prefix = "model.layers.3.mlp.experts"
    C.save_experts(module, tmp_path, prefix)
    keys = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert keys["quant_method"] == "fp8" and keys["activation_scheme"] == ("static" if static else "dynamic")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f"{prefix}.0.gate_proj.weight", f"{prefix}.0.up_proj.weight_scale_inv", f"{prefix}.3.down_proj.weight"} <= names

    fresh = make_experts(4, 64, 40, dtype=torch.bfloat16, device=DEV, seed=99)
    C.load_experts(fresh, tmp_path, prefix)
    assert Q.quant_format(fresh) == Q.quant_format(module)
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        a, b = getattr(fresh, name), getattr(module, name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for mode in MODES:
        assert torch.equal(run(fresh, x, idx, w, mode), run(module, x, idx, w, mode))


def test_dequantize_true_path_gives_bf16_experts(tmp_path):
    module = quantised(4, 64, 40, ("fp8_block", "ue8m0", (32, 32)), dtype=torch.bfloat16, seed=22)
    C.save_experts(module, tmp_path, "experts")
    want_up, want_down = Q.dequantized_weights(module, torch.bfloat16)
    fresh = make_experts(4, 64, 40, dtype=torch.bfloat16, device=DEV, seed=1)
    C.load_experts(fresh, tmp_path, "experts", dequantize=True)
    assert fresh.gate_up_proj.dtype == torch.bfloat16 and Q.quant_format(fresh) is None
    assert torch.equal(fresh.gate_up_proj, want_up) and torch.equal(fresh.down_proj, want_down)
    assert problem_from_module(fresh).weight_format == "dense"
    ranking = selector.explain_model(fresh, num_tokens=4)[""]
    assert "eager" not in ranking.excluded  # dense again: every bf16 backend may run it
    # and the config's own dequantize flag, through Transformers' FineGrainedFP8Config where installed
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["dequantize"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    fresh2 = make_experts(4, 64, 40, dtype=torch.bfloat16, device=DEV, seed=1)
    C.load_experts(fresh2, tmp_path, "experts")
    assert torch.equal(fresh2.gate_up_proj, want_up)
    x = torch.randn(3, 64, device=DEV, dtype=torch.bfloat16)
    idx, w = random_routing(3, 4, 2, device=DEV)
    selector.set_experts_implementation(fresh2, "grouped_mm")
    ref = Q.reference_forward(module, x, idx, w, quantize_activations_as_kernel=False)
    assert relative_error(fresh2(x, idx, w), ref) < 2e-2  # bf16 dense compute


def test_quantization_config_sources():
    got = C.read_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]})  # fmt: skip  (DeepSeek-V3's config)
    assert got == {"weight_format": "fp8_block", "scale_format": "float32", "block_size": (128, 128),
                   "activation_quant": "dynamic", "dequantize": False}  # fmt: skip
    got = C.read_quantization_config({"quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4",
                                                               "scale_fmt": "ue8m0"}})  # fmt: skip
    assert got["weight_format"] == "fp4" and got["scale_format"] == "ue8m0"
    with pytest.raises(ValueError, match="only fine-grained 'fp8'"):
        C.read_quantization_config({"quant_method": "awq"})
    with pytest.raises(ValueError, match="scale_fmt"):
        C.read_quantization_config({"quant_method": "fp8", "scale_fmt": "e5m2"})
    tf = pytest.importorskip("transformers")
    got = C.read_quantization_config(tf.FineGrainedFP8Config(weight_block_size=(64, 32), scale_fmt="ue8m0", dequantize=True))
    assert got["block_size"] == (64, 32) and got["scale_format"] == "ue8m0" and got["dequantize"]


def test_load_variants(tmp_path):
    """uint8 UE8M0 scales (MXFP8 style), `.scale` naming (DeepSeek-V4-Flash), Transformers' fused naming, and
    the block size read off the scale grid when no config is given."""
    from safetensors.torch import save_file

    module = quantised(3, 64, 64, ("fp8_block", "ue8m0", (32, 32)), seed=23)
    tensors = C.experts_state_dict(module, "mlp.experts")
    renamed = {}
    for k, v in tensors.items():
        if k.endswith("weight_scale_inv"):
            renamed[k[: -len("weight_scale_inv")] + "scale"] = v.view(torch.uint8)
        else:
            renamed[k] = v
    save_file(renamed, str(tmp_path / "a.safetensors"))
    fresh = make_experts(3, 64, 64, seed=5)
    C.load_experts(fresh, tmp_path / "a.safetensors", "mlp.experts")
    assert Q.quant_format(fresh) == Q.quant_format(module)
    assert torch.equal(fresh.gate_up_proj_scale_inv.view(torch.uint8), module.gate_up_proj_scale_inv.view(torch.uint8).cpu())

    fused = {f"m.experts.{n}": getattr(module, n).detach().cpu() for n in
             ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")}  # fmt: skip
    save_file(fused, str(tmp_path / "b.safetensors"))
    fresh = make_experts(3, 64, 64, seed=6)
    C.load_experts(fresh, [tmp_path / "b.safetensors"], "m.experts", quantization_config={"quant_method": "fp8",
                   "scale_fmt": "ue8m0", "weight_block_size": [32, 32]})  # fmt: skip
    assert torch.equal(fresh.down_proj.view(torch.uint8), module.down_proj.view(torch.uint8).cpu())

    with pytest.raises(ValueError, match="checkpoint has 3 experts, the module 4"):
        C.load_experts(make_experts(4, 64, 64), tmp_path / "b.safetensors", "m.experts")
    with pytest.raises(KeyError, match="no mlp.experts.0.down_proj.weight"):
        C.load_experts(make_experts(3, 64, 64), tmp_path / "b.safetensors", "mlp.experts")


def test_load_model_experts_walks_the_model(tmp_path):
    class Model(torch.nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.layers = torch.nn.ModuleList([make_experts(2, 32, 32, seed=seed + i) for i in range(2)])

    src = Model(0)
    for m in src.layers:
        Q.quantize_experts(m, "fp4")
    C.save_experts({f"layers.{i}": m for i, m in enumerate(src.layers)}, tmp_path)
    dst = Model(7)
    assert C.load_model_experts(dst, tmp_path) == ["layers.0", "layers.1"]
    assert all(m.selector_weight_format == "fp4" for m in dst.layers)
    assert torch.equal(dst.layers[1].down_proj, src.layers[1].down_proj)


# ----------------------------------------------------------------------------------------------------------------
# GPU.
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", [("fp8_block", "float32", None), ("fp8_block", "ue8m0", None), ("fp4", "ue8m0", None)])
@pytest.mark.parametrize("tokens", [1, 8, 64, 700])
def test_gpu_bf16_against_reference(fmt, mode, tokens):
    module = quantised(16, 512, 384, fmt, dtype=torch.bfloat16, seed=31)
    idx, w = random_routing(tokens, 16, 4, device="cuda", skew=tokens == 64)
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    check(module, x, idx, w, mode, dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    module = quantised(8, 256, 128, ("fp8_block", "ue8m0", None), dtype=torch.bfloat16)
    idx, w = random_routing(4, 8, 2, device="cuda")
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    for mode in MODES:
        want = run(module, x, idx, w, mode)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = run(module, x, idx, w, mode)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def replayed(module, x, idx, w, mode):
    """The layer's plan as the dispatch core runs it: replayed from a recorded graph where its GraphPolicy allows."""
    from selector import graphs
    from selector.plugins.quant_kernels.forward import prepare_quantised
    from selector.problem import problem_from_module

    plan = prepare_quantised(module, problem_from_module(module, top_k=idx.shape[1]), mode, "quant")
    policy = plan.graphs
    if policy is None or not graphs.graphs_enabled(x, policy.max_tokens, policy.variable):
        return plan.run(x, idx, w)
    key = (mode, x.shape, x.dtype, idx.shape, idx.dtype, w.dtype, x.device)
    return graphs.replay(module, "quant", key, plan.run, (x, idx, w))


@pytest.mark.gpu
def test_gpu_decode_graph_replay_matches_direct_launches(monkeypatch):
    module = quantised(8, 256, 128, ("fp4", "ue8m0", None), dtype=torch.bfloat16)
    for tokens in (1, 5, 64):
        idx, w = random_routing(tokens, 8, 2, device="cuda")
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        for mode in MODES:
            monkeypatch.setenv("SELECTOR_QUANT_GRAPHS", "1")
            first, again = replayed(module, x, idx, w, mode), replayed(module, x, idx, w, mode)  # record, replay
            monkeypatch.setenv("SELECTOR_QUANT_GRAPHS", "0")
            direct = run(module, x, idx, w, mode)
            assert torch.equal(first, direct) and torch.equal(again, direct)
    from selector import graphs

    assert len(graphs.graphs_of(module, "quant")) == 6


@pytest.mark.compile
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_torch_compile(mode):
    module = quantised(8, 256, 128, ("fp8_block", "float32", None), dtype=torch.bfloat16)
    idx, w = random_routing(4, 8, 2, device="cuda")
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda a, b, c: run(module, a, b, c, mode), fullgraph=True)
    assert torch.equal(compiled(x, idx, w), run(module, x, idx, w, mode))


@pytest.mark.skipif(CUDA, reason="the GPU runs the real script")
def test_interpreter_is_on_without_gpu():
    if not CUDA:
        assert os.environ.get("TRITON_INTERPRET") == "1"


def test_plain_projection_tiles_straddling_gate_and_up_read_both_scale_rows():
    """A post-expert-norm layer runs gate_up as a plain projection over [gate | up] channels whose scale blocks
    restart at the up half (I = 40, 32-wide blocks): a 32-wide tile at channel 32 holds gate and up channels, so
    it must not take one scale for the whole tile (the GPU's tile heuristic picks 32 here; forced on CPU)."""
    module = quantised(4, 64, 40, ("fp8_block", "float32", (32, 32)), layout=Layout(post_norm=True), seed=14)
    idx, w = random_routing(5, 4, 2, device=DEV)
    x = torch.randn(5, 64, device=DEV)
    for bn in (16, 32):
        out = run(module, x, idx, w, "grouped", config={"BLOCK_M": 16, "BLOCK_N": bn})
        assert relative_error(out, Q.reference_forward(module, x, idx, w)) < EMULATED_TOL[torch.float32]
