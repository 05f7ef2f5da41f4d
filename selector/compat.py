"""Which versions of two packages work together: pure functions of the probes' package facts, no torch.

Transformers loads hub kernels (its ``kernels-community`` experts backends) through the ``kernels`` package and
pins the range it accepts; outside that range its hub backends fail with "requires the kernels package" even
though ``kernels`` is installed. The pins below are read off Transformers' own requirement of ``kernels`` for
each release; a release not listed is not judged (no guess at a pin nobody checked).
"""

from __future__ import annotations

from typing import Protocol

from selector.probes import PackageFacts
from selector.requirements import version_tuple

# (first, last) Transformers minor releases -> kernels range (min inclusive, max exclusive).
KERNELS_PINS: tuple[tuple[tuple[int, int], tuple[int, int], str, str], ...] = (
    ((5, 25), (5, 25), "0.19.1", "0.20"),
    ((5, 23), (5, 24), "0.18.2", "0.19"),
    ((5, 20), (5, 22), "0.17.2", "0.18"),
    ((5, 18), (5, 19), "0.17", "0.18"),
    ((5, 15), (5, 17), "0.16", "0.17"),
    ((5, 14), (5, 14), "0.15.2", "0.16"),
)


class _HasPackages(Protocol):
    def package(self, name: str) -> PackageFacts | None: ...


def kernels_for_transformers(transformers_version: str) -> tuple[str, str] | None:
    """The `kernels` range, (min inclusive, max exclusive), that a Transformers release loads hub kernels with.

    '5.23.1' -> ('0.18.2', '0.19'); None for a release whose pin is not known here.
    """
    parts = version_tuple(transformers_version)
    if len(parts) < 2:
        return None
    minor = (parts[0], parts[1])
    for first, last, low, high in KERNELS_PINS:
        if first <= minor <= last:
            return low, high
    return None


def hub_kernels_verdict(env: _HasPackages) -> str | None:
    """One line (problem and fix) when the installed transformers/kernels pair will not load hub kernels; else None.

    None also when either package is missing (a missing package is reported by the backends that need it) or
    when the Transformers release's pin is not known.
    """
    tf, kn = env.package("transformers"), env.package("kernels")
    if tf is None or kn is None or tf.version is None or kn.version is None:
        return None
    pin = kernels_for_transformers(tf.version)
    if pin is None:
        return None
    low, high = pin
    have = version_tuple(kn.version)
    if version_tuple(low) <= have < version_tuple(high):
        return None
    return (
        f"transformers {tf.version} loads hub kernels only with kernels>={low},<{high}, but kernels {kn.version} "
        f"is installed (its hub backends fail with \"requires the kernels package\"); "
        f"fix: pip install 'kernels>={low},<{high}'"
    )


__all__ = ["KERNELS_PINS", "hub_kernels_verdict", "kernels_for_transformers"]
