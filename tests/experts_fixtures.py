"""Test helpers, from the package's own testing module (what plugin authors use too)."""

from selector.testing import (  # noqa: F401
    TOLERANCE,
    Layout,
    clamped_swiglu,
    make_experts,
    random_routing,
    reference_experts,
    relative_error,
)
