"""Tune the fused experts kernels' tile configs on this GPU and write them as a shipped table (see configs.py).

    python -m selector.plugins.triton_fused.tune --preset public --out plugins/triton_fused/configs/<GPU>.json

Every public preset's layer but the held-out ones (`selector.presets.tabled_presets`), each searched by
``tune_kernels`` within ``--budget`` seconds (``TABLE_BUDGET_S``) at the token counts `selector tune` uses, and
merged into the table after each layer (``--resume`` goes on where a cut run stopped). A maintainer reruns it for a
new GPU or a new release; the table's header keeps the command.

``tune_kernels`` (the backend's ``BackendSpec.tune_kernels``, run by ``selector tune``) is the search for one
layer: for every token count it tries candidate BLOCK_M values, times the gate_up and down GEMMs over their
candidate tiles (do_bench, median), keeps the fastest align + gate_up + down, and where the persistent Hopper GEMM
can run the layer times the whole layer with and without it; see its docstring.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from selector.arguments import number, whole_numbers
from selector.plugins import tile_tables
from selector.types import Problem

from . import configs as _configs

# The kernels (and triton) are imported where a kernel runs, so the CLI and the search logic load on a machine
# without them and say what is missing in one line.

TOKEN_COUNTS = (1, 8, 64, 512, 4096, 16384)

# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_N of the gated gate_up GEMM counts intermediate channels
# (the program reads twice as many weight rows).
_SMALL_M = [
    (16, 128, 4, 4),
    (32, 128, 4, 4),
    (64, 128, 4, 4),
    (32, 256, 4, 3),
    (64, 256, 4, 3),
    (64, 64, 4, 5),
    (128, 128, 4, 3),
]
_LARGE_M = [
    (64, 64, 4, 4),
    (128, 64, 4, 4),
    (128, 64, 8, 4),
    (128, 64, 8, 3),
    (64, 128, 8, 3),
    (128, 128, 8, 3),
    (256, 64, 8, 3),
    (256, 64, 8, 4),
]


def block_m_candidates(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    pairs = max(1, num_tokens * top_k)
    per_expert = pairs / max(1, min(num_experts, pairs))
    if per_expert <= 8:
        return [16]
    if per_expert <= 24:
        return [16, 32]
    if per_expert <= 64:
        return [32, 64]
    if per_expert <= 192:
        return [64, 128]
    return [128, 64]


def gemm_candidates(block_m: int, n_out: int, gated: bool, elem: int = 2) -> list[dict[str, int]]:
    base = _SMALL_M if block_m <= 32 else _LARGE_M
    out = []
    for bn, bk, warps, stages in base:
        if gated and bn > 128:
            continue
        if bn > max(16, 2 * n_out):
            continue
        n_b = 2 if gated else 1
        if (block_m * bk + n_b * bn * bk) * elem * stages > 225 * 1024:
            continue
        if block_m >= _configs.TMA_MIN_BLOCK_M and not _configs.tma_tiles(block_m, bk, bn, elem):
            continue  # a layer runs TMA for both GEMMs or neither: every tile offered here must be TMA-readable
        out.append(
            {
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "GROUP_M": 1 if block_m <= 32 else 8,
                "num_warps": warps,
                "num_stages": stages,
                "SPLIT_K": 1,
            }
        )
    return out


# One token's down projection as ``_token_down_kernel`` (one K loop over the k experts per output tile): narrow
# tiles, so that H / BLOCK_N programs cover the GPU, and deep pipelines; the H200 sweep's leaders first.
_TOKEN_DOWN = [(32, 256, 4, 4), (32, 256, 4, 8), (16, 256, 4, 4), (64, 256, 4, 4), (32, 128, 4, 8)]


# One token's down projection as pair blocks: each (pair, tile) split over this many programs along K. On the
# H200 two led by 4-8% at Qwen1.5-MoE and GPT-OSS-20B (Qwen3-30B level), four lost (docs/design/triton_fused.md).
PAIR_DOWN_SPLITS = (1, 2)


def with_down_splits(cands: list[dict[str, int]]) -> list[dict[str, int]]:
    """Pair-block down tiles, each at every split of PAIR_DOWN_SPLITS (unsplit first)."""
    return [dict(c, SPLIT_K=s) for s in PAIR_DOWN_SPLITS for c in cands]


def token_down_candidates(elem: int = 2) -> list[dict[str, int]]:
    out = []
    for bn, bk, warps, stages in _TOKEN_DOWN:
        if (16 * bk + bn * bk) * elem * stages > 225 * 1024:
            continue
        out.append({"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "num_warps": warps, "num_stages": stages, "SPLIT_K": 1})
    return out


def _routing(num_tokens: int, top_k: int, num_experts: int, device, gen=None):
    scores = torch.rand(num_tokens, num_experts, device=device, generator=gen)
    w, ids = torch.topk(scores, top_k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def _bench(fn, warmup_ms: float, rep_ms: float) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e-3


# ---------------------------------------------------------------------------------------------------------------
# tune_kernels: one layer, within a budget of seconds (selector tune)
# ---------------------------------------------------------------------------------------------------------------

_log = logging.getLogger("selector.tune.triton_fused")

SEARCH_WARMUP_MS = 1.0  # do_bench per timing: a few reps are enough to rank tiles that differ by 10% or more
SEARCH_REP_MS = 5.0
NEW_KERNEL_GUESS_S = 1.5  # what one not yet compiled tile config costs (JIT compile + timing) until one is seen
REPEAT_GUESS_S = 0.05  # what a timing of an already compiled one costs until one is seen
DROP_BLOCK_M_ABOVE = 1.2  # after two rounds a BLOCK_M this much slower than the best one gets no more timings
LARGE_TOKENS = 512  # from here the GEMMs are compute bound and tiles matter most (the target is set from here)
GEMM_PARTS = ("gate_up", "down")
# The persistent Hopper GEMM (configs.PERSISTENT) is a choice for the whole layer: once a token count's tiles are
# found with blocks of its 128 rows, the layer is timed with and without it (LAYER_PARTS), and it is kept only
# where it is faster by this share or more (the two differ by a few per cent where the kernel does not help).
LAYER_PARTS = ("layer", "layer_persistent")
PERSISTENT_MIN_GAIN = 0.02
PERSISTENT_BUILD_GUESS_S = 30.0  # the persistent kernel's first layer timing: both GEMMs built (Gluon), then timed


def token_order(token_counts: Iterable[int]) -> list[int]:
    """The order token counts are tuned in: largest first (where tiles matter; small T is weight bound, near the
    heuristics' tiles already), so a budget cut leaves the small ones on defaults."""
    return sorted({int(t) for t in token_counts if int(t) >= 1}, reverse=True)


def token_weight(num_tokens: int) -> float:
    """A token count's share of the budget, relative to the others still to tune."""
    return 3.0 if num_tokens >= LARGE_TOKENS else 1.0 if num_tokens >= 64 else 0.5


def _cfg_items(cfg: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple((k, int(cfg.get(k, _configs.DEFAULT_GEMM[k]))) for k in _configs._GEMM_KEYS)


def prior_winners(table: Mapping[str, Mapping[int, Mapping[str, Any]]], block_m: int, part: str) -> list[dict]:
    """GEMM tiles that won for this BLOCK_M in shipped tables, most often first: where a new shape's best tile is
    likely to be, so they are timed before the rest of the candidates."""
    counts: dict[tuple, int] = {}
    for per_t in table.values():
        for cfg in per_t.values():
            if cfg.get("BLOCK_M") == block_m and part in cfg:
                items = _cfg_items(cfg[part])
                counts[items] = counts.get(items, 0) + 1
    return [dict(items) for items, _ in sorted(counts.items(), key=lambda kv: -kv[1])]


def candidate_plan(
    num_experts: int,
    hidden: int,
    intermediate: int,
    top_k: int,
    num_tokens: int,
    *,
    elem: int = 2,
    prior: Mapping[str, Mapping[int, Mapping[str, Any]]] | None = None,
    num_sms: int = 132,
) -> dict[int, dict[str, list[dict[str, int]]]]:
    """{BLOCK_M: {"gate_up": [tiles], "down": [tiles]}}, the heuristics' BLOCK_M first, each list most promising
    first: the heuristics' own tiles (the baseline every tuned entry must beat), then the shipped tables'
    winners for that BLOCK_M, then the rest of the tuner's candidates."""
    dtype = torch.float16 if elem == 2 else torch.float32
    default = _configs.normalize(
        _configs.default_config(num_experts, hidden, intermediate, num_tokens, top_k, dtype, num_sms=num_sms)
    )
    bms = [default["BLOCK_M"]] + [bm for bm in block_m_candidates(num_tokens, top_k, num_experts)]
    from .kernels import PAIR_BLOCK_MAX_TOKENS

    token_cell = num_tokens <= PAIR_BLOCK_MAX_TOKENS and intermediate >= _configs.TOKEN_DOWN_MIN_I
    plan: dict[int, dict[str, list[dict[str, int]]]] = {}
    for bm in dict.fromkeys(bms):
        plan[bm] = {}
        for part in GEMM_PARTS:
            n_out = intermediate if part == "gate_up" else hidden
            first = [default[part]] if bm == default["BLOCK_M"] else []
            ranked = prior_winners(prior or {}, bm, part)
            rest = gemm_candidates(bm, n_out, part == "gate_up", elem)
            if part == "down" and num_tokens <= PAIR_BLOCK_MAX_TOKENS:  # pair blocks: down may split K
                rest = with_down_splits(rest)
            if part == "down" and token_cell:  # the layer may run _token_down_kernel (K-contiguous weights)
                rest = token_down_candidates(elem) + rest
            allowed = {_cfg_items(c) for c in rest}
            seen: set[tuple] = set()
            plan[bm][part] = []
            for cfg in first + [c for c in ranked if _cfg_items(c) in allowed] + rest:
                if _cfg_items(cfg) not in seen:
                    seen.add(_cfg_items(cfg))
                    plan[bm][part].append(dict(cfg))
    return plan


@dataclass(frozen=True)
class Task:
    """One timing: the align for a BLOCK_M (part "align"), one GEMM with one tile config, or the whole layer with
    the configuration `layer` (``configs.encode_config``), without or with the persistent GEMM (LAYER_PARTS)."""

    num_tokens: int
    block_m: int
    part: str
    tiles: tuple[tuple[str, int], ...] = ()
    layer: tuple[int, ...] = ()

    @property
    def config(self) -> dict[str, int]:
        return dict(self.tiles)

    @property
    def kernel(self) -> tuple:
        """What Triton compiles once and reuses for every token count (a layer timing: the persistent kernel,
        built once for every configuration, or tiles the GEMM timings built already)."""
        return (self.part,) if self.part in LAYER_PARTS else (self.block_m, self.part, self.tiles)


class CostGuess:
    """What the next timing will cost in seconds of the budget: a new tile config compiles first, a seen one
    does not. The largest cost seen so far of each kind, so the budget is not overrun by a slow compile."""

    def __init__(self) -> None:
        self.new = NEW_KERNEL_GUESS_S
        self.repeat = REPEAT_GUESS_S
        self._seen_new = self._seen_repeat = False
        self.compiled: set[tuple] = set()

    def expect(self, task: Task) -> float:
        if task.kernel in self.compiled:
            return self.repeat
        return PERSISTENT_BUILD_GUESS_S if task.part == "layer_persistent" else self.new

    def observe(self, task: Task, seconds: float) -> None:
        if task.part in LAYER_PARTS:  # a build of the persistent kernel says nothing about a tile config's
            self.compiled.add(task.kernel)
            return
        if task.kernel in self.compiled:
            self.repeat = max(seconds, self.repeat) if self._seen_repeat else seconds
            self._seen_repeat = True
        else:
            self.new = max(seconds, self.new) if self._seen_new else seconds
            self._seen_new = True
            self.compiled.add(task.kernel)


@dataclass
class CellSearch:
    """The search for one token count: timings in rounds (round r times the r-th tile of every GEMM of every
    BLOCK_M still in the running), so each BLOCK_M has a complete configuration after the first round; from the
    third round a BLOCK_M far behind the best gets no more timings."""

    num_tokens: int
    plan: Mapping[int, Mapping[str, Sequence[Mapping[str, int]]]]
    weight: float = 1.0
    persistent: bool = False  # the persistent GEMM can run this layer at this token count (persistent_candidate)
    align_s: dict[int, float] = field(default_factory=dict)
    best: dict[tuple[int, str], tuple[float, dict[str, int]]] = field(default_factory=dict)
    baseline_s: dict[str, float] = field(default_factory=dict)
    layer_s: dict[str, float] = field(default_factory=dict)  # LAYER_PARTS' times of the best tiles
    measured: int = 0
    _round: int = 0
    _queue: list[Task] = field(default_factory=list)
    _dropped: set[int] = field(default_factory=set)
    _layer_asked: bool = False

    def __post_init__(self) -> None:
        self._fill()

    def _total(self, bm: int) -> float | None:
        parts = [self.best.get((bm, p)) for p in GEMM_PARTS]
        if bm not in self.align_s or any(p is None for p in parts):
            return None
        return self.align_s[bm] + sum(p[0] for p in parts if p is not None)

    def _fill(self) -> None:
        while not self._queue:
            r = self._round
            if r >= 2:
                totals = {bm: self._total(bm) for bm in self.plan if bm not in self._dropped}
                known = [t for t in totals.values() if t is not None]
                if known:
                    best = min(known)
                    self._dropped |= {bm for bm, t in totals.items() if t is None or t > DROP_BLOCK_M_ABOVE * best}
            live = [bm for bm in self.plan if bm not in self._dropped]
            if not any(r < len(self.plan[bm][p]) for bm in live for p in GEMM_PARTS):
                self._ask_layer()
                return
            for bm in live:
                if r == 0:
                    self._queue.append(Task(self.num_tokens, bm, "align"))
                for p in GEMM_PARTS:
                    if r < len(self.plan[bm][p]):
                        self._queue.append(Task(self.num_tokens, bm, p, _cfg_items(self.plan[bm][p][r])))
            self._round += 1

    def _ask_layer(self) -> None:
        """The tiles are found: where the persistent GEMM may take them, the layer with and without it, once."""
        if self._layer_asked or not self.persistent:
            return
        self._layer_asked = True
        found = self._tiles()
        if found is not None and found[0]["BLOCK_M"] == _configs.PERSISTENT_BLOCK_M:
            layer = tuple(_configs.encode_config(found[0]))
            self._queue += [Task(self.num_tokens, found[0]["BLOCK_M"], p, layer=layer) for p in LAYER_PARTS]

    def next_task(self) -> Task | None:
        return self._queue[0] if self._queue else None

    def record(self, task: Task, seconds: float) -> None:
        """A task's measured kernel time (inf: it did not run here)."""
        self._queue.pop(0)
        self.measured += 1
        if task.part == "align":
            if math.isfinite(seconds):
                self.align_s[task.block_m] = seconds
            else:
                self._dropped.add(task.block_m)
                self._queue = [t for t in self._queue if t.block_m != task.block_m]
        elif task.part in LAYER_PARTS:
            self.layer_s[task.part] = seconds
        elif math.isfinite(seconds):
            key = (task.block_m, task.part)
            if key not in self.best or seconds < self.best[key][0]:
                self.best[key] = (seconds, task.config)
            first_bm = next(iter(self.plan))
            if task.block_m == first_bm and task.tiles == _cfg_items(self.plan[first_bm][task.part][0]):
                self.baseline_s[task.part] = seconds  # the heuristics' own tiles
        self._fill()

    @property
    def done(self) -> bool:
        return not self._queue

    def _tiles(self) -> tuple[dict[str, Any], float] | None:
        totals = {bm: t for bm in self.plan if (t := self._total(bm)) is not None}
        if not totals:
            return None
        bm = min(totals, key=totals.__getitem__)
        cfg = {"BLOCK_M": bm, **{p: dict(self.best[(bm, p)][1]) for p in GEMM_PARTS}}
        return _configs.normalize(cfg), totals[bm]

    def takes_persistent(self) -> bool:
        """Whether the layer timed faster, by PERSISTENT_MIN_GAIN or more, with the persistent GEMM."""
        plain, persistent = (self.layer_s.get(p, math.inf) for p in LAYER_PARTS)
        return math.isfinite(plain) and persistent <= (1 - PERSISTENT_MIN_GAIN) * plain

    def result(self) -> tuple[dict[str, Any], float] | None:
        """(best full config, its align + GEMM seconds), or None before one BLOCK_M is complete; PERSISTENT set
        where ``takes_persistent``."""
        found = self._tiles()
        if found is None or not self.takes_persistent():
            return found
        return _configs.normalize({**found[0], "PERSISTENT": 1}), found[1]

    def default_s(self) -> float | None:
        """The heuristics' own configuration's time, when all of it was measured."""
        bm = next(iter(self.plan))
        if bm in self.align_s and all(p in self.baseline_s for p in GEMM_PARTS):
            return self.align_s[bm] + sum(self.baseline_s[p] for p in GEMM_PARTS)
        return None


@dataclass
class SearchOutcome:
    cells: dict[int, CellSearch]
    seconds: float
    cut_short: bool
    measured: int


def run_search(
    cells: Sequence[CellSearch],
    measure: Callable[[Task], float],
    budget_s: float,
    *,
    clock: Callable[[], float] = time.perf_counter,
    start: float | None = None,
    cost: CostGuess | None = None,
) -> SearchOutcome:
    """Time the cells' tasks until each is done or the budget is spent; never starts a timing expected to end
    past the budget. First pass: each cell (most important first) gets its weight's share of what is left, what
    it does not use goes to the cells after it; second pass: the budget left goes to the cells not done, in the
    same order. `measure(task)` returns the kernel's seconds (raises when the tiles cannot run here). `cost`: what
    timings cost, learnt by an earlier search in this process (kernels it compiled are not built again)."""
    t0 = clock() if start is None else start
    deadline = t0 + max(0.0, budget_s)
    cost = cost or CostGuess()
    order = list(cells)

    def work(cell: CellSearch, until: float) -> None:
        while (task := cell.next_task()) is not None:
            if clock() + cost.expect(task) > until:
                return
            before = clock()
            try:
                seconds = float(measure(task))
            except Exception as exc:  # noqa: BLE001 - tiles this GPU cannot run (resources): the others count
                _log.info(
                    "T=%d BM=%d %s %s: skipped (%s: %s)",
                    task.num_tokens,
                    task.block_m,
                    task.part,
                    task.config,
                    type(exc).__name__,
                    str(exc)[:120],
                )
                seconds = math.inf
            cost.observe(task, clock() - before)
            cell.record(task, seconds)

    for i, cell in enumerate(order):
        now = clock()
        weights = sum(c.weight for c in order[i:])
        work(cell, min(deadline, now + (deadline - now) * cell.weight / weights))
    for cell in order:
        work(cell, deadline)
    return SearchOutcome(
        cells={c.num_tokens: c for c in order},
        seconds=clock() - t0,
        cut_short=not all(c.done for c in order),
        measured=sum(c.measured for c in order),
    )


# --- timing on the GPU ------------------------------------------------------------------------------------------


def _do_bench_timer(fn: Callable[[], None]) -> float:
    return _bench(fn, SEARCH_WARMUP_MS, SEARCH_REP_MS)


class LayerBench:
    """Times a problem's align and GEMMs on random weights laid out as the problem stores them (transposed,
    interleaved, biases): `bench(task) -> seconds`. Inputs for one token count at a time are kept."""

    def __init__(
        self,
        problem: Problem,
        device: torch.device,
        timer: Callable[[Callable[[], None]], float],
        weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`weights`: (gate_up, down) as the problem stores them, instead of random ones."""
        from . import kernels as _k

        self._k, self.timer, self.device = _k, timer, device
        self.dtype = getattr(torch, problem.dtype)
        e, h, i_dim = problem.num_experts, problem.hidden_size, problem.intermediate_size
        self.e, self.h, self.i_dim, self.top_k = e, h, i_dim, problem.top_k
        g = torch.Generator(device=device).manual_seed(0)
        shape1 = (e, h, 2 * i_dim) if problem.is_transposed else (e, 2 * i_dim, h)
        shape2 = (e, i_dim, h) if problem.is_transposed else (e, h, i_dim)
        if weights is None:
            weights = (
                torch.randn(shape1, device=device, dtype=self.dtype, generator=g) / math.sqrt(h),
                torch.randn(shape2, device=device, dtype=self.dtype, generator=g) / math.sqrt(i_dim),
            )
        self.w1, self.w2 = weights
        self.b1 = torch.randn(e, 2 * i_dim, device=device, dtype=self.dtype) if problem.has_bias else None
        self.b2 = torch.randn(e, h, device=device, dtype=self.dtype) if problem.has_bias else None
        self.interleaved, self.transposed = problem.interleaved, problem.is_transposed
        gate = problem.gate
        # the layer's own gate in the gate_up epilogue (the clamped SwiGLU's alpha and limit as runtime scalars)
        plain = gate.is_default and problem.activation in _k.SUPPORTED_ACTIVATIONS
        self.layer = _k.fused_layer(
            self.w1,
            self.w2,
            num_experts=e,
            activation=problem.activation if plain else "silu",
            interleaved=self.interleaved,
            transposed=self.transposed,
            gate_up_bias=self.b1,
            down_bias=self.b2,
            gate=gate.name,
            gate_alpha=gate.alpha,
            gate_limit=gate.limit,
        )
        self.prec = _k._dot_precision(self.dtype)
        self.activation = problem.activation
        self._cell: tuple[int, dict[str, Any]] | None = None

    def _inputs(self, num_tokens: int) -> dict[str, Any]:
        if self._cell is None or self._cell[0] != num_tokens:
            self._cell = None  # free the last token count's buffers first
            g = torch.Generator(device=self.device).manual_seed(num_tokens)
            ids, tw = _routing(num_tokens, self.top_k, self.e, self.device, g)
            pairs = num_tokens * self.top_k
            self._cell = (
                num_tokens,
                {
                    "x": torch.randn(num_tokens, self.h, device=self.device, dtype=self.dtype, generator=g),
                    "ids": ids.reshape(-1).contiguous(),
                    "tw": tw.reshape(-1).contiguous(),
                    "pairs": pairs,
                    "inter": torch.randn(
                        self._k.inter_rows_bound(pairs, self.e),
                        self.i_dim,
                        device=self.device,
                        dtype=self.dtype,
                        generator=g,
                    ),  # rows in pair order or in block order
                    "y": torch.empty(pairs, self.h, device=self.device, dtype=self.dtype),
                    "aligned": {},
                },
            )
        return self._cell[1]

    def __call__(self, task: Task) -> float:
        k, c = self._k, self._inputs(task.num_tokens)
        bm = task.block_m
        pair_blocks = task.num_tokens <= k.PAIR_BLOCK_MAX_TOKENS  # the layer runs _pair_gemm_kernel, no align
        if task.part == "align":
            return 0.0 if pair_blocks else self.timer(lambda: k.align(c["ids"], self.e, bm))
        if task.part in LAYER_PARTS:
            return self._time_layer(task, c)
        cfg = task.config
        if pair_blocks:
            return self._time_pair_blocks(task.part, cfg, c)
        if bm not in c["aligned"]:
            c["aligned"][bm] = k.align(c["ids"], self.e, bm)
        rows, blocks = c["aligned"][bm]
        # the TMA layout the layer would run these tiles with (kernels.part_layout)
        tma = k.part_layout(
            task.part,
            self.w1 if task.part == "gate_up" else self.w2,
            bm,
            cfg,
            i_dim=self.i_dim,
            interleaved=self.interleaved,
            transposed=self.transposed,
        )
        sort_x = task.part == "gate_up" and tma["a_tma"]  # the layer's copy of x into block order, timed with it
        gemm, a, out, topk_w, a_div = self._part_args(task.part, c, sort_x)
        grouping = k.Blocks(rows, blocks, bm, c["pairs"])
        return self.timer(
            lambda: k._launch_gemm(
                gemm,
                k.rows_in_block_order(a, rows, c["pairs"], self.top_k) if sort_x else a,
                out,
                grouping,
                topk_w,
                cfg,
                a_div=a_div,
                dot_prec=self.prec,
                tma=tma,
            )
        )

    def _time_layer(self, task: Task, c: dict[str, Any]) -> float:
        """The whole layer (align, copies, GEMMs, combine) with the task's configuration, the persistent GEMM
        asked for or not (LAYER_PARTS). Only for layers ``persistent_candidate`` lets through: act_mul gates."""
        cfg = {**_configs.decode_config(list(task.layer)), "PERSISTENT": int(task.part == "layer_persistent")}
        ids, tw = c["ids"].view(-1, self.top_k), c["tw"].view(-1, self.top_k)
        return self.timer(
            lambda: self._k.fused_experts(
                c["x"],
                self.w1,
                self.w2,
                ids,
                tw,
                num_experts=self.e,
                activation=self.activation,
                interleaved=self.interleaved,
                transposed=self.transposed,
                gate_up_bias=self.b1,
                down_bias=self.b2,
                config=cfg,
            )
        )

    def _time_pair_blocks(self, part: str, cfg: dict[str, int], c: dict[str, Any]) -> float:
        """One token: the layer's two launches, gate_up or down, as the layer runs them: down as
        ``_token_down_kernel`` where ``kernels.token_down`` says so, else a ``_pair_gemm_kernel`` with the k-way
        sum in its epilogue, into the layer's output (each call leaves the counters at zero for the next)."""
        k = self._k
        if "counts" not in c:  # enough counters for any BLOCK_N of the down GEMM
            c["counts"] = torch.zeros(
                c["pairs"] // self.top_k * k.cdiv(self.h, 16), dtype=torch.int32, device=self.device
            )
            c["part"] = torch.empty(c["pairs"] * max(PAIR_DOWN_SPLITS), self.h, dtype=torch.float32, device=self.device)
            c["out"] = torch.empty(c["pairs"] // self.top_k, self.h, dtype=self.dtype, device=self.device)
        gemm, a, out, _, a_div = self._part_args(part, c, False)
        first = part == "gate_up"
        by_token = k.token_down(self.i_dim, self.layer.dn.stride_wk)
        route = k.Route(c["ids"], c["tw"], None, self.e, self.top_k)
        if by_token and not first:
            return self.timer(lambda: k._launch_token_down(gemm, a, c["out"], route, cfg, dot_prec=self.prec))
        scratch = (c["part"], c["counts"])
        launch = lambda: k._launch_pair_gemm(  # noqa: E731
            gemm,
            a,
            out if first else c["out"],
            route,
            scratch,
            cfg,
            a_div=a_div,
            dot_prec=self.prec,
            first=first,
            combine_out=not first,
            mul_w=first and by_token,
        )
        return self.timer(launch)

    def _part_args(self, part: str, c: dict[str, Any], sort_x: bool) -> tuple:
        """One GEMM's (record, input, output, routing weights, a_div) as the layer passes them."""
        if part == "gate_up":
            return self.layer.up, c["x"], c["inter"], None, 1 if sort_x else self.top_k
        return self.layer.dn, c["inter"], c["y"], c["tw"], 1


# --- the entry point --------------------------------------------------------------------------------------------

NEEDS_CUDA = (
    "triton_fused tune: needs a CUDA GPU and none is visible (it times the kernels on the GPU the tiles "
    "are for); run it on that GPU's node"
)


def _not_tunable(problem: Problem) -> str | None:
    if problem.weight_format != "dense":
        return (
            f"{problem.weight_format} experts run plugins/quant_kernels' tiles; tune them with "
            "`python -m selector.plugins.quant_kernels.tune`"
        )
    if not problem.gated:
        return "the tile tables hold gated experts only; non-gated layers run the heuristics' tiles"
    if problem.dtype not in ("bfloat16", "float16"):
        return f"the tile tables hold bfloat16 / float16 layers only, not {problem.dtype}"
    if problem.gate.custom or problem.post_expert_norm:
        what = "a custom gate function" if problem.gate.custom else "a post-expert norm"
        return f"triton_fused does not run layers with {what}: there are no tiles to tune for them"
    return None


def persistent_candidate(problem: Problem, num_tokens: int, capability: tuple[int, int] | None, gluon: bool) -> bool:
    """Whether the tuner times the layer with the persistent Hopper GEMM at this token count: what
    ``kernels.persistent_fits`` asks of a layer (Gluon built, an sm_90 GPU of `capability`, 16-bit, weights as
    stored read by TMA, concatenated gate and up with the act_mul gate), above the one-token path, and its copies
    within the temporaries bound (``kernels.x_copy_fits``). None `capability`: no GPU."""
    from . import hopper_gemm
    from . import kernels as _k

    if not gluon or capability is None or capability[0] != 9 or num_tokens <= _k.PAIR_BLOCK_MAX_TOKENS:
        return False
    if problem.is_transposed or problem.interleaved or not problem.gate.is_default:
        return False
    if problem.dtype not in ("bfloat16", "float16") or problem.gate.custom or problem.post_expert_norm:
        return False
    e, h, i_dim, k = problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k
    return _k.x_copy_fits(num_tokens, k, h, i_dim, hopper_gemm.compact_rows(num_tokens * k, e))


def _prior() -> dict[str, dict[int, dict[str, Any]]]:
    from selector.plugins.tile_tables import read_table

    table: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(_configs.CONFIG_DIR.glob("*.json")):
        for key, per_t in read_table(path, _configs.normalize).items():
            table.setdefault(f"{path.stem}:{key}", per_t)
    return table


def _keep_persistent(found: dict[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    """`found` with the persistent GEMM where the configuration it replaces had it and the blocks still fit it."""
    if before.get("PERSISTENT") and found["BLOCK_M"] == _configs.PERSISTENT_BLOCK_M:
        return _configs.normalize({**found, "PERSISTENT": 1})
    return found


def tune_kernels(
    problem: Problem,
    token_counts: Sequence[int] = TOKEN_COUNTS,
    budget_s: float = 60.0,
    *,
    force: bool = False,
    measure: Callable[[Task], float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    device_name: str | None = None,
    directory: str | Path | None = None,
    capability: tuple[int, int] | None = None,
    cost: CostGuess | None = None,
) -> dict[str, Any]:
    """Tune the tiles of one layer at these token counts on this GPU within `budget_s` seconds (compiles
    included) and merge them into the user tile table, where `configs.get_config` finds them first.

    The tiles go under the layer's shape in its weight layout (`configs.layout_key`: GPT-OSS's transposed,
    interleaved experts get their own entry). Shapes the shipped table has are left alone, and token counts the
    user table already holds measured tiles for are skipped, unless `force`. Largest token counts first, each
    with its share of the budget; a budget cut keeps the best tiles measured so far ("tokens_partial": tuned
    again next time) and writes the tiles that would run anyway for the token counts it never reached
    ("tokens_default"). Where the persistent Hopper GEMM can run the layer (``persistent_candidate``), each
    token count's best tiles with 128-row blocks are timed as a whole layer with and without it, and
    PERSISTENT is set where it is faster (``CellSearch.takes_persistent``). `measure`, `clock`, `device_name`,
    `directory` and `capability` replace the GPU timing, the clock, the GPU's name, the user table's folder and
    the GPU's compute capability (tests); `cost` carries what timings cost from one layer's search to the next.
    Returns a summary: tokens tuned and left on defaults, the configs
    chosen with their times and the defaults' times, the whole-layer times without and with the persistent
    GEMM where they were taken, seconds spent, whether the budget cut it short, and where it was written.
    """
    start = clock()
    key = _configs.layout_key(
        _configs.shape_key(problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k),
        transposed=problem.is_transposed,
        interleaved=problem.interleaved,
    )
    summary = tile_tables.tuning_summary(key, device_name, budget_s, _not_tunable(problem), default_us={}, layer_us={})
    if summary["skipped"]:
        return summary
    device = torch.device("cuda", problem.device_index)
    if measure is None and not torch.cuda.is_available():
        raise RuntimeError(NEEDS_CUDA)
    name = device_name or torch.cuda.get_device_name(device)
    summary["device"] = name
    if not force and _configs.shipped_has(name, key):
        summary["skipped"] = f"the shipped tile table for {name} has {key} (force=True tunes it again)"
        return summary
    wanted = token_order(token_counts)
    if not wanted:
        summary["skipped"] = "no token count (>= 1) was asked for"
        return summary
    done = set() if force else _configs.user_tuned_tokens(name, key, str(directory) if directory else None)
    todo = [t for t in wanted if t not in done]
    if not todo:
        summary["skipped"] = f"the user tile table already holds tuned tiles for {key} at every token count asked"
        return summary
    elem = 2
    num_sms = _configs._num_sms(problem.device_index) if measure is None else 132
    if measure is None:
        capability = torch.cuda.get_device_capability(device)
    from . import hopper_gemm

    prior = _prior()
    cells = [
        CellSearch(
            t,
            candidate_plan(
                problem.num_experts,
                problem.hidden_size,
                problem.intermediate_size,
                problem.top_k,
                t,
                elem=elem,
                prior=prior,
                num_sms=num_sms,
            ),
            token_weight(t),
            persistent=persistent_candidate(problem, t, capability, hopper_gemm.AVAILABLE),
        )
        for t in todo
    ]
    dtype = getattr(torch, problem.dtype)
    shape = _configs.LayerShape(problem.num_experts, problem.hidden_size, problem.intermediate_size, dtype,
                                transposed=problem.is_transposed, interleaved=problem.interleaved)  # fmt: skip
    before = {t: _configs.layer_config(shape, t, problem.top_k, device) for t in todo}  # what runs untuned
    if measure is None:
        measure = LayerBench(problem, device, _do_bench_timer)
    outcome = run_search(cells, measure, budget_s - (clock() - start), clock=clock, cost=cost)
    existing = _configs.load_user_table(name, str(directory) if directory else None).get(key, {})
    shipped = _configs.load_table(name, str(_configs._config_dir())).get(key, {}) if force else {}
    entries: dict[int, dict[str, Any]] = {}
    for t in todo:
        cell = outcome.cells[t]
        found = cell.result()
        if found is not None and cell.persistent and LAYER_PARTS[1] not in cell.layer_s:
            # a budget cut before the whole-layer timings: keep the persistent choice of the tiles that ran before
            found = (_keep_persistent(found[0], before[t]), found[1])
        if found is not None:
            entries[t] = found[0]
            summary["tokens_tuned" if cell.done else "tokens_partial"].append(t)
            summary["time_us"][t] = round(found[1] * 1e6, 2)
            if (base := cell.default_s()) is not None:
                summary["default_us"][t] = round(base * 1e6, 2)
            if all(math.isfinite(cell.layer_s.get(p, math.inf)) for p in LAYER_PARTS):
                summary["layer_us"][t] = {p: round(cell.layer_s[p] * 1e6, 2) for p in LAYER_PARTS}
        else:
            summary["tokens_default"].append(t)
            if t not in existing:  # what would run without the user table (a token count tuned before stays)
                entries[t] = (
                    _configs.entry_for(shipped, t)
                    if shipped
                    else _configs.normalize(
                        _configs.default_config(
                            problem.num_experts,
                            problem.hidden_size,
                            problem.intermediate_size,
                            t,
                            problem.top_k,
                            dtype,
                            num_sms=num_sms,
                        )
                    )
                )
        if t in entries:
            summary["configs"][t] = entries[t]
    if summary["tokens_tuned"] or summary["tokens_partial"]:
        # only finished searches count as tuned: a later run picks up where a budget cut stopped
        path = _configs.write_user_entries(
            name, key, entries, summary["tokens_tuned"], dtype=problem.dtype, directory=directory
        )
        summary["written_to"] = str(path)
    summary["cut_short"] = outcome.cut_short
    summary["seconds"] = round(clock() - start, 3)
    _log.info(
        "%s on %s: tuned T=%s in %.1fs%s",
        key,
        name,
        summary["tokens_tuned"],
        summary["seconds"],
        " (budget cut it short)" if outcome.cut_short else "",
    )
    return summary


def table_problems(presets: Sequence[str], shapes: Sequence[tuple[int, int, int, int]]) -> list[Problem]:
    """The layers a table is tuned for: "public" (every public preset's shape the tables hold,
    `presets.tabled_presets`), "grid" (the perf grid's), or preset names; then plain (E, H, I, k) shapes. One per
    table entry (shape and layout), bfloat16 on CUDA."""
    from selector.presets import GRID_PRESETS, preset, tabled_presets

    names: list[str] = []
    for name in presets:
        names += tabled_presets() if name == "public" else list(GRID_PRESETS) if name == "grid" else [name]
    found = [preset(n) for n in names] + [Problem(num_experts=e, hidden_size=h, intermediate_size=i, top_k=k)
                                          for e, h, i, k in shapes]  # fmt: skip
    unique = {_table_key(p): replace(p, dtype="bfloat16", device="cuda") for p in reversed(found)}
    return list(reversed(unique.values()))


def _table_key(problem: Problem) -> str:
    size = _configs.shape_key(problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k)
    return _configs.layout_key(size, transposed=problem.is_transposed, interleaved=problem.interleaved)


TABLE_BUDGET_S = 20.0  # seconds per layer: tune_kernels' search finds tiles within a few per cent of a long one


def tune_table(
    problems: Sequence[Problem],
    out: Path,
    token_counts: Sequence[int] = TOKEN_COUNTS,
    budget_s: float = TABLE_BUDGET_S,
    *,
    resume: bool = False,
    command: str = "",
    tune: Callable[..., dict[str, Any]] = tune_kernels,
) -> Path:
    """A shipped tile table for this GPU: each layer's tiles found by ``tune_kernels``' search (`budget_s` each; the
    first layer also pays the persistent kernel's build), merged into `out` after each layer so a cut run keeps
    what it found; `resume` skips the layers `out` holds. Only measured cells are written (finished searches are
    listed as "tuned", those the budget cut keep their best tiles so far); a token count the search never reached
    is left to the table's other token counts of the layer. The header names this GPU's SM count and compute
    capability (what ``configs.nearest_config`` matches another GPU by) and the `commands` that made the table."""
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    try:
        made_by = [c for c in tile_tables.read_document(out).get("commands", []) if isinstance(c, str)]
    except ValueError:
        made_by = []
    header = {
        "version": 1,
        "device": props.name,
        "dtype": "bfloat16",
        "num_sms": props.multi_processor_count,
        "capability": list(torch.cuda.get_device_capability(device)),
        "commands": list(dict.fromkeys([*made_by, command] if command else made_by)),
    }
    held = set(tile_tables.read_table(out, _configs.normalize)) if resume else set()
    cost = CostGuess()
    with tempfile.TemporaryDirectory() as scratch:
        for problem in problems:
            key = _table_key(problem)
            if key in held:
                continue
            built = ("layer_persistent",) in cost.compiled
            summary = tune(problem, token_counts, budget_s + (0.0 if built else PERSISTENT_BUILD_GUESS_S),
                           force=True, directory=scratch, cost=cost)  # fmt: skip
            measured = {t: summary["configs"][t] for t in (*summary["tokens_tuned"], *summary["tokens_partial"])}
            if summary["skipped"] or not measured:
                _log.warning("%s: not tuned (%s)", key, summary["skipped"] or "the budget ran out before any tiles ran")
                continue
            tile_tables.merge_entries(out, key, measured, summary["tokens_tuned"], header, "triton_fused")
            _log.warning("%s: T=%s tuned, T=%s cut by the budget, in %.0f s", key, sorted(summary["tokens_tuned"]),
                         sorted(summary["tokens_partial"]), summary["seconds"])  # fmt: skip
    _configs.clear_caches()
    return out


def _shape_arg(text: str) -> tuple[int, int, int, int]:
    values = whole_numbers(1)(text)
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"--shape takes four positive integers E,H,I,k, got {text!r}")
    return values[0], values[1], values[2], values[3]


def _shown_command(argv: Sequence[str], out: Path) -> str:
    """The command as a maintainer reruns it: the table written where it ships, whatever --out this run named."""
    shown, skip = [], False
    for arg in argv:
        if skip or arg == "--out" or arg.startswith("--out="):
            skip = arg == "--out"
            continue
        shown.append(arg)
    shipped = Path("plugins/triton_fused/configs") / out.name
    return " ".join(["python -m selector.plugins.triton_fused.tune", *shown, "--out", str(shipped)])


def main(argv: list[str] | None = None) -> int:
    """Exit 0 after writing the table, 1 when it cannot run here (one line; --debug: the traceback), 2 on bad flags."""
    import sys

    from selector.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", action="append", choices=["public", "grid", *PRESETS],
                   help="public (default): every public preset's shape but the held-out ones; grid; or a preset name")  # fmt: skip
    p.add_argument("--shape", action="append", default=[], type=_shape_arg, help="E,H,I,k (repeatable)")
    p.add_argument("--tokens", type=whole_numbers(1), default=list(TOKEN_COUNTS), help="comma list of token counts")
    p.add_argument("--budget", type=number(0.0, inclusive=False), default=TABLE_BUDGET_S,
                   help="seconds of search per layer")  # fmt: skip
    p.add_argument("--out", default=None, help="JSON path (default: configs/<GPU name>.json in the package)")
    p.add_argument("--resume", action="store_true", help="skip the layers --out already holds")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    a = p.parse_args(argv)
    problems = table_problems(a.preset or ([] if a.shape else ["public"]), a.shape)

    def write() -> str:
        out = Path(a.out or _configs.CONFIG_DIR / _configs.config_file_name(torch.cuda.get_device_name()))
        command = _shown_command(argv if argv is not None else sys.argv[1:], out)
        return str(tune_table(problems, out, a.tokens, a.budget, resume=a.resume, command=command))

    return tile_tables.run_tuner("triton_fused", "the kernel", torch.cuda.is_available(), a.debug, write)


if __name__ == "__main__":
    raise SystemExit(main())
