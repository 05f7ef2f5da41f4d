"""Experts configurations of well-known models, for `doctor --preset` and `bench`."""

from __future__ import annotations

from selector.gates import clamped_swiglu
from selector.types import Problem

PRESETS: dict[str, Problem] = {
    "qwen1.5-moe-a2.7b": Problem(num_experts=60, hidden_size=2048, intermediate_size=1408, top_k=4),
    "qwen3-30b-a3b": Problem(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8),
    "mixtral-8x7b": Problem(num_experts=8, hidden_size=4096, intermediate_size=14336, top_k=2),
    "deepseek-v3": Problem(num_experts=256, hidden_size=7168, intermediate_size=2048, top_k=8),
    "gpt-oss-20b": Problem(
        num_experts=32,
        hidden_size=2880,
        intermediate_size=2880,
        top_k=4,
        has_bias=True,
        is_transposed=True,
        interleaved=True,
        activation="clamped_swiglu",  # as problem_from_module names a layer whose gate is not act_mul
        gate=clamped_swiglu(),  # GPT-OSS's alpha 1.702, limit 7
    ),
}


def preset(name: str) -> Problem:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
