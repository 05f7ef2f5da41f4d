"""selector.weight_cache: derived weights built once per set of source tensors, rebuilt when one changes."""

import copy

import torch

from selector.weight_cache import DerivedWeights, fingerprint


def _counting(value):
    calls = []

    def build():
        calls.append(1)
        return value()

    return build, calls


def test_built_once_then_rebuilt_after_an_in_place_change_or_a_new_tensor() -> None:
    module = torch.nn.Linear(4, 4)
    cache: DerivedWeights = DerivedWeights()
    build, calls = _counting(lambda: module.weight.detach().t().contiguous())
    first = cache.get(module, fingerprint((module.weight,)), build)
    assert cache.get(module, fingerprint((module.weight,)), build) is first and len(calls) == 1
    with torch.no_grad():
        module.weight.add_(1.0)  # same storage, new version
    second = cache.get(module, fingerprint((module.weight,)), build)
    assert len(calls) == 2 and torch.equal(second, module.weight.detach().t())
    module.weight = torch.nn.Parameter(torch.zeros(4, 4))
    assert torch.equal(cache.get(module, fingerprint((module.weight,)), build), torch.zeros(4, 4))
    assert len(calls) == 3


def test_not_cached_builds_every_call_and_keep_can_refuse_a_value() -> None:
    module = torch.nn.Linear(2, 2)
    cache: DerivedWeights = DerivedWeights()
    build, calls = _counting(lambda: module.weight)
    key = fingerprint((module.weight, None))
    cache.get(module, key, build, cache=False)
    cache.get(module, key, build, cache=False)
    assert len(calls) == 2 and cache.kept(module) is None
    cache.get(module, key, build, keep=lambda value: value is not module.weight)  # a view: not worth keeping
    assert cache.kept(module) is None and len(calls) == 3


def test_a_deep_copy_starts_empty() -> None:
    module = torch.nn.Linear(2, 2)
    cache: DerivedWeights = DerivedWeights()
    cache.get(module, fingerprint((module.weight,)), lambda: module.weight.detach().clone())
    assert cache.kept(copy.deepcopy(module)) is None and cache.kept(module) is not None
