"""`sonicmoe`: SonicMoE's fused MoE forward (`moe_general_routing_inputs`) from `kernels-community/sonic-moe`.

Gated experts only: silu, gelu (and tanh-gelu), relu map to the kernel's SwiGLU, GeGLU, ReGLU; its GeGLU uses
the tanh approximation of GELU. Any other activation, a non-gated layer or a custom gate function has no
SonicMoE kernel: the first forward raises ImportError telling the user to pick another backend.

First-call cost (measured on the H200 with sonic-moe 0.1.2.post1, ../shared/perf.md): the CuTe-DSL kernels
JIT-compile for 25-144 s on the first call of a layer shape, and about 2 s more for each new token count.
Two things follow here:

- **Token buckets.** The adapter pads the token count up to a quarter-octave bucket (4, 5, 6, 7, 8, 10, 12,
  14, 16, 20, ...: at most 25 % extra rows, dummy rows of weight 0), so a decode loop with changing batch
  sizes compiles at most four token counts per doubling instead of one per batch size.
  `SELECTOR_SONICMOE_PAD_TOKENS=0` turns it off.
- **Ranking rule.** The estimate is the steady-state time plus the one-time costs still ahead for this problem
  in this process (shape not compiled yet: 60 s, the middle of the measured range; token bucket not compiled
  yet, or token count unknown: 2 s; kernel neither local nor cached: a 30 s download), spread over
  `SELECTOR_JIT_AMORTIZE_CALLS` calls (default 1000). So
  `auto` does not pick a cold SonicMoE unless it would still win after paying the compile; it picks a warm
  one (compiled by an explicit `sonicmoe` run or `warm_up()`) where it is fastest. Measured tuning results
  replace the steady part of the estimate; the compile still ahead in this process is added to them the same way.

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import replace

from selector.plugins import adapter
from selector.probes import Environment

from selector import Availability, Problem, Requirements, Status, hub, settings
from selector.costmodel import floor_seconds, tokens

KERNEL = hub.PINS["sonic-moe"]
# layer activation (selector.problem.activation_name) -> the kernel's ActivationType member
ACTIVATION_TYPES = {"silu": "SWIGLU", "gelu": "GEGLU", "gelu_tanh": "GEGLU", "relu": "REGLU"}
PAD_VARIABLE = "SELECTOR_SONICMOE_PAD_TOKENS"

REQUIREMENTS = Requirements(
    devices=frozenset({"cuda"}),
    min_compute_capability=(9, 0),
    # the set measured on the H200: cutlass-dsl 4.4.2; apache-tvm-ffi is checked in `_packages`
    packages={"kernels": hub.KERNELS_MIN_VERSION, "nvidia-cutlass-dsl": "4.4"},
    dtypes=frozenset({"bfloat16"}),
    # activations, gating and custom gates are judged by `_activation`: an explicit request gets an ImportError
    activations=None,
    non_gated=True,  # claimed so that `_activation` refuses it with a clear ImportError, not a silent skip
    custom_gate=True,  # likewise refused by `_activation`
    bias=True,
    transposed=True,  # copied once into the kernel's (E, 2I, H) layout, held by the plan
    interleaved=True,  # the kernel's own default layout; concatenated gate|up is a flag
    post_expert_norm=False,  # the kernel fuses the weighted sum over experts: no per-expert hook
    expert_parallel=True,  # sentinel slots are routed to expert 0 with weight 0
)

# not among the default probes: asked for here (SELECTOR_PACKAGE_APACHE_TVM_FFI works)
PACKAGES = (adapter.Package("apache-tvm-ffi", "0.1.10", "SonicMoE's CuTe-DSL kernels call through it"),)
HOST_SECONDS = 0.9e-3  # measured: ~0.75-1.5 ms per call at T <= 64 on the H200 (host-bound)
EFFICIENCY = 1.65  # measured: 1.3-1.8x the floor at T >= 4096
AMORTIZE_VARIABLE = hub.AMORTIZE_VARIABLE
SHAPE_JIT_SECONDS = 60.0  # measured 25-144 s on the first call of a shape
TOKEN_JIT_SECONDS = 2.0  # measured ~2 s for each new token count
# what it compiles per: the layer's shape (its activation as the kernel's ActivationType), then each token count
SHAPE = ("num_experts", "hidden_size", "intermediate_size", "top_k", "dtype", "activation", "has_bias", "interleaved")
SHAPES = adapter.FirstCalls(SHAPE_JIT_SECONDS)
TOKENS = adapter.FirstCalls(TOKEN_JIT_SECONDS)  # (shape key, padded token count)

FIRST_CALL_COST = (
    f"downloads {KERNEL} on first use unless cached or local; JIT-compiles 25-144 s on the first call of a "
    "layer shape and ~2 s per new token bucket (token counts padded to quarter-octave buckets); auto spreads "
    f"that over {AMORTIZE_VARIABLE} (1000) calls, so it waits for a warm shape (selector.plugins.sonicmoe.warm_up)"
)


def padded_tokens(num_tokens: int) -> int:
    """The token bucket the kernel sees: quarter-octave steps above 4 (<= 25 % padding), exact when disabled."""
    if num_tokens <= 4 or not settings.get(PAD_VARIABLE):
        return num_tokens
    step = 1 << (num_tokens.bit_length() - 3)
    return -(-num_tokens // step) * step


def problem_key(problem: Problem) -> tuple:
    """The ledger key of a layer (gelu and tanh-gelu run the same GEGLU kernel)."""
    activation = problem.gate.activation
    kernel_activation = ACTIVATION_TYPES.get(activation, activation)
    return adapter.shape_key(replace(problem, gate=replace(problem.gate, activation=kernel_activation)), SHAPE)


def record_compiled(key: tuple, num_tokens: int) -> None:
    """Called after a successful kernel call with `num_tokens` (already padded) rows."""
    SHAPES.record(key)
    TOKENS.record((key, num_tokens))


def forget_compiled() -> None:
    SHAPES.forget()
    TOKENS.forget()


def pending_compile_seconds(problem: Problem) -> float:
    """Compile time still ahead of this problem in this process, by the measured figures."""
    key = problem_key(problem)
    if problem.num_tokens is None:  # a mix of token counts: one of them is new
        return SHAPES.pending(key) + TOKEN_JIT_SECONDS
    return SHAPES.pending(key) + TOKENS.pending((key, padded_tokens(problem.num_tokens)))


def _pending(problem: Problem, env: Environment) -> float:
    """Seconds of compile and download still ahead in this process before `problem` runs at steady speed."""
    return pending_compile_seconds(problem) + hub.pending_download_seconds(KERNEL, env)


def _estimate(problem: Problem, env: Environment) -> float:
    """max(host time, 1.65 x the floor of the padded token count) + (pending compile + download) / calls."""
    padded = problem if problem.num_tokens is None else problem.with_tokens(padded_tokens(tokens(problem)))
    steady = max(HOST_SECONDS, EFFICIENCY * floor_seconds(padded, env))
    return steady + _pending(problem, env) / hub.amortize_calls()


def _packages(problem: Problem, env: Environment) -> Availability | None:
    return adapter.package_verdict(PACKAGES, env)


def unsupported_activation(problem: Problem) -> str | None:
    if not problem.gated:
        return "non-gated experts"
    if problem.gate.custom:
        return "a custom gate function"
    if problem.activation not in ACTIVATION_TYPES:
        return f"the gated activation {problem.activation!r}"
    return None


def _activation(problem: Problem, env: Environment) -> Availability | None:
    what = unsupported_activation(problem)
    if what is None:
        return None
    # Status MISSING_PACKAGE: the kernel this layer needs does not exist (an ImportError when requested).
    return Availability(
        Status.MISSING_PACKAGE,
        f"SonicMoE has no kernel for {what}: it fuses gated silu/gelu/relu only (SwiGLU, GeGLU, ReGLU)",
        "pick another experts backend for this layer, e.g. grouped_mm, triton_fused or eager",
        found=f"{KERNEL}: ActivationType SWIGLU, GEGLU, REGLU",
    )


FORWARD = "selector.plugins.sonicmoe.forward"
# warm_up(module, token_counts, top_k): compile SonicMoE for `module`'s shape and these token counts now
warm_up = adapter.lazy("selector.plugins.sonicmoe.forward", "warm_up")


SPEC = adapter.declare(
    "sonicmoe",
    "selector.plugins.sonicmoe.forward",
    REQUIREMENTS,
    description=f"SonicMoE fused gated MoE (CuTe DSL) from {KERNEL}",
    check=hub.kernel_check(KERNEL, machine=_packages, config=_activation),
    estimate=_estimate,
    pending_cost=_pending,
    # the kernel asserts it is not being compiled; JIT on the first call of a shape / token bucket. The hub kernel
    # runs its own autograd Function when grad is enabled (is_inference_mode_enabled=False), and the plan copies
    # the weights per run then, so the gradients reach the parameters
    calls=replace(adapter.UNTRACED_CALLS, differentiable=frozenset({"hidden_states", "routing_weights", "expert_weights"})),
    first_call_cost=FIRST_CALL_COST,
    url="https://huggingface.co/kernels-community/sonic-moe",
)


selector_backends = adapter.backends_hook(SPEC)


__all__ = [
    "ACTIVATION_TYPES", "KERNEL", "PAD_VARIABLE", "SHAPE_JIT_SECONDS", "TOKEN_JIT_SECONDS", "forget_compiled",
    "padded_tokens", "pending_compile_seconds", "problem_key", "record_compiled", "selector_backends", "warm_up",
]
