"""Tune a loaded model's experts layers once, within a budget: `selector.tune_model(model, budget_s=...)`.

For each distinct experts shape of the model, every backend that can run it here and declares a kernel tuner
(`BackendSpec.tune_kernels`: the fused Triton kernel's tile search) tunes it at the token counts a model meets
(TUNE_TOKENS), sharing the budget, and keeps what it found where it looks first (the user tile table). Shapes a
shipped table or an earlier tuning already covers are skipped by the tuners themselves, so a second call, or a
second process on the node, costs nothing: processes take the GPU's measurement lock in turn, and the one that
waited finds the shapes tuned. `SELECTOR_TUNE_ON_LOAD=<seconds>` runs this when `selector.from_pretrained` /
`selector.from_config` load a model on a CUDA GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from selector.layers import find_experts
from selector.tune.runner import TuneUnavailable, lock_name
from selector.tune.store import TuneStore
from selector.types import Problem

TUNE_TOKENS = (1, 8, 64, 512, 4096, 16384)
Progress = Callable[[str, int, int], None]  # (what, shapes done, shapes in all)


@dataclass
class ModelTuning:
    """What `tune_model` did: per shape and backend the tuner's summary, the shapes nothing could tune here (and
    why), and the seconds spent (waiting for another process's lock included)."""

    shapes: list[Problem] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)
    untunable: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def tuned(self) -> list[dict[str, Any]]:
        """The summaries of the tunings that measured something (shapes already covered are left out)."""
        return [s for s in self.summaries if s.get("tokens_tuned") or s.get("tokens_partial")]


def model_shapes(model: torch.nn.Module) -> list[Problem]:
    """The distinct experts layers of `model` as the ranking sees them (token count unset), in model order."""
    from selector.dispatch import problem_of, traced_top_k

    shapes: dict[Problem, None] = {}
    for _, module in find_experts(model):  # k: the last call's, else as the module or its config declares it
        shapes.setdefault(problem_of(module, traced_top_k(module)).with_tokens(None), None)
    return list(shapes)


def _describe(problem: Problem) -> str:
    return f"E={problem.num_experts} H={problem.hidden_size} I={problem.intermediate_size} k={problem.top_k}"


def tune_model(
    model: torch.nn.Module,
    budget_s: float = 30.0,
    *,
    token_counts: Sequence[int] = TUNE_TOKENS,
    lock_timeout_s: float = 600.0,
    progress: Progress | bool = True,
    store: TuneStore | None = None,
) -> ModelTuning:
    """Tune the kernels of `model`'s distinct experts shapes on this GPU within `budget_s` seconds in all, and keep
    them (the user tile table); later forwards run them. `progress`: a bar on stderr (True), a callback, or none.
    Shapes no backend here can tune (the fused kernel's tuner needs a CUDA GPU) are listed in `untunable`.
    Raises TuneUnavailable when another process holds the GPU's measurement lock past `lock_timeout_s`."""
    from selector import dispatch
    from selector.environment import current_environment
    from selector.requirements import evaluate

    if budget_s <= 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    started = time.perf_counter()
    result = ModelTuning(shapes=model_shapes(model))
    env = current_environment()
    registry = dispatch.get_backend_registry()
    jobs = []
    for problem in result.shapes:
        tuners = [s for s in registry.specs.values() if s.tune_kernels and evaluate(s, problem, env).ok]
        if not tuners:
            result.untunable[_describe(problem)] = (
                f"no backend that runs it here ({problem.dtype} on {problem.device}) declares a kernel tuner"
            )
        jobs += [(problem, spec) for spec in tuners]
    if not jobs:
        result.seconds = time.perf_counter() - started
        return result
    store = store or TuneStore()
    report = _progress(progress, len(jobs))
    device = "cuda" if any(p.device == "cuda" for p, _ in jobs) else jobs[0][0].device
    lock = lock_name(env, device)
    with store.measurement_lock(lock, lock_timeout_s) as got:
        if not got:
            raise TuneUnavailable(
                f"another process holds the measurement lock {lock!r} (beside {store.path}) past "
                f"{lock_timeout_s:g} s: let it finish, or raise lock_timeout_s"
            )
        for done, (problem, spec) in enumerate(jobs):
            left = budget_s - (time.perf_counter() - started)
            if left <= 0:
                result.summaries.append({"backend": spec.name, "shape": _describe(problem), "skipped": "out of budget"})
                continue
            report(f"{spec.name} {_describe(problem)}", done, len(jobs))
            share = left / (len(jobs) - done)  # what the earlier jobs left, shared by those still to run
            summary = dict(spec.tune_kernels(replace(problem, num_tokens=None), tuple(token_counts), share))
            summary.setdefault("backend", spec.name)
            result.summaries.append(summary)
        report("done", len(jobs), len(jobs))
    dispatch.reset_selection_caches()  # plans prepared before read the tiles of before
    result.seconds = time.perf_counter() - started
    return result


def _progress(progress: Progress | bool, total: int) -> Progress:
    """A callback from `progress`: True draws `selector tune`'s bar (tqdm, or one stderr line per shape)."""
    if callable(progress):
        return progress
    if not progress or total == 0:
        return lambda what, done, total: None
    from selector.tune.progress import ProgressBar

    bar = ProgressBar(unit="shape")

    def step(what: str, done: int, all_: int) -> None:
        if done == all_:
            bar.close()
        else:
            bar(what, done, all_)

    return step
