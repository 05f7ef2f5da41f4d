"""`selector tune`: measure every backend that can run a model's experts layers on this GPU, so that `auto`
picks from measurements instead of a static guess.

For each layer (from a Transformers config.json, a preset or flags): the backends with a `tune_kernels` hook
tune their kernels within a budget; each backend's first call is timed (JIT, autotuning); then every (token
count, mode) cell is timed across the backends in interleaved rounds (`selector.bench.timing.time_interleaved`);
the records go to the tuning store and the node daemon; the plan says which backend runs which token range,
where the choice crosses over and what it gains over the static choice.

Modules, one job each: `inputs` (layers and token counts), `layers` (the timed module and its reference),
`store` (what tune needs of the tuning store), `runner` (the run), `plan` (ranges, crossovers, gains), `cli`
(the command). Importing this package imports no torch.
"""

from __future__ import annotations

from selector.tune.cli import register
from selector.tune.inputs import (
    GRID,
    TuneInputError,
    TuneTarget,
    preset_targets,
    problem_from_config,
    read_config,
    token_counts,
)
from selector.tune.plan import ModePlan, Timed, build_plan, render_plan
from selector.tune.runner import TuneCell, TuneOptions, TuneResult, TuneUnavailable, plan_cells, run_tune
from selector.tune.store import TuneStore

__all__ = [
    "GRID",
    "ModePlan",
    "Timed",
    "TuneCell",
    "TuneInputError",
    "TuneOptions",
    "TuneResult",
    "TuneStore",
    "TuneTarget",
    "TuneUnavailable",
    "build_plan",
    "plan_cells",
    "preset_targets",
    "problem_from_config",
    "read_config",
    "register",
    "render_plan",
    "run_tune",
    "token_counts",
]
