"""`selector bench --compile MODES`: each backend's experts layer compiled against the same layer uncompiled.

Per preset, one layer per backend (the same weights), compiled once per torch.compile mode with dynamic shapes
(so the token counts share a graph), fullgraph where the backend declares it (auto always: one opaque op). Per
(preset, token count) every runner, uncompiled and compiled, is timed in interleaved rounds
(`time_interleaved`); the table shows the compiled / uncompiled ratio per mode, which should never exceed
about 1. CUDA-graph modes mark a new step before each call (`cudagraph_mark_step_begin`), so that alternating
between compiled layers replays their graphs instead of recording new paths.
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

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "device": self.device, "modes": self.modes, "rows": [asdict(r) for r in self.rows],
                "compile_s": self.compile_s, "skipped": self.skipped}  # fmt: skip


def _runs_here(name: str, layer: Any) -> str | None:
    """None if backend `name` runs this layer here, else why not."""
    from selector.dispatch import get_backend_registry, problem_of
    from selector.environment import current_environment
    from selector.requirements import evaluate

    if name == "auto":
        return None
    verdict = evaluate(get_backend_registry().get(name), problem_of(layer, 8), current_environment())
    return None if verdict.ok else verdict.reason


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
) -> CompiledBench:
    """Time every backend uncompiled and compiled in each mode (see the module docstring). `presets`: preset
    names, or names mapped to their `Problem`. `device="cpu"` (with another `compiler`, e.g. "aot_eager") runs
    the harness on the CPU for a check, on the host clock, one call per sample: its times mean nothing."""
    import torch

    from selector.bench.layer import make_layer, random_routing
    from selector.dispatch import last_backend, set_requested_implementation
    from selector.presets import preset

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("selector bench --compile needs a CUDA GPU")
    before = os.environ.get("SELECTOR_VALIDATE")
    os.environ["SELECTOR_VALIDATE"] = before or "shapes"  # the layer is timed, not the per-call checks
    dtype = getattr(torch, dtype_name)
    result = CompiledBench(device=torch.cuda.get_device_name() if device == "cuda" else device, modes=list(modes))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    shapes = presets if isinstance(presets, Mapping) else {name: None for name in presets}
    say = progress or (lambda msg: None)
    # every layer here is one module class: its forward is one code object, compiled once per layer and mode, which
    # would pass dynamo's per-code-object limit (8) after a few backends x modes; a model holds one compiled
    # forward per model, so the limit is the harness's, not the user's
    limits = {name: getattr(torch._dynamo.config, name) for name in ("recompile_limit", "accumulated_recompile_limit")
              if hasattr(torch._dynamo.config, name)}  # fmt: skip
    for name in limits:
        setattr(torch._dynamo.config, name, max(limits[name], 4096))
    try:
        for shape, given in shapes.items():
            problem = preset(shape) if given is None else given
            base = make_layer(torch, problem, dtype, device, seed=0)
            weights = (base.gate_up_proj.data, base.down_proj.data)
            layers: dict[str, Any] = {}
            for name in backends:
                layer = make_layer(torch, problem, dtype, device, seed=0, weights=weights)
                set_requested_implementation(layer, name)
                why = _runs_here(name, layer)
                if why is not None:
                    result.skipped[f"{shape}/{name}"] = why
                    continue
                layers[name] = layer
            compiled: dict[tuple[str, str], Callable[..., Any]] = {}
            for name, layer in layers.items():
                with torch.no_grad():
                    layer(*_inputs(torch, problem, 3, dtype, random_routing, device))  # seen eagerly before tracing
                for mode in modes:
                    compiled[(name, mode)] = _compiled(torch, layer, name, mode, compiler)
            for t in tokens:
                say(f"{shape} T={t}")
                inputs = _inputs(torch, problem, t, dtype, random_routing, device)
                runners: dict[str, Callable[[], Any]] = {}
                errors: dict[str, str] = {}
                for name, layer in layers.items():
                    runners[f"{name}|{UNCOMPILED}"] = _bound(torch, layer, inputs)
                    for mode in modes:
                        key, fn = f"{name}|{mode}", compiled[(name, mode)]
                        start = time.perf_counter()
                        try:  # the first calls at this T trace, compile, record: outside the timing
                            with torch.no_grad():
                                for _ in range(3):
                                    fn(*inputs)
                            sync()
                        except Exception as exc:  # noqa: BLE001 - reported per runner, the others still run
                            errors[key] = _short(exc)
                            continue
                        elapsed = time.perf_counter() - start
                        result.compile_s[f"{shape}/{name}/{mode}"] = result.compile_s.get(
                            f"{shape}/{name}/{mode}", 0.0) + elapsed  # fmt: skip
                        runners[key] = _bound(torch, fn, inputs)
                timings = time_interleaved(torch, runners, "compile", rounds=rounds, sample_s=sample_s, device=device,
                                           errors=errors)  # fmt: skip
                for name, layer in layers.items():
                    row = CompiledRow(shape, t, name)
                    for run in (UNCOMPILED, *modes):
                        key = f"{name}|{run}"
                        if key in timings:
                            row.times_s[run] = timings[key].median_s
                            row.spread[run] = timings[key].spread
                        elif key in errors:
                            row.errors[run] = errors[key]
                        if run != UNCOMPILED and key in runners and key not in errors:
                            with torch.no_grad():
                                runners[key]()
                            row.ran[run] = last_backend(layer)
                    with torch.no_grad():
                        runners[f"{name}|{UNCOMPILED}"]()
                    row.ran[UNCOMPILED] = last_backend(layer)
                    result.rows.append(row)
    finally:
        if before is None:
            os.environ.pop("SELECTOR_VALIDATE", None)
        for name, value in limits.items():
            setattr(torch._dynamo.config, name, value)
    return result


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


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.0f}"


def compiled_table(result: CompiledBench) -> str:
    """Markdown: per (preset, tokens, backend) µs uncompiled and per mode, with compiled / uncompiled."""
    head = ["preset", "T", "backend", "uncompiled µs"]
    for mode in result.modes:
        head += [f"{mode} µs", f"{mode} ÷ uncompiled"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result.rows:
        if not row.times_s and row.errors:  # nothing ran: the reasons instead
            lines.append(f"| {row.preset} | {row.tokens} | {row.backend} | " + "; ".join(
                f"{m}: {e}" for m, e in row.errors.items()) + " |")  # fmt: skip
            continue
        cells = [row.preset, str(row.tokens), _label(row), _us(row.times_s.get(UNCOMPILED))]
        for mode in result.modes:
            ratio = row.ratio(mode)
            cells += [_us(row.times_s.get(mode)) if mode not in row.errors else "error",
                      "-" if ratio is None else f"{ratio:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _label(row: CompiledRow) -> str:
    """auto names what it ran, per run where that differs (auto under compile chooses at run time too)."""
    if row.backend != "auto":
        return row.backend
    picks = {run: name for run, name in row.ran.items() if name}
    if len(set(picks.values())) <= 1:
        return f"auto ({next(iter(picks.values()), '?')})"
    return "auto (" + ", ".join(f"{run}: {name}" for run, name in picks.items()) + ")"
