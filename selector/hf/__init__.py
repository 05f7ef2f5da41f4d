"""Hugging Face Transformers drop-in: selector's backends and "auto" as Transformers experts implementations.

    import selector
    model = selector.from_pretrained(AutoModelForCausalLM, "Qwen/Qwen1.5-MoE-A2.7B", dtype=torch.bfloat16)
    print(selector.hf.selection_report(model))      # per sub-config: the choice, and why not the others

or, with Transformers' own loader once `selector.hf` is imported (importing it registers the names):

    AutoModelForCausalLM.from_pretrained(name, experts_implementation="auto")
    model.set_experts_implementation({"text_config": "selector:grouped_mm", "vision_config": "eager"})

One job per module, each importing only those above it:
- `version`: the Transformers release this needs (`check_transformers`).
- `names`: the names given and read in Transformers' experts interfaces ("auto", "selector:<backend>", ...).
- `modules`: the experts modules of a model and the sub-config each belongs to.
- `decode`: the decode phase of `generate()` (selector's grouped_mm runs as batched_mm on accelerators).
- `quantized`: Transformers' FP8Experts modules, and "auto"'s fallback to Transformers' own FP8 functions.
- `registration`: the functions registered into Transformers' experts interfaces.
- `requests`: the names accepted, checking a request, set / get per sub-config.
- `report`: what each sub-config runs here, and why not the other backends.
- `loaders`: from_pretrained / from_config, and a CompileConfig for the compiled decode step.
"""

from __future__ import annotations

import logging

from selector.hf.decode import decode_phase, decode_request, set_accelerator_check
from selector.hf.loaders import compile_config, from_config, from_pretrained
from selector.hf.modules import experts_modules, is_transformers_experts, sub_config_keys
from selector.hf.names import AUTO, DECODE_SWAPS, EAGER, PREFIX, TRANSFORMERS_FALLBACK
from selector.hf.quantized import is_quantized
from selector.hf.registration import register_on_import, register_with_transformers, transformers_names
from selector.hf.report import REPORT_TOKENS, ScopeSelection, SelectionReport, log_selection, selection_report
from selector.hf.requests import (
    accepted_names,
    get_experts_implementation,
    set_experts_implementation,
    validate_request,
)
from selector.hf.version import MIN_TRANSFORMERS, check_transformers

logger = logging.getLogger("selector.hf")  # every module of the package logs here

register_on_import()

__all__ = [
    "AUTO",
    "DECODE_SWAPS",
    "EAGER",
    "MIN_TRANSFORMERS",
    "PREFIX",
    "REPORT_TOKENS",
    "TRANSFORMERS_FALLBACK",
    "ScopeSelection",
    "SelectionReport",
    "accepted_names",
    "check_transformers",
    "compile_config",
    "decode_phase",
    "decode_request",
    "experts_modules",
    "from_config",
    "from_pretrained",
    "get_experts_implementation",
    "is_quantized",
    "is_transformers_experts",
    "log_selection",
    "register_with_transformers",
    "selection_report",
    "set_accelerator_check",
    "set_experts_implementation",
    "sub_config_keys",
    "transformers_names",
    "validate_request",
]
