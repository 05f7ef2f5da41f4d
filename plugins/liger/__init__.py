"""`liger`: Liger-Kernel's fused MoE (`liger_kernel.ops.fused_moe.LigerFusedMoEFunction`), pure Triton.

The kernel takes Transformers' own layout, `gate_up_proj` [E, 2I, H] with concatenated [gate | up] rows and
`down_proj` [E, H, I], runs SiLU-gated experts only (its up kernel fuses silu(gate) * up), int32 expert ids and
float routing weights; it has no bias, no other activation, no custom gate and no per-expert hook. Transposed
and interleaved layouts are copied once into its layout (held by the plan). It has its own backward for the
input, the routing weights and both expert weights.

Two things keep it away from `auto` where it would hurt (liger-kernel 0.8.5, read from its source):

- **One host sync per call**: its routing metadata reads the number of M tiles with `.item()` to size its
  buffers, so it is declared not capturable in a CUDA graph and not for torch.compile.
- **First call**: its GEMMs autotune 32 configs per (H, I) (Triton's autotuner, in-process only): on the H200 a
  256x128 test shape took seconds, the Qwen3-30B-A3B shape (H=2048, I=768) more than 200 s (a test call did not
  finish in 200 s); the estimate adds that until this process has run the shape.

Measured on the H200 by an earlier comparison (not a curated result here): 1.23-1.44x our time at T >= 4096,
1.3-1.8x at T=64, 2-16x at T=1.
Nothing here imports torch.
"""

from __future__ import annotations

from selector.plugins import adapter
from selector.probes import Environment

from dataclasses import replace

from selector import Problem, Requirements, hub

DISTRIBUTION = "liger-kernel"
MIN_VERSION = "0.8.5"  # the first release measured here with `ops.fused_moe`
OFFLINE_DOC = "docs/offline-kernels.md#liger-kernel"
PACKAGES = (adapter.Package(DISTRIBUTION, MIN_VERSION, "its fused MoE kernels, liger_kernel.ops.fused_moe",
                            OFFLINE_DOC),)
INSTALL = PACKAGES[0].install()

REQUIREMENTS = Requirements(
    devices=frozenset({"cuda"}),
    min_compute_capability=(8, 0),  # Triton tl.dot in bf16: Ampere and newer
    packages={"triton": "3.0"},
    dtypes=frozenset({"bfloat16", "float16"}),
    activations=frozenset({"silu"}),  # the up kernel fuses silu(gate) * up and nothing else
    transposed=True,  # copied once into [E, 2I, H] / [E, H, I], held by the plan
    interleaved=True,  # de-interleaved once into [gate | up], held by the plan
    expert_parallel=True,  # sentinel slots go to expert 0 with weight 0
)

AUTOTUNE_SECONDS = 240.0  # 32 configs for each of its GEMMs, once per (H, I) per process (H200: > 200 s)
HOST_SECONDS = 0.25e-3  # the host sync and about ten launches per call
EFFICIENCY = 1.9  # measured: 1.23-1.8x our time at T >= 64, ours ~1.1-1.5x the floor
SHAPE = ("hidden_size", "intermediate_size")  # Liger's autotuner keys its GEMM configs on (H, I)
TUNED = adapter.FirstCalls(AUTOTUNE_SECONDS)

FIRST_CALL_COST = (
    f"autotunes 32 Triton configs per GEMM on the first call of each (hidden, intermediate) shape (auto counts "
    f"{AUTOTUNE_SECONDS:.0f} s, spread over {hub.AMORTIZE_VARIABLE} calls, until this process ran the shape); "
    "one host sync per call"
)


def _pending(problem: Problem, env: Environment) -> float:
    return TUNED.pending(adapter.shape_key(problem, SHAPE))


SPEC = adapter.declare(
    "liger",
    "selector.plugins.liger.forward",
    REQUIREMENTS,
    description="Liger-Kernel fused MoE (Triton grouped GEMMs with fused SwiGLU)",
    check=adapter.packages_check(PACKAGES),
    estimate=adapter.steady_estimate(HOST_SECONDS, EFFICIENCY, _pending),  # max(host, 1.9 x floor) + autotuning
    pending_cost=_pending,
    # `.item()` inside (a graph break at best): one host sync per call (the M-tile count)
    calls=replace(adapter.UNTRACED_CALLS, differentiable=frozenset({"hidden_states", "routing_weights", "expert_weights"})),
    first_call_cost=FIRST_CALL_COST,
    url="https://github.com/linkedin/Liger-Kernel",
)


selector_backends = adapter.backends_hook(SPEC)


__all__ = ["DISTRIBUTION", "INSTALL", "MIN_VERSION", "OFFLINE_DOC", "SHAPE", "SPEC", "TUNED", "selector_backends"]
