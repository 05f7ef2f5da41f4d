"""`selector bench --compile MODES`: each backend's experts layer compiled against the same layer uncompiled.

Per preset, one layer per backend (the same weights), compiled once per torch.compile mode with dynamic shapes
(so the token counts share a graph), fullgraph where the backend declares it (auto always: one opaque op). Per
(preset, token count) every runner, uncompiled and compiled, is timed in interleaved rounds
(`time_interleaved`); the table shows the compiled / uncompiled ratio per mode, which should never exceed
about 1. CUDA-graph modes mark a new step before each call (`cudagraph_mark_step_begin`), so that alternating
between compiled layers replays their graphs instead of recording new paths.

`stack` N > 1 times N layers of the preset's shape, each with its own weights, in one module whose forward runs
`x = x + layer_i(x, index, weights)` for each, as a model's decoder stack runs its experts layers; the stack is
compiled as one, against the same stack uncompiled, and every time is per layer (a call's time / N). A single
compiled layer pays torch.compile's fixed entry cost (guards, the runtime wrappers) on every call; a model pays
it once per forward for all its layers, which the stack shows. The weights of the N layers are shared by the
backends: memory is N layers' weights per preset.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from selector.bench.timing import time_interleaved

COMPILE_PRESETS = ("qwen3-30b-a3b", "qwen1.5-moe-a2.7b")
COMPILE_TOKENS = (1, 8, 64, 512, 4096)
COMPILE_BACKENDS = ("auto", "triton_fused", "grouped_mm")
UNCOMPILED = "uncompiled"
SCHEMA = "selector.bench.compiled/1"


@dataclass
class CompiledRow:
    """One (preset, tokens, backend): seconds per call uncompiled and per compiled mode, what auto ran."""

    preset: str
    tokens: int
    backend: str
    times_s: dict[str, float] = field(default_factory=dict)  # mode (or "uncompiled") -> median seconds
    spread: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    ran: dict[str, str | None] = field(default_factory=dict)  # mode -> the backend that ran the last call

    def ratio(self, mode: str) -> float | None:
        """compiled / uncompiled time in `mode` (< 1: compiling helped)."""
        base, t = self.times_s.get(UNCOMPILED), self.times_s.get(mode)
        return t / base if base and t else None


@dataclass
class CompiledBench:
    device: str
    modes: list[str]
    rows: list[CompiledRow] = field(default_factory=list)
    compile_s: dict[str, float] = field(default_factory=dict)  # "preset/backend/mode" -> seconds of first calls
    skipped: dict[str, str] = field(default_factory=dict)  # "preset/backend" -> why
    stack: int = 1  # layers per timed call; every time in `rows` is per layer (a call's time / stack)
    train: bool = False  # one timed call is a training step (forward under autograd, then the backward)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "device": self.device,
            "modes": self.modes,
            "stack": self.stack,
            "times_per": "layer",
            "call": "train step" if self.train else "forward",
            "rows": [asdict(r) for r in self.rows],
            "compile_s": self.compile_s,
            "skipped": self.skipped,
        }


def _runs_here(name: str, layer: Any) -> str | None:
    """None if backend `name` runs this layer here, else why not."""
    from selector.dispatch import get_backend_registry, problem_of
    from selector.environment import current_environment
    from selector.requirements import evaluate

    if name == "auto":
        return None
    verdict = evaluate(get_backend_registry().get(name), problem_of(layer, 8), current_environment())
    return None if verdict.ok else verdict.reason


def experts_stack(torch: Any, layers: Sequence[Any]) -> Any:
    """One module that runs `layers` as a decoder stack runs its experts layers: x = x + layer(x, index, weights),
    one layer after another (the same routing for all: the experts are timed, not the router)."""

    class ExpertsStack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(layers)

        def forward(self, x: Any, index: Any, weights: Any) -> Any:
            for layer in self.layers:
                x = x + layer(x, index, weights)
            return x

    return ExpertsStack()


def _compiled(torch: Any, layer: Any, name: str, mode: str, compiler: str) -> Callable[..., Any]:
    from selector.dispatch import get_backend_registry
    from selector.types import GRAPH_MODES

    fullgraph = name == "auto" or get_backend_registry().get(name).traces_fullgraph()
    fn = torch.compile(layer, backend=compiler, mode=mode, fullgraph=fullgraph, dynamic=True)
    if mode not in GRAPH_MODES or compiler != "inductor":
        return fn
    mark = torch.compiler.cudagraph_mark_step_begin

    def step(*args: Any) -> Any:
        mark()
        return fn(*args)

    return step


def run_compiled_bench(
    presets: Sequence[str] | Mapping[str, Any] = COMPILE_PRESETS,
    tokens: Sequence[int] = COMPILE_TOKENS,
    modes: Sequence[str] = ("default", "reduce-overhead"),
    backends: Sequence[str] = COMPILE_BACKENDS,
    dtype_name: str = "bfloat16",
    rounds: int = 5,
    sample_s: float = 0.02,
    progress: Callable[[str], None] | None = None,
    device: str = "cuda",
    compiler: str = "inductor",
    stack: int = 1,
    train: bool = False,
) -> CompiledBench:
    """Time every backend uncompiled and compiled in each mode (see the module docstring). `presets`: preset
    names, or names mapped to their `Problem`. `stack`: layers per timed module (1: the layer itself), times
    per layer. `train`: one timed call is a training step, as `selector bench --modes train` times it (hidden
    states, routing weights and expert weights require grad; the backward of a fixed gradient; gradients set
    to None before each step), compiled with autograd. `device="cpu"` (with another `compiler`, e.g.
    "aot_eager") runs the harness on the CPU for a check, on the host clock, one call per sample: its times
    mean nothing."""
    import torch

    from selector.presets import preset

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("selector bench --compile needs a CUDA GPU")
    if stack < 1:
        raise ValueError(f"stack must be at least 1 layer, got {stack}")
    before = os.environ.get("SELECTOR_VALIDATE")
    os.environ["SELECTOR_VALIDATE"] = before or "shapes"  # the layer is timed, not the per-call checks
    dtype = getattr(torch, dtype_name)
    result = CompiledBench(
        device=torch.cuda.get_device_name() if device == "cuda" else device, modes=list(modes), stack=stack, train=train
    )
    shapes = presets if isinstance(presets, Mapping) else {name: None for name in presets}
    say = progress or (lambda msg: None)
    # every layer here is one module class: its forward is one code object, compiled once per layer and mode, which
    # would pass dynamo's per-code-object limit (8) after a few backends x modes; a model holds one compiled
    # forward per model, so the limit is the harness's, not the user's
    limits = {
        name: getattr(torch._dynamo.config, name)
        for name in ("recompile_limit", "accumulated_recompile_limit")
        if hasattr(torch._dynamo.config, name)
    }
    for name in limits:
        setattr(torch._dynamo.config, name, max(limits[name], 4096))
    setup = _Setup(torch, dtype, device, compiler, tuple(tokens), tuple(backends), rounds, sample_s, say)
    try:
        for shape, given in shapes.items():
            problem = preset(shape) if given is None else given
            _bench_preset(setup, result, shape, problem)
            # the next preset's N layers of weights should not meet these (freed with the call's locals), nor
            # should its layers find these layers' compiled code
            torch._dynamo.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        if before is None:
            os.environ.pop("SELECTOR_VALIDATE", None)
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, value)
    return result


@dataclass(frozen=True)
class _Setup:
    """What every preset of one run is timed with: torch, dtype, device and compiler, the token counts, the
    backends, the interleaved rounds, and where progress goes."""

    torch: Any
    dtype: Any
    device: str
    compiler: str
    tokens: tuple[int, ...]
    backends: tuple[str, ...]
    rounds: int
    sample_s: float
    say: Callable[[str], None]


def _bench_preset(setup: _Setup, result: CompiledBench, shape: str, problem: Any) -> None:
    """One preset's rows into `result`: every backend's layer (or stack), uncompiled and per mode, per T."""
    from selector.bench.layer import make_layer, random_routing
    from selector.dispatch import last_backend, set_requested_implementation

    torch, dtype, device, compiler = setup.torch, setup.dtype, setup.device, setup.compiler
    tokens, backends, say = setup.tokens, setup.backends, setup.say
    stack, modes = result.stack, result.modes
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # the N layers' weights, one set per layer (seeded by position), shared by every backend's stack
    weights = []
    for i in range(stack):
        base = make_layer(torch, problem, dtype, device, seed=i)
        weights.append((base.gate_up_proj.data, base.down_proj.data))
    runs: dict[str, Any] = {}  # backend -> what one timed call runs: the layer, or a stack of them
    firsts: dict[str, Any] = {}  # backend -> its first layer (what it ran is read off that one)
    for name in backends:
        members = [make_layer(torch, problem, dtype, device, seed=i, weights=w) for i, w in enumerate(weights)]
        for member in members:
            set_requested_implementation(member, name)
            member.requires_grad_(result.train)
        why = _runs_here(name, members[0])
        if why is not None:
            result.skipped[f"{shape}/{name}"] = why
            continue
        runs[name] = members[0] if stack == 1 else experts_stack(torch, members)
        firsts[name] = members[0]
    compiled: dict[tuple[str, str], Callable[..., Any]] = {}
    for name, run in runs.items():
        with torch.set_grad_enabled(result.train):  # every layer seen eagerly before tracing
            run(*_inputs(torch, problem, 3, dtype, random_routing, device))
        for mode in modes:
            compiled[(name, mode)] = _compiled(torch, run, name, mode, compiler)
    for t in tokens:
        say(f"{shape} T={t}")
        inputs = _inputs(torch, problem, t, dtype, random_routing, device)
        if result.train:
            inputs = (inputs[0].requires_grad_(True), inputs[1], inputs[2].requires_grad_(True))

        def bind(fn: Callable[..., Any], module: Any, inputs: tuple[Any, ...] = inputs) -> Callable[[], Any]:
            """fn (`module`, or it compiled) on this T's inputs: a training step, or a forward without grad."""
            return _bound_step(torch, fn, inputs, module) if result.train else _bound(torch, fn, inputs)

        runners: dict[str, Callable[[], Any]] = {}
        errors: dict[str, str] = {}
        for name, run in runs.items():
            runners[f"{name}|{UNCOMPILED}"] = bind(run, run)
            for mode in modes:
                key, fn = f"{name}|{mode}", compiled[(name, mode)]
                start = time.perf_counter()
                try:  # the first calls at this T trace, compile, record: outside the timing
                    first = bind(fn, run)
                    for _ in range(3):
                        first()
                    sync()
                except Exception as exc:  # noqa: BLE001 - reported per runner, the others still run
                    errors[key] = _short(exc)
                    continue
                elapsed = time.perf_counter() - start
                spent = f"{shape}/{name}/{mode}"
                result.compile_s[spent] = result.compile_s.get(spent, 0.0) + elapsed
                runners[key] = bind(fn, run)
        timings = time_interleaved(
            torch, runners, "compile", rounds=setup.rounds, sample_s=setup.sample_s, device=device, errors=errors
        )
        for name in runs:
            row = CompiledRow(shape, t, name)
            for mode in (UNCOMPILED, *modes):
                key = f"{name}|{mode}"
                if key in timings:
                    row.times_s[mode] = timings[key].median_s / stack
                    row.spread[mode] = timings[key].spread
                elif key in errors:
                    row.errors[mode] = errors[key]
                if mode != UNCOMPILED and key in runners and key not in errors:
                    runners[key]()
                    row.ran[mode] = last_backend(firsts[name])
            runners[f"{name}|{UNCOMPILED}"]()
            row.ran[UNCOMPILED] = last_backend(firsts[name])
            result.rows.append(row)


def _inputs(
    torch: Any, problem: Any, tokens: int, dtype: Any, routing: Callable[..., Any], device: str
) -> tuple[Any, ...]:
    index, weights = routing(torch, tokens, problem.num_experts, problem.top_k, device, seed=tokens)
    hidden = torch.randn(tokens, problem.hidden_size, device=device, dtype=dtype)
    return hidden, index, weights


def _bound(torch: Any, fn: Callable[..., Any], inputs: tuple[Any, ...]) -> Callable[[], Any]:
    def call() -> Any:
        with torch.no_grad():
            return fn(*inputs)

    return call


def _bound_step(torch: Any, fn: Callable[..., Any], inputs: tuple[Any, ...], module: Any) -> Callable[[], Any]:
    """One training step of fn (`module`, or it compiled) on `inputs`, as the grid's train mode runs one
    (`selector.bench.grid.train_step`: gradients set to None, forward, backward of a fixed upstream gradient)."""
    from selector.bench.grid import train_step

    x, index, weights = inputs
    params = [p for p in module.parameters() if p.requires_grad]
    upstream = torch.linspace(-1.0, 1.0, x.numel(), device=x.device, dtype=x.dtype).view_as(x)
    return train_step(lambda _layer, h, i, w: fn(h, i, w), module, x, index, weights, upstream, params)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.0f}"


def compiled_table(result: CompiledBench) -> str:
    """Markdown: per (preset, tokens, backend) µs uncompiled and per mode, each with its spread over the rounds
    ((max - min) / median), and compiled / uncompiled; a caption line says how many layers one timed call ran
    (times are per layer)."""
    unit = "µs" if result.stack == 1 else "µs/layer"
    head = ["preset", "T", "backend", f"uncompiled {unit}"]
    for mode in result.modes:
        head += [f"{mode} {unit}", f"{mode} ÷ uncompiled"]
    caption = "One experts layer per call."
    if result.stack != 1:
        caption = (
            f"A stack of {result.stack} experts layers per call (x = x + layer_i(x, ...), compiled as one); "
            f"times per layer: a call's time / {result.stack}."
        )
    if result.train:
        caption += " Each call is a training step: the forward under autograd, then the backward."
    lines = [caption, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result.rows:
        if not row.times_s and row.errors:  # nothing ran: the reasons instead
            reasons = "; ".join(f"{m}: {e}" for m, e in row.errors.items())
            lines.append(f"| {row.preset} | {row.tokens} | {row.backend} | {reasons} |")
            continue
        cells = [row.preset, str(row.tokens), _label(row), _timed(row, UNCOMPILED)]
        for mode in result.modes:
            ratio = row.ratio(mode)
            cells += [
                _timed(row, mode) if mode not in row.errors else "error",
                "-" if ratio is None else f"{ratio:.2f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _timed(row: CompiledRow, mode: str) -> str:
    """The median µs, with the spread of its rounds where there were several."""
    spread = row.spread.get(mode)
    text = _us(row.times_s.get(mode))
    return text if not spread or text == "-" else f"{text} (±{spread * 100:.0f}%)"


def _label(row: CompiledRow) -> str:
    """auto names what it ran, per run where that differs (auto under compile chooses at run time too)."""
    if row.backend != "auto":
        return row.backend
    picks = {run: name for run, name in row.ran.items() if name}
    if len(set(picks.values())) <= 1:
        return f"auto ({next(iter(picks.values()), '?')})"
    return "auto (" + ", ".join(f"{run}: {name}" for run, name in picks.items()) + ")"
