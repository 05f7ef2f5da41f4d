"""Testing helpers for backend authors: random experts modules of every layout, a float64 reference written from
the definition, and a contract check that runs a backend on every layout it declares.

    from selector.testing import check_backend_contract
    report = check_backend_contract(MY_SPEC)       # every declared layout, on this machine's device
    assert report.ok, report.describe()

The reference loops over tokens and slots in float64 on the CPU, straight from the definition (not from any
backend), so a backend checked against it is checked against the maths, not against another backend.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import selector
from selector.layers import clamped_swiglu


@dataclass(frozen=True)
class Layout:
    gated: bool = True
    bias: bool = False
    transposed: bool = False
    interleaved: bool = False
    custom_gate: bool = False
    post_norm: bool = False
    expert_parallel: bool = False

    def __str__(self) -> str:
        on = [k for k, v in self.__dict__.items() if v is True and k != "gated"]
        return "-".join((["gated"] if self.gated else ["plain"]) + on)


def make_experts(
    num_experts: int,
    hidden: int,
    inter: int,
    layout: Layout = Layout(),
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    act: torch.nn.Module | None = None,
    seed: int | None = None,
) -> torch.nn.Module:
    """A decorated experts module with random weights (scaled so activations stay O(1))."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)

    @selector.experts(
        has_gate=layout.gated,
        has_bias=layout.bias,
        is_transposed=layout.transposed,
        is_concatenated=not layout.interleaved,
        has_post_expert_norm=layout.post_norm,
        gate_fn=clamped_swiglu if layout.custom_gate else None,
        replace_forward=True,  # its forward is the plain loop the decorator replaces
    )
    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = num_experts
            up_out = 2 * inter if layout.gated else inter

            def param(*shape: int, scale: float) -> torch.nn.Parameter:
                return torch.nn.Parameter((torch.randn(*shape, generator=gen) * scale).to(dtype))

            up_shape = (num_experts, hidden, up_out) if layout.transposed else (num_experts, up_out, hidden)
            down_shape = (num_experts, inter, hidden) if layout.transposed else (num_experts, hidden, inter)
            up = param(*up_shape, scale=hidden**-0.5)
            if layout.gated:
                self.gate_up_proj = up
            else:
                self.up_proj = up
            self.down_proj = param(*down_shape, scale=inter**-0.5)
            if layout.bias:
                bias = param(num_experts, up_out, scale=0.1)
                if layout.gated:
                    self.gate_up_proj_bias = bias
                else:
                    self.up_proj_bias = bias
                self.down_proj_bias = param(num_experts, hidden, scale=0.1)
            if layout.post_norm:
                self.post_expert_norm = torch.nn.LayerNorm(hidden, dtype=dtype)
            self.act_fn = act if act is not None else torch.nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):  # replaced by the decorator
            raise AssertionError("the decorator must replace forward")

    module = Experts().to(device)
    module._is_expert_parallel = layout.expert_parallel
    return module


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, device: str = "cpu", skew: bool = False, sentinel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token; `skew` sends most tokens to expert 0; `sentinel` marks some slots id == E."""
    scores = torch.rand(num_tokens, num_experts)
    if skew:
        scores[:, 0] += 10.0
    index = scores.topk(top_k, dim=1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k), dim=1)
    if sentinel and num_tokens:
        index[::2, -1] = num_experts
    return index.to(device), weights.to(device)


def reference_experts(
    module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """float64 loop over tokens and slots, straight from the definition."""
    ref = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)
    x, idx, w = hidden.detach().cpu().double(), index.cpu(), weights.detach().cpu().double()
    gated = getattr(ref, "has_gate", True)
    up_w = ref.gate_up_proj if gated else ref.up_proj
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= ref.num_experts:
                continue
            up = x[t] @ up_w[e] if ref.is_transposed else up_w[e] @ x[t]
            if ref.has_bias:
                up = up + (ref.gate_up_proj_bias[e] if gated else ref.up_proj_bias[e])
            h = ref._apply_gate(up) if gated else ref.act_fn(up)
            down = h @ ref.down_proj[e] if ref.is_transposed else ref.down_proj[e] @ h
            if ref.has_bias:
                down = down + ref.down_proj_bias[e]
            if getattr(ref, "has_post_expert_norm", False):  # Transformers before the norm has no such flag
                down = ref.post_expert_norm(down)
            out[t] += w[t, j] * down
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.detach().cpu().double()
    ref = ref.detach().cpu().double()  # a reference may be computed on the output's device
    assert torch.isfinite(out64).all(), "output holds NaN or inf"
    denom = ref.norm().item()
    return (out64 - ref).norm().item() / (denom if denom > 0 else 1.0)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


# --- the contract check ------------------------------------------------------------------------------------------

# Layouts the check builds, each named by the Requirements flag a backend sets to run it (None: the plain layout).
CONTRACT_LAYOUTS: tuple[tuple[str | None, Layout], ...] = (
    (None, Layout()),
    ("non_gated", Layout(gated=False)),
    ("bias", Layout(bias=True)),
    ("transposed", Layout(transposed=True)),
    ("interleaved", Layout(interleaved=True)),
    ("custom_gate", Layout(custom_gate=True, interleaved=True)),
    ("post_expert_norm", Layout(post_norm=True)),
    ("expert_parallel", Layout(expert_parallel=True)),
)
# what Layout field each Requirements flag turns on, to name a failing layout by what it declares
_FLAGS = {
    "non_gated": "gated",
    "bias": "bias",
    "transposed": "transposed",
    "interleaved": "interleaved",
    "custom_gate": "custom_gate",
    "post_expert_norm": "post_norm",
    "expert_parallel": "expert_parallel",
}


@dataclass
class ContractReport:
    """What the contract check ran: per layout, "ok", "not declared", "cannot run here: ..." or the failure."""

    backend: str
    device: str
    dtype: str
    results: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def describe(self) -> str:
        lines = [f"{self.backend} on {self.device} ({self.dtype}):"]
        lines += [f"  {layout}: {result}" for layout, result in self.results.items()]
        return "\n".join(lines)


def check_backend_contract(
    spec: object,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    token_counts: Sequence[int] = (0, 1, 7, 33),
    num_experts: int = 6,
    hidden: int = 32,
    inter: int = 16,
    top_k: int = 2,
    seed: int = 0,
) -> ContractReport:
    """Run a backend (`BackendSpec`, or a registered name) on every layout of CONTRACT_LAYOUTS it declares here
    and compare it with the float64 reference; a declared layout whose output is wrong (or that raises, writes
    into its inputs, or returns the wrong shape or dtype) is a failure. Layouts it does not declare are not run:
    the dispatch core never sends them (closed world). `device`: "cuda" when available, else "cpu"."""
    from selector.dispatch import get_backend_registry
    from selector.environment import current_environment
    from selector.problem import problem_from_module
    from selector.requirements import evaluate
    from selector.types import BackendSpec

    if isinstance(spec, str):
        spec = get_backend_registry().get(spec)
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"check_backend_contract takes a BackendSpec or a backend name, got {type(spec).__name__}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = ContractReport(spec.name, device, str(dtype).removeprefix("torch."))
    env = current_environment()
    forward = None
    for flag, layout in CONTRACT_LAYOUTS:
        name = flag or "plain"
        module = make_experts(num_experts, hidden, inter, layout, dtype=dtype, device=device, seed=seed)
        verdict = evaluate(spec, problem_from_module(module, top_k=top_k), env)
        if not verdict.ok:
            declared = flag is None or getattr(spec.requirements, flag)
            report.results[name] = f"cannot run here: {verdict.reason}" if declared else "not declared"
            continue
        if forward is None:
            forward = spec.load()
        problems = [
            _contract_failure(forward, module, layout, t, num_experts, top_k, dtype, device, seed) for t in token_counts
        ]
        found = [f"T={t}: {p}" for t, p in zip(token_counts, problems) if p]
        report.results[name] = "; ".join(found) if found else "ok"
        if found:
            what = f"declares {flag}=True" if flag else "runs the plain layout"
            report.failures.append(f"{spec.name} {what} but {found[0]}")
    return report


def _contract_failure(
    forward: object,
    module: torch.nn.Module,
    layout: Layout,
    tokens: int,
    num_experts: int,
    top_k: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> str | None:
    """Why one call breaks the contract, or None."""
    torch.manual_seed(seed + tokens)
    x = (torch.randn(tokens, module.down_proj.shape[-1 if layout.transposed else -2]) * 0.5).to(dtype).to(device)
    index, weights = random_routing(tokens, num_experts, top_k, device, sentinel=layout.expert_parallel)
    weights = weights.to(dtype)
    before = (x.clone(), index.clone(), weights.clone())
    try:
        with torch.no_grad():  # the forward's contract; what a backend differentiates is declared apart
            out = forward(module, x, index, weights)  # type: ignore[operator]
    except Exception as exc:
        return f"raised {type(exc).__name__}: {str(exc)[:200]}"
    if not all(torch.equal(a, b) for a, b in zip(before, (x, index, weights))):
        return "wrote into its inputs"
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        return f"returned {got}, expected {tuple(x.shape)} {x.dtype}"
    if tokens == 0:
        return None
    ref = reference_experts(module, x, index, weights)
    out64 = out.detach().cpu().double()
    if not torch.isfinite(out64).all():
        return "returned NaN or inf"
    error = (out64 - ref).norm().item() / max(ref.norm().item(), 1e-30)
    tolerance = TOLERANCE.get(dtype, 2e-2)
    return None if error <= tolerance else f"differs from the float64 reference (relative error {error:.2e} > {tolerance:g})"


def assert_backend_contract(spec: object, **options: object) -> ContractReport:
    """check_backend_contract, raising AssertionError with every failure (for a plugin's own test suite)."""
    report = check_backend_contract(spec, **options)  # type: ignore[arg-type]
    if not report.ok:
        raise AssertionError("\n".join(report.failures) + "\n" + report.describe())
    return report


__all__ = [
    "CONTRACT_LAYOUTS",
    "ContractReport",
    "Layout",
    "TOLERANCE",
    "assert_backend_contract",
    "check_backend_contract",
    "clamped_swiglu",
    "make_experts",
    "random_routing",
    "reference_experts",
    "relative_error",
]
