"""What this process has compiled of SonicMoE, and the token buckets it compiles for: read by the ranking's
estimate (selector.plugins.sonicmoe) and written by the forward after a successful call."""

from __future__ import annotations

from selector import hub, settings
from selector.types import Problem

KERNEL = hub.PINS["sonic-moe"]

# layer activation (selector.problem.activation_name) -> the kernel's ActivationType member
ACTIVATION_TYPES = {"silu": "SWIGLU", "gelu": "GEGLU", "gelu_tanh": "GEGLU", "relu": "REGLU"}

SHAPE_JIT_SECONDS = 60.0  # measured 25-144 s on the first call of a shape
TOKEN_JIT_SECONDS = 2.0  # measured ~2 s for each new token count
PAD_VARIABLE = "SELECTOR_SONICMOE_PAD_TOKENS"

# Compiled in this process: shape keys, and (shape key, padded token count) pairs. Filled by the forward.
_WARM_SHAPES: set[tuple] = set()
_WARM_TOKENS: set[tuple] = set()


def padded_tokens(num_tokens: int) -> int:
    """The token bucket the kernel sees: quarter-octave steps above 4 (<= 25 % padding), exact when disabled."""
    if num_tokens <= 4 or not settings.get(PAD_VARIABLE):
        return num_tokens
    step = 1 << (num_tokens.bit_length() - 3)
    return -(-num_tokens // step) * step


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int, dtype: str, activation: str, bias: bool,
              interleaved: bool) -> tuple:
    return (num_experts, hidden, inter, top_k, dtype, ACTIVATION_TYPES.get(activation, activation), bias, interleaved)


def problem_key(problem: Problem) -> tuple:
    return shape_key(
        problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k, problem.dtype,
        problem.activation, problem.has_bias, problem.interleaved,
    )


def record_compiled(key: tuple, num_tokens: int) -> None:
    """Called by the forward after a successful kernel call with `num_tokens` (already padded) rows."""
    _WARM_SHAPES.add(key)
    _WARM_TOKENS.add((key, num_tokens))


def forget_compiled() -> None:
    _WARM_SHAPES.clear()
    _WARM_TOKENS.clear()


def pending_compile_seconds(problem: Problem) -> float:
    """Compile time still ahead of this problem in this process, by the measured figures."""
    key = problem_key(problem)
    pending = 0.0 if key in _WARM_SHAPES else SHAPE_JIT_SECONDS
    if problem.num_tokens is None or (key, padded_tokens(problem.num_tokens)) not in _WARM_TOKENS:
        pending += TOKEN_JIT_SECONDS
    return pending
