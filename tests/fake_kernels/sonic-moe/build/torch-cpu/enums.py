"""FAKE sonicmoe.enums: the activation names of sonic-moe 0.1.2.post1."""

from enum import Enum


class ActivationType(Enum):
    SWIGLU = "swiglu"
    GEGLU = "geglu"
    REGLU = "reglu"

    RELU_SQ = "relu_sq"
    RELU = "relu"
    GELU = "gelu"
    SILU = "silu"


def is_glu(activation_type: ActivationType) -> bool:
    return activation_type in (ActivationType.SWIGLU, ActivationType.REGLU, ActivationType.GEGLU)
