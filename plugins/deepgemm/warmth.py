"""The layer shapes this process has run through DeepGEMM (its JIT compiles per shape): read by the ranking's
estimate (selector.plugins.deepgemm) and written by the forward after a successful call."""

from __future__ import annotations

from selector import hub
from selector.types import Problem

KERNEL = hub.PINS["deep-gemm"]
_COMPILED: set[tuple] = set()  # layer shapes this process has run (filled by the forward)


def shape_key(num_experts: int, hidden: int, inter: int, gated: bool, transposed: bool, weight_format: str,
              scale_format: str | None) -> tuple:
    return (num_experts, hidden, inter, gated, transposed, weight_format, scale_format if weight_format != "dense" else None)


def problem_key(problem: Problem) -> tuple:
    return shape_key(problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.gated,
                     problem.is_transposed, problem.weight_format, problem.scale_format)


def record_compiled(key: tuple) -> None:
    _COMPILED.add(key)


def is_compiled(problem: Problem) -> bool:
    return problem_key(problem) in _COMPILED


def forget_compiled() -> None:
    _COMPILED.clear()
