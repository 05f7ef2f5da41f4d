"""The selection report: per sub-config, what was asked, what runs on this machine, and why not the others."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from selector import dispatch
from selector.hf.modules import experts_modules
from selector.hf.names import AUTO, PREFIX, TRANSFORMERS_FALLBACK
from selector.hf.quantized import adopt_quantized, is_quantized, quantized_plan
from selector.hf.registration import register_with_transformers
from selector.types import Availability, Problem, Ranking

logger = logging.getLogger("selector.hf")

# token counts shown in reports for "auto": a decode step, small batches, a prefill
REPORT_TOKENS: tuple[int, ...] = (1, 16, 256, 4096)


@dataclass(frozen=True)
class ScopeSelection:
    """What runs the experts layers of one sub-config (one entry per distinct layer shape)."""

    scope: str  # "" for the model's own config, else the sub-config key
    requested: str | None  # the name the config holds
    runs: str  # "selector" or "transformers"
    modules: tuple[str, ...]
    problem: Problem | None
    chosen: str | None  # the backend for a typical token count ("auto"), or the named one
    by_tokens: Mapping[int, str | None] = field(default_factory=dict)  # "auto": the pick per token count
    ranking: Ranking | None = None
    error: str | None = None  # an explicit backend that cannot run here: what the first forward raises
    # Transformers' own name that selector also has: how to ask for selector's, and why it cannot run here if not
    hint: str | None = None

    @property
    def excluded(self) -> Mapping[str, Availability]:
        return self.ranking.excluded if self.ranking is not None else {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "requested": self.requested,
            "runs": self.runs,
            "modules": list(self.modules),
            "problem": self.problem.to_dict() if self.problem else None,
            "chosen": self.chosen,
            "by_tokens": {str(k): v for k, v in self.by_tokens.items()},
            "ranking": self.ranking.to_dict() if self.ranking else None,
            "error": self.error,
            "hint": self.hint,
        }

    def lines(self) -> list[str]:
        scope = self.scope or "(model)"
        shape = self.problem.describe(tokens=False) if self.problem else "?"
        chosen = self.chosen or "nothing runnable"
        head = f"{scope}: {self.requested} -> {chosen} [{len(self.modules)} layer(s), {shape}]"
        if self.runs == "transformers" and self.requested == AUTO:
            head += " (no selector backend takes this weight format: Transformers' own FP8 function)"
        elif self.runs == "transformers":
            head += f" (Transformers' own implementation{'; ' + self.hint if self.hint else ''})"
        out = [head]
        if self.by_tokens:
            out.append("  per token count: " + ", ".join(f"T={t}: {n}" for t, n in self.by_tokens.items()))
        if self.ranking is not None:
            others = [f"{c.name} ({'measured' if c.source == 'measured' else 'est.'} {c.estimate * 1e6:.0f} us)"
                      for c in self.ranking.candidates]
            if others:
                out.append("  runnable, best first: " + ", ".join(others))
            for name, why in self.ranking.excluded.items():
                fix = f" (fix: {why.remedy})" if why.remedy else ""
                out.append(f"  not {name}: {why.status.value}: {why.reason}{fix}")
        if self.error:
            out.append(f"  the first forward will raise: {self.error}")
        return out


@dataclass(frozen=True)
class SelectionReport:
    """Per sub-config: what was asked, what runs, and why not the other backends."""

    entries: tuple[ScopeSelection, ...]

    @property
    def scopes(self) -> dict[str, list[ScopeSelection]]:
        out: dict[str, list[ScopeSelection]] = {}
        for entry in self.entries:
            out.setdefault(entry.scope, []).append(entry)
        return out

    def __getitem__(self, scope: str) -> ScopeSelection:
        return self.scopes[scope][0]

    def __contains__(self, scope: object) -> bool:
        return scope in self.scopes

    def chosen(self) -> dict[str, str | None]:
        return {scope: entries[0].chosen for scope, entries in self.scopes.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [e.to_dict() for e in self.entries]}

    def __str__(self) -> str:
        if not self.entries:
            return "no experts layers that use Transformers' experts interface"
        return "\n".join(line for e in self.entries for line in e.lines())


def _config_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    usable = isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize > 1
    return dtype if usable else torch.bfloat16


def selection_report(model: torch.nn.Module, tokens: Sequence[int] = REPORT_TOKENS) -> SelectionReport:
    """What each sub-config's experts layers run on this machine, at their current device and dtype."""
    names = register_with_transformers()
    entries: list[ScopeSelection] = []
    for scope, members in experts_modules(model).items():
        groups: dict[Problem, list[str]] = {}
        first: dict[Problem, torch.nn.Module] = {}
        requested: dict[Problem, str | None] = {}
        for path, module in members:
            if is_quantized(module):
                adopt_quantized(module, _config_dtype(module.config))
            problem = dispatch.problem_of(module, dispatch.declared_top_k(module))
            groups.setdefault(problem, []).append(path)
            first.setdefault(problem, module)
            requested.setdefault(problem, module.config._experts_implementation)
        for problem, paths in groups.items():
            module, req = first[problem], requested[problem]
            entries.append(_scope_entry(scope, req, tuple(paths), problem, module, names, tokens))
    return SelectionReport(tuple(entries))


def _scope_entry(
    scope: str,
    requested: str | None,
    paths: tuple[str, ...],
    problem: Problem,
    module: torch.nn.Module,
    names: Mapping[str, str],
    tokens: Sequence[int],
) -> ScopeSelection:
    request = names.get(requested) if isinstance(requested, str) else None
    if request is None:  # Transformers' own ("eager", "grouped_mm", ...)
        hint = _selector_twin(requested, module, problem, names)
        return ScopeSelection(scope, requested, "transformers", paths, problem, requested, hint=hint)
    ranking = dispatch.explain_module(module, top_k=problem.top_k)
    if request == AUTO and is_quantized(module):  # no selector backend for the format: Transformers' FP8 one
        by_tokens = {t: quantized_plan(module, t, problem.top_k, decoding=False) for t in tokens}
        chosen = ranking.best or TRANSFORMERS_FALLBACK + "grouped_mm"
        runs = "selector" if ranking.best else "transformers"
        return ScopeSelection(scope, requested, runs, paths, problem, chosen, by_tokens, ranking)
    if request == AUTO:
        by_tokens = {t: dispatch.explain_module(module, num_tokens=t, top_k=problem.top_k).best for t in tokens}
        return ScopeSelection(scope, requested, "selector", paths, problem, ranking.best, by_tokens, ranking)
    error = None
    if request in ranking.excluded:
        why = ranking.excluded[request]
        error = f"{why.status.error_type.__name__}: {why.reason}"
    return ScopeSelection(scope, requested, "selector", paths, problem, request, {}, ranking, error)


def _selector_twin(requested: object, module: torch.nn.Module, problem: Problem, names: Mapping[str, str]) -> str | None:
    """For a name Transformers runs itself that selector has too: the name that asks for selector's, and, where
    selector's cannot run here, its reason in selector's words (a CUDA-only kernel on a CPU says so)."""
    own = f"{PREFIX}{requested}" if isinstance(requested, str) else None
    if own is None or names.get(own) != requested:
        return None
    why = dispatch.explain_module(module, top_k=problem.top_k).excluded.get(requested)
    return f"`{own}` runs selector's" + (f", which cannot run here: {why.reason}" if why else "")


def log_selection(model: torch.nn.Module, level: int = logging.INFO) -> SelectionReport:
    """`selection_report(model)`, its first line per entry logged at `level`; warns when nothing uses the interface."""
    report = selection_report(model)
    if logger.isEnabledFor(level):
        for entry in report.entries:
            logger.log(level, "selector: %s", entry.lines()[0])
    if not report.entries:
        logger.warning(
            "selector: %s has no experts layers built with Transformers' experts interface; "
            "experts_implementation has no effect on it",
            type(model).__name__,
        )
    return report
