"""Loaders: Transformers' from_pretrained / from_config with selector's experts implementation, and a
CompileConfig for generate()'s compiled decode step."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from selector import settings
from selector.hf.names import AUTO
from selector.hf.registration import register_with_transformers
from selector.hf.report import log_selection
from selector.hf.requests import validate_request
from selector.hf.version import check_transformers

_log = logging.getLogger("selector")
_HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "revision",
    "subfolder",
    "trust_remote_code",
    "proxies",
)


def from_pretrained(
    model_class: Any,
    pretrained_model_name_or_path: Any,
    *model_args: Any,
    experts_implementation: str | Mapping[str, str] = AUTO,
    **kwargs: Any,
) -> Any:
    """`model_class.from_pretrained(...)` with `experts_implementation="auto"` (or a name, or a dict per sub-config).

    Checks names and sub-config keys before loading, logs the choice, returns the model.
    `selection_report(model)` shows the choice per sub-config and why the other backends were not taken.
    """
    register_with_transformers()
    if not isinstance(experts_implementation, str):
        config = kwargs.get("config")
        if config is None or isinstance(config, (str, bytes)) or not hasattr(config, "sub_configs"):
            from transformers import AutoConfig

            hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
            config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path, **hub)
        validate_request(config, experts_implementation)
        experts_implementation = dict(experts_implementation)
    else:
        validate_request(None, experts_implementation)
    model = model_class.from_pretrained(
        pretrained_model_name_or_path, *model_args, experts_implementation=experts_implementation, **kwargs
    )
    log_selection(model)
    tune_on_load(model)
    return model


def from_config(
    model_class: Any,
    config: Any,
    experts_implementation: str | Mapping[str, str] = AUTO,
    **kwargs: Any,
) -> Any:
    """`model_class.from_config(config, ...)` with selector's experts implementation (randomly initialised)."""
    register_with_transformers()
    validate_request(config, experts_implementation)
    request = experts_implementation if isinstance(experts_implementation, str) else dict(experts_implementation)
    # Auto classes have from_config; a concrete model class has _from_config (the same path, no hub access)
    build = getattr(model_class, "from_config", None) or model_class._from_config
    model = build(config, experts_implementation=request, **kwargs)
    log_selection(model)
    tune_on_load(model)
    return model


def tune_on_load(model: Any) -> None:
    """`selector.tune_model(model, budget_s=SELECTOR_TUNE_ON_LOAD)` where that is set and the model is on a CUDA GPU;
    a model on another device is left alone, and a tuning that cannot run is logged, never raised: loading works."""
    budget = float(settings.get("SELECTOR_TUNE_ON_LOAD") or 0.0)
    if budget <= 0:
        return
    from selector.tune.model import tune_model
    from selector.tune.runner import TuneUnavailable

    try:
        done = tune_model(model, budget_s=budget)
    except TuneUnavailable as exc:
        _log.warning("selector: SELECTOR_TUNE_ON_LOAD: not tuned: %s", exc)
        return
    if done.tuned:
        _log.info("selector: tuned %d experts shape(s) in %.1f s", len(done.tuned), done.seconds)


def compile_config(
    mode: str = "reduce-overhead",
    *,
    fullgraph: bool = True,
    skip_module_guards: bool = False,
    backend: str = "inductor",
) -> Any:
    """A Transformers CompileConfig for generate()'s compiled decode step (pass it as `compile_config=`).

    skip_module_guards: Dynamo stops guarding the attributes of torch's own nn modules
    (torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe), which the compiled step otherwise checks on every
    call. On an H200, Qwen1.5-MoE-A2.7B at batch 1 with "auto": 5.30 -> 4.48 ms/token (benchmarks/README.md).
    Only for a model whose modules stay as they are between calls: a changed attribute is no longer noticed.
    torch.compile takes a mode or options, not both, so with the filter the mode goes in as its Inductor options.
    """
    check_transformers()
    from transformers import CompileConfig

    if not skip_module_guards:
        return CompileConfig(backend=backend, mode=mode, fullgraph=fullgraph)
    guard_filter = getattr(torch.compiler, "skip_guard_on_inbuilt_nn_modules_unsafe", None)
    if guard_filter is None:
        raise ImportError(f"skip_module_guards needs torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe "
                          f"(torch >= 2.7); this is torch {torch.__version__}")  # fmt: skip
    options: dict[str, Any] = {}
    if backend == "inductor":
        from torch._inductor import list_mode_options

        options.update(list_mode_options(mode or "default"))
    options["guard_filter_fn"] = guard_filter
    return CompileConfig(backend=backend, mode=None, options=options, fullgraph=fullgraph)
