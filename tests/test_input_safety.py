"""Inputs the CPU backends must refuse or run right: id dtypes, NaN/inf routing weights."""

from __future__ import annotations

import pytest
import torch
from experts_fixtures import make_experts, random_routing, reference_experts, relative_error

import selector
from selector.dispatch import reset_selection_caches
from selector.errors import ExpertsInputError

CPU_BACKENDS = ("batched_mm", "grouped_mm", "eager")


@pytest.fixture(autouse=True)
def fresh_caches():
    torch.manual_seed(0)
    reset_selection_caches()
    yield
    reset_selection_caches()


def _layer(backend: str, experts: int = 8):
    module = make_experts(experts, 32, 16, seed=0)
    selector.set_experts_implementation(module, backend)
    return module


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int32_and_int64_ids_give_the_right_output(backend: str, dtype: torch.dtype) -> None:
    module = _layer(backend)
    x = torch.randn(5, 32)
    idx, w = random_routing(5, 8, 2)
    out = module(x, idx.to(dtype), w)
    assert relative_error(out, reference_experts(module, x, idx, w)) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "dtype, why",
    [
        (torch.uint8, "as a mask"),
        (torch.bool, "as a mask"),
        (torch.int8, "only for int32 and int64"),
        (torch.int16, "only for int32 and int64"),
        (torch.float32, "expert ids are integers"),
        (torch.bfloat16, "expert ids are integers"),
    ],
)
def test_other_id_dtypes_are_refused_with_the_fix(backend: str, dtype: torch.dtype, why: str) -> None:
    module = _layer(backend)
    # As many ids as experts: the length at which torch would read a uint8 tensor as a mask over the experts, silently wrong.
    x = torch.randn(4, 32)
    idx, w = random_routing(4, 8, 2)
    with pytest.raises(ExpertsInputError) as info:
        module(x, idx.to(dtype), w)
    message = str(info.value)
    assert f"got {dtype}" in message and why in message
    assert "top_k_index must be an integer tensor of int64 or int32" in message and "fix: pass top_k_index.long()" in message


@pytest.mark.parametrize("level", ["full", "shapes"])
def test_id_dtype_is_checked_at_the_shapes_level_too(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELECTOR_VALIDATE", level)
    module = _layer("batched_mm")
    x = torch.randn(4, 32)
    idx, w = random_routing(4, 8, 2)
    with pytest.raises(ExpertsInputError, match="got torch.uint8"):
        module(x, idx.to(torch.uint8), w)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_routing_weights_raise_on_the_cpu(backend: str, bad: float) -> None:
    module = _layer(backend)
    x = torch.randn(5, 32)
    idx, w = random_routing(5, 8, 2)
    w = w.clone()
    w[3, 1] = bad
    with pytest.raises(ExpertsInputError, match=r"top_k_weights holds 1 NaN or infinite value\(s\)"):
        module(x, idx, w)
