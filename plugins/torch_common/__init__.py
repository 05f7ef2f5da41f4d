"""What the torch backends (`eager`, `batched_mm`, `grouped_mm`) share.

- this package: the fields of their declarations that plain torch ops earn; importing it imports no torch (the
  declarations are built without it);
- ``routing``: the routing guard their forwards run first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from selector.types import COMPILE_MODES, GRAD_INPUTS

# BackendSpec(**TRACEABLE, ...): plain torch ops (and custom ops) without host syncs: autograd differentiates all
# of it, and torch.compile traces it whole in every mode
TRACEABLE: Mapping[str, Any] = {
    "differentiable": frozenset(GRAD_INPUTS),
    "compile_modes": frozenset(COMPILE_MODES),
    "fullgraph": True,
}
