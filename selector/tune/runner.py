"""The run of `selector tune`: for each layer, the backends that can run it here tune their kernels within a
budget, then every (token count, mode) cell is timed across those backends in interleaved rounds, the records
are saved to the tuning store, and the plan is built from what is measured.

It reaches the dispatch core only through its public API (`backend_forward`, `rank`). `device="cpu"` runs the
same on the CPU backends with the host clock (no graph mode), so the whole run is testable without a GPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from selector.tune.inputs import TuneInputError, TuneTarget, token_counts
from selector.bench.layouts import is_plain
from selector.tune.plan import ModePlan, Timed, build_plan
from selector.tune.store import TuneStore
from selector.tuning import Fingerprints
from selector.types import Problem

SCHEMA = "selector.tune/1"
TOOL = "selector tune"
SAMPLE_ROWS = 32  # tokens checked against the float64 reference
TOLERANCE = 5e-2  # relative error above which a backend's result is wrong (bf16 results read ~5e-3)

Progress = Callable[[str, int, int], None]  # (what, cells done, cells in all)


class TuneUnavailable(RuntimeError):
    """Measuring cannot start here (no CUDA GPU, the GPU's lock held elsewhere): one line naming the fix."""


@dataclass
class TuneCell:
    """One (layer, token count, mode) to time, the backends that can run it here, and what the static ranking
    picks for it."""

    target: str
    problem: Problem  # with the token count and the mode (cuda_graph)
    tokens: int
    mode: str
    backends: list[str]
    static: str | None
    measured: bool = False  # every backend already has a record under this fingerprint
    left_out: dict[str, str] = field(default_factory=dict)  # runnable here, but not timed: why

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "tokens": self.tokens,
            "mode": self.mode,
            "backends": self.backends,
            "static": self.static,
            "already_measured": self.measured,
            "left_out": self.left_out,
        }


@dataclass
class TuneResult:
    device: str
    gpu: str
    fingerprint: Fingerprints  # each backend's record fingerprint here
    targets: list[TuneTarget]
    cells: list[TuneCell]
    dry_run: bool = False
    force: bool = False
    timings: dict[tuple[str, str], dict[int, dict[str, Timed]]] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)  # a backend dropped from a cell, and why
    kernel_tuning: list[dict[str, Any]] = field(default_factory=list)
    first_calls: dict[str, dict[str, float]] = field(default_factory=dict)  # target -> backend -> seconds
    records: list[dict[str, Any]] = field(default_factory=list)
    stored: int = 0
    durations: dict[str, float] = field(default_factory=dict)  # target -> seconds
    total_s: float = 0.0
    plans: list[ModePlan] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "device": self.device,
            "gpu": self.gpu,
            "fingerprints": self.fingerprint.to_dict(),
            "dry_run": self.dry_run,
            "targets": [{"name": t.name, "problem": asdict(t.problem), "notes": list(t.notes)} for t in self.targets],
            "cells": [c.to_dict() for c in self.cells],
            "kernel_tuning": self.kernel_tuning,
            "first_call_s": self.first_calls,
            "errors": self.errors,
            "records_stored": self.stored,
            "seconds": {"total": self.total_s, "per_target": self.durations},
            "plans": [p.to_dict() for p in self.plans],
            "timings": self.timing_rows(),
        }

    def timing_rows(self) -> list[dict[str, Any]]:
        """One row per timed (target, mode, token count, backend), fastest backend first within a token count."""
        rows = []
        for (target, mode), by_t in self.timings.items():
            for t, by_b in sorted(by_t.items()):
                for b, m in sorted(by_b.items(), key=lambda item: item[1].time_s):
                    cell = {"target": target, "mode": mode, "tokens": t, "backend": b}
                    rows.append({**cell, "time_s": m.time_s, "spread": m.spread})
        return rows


def cell_problem(problem: Problem, tokens: int, mode: str) -> Problem:
    return replace(problem.with_tokens(tokens), cuda_graph=mode == "graph")


def plan_cells(
    targets: Sequence[TuneTarget],
    tokens: Sequence[int],
    modes: Sequence[str],
    graph_max_tokens: int,
    backends: Sequence[str] | None,
    env: Any,
    registry: Any,
    store: TuneStore,
    fingerprint: Fingerprints,
    gpu: str,
    config: Any = None,
    memory_cap_gb: float = 40.0,
) -> list[TuneCell]:
    """Every cell to time: graph mode only up to `graph_max_tokens`; per cell the backends whose verdict here is
    ok (restricted to `backends`), and the static pick (the ranking without measurements). A cell is already
    measured when every one of its backends has a record under `fingerprint` on `gpu` (a backend dropped from a
    cell last time, e.g. for a wrong result, has none: its cell is measured again)."""
    from selector.ranking import rank
    from selector.tuning import problem_key

    from selector.bench.layer import temp_bytes_estimate

    cells = []
    for target in targets:
        elem = 4 if target.problem.dtype == "float32" else 2
        key = problem_key(target.problem)
        for t in tokens:
            for mode in modes:
                if mode == "graph" and t > graph_max_tokens:
                    continue
                problem = cell_problem(target.problem, t, mode)
                ranking = rank(problem, env, registry, config)
                names = backends if backends is not None else registry.names
                runnable, left_out = [], {}
                for n in names:
                    if n not in ranking.verdicts or not ranking.verdicts[n].ok:
                        continue
                    if temp_bytes_estimate(n, t, problem, elem) > memory_cap_gb * 2**30:
                        left_out[n] = f"needs more than {memory_cap_gb:g} GB of temporaries (--memory-cap-gb)"
                    else:
                        runnable.append(n)
                measured = bool(runnable) and store.is_measured(fingerprint, gpu, key, mode, t, runnable)
                cells.append(TuneCell(target.name, problem, t, mode, runnable, ranking.best, measured, left_out))
    return cells


@dataclass(frozen=True)
class TuneOptions:
    """How `run_tune` measures: the cells (token counts, modes, backends) and the budgets. The CLI builds one
    from its flags (`selector.tune.cli.tune_options`); the defaults are the CLI's."""

    tokens: Sequence[int] | None = None  # default: every power of two 1..16384
    batch_sizes: Sequence[int] = ()  # the model's own batch sizes, added to the token counts
    modes: Sequence[str] = ("eager", "graph")
    graph_max_tokens: int = 512
    backends: Sequence[str] | None = None  # default: every registered backend that can run a cell
    kernel_budget_s: float = 60.0  # per layer, for the backends' kernel tuning hooks
    memory_cap_gb: float = 40.0  # a backend needing more temporaries is left out of a cell
    force: bool = False  # measure cells already measured under this fingerprint
    dry_run: bool = False  # list the cells, measure nothing
    rounds: int = 5
    sample_s: float = 0.02
    device: str = "cuda"
    lock_timeout_s: float = 600.0  # how long to wait for another process measuring on the GPU


def run_tune(
    targets: Sequence[TuneTarget],
    options: TuneOptions = TuneOptions(),
    *,
    store: TuneStore | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> TuneResult:
    """Tune `targets` (their problems on `options.device`) at the token counts (default every power of two
    1..16384, plus `options.batch_sizes`) in `options.modes`; cells already measured under this fingerprint are
    skipped unless `options.force`. `options.dry_run` lists the cells and measures nothing. Raises
    TuneInputError (an unknown backend, a bad mode), TuneUnavailable (no CUDA, the GPU's lock held elsewhere)."""
    from selector.config import load_config
    from selector.environment import current_environment
    from selector.registry import get_registry

    started = time.perf_counter()
    store = store or TuneStore()
    say = log or (lambda _msg: None)
    counts = token_counts(options.tokens, options.batch_sizes)
    modes = options.modes
    bad_modes = [m for m in modes if m not in ("eager", "graph")]
    if bad_modes or not modes:
        raise TuneInputError(f"--modes {','.join(bad_modes) or 'nothing'}: expected eager and/or graph")
    registry = get_registry()
    unknown = [b for b in options.backends or () if b not in registry.specs]
    if unknown:
        registered = ", ".join(registry.names)
        raise TuneInputError(f"--backends {', '.join(unknown)}: no such backend; registered: {registered}")
    device = options.device
    torch = None if options.dry_run else _torch_for(device)
    if device != "cuda":
        modes = [m for m in modes if m != "graph"]  # captured graphs need CUDA
    env = current_environment()
    try:
        config = load_config()
    except Exception:  # a broken config is doctor's to report; the static pick then ignores it
        config = None
    gpu = _gpu_name(env, torch, device)
    fingerprint = store.fingerprint()
    targets = _unique_names([replace(t, problem=replace(t.problem, device=device)) for t in targets])
    for t in targets:
        if t.problem.weight_format != "dense" and not is_plain(t.problem):
            raise TuneInputError(
                f"{t.name}: quantised weights ({t.problem.weight_format}) are built in the plain layout only, and "
                "this layer has another: pass --format dense"
            )
    cells = plan_cells(
        targets,
        counts,
        modes,
        options.graph_max_tokens,
        options.backends,
        env,
        registry,
        store,
        fingerprint,
        gpu,
        config=config,
        memory_cap_gb=options.memory_cap_gb,
    )
    result = TuneResult(device, gpu, fingerprint, list(targets), cells, dry_run=options.dry_run, force=options.force)
    if torch is not None:  # not a dry run
        run = _Run(torch, result, registry, store, options, progress, say)
        lock = lock_name(env, device)
        with store.measurement_lock(lock, options.lock_timeout_s) as got:
            if not got:
                raise TuneUnavailable(
                    f"another process is measuring on {gpu} (lock {lock!r} beside the tuning store {store.path}), "
                    "or the lock cannot be taken there: wait for it to finish, raise --lock-timeout, or set "
                    "SELECTOR_TUNING_STORE to a folder you may write"
                )
            for target in targets:
                run.target(target, counts, options.kernel_budget_s, options.force)
    result.plans = plans_of(result, store)
    result.total_s = time.perf_counter() - started
    return result


def _torch_for(device: str) -> Any:
    """torch, to measure on `device`; TuneUnavailable for CUDA when no GPU is visible."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        raise TuneUnavailable(
            f"needs a CUDA GPU and none is visible (torch {torch.__version__}, {build}); run it on the GPU node "
            "(--dry-run lists the cells anywhere), `selector doctor` says what this machine lacks"
        )
    return torch


def lock_name(env: Any, device: str) -> str:
    """The measurement lock of the GPU this process times on: by UUID (or NVML index) where the probe has it, so
    that two processes with different CUDA_VISIBLE_DEVICES that both see `cuda:0` do not wait on each other."""
    if device != "cuda" or not env.gpu.devices:
        return device
    d = env.gpu.devices[0]
    if d.uuid:
        return d.uuid
    return f"gpu-{d.nvml_index if d.nvml_index is not None else d.index}"


def _unique_names(targets: Sequence[TuneTarget]) -> list[TuneTarget]:
    """Targets named apart (two config files of one model type), since reports and timings are keyed by name."""
    seen: dict[str, int] = {}
    out = []
    for t in targets:
        seen[t.name] = seen.get(t.name, 0) + 1
        out.append(t if seen[t.name] == 1 else replace(t, name=f"{t.name}#{seen[t.name]}"))
    return out


def _gpu_name(env: Any, torch: Any, device: str) -> str:
    """The GPU name records are keyed by: the probe's (what a lookup reads), else torch's."""
    if device != "cuda":
        return device
    if env.gpu.devices:
        return str(env.gpu.devices[0].name)
    return str(torch.cuda.get_device_name(0)) if torch is not None else "cuda"


def plans_of(result: TuneResult, store: TuneStore) -> list[ModePlan]:
    """The plan per (target, mode): this run's times, and for cells it skipped, the store's records."""
    from selector.tuning import problem_key

    stored: dict[tuple[str, str], dict[int, dict[str, Timed]]] = {}
    keys = {problem_key(t.problem): t.name for t in result.targets}
    for r in store.records():
        trusted = result.fingerprint.trusts(str(r.get("backend")), str(r.get("fingerprint")))
        if trusted and r.get("gpu") == result.gpu and r.get("problem") in keys:
            try:
                by_t = stored.setdefault((keys[r["problem"]], r["mode"]), {}).setdefault(int(r["tokens"]), {})
                by_t[r["backend"]] = Timed(float(r["time_s"]), float(r.get("spread", 0.0)))
            except (KeyError, TypeError, ValueError):
                continue
    plans = []
    for target in result.targets:
        for mode in dict.fromkeys(c.mode for c in result.cells if c.target == target.name):
            cells = {c.tokens: c for c in result.cells if c.target == target.name and c.mode == mode}
            times: dict[int, dict[str, Timed]] = {}
            for t in cells:
                fresh = result.timings.get((target.name, mode), {}).get(t)
                old = stored.get((target.name, mode), {}).get(t, {})
                chosen = fresh if fresh else {b: m for b, m in old.items() if b in cells[t].backends} or old
                if chosen:
                    times[t] = chosen
            static = {t: c.static for t, c in cells.items()}
            plans.append(build_plan(target.name, problem_key(target.problem), mode, times, static))
    return plans


class _Run:
    """The measuring state of one run: torch, the result so far, the store, the options."""

    def __init__(
        self,
        torch: Any,
        result: TuneResult,
        registry: Any,
        store: TuneStore,
        options: TuneOptions,
        progress: Progress | None,
        say: Callable[[str], None],
    ) -> None:
        self.torch, self.result, self.registry, self.store = torch, result, registry, store
        self.rounds, self.sample_s = max(1, options.rounds), options.sample_s
        self.cuda = result.device == "cuda"
        self.device = torch.device(result.device)
        self.progress, self.say = progress, say
        self.todo = sum(1 for c in result.cells if force_or_new(c, result.force))
        self.done = 0

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def release(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()

    def target(self, target: TuneTarget, counts: Sequence[int], budget_s: float, force: bool) -> None:
        """One layer: its backends' kernel tuning, then every cell not yet measured, records saved at the end."""
        from selector.bench.layouts import make_problem_layer
        from selector.tuning import check_record

        todo = [c for c in self.result.cells if c.target == target.name and force_or_new(c, force)]
        if not todo:
            self.say(f"{target.name}: every cell already measured under this fingerprint (--force measures again)")
            return
        started = time.perf_counter()
        self.tune_kernels(target, todo, budget_s)
        layer = make_problem_layer(self.torch, target.problem, self.device, seed=0)
        records: list[dict[str, Any]] = []
        try:
            for t in sorted({c.tokens for c in todo}):
                inputs = self.inputs(target, layer, t)
                for cell in (c for c in todo if c.tokens == t):
                    records += self.measure(target, cell, layer, inputs)
                    self.done += 1
                    if self.progress is not None:
                        self.progress(f"{target.name} T={t} {cell.mode}", self.done, self.todo)
                del inputs
                self.release()
        finally:
            del layer
            self.release()
            valid = []
            for r in records:  # e.g. a spread of 100x (a sample hit a pause): its cell is measured again next time
                why = check_record(r)
                if why is None:
                    valid.append(r)
                else:
                    self.result.errors.append(
                        _error(target.name, r["tokens"], r["mode"], r["backend"], f"record refused: {why}")
                    )
            saved = self.store.save(valid)  # what was measured is kept, even after a failure
            self.result.stored += saved.stored
            for why in saved.refused:
                self.result.errors.append(
                    _error(target.name, None, None, None, f"the tuning store refused a record: {why}")
                )
            self.result.records += valid
            self.result.durations[target.name] = time.perf_counter() - started

    def tune_kernels(self, target: TuneTarget, todo: Sequence[TuneCell], budget_s: float) -> None:
        """Every backend of these cells with a `tune_kernels` hook tunes within what is left of the budget."""
        counts = sorted({c.tokens for c in todo})
        spent = 0.0
        for name in dict.fromkeys(b for c in todo for b in c.backends):
            hook = self.registry.specs[name].tune_kernels
            if hook is None:
                continue
            entry: dict[str, Any] = {"target": target.name, "backend": name, "budget_s": max(0.0, budget_s - spent)}
            if budget_s - spent <= 0:
                entry["skipped"] = "the kernel budget is spent (--kernel-budget-s)"
            else:
                start = time.perf_counter()
                try:
                    entry["summary"] = dict(hook(target.problem, counts, budget_s - spent) or {})
                except Exception as exc:  # a broken tuner must not lose the run: the backend is timed as it is
                    entry["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                self.sync()
                entry["seconds"] = time.perf_counter() - start
                spent += entry["seconds"]
            self.result.kernel_tuning.append(entry)
            self.say(f"{target.name}: {name} kernel tuning: " + _describe(entry))

    def inputs(self, target: TuneTarget, layer: Any, t: int) -> tuple[Any, Any, Any, Any]:
        """(hidden states, expert ids, routing weights, float64 reference of the first rows) for T tokens."""
        from selector.bench.layer import random_routing
        from selector.bench.layouts import reference_of

        torch, p = self.torch, target.problem
        index, weights = random_routing(torch, t, p.num_experts, p.top_k, self.device, seed=t)
        gen = torch.Generator(device=self.device).manual_seed(1000 + t)
        x = torch.randn(t, p.hidden_size, device=self.device, dtype=getattr(torch, p.dtype), generator=gen)
        ref = reference_of(torch, layer, p, x, index, weights, min(t, SAMPLE_ROWS))
        return x, index, weights, ref

    def drop(self, cell: TuneCell, backend: str, why: str) -> None:
        self.result.errors.append(_error(cell.target, cell.tokens, cell.mode, backend, why))

    def measure(self, target: TuneTarget, cell: TuneCell, layer: Any, inputs: tuple[Any, ...]) -> list[dict[str, Any]]:
        """One cell: each backend's first call (timed: JIT, autotuning) checked against the reference, then all
        of them in interleaved rounds; the records of those that finished."""
        from selector.bench.timing import Timing, time_interleaved
        from selector.dispatch import backend_runner
        from selector.tuning import problem_key

        torch = self.torch
        x, index, weights, ref = inputs
        runners: dict[str, Callable[[], Any]] = {}
        firsts = self.result.first_calls.setdefault(target.name, {})
        for name in cell.backends:
            try:
                fn = backend_runner(name)
                runner = lambda fn=fn: fn(layer, x, index, weights)
                self.sync()
                start = time.perf_counter()
                out = runner()
                self.sync()
                firsts.setdefault(name, time.perf_counter() - start)  # the layer's first call: JIT, autotuning
                rows = ref.shape[0]
                error = float((out[:rows].double() - ref).norm() / ref.norm().clamp_min(1e-30))
                if not math.isfinite(error) or error > TOLERANCE:
                    self.drop(cell, name, f"wrong result: relative error {error:.3g} against float64 (> {TOLERANCE:g})")
                    continue
                runners[name] = runner
            except Exception as exc:
                self.drop(cell, name, f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
        errors: dict[str, str] = {}
        timings: dict[str, Timing] = {}
        if runners:
            timings = time_interleaved(
                torch,
                runners,
                cell.mode,
                rounds=self.rounds,
                sample_s=self.sample_s,
                device=self.device.type,
                errors=errors,
            )
        self.sync()
        for name, why in errors.items():
            self.drop(cell, name, f"failed while timed: {why}")
        by_t = self.result.timings.setdefault((cell.target, cell.mode), {}).setdefault(cell.tokens, {})
        now, key = time.time(), problem_key(target.problem)
        records = []
        for name, timing in timings.items():
            by_t[name] = Timed(timing.median_s, timing.spread)
            records.append(
                {
                    "fingerprint": self.result.fingerprint.of(name),
                    "gpu": self.result.gpu,
                    "problem": key,
                    "mode": cell.mode,
                    "tokens": cell.tokens,
                    "backend": name,
                    "time_s": timing.median_s,
                    "spread": timing.spread,
                    "rounds": timing.rounds,
                    "first_call_s": firsts.get(name, 0.0),
                    "measured_at": now,
                    "tool": TOOL,
                }
            )
        return records


def _error(target: str, tokens: int | None, mode: str | None, backend: str | None, error: str) -> dict[str, Any]:
    """One entry of `TuneResult.errors`: a backend dropped from a cell (or a record refused), and why."""
    return {"target": target, "tokens": tokens, "mode": mode, "backend": backend, "error": error}


def force_or_new(cell: TuneCell, force: bool) -> bool:
    return bool(cell.backends) and (force or not cell.measured)


def _describe(entry: Mapping[str, Any]) -> str:
    if "skipped" in entry:
        return f"skipped: {entry['skipped']}"
    if "error" in entry:
        return f"failed after {entry['seconds']:.1f}s: {entry['error']}"
    summary = ", ".join(f"{k}={v}" for k, v in list(entry.get("summary", {}).items())[:6])
    return f"{entry['seconds']:.1f}s" + (f" ({summary})" if summary else "")
