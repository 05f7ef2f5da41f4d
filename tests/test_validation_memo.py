"""validate_inputs' memo of checked call signatures: a signature that passed is not checked again, anything that
changes what the checks would say (shape, dtype, device, sizes, level) is checked afresh, and values are checked
once per signature at level "first" (every call at "full"), never remembered while they could not be read."""

from __future__ import annotations

import pytest
import torch

from selector import validation
from selector.errors import ExpertsInputError
from selector.validation import validate_inputs

E, H = 4, 8


def _inputs(tokens: int = 3, k: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(tokens, H), torch.randint(0, E, (tokens, k)), torch.rand(tokens, k)


def _count_value_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = validation._check_values
    monkeypatch.setattr(validation, "_check_values", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize(("level", "checks", "remembered"), [("first", 1, 1), ("full", 3, 0)])
def test_values_are_checked_once_per_signature_at_first_and_on_every_call_at_full(
    level: str, checks: int, remembered: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_value_checks(monkeypatch)
    seen: set = set()
    x, ids, w = _inputs()
    for _ in range(3):
        validate_inputs(x, ids, w, E, H, level=level, seen=seen)
    assert len(calls) == checks and len(seen) == remembered


def test_another_signature_is_checked_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_value_checks(monkeypatch)
    seen: set = set()
    x, ids, w = _inputs()
    validate_inputs(x, ids, w, E, H, level="first", seen=seen)
    validate_inputs(x[:2], ids[:2], w[:2], E, H, level="first", seen=seen)  # another token count
    validate_inputs(x.double(), ids, w, E, H, level="first", seen=seen)  # another dtype
    validate_inputs(x, ids.int(), w, E, H, level="first", seen=seen)
    validate_inputs(x, ids, w, E + 1, H, level="first", seen=seen)  # another layer size
    assert len(calls) == 5 and len(seen) == 5


def test_a_remembered_signature_at_shapes_does_not_count_for_first(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_value_checks(monkeypatch)
    seen: set = set()
    x, ids, w = _inputs()
    validate_inputs(x, ids, w, E, H, level="shapes", seen=seen)
    assert calls == [] and len(seen) == 1
    validate_inputs(x, ids, w, E, H, level="first", seen=seen)
    assert calls == [1]


def test_bad_values_raise_on_every_call_of_their_signature() -> None:
    seen: set = set()
    x, ids, w = _inputs()
    ids[0, 0] = E  # out of range
    for _ in range(2):
        with pytest.raises(ExpertsInputError, match="expert ids must lie in"):
            validate_inputs(x, ids, w, E, H, level="first", seen=seen)
    assert not seen


def test_values_unreadable_while_capturing_are_checked_by_the_next_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_value_checks(monkeypatch)
    seen: set = set()
    x, ids, w = _inputs()
    monkeypatch.setattr(validation, "_capturing", lambda t: True)
    validate_inputs(x, ids, w, E, H, level="first", seen=seen)
    assert calls == [] and not seen
    monkeypatch.setattr(validation, "_capturing", lambda t: False)
    validate_inputs(x, ids, w, E, H, level="first", seen=seen)
    assert calls == [1] and len(seen) == 1


def test_a_shape_error_is_raised_again_and_never_remembered() -> None:
    seen: set = set()
    x, ids, w = _inputs()
    for _ in range(2):
        with pytest.raises(ExpertsInputError, match="must have the shape of top_k_index"):
            validate_inputs(x, ids, w[:, :1], E, H, level="first", seen=seen)
    assert not seen


def test_the_memo_stays_bounded() -> None:
    seen: set = set()
    for tokens in range(1, 300):
        validate_inputs(*_inputs(tokens), E, H, level="shapes", seen=seen)
    assert 0 < len(seen) <= 256
