"""Tensors a backend derives from an experts module's parameters (its kernel's layout, a dtype copy), built once
and kept beside the module until a source tensor changes."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def fingerprint(tensors: Sequence[torch.Tensor | None]) -> tuple:
    """What tells a tensor's values apart without reading them: storage, in-place version, shape, strides, dtype."""
    return tuple(
        None if t is None else (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors
    )


class DerivedWeights(Generic[T]):
    """One derived value per module, in a weak map: it dies with the module, and a deep copy starts empty."""

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Hashable, T]] = weakref.WeakKeyDictionary()

    def kept(self, module: torch.nn.Module) -> T | None:
        """The value kept for `module`, if any (whatever key it was built for)."""
        entry = self._entries.get(module)
        return None if entry is None else entry[1]

    def get(
        self,
        module: torch.nn.Module,
        key: Hashable,
        build: Callable[[], T],
        cache: bool = True,
        keep: Callable[[T], bool] | None = None,
    ) -> T:
        """The value built for `key` (a `fingerprint` of its sources plus the layout it depends on), built anew
        when the key changed. `cache` False (e.g. the sources need a gradient, which a kept copy would cut):
        built every call, nothing read or kept; `keep`: whether a built value is worth keeping (a view is not)."""
        if cache:
            entry = self._entries.get(module)
            if entry is not None and entry[0] == key:
                return entry[1]
        value = build()
        if cache and (keep is None or keep(value)):
            self._entries[module] = (key, value)
        return value
