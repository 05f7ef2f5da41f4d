"""What `selector tune` measures: the layers (from a Transformers config.json, presets or flags) and the token counts.

Pure: reads the config file it is pointed at with json, imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from selector.gates import GPT_OSS_ALPHA, GPT_OSS_LIMIT, clamped_swiglu
from selector.presets import GRID_PRESETS
from selector.types import Problem

GRID = GRID_PRESETS  # --preset grid
DEFAULT_TOKENS = tuple(1 << i for i in range(15))  # every power of two 1..16384
FORMATS: dict[str, tuple[str, str | None]] = {  # --format: (weight format, scale format), as `selector bench`
    "dense": ("dense", None),
    "fp8-f32": ("fp8_block", "float32"),
    "fp8-ue8m0": ("fp8_block", "ue8m0"),
    "fp4": ("fp4", "ue8m0"),
}
DTYPES = ("bfloat16", "float16", "float32")
_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")
_TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}


class TuneInputError(ValueError):
    """A config file, preset or flag `selector tune` cannot use: one line naming the fix."""


@dataclass(frozen=True)
class TuneTarget:
    """One layer to tune: its name in reports, the problem (token count unset) and notes on how it was read."""

    name: str
    problem: Problem
    notes: tuple[str, ...] = ()


def _first(config: Mapping[str, Any], keys: Sequence[str], what: str, source: str) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise TuneInputError(f"{source}: no {what} ({' / '.join(keys)}) in the config; is it an MoE model's config.json?")


def problem_from_config(config: Mapping[str, Any], source: str = "config.json") -> TuneTarget:
    """The experts layer a Transformers config describes: E, H, I (per expert), k, dtype, GPT-OSS's layout
    (bias, transposed, interleaved, clamped SwiGLU gate) and fine-grained FP8 weights. A multimodal config's
    `text_config` is read where the top level has no experts."""
    if not any(k in config for k in _EXPERTS_KEYS) and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    model_type = str(config.get("model_type", "")) or "model"
    experts = _first(config, _EXPERTS_KEYS, "expert count", source)
    hidden = _first(config, ("hidden_size",), "hidden size", source)
    inter = _first(config, _INTERMEDIATE_KEYS, "intermediate size per expert", source)
    top_k = _first(config, _TOP_K_KEYS, "experts per token", source)
    if top_k > experts:
        raise TuneInputError(f"{source}: {top_k} experts per token but only {experts} experts")
    notes: list[str] = []
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    if dtype not in DTYPES:
        notes.append(f"dtype {dtype!r} is not one selector times: timing bfloat16")
        dtype = "bfloat16"
    act = str(config.get("hidden_act", "silu"))
    problem = Problem(
        num_experts=experts,
        hidden_size=hidden,
        intermediate_size=inter,
        top_k=top_k,
        dtype=dtype,
        activation=_ACTIVATIONS.get(act, "silu"),
    )
    if act not in _ACTIVATIONS:
        notes.append(f"hidden_act {act!r} is not one selector times: timing silu")
    if model_type == "gpt_oss":  # biases, [E, H, 2I] weights, interleaved gate/up, clamped SwiGLU (presets.py)
        gate = clamped_swiglu(
            float(config.get("swiglu_alpha", GPT_OSS_ALPHA)), float(config.get("swiglu_limit", GPT_OSS_LIMIT))
        )
        problem = replace(problem, has_bias=True, is_transposed=True, interleaved=True, gate=gate)
    quant = config.get("quantization_config")
    if isinstance(quant, Mapping):
        method = str(quant.get("quant_method", "")).lower()
        if method == "fp8":
            scale = "ue8m0" if quant.get("scale_fmt") == "ue8m0" else "float32"
            problem = replace(problem, weight_format="fp8_block", scale_format=scale)
        else:
            notes.append(
                f"quantization_config.quant_method {method!r} is not one selector runs: timing the dense "
                "layer (--format chooses another)"
            )
    name = str(config.get("_name_or_path") or model_type)
    return TuneTarget(name, problem, tuple(notes))


def read_config(path: str | Path) -> TuneTarget:
    """A config.json file, or a model directory holding one (TuneInputError naming the fault otherwise)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no config.json" if path.is_dir() else f"{path} does not exist"
        raise TuneInputError(f"{where}: give a Transformers config.json or the model directory holding one")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TuneInputError(
            f"{file} is not readable JSON ({type(exc).__name__}: {exc}): give a Transformers config.json"
        ) from None
    if not isinstance(config, Mapping):
        raise TuneInputError(f"{file} holds a JSON {type(config).__name__}, not a config object")
    target = problem_from_config(config, str(file))
    if config.get("_name_or_path"):
        return target
    folder = path.name if path.is_dir() else file.parent.name  # a model directory names the model
    return replace(target, name=folder or target.name)


def preset_targets(names: Iterable[str]) -> list[TuneTarget]:
    """Presets by name; `grid` is the perf grid's five shapes."""
    from selector.presets import PRESETS

    out: list[TuneTarget] = []
    for name in names:
        for one in GRID if name.lower() == "grid" else (name.lower(),):
            if one not in PRESETS:
                raise TuneInputError(f"unknown preset {name!r}: known are grid, {', '.join(PRESETS)}")
            out.append(TuneTarget(one, PRESETS[one]))
    return out


def flag_target(experts: int, hidden: int, intermediate: int, top_k: int) -> TuneTarget:
    for flag, value in (("--experts", experts), ("--hidden", hidden), ("--intermediate", intermediate), ("--top-k", top_k)):
        if value < 1:
            raise TuneInputError(f"{flag} must be at least 1, got {value}")
    if top_k > experts:
        raise TuneInputError(f"--top-k {top_k} is more than the {experts} experts (--experts)")
    problem = Problem(num_experts=experts, hidden_size=hidden, intermediate_size=intermediate, top_k=top_k)
    return TuneTarget(f"E{experts}-H{hidden}-I{intermediate}-k{top_k}", problem)


def with_overrides(target: TuneTarget, dtype: str | None, fmt: str | None, device: str) -> TuneTarget:
    """The target on `device`, with --dtype and --format applied where given."""
    problem = replace(target.problem, device=device)
    if dtype is not None:
        problem = replace(problem, dtype=dtype)
    if fmt is not None:
        if fmt not in FORMATS:
            raise TuneInputError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
        weight_format, scale_format = FORMATS[fmt]
        problem = replace(problem, weight_format=weight_format, scale_format=scale_format)
    return replace(target, problem=problem)


def token_counts(tokens: Iterable[int] | None, batch_sizes: Iterable[int] = ()) -> list[int]:
    """The token counts to measure, ascending: `tokens` (default every power of two 1..16384) and the model's
    own batch sizes."""
    counts = set(DEFAULT_TOKENS if tokens is None else tokens) | set(batch_sizes)
    bad = sorted(t for t in counts if t < 1)
    if bad:
        raise TuneInputError(f"token counts must be at least 1, got {bad[0]}")
    return sorted(counts)
