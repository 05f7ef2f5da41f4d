"""The shape presets: valid problems, unique lowercase names, the public group, the documented checkpoints."""

from __future__ import annotations

import ast
import inspect

import pytest

from selector import presets
from selector.gates import CLAMPED_SWIGLU
from selector.presets import PRESETS, PUBLIC_PRESETS, preset
from selector.types import Problem

GRID = ("qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-20b")
DOCUMENTED = GRID + (
    "qwen2-57b-a14b", "qwen3-235b-a22b", "qwen3-next-80b-a3b", "qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b",
    "qwen3.5-35b-a3b", "qwen3.5-397b-a17b", "mixtral-8x22b", "deepseek-v2", "deepseek-v2-lite", "kimi-k2",
    "moonlight-16b-a3b", "gpt-oss-120b", "olmoe-1b-7b", "granite-3.0-1b-a400m", "granite-3.0-3b-a800m",
    "phi-3.5-moe", "jamba-v0.1", "glm-4.5", "glm-4.5-air", "glm-4.7-flash", "glm-5", "minimax-m2", "dots.llm1",
    "gemma-4-26b-a4b",
)  # fmt: skip


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_a_valid_problem(name: str) -> None:
    p = PRESETS[name]
    assert isinstance(p, Problem)
    for size in (p.num_experts, p.hidden_size, p.intermediate_size, p.top_k):
        assert isinstance(size, int) and not isinstance(size, bool) and size > 0, (name, size)
    assert p.top_k <= p.num_experts, name
    assert p.num_tokens is None and p.weight_format == "dense" and p.scale_format is None, name
    assert not p.requires_grad and not p.compile and not p.expert_parallel, name
    assert preset(name) is p and preset(name.upper()) is p


def test_names_are_lowercase_and_unique() -> None:
    assert all(name == name.lower() and name.strip() == name and " " not in name for name in PRESETS)
    # a dict literal silently keeps the last of two equal keys: read the source's keys to catch a duplicate
    tree = ast.parse(inspect.getsource(presets))
    literal = next(n.value for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                   and getattr(n.target, "id", None) == "PRESETS")  # fmt: skip
    assert isinstance(literal, ast.Dict)
    keys = [k.value for k in literal.keys if isinstance(k, ast.Constant)]
    assert len(keys) == len(literal.keys) == len(set(keys)) == len(PRESETS)


def test_public_presets_lists_only_known_presets_once() -> None:
    assert isinstance(PUBLIC_PRESETS, tuple)
    assert len(PUBLIC_PRESETS) == len(set(PUBLIC_PRESETS))
    assert set(PUBLIC_PRESETS) <= set(PRESETS)
    assert set(GRID) <= set(PUBLIC_PRESETS)


def test_the_documented_checkpoints_are_present() -> None:
    assert not set(DOCUMENTED) - set(PRESETS)
    assert not set(DOCUMENTED) - set(PUBLIC_PRESETS)


def test_the_grid_keeps_its_names_order_and_values() -> None:
    assert tuple(PRESETS)[: len(GRID)] == GRID  # error messages list the known presets in this order
    fields = ("num_experts", "hidden_size", "intermediate_size", "top_k")
    shapes = {name: tuple(getattr(PRESETS[name], f) for f in fields) for name in GRID}
    assert shapes == {
        "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4),
        "qwen3-30b-a3b": (128, 2048, 768, 8),
        "mixtral-8x7b": (8, 4096, 14336, 2),
        "deepseek-v3": (256, 7168, 2048, 8),
        "gpt-oss-20b": (32, 2880, 2880, 4),
    }


def test_gpt_oss_layout_is_shared_by_both_sizes() -> None:
    small, large = preset("gpt-oss-20b"), preset("gpt-oss-120b")
    for p in (small, large):
        assert p.has_bias and p.is_transposed and p.interleaved and p.gated
        assert p.gate.name == CLAMPED_SWIGLU and p.gate.alpha == 1.702 and p.gate.limit == 7.0
        assert p.activation == CLAMPED_SWIGLU
    assert large.num_experts == 128 and (large.hidden_size, large.intermediate_size, large.top_k) == (2880, 2880, 4)


def test_other_presets_use_the_plain_gated_layout() -> None:
    for name, p in PRESETS.items():
        if name.startswith("gpt-oss"):
            continue
        assert p.gated and not (p.has_bias or p.is_transposed or p.interleaved or p.custom_gate), name
        assert p.gate.is_default and p.activation in ("silu", "gelu_tanh"), name


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown preset 'nope'; known: qwen1.5-moe-a2.7b, "):
        preset("nope")
