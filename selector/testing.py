"""Testing helpers for backend authors: random experts modules of every layout, a float64 reference written from
the definition, a contract check that runs a backend on every combination of the layout flags it declares, and
an installed-looking distribution written to a folder, to test the entry-point road without installing.

    from selector.testing import check_backend_contract
    report = check_backend_contract(MY_SPEC)       # every declared layout combination, on this machine's device
    assert report.ok, report.describe()

The reference computes, in float64 on the CPU, every token's own experts slot by slot, straight from the
definition (not from any backend), so a backend checked against it is checked against the maths, not against
another backend.
"""

from __future__ import annotations

import copy
import itertools
import os
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import selector
from selector.gates import CLAMPED_SWIGLU
from selector.hookspecs import ENTRY_POINT_GROUP
from selector.layers import clamped_swiglu
from selector.requirements import gates_run
from selector.types import Requirements


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
    num_tokens: int,
    num_experts: int,
    top_k: int,
    device: str = "cpu",
    skew: bool = False,
    sentinel: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token; `skew` sends most tokens to expert 0; `sentinel` marks some slots id == E;
    `generator`: a CPU generator to draw from (default: torch's global one)."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if skew:
        scores[:, 0] += 10.0
    index = scores.topk(top_k, dim=1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), dim=1)
    if sentinel and num_tokens:
        index[::2, -1] = num_experts
    return index.to(device), weights.to(device)


def reference_experts(
    module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """float64, straight from the definition: for each slot j, every token t runs its own expert idx[t, j]
    (weights gathered per token, one matrix-vector product each) and adds w[t, j] times its output; a sentinel id
    (== num_experts) adds nothing. Runs on a float64 copy of the module, unless it is one already."""
    ref = module if _is_float64_on_cpu(module) else copy.deepcopy(module).to(device="cpu", dtype=torch.float64)
    x, idx, w = hidden.detach().cpu().double(), index.cpu(), weights.detach().cpu().double()
    gated = getattr(ref, "has_gate", True)
    # each token's matrix-vector product: weights [E, in, out] when transposed, else [E, out, in]
    matvec = "ti,tio->to" if ref.is_transposed else "ti,toi->to"
    up_w, down_w = (ref.gate_up_proj if gated else ref.up_proj), ref.down_proj
    up_b = (ref.gate_up_proj_bias if gated else ref.up_proj_bias) if ref.has_bias else None
    down_b = ref.down_proj_bias if ref.has_bias else None
    norm = ref.post_expert_norm if getattr(ref, "has_post_expert_norm", False) else None  # older Transformers: none
    out = torch.zeros_like(x)
    for j in range(idx.shape[1]):
        tokens = (idx[:, j] < ref.num_experts).nonzero().squeeze(1)  # sentinel slots contribute nothing
        e = idx[tokens, j]
        up = torch.einsum(matvec, x[tokens], up_w[e])
        if up_b is not None:
            up = up + up_b[e]
        h = ref._apply_gate(up) if gated else ref.act_fn(up)
        down = torch.einsum(matvec, h, down_w[e])
        if down_b is not None:
            down = down + down_b[e]
        if norm is not None:
            down = norm(down)
        out.index_add_(0, tokens, w[tokens, j, None] * down)
    return out


def _is_float64_on_cpu(module: torch.nn.Module) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    return bool(tensors) and all(t.dtype == torch.float64 and t.device.type == "cpu" for t in tensors)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.detach().cpu().double()
    ref = ref.detach().cpu().double()  # a reference may be computed on the output's device
    assert torch.isfinite(out64).all(), "output holds NaN or inf"
    denom = ref.norm().item()
    return (out64 - ref).norm().item() / (denom if denom > 0 else 1.0)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


# --- the contract check ------------------------------------------------------------------------------------------

# The layout flags a backend declares in its Requirements (`custom_gate`: it runs GPT-OSS's clamped SwiGLU, through
# the module's own _apply_gate or as a gate of selector.gates). The check runs every combination of those it
# declares that makes a layer, so a bias lost only in the transposed path is caught.
LAYOUT_FLAGS = ("non_gated", "bias", "transposed", "interleaved", "custom_gate", "post_expert_norm", "expert_parallel")
# what module each activation name a backend may declare (Requirements.gating.activations) is built with
_ACTIVATION_MODULES = {
    "silu": torch.nn.SiLU,
    "gelu": torch.nn.GELU,
    "gelu_tanh": lambda: torch.nn.GELU(approximate="tanh"),
    "relu": torch.nn.ReLU,
}


def declared_flags(requirements: Requirements) -> tuple[str, ...]:
    """The flags of LAYOUT_FLAGS a backend's `Requirements` turn on, in that order."""
    custom = requirements.gating.custom or (requirements.interleaved and CLAMPED_SWIGLU in gates_run(requirements))
    on = {flag: custom if flag == "custom_gate" else bool(getattr(requirements, flag)) for flag in LAYOUT_FLAGS}
    return tuple(flag for flag in LAYOUT_FLAGS if on[flag])


def contract_layouts(requirements: Requirements) -> list[tuple[str, Layout]]:
    """(name, Layout) for every combination of the declared layout flags that makes a layer, smallest first:
    "plain", "bias", ..., "bias+transposed", ... A non-gated layer has no gate channels (no interleaved, no
    custom gate); the clamped SwiGLU reads interleaved channels, so a custom gate comes with them where the
    backend declares them; the gated layouts need `gating.gated`."""
    flags = declared_flags(requirements)
    gated_ok = requirements.gating.gated
    layouts: dict[Layout, str] = {}
    for size in range(len(flags) + 1):
        for chosen in itertools.combinations(flags, size):
            gated = "non_gated" not in chosen
            if (gated and not gated_ok) or (not gated and {"interleaved", "custom_gate"} & set(chosen)):
                continue
            layout = Layout(
                gated=gated,
                bias="bias" in chosen,
                transposed="transposed" in chosen,
                interleaved="interleaved" in chosen or ("custom_gate" in chosen and "interleaved" in flags),
                custom_gate="custom_gate" in chosen,
                post_norm="post_expert_norm" in chosen,
                expert_parallel="expert_parallel" in chosen,
            )
            # {custom_gate} and {interleaved, custom_gate} can make one layer: it keeps the shorter name
            layouts.setdefault(layout, "+".join(chosen) or "plain")
    return [(name, layout) for layout, name in layouts.items()]


def _activation_for(requirements: Requirements) -> torch.nn.Module:
    """SiLU, or the first activation the backend declares when it does not run SiLU."""
    declared = requirements.gating.activations
    if declared is None or "silu" in declared:
        return torch.nn.SiLU()
    name = next((n for n in _ACTIVATION_MODULES if n in declared), "silu")
    return _ACTIVATION_MODULES[name]()


@dataclass
class ContractReport:
    """What the contract check ran: per layout, "ok", "not declared", "cannot run here: ..." or the failure;
    `checked` names the layouts it ran. A report that checked none fails: it proves nothing."""

    backend: str
    device: str
    dtype: str
    results: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def describe(self) -> str:
        lines = [f"{self.backend} on {self.device} ({self.dtype}): {len(self.checked)} layouts checked"]
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
    """Run a backend (`BackendSpec`, or a registered name) on every combination of the layout flags it declares
    (`contract_layouts`: bias with transposed, interleaved with a custom gate, ...) that runs here, and compare it
    with the float64 reference; a layout whose output is wrong (or that raises, writes into its inputs, or returns
    the wrong shape or dtype) is a failure, and so is a check that ran no layout at all. Flags it does not declare
    are not run: the dispatch core never sends them (closed world). `device`: "cuda" when available, else "cpu"."""
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
    req = spec.requirements
    env = current_environment()
    act = _activation_for(req)
    forward = None
    refusals: list[str] = []
    for name, layout in contract_layouts(req):
        module = make_experts(num_experts, hidden, inter, layout, dtype=dtype, device=device, act=act, seed=seed)
        verdict = evaluate(spec, problem_from_module(module, top_k=top_k), env)
        if not verdict.ok:
            report.results[name] = f"cannot run here: {verdict.reason}"
            refusals.append(verdict.reason)
            continue
        if forward is None:
            forward = spec.load()
        ref = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)  # one float64 copy for every call
        problems = [
            _contract_failure(forward, module, ref, layout, t, num_experts, top_k, dtype, device, seed)
            for t in token_counts
        ]
        found = [f"T={t}: {p}" for t, p in zip(token_counts, problems) if p]
        report.results[name] = "; ".join(found) if found else "ok"
        report.checked.append(name)
        if found:
            flags = [f"{flag}=True" for flag in name.split("+") if flag != "plain"]
            what = f"declares {', '.join(flags)}" if flags else "runs the plain layout"
            report.failures.append(f"{spec.name} {what} but {found[0]}")
    declared = declared_flags(req)
    undeclared = (["plain"] if not req.gating.gated else []) + [f for f in LAYOUT_FLAGS if f not in declared]
    report.results.update(dict.fromkeys(undeclared, "not declared"))
    if not report.checked:
        why = "; ".join(dict.fromkeys(refusals)) or "it declares no layout (neither gated nor non-gated experts)"
        report.failures.append(
            f"{spec.name} checked no layout on {device} ({report.dtype}): {why}. A check that runs nothing proves "
            "nothing: pass the device and dtype it runs (check_backend_contract(spec, device=..., dtype=...)), or "
            "skip the test on a machine where it cannot run"
        )
    return report


def _contract_failure(
    forward: object,
    module: torch.nn.Module,
    reference: torch.nn.Module,
    layout: Layout,
    tokens: int,
    num_experts: int,
    top_k: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> str | None:
    """Why one call breaks the contract, or None."""
    gen = torch.Generator().manual_seed(seed + tokens)
    hidden = module.down_proj.shape[-1 if layout.transposed else -2]
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(dtype).to(device)
    index, weights = random_routing(tokens, num_experts, top_k, device, sentinel=layout.expert_parallel, generator=gen)
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
    ref = reference_experts(reference, x, index, weights)
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


# --- an outside plugin without installing it -------------------------------------------------------------------


def write_distribution(
    root: str | os.PathLike[str],
    name: str,
    entry_points: Mapping[str, str],
    files: Mapping[str, str] | None = None,
    version: str = "0.1",
) -> Path:
    """Lay out a distribution as pip installs one, under `root`: `files` (path relative to root -> text: the
    plugin's modules) and a `<name>-<version>.dist-info` folder with METADATA and an entry_points.txt that lists
    `entry_points` (entry-point name -> "module" or "module:object") in selector's group. With `root` on
    sys.path, importlib.metadata finds it as it finds an installed plugin, so the registry loads it the way it
    loads every plugin. Returns the dist-info folder."""
    root = Path(root)
    for relative, text in (files or {}).items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    info = root / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{ep} = {target}\n" for ep, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{lines}")
    return info


__all__ = [
    "LAYOUT_FLAGS",
    "ContractReport",
    "Layout",
    "TOLERANCE",
    "assert_backend_contract",
    "check_backend_contract",
    "clamped_swiglu",
    "contract_layouts",
    "declared_flags",
    "make_experts",
    "random_routing",
    "reference_experts",
    "relative_error",
    "write_distribution",
]
