"""`selector bench`: one experts layer per cell, every available backend and Transformers' own backends as
peers, timed side by side in one run against the physical floor measured in the same run.

For each cell (shape, token count, dtype, weight format, backend, mode): time, time / floor, TFLOP/s, GB/s,
peak extra memory, error against a float64 reference on a sample of tokens, and the ratio to the best
Transformers peer. `--formats` adds quantised copies of each layer (fp8 block scales as float32 or UE8M0, fp4):
their floor counts the bytes as stored (scales included) and, for compute, the e4m3 matmul rate measured in the
same run (the kernels multiply e4m3 tiles); their reference is float64 from the dequantised weights with the
activations quantised as the kernels do, and Transformers' peers run dense cells only. Modes: `eager` (calls
back to back, events around the whole run, as a decode loop runs), `graph` (one call captured in a CUDA graph,
replays back to back), `compile` (torch.compile, then like eager) and `train` (one training step per call, the
differentiable backends only, gradients checked against float64). Within a cell and mode every backend, the
peers and `auto` are timed together in interleaved rounds (A B C, B C A, ...: the GPU's clocks drift 5-10%
between two passes), so each cell has a median and a spread, and a choice-quality summary sets `auto` against
the fastest selector backend of the same run. Output: a markdown table, JSON, and a PNG
plot of time/floor against tokens.

Modules, one job each: `cells` (what a run records), `timing` (ceilings and timers), `layer` (a cell's layer,
inputs, reference and floor), `grid` (the runner), `render` (tables, plot, files), `cli` (the command).
Importing this package imports no torch.
"""

from __future__ import annotations

from selector.bench.cells import (
    DEFAULT_PRESETS,
    DEFAULT_TOKENS,
    FORMATS,
    PEER_PREFIX,
    SCHEMA,
    BenchResult,
    Cell,
    choice_quality,
    measured_rows,
)
from selector.bench.cli import register
from selector.bench.grid import BenchOptions, fill_peer_ratios, peer_functions, run_bench
from selector.bench.layer import (
    bytes_moved,
    compute_ceiling,
    floor_seconds,
    flops_of,
    format_layer,
    make_layer,
    random_routing,
    reference,
    reference_rows,
    temp_bytes_estimate,
)
from selector.bench.render import choice_table, fmt_time, formats_table, markdown_table, plot, summarise, write_outputs
from selector.bench.timing import (
    Timing,
    calls_for,
    capture_graph,
    measure_ceilings,
    time_back_to_back,
    time_first_call,
    time_graph,
    time_host,
    time_interleaved,
)

__all__ = [
    "DEFAULT_PRESETS",
    "DEFAULT_TOKENS",
    "FORMATS",
    "PEER_PREFIX",
    "SCHEMA",
    "BenchOptions",
    "BenchResult",
    "Cell",
    "Timing",
    "bytes_moved",
    "calls_for",
    "capture_graph",
    "choice_quality",
    "choice_table",
    "compute_ceiling",
    "fill_peer_ratios",
    "floor_seconds",
    "flops_of",
    "fmt_time",
    "format_layer",
    "formats_table",
    "make_layer",
    "markdown_table",
    "measured_rows",
    "measure_ceilings",
    "peer_functions",
    "plot",
    "random_routing",
    "reference",
    "reference_rows",
    "register",
    "run_bench",
    "summarise",
    "temp_bytes_estimate",
    "time_back_to_back",
    "time_first_call",
    "time_graph",
    "time_host",
    "time_interleaved",
    "write_outputs",
]
