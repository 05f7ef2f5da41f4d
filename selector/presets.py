"""Experts configurations of well-known models, for `doctor --preset`, `bench` and `tune --preset`.

One preset per public checkpoint whose Transformers modeling file decorates its experts module
(`use_experts_implementation`): the routed experts only (E experts, hidden size H, per-expert intermediate size
I, i.e. `moe_intermediate_size` where a config has both, top-k). Shared experts and dense layers are not part of
the experts module and are not described here. Every shape names where its numbers were read; a checkpoint whose
numbers could not be confirmed from a published config (or a training recipe that spells them out) is left out.
Checkpoints of the same shape share their values; only distinct shapes matter for tuning.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from selector.gates import clamped_swiglu
from selector.types import Problem


def _shape(experts: int, hidden: int, intermediate: int, top_k: int, **layout: Any) -> Problem:
    return Problem(num_experts=experts, hidden_size=hidden, intermediate_size=intermediate, top_k=top_k, **layout)


# GPT-OSS: biases, transposed [E, H, 2I] weights, interleaved gate/up channels, clamped SwiGLU.
_GPT_OSS_20B = Problem(
    num_experts=32,
    hidden_size=2880,
    intermediate_size=2880,
    top_k=4,
    has_bias=True,
    is_transposed=True,
    interleaved=True,
    activation="clamped_swiglu",  # as problem_from_module names a layer whose gate is not act_mul
    gate=clamped_swiglu(),  # GPT-OSS's alpha 1.702, limit 7
)

PRESETS: dict[str, Problem] = {
    # --- the perf grid (selector.tune.inputs.GRID); names and values are fixed: other code and tests use them ---
    # huggingface.co/Qwen/Qwen1.5-MoE-A2.7B config.json (qwen2_moe)
    "qwen1.5-moe-a2.7b": Problem(num_experts=60, hidden_size=2048, intermediate_size=1408, top_k=4),
    # THUDM/slime scripts/models/qwen3-30B-A3B.sh; MindSpeed-RL configs/model/qwen3_30b_a3b.yaml (qwen3_moe)
    "qwen3-30b-a3b": Problem(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8),
    # huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1 config.json (mixtral)
    "mixtral-8x7b": Problem(num_experts=8, hidden_size=4096, intermediate_size=14336, top_k=2),
    # THUDM/slime scripts/models/deepseek-v3.sh (deepseek_v3; DeepSeek-R1 has the same shape)
    "deepseek-v3": Problem(num_experts=256, hidden_size=7168, intermediate_size=2048, top_k=8),
    # transformers GptOssConfig defaults (documented as openai/gpt-oss-20b); NeMo Megatron-Bridge docs gpt-oss
    "gpt-oss-20b": _GPT_OSS_20B,
    # --- Qwen ---
    # huggingface.co/Intel/Qwen2-57B-A14B-Instruct-int4-inc config.json (quantized Qwen2-57B-A14B-Instruct; qwen2_moe)
    "qwen2-57b-a14b": _shape(64, 3584, 2560, 8),
    # THUDM/slime scripts/models/qwen3-235B-A22B.sh; MindSpeed-RL configs/model/qwen3_235b_a22b.yaml (qwen3_moe)
    "qwen3-235b-a22b": _shape(128, 4096, 1536, 8),
    # THUDM/slime scripts/models/qwen3-next-80B-A3B.sh (qwen3_next)
    "qwen3-next-80b-a3b": _shape(512, 2048, 512, 10),
    # THUDM/slime scripts/models/qwen3-vl-30b-a3b.sh (qwen3_vl_moe text part; same shape as qwen3-30b-a3b)
    "qwen3-vl-30b-a3b": _shape(128, 2048, 768, 8),
    # THUDM/slime scripts/models/qwen3-vl-235b-a22b.sh (qwen3_vl_moe text part; same shape as qwen3-235b-a22b)
    "qwen3-vl-235b-a22b": _shape(128, 4096, 1536, 8),
    # THUDM/slime scripts/models/qwen3.5-35B-A3B.sh (qwen3_5_moe)
    "qwen3.5-35b-a3b": _shape(256, 2048, 512, 8),
    # THUDM/slime scripts/models/qwen3.5-397B-A17B.sh (qwen3_5_moe)
    "qwen3.5-397b-a17b": _shape(512, 4096, 1024, 10),
    # --- Mistral ---
    # huggingface.co/mistral-community/Mixtral-8x22B-v0.1 (config.json as copied by its fine-tunes) (mixtral)
    "mixtral-8x22b": _shape(8, 6144, 16384, 2),
    # --- DeepSeek and DeepSeek-V3-architecture checkpoints ---
    # huggingface.co/deepseek-ai/DeepSeek-V3 inference/configs/config_236B.json (deepseek_v2)
    "deepseek-v2": _shape(160, 5120, 1536, 6),
    # huggingface.co/deepseek-ai/DeepSeek-Coder-V2-Lite-Base config.json; DeepSeek-V3 inference/configs/config_16B.json
    "deepseek-v2-lite": _shape(64, 2048, 1408, 6),
    # THUDM/slime scripts/models/kimi-k2.sh (DeepSeek-V3 architecture)
    "kimi-k2": _shape(384, 7168, 2048, 8),
    # THUDM/slime scripts/models/moonlight.sh (moonshotai/Moonlight-16B-A3B, DeepSeek-V3 architecture)
    "moonlight-16b-a3b": _shape(64, 2048, 1408, 6),
    # --- OpenAI ---
    # NeMo Megatron-Bridge docs gpt-oss (128 experts, top-4, hidden 2880, expert FFN 2880); layout as gpt-oss-20b
    "gpt-oss-120b": replace(_GPT_OSS_20B, num_experts=128),
    # --- AllenAI ---
    # huggingface.co/allenai/OLMoE-1B-7B-0924 config.json (olmoe)
    "olmoe-1b-7b": _shape(64, 2048, 1024, 8),
    # --- IBM Granite ---
    # config.json of ibm-granite/granite-3.0-1b-a400m-base as copied by its fine-tunes; ollama granite3-moe (granitemoe)
    "granite-3.0-1b-a400m": _shape(32, 1024, 512, 8),
    # config.json of ibm-granite/granite-3.0-3b-a800m-{base,instruct} quantizations; ollama granite3-moe (granitemoe)
    "granite-3.0-3b-a800m": _shape(40, 1536, 512, 8),
    # --- Microsoft ---
    # huggingface.co/nm-testing/Phi-3.5-MoE-instruct-FP8 config.json (of microsoft/Phi-3.5-MoE-instruct; phimoe)
    "phi-3.5-moe": _shape(16, 4096, 6400, 2),
    # --- AI21 ---
    # huggingface.co/ai21labs/Jamba-v0.1 config.json (jamba; experts on every other layer)
    "jamba-v0.1": _shape(16, 4096, 14336, 2),
    # --- Zhipu GLM ---
    # THUDM/slime scripts/models/glm4.5-355B-A32B.sh (zai-org/GLM-4.5; glm4_moe)
    "glm-4.5": _shape(160, 5120, 1536, 8),
    # THUDM/slime scripts/models/glm4.5-106B-A12B.sh (zai-org/GLM-4.5-Air; glm4_moe)
    "glm-4.5-air": _shape(128, 4096, 1408, 8),
    # THUDM/slime scripts/models/glm4.7-30B-A3B.sh (zai-org/GLM-4.7-Flash; glm4_moe_lite)
    "glm-4.7-flash": _shape(64, 2048, 1536, 4),
    # THUDM/slime scripts/models/glm5-744B-A40B.sh (zai-org/GLM-5; glm_moe_dsa)
    "glm-5": _shape(256, 6144, 2048, 8),
    # --- MiniMax ---
    # THUDM/slime scripts/models/minimax-m2.sh (minimax_m2)
    "minimax-m2": _shape(256, 3072, 1536, 8),
    # --- rednote ---
    # huggingface.co/rednote-hilab/dots.llm1.base config.json (dots1)
    "dots.llm1": _shape(128, 4096, 1408, 6),
    # --- Google ---
    # THUDM/slime scripts/models/gemma4-26B-A4B.sh (gemma4); gelu_pytorch_tanh: transformers Gemma4TextConfig
    "gemma-4-26b-a4b": _shape(128, 2816, 704, 8, activation="gelu_tanh"),
}

# The perf grid's shapes (`--preset grid`).
GRID_PRESETS: tuple[str, ...] = ("qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-20b")

# Every public checkpoint's preset (the perf grid's five included), in PRESETS' order.
PUBLIC_PRESETS: tuple[str, ...] = tuple(PRESETS)

# Shapes kept out of every shipped tile table and so out of the tile heuristic's fit (configs.nearest_config reads
# the tables): the benchmark of untuned speed on shapes no table holds runs on these (benchmarks/untuned.py).
HELD_OUT_PRESETS: tuple[str, ...] = (
    "olmoe-1b-7b",
    "glm-4.7-flash",
    "dots.llm1",
    "granite-3.0-3b-a800m",
    "minimax-m2",
    "phi-3.5-moe",
)


def tabled_presets() -> list[str]:
    """The public presets whose shapes the shipped tile tables hold: one name per distinct layer (shape and
    layout), perf grid first, held-out shapes left out."""
    held = {_layer_of(PRESETS[n]) for n in HELD_OUT_PRESETS}
    names: dict[tuple, str] = {}
    for name in (*GRID_PRESETS, *PUBLIC_PRESETS):
        layer = _layer_of(PRESETS[name])
        if layer not in held:
            names.setdefault(layer, name)
    return list(names.values())


def _layer_of(problem: Problem) -> tuple:
    """What a tile table entry is keyed by: the sizes and the weight layout (the gate aside: the tiles serve any)."""
    return (problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k,
            problem.is_transposed, problem.interleaved)  # fmt: skip


def preset(name: str) -> Problem:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
