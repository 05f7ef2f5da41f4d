"""Host side of the quantised experts kernels, one name space for callers (tune.py, benchmarks, tests).

``layer_forward`` runs a whole layer (a ``QuantLayer`` record) whose gate is act(gate) * up (or a plain
activation) and that has no post-expert norm: routing (``triton_common.align``, grouped mode only), the gate_up GEMM with bias and
gating in its epilogue, the down GEMM with bias and the routing weight in its epilogue, and the shared
deterministic ``combine`` (fixed-order fp32 sum over the k slots; sentinel slots skipped). One torch custom op,
so torch.compile sees one opaque node and there is no host synchronisation (CUDA graphs capture it).
``route`` / ``run_projection`` are the same pieces one by one, for layers whose gate or norm is torch code.

Each job lives in its own module: ``activation_quant`` (x quantised to e4m3), ``routing`` (pairs grouped by
expert, the combine), ``projection`` (the grouped / batched launchers), ``records`` (what a layer's plan holds:
weights, format, epilogue), ``tiles`` (tile sizes, K splits, TMA and combine choices, tuned tables) and ``layer``
(the whole layer and its custom op).
"""

from __future__ import annotations

from selector.plugins.quant_kernels.activation_quant import quantize_rows
from selector.plugins.quant_kernels.layer import MODES, layer_forward, run_layer
from selector.plugins.quant_kernels.projection import PLAIN, Activations, Output, run_projection
from selector.plugins.quant_kernels.records import (
    LINEAR,
    Epilogue,
    Projection,
    QuantLayer,
    QuantWeights,
    WeightFormat,
    quant_layer,
    up_epilogue,
)
from selector.plugins.quant_kernels.routing import combine_slots, route, route_deferred
from selector.plugins.quant_kernels.tiles import (
    TMA_MAX_BOX,
    TMA_MIN_BLOCK_M,
    combine_in_kernel,
    finish_split,
    grouped_block_m,
    resolve_config,
    split_k,
    use_tma,
)
from selector.plugins.triton_common.align import AlignPlan, max_blocks_for, plan_align, run_align
from selector.plugins.triton_common.launch import TensorDescriptor  # None: a Triton without TMA

__all__ = [
    "LINEAR",
    "MODES",
    "PLAIN",
    "TMA_MAX_BOX",
    "TMA_MIN_BLOCK_M",
    "Activations",
    "AlignPlan",
    "Epilogue",
    "Output",
    "Projection",
    "QuantLayer",
    "QuantWeights",
    "TensorDescriptor",
    "WeightFormat",
    "combine_in_kernel",
    "combine_slots",
    "finish_split",
    "grouped_block_m",
    "layer_forward",
    "max_blocks_for",
    "plan_align",
    "quant_layer",
    "quantize_rows",
    "resolve_config",
    "route",
    "route_deferred",
    "run_align",
    "run_layer",
    "run_projection",
    "split_k",
    "up_epilogue",
    "use_tma",
]
