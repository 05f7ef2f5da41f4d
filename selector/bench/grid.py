"""The grid runner of `selector bench`: for every shape, weight format and token count, one layer, then every
selector backend, `auto` as a user runs it and Transformers' own backends as peers, each timed in every mode.
Mode `train` times a training step of the layer (forward under autograd, then the backward), the differentiable
backends only.

It reaches the dispatch core only through its public API (`set_experts_implementation`, `last_backend`,
`backend_forward`, `rank`).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from selector.bench.cells import FORMATS, MODES, PEER_PREFIX, TRAIN, BenchResult, Cell, row_of
from selector.bench.layer import (
    bytes_moved,
    floor_seconds,
    flops_of,
    format_layer,
    grad_errors,
    make_layer,
    random_routing,
    temp_bytes_estimate,
    train_costs,
)
from selector.bench.layouts import is_plain, make_problem_layer, reference_of
from selector.bench.timing import measure_ceilings, time_interleaved

Forward = Callable[..., Any]  # Transformers' experts signature: fn(module, hidden_states, top_k_index, top_k_weights)


def peer_functions() -> dict[str, Forward]:
    """Transformers' built-in experts functions, when transformers is installed."""
    try:
        from transformers.integrations import moe
        from transformers.models.qwen2_moe import modeling_qwen2_moe
    except Exception:
        return {}
    eager = getattr(modeling_qwen2_moe.Qwen2MoeExperts.forward, "__wrapped__", None)
    peers = {"hf:batched_mm": moe.batched_mm_experts_forward, "hf:grouped_mm": moe.grouped_mm_experts_forward}
    if eager is not None:
        peers["hf:eager"] = eager
    return peers


@dataclass(frozen=True)
class BenchOptions:
    """How `run_bench` times the grid. The CLI builds one from its flags (`selector.bench.cli.bench_options`);
    the defaults are the CLI's."""

    dtype_name: str = "bfloat16"
    backends: Sequence[str] | None = None  # selector backends to time; default every registered one
    modes: Sequence[str] = ("eager", "graph")  # some of cells.MODES
    formats: Sequence[str] = ("dense",)  # weight formats timed side by side, some of cells.FORMATS
    graph_max_tokens: int = 4096
    memory_cap_gb: float = 40.0  # a backend needing more temporaries gets a skipped cell
    with_peers: bool = True  # Transformers' own backends timed beside
    device: str = "cuda"
    ceilings: Mapping[str, float] | None = None  # measured on the GPU when None; a CPU run must pass them
    rounds: int = 5
    sample_s: float = 0.02


def run_bench(
    presets: Sequence[str] | Mapping[str, Any],
    tokens: Sequence[int],
    options: BenchOptions = BenchOptions(),
    *,
    progress: Callable[[str], None] | None = None,
    skip: Collection[tuple[str, str, int]] = (),
    after_shape: Callable[[BenchResult], None] | None = None,
) -> BenchResult:
    """Time the grid, with the per-call value checks off (`SELECTOR_VALIDATE=shapes` unless set): the layer is
    timed, not them. `presets`: preset names, or shape names mapped to their `Problem`.

    Per (cell, mode) every backend, the peers and `auto` are timed together, `options.rounds` interleaved rounds
    of samples of about `options.sample_s` each (`time_interleaved`); each cell records the median and the spread.

    Mode `train`: one sample is one training step (`train_step`); a backend without a backward for the
    hidden states, the routing weights and the expert weights gets a skipped cell; the layer's weights require
    grad during that mode only.

    `options.device="cpu"` (with `options.ceilings` given) runs the same grid on the CPU to check the harness,
    e.g. the Triton kernels under the interpreter: one call per sample on the host clock, no graph mode; its
    times mean nothing.

    `skip`: (shape, format, tokens) not to measure (a resumed run's rows already measured; `measured_rows`).
    `after_shape`: called with the result so far after every shape, so that a run stopped by a job's time limit
    keeps what it finished (the CLI writes its files there).
    Raises ValueError for an unknown format or mode or a CPU run without ceilings, RuntimeError without a CUDA
    GPU."""
    unknown = [f for f in options.formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown format(s) {unknown}: expected some of {', '.join(FORMATS)}")
    unknown = [m for m in options.modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}: expected some of {', '.join(MODES)}")
    before = os.environ.get("SELECTOR_VALIDATE")
    os.environ["SELECTOR_VALIDATE"] = before or "shapes"
    try:
        grid = _Grid(options, progress)
        shapes = presets if isinstance(presets, Mapping) else {name: None for name in presets}
        for shape, problem in shapes.items():
            if grid.run_shape(shape, tokens, problem, skip) and after_shape is not None:
                fill_peer_ratios(grid.result.cells)
                after_shape(grid.result)
        fill_peer_ratios(grid.result.cells)
        return grid.result
    finally:
        if before is None:
            del os.environ["SELECTOR_VALIDATE"]


def records_from_bench(result: BenchResult) -> list[dict[str, Any]]:
    """Tuning records (`selector.tuning`) of a run's timed cells: selector backends on dense layers, eager and
    graph modes (tuning.MODES: not compile, not train), each under its backend's record fingerprint here."""
    from selector import tuning
    from selector.presets import PRESETS
    from selector.tuning_store import current_fingerprints

    fingerprints, out = current_fingerprints(), []
    for cell in result.cells:
        problem = PRESETS.get(cell.shape)
        if problem is None or cell.mode not in tuning.MODES or not cell.time_s or cell.format != "dense":
            continue
        fingerprint = fingerprints.of(cell.backend)
        if cell.backend.startswith((PEER_PREFIX, "auto")) or fingerprint is None:
            continue
        record = {
            "fingerprint": fingerprint, "gpu": result.device, "tokens": cell.tokens, "backend": cell.backend,
            "problem": tuning.problem_key(replace(problem, dtype=cell.dtype)), "mode": cell.mode,
            "time_s": cell.time_s, "tool": "selector bench",
        }
        if cell.spread is not None and cell.rounds:
            record.update(spread=cell.spread, rounds=cell.rounds)
        out.append(record)
    return out


def fill_peer_ratios(cells: list[Cell]) -> None:
    """vs_best_peer against Transformers' best of the same cell and weight format (peers run dense cells only)."""
    best: dict[tuple[str, int, str, str, str], float] = {}
    for c in cells:
        if c.backend.startswith(PEER_PREFIX) and c.time_s:
            best[row_of(c)] = min(best.get(row_of(c), math.inf), c.time_s)
    for c in cells:
        peer = best.get(row_of(c))
        if peer and c.time_s:
            c.vs_best_peer = peer / c.time_s


@dataclass
class _Inputs:
    """One cell's layer and inputs, its floor and its float64 reference on the first `sample` tokens."""

    shape: str
    fmt: str
    problem: Any
    layer: Any
    x: Any
    index: Any
    weights: Any
    floor_s: float
    flops: float
    moved: float
    sample: int
    ref: Any
    grad_out: Any = None  # train mode: the fixed upstream gradient of every step of the cell
    train_floor: tuple[float, float, float] = (0.0, 0.0, 0.0)  # train mode: (floor_s, flops, moved) of a step

    def costs(self, mode: str) -> tuple[float, float, float]:
        """(floor_s, flops, bytes moved) of one sample in `mode`: a forward, or a training step."""
        return self.train_floor if mode == TRAIN else (self.floor_s, self.flops, self.moved)

    def call(self, fn: Forward) -> Any:
        return fn(self.layer, self.x, self.index, self.weights)


@contextmanager
def trainable(layer: Any) -> Iterator[list[Any]]:
    """The layer's floating-point parameters requiring grad inside the block (the bench builds them frozen, for
    the inference modes); on leaving, their gradients dropped and each flag as it was."""
    params = [p for p in layer.parameters() if p.is_floating_point()]
    before = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        yield params
    finally:
        for p, flag in zip(params, before):
            p.grad = None
            p.requires_grad_(flag)


def train_step(
    fn: Forward, layer: Any, x: Any, index: Any, weights: Any, grad_out: Any, params: Sequence[Any]
) -> Callable[[], Any]:
    """One training step of the layer as a runner: gradients reset as `optimizer.zero_grad(set_to_none=True)`
    does (so that they do not accumulate from step to step), the forward under autograd with `x` and `weights`
    leaves requiring grad, then the backward of the fixed `grad_out`. The runner returns the forward's output."""

    def step() -> Any:
        x.grad = weights.grad = None
        for p in params:
            p.grad = None
        out = fn(layer, x, index, weights)
        out.backward(grad_out)
        return out

    return step


class _Grid:
    """The state of one run: options, the environment, the registry, the peers and the result so far."""

    def __init__(self, options: BenchOptions, progress: Callable[[str], None] | None) -> None:
        import torch

        from selector.environment import current_environment
        from selector.registry import get_registry

        device, ceilings = options.device, options.ceilings
        self.cuda = device == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError("selector bench needs a CUDA GPU (it times kernels against the GPU's floor)")
        if not self.cuda and ceilings is None:
            raise ValueError(f"selector bench on {device}: pass the ceilings (they are measured on a GPU only)")
        self.torch = torch
        self.device = torch.device(device)
        self.dtype_name, self.dtype = options.dtype_name, getattr(torch, options.dtype_name)
        self.backends, self.modes, self.formats = options.backends, tuple(options.modes), tuple(options.formats)
        self.graph_max_tokens, self.memory_cap_gb = options.graph_max_tokens, options.memory_cap_gb
        self.env = current_environment()
        self.registry = get_registry()
        self.peers = peer_functions() if options.with_peers else {}
        self.say = progress or (lambda _msg: None)
        self.rounds, self.sample_s = max(1, options.rounds), options.sample_s
        self.train_skips: dict[str, str] = {}  # per cell: why a backend gets no train cell
        if ceilings is None:
            ceilings = measure_ceilings(torch, self.device, fp8=any(FORMATS[f] for f in self.formats))
        self.result = BenchResult(
            device=torch.cuda.get_device_name() if self.cuda else device,
            ceilings=dict(ceilings),
            command="selector " + " ".join(sys.argv[1:]) if sys.argv and "selector" in sys.argv[0] else "",
            environment=self.env.to_dict(),
        )

    def failed(self, shape: str, fmt: str, token_counts: Sequence[int], what: str, exc: Exception) -> None:
        from selector.dispatch import AUTO

        reason = f"{what}: {type(exc).__name__}: {str(exc)[:160]}"
        self.result.cells.extend(
            Cell(shape, t, self.dtype_name, AUTO, mode, format=fmt, skipped=reason)
            for t in token_counts
            for mode in self.modes
        )

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def release(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()

    def run_shape(
        self, shape: str, tokens: Sequence[int], problem: Any = None, skip: Collection[tuple[str, str, int]] = ()
    ) -> bool:
        """Every format and token count of one shape (a preset's unless `problem` is given) but those in `skip`;
        one quantised copy alive at a time. False when there was nothing left to measure (no layer was built)."""
        from selector.presets import preset

        todo = {fmt: [t for t in tokens if (shape, fmt, t) not in skip] for fmt in self.formats}
        if not any(todo.values()):
            return False
        torch = self.torch
        base = replace(problem or preset(shape), dtype=self.dtype_name, device=self.device.type)
        # a plain layer as quantising expects; other layouts (GPT-OSS's) in their own layout, dense only
        dense = (
            make_layer(torch, base, self.dtype, self.device, seed=0)
            if is_plain(base)
            else make_problem_layer(torch, base, self.device, seed=0)
        )
        for fmt, fmt_tokens in todo.items():
            if not fmt_tokens:
                continue
            try:
                layer = format_layer(torch, dense, base, fmt)
            except Exception as exc:  # e.g. out of memory: the other formats still run
                self.failed(shape, fmt, fmt_tokens, "failed to quantise", exc)
                continue
            for t in fmt_tokens:
                try:
                    self.run_cells(self.inputs(shape, fmt, base, layer, t))
                except Exception as exc:  # the reference or auto's own call failed: record it, go on
                    self.failed(shape, fmt, [t], "failed", exc)
            del layer
            self.release()
        del dense
        self.release()
        return True

    def inputs(self, shape: str, fmt: str, base: Any, layer: Any, t: int) -> _Inputs:
        """The same routing and hidden states for every format of a token count."""
        torch = self.torch
        wf, sf = FORMATS[fmt] or ("dense", None)
        index, weights = random_routing(torch, t, base.num_experts, base.top_k, self.device, seed=t)
        gen = torch.Generator(device=self.device).manual_seed(1000 + t)
        x = torch.randn(t, base.hidden_size, device=self.device, dtype=self.dtype, generator=gen)
        problem = replace(base.with_tokens(t), weight_format=wf, scale_format=sf)
        moved = bytes_moved(layer, problem, int(index.unique().numel()), t, x.element_size())
        flops = flops_of(problem, t)
        sample = min(t, 32)
        ref = reference_of(torch, layer, base, x, index, weights, sample)
        floor = floor_seconds(self.result.ceilings, problem, moved, flops)
        grad_out, train_floor = None, (0.0, 0.0, 0.0)
        if TRAIN in self.modes:  # made once per cell: every backend's steps differentiate the same loss
            gen = torch.Generator(device=self.device).manual_seed(2000 + t)
            grad_out = torch.randn(t, base.hidden_size, device=self.device, dtype=self.dtype, generator=gen)
            step_moved, step_flops = train_costs(moved, flops, problem, t, x.element_size())
            step_floor = floor_seconds(self.result.ceilings, problem, step_moved, step_flops)
            train_floor = (step_floor, step_flops, step_moved)
        return _Inputs(
            shape, fmt, problem, layer, x, index, weights, floor, flops, moved, sample, ref, grad_out, train_floor
        )

    def candidates(self, cell: _Inputs) -> dict[str, Forward | None]:
        """Every backend to time for this cell (None: excluded, its reason already recorded), the peers, and
        "auto" as a user runs it: the module's own forward (dispatch, shape checks, the picked backend)."""
        import selector
        from selector.dispatch import AUTO, backend_runner

        found: dict[str, Forward | None] = {}
        ranking = selector.rank(cell.problem, self.env, self.registry)
        for name in self.backends or self.registry.names:
            verdict = ranking.excluded.get(name)
            found[name] = None if verdict else backend_runner(name)
            if verdict:
                self.result.cells.extend(self.new_cell(cell, name, mode, skipped=verdict.reason) for mode in self.modes)
        if cell.fmt == "dense":  # Transformers' backends run dense weights only
            found.update(self.peers)
        found[AUTO] = lambda module, hs, idx, w: module(hs, idx, w)
        return found

    def new_cell(self, cell: _Inputs, name: str, mode: str, **kw: Any) -> Cell:
        return Cell(cell.shape, cell.x.shape[0], self.dtype_name, name, mode, format=cell.fmt, **kw)

    def run_cells(self, cell: _Inputs) -> None:
        """Every backend's cells for one layer (one weight format) and one token count, appended to the result:
        per mode, every backend, the peers and `auto` timed together in interleaved rounds."""
        import selector
        from selector.dispatch import AUTO

        # what "auto" picks for this cell, through the model API itself (its eager pick; graph mode may differ)
        selector.set_experts_implementation(cell.layer, AUTO)
        cell.layer(cell.x, cell.index, cell.weights)
        t, elem = cell.x.shape[0], cell.x.element_size()
        timed: dict[str, Forward] = {}
        for name, fn in self.candidates(cell).items():
            if fn is None:
                continue
            if temp_bytes_estimate(name, t, cell.problem, elem) > self.memory_cap_gb * 2**30:
                self.result.cells.extend(
                    self.new_cell(cell, name, mode, skipped=f"needs more than {self.memory_cap_gb:g} GB of temporaries")
                    for mode in self.modes
                )
                continue
            timed[name] = fn
        self.train_skips = self.no_training(cell, timed) if TRAIN in self.modes else {}
        for mode in self.modes:
            self.say(f"{cell.shape} T={t} {cell.fmt} {mode}")
            if mode == TRAIN and cell.fmt == "dense":
                with trainable(cell.layer) as params:
                    self.run_mode(cell, mode, timed, params)
            else:
                self.run_mode(cell, mode, timed)
            self.release()

    def no_training(self, cell: _Inputs, names: Sequence[str]) -> dict[str, str]:
        """Why each of `names` gets no train cell: no backward for every GRAD_INPUTS name (asked of the ranking,
        with the cell's problem differentiating all of them, as the dispatch core asks; a backend that declares
        no `differentiable=` is not timed either), quantised weights, or the memory cap."""
        import selector
        from selector.dispatch import AUTO
        from selector.types import GRAD_INPUTS

        wanted = ", ".join(GRAD_INPUTS)
        if cell.fmt != "dense":
            return {n: f"no backward for {cell.fmt} expert weights: train mode runs dense weights" for n in names}
        ranking = selector.rank(replace(cell.problem, grad_inputs=GRAD_INPUTS), self.env, self.registry)
        skips: dict[str, str] = {}
        for name in names:
            if name == AUTO or name.startswith(PEER_PREFIX):  # auto picks a differentiable one; peers are torch
                continue
            verdict, spec = ranking.excluded.get(name), self.registry.specs.get(name)
            if verdict is not None:
                skips[name] = f"no backward for {wanted}: {verdict.reason}"
            elif spec is not None and spec.differentiable is None:
                skips[name] = f"no backward for {wanted} declared (the backend sets no differentiable=)"
        t, elem, cap = cell.x.shape[0], cell.x.element_size(), self.memory_cap_gb * 2**30
        for name in names:
            if name not in skips and temp_bytes_estimate(name, t, cell.problem, elem, train=True) > cap:
                skips[name] = (
                    f"a training step needs more than {self.memory_cap_gb:g} GB of temporaries, kept "
                    "activations and gradients"
                )
        return skips

    def mode_skip(self, name: str, mode: str, tokens: int) -> str | None:
        """Why `name` is not timed in `mode` at all, if it is not."""
        if mode == TRAIN:
            return self.train_skips.get(name)
        if mode == "graph" and tokens > self.graph_max_tokens:
            return f"graph mode only up to T={self.graph_max_tokens}"
        if mode == "graph" and name.endswith("eager"):
            return "reads expert ids on the host: cannot be captured"
        if mode == "graph" and not self.cuda:
            return "graph mode needs CUDA"
        return None

    def run_mode(self, cell: _Inputs, mode: str, fns: Mapping[str, Forward], params: Sequence[Any] = ()) -> None:
        """One mode of one cell: each backend's first call (memory, error against the reference), `auto`'s last
        so that every backend it may pick has run once, then all of them timed in interleaved rounds. `params`:
        in train mode, the layer's parameters that require grad."""
        from selector.dispatch import AUTO, last_backend

        rows: dict[str, Cell] = {}
        runners: dict[str, Callable[[], Any]] = {}
        for name, fn in sorted(fns.items(), key=lambda item: item[0] == AUTO):  # auto last
            out = self.new_cell(cell, name, mode, floor_s=cell.costs(mode)[0])
            self.result.cells.append(out)
            out.skipped = self.mode_skip(name, mode, out.tokens)
            if out.skipped is None:
                runner = self.first_step(out, cell, fn, params) if mode == TRAIN else self.first_call(out, cell, fn)
                if runner is not None:
                    runners[name], rows[name] = runner, out
        errors: dict[str, str] = {}
        if not runners:
            return
        timer_mode = "eager" if mode == TRAIN else mode  # a training step is called as it is, like an eager call
        timings = time_interleaved(
            self.torch,
            runners,
            timer_mode,
            rounds=self.rounds,
            sample_s=self.sample_s if self.cuda else 0.0,
            device=self.device.type,
            errors=errors,
        )
        self.sync()
        for p in params:  # the last step's gradients are not needed: free them before the next mode or cell
            p.grad = None
        pick = last_backend(cell.layer)  # auto's runner ran (or was captured) last in this mode
        for name, out in rows.items():
            out.auto_pick = name == pick
            if name == AUTO:
                out.picked = pick
            if name in errors:
                out.skipped = f"failed: {errors[name]}"
                continue
            timing = timings[name]
            out.time_s, out.spread, out.rounds = timing.median_s, timing.spread, timing.rounds
            _, flops, moved = cell.costs(mode)
            out.tflops = flops / out.time_s / 1e12
            out.gbps = moved / out.time_s / 1e9

    def first_call(self, out: Cell, cell: _Inputs, fn: Forward) -> Callable[[], Any] | None:
        """One backend's first call in one mode: peak extra memory and error against the reference; the runner
        to time, or None with the failure recorded in the cell (one failing backend must not lose the run)."""
        torch = self.torch
        try:
            runner: Callable[[], Any] = lambda: cell.call(fn)
            if out.mode == "compile":
                compiled = torch.compile(fn, dynamic=False)
                runner = lambda: cell.call(compiled)
            self.measure_first(out, cell, runner)
            return runner
        except Exception as exc:
            out.skipped = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            return None

    def first_step(self, out: Cell, cell: _Inputs, fn: Forward, params: Sequence[Any]) -> Callable[[], Any] | None:
        """One backend's first training step: peak extra memory (activations and gradients included), the
        forward's error against the reference, the gradients' errors (a step on the sample rows alone, against
        float64 from the definition); the runner to time, or None with the failure recorded in the cell."""
        try:
            x = cell.x.detach().requires_grad_(True)
            weights = cell.weights.detach().requires_grad_(True)
            runner = train_step(fn, cell.layer, x, cell.index, weights, cell.grad_out, params)
            self.measure_first(out, cell, runner)
            if cell.sample:
                self.check_grads(out, cell, fn, params)
            return runner
        except Exception as exc:
            out.skipped = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            return None

    def measure_first(self, out: Cell, cell: _Inputs, runner: Callable[[], Any]) -> None:
        """One call of `runner`: its peak extra device memory and its output's error on the sample rows against
        the float64 reference, into `out`."""
        torch = self.torch
        self.sync()
        base = torch.cuda.memory_allocated() if self.cuda else 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        result = runner().detach()
        self.sync()
        if self.cuda:
            out.extra_memory_bytes = torch.cuda.max_memory_allocated() - base
        if cell.sample:
            diff = (result[: cell.sample].double() - cell.ref).norm() / cell.ref.norm().clamp_min(1e-30)
            out.rel_error = float(diff)

    def check_grads(self, out: Cell, cell: _Inputs, fn: Forward, params: Sequence[Any]) -> None:
        """A training step on the first `cell.sample` rows alone, its gradients against float64 (for the `auto`
        row: the backend auto picks at that token count)."""
        n = cell.sample
        x = cell.x[:n].detach().clone().requires_grad_(True)
        weights = cell.weights[:n].detach().clone().requires_grad_(True)
        index, grad_out = cell.index[:n], cell.grad_out[:n]
        train_step(fn, cell.layer, x, index, weights, grad_out, params)()
        self.sync()
        grads = {name: p.grad for name, p in cell.layer.named_parameters() if p.is_floating_point()}
        grads.update(hidden_states=x.grad, routing_weights=weights.grad)
        errors = grad_errors(self.torch, cell.layer, cell.problem, x.detach(), index, weights.detach(), grad_out, grads)
        for p in params:
            p.grad = None
        out.grad_rel_errors = errors
        out.grad_rel_error = max(errors.values())
