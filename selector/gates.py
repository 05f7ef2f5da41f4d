"""The gate vocabulary: the gated activations a fused kernel can run as data instead of calling Python.

A gated experts layer computes ``gate(gate_up_out)`` between its two projections. Most layers use
``act_mul``: ``act(gate) * up`` with the module's activation (silu, gelu, gelu_tanh, relu, named by
`Problem.activation`). GPT-OSS uses ``clamped_swiglu``:

    g = min(gate, limit);  u = clamp(up, -limit, limit);  out = (u + 1) * g * sigmoid(alpha * g)

Both come with their parameters, so a kernel that declares a gate (`Requirements.gates`) runs it with the layer's
own values. A gate function the selector does not recognise stays Python (`Problem.custom_gate`): only backends
that call the module's `_apply_gate` run it.

Pure data: no torch, so the selection floor can read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ACT_MUL = "act_mul"
CLAMPED_SWIGLU = "clamped_swiglu"
GATE_NAMES = (ACT_MUL, CLAMPED_SWIGLU)
# GPT-OSS's values (transformers' GptOssExperts: alpha 1.702, limit from config.swiglu_limit, 7.0 by default)
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class Gate:
    """A named gate and its parameters: ``Gate()`` is act(gate) * up, ``Gate("clamped_swiglu", alpha=1.702,
    limit=7.0)`` GPT-OSS's. ValueError for an unknown name or parameters the gate does not take.

    As a layer's gate (`Problem.gate`) it also says the activation (act_mul's act; a gate other than act_mul
    names itself there) and whether the module's `_apply_gate` is a function the selector does not recognise
    (`custom`, with that function's name in `source` for the reasons): then only torch code runs it and `name`
    stays act_mul. `label()` names the gate and its parameters only, and equality compares those alone (`name`,
    `alpha`, `limit`): the layer's activation and custom gate count in `Problem`'s equality instead.
    """

    name: str = ACT_MUL
    alpha: float | None = None
    limit: float | None = None
    # a layer's facts about the gate, not its identity: two gates are equal (and hash alike) when they name the
    # same gate with the same parameters, what a kernel runs; Problem compares these too
    activation: str = field(default="silu", compare=False)
    # an _apply_gate that is not a gate of this module: only torch code runs it
    custom: bool = field(default=False, compare=False)
    source: str = field(default="", compare=False)  # a custom gate's function (e.g. "MyExperts._apply_gate")

    def __post_init__(self) -> None:
        if self.name not in GATE_NAMES:
            raise ValueError(f"unknown gate {self.name!r}; known gates: {', '.join(GATE_NAMES)}")
        if self.name != ACT_MUL:  # a gate other than act_mul is the whole function: it names the activation
            object.__setattr__(self, "activation", self.name)
        if self.name == ACT_MUL:
            if self.alpha is not None or self.limit is not None:
                raise ValueError("gate 'act_mul' takes no parameters (its activation is the module's act_fn)")
            return
        for what in ("alpha", "limit"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"gate {self.name!r} needs a finite number {what}=, got {value!r}")
            object.__setattr__(self, what, float(value))
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"gate {self.name!r} needs limit > 0, got {self.limit}")

    @property
    def is_default(self) -> bool:
        """act(gate) * up: what every gated backend runs."""
        return self.name == ACT_MUL

    def describe(self) -> str:
        """The activation for act_mul, else the gate with its parameters: what a one-line summary shows."""
        return self.activation if self.is_default else self.label()

    def label(self) -> str:
        """Stable text naming the gate and its parameters, e.g. ``clamped_swiglu(alpha=1.702,limit=7)``."""
        if self.is_default:
            return self.name
        return f"{self.name}(alpha={self.alpha:g},limit={self.limit:g})"

    def __str__(self) -> str:
        return self.label()


DEFAULT_GATE = Gate()


def clamped_swiglu(alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT) -> Gate:
    """GPT-OSS's clamped SwiGLU with these parameters."""
    return Gate(CLAMPED_SWIGLU, alpha=alpha, limit=limit)


__all__ = ["ACT_MUL", "CLAMPED_SWIGLU", "DEFAULT_GATE", "GATE_NAMES", "GPT_OSS_ALPHA", "GPT_OSS_LIMIT", "Gate",
           "clamped_swiglu"]
