"""Tune the fused experts kernels' tile configs on this GPU and write them as JSON (see configs.py).

    python -m selector.plugins.triton_fused.tune --preset grid --out plugins/triton_fused/configs/NVIDIA_H200.json

For every (shape, token count) it tries each candidate BLOCK_M; for each, it times the gate_up GEMM and the
down GEMM separately over their candidate tiles (triton.testing.do_bench, median), and keeps the BLOCK_M whose
align + best gate_up + best down is fastest. Random inputs, uniform top-k routing with distinct experts.

``tune_kernels`` (the backend's ``BackendSpec.tune_kernels``, run by ``selector tune``) is the same search for
one layer within a budget of seconds, written to this node's user tile table (configs.py); see its docstring.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from selector.plugins import tile_tables
from selector.types import Problem

from . import configs as _configs

# The kernels (and triton) are imported where a kernel runs, so the CLI and the search logic load on a machine
# without them and say what is missing in one line.

PRESETS: dict[str, list[tuple[int, int, int, int]]] = {
    # (E, H, I, k)
    "grid": [(60, 2048, 1408, 4), (128, 2048, 768, 8), (8, 4096, 14336, 2), (256, 7168, 2048, 8)],
    "qwen3": [(128, 2048, 768, 8)],
    "small": [(60, 2048, 1408, 4), (128, 2048, 768, 8)],
}
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


def tune_cell(
    w1: torch.Tensor,
    w2: torch.Tensor,
    num_tokens: int,
    top_k: int,
    *,
    gated: bool = True,
    warmup_ms: float = 5.0,
    rep_ms: float = 20.0,
    log=print,
) -> dict[str, Any]:
    """Best config for one shape (weights w1 [E, 2I, H], w2 [E, H, I]) and token count; with timings."""
    from . import kernels as _k

    e, _, h = w1.shape
    i_dim = w2.shape[2]
    dev, dt = w1.device, w1.dtype
    if num_tokens <= _k.PAIR_BLOCK_MAX_TOKENS:
        if not gated:
            raise ValueError("triton_fused tune: the tile tables hold gated experts only")
        problem = Problem(
            num_experts=e, hidden_size=h, intermediate_size=i_dim, top_k=top_k, dtype=str(dt).replace("torch.", "")
        )
        bench = LayerBench(problem, dev, lambda fn: _bench(fn, warmup_ms, rep_ms), weights=(w1, w2))
        return _tune_pair_cell(bench, num_tokens, log)
    elem = w1.element_size()
    x = torch.randn(num_tokens, h, device=dev, dtype=dt)
    ids, tw = _routing(num_tokens, top_k, e, dev)
    ids_flat, tw_flat = ids.reshape(-1), tw.reshape(-1)
    n_pairs = num_tokens * top_k
    inter = torch.randn(_k.inter_rows_bound(n_pairs, e), i_dim, device=dev, dtype=dt)  # block order fits too
    y = torch.empty(n_pairs, h, device=dev, dtype=dt)
    prec = _k._dot_precision(dt)
    layer = _k.fused_layer(w1, w2, num_experts=e, gated=gated)  # silu: the tables' tiles are per shape
    best: dict[str, Any] | None = None
    for bm in block_m_candidates(num_tokens, top_k, e):
        sorted_rows, block_expert = _k.align(ids_flat, e, bm)
        blocks = _k.Blocks(sorted_rows, block_expert, bm, n_pairs)
        t_align = _bench(lambda: _k.align(ids_flat, e, bm), warmup_ms, rep_ms)
        parts: dict[str, tuple[float, dict[str, int]]] = {}
        for part in ("gate_up", "down"):
            n_out = i_dim if part == "gate_up" else h
            for cfg in gemm_candidates(bm, n_out, gated and part == "gate_up", elem):
                full = dict(cfg)
                # the TMA layout the layer would run these tiles with (kernels.part_layout)
                tma = _k.part_layout(part, w1 if part == "gate_up" else w2, bm, full, i_dim=i_dim, gated=gated)
                if part == "gate_up":  # x copied into block order where the layer copies it, the copy timed
                    fn = lambda: _k._launch_gemm(  # noqa: E731
                        layer.up,
                        _k.rows_in_block_order(x, sorted_rows, n_pairs, top_k) if tma["a_tma"] else x,
                        inter,
                        blocks,
                        None,
                        full,
                        a_div=1 if tma["a_tma"] else top_k,
                        dot_prec=prec,
                        tma=tma,
                    )
                else:
                    fn = lambda: _k._launch_gemm(  # noqa: E731
                        layer.dn, inter, y, blocks, tw_flat, full, a_div=1, dot_prec=prec, tma=tma
                    )
                _keep_fastest(parts, part, cfg, lambda fn=fn: _bench(fn, warmup_ms, rep_ms), log, f"BM={bm}")
        if len(parts) < 2:
            continue
        total = t_align + parts["gate_up"][0] + parts["down"][0]
        log(
            f"  T={num_tokens} BM={bm}: align {t_align * 1e6:.1f}us gate_up {parts['gate_up'][0] * 1e6:.1f}us "
            f"{parts['gate_up'][1]} down {parts['down'][0] * 1e6:.1f}us {parts['down'][1]}"
        )
        if best is None or total < best["time_s"]:
            best = {
                "config": {"BLOCK_M": bm, "gate_up": parts["gate_up"][1], "down": parts["down"][1]},
                "time_s": total,
                "gate_up_s": parts["gate_up"][0],
                "down_s": parts["down"][0],
                "align_s": t_align,
            }
    if best is None:
        raise RuntimeError(f"no candidate config ran for T={num_tokens}")
    return best


def _keep_fastest(
    best: dict[str, tuple[float, dict[str, int]]],
    part: str,
    cfg: dict[str, int],
    run: Callable[[], float],
    log,
    label: str,
) -> None:
    """Times one tile config (`run()`: seconds) and keeps it as best[part] when fastest; a config that does not
    compile or run here (resources) is logged and left out."""
    try:
        t = run()
    except Exception as exc:
        log(f"    skip {label} {part} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
        return
    if part not in best or t < best[part][0]:
        best[part] = (t, cfg)


def _tune_pair_cell(bench: LayerBench, num_tokens: int, log=print) -> dict[str, Any]:
    """``tune_cell`` where the layer runs pair blocks (no align; each GEMM's tiles timed on its own launch)."""
    bm = 16
    best: dict[str, tuple[float, dict[str, int]]] = {}
    by_token = bench._k.token_down(bench.i_dim, bench.s2[1])
    for part in GEMM_PARTS:
        n_out = bench.i_dim if part == "gate_up" else bench.h
        if part == "down" and by_token:
            cands = token_down_candidates(bench.w1.element_size())
        else:
            cands = gemm_candidates(bm, n_out, part == "gate_up", bench.w1.element_size())
            if part == "down":
                cands = with_down_splits(cands)
        for cfg in cands:
            task = Task(num_tokens, bm, part, _cfg_items(cfg))
            _keep_fastest(best, part, cfg, lambda task=task: bench(task), log, "pair blocks")
    if len(best) < 2:
        raise RuntimeError(f"no candidate config ran for T={num_tokens}")
    log(
        f"  T={num_tokens} pair blocks: gate_up {best['gate_up'][0] * 1e6:.1f}us {best['gate_up'][1]} "
        f"down {best['down'][0] * 1e6:.1f}us {best['down'][1]}"
    )
    return {
        "config": {"BLOCK_M": bm, "gate_up": best["gate_up"][1], "down": best["down"][1]},
        "time_s": best["gate_up"][0] + best["down"][0],
        "gate_up_s": best["gate_up"][0],
        "down_s": best["down"][0],
        "align_s": 0.0,
    }


def tune(
    shapes: Iterable[tuple[int, int, int, int]],
    token_counts: Iterable[int] = TOKEN_COUNTS,
    dtype: torch.dtype = torch.bfloat16,
    out_path: str | Path | None = None,
    *,
    warmup_ms: float = 5.0,
    rep_ms: float = 20.0,
    log=print,
) -> dict[str, Any]:
    """Tune every (shape, token count); merge into the JSON at out_path (if given) and return that document.

    shapes: (E, H, I, k) tuples. Weights are random, [E, 2I, H] and [E, H, I] (gated, not transposed).
    """
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    doc: dict[str, Any] = {"version": 1, "device": name, "dtype": str(dtype).replace("torch.", ""), "configs": {}}
    if out_path is not None and Path(out_path).exists():
        try:
            old = json.loads(Path(out_path).read_text())
            if old.get("device") == name:
                doc["configs"].update(old.get("configs", {}))
        except ValueError:
            pass
    timings: dict[str, dict[str, float]] = {}
    for e, h, i_dim, top_k in shapes:
        key = _configs.shape_key(e, h, i_dim, top_k)
        log(f"{key}")
        g = torch.Generator(device=dev).manual_seed(0)
        w1 = (torch.randn(e, 2 * i_dim, h, device=dev, dtype=dtype, generator=g) / math.sqrt(h)).contiguous()
        w2 = (torch.randn(e, h, i_dim, device=dev, dtype=dtype, generator=g) / math.sqrt(i_dim)).contiguous()
        entry = doc["configs"].setdefault(key, {})
        timings[key] = {}
        for t in token_counts:
            best = tune_cell(w1, w2, t, top_k, warmup_ms=warmup_ms, rep_ms=rep_ms, log=log)
            entry[str(t)] = best["config"]
            timings[key][str(t)] = best["time_s"]
            log(f"  T={t}: best {best['time_s'] * 1e6:.1f}us (GEMMs + align) {best['config']}")
        del w1, w2
        torch.cuda.empty_cache()
    doc["tuned_seconds"] = round(time.perf_counter() - t0, 1)
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    _configs.clear_caches()
    log(f"tuning took {time.perf_counter() - t0:.1f}s")
    doc["_timings"] = timings
    return doc


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
) -> SearchOutcome:
    """Time the cells' tasks until each is done or the budget is spent; never starts a timing expected to end
    past the budget. First pass: each cell (most important first) gets its weight's share of what is left, what
    it does not use goes to the cells after it; second pass: the budget left goes to the cells not done, in the
    same order. `measure(task)` returns the kernel's seconds (raises when the tiles cannot run here)."""
    t0 = clock() if start is None else start
    deadline = t0 + max(0.0, budget_s)
    cost = CostGuess()
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
    the GPU's compute capability (tests). Returns a summary: tokens tuned and left on defaults, the configs
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
    if measure is None:
        measure = LayerBench(problem, device, _do_bench_timer)
    outcome = run_search(cells, measure, budget_s - (clock() - start), clock=clock)
    existing = _configs.load_user_table(name, str(directory) if directory else None).get(key, {})
    shipped = _configs.load_table(name, str(_configs._config_dir())).get(key, {}) if force else {}
    dtype = getattr(torch, problem.dtype)
    entries: dict[int, dict[str, Any]] = {}
    for t in todo:
        cell = outcome.cells[t]
        found = cell.result()
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
                    _configs.lookup({key: shipped}, key, t)
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


def main(argv: list[str] | None = None) -> int:
    """Exit 0 after writing the table, 1 when it cannot run here (one line; --debug: the traceback), 2 on bad flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="grid")
    p.add_argument("--shape", action="append", default=[], help="E,H,I,k (repeatable; added to the preset)")
    p.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)))
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--out", default=None, help="JSON path (default: configs/<GPU name>.json in the package)")
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    a = p.parse_args(argv)
    try:
        extra = [tuple(int(v) for v in s.split(",")) for s in a.shape]
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--shape takes E,H,I,k and --tokens a comma list, as integers; got {a.shape} and {a.tokens!r}")
    if any(len(s) != 4 or min(s) < 1 for s in extra) or not tokens or min(tokens) < 1:
        p.error("--shape takes four positive integers E,H,I,k and --tokens positive integers")
    shapes = list(PRESETS[a.preset]) + extra

    def write() -> str:
        out = a.out or str(_configs.CONFIG_DIR / _configs.config_file_name(torch.cuda.get_device_name()))
        tune(shapes, tokens, getattr(torch, a.dtype), out, rep_ms=a.rep_ms)
        return out

    return tile_tables.run_tuner("triton_fused", "the kernel", torch.cuda.is_available(), a.debug, write)


if __name__ == "__main__":
    raise SystemExit(main())
