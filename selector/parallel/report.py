"""The expert-parallel section of `selector doctor`: every strategy's verdict, eager and where a CUDA graph captures
or torch.compile traces, for a group of ranks described by facts (no torch imported, no collective run).

The facts come from the doctor's flags (`--ep-size N`, `--ep-backend`), judged on this machine's probes (a CPU
build of torch has no NCCL; the NCCL version is the one of the `nvidia-nccl-cu*` distribution torch installed), or
from a live group (`selector.parallel.facts_of(group, E)` inside a process that initialised one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from selector.parallel.strategies import PREFERENCE, STRATEGIES, ParallelFacts, check_strategy, choose, version_text
from selector.probes import Environment
from selector.probes.packages import probe_packages
from selector.types import Availability

NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")  # what CUDA wheels of torch pull in


@dataclass(frozen=True)
class StrategyLine:
    """One strategy as doctor shows it."""

    name: str
    description: str
    tradeoff: str
    capturable: bool
    verdict: Availability  # called eagerly
    captured: Availability  # called where a CUDA graph captures or torch.compile traces

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "tradeoff": self.tradeoff,
            "capturable": self.capturable,
            **self.verdict.to_dict(),
            "captured": self.captured.to_dict(),
        }


@dataclass(frozen=True)
class ParallelSection:
    """The facts judged, where they came from, each strategy's verdicts and what `auto` runs."""

    facts: ParallelFacts
    source: str
    lines: tuple[StrategyLine, ...]
    chosen: str | None  # what `auto` runs eagerly (None: nothing runs)
    chosen_captured: str | None  # under CUDA graphs and torch.compile
    nccl_source: str = ""

    def to_dict(self) -> dict[str, Any]:
        f = self.facts
        return {
            "source": self.source,
            "has_group": f.has_group,
            "world_size": f.world_size,
            "backend": f.backend,
            "num_experts": f.num_experts,
            "same_tokens": f.same_tokens,
            "nccl_version": version_text(f.nccl_version) if f.nccl_version else None,
            "nccl_source": self.nccl_source,
            "nccl_problem": f.nccl_problem,
            "auto": self.chosen,
            "auto_captured": self.chosen_captured,
            "strategies": [line.to_dict() for line in self.lines],
        }


def _version_tuple(text: str) -> tuple[int, ...] | None:
    parts = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def nccl_facts(
    env: Environment, environ: Mapping[str, str] | None = None
) -> tuple[tuple[int, ...] | None, str, str | None]:
    """(NCCL version or None, where it was read, why NCCL cannot run here or None), from the probes alone."""
    torch = next((p for p in env.packages if p.name == "torch"), None)
    problem = None
    if torch is None or torch.version is None:
        problem = "torch is not installed"
    elif not torch.detail.get("cuda"):
        problem = f"torch {torch.version} is a CPU build, without NCCL"
    elif not env.gpu.devices:
        problem = "no CUDA GPU is visible"
    for facts in probe_packages(NCCL_DISTRIBUTIONS, environ):
        if facts.version:
            return _version_tuple(facts.version), f"{facts.name} {facts.version} ({facts.source})", problem
    unknown = "no nvidia-nccl distribution installed (a torch built with NCCL inside: its version is not read)"
    return None, unknown, problem


def doctor_facts(
    env: Environment,
    world_size: int,
    num_experts: int,
    backend: str | None = None,
    same_tokens: bool = False,
    environ: Mapping[str, str] | None = None,
) -> tuple[ParallelFacts, str]:
    """The facts of a group of `world_size` ranks on this machine (nccl where torch has CUDA and a GPU is seen,
    else gloo, unless `backend` says), and where the NCCL facts came from."""
    version, source, problem = nccl_facts(env, environ)
    if backend is None:
        backend = "gloo" if problem else "nccl"
    facts = ParallelFacts(True, world_size, backend, num_experts, same_tokens, False, version, problem)
    return facts, source if backend == "nccl" else ""


def build_section(facts: ParallelFacts, source: str, nccl_source: str = "") -> ParallelSection:
    """Every strategy's verdicts for the facts, in the order `auto` tries them."""
    captured_facts = replace(facts, capturing=True)
    lines = tuple(
        StrategyLine(n, s.description, s.tradeoff, s.capturable, check_strategy(s, facts),
                     check_strategy(s, captured_facts))
        for n, s in ((n, STRATEGIES[n]) for n in PREFERENCE)
    )

    def auto(f: ParallelFacts) -> str | None:
        try:
            return choose(f)
        except (ValueError, ImportError):
            return None

    return ParallelSection(facts, source, lines, auto(facts), auto(captured_facts), nccl_source)


def group_section(group: Any, num_experts: int, same_tokens: bool = False) -> ParallelSection:
    """The section for a live process group (None: the default world), inside a process that initialised one;
    loads torch.distributed, which the doctor command itself never does."""
    from selector.parallel.layer import facts_of

    facts = facts_of(group, num_experts, same_tokens)
    return build_section(facts, "the initialised process group" if facts.has_group else "no process group")


def no_group_section(num_experts: int) -> ParallelSection:
    return build_section(ParallelFacts(False, 0, None, num_experts), "no process group")


def section_title(section: ParallelSection) -> str:
    f = section.facts
    if not f.has_group:
        return "Expert parallelism: no process group (`selector doctor --ep-size N` judges a group of N ranks)"
    nccl = f", NCCL {version_text(f.nccl_version)}" if f.backend == "nccl" and f.nccl_version else ""
    same = ", the same tokens on every rank" if f.same_tokens else ""
    group = f"{f.world_size} ranks over {f.backend}{nccl}, E={f.num_experts}{same}"
    head = f"Expert parallelism ({group}; {section.source})"
    if section.chosen is None:
        return f"{head}: no strategy runs"
    captured = section.chosen_captured or "nothing"
    return f"{head}: auto runs {section.chosen}; under CUDA graphs and torch.compile {captured}"


def section_text(section: ParallelSection, ok: str, bad: str) -> list[str]:
    """The section as the text report's lines (`ok` / `bad`: the report's marks)."""
    lines = [section_title(section)]
    if not section.facts.has_group:
        for line in section.lines:
            lines.append(f"  {bad} {line.name:<18} excluded: no process group")
        return lines
    for line in section.lines:
        v = line.verdict
        lines.append(f"  {ok if v.ok else bad} {line.name:<18} {line.description}")
        if v.ok:
            if v.reason:
                lines.append(f"      {v.reason}")
            c = line.captured
            lines.append("      under CUDA graphs / torch.compile: " + ("runs" if c.ok else f"excluded, {c.reason}"))
        else:
            lines.append(f"      {v.status.value}: {v.reason}")
            if v.remedy:
                lines.append(f"      fix: {v.remedy}")
        lines.append(f"      trade-off: {line.tradeoff}")
    if section.nccl_source:
        lines.append(f"  NCCL: {section.nccl_source}")
    return lines


def section_markdown(section: ParallelSection) -> list[str]:
    """The section as markdown lines: a heading and one table row per strategy."""
    lines = [
        f"## {section_title(section)}",
        "",
        "| strategy | eager | under CUDA graphs / torch.compile | reason | fix |",
        "|---|---|---|---|---|",
    ]
    for line in section.lines:
        v, c = line.verdict, line.captured
        reason = v.reason if not v.ok else (c.reason if not c.ok else v.reason)
        fix = v.remedy if not v.ok else c.remedy
        lines.append(
            f"| {line.name} | {v.status.value} | {c.status.value} | {reason.replace('|', '/')} | "
            f"{fix.replace('|', '/')} |"
        )
    return lines


__all__ = [
    "NCCL_DISTRIBUTIONS",
    "ParallelSection",
    "StrategyLine",
    "build_section",
    "doctor_facts",
    "group_section",
    "nccl_facts",
    "no_group_section",
    "section_markdown",
    "section_text",
    "section_title",
]
