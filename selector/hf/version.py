"""The Transformers release this integration needs, checked before anything registers or loads."""

from __future__ import annotations

from typing import Any

MIN_TRANSFORMERS = "5.14"  # first release whose validation reads the experts interface and that has
# get_experts_implementation / per-sub-config set_experts_implementation


def _transformers_error(found: str) -> ImportError:
    return ImportError(
        f"selector's Transformers integration needs transformers>={MIN_TRANSFORMERS} (the experts interface "
        "`transformers.integrations.moe.ExpertsInterface` that validates registered names, and "
        "`PreTrainedModel.get_experts_implementation` / per-sub-config `set_experts_implementation`); "
        f"found: {found}. fix: pip install -U 'transformers>={MIN_TRANSFORMERS}' "
        "(or: pip install 'selector[transformers]')."
    )


def check_transformers() -> Any:
    """The `transformers.integrations.moe` module, or ImportError naming the version this integration needs."""
    try:
        import transformers
    except ImportError:
        raise _transformers_error("transformers is not installed") from None
    version = getattr(transformers, "__version__", "?")
    where = f"transformers {version} at {getattr(transformers, '__file__', '?')}"
    try:
        from transformers.integrations import moe
        from transformers.modeling_utils import PreTrainedModel
    except ImportError as exc:
        raise _transformers_error(f"{where} ({exc})") from None
    needed = {
        "integrations.moe.ExpertsInterface": hasattr(moe, "ExpertsInterface"),
        "integrations.moe.ALL_EXPERTS_FUNCTIONS": hasattr(moe, "ALL_EXPERTS_FUNCTIONS"),
        "PreTrainedModel.get_experts_implementation": hasattr(PreTrainedModel, "get_experts_implementation"),
        "PreTrainedModel.set_experts_implementation": hasattr(PreTrainedModel, "set_experts_implementation"),
    }
    missing = [name for name, ok in needed.items() if not ok]
    if missing:
        raise _transformers_error(f"{where}, which lacks {', '.join(missing)}")
    return moe
