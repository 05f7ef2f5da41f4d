"""Quantised experts (Transformers' FP8Experts: fp8 block-scaled or fp4 weights) through selector.

An FP8Experts module is adopted once (marked with the selector_* attributes the ranking reads). "auto" then
takes a selector backend for its format where one exists, else Transformers' own FP8 function: grouped_mm,
and batched_mm for the decode steps on an accelerator (Transformers' own decode-phase rule).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from selector import dispatch, layers
from selector.costmodel import TYPICAL_TOKENS
from selector.hf.decode import in_decode_phase, on_accelerator
from selector.hf.names import TRANSFORMERS_FALLBACK

logger = logging.getLogger("selector.hf")

# (problem, token bucket, decode swap?) -> the backend, or TRANSFORMERS_FALLBACK + Transformers' function
_QUANT_PLANS: dict[tuple[Any, ...], str] = {}


def is_quantized(module: torch.nn.Module) -> bool:
    """Experts with one-byte weights (Transformers' FP8Experts: fp8, or fp4 packed in int8)."""
    return layers.up_weight(module).element_size() == 1


def adopt_quantized(module: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """Mark an FP8Experts module with the selector_* attributes the ranking reads (once)."""
    # getattr, not a look into module.__dict__: this also runs while torch.compile traces, and Dynamo
    # (torch 2.11) cannot trace calls on a module's __dict__
    if getattr(module, "selector_weight_format", None) is not None:
        return
    try:
        from selector.quant import adopt_transformers_experts

        adopt_transformers_experts(module, compute_dtype=compute_dtype)
        return
    except (ImportError, ValueError) as exc:  # no quantisation module, or a format selector does not describe
        logger.debug("selector: %s: weight format described by dtype only (%s)", type(module).__name__, exc)
    weight = layers.up_weight(module)
    module.selector_weight_format = "fp4" if weight.dtype in (torch.int8, torch.uint8) else "fp8_block"
    dispatch.forget_module(module)  # what the core cached of these weights was read before the format was known


def quantized_plan(module: torch.nn.Module, num_tokens: int, top_k: int, decoding: bool) -> str:
    """A selector backend for this quantised layer, or Transformers' own FP8 function where none takes it.

    The fallback is what Transformers itself runs: grouped_mm, and batched_mm for the decode steps on an
    accelerator (its own decode-phase rule)."""
    problem = dispatch.problem_of(module, top_k)
    bucket = dispatch.token_bucket(num_tokens)
    swap = decoding and on_accelerator(layers.up_weight(module).device)
    key = (problem, bucket, swap)
    plan = _QUANT_PLANS.get(key)
    if plan is None:
        best = dispatch.explain_module(module, num_tokens=bucket, top_k=top_k).best
        if best is None:
            best = TRANSFORMERS_FALLBACK + ("batched_mm" if swap else "grouped_mm")
        plan = _QUANT_PLANS[key] = best
    return plan


@torch.compiler.assume_constant_result
def _quantized_plan_constant(uid: str, top_k: int) -> str:
    # only constants cross into a function dynamo runs eagerly: the module goes by its tracked id. The decode
    # flag is read here, not in the traced caller: Dynamo cannot trace ContextVar.get (a graph break per layer).
    return quantized_plan(dispatch.tracked_module(uid), TYPICAL_TOKENS, top_k, in_decode_phase())


def quantized_auto(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    """The "auto" forward of a quantised layer: its plan's selector backend, or Transformers' own FP8 function."""
    num_tokens, top_k = hidden_states.shape[0], top_k_index.shape[1]
    if torch.compiler.is_compiling():
        uid = dispatch.tracked_id(module)  # a getattr: traceable
        if uid is None:
            raise RuntimeError(
                "selector cannot choose a backend inside torch.compile for an experts module it has not seen: "
                "call the model once before compiling, or selector.set_experts_implementation(model, ...)"
            )
        plan = _quantized_plan_constant(uid, dispatch.traced_top_k(module))
    else:
        dispatch.track(module)
        plan = quantized_plan(module, num_tokens, top_k, in_decode_phase())
    if plan.startswith(TRANSFORMERS_FALLBACK):
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

        if not torch.compiler.is_compiling():
            dispatch.note_backend(module, plan)
        fn = FP8ExpertsInterface._global_mapping[plan[len(TRANSFORMERS_FALLBACK) :]]
        return fn(module, hidden_states, top_k_index, top_k_weights)
    return dispatch.run_experts(module, hidden_states, top_k_index, top_k_weights, implementation=plan)
