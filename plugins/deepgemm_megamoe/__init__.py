"""`deepgemm_megamoe`: DeepGEMM's Mega MoE, one fused kernel for EP dispatch + L1 + SwiGLU + L2 + combine.

Blackwell only (compute capability >= 10.0, nvcc >= 12.9 for its JIT), FP4 expert weights with UE8M0 scales
and FP8 activations; gated SwiGLU (an optional clamp from `config.swiglu_limit`). Its symmetric buffer
rendezvous over a torch.distributed process group: with expert parallelism (EP size > 1) one must be
initialised and given to the module (`module.selector_process_group`); on a single rank an initialised world
of one is enough. With EP > 1 the kernel does the dispatch itself, so `top_k_index` holds global expert ids.

None of this hardware is on the development machines: the requirement checks, errors and the call path are
written against DeepGEMM's documented API (`deep_gemm.mega`) and tested with a fake kernel only.
"""

from __future__ import annotations

import sys

from selector.plugins import adapter
from selector.plugins.deepgemm import KERNEL
from selector.probes import Environment

from dataclasses import replace

from selector import Availability, Problem, Requirements, Status, ToolkitRule, hub

BLACKWELL = ToolkitRule(min_cc=(10, 0), max_cc=None, nvcc=(12, 9), family="Blackwell")

REQUIREMENTS = Requirements(
    devices=frozenset({"cuda"}),
    min_compute_capability=(10, 0),
    max_compute_capability=(11, 0),  # SM100 kernels only
    toolkit=(BLACKWELL,),
    packages={"kernels": hub.KERNELS_MIN_VERSION},
    dtypes=frozenset({"bfloat16"}),  # the compute dtype of the FP4 experts (selector.quant)
    weight_formats=frozenset({"fp4"}),
    scale_formats=frozenset({"ue8m0"}),
    activation_quant=frozenset({"dynamic"}),
    activations=frozenset({"silu"}),
    non_gated=False,
    bias=False,
    transposed=False,
    interleaved=False,  # the kernel interleaves [gate | up] itself (transform_weights_for_mega_moe)
    custom_gate=False,
    post_expert_norm=False,
    expert_parallel=True,
    needs_process_group=True,
)


def process_group_check(problem: Problem, env: Environment) -> Availability | None:
    """EP size > 1 needs an initialised torch.distributed (read without importing torch)."""
    if not problem.expert_parallel:
        return None
    dist = sys.modules.get("torch.distributed")
    initialised = bool(dist is not None and dist.is_available() and dist.is_initialized())
    if initialised:
        return None
    return Availability(
        Status.UNSUPPORTED_CONFIG,
        "Mega MoE with expert parallelism (EP size > 1) rendezvous its symmetric buffer over a torch.distributed "
        "process group, and none is initialised",
        "call torch.distributed.init_process_group and set module.selector_process_group to the EP group, "
        "or pick deepgemm (no fused dispatch)",
    )


SPEC = adapter.declare(
    "deepgemm_megamoe",
    "selector.plugins.deepgemm_megamoe.forward",
    REQUIREMENTS,
    description=f"DeepGEMM Mega MoE: fused FP8 x FP4 EP MoE on Blackwell, from {KERNEL}",
    check=hub.kernel_check(KERNEL, config=process_group_check),
    estimate=None,  # never measured: sorts after every backend that has an estimate
    # not verified under torch.compile nor in CUDA graphs: declared unsupported until it is; inference-only fused
    # kernel (its forward raises while autograd records)
    calls=replace(adapter.UNTRACED_CALLS, differentiable=frozenset()),
    first_call_cost=(
        f"downloads {KERNEL} unless cached; JIT-compiles with nvcc on the first call of a shape; allocates its "
        "symmetric buffer (a collective, ~1 MiB per token per rank) for the largest batch seen"
    ),
    url="https://github.com/deepseek-ai/DeepGEMM",
)


selector_backends = adapter.backends_hook(SPEC)
