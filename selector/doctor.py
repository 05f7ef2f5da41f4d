"""`selector doctor`: collect every fact and verdict into one report object; renderers turn it into text,
markdown or JSON. Nothing here imports torch, so a cold run stays fast on a CPU-only machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import selector
from selector.compat import hub_kernels_verdict
from selector.config import ConfigError, SelectorConfig, load_config
from selector.model_shapes import ModelSection
from selector.parallel.report import ParallelSection, no_group_section
from selector.probes import Environment
from selector.ranking import rank
from selector.registry import Registry
from selector.settings import setting
from selector.tuning import TuningTable, measured_for
from selector.types import Availability, Problem, Ranking, Status

SCHEMA = "selector.doctor/1"  # bump on any incompatible change to the JSON layout


CheckStatus = Literal["ok", "warning", "failed"]


@dataclass(frozen=True)
class Check:
    """One line of the checklist: a section, a verdict, a title and detail lines."""

    section: str
    ok: bool
    title: str
    detail: tuple[str, ...] = ()
    warning: str = ""  # why a check that passed is worth a look (overrides, disagreeing variables); "" when not

    @property
    def status(self) -> CheckStatus:
        """The one verdict every rendering shows: a failed check is failed, whatever it also warns about."""
        return "failed" if not self.ok else "warning" if self.warning else "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"section": self.section, "ok": self.ok, "status": self.status, "warning": self.status == "warning",
                "title": self.title, "detail": list(self.detail)}


@dataclass(frozen=True)
class BackendLine:
    name: str
    provider: str
    distribution: str
    description: str
    verdict: Availability
    first_call_cost: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "provider": self.provider,
            "distribution": self.distribution,
            "description": self.description,
            "first_call_cost": self.first_call_cost,
            **self.verdict.to_dict(),
        }


@dataclass
class DoctorReport:
    environment: Environment
    checks: list[Check]
    backends: list[BackendLine]
    backend_problem: Problem
    plugins: list[dict[str, Any]]
    registry_problems: list[str]
    config: dict[str, Any]
    ranking: Ranking | None = None
    required: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # what makes the exit code 1
    # shown, not fatal: a plugin nobody asked for that failed (its backends are simply absent)
    warnings: list[str] = field(default_factory=list)
    usable: list[str] = field(default_factory=list)  # what `auto` may choose for the judged layer, best first
    no_estimate: list[str] = field(default_factory=list)  # runnable backends that give no cost estimate
    parallel: ParallelSection | None = None  # the expert-parallel strategies' verdicts
    model: ModelSection | None = None  # a model config's experts shapes and their coverage (--model)

    @property
    def exit_code(self) -> int:
        return 1 if self.broken else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "selector_version": selector.__version__,
            "exit_code": self.exit_code,
            "broken": self.broken,
            "warnings": self.warnings,
            "checks": [c.to_dict() for c in self.checks],
            "backends_for": self.backend_problem.to_dict(),
            "backends": [b.to_dict() for b in self.backends],
            "plugins": self.plugins,
            "registry_problems": self.registry_problems,
            "config": self.config,
            "ranking": self.ranking.to_dict() if self.ranking else None,
            "required": self.required,
            "usable": self.usable,
            "no_estimate": self.no_estimate,
            "expert_parallel": self.parallel.to_dict() if self.parallel else None,
            "model": self.model.to_dict() if self.model else None,
            "environment": self.environment.to_dict(),
        }


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "? GiB"


def _gpu_check(env: Environment) -> Check:
    gpu = env.gpu
    suffix = " (overridden)" if gpu.overridden and "overridden" not in gpu.source else ""
    if not gpu.devices:
        return Check("gpu", False, f"GPU: {gpu.problem or 'no CUDA GPU visible'}", (f"source: {gpu.source}{suffix}",))
    lines = tuple(
        f"cuda:{d.index} {d.name}, compute capability {d.compute_capability[0]}.{d.compute_capability[1]}, "
        f"{_gib(d.memory_total_bytes)}" + (f", {_gib(d.memory_free_bytes)} free" if d.memory_free_bytes else "")
        for d in gpu.devices
    )
    driver = f"driver {gpu.driver_version or '?'} (CUDA {gpu.driver_cuda_version or '?'})"
    title = f"GPU: {len(gpu.devices)} x {gpu.devices[0].name}, {driver}"
    overridden = f"the GPU facts are overridden ({gpu.source})" if gpu.overridden else ""
    return Check("gpu", True, title, (*lines, f"source: {gpu.source}{suffix}"), warning=overridden)


def _toolkit_check(env: Environment) -> Check:
    tk = env.toolkit
    detail = (*tk.warnings, *(f"searched {s}" for s in tk.searched))
    if tk.usable_for_jit and tk.nvcc_version:
        v = f"{tk.nvcc_version[0]}.{tk.nvcc_version[1]}"
        title = f"CUDA toolkit: nvcc {v} at {tk.root} (found by {tk.found_by})"
        why = "; ".join(tk.warnings) or ("the toolkit facts are overridden" if tk.overridden else "")
        return Check("toolkit", True, title, detail, warning=why)
    title = f"CUDA toolkit: {tk.problem or 'not found'}"
    return Check("toolkit", False, title, (*detail, "needed only by backends that compile kernels at run time"))


def _packages_check(env: Environment) -> Check:
    present, missing, detail = [], [], []
    for p in env.packages:
        if p.version is None:
            missing.append(p.name)
            continue
        extra = ""
        if p.name == "torch" and "cuda" in p.detail:
            extra = f" (CUDA {p.detail['cuda']} build)" if p.detail["cuda"] else " (CPU build)"
        present.append(f"{p.name} {p.version}{extra}")
        if p.overridden:
            detail.append(f"{p.name}: {p.source}")
    title = "Packages: " + ", ".join(present)
    if missing:
        detail.insert(0, "not installed: " + ", ".join(missing))
    mismatch = hub_kernels_verdict(env)  # Transformers' hub backends refuse a kernels outside their range
    if mismatch:
        detail.append(mismatch)
    return Check("packages", "torch" in " ".join(present), title, tuple(detail))


def _tuning_check(table: TuningTable, where: str) -> Check:
    """How many measured times this environment has, and how many are stale (measured under other facts than
    their backend's now: each record carries its backend's fingerprint)."""
    distinct = len(set(table.fingerprints.by_backend.values()))
    detail = [f"store: {where}", f"fingerprints: one per backend ({distinct} distinct; `selector store show` "
              "lists them)" if table.fingerprints.by_backend else f"fingerprint: {table.fingerprints.default}"]
    if table.stale:
        per_backend = ", ".join(f"{b} {n}" for b, n in sorted(table.stale_by_backend.items()))
        detail.append(f"{table.stale} record(s) measured in another environment ({per_backend}: the GPU, driver, "
                      "CUDA, torch, Triton or that backend's distribution changed): not trusted; run `selector "
                      "tune` again")
    if table.legacy:
        detail.append(f"{table.legacy} record(s) of the older single-fingerprint format, proven current (measured "
                      "here with these plugins)")
    if table.unknown:
        detail.append(f"{table.unknown} record(s) of backends not loaded here: unused")
    if table.invalid:
        detail.append(f"{table.invalid} record(s) that do not validate: skipped")
    if not len(table):
        detail.append("auto ranks by static estimates here: `selector tune --preset <model>` measures them")
        return Check("tuning", True, "Tuning: no measured times for this environment", tuple(detail),
                     warning="no measured times: auto ranks by static estimates")
    untrusted = [f"{n} {what} record(s)" for n, what in ((table.stale, "stale"), (table.invalid, "invalid")) if n]
    return Check("tuning", True, f"Tuning: {len(table)} measured time(s) for this environment", tuple(detail),
                 warning=", ".join(untrusted) + " not used" if untrusted else "")


def _plugins_check(registry: Registry) -> Check:
    failed = [p for p in registry.plugins if p.error]
    skipped = [p for p in registry.plugins if p.skipped]
    loaded = [p for p in registry.plugins if not p.error and not p.skipped]
    dists = sorted({p.distribution for p in loaded})
    title = f"Plugins: {len(loaded)} loaded from {', '.join(dists) or 'nothing'}"
    detail = [f"{p.name} ({p.distribution}): {p.error}" for p in failed]
    detail += [f"{p.name}: skipped, {p.skipped}" for p in skipped]
    detail += registry.problems
    # a plugin that failed to load, or a clash between plugins, leaves backends out and the rest usable: a warning
    # (the README's word), never a broken machine
    why = [f"{len(failed)} plugin(s) failed to load: their backends are absent"] if failed else []
    why += [f"{len(registry.problems)} problem(s) registering backends"] if registry.problems else []
    return Check("plugins", True, title, tuple(detail), warning="; ".join(why))


def malformed_settings(environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The SELECTOR_* variables of `environ` that selector cannot use: (one message per malformed value, as
    selector.settings parses it when it reads it; the names that are no setting at all)."""
    malformed, unknown = [], []
    for name in sorted(n for n in environ if n.startswith("SELECTOR_")):
        try:
            declared = setting(name)
        except KeyError:
            unknown.append(name)
            continue
        raw = environ[name]
        if declared.empty_is_unset and not raw.strip():
            continue
        try:
            declared.parse(raw)
        except ValueError as exc:
            fallback = f" (read as its default, {declared.shown_default()})" if declared.on_bad == "default" else ""
            malformed.append(f"{exc}{fallback}")
    return malformed, unknown


def _settings_check(environ: Mapping[str, str]) -> Check:
    """A malformed setting fails here rather than at the first forward (or, for one that falls back to its
    default, rather than never); a SELECTOR_* name that is no setting (a typo?) is worth a look."""
    malformed, unknown = malformed_settings(environ)
    detail = (*malformed, *(f"{n}: not a selector setting (`selector doctor --help` lists them)" for n in unknown))
    if malformed:
        return Check("settings", False, f"Settings: {len(malformed)} malformed SELECTOR_* variable(s)", detail)
    count = sum(1 for n in environ if n.startswith("SELECTOR_"))
    title = f"Settings: {count} SELECTOR_* variable(s) set, none malformed"
    return Check("settings", True, title, detail, warning=f"unknown: {', '.join(unknown)}" if unknown else "")


def default_problem(env: Environment) -> Problem:
    """The layer backends are judged on when no configuration is given: only machine facts then matter."""
    if env.gpu.devices:
        return Problem(num_experts=8, hidden_size=1024, intermediate_size=1024, top_k=2, device="cuda")
    return Problem(num_experts=8, hidden_size=1024, intermediate_size=1024, top_k=2, dtype="float32", device="cpu")


def build_report(
    env: Environment,
    registry: Registry,
    problem: Problem | None = None,
    required: Sequence[str] = (),
    config: SelectorConfig | None = None,
    tuning: TuningTable | None = None,
    tuning_store: str = "",
    parallel: ParallelSection | None = None,
    model: ModelSection | None = None,
    environ: Mapping[str, str] | None = None,
) -> DoctorReport:
    """Everything doctor shows, computed once. `problem` adds a ranking; `required` backends must run here.
    `tuning`: the measured times of this environment (the ranking uses them where they cover the problem, and
    says so); `tuning_store`: where they were read from. `parallel`: the expert-parallel strategies judged for a
    group (`selector.parallel.report`; a group asked for in which no strategy runs is broken); without it the
    section says there is no process group. `model`: a model config's shapes and their coverage
    (`selector.model_shapes.model_section`), shown as its own section. `environ` (default: os.environ): where the
    SELECTOR_* settings are read; a malformed one is broken.

    The backend lines are the ranking's verdicts on the judged problem (one judgement, the one `auto` makes).
    """
    broken: list[str] = []
    if config is None:
        try:
            config = load_config()
        except ConfigError as exc:
            broken.append(str(exc))
            config = SelectorConfig()
    environ = os.environ if environ is None else environ
    broken += malformed_settings(environ)[0]  # set on purpose, so a request: selector would refuse or ignore it
    checks = [_gpu_check(env), _toolkit_check(env), _packages_check(env), _plugins_check(registry),
              _settings_check(environ)]
    if tuning is not None:
        checks.append(_tuning_check(tuning, tuning_store or "(given)"))
    # An installed plugin is not a request: its failure is reported; it breaks only what names its backends
    # (a --require or a pin of a name it would have provided is then "not registered").
    warnings = [f"{c.section}: {c.warning}" for c in checks if c.status == "warning"]
    warnings += [f"plugin {p.name}: {p.error}" for p in registry.plugins if p.error]

    judged = problem or default_problem(env)
    if problem is None and not env.gpu.devices:
        judged = replace(judged, device="cpu")
    measured = None if tuning is None or problem is None else measured_for(judged, env, tuning)
    ranking = rank(judged, env, registry, config, measured=measured)
    backends = []
    for name in registry.names:
        spec = registry.specs[name]
        provider = registry.providers[name]
        dist = next((p.distribution for p in registry.plugins if p.name == provider), "")
        backends.append(
            BackendLine(name, provider, dist, spec.description, ranking.verdicts[name], spec.first_call_cost)
        )
    broken += _pin_problems(config, registry, ranking)
    for name in required:
        line = next((b for b in backends if b.name == name), None)
        if line is None:
            broken.append(f"required backend {name!r} is not registered (registered: {', '.join(registry.names)})")
        elif not line.verdict.ok:
            broken.append(f"required backend {name!r} cannot run here: {line.verdict.reason}")
    usable = [c.name for c in ranking.candidates]
    if not any(b.verdict.ok for b in backends):
        broken.append("no experts backend can run here")
    elif not usable:  # every runnable backend is denied: auto would raise at the first forward
        denied = sorted(n for n in config.deny if n in ranking.verdicts and ranking.verdicts[n].ok)
        broken.append(f"no backend can run this layer here: the config denies every runnable one "
                      f"({', '.join(denied)}); remove one from 'deny' in {', '.join(config.files) or 'the config'}")
    if parallel is None:
        parallel = no_group_section(judged.num_experts)
    elif parallel.facts.has_group and parallel.chosen is None:
        reasons = "; ".join(f"{line.name}: {line.verdict.reason}" for line in parallel.lines)
        broken.append(f"expert parallelism over {parallel.facts.world_size} ranks: no strategy runs ({reasons})")
    return DoctorReport(
        environment=env,
        checks=checks,
        backends=backends,
        backend_problem=judged,
        plugins=[p.to_dict() for p in registry.plugins],
        registry_problems=list(registry.problems),
        config=config.to_dict(),
        ranking=ranking if problem is not None else None,
        required=list(required),
        broken=broken,
        warnings=warnings,
        usable=usable,
        no_estimate=[c.name for c in ranking.candidates
                     if c.source != "measured" and not _has_estimate(registry, c.name, judged, env)],
        parallel=parallel,
        model=model,
    )


def _has_estimate(registry: Registry, name: str, problem: Problem, env: Environment) -> bool:
    """Whether the backend gives a cost for the problem (the ranking sorts one that does not last)."""
    estimate = registry.specs[name].estimate
    if estimate is None:
        return False
    try:
        float(estimate(problem, env))
    except Exception:  # a broken estimate counts as none, as in the ranking
        return False
    return True


def _pin_problems(config: SelectorConfig, registry: Registry, ranking: Ranking) -> list[str]:
    """A pin is an explicit request: one that names no backend, or one that cannot run here, is broken (exit 1)."""
    pin = config.pin
    if pin is None:
        return []
    where = config.sources.get("pin") or ", ".join(config.files) or "the config"
    if pin not in registry.specs:
        return [f"{where}: pinned backend {pin!r} is not registered (registered: {', '.join(registry.names)}); "
                "fix the name or remove the pin"]
    if pin in config.deny:
        return [f"{where}: backend {pin!r} is both pinned and denied; remove it from one of 'pin' and 'deny'"]
    verdict = ranking.verdicts[pin]
    if not verdict.ok:
        fix = verdict.remedy or "remove the pin"
        return [f"{where}: pinned backend {pin!r} cannot run here ({verdict.status.value}: {verdict.reason}); "
                f"fix: {fix}, or remove the pin"]
    return []


def status_mark(verdict: Availability) -> str:
    return "ok" if verdict.status is Status.OK else verdict.status.value
