"""Ranking: a pure function of (probe facts, problem, registry, config) -> ordered candidates + exclusions."""

from __future__ import annotations

from collections.abc import Mapping

from selector.config import SelectorConfig
from selector.probes import Environment
from selector.registry import Registry
from selector.requirements import evaluate
from selector.types import Availability, Candidate, Problem, Ranking, Status

UNKNOWN_COST = 1.0  # seconds: a backend that gives no estimate sorts after every one that does


def _estimate(registry: Registry, name: str, problem: Problem, env: Environment) -> float:
    estimate = registry.specs[name].estimate
    if estimate is None:
        return UNKNOWN_COST
    try:
        return float(estimate(problem, env))
    except Exception:  # a broken estimate must not hide a working backend
        return UNKNOWN_COST


def rank(
    problem: Problem,
    env: Environment,
    registry: Registry,
    config: SelectorConfig | None = None,
    measured: Mapping[str, float] | None = None,
) -> Ranking:
    """Order the backends that can run `problem` here, fastest first, and say why each other one cannot.

    Every backend is judged once (`Ranking.verdicts`), denied ones too. Order: a pinned backend first, then
    preferred ones in the config's order, then by measured time (`measured`: backend -> seconds for this
    problem, e.g. from tuning) or else by the plugin's estimate.
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
        cost = (measured or {}).get(name)
        runnable.append(
            Candidate(
                name=name,
                estimate=cost if cost is not None else _estimate(registry, name, problem, env),
                pinned=name == config.pin,
                preferred=name in config.prefer,
            )
        )

    def order(c: Candidate) -> tuple[int, int, float, str]:
        preference = config.prefer.index(c.name) if c.preferred else len(config.prefer)
        return (0 if c.pinned else 1, preference, c.estimate, c.name)

    return Ranking(problem=problem, candidates=tuple(sorted(runnable, key=order)), excluded=excluded, verdicts=verdicts)
