"""The gates of selector.gates in triton_fused's gate_up epilogue, against a float64 reference written here from
Transformers' GPT-OSS definition (and act(gate) * up for act_mul).

CPU: the Triton interpreter (tests/conftest.py), fp32 and tiny (bf16 dots are wrong in the interpreter); the
relative error is ~1e-7 there, tolerance 1e-5. GPU (`gpu`): bf16 at GPT-OSS's size (H = I = 2880, E = 32,
k = 4); bf16 rounds the input, the intermediate and each slot's output (8-bit mantissa, ~4e-3 each): 2e-2.
Every buffer is poisoned before the kernels run (triton_common.launch.POISON): an element a kernel does not
write turns the result into NaN and the test fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from selector.plugins.triton_common import launch as L
from selector.plugins.triton_fused import kernels as K
from selector.plugins.triton_fused.forward import triton_fused_experts_forward

import selector
from selector.gates import DEFAULT_GATE, Gate, clamped_swiglu
from selector.testing import Layout, make_experts, random_routing, reference_experts, relative_error

pytestmark = pytest.mark.interpreter

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
FP32_TOL = 1e-5
BF16_TOL = 2e-2


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(L, "POISON", True)


@pytest.fixture(autouse=True)
def _exact_fp32_dots():
    """fp32 cases compare at 1e-5: Triton's exact fp32 dots (torch's "highest" matmul precision), not tf32."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


_ACT = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
    "relu": torch.relu,
}


def apply_gate64(h: torch.Tensor, gate: Gate, activation: str, interleaved: bool) -> torch.Tensor:
    """The gate on float64 gate_up outputs: GPT-OSS's `_apply_gate` (Transformers), or act(gate) * up."""
    g, u = (h[:, 0::2], h[:, 1::2]) if interleaved else h.chunk(2, dim=-1)
    if gate.name == "clamped_swiglu":
        g = g.clamp(max=gate.limit)
        u = u.clamp(min=-gate.limit, max=gate.limit)
        return (u + 1) * (g * torch.sigmoid(g * gate.alpha))
    return _ACT[activation](g) * u


def reference(case: dict, num_experts: int, gate: Gate, activation: str = "silu", interleaved: bool = False,
              transposed: bool = False) -> torch.Tensor:  # fmt: skip
    """float64 on the inputs' device, one expert at a time: h = x W1 + b1, gate, y = h W2 + b2, weighted sum."""
    x, ids, wts = case["x"].double(), case["ids"], case["wts"].double()
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        if not 0 <= e < num_experts:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        w1, w2 = case["w1"][e].double(), case["w2"][e].double()
        h = x[tok] @ (w1 if transposed else w1.T)
        if case["b1"] is not None:
            h = h + case["b1"][e].double()
        h = apply_gate64(h, gate, activation, interleaved)
        o = h @ (w2 if transposed else w2.T)
        if case["b2"] is not None:
            o = o + case["b2"][e].double()
        out.index_add_(0, tok, o * wts[tok, slot, None])
    return out


def make_case(T: int, H: int, I: int, E: int, k: int, *, dtype=torch.float32, transposed=False, bias=False,
              routing="uniform", x_scale=1.0, device=DEV, seed=0) -> dict:  # fmt: skip
    """Random weights scaled so gate_up outputs are O(x_scale); routing "uniform" (distinct experts per token),
    "skewed" (80% of the tokens put expert 0 first) or "sparse" (only experts 1 and E - 2: the rest get none)."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where it runs: GPT-OSS's weights are 2 GB

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    x = randn(T, H) * x_scale
    w1 = randn(E, 2 * I, H) / math.sqrt(H)
    w2 = randn(E, H, I) / math.sqrt(I)
    if transposed:
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    routes = torch.Generator().manual_seed(seed)
    if routing == "sparse":
        assert k == 2 and E >= 4
        ids = torch.tensor([[1, E - 2]] * T)
    else:
        ids = torch.stack([torch.randperm(E, generator=routes)[:k] for _ in range(T)])
        if routing == "skewed":
            for t in range(int(0.8 * T)):
                row = ids[t].tolist()
                ids[t] = torch.tensor([0] + [e for e in row if e != 0][: k - 1])
    wts = torch.rand(T, k, generator=routes)
    b1 = randn(E, 2 * I) * 0.5 if bias else None
    b2 = randn(E, H) * 0.5 if bias else None

    def to(t):
        return None if t is None else t.to(device=device, dtype=dtype)

    return dict(x=to(x), w1=to(w1), w2=to(w2), ids=ids.long().to(device), wts=wts.to(device), b1=to(b1), b2=to(b2))


def run_and_check(case: dict, E: int, gate: Gate, tol: float, *, activation="silu", interleaved=False,
                  transposed=False) -> float:  # fmt: skip
    out = K.fused_experts(
        case["x"], case["w1"], case["w2"], case["ids"], case["wts"], num_experts=E, activation=activation,
        interleaved=interleaved, transposed=transposed, gate_up_bias=case["b1"], down_bias=case["b2"],
        gate=gate.name, gate_alpha=gate.alpha, gate_limit=gate.limit,
    )  # fmt: skip
    assert out.shape == case["x"].shape and out.dtype == case["x"].dtype
    assert torch.isfinite(out).all(), "unwritten (poisoned) or non-finite output"
    ref = reference(case, E, gate, activation, interleaved, transposed)
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    return err


GPT_OSS = clamped_swiglu()  # alpha 1.702, limit 7
TIGHT = clamped_swiglu(alpha=1.0, limit=0.5)  # both clamps bite on O(1) values

# id, (T, H, I, E, k), gate, kwargs of make_case / run_and_check
CASES = [
    ("silu", (5, 32, 16, 4, 2), DEFAULT_GATE, dict(activation="silu")),
    ("gelu_interleaved", (5, 32, 16, 4, 2), DEFAULT_GATE, dict(activation="gelu", interleaved=True)),
    ("gelu_tanh", (4, 32, 16, 4, 2), DEFAULT_GATE, dict(activation="gelu_tanh")),
    ("relu_interleaved", (4, 32, 16, 4, 2), DEFAULT_GATE, dict(activation="relu", interleaved=True)),
    ("clamped_concatenated", (5, 32, 16, 4, 2), TIGHT, {}),
    ("clamped_interleaved", (5, 32, 16, 4, 2), TIGHT, dict(interleaved=True)),
    ("gpt_oss_layout", (6, 32, 16, 4, 2), GPT_OSS, dict(interleaved=True, transposed=True, bias=True, x_scale=8.0)),
    ("gpt_oss_odd", (13, 37, 19, 5, 3), TIGHT, dict(interleaved=True, transposed=True, bias=True)),
    ("gpt_oss_T1", (1, 32, 24, 4, 2), GPT_OSS, dict(interleaved=True, transposed=True, bias=True, x_scale=8.0)),
    ("clamped_T1", (1, 32, 16, 8, 4), TIGHT, {}),
    ("gelu_tanh_T1", (1, 32, 16, 8, 3), DEFAULT_GATE, dict(activation="gelu_tanh", interleaved=True)),
    ("skewed", (20, 32, 16, 6, 2), TIGHT, dict(interleaved=True, transposed=True, bias=True, routing="skewed")),
    ("empty_experts", (7, 32, 16, 8, 2), TIGHT, dict(interleaved=True, transposed=True, bias=True, routing="sparse")),
]
_RUN = ("activation", "interleaved", "transposed")


@pytest.mark.parametrize(("shape", "gate", "kw"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_gate_matches_the_reference_fp32(shape, gate, kw):
    T, H, I, E, k = shape
    case = make_case(T, H, I, E, k, **{n: v for n, v in kw.items() if n not in _RUN or n == "transposed"})
    run_and_check(case, E, gate, FP32_TOL, **{n: v for n, v in kw.items() if n in _RUN})


def test_the_clamps_and_biases_change_the_result():
    """A test that could not fail: guard against a reference that ignores limit, alpha or the (up + 1) term."""
    case = make_case(6, 32, 16, 4, 2, transposed=True, bias=True, x_scale=8.0)
    base = reference(case, 4, GPT_OSS, interleaved=True, transposed=True)
    for other in (clamped_swiglu(1.702, 70.0), clamped_swiglu(1.0, 7.0), DEFAULT_GATE):
        assert relative_error(reference(case, 4, other, interleaved=True, transposed=True), base) > 1e-2


def test_bad_gate_arguments_are_refused():
    case = make_case(2, 32, 16, 4, 2)
    args = (case["x"], case["w1"], case["w2"], case["ids"], case["wts"])
    with pytest.raises(ValueError, match="gate 'swish' is not supported"):
        K.fused_experts(*args, num_experts=4, gate="swish")
    with pytest.raises(ValueError, match="needs a finite number gate_limit"):
        K.fused_experts(*args, num_experts=4, gate="clamped_swiglu", gate_alpha=1.0)
    with pytest.raises(ValueError, match="needs gated experts"):
        K.fused_experts(case["x"], case["w1"][:, :16], case["w2"], case["ids"], case["wts"], num_experts=4,
                        gated=False, gate="clamped_swiglu", gate_alpha=1.0, gate_limit=7.0)  # fmt: skip


# --- whole modules through the adapter ---------------------------------------------------------------------------


def _gpt_oss_experts(hidden: int, inter: int, experts: int, top_k: int, limit: float = 7.0, seed: int = 0,
                     device: str = DEV, dtype: torch.dtype = torch.float32):  # fmt: skip
    """A real Transformers GptOssExperts with random weights (its init leaves them empty), built on `device`."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                       num_experts_per_tok=top_k, swiglu_limit=limit)  # fmt: skip
    with torch.device(device):
        module = GptOssExperts(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    scales = {"gate_up_proj": hidden**-0.5, "down_proj": inter**-0.5, "gate_up_proj_bias": 0.5, "down_proj_bias": 0.5}
    with torch.no_grad():
        for name, scale in scales.items():
            p = getattr(module, name)
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * scale)
    return module.to(dtype)


def _eager(module, x, index, weights):
    """Transformers' own loop over experts (the module's original forward)."""
    module.config._experts_implementation = "eager"
    with torch.no_grad():
        return module(x, index, weights)


def test_selectors_gpt_oss_layout_module_runs_fused():
    layout = Layout(custom_gate=True, interleaved=True, bias=True, transposed=True)
    module = make_experts(5, 32, 16, layout, device=DEV, seed=4)
    x = torch.randn(9, 32, device=DEV) * 4
    index, weights = random_routing(9, 5, 2, DEV, skew=True)
    with torch.no_grad():  # no backward for this gate: inference only
        out = triton_fused_experts_forward(module, x, index, weights)
    assert relative_error(out, reference_experts(module, x, index, weights)) < FP32_TOL


def test_transformers_gpt_oss_experts_run_fused_fp32():
    module = _gpt_oss_experts(32, 16, 4, 2, limit=1.5, seed=5)
    x = torch.randn(7, 32, device=DEV) * 2
    index, weights = random_routing(7, 4, 2, DEV)
    with torch.no_grad():
        out = triton_fused_experts_forward(module, x, index, weights)
    eager = _eager(module, x, index, weights)
    ref = reference_experts(module, x, index, weights)
    assert relative_error(eager, ref) < FP32_TOL  # the reference is Transformers' layer
    assert relative_error(out, ref) < FP32_TOL


def _load_fused():  # noqa: ANN202
    return triton_fused_experts_forward


@selector.hookimpl
def _fused_cpu_backends():
    """triton_fused's own declaration (its gates included), on the CPU: its kernels run in the interpreter."""
    from dataclasses import replace

    from selector.plugins.triton_fused import selector_backends

    spec = selector_backends()[0]
    req = replace(spec.requirements, devices=frozenset({"cpu"}), min_compute_capability=None, packages={})
    return [selector.BackendSpec(name="fused_gates_cpu", load=_load_fused, requirements=req, check=spec.check,
                                 estimate=lambda problem, env: 1e-9)]  # fmt: skip


@pytest.mark.skipif(CUDA, reason="on a CPU, where the kernels run in the interpreter")
def test_transformers_gpt_oss_experts_through_registration_run_fused():
    """Transformers' experts interface asked for the fused backend: the GPT-OSS gate is recognised, the request
    is honoured (no refusal, no fallback) and the result matches Transformers' own loop."""
    import types

    from selector import hf
    from selector.dispatch import reset_selection_caches
    from selector.registry import register_plugin, unregister_plugin

    register_plugin(types.SimpleNamespace(selector_backends=_fused_cpu_backends), "fused_gates_cpu_plugin")
    reset_selection_caches()
    try:
        hf.register_with_transformers()
        module = _gpt_oss_experts(32, 24, 5, 2, limit=2.0, seed=7, device="cpu")
        x = torch.randn(6, 32) * 2
        index, weights = random_routing(6, 5, 2, "cpu", skew=True)
        eager = _eager(module, x, index, weights)
        module.config._experts_implementation = hf.PREFIX + "fused_gates_cpu"
        with torch.no_grad():
            out = module(x, index, weights)
        assert selector.last_backend(module) == "fused_gates_cpu"
        assert relative_error(out, eager.double()) < FP32_TOL
    finally:
        unregister_plugin("fused_gates_cpu_plugin")
        reset_selection_caches()
        hf.register_with_transformers()


def test_a_custom_python_gate_is_refused_not_miscomputed():
    module = make_experts(4, 32, 16, Layout(interleaved=True), device=DEV, seed=6)
    type(module)._apply_gate = lambda self, x: torch.nn.functional.silu(x[..., ::2]) * x[..., 1::2] * 0.5
    index, weights = random_routing(3, 4, 2, DEV)
    with pytest.raises(ValueError, match="_apply_gate is not a gate of selector.gates"):
        triton_fused_experts_forward(module, torch.randn(3, 32, device=DEV), index, weights)


# --- the GPU: bf16 at GPT-OSS's size -------------------------------------------------------------------------------

GPT_OSS_SIZE = (2880, 2880, 32, 4)  # H, I, E, k


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
@pytest.mark.parametrize("T", [1, 7, 256])
def test_gpu_gpt_oss_layout_bf16(T, routing):
    H, I, E, k = GPT_OSS_SIZE
    case = make_case(T, H, I, E, k, dtype=torch.bfloat16, transposed=True, bias=True, routing=routing,
                     x_scale=4.0, device="cuda", seed=T)  # fmt: skip
    run_and_check(case, E, GPT_OSS, BF16_TOL, interleaved=True, transposed=True)


@pytest.mark.gpu
def test_gpu_experts_without_tokens_bf16():
    H, I, E, _ = GPT_OSS_SIZE
    case = make_case(64, H, I, E, 2, dtype=torch.bfloat16, transposed=True, bias=True, routing="sparse",
                     device="cuda", seed=3)  # fmt: skip
    run_and_check(case, E, TIGHT, BF16_TOL, interleaved=True, transposed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", [DEFAULT_GATE, TIGHT], ids=str)
def test_gpu_gates_concatenated_bf16(gate):
    case = make_case(96, 1024, 512, 16, 4, dtype=torch.bfloat16, device="cuda", seed=4)
    run_and_check(case, 16, gate, BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 300])
def test_gpu_transformers_gpt_oss_through_registration_bf16(T):
    """A real GptOssExperts at GPT-OSS's size, asked for `selector:triton_fused` through Transformers' experts
    interface: the fused kernels run it (no fallback) and match Transformers' own eager loop."""
    from selector import hf

    hf.register_with_transformers()
    H, I, E, k = GPT_OSS_SIZE
    module = _gpt_oss_experts(H, I, E, k, seed=T, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(T)
    x = (torch.randn(T, H, generator=gen) * 2).to("cuda", torch.bfloat16)
    index, weights = random_routing(T, E, k, "cuda")
    weights = weights.to(torch.bfloat16)
    eager = _eager(module, x, index, weights)
    module.config._experts_implementation = hf.PREFIX + "triton_fused"
    with torch.no_grad():
        out = module(x, index, weights)
        again = module(x, index, weights)  # a CUDA-graph replay at decode sizes: the same values
    assert selector.last_backend(module) == "triton_fused"
    assert torch.equal(out, again)
    ref = _module_reference64(module, x, index, weights)
    assert relative_error(out, ref) < BF16_TOL
    assert relative_error(eager, ref) < BF16_TOL
    assert relative_error(out, eager.double().cpu()) < 1.5 * BF16_TOL


def _module_reference64(module, x, index, weights):
    """float64 on the module's device, one expert at a time, with the module's own _apply_gate (Transformers')
    and its transposed weights: reference_experts' definition without copying every expert to the CPU."""
    x64, w64, out = x.double(), weights.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in index.unique().tolist():
        tok, slot = torch.nonzero(index == e, as_tuple=True)
        h = x64[tok] @ module.gate_up_proj[e].double() + module.gate_up_proj_bias[e].double()
        o = module._apply_gate(h) @ module.down_proj[e].double() + module.down_proj_bias[e].double()
        out.index_add_(0, tok, o * w64[tok, slot, None])
    return out.cpu()


@pytest.mark.skipif(CUDA, reason="the interpreter's CPU tensors; on a GPU test_tile_tuning_kernels times real kernels")
def test_tile_tuning_times_the_gpt_oss_epilogue_in_the_interpreter(tmp_path, monkeypatch):
    """The tuner's bench builds the GPT-OSS layer (transposed, interleaved, biases) and launches its gate_up
    GEMM with the clamped SwiGLU; the tiles land under the layout's own key."""
    import time
    from dataclasses import replace

    from selector.plugins.triton_fused import configs as C
    from selector.plugins.triton_fused import tune as TU

    from selector.presets import preset

    monkeypatch.setenv("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", str(tmp_path / "user"))
    C.clear_caches()
    launched = []
    real_launch = K._launch_gemm
    monkeypatch.setattr(K, "_launch_gemm", lambda gemm, *a, **kw: launched.append(gemm) or real_launch(gemm, *a, **kw))

    def wall_timer(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    problem = replace(preset("gpt-oss-20b"), num_experts=4, hidden_size=32, intermediate_size=16, top_k=2,
                      dtype="float16", device="cpu")  # fmt: skip
    try:
        bench = TU.LayerBench(problem, torch.device("cpu"), wall_timer)
        summary = TU.tune_kernels(problem, (4,), 60.0, measure=bench, device_name="Interpreter GPU")
        assert summary["skipped"] is None and summary["tokens_tuned"] == [4]
        assert summary["shape"] == "E=4,H=32,I=16,k=2,transposed,interleaved"
        assert set(C.load_user_table("Interpreter GPU")) == {summary["shape"]}
    finally:
        C.clear_caches()
    gate_up = [gemm for gemm in launched if gemm.gated]  # the layer's gate_up records, as launched
    assert gate_up
    assert all((g.gate, g.gate_alpha, g.gate_limit, g.interleaved) == (1, 1.702, 7.0, True) for g in gate_up)


@pytest.mark.skipif(CUDA, reason="on a CPU, where the kernels run in the interpreter")
def test_triton_fused_declaration_keeps_its_contract_in_the_interpreter():
    """Every layout triton_fused declares (the GPT-OSS gate on interleaved channels included) matches the
    float64 reference: selector.testing's contract check with its declaration moved to the CPU."""
    from selector.testing import check_backend_contract

    spec = _fused_cpu_backends()[0]
    report = check_backend_contract(spec, device="cpu", token_counts=(0, 5))
    assert report.ok, report.describe()
    assert report.results["custom_gate"] == "ok"  # selector's clamped SwiGLU: a gate the epilogue runs
    assert report.results["post_expert_norm"] == "not declared"
