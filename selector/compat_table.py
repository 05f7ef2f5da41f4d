"""The torch.compile / CUDA-graph / autograd compatibility table, rendered from what each backend declares.

README's table is this module's output for the built-in backends (`python -m selector.compat_table`), so the
documentation cannot drift from the declarations the ranking enforces.
"""

from __future__ import annotations

from collections.abc import Iterable

from selector.types import COMPILE_MODES, GRAD_INPUTS, BackendSpec

YES, NO = "yes", "no"


def autograd_cell(spec: BackendSpec) -> str:
    """The inputs the backend's backward differentiates, or "no backward"."""
    if spec.differentiable is None:
        return "undeclared"
    if not spec.differentiable:
        return "no backward"
    names = ", ".join(name for name in GRAD_INPUTS if name in spec.differentiable)
    quantised = spec.requirements.weight_formats - spec.grad_weight_formats
    return names + (f" ({', '.join(sorted(spec.grad_weight_formats))} weights)" if quantised else "")


def compat_row(spec: BackendSpec) -> str:
    """One markdown row: the backend, each torch.compile mode, fullgraph, CUDA-graph capture, autograd."""
    modes = spec.supported_compile_modes()
    cells = [f"`{spec.name}`", *(YES if m in modes else NO for m in COMPILE_MODES)]
    cells += [YES if spec.calls.traces_fullgraph() else NO, YES if spec.calls.cuda_graphs else NO, autograd_cell(spec)]
    return "| " + " | ".join(cells) + " |"


def markdown_table(specs: Iterable[BackendSpec]) -> str:
    """The compatibility table of `specs`, by backend name."""
    header = ["backend", *(f"compile `{m}`" for m in COMPILE_MODES), "`fullgraph=True`", "CUDA graph", "autograd"]
    rows = [compat_row(s) for s in sorted(specs, key=lambda s: s.name)]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows])


def builtin_table() -> str:
    """The table of the backends shipped with selector (what README shows)."""
    from selector.registry import get_registry

    registry = get_registry()
    return markdown_table(s for n, s in registry.specs.items() if registry.providers.get(n) in registry.builtins)


if __name__ == "__main__":
    print(builtin_table())
