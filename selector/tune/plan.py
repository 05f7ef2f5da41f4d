"""The plan `selector tune` reports: per layer and mode, which backend runs which token range, where the choice
crosses over, and what measuring gains over the static choice.

Pure: it is handed measured times and the static picks; no torch, no files.

A token count T runs what was measured at the smallest measured count >= T (the dispatch core rounds T up to a
power-of-two bucket and looks up the nearest measured count), so a range of measured counts t_i..t_j with the
same best backend covers T from t_(i-1) + 1 to t_j, the last range every T above too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Timed:
    """A backend's measured time at one token count, with its relative spread over the rounds."""

    time_s: float
    spread: float = 0.0


@dataclass(frozen=True)
class TokenRow:
    tokens: int
    best: str
    best_s: float
    spread: float  # the best's
    runner_up: str | None = None
    margin: float | None = None  # runner-up time / best time - 1
    static: str | None = None  # what the ranking picks without measurements
    static_s: float | None = None  # its measured time (None: not measured)
    gain: float | None = None  # static_s / best_s

    @property
    def within_spread(self) -> bool:
        """The runner-up is closer than the best's own spread: the two are not told apart."""
        return self.margin is not None and self.margin <= self.spread


@dataclass(frozen=True)
class TokenRange:
    backend: str
    low: int  # first token count of the range
    high: int | None  # last one; None: and every count above
    measured: tuple[int, ...]  # the measured counts inside


@dataclass(frozen=True)
class Crossover:
    after: int  # last measured count of the earlier backend
    before: int  # first measured count of the later one
    earlier: str
    later: str


@dataclass
class ModePlan:
    """The plan for one layer in one mode."""

    target: str
    problem_key: str
    mode: str
    rows: list[TokenRow] = field(default_factory=list)
    ranges: list[TokenRange] = field(default_factory=list)
    crossovers: list[Crossover] = field(default_factory=list)
    gain: float | None = None  # geometric mean of the per-T gains over the static choice

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "problem": self.problem_key,
            "mode": self.mode,
            "gain_over_static": self.gain,
            "ranges": [asdict(r) for r in self.ranges],
            "crossovers": [asdict(c) for c in self.crossovers],
            "tokens": [{**asdict(r), "within_spread": r.within_spread} for r in self.rows],
        }


def build_plan(
    target: str,
    problem_key: str,
    mode: str,
    times: Mapping[int, Mapping[str, Timed]],
    static: Mapping[int, str | None] | None = None,
) -> ModePlan:
    """The plan from `times` ({tokens: {backend: Timed}}, counts without any time are left out) and `static`
    ({tokens: the static pick})."""
    plan = ModePlan(target, problem_key, mode)
    gains: list[float] = []
    for t in sorted(times):
        by_backend = {b: m for b, m in times[t].items() if m.time_s > 0}
        if not by_backend:
            continue
        order = sorted(by_backend, key=lambda b: (by_backend[b].time_s, b))
        best, second = order[0], order[1] if len(order) > 1 else None
        best_s = by_backend[best].time_s
        pick = (static or {}).get(t)
        static_s = by_backend[pick].time_s if pick in by_backend else None
        gain = static_s / best_s if static_s is not None else None
        if gain is not None:
            gains.append(gain)
        plan.rows.append(
            TokenRow(
                tokens=t,
                best=best,
                best_s=best_s,
                spread=by_backend[best].spread,
                runner_up=second,
                margin=by_backend[second].time_s / best_s - 1 if second else None,
                static=pick,
                static_s=static_s,
                gain=gain,
            )
        )
    previous = 0
    for i, row in enumerate(plan.rows):
        if plan.ranges and plan.ranges[-1].backend == row.best:
            last = plan.ranges[-1]
            plan.ranges[-1] = TokenRange(last.backend, last.low, row.tokens, (*last.measured, row.tokens))
        else:
            if plan.ranges:
                plan.crossovers.append(Crossover(plan.rows[i - 1].tokens, row.tokens, plan.ranges[-1].backend, row.best))
            plan.ranges.append(TokenRange(row.best, previous + 1, row.tokens, (row.tokens,)))
        previous = row.tokens
    if plan.ranges:
        last = plan.ranges[-1]
        plan.ranges[-1] = TokenRange(last.backend, last.low, None, last.measured)
    plan.gain = math.exp(sum(math.log(g) for g in gains) / len(gains)) if gains else None
    return plan


def _time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.1f}µs" if s < 1e-3 else f"{s * 1e3:.2f}ms"


def render_plan(plan: ModePlan) -> str:
    """One plan as text: the ranges and crossovers, then a markdown table per token count."""
    head = f"{plan.target} ({plan.problem_key}), {plan.mode}"
    if not plan.rows:
        return f"{head}: nothing measured\n"
    ranges = ", ".join(f"T {r.low}-{r.high if r.high is not None else '…'}: {r.backend}" for r in plan.ranges)
    cross = "; ".join(f"{c.earlier} -> {c.later} between T={c.after} and T={c.before}" for c in plan.crossovers)
    gain = f"{plan.gain:.3f}x" if plan.gain is not None else "- (static pick not measured)"
    lines = [
        f"{head}",
        f"  plan: {ranges}",
        f"  crossovers: {cross or 'none'}",
        f"  gain over the static choice (geometric mean over T): {gain}",
        "",
        "| T | best | time | spread | runner-up | margin | static | static time | gain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in plan.rows:
        margin = "-" if r.margin is None else f"{r.margin:+.1%}" + (" (within spread)" if r.within_spread else "")
        lines.append(f"| {r.tokens} | {r.best} | {_time(r.best_s)} | {r.spread:.1%} | {r.runner_up or '-'} | {margin} | "
                     f"{r.static or '-'} | {_time(r.static_s)} | {'-' if r.gain is None else f'{r.gain:.3f}'} |")
    return "\n".join(lines) + "\n"
