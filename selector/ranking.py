"""Ranking: a pure function of (probe facts, problem, registry, config) -> ordered candidates + exclusions."""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import replace

from selector.config import SelectorConfig
from selector.probes import Environment
from selector.registry import Registry
from selector.requirements import evaluate
from selector.tuning import Measurement
from selector.types import Availability, Candidate, Problem, Ranking, Status

UNKNOWN_COST = 1.0  # seconds: a backend that gives no estimate sorts after every one that does
# A measured first call this long is a JIT build the ranking charges until the backend ran the shape here; shorter
# ones (a Triton compile, mostly served from Triton's disk cache in later processes) are not charged.
JIT_SECONDS = 10.0


def _estimate(registry: Registry, name: str, problem: Problem, env: Environment) -> float:
    estimate = registry.specs[name].estimate
    if estimate is None:
        return UNKNOWN_COST
    try:
        return float(estimate(problem, env))
    except Exception:  # a broken estimate must not hide a working backend
        return UNKNOWN_COST


def _pending(registry: Registry, name: str, problem: Problem, env: Environment, m: Measurement,
             warm: Container[str]) -> float:  # fmt: skip
    """One-time seconds still ahead before `name` runs `problem` at its measured speed in this process."""
    pending = registry.specs[name].pending_cost
    if pending is not None:
        try:
            return max(0.0, float(pending(problem, env)))
        except Exception:  # a broken hook must not hide a working backend: assume what tuning saw
            pass
    return 0.0 if name in warm or m.first_call_s < JIT_SECONDS else m.first_call_s


def _measured_candidate(
    registry: Registry, name: str, problem: Problem, env: Environment, m: Measurement | float,
    warm: Container[str], amortize_calls: float,
) -> Candidate:  # fmt: skip
    if not isinstance(m, Measurement):
        m = Measurement(float(m))
    cost = m.time_s + _pending(registry, name, problem, env, m, warm) / max(amortize_calls, 1.0)
    return Candidate(name=name, estimate=cost, source="measured", measured_tokens=m.tokens or None, spread=m.spread)


def rank(
    problem: Problem,
    env: Environment,
    registry: Registry,
    config: SelectorConfig | None = None,
    measured: Mapping[str, Measurement | float] | None = None,
    warm: Container[str] = (),
    amortize_calls: float = 1000.0,
) -> Ranking:
    """Order the backends that can run `problem` here, fastest first, and say why each other one cannot.

    Every backend is judged once (`Ranking.verdicts`), denied ones too. Order: a pinned backend first, then
    preferred ones in the config's order, then by cost: the measured time where `measured` (backend ->
    Measurement for this problem, from the tuning store) has one, plus the one-time cost still ahead in this
    process (the backend's `pending_cost`, else the measured first-call cost unless the backend is in `warm`)
    spread over `amortize_calls` calls; else the plugin's static estimate. Each candidate says which it used.
    A plugin that failed to load (raised, overran SELECTOR_PLUGIN_TIMEOUT, ...) is among the exclusions by its
    plugin name, with what happened.
    """
    config = config or SelectorConfig()
    excluded: dict[str, Availability] = {}
    verdicts: dict[str, Availability] = {}
    runnable: list[Candidate] = []
    for name in registry.names:
        verdict = verdicts[name] = evaluate(registry.specs[name], problem, env)
        if name in config.deny:
            excluded[name] = Availability(
                Status.DENIED_BY_CONFIG,
                "denied by configuration",
                f"remove it from 'deny' in {', '.join(config.files) or 'the config'}",
            )
            continue
        if not verdict.ok:
            excluded[name] = verdict
            continue
        m = (measured or {}).get(name)
        if m is not None:
            found = _measured_candidate(registry, name, problem, env, m, warm, amortize_calls)
        else:
            found = Candidate(name=name, estimate=_estimate(registry, name, problem, env))
        runnable.append(replace(found, pinned=name == config.pin, preferred=name in config.prefer))

    # a broken plugin registered no backend; say why its backends are absent
    for name, why in registry.failed_plugins().items():
        excluded.setdefault(name, why)

    def order(c: Candidate) -> tuple[int, int, float, str]:
        preference = config.prefer.index(c.name) if c.preferred else len(config.prefer)
        return (0 if c.pinned else 1, preference, c.estimate, c.name)

    return Ranking(problem=problem, candidates=tuple(sorted(runnable, key=order)), excluded=excluded, verdicts=verdicts)
