"""`triton_kernels`: OpenAI's `triton_kernels.matmul_ogs` ragged grouped GEMMs (GPT-OSS's MoE path).

Two `matmul_ogs` calls per layer: the up projection gathers each (token, slot) row into expert-sorted order
(`GatherIndx`), the gate or activation runs in torch on the sorted rows (any activation, gated or not,
concatenated or interleaved channels), and the down projection multiplies each row by its routing weight
(`gammas`) and sums the k slots of each token (`ScatterIndx`, a grouped reduction in float32). The routing
metadata (`RoutingData`, its histogram and tile maps from `compute_expt_data`) is built from the given top-k
ids with device ops only: no host sync. Weights are read in place: the library takes W as [E, K, N] in either
row- or column-major order, so neither layout is copied; biases run in its epilogue.

Gates: the adapter applies the module's own gate (`_apply_gate`) in torch between the GEMMs, so any gate runs,
GPT-OSS's clamped SwiGLU included (`custom_gate=True`; triton_kernels could also fuse it into the up GEMM,
`FusedActivation(swiglu_fn, (alpha, limit), 2)`, over interleaved channels). A post-expert
norm cannot run (the slots are summed inside the down GEMM's reduction).

First call: Triton JIT-compiles its kernels for each new shape / tile choice (0.8-3.5 s per grid shape on the
H200; in-process record). Its eager calls are host-bound (1.3-1.8 ms at T <= 512: matmul_ogs plans in Python);
`selector bench` captured it in CUDA graphs without error, but capture is not declared until a test proves the
replay right on new routing, and compile is not declared.
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from selector.probes import Environment

from selector import Availability, BackendSpec, Problem, Requirements, hookimpl, hub
from selector.costmodel import floor_seconds
from selector.plugins.triton_kernels.state import (
    DISTRIBUTION,
    OFFLINE_DOC,
    forget_compiled,
    is_compiled,
    locate,
    package_verdict,
    record_compiled,
)

REQUIREMENTS = Requirements(
    devices=frozenset({"cuda"}),
    min_compute_capability=(9, 0),  # measured on Hopper; its non-TMA path for Ampere is not checked here
    packages={"triton": "3.6"},  # a triton_kernels tree follows its Triton release (the vLLM 0.33 copy: 3.6)
    dtypes=frozenset({"bfloat16", "float16"}),
    activations=None,  # the module's own activation runs in torch between the two GEMMs
    non_gated=True,
    bias=True,  # matmul_ogs adds [E, N] biases in its epilogue
    transposed=True,  # W [E, K, N] row-major as it is; the standard layout as column-major views
    interleaved=True,  # the module's gate reads interleaved channels itself
    custom_gate=True,  # the module's own _apply_gate runs in torch between the GEMMs: any gate, GPT-OSS's too
    post_expert_norm=False,  # the k slots are summed inside the down GEMM's reduction
    expert_parallel=True,  # sentinel slots go to expert 0 with weight 0
)

JIT_SECONDS = 4.0  # measured on the H200: 0.8-3.5 s per grid shape
HOST_SECONDS = 1.4e-3  # two matmul_ogs calls' Python planning: 1.3-1.8 ms per eager call at T <= 512 on the H200
EFFICIENCY = 1.6  # measured: 1.0-1.1x our time at T = 4096 (DeepSeek-V3, Mixtral), ours 1.3-1.6x the floor

FIRST_CALL_COST = (
    f"Triton JIT-compiles matmul_ogs for each new layer shape (auto counts {JIT_SECONDS:.0f} s, spread over "
    f"{hub.AMORTIZE_VARIABLE} calls, until this process has run the shape)"
)


def shape_key(problem: Problem) -> tuple:
    return (problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k, problem.dtype,
            problem.gated, problem.has_bias, problem.is_transposed)  # fmt: skip


def _pending(problem: Problem, env: Environment) -> float:
    return 0.0 if is_compiled(shape_key(problem)) else JIT_SECONDS


def _estimate(problem: Problem, env: Environment) -> float:
    steady = max(HOST_SECONDS, EFFICIENCY * floor_seconds(problem, env))
    return steady + _pending(problem, env) / hub.amortize_calls()


def _check(problem: Problem, env: Environment) -> Availability | None:
    return package_verdict(env)


def _load():  # noqa: ANN202
    from selector.plugins.triton_kernels.forward import triton_kernels_experts_forward, load_triton_kernels

    load_triton_kernels()  # the library imports here, so a broken install is a load failure auto skips, not a failed call
    return triton_kernels_experts_forward


SPEC = BackendSpec(
    name="triton_kernels",
    load=_load,
    requirements=REQUIREMENTS,
    description="OpenAI triton_kernels matmul_ogs (ragged gather/scatter grouped GEMMs, GPT-OSS's path)",
    check=_check,
    estimate=_estimate,
    pending_cost=_pending,
    compile_compatible=False,  # Python planning (opt flags, descriptors) around the launches: not traced
    compile_modes=frozenset(),
    fullgraph=False,
    cuda_graph_safe=False,  # no host sync, but capture not verified; Triton JIT on first call of a shape
    differentiable=frozenset(),  # forward only here
    first_call_cost=FIRST_CALL_COST,
    url="https://github.com/triton-lang/triton/tree/main/python/triton_kernels",
)


@hookimpl
def selector_backends() -> Sequence[BackendSpec]:
    return [SPEC]


__all__ = ["DISTRIBUTION", "OFFLINE_DOC", "SPEC", "forget_compiled", "locate", "record_compiled",
           "selector_backends", "shape_key"]
