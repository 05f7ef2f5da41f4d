"""The expert-parallel benchmark: dispatch + combine bandwidth per rank and the layer's time against Transformers'
own all-to-all expert parallelism on the same local experts backend.

    python -m selector.parallel.bench --out ep.json                      # every CUDA GPU, nccl
    python -m selector.parallel.bench --device cpu --world 2 --shape tiny:8:16:8:2 --tokens 1 4 --out ep.json

One process per rank (multiprocessing, no torchrun). For every shape and token count per rank, all ranks time the
same variants in interleaved rounds (A B C A B C ...), each round `iters` back-to-back calls between CUDA events
(wall clock on the CPU); a cell's time is the slowest rank's median, its spread the slowest rank's (max - min) /
median. The variants:

- `exchange:<strategy>`: dispatch + combine alone (the local computation returns the received rows), with the
  bytes this rank sends to other ranks and that over the time: the bandwidth;
- `layer:<strategy>`: the `ExpertParallel` layer, local experts through selector (`--backend`);
- `layer:all_to_all_padded+graph`: the same replayed from a CUDA graph (CUDA only);
- `transformers:all_to_all`: Transformers' `AllToAllEP` around the same local experts module and backend, where
  Transformers 5.23+ is importable (else the output says why not).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "selector.parallel.bench/1"
DEFAULT_PRESETS = ("deepseek-v3", "qwen3-30b-a3b")
DEFAULT_TOKENS = (1, 64, 4096)
TARGET_ROUND_S = 0.02  # calls per round chosen so one round lasts about this long on the slowest rank


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int


def parse_shape(text: str) -> Shape:
    """A preset name (selector.presets) or `name:E:H:I:k`."""
    parts = text.split(":")
    if len(parts) == 5:
        try:
            e, h, i, k = (int(p) for p in parts[1:])
        except ValueError:
            raise ValueError(f"--shape {text!r}: E, H, I and k must be integers (name:E:H:I:k)") from None
        return Shape(parts[0], e, h, i, k)
    from selector.presets import preset

    p = preset(text)  # ValueError listing the presets
    if p.has_bias or p.is_transposed or p.gate.custom:
        raise ValueError(f"--shape {text!r}: the benchmark builds plain gated SwiGLU experts, not this layout")
    return Shape(text, p.num_experts, p.hidden_size, p.intermediate_size, p.top_k)


def transformers_all_to_all() -> tuple[Any, str]:
    """(Transformers' AllToAllEP class, "") where Transformers 5.23+ is importable, else (None, why not)."""
    try:
        import transformers
    except ImportError as exc:  # absent, or its import-time check of huggingface-hub / tokenizers failed
        return None, f"transformers does not import: {exc}"
    from selector.requirements import version_tuple

    if version_tuple(transformers.__version__) < (5, 23):
        return None, f"transformers {transformers.__version__} has no expert parallelism (5.23+)"
    try:
        from transformers.distributed.expert_parallel import AllToAllEP
    except Exception as exc:  # noqa: BLE001 - a peer that does not load is reported, the rest still runs
        return None, f"transformers {transformers.__version__}: {exc}"
    return AllToAllEP, ""


# --- bytes moved ------------------------------------------------------------------------------------------------------


def all_to_all_rows(index: Any, per_rank: int, world: int) -> list[int]:
    """Rows this rank's exact all_to_all sends to each rank: its tokens with a slot there."""
    import torch

    owner = torch.div(index, per_rank, rounding_mode="floor")
    hits = owner.unsqueeze(0) == torch.arange(world, device=index.device).view(world, 1, 1)
    return hits.any(dim=2).sum(dim=1).tolist()


def sent_bytes(
    strategy: str,
    rank: int,
    world: int,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    tokens: int,
    capacity: int,
    row_bytes: int,
    meta_bytes: int,
) -> dict[str, int]:
    """Bytes this rank sends to other ranks in the dispatch and in the combine (its own share stays local).

    `row_bytes`: one hidden row; `meta_bytes`: one token's ids and weights. all_to_all sends a token once per rank
    that owns one of its slots and gets the rows back; all_to_all_padded sends `capacity` padded rows to every
    other rank and each of them its rows back; Transformers' all_to_all sends one row per (token, slot) pair.
    """
    others = [r for r in range(world) if r != rank]
    if strategy == "all_to_all":
        dispatch = sum(send_rows[r] for r in others) * (row_bytes + meta_bytes)
        combine = sum(recv_rows[r] for r in others) * row_bytes
    elif strategy == "all_to_all_padded":
        dispatch = len(others) * capacity * (row_bytes + meta_bytes)
        combine = len(others) * capacity * row_bytes
    elif strategy == "transformers":  # send_rows / recv_rows count (token, slot) pairs here
        dispatch = sum(send_rows[r] for r in others) * row_bytes
        combine = sum(recv_rows[r] for r in others) * row_bytes
    else:
        raise ValueError(f"no byte count for {strategy!r}")
    return {"dispatch": dispatch, "combine": combine, "total": dispatch + combine}


# --- one rank ---------------------------------------------------------------------------------------------------------


def _local_experts(shape: Shape, per_rank: int, dtype: Any, device: str, seed: int) -> Any:
    """This rank's experts, weights drawn on the device (a DeepSeek-V3 shard is 11 GiB: no host round trip)."""
    import torch

    from selector.testing import make_experts

    local = make_experts(per_rank, 8, 8, dtype=dtype, device=device, seed=seed)  # the decorated class, tiny
    gen = torch.Generator(device=device).manual_seed(seed)

    def weight(*dims: int, scale: float) -> torch.nn.Parameter:
        data = torch.randn(*dims, generator=gen, device=device, dtype=dtype).mul_(scale)
        return torch.nn.Parameter(data, requires_grad=False)

    local.gate_up_proj = weight(per_rank, 2 * shape.intermediate, shape.hidden, scale=shape.hidden**-0.5)
    local.down_proj = weight(per_rank, shape.hidden, shape.intermediate, scale=shape.intermediate**-0.5)
    local._is_expert_parallel = True
    return local


def _routing(tokens: int, shape: Shape, device: str, seed: int) -> tuple[Any, Any]:
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, shape.num_experts, generator=gen, device=device)
    index = scores.topk(shape.top_k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, shape.top_k, generator=gen, device=device), dim=1)
    return index, weights


class _Clock:
    """CUDA events on a GPU, the wall clock on the CPU; `time(fn, iters)` in seconds per call."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device == "cuda"
        self.torch = torch

    def time(self, fn: Callable[[], Any], iters: int) -> float:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        begin = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - begin) / iters


def _graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` captured in a CUDA graph after a warm-up on a side stream; the replay as a callable."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@dataclass(frozen=True)
class _RankSetup:
    """One rank of the run: its place in the group, its device, the local experts backend, and the group with
    the expert- and tensor-parallel meshes Transformers' layer takes."""

    rank: int
    world: int
    device: str
    backend: str  # the local experts backend (selector name or auto)
    group: Any
    ep_mesh: Any
    tp_mesh: Any


def _variants(
    setup: _RankSetup, shape: Shape, tokens: int, local: Any, skipped: dict[str, str]
) -> dict[str, tuple[Callable[[], Any], dict[str, int] | None]]:
    """Every variant of one cell as a no-argument call, with the bytes it sends (None for whole layers)."""
    import torch
    import torch.distributed as dist

    from selector import dispatch
    from selector.parallel.exchange import all_to_all_exchange, check_capacity, padded_exchange
    from selector.parallel.layer import ExpertParallel

    rank, world, device, backend, group = setup.rank, setup.world, setup.device, setup.backend, setup.group
    per_rank = shape.num_experts // world
    hidden = torch.randn(
        tokens,
        shape.hidden,
        device=device,
        dtype=local.gate_up_proj.dtype,
        generator=torch.Generator(device=device).manual_seed(1000 + rank),
    )
    index, weights = _routing(tokens, shape, device, seed=2000 + rank)
    capacity = check_capacity(group, tokens, None, hidden.device)  # every rank holds `tokens` here
    send_rows = all_to_all_rows(index, per_rank, world)
    recv_rows = torch.empty(world, dtype=torch.int64, device=hidden.device)
    dist.all_to_all_single(recv_rows, torch.tensor(send_rows, dtype=torch.int64, device=hidden.device), group=group)
    owner = torch.div(index, per_rank, rounding_mode="floor").reshape(-1)
    pair_send = torch.bincount(owner, minlength=world)[:world].to(torch.int64)
    pair_recv = torch.empty_like(pair_send)
    dist.all_to_all_single(pair_recv, pair_send, group=group)
    row_bytes = shape.hidden * hidden.element_size()
    meta_bytes = shape.top_k * (index.element_size() + weights.element_size())

    def moved(strategy: str, sends: list[int], recvs: list[int]) -> dict[str, int]:
        return sent_bytes(strategy, rank, world, sends, recvs, tokens, capacity, row_bytes, meta_bytes)

    def passthrough(rows: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rows

    out: dict[str, tuple[Callable[[], Any], dict[str, int] | None]] = {
        "exchange:all_to_all": (
            lambda: all_to_all_exchange(group, per_rank, hidden, index, weights, passthrough),
            moved("all_to_all", send_rows, recv_rows.tolist()),
        ),
        "exchange:all_to_all_padded": (
            lambda: padded_exchange(group, per_rank, hidden, index, weights, passthrough, capacity),
            moved("all_to_all_padded", [], []),
        ),
    }
    exact = ExpertParallel(local, group, shape.num_experts, "all_to_all", implementation=backend)
    padded = ExpertParallel(local, group, shape.num_experts, "all_to_all_padded", implementation=backend)
    out["layer:all_to_all"] = (lambda: exact(hidden, index, weights), None)
    out["layer:all_to_all_padded"] = (lambda: padded(hidden, index, weights), None)
    if device == "cuda":
        replay, failure = None, ""
        try:
            # the warm-up runs the padded layer eagerly (proving the capacity); the capture skips the proof
            replay = _graphed(lambda: padded(hidden, index, weights))
        except Exception as exc:  # noqa: BLE001 - a capture that fails is a result, not the end of the run
            failure = f"rank {rank}: {type(exc).__name__}: {exc}"
        # a captured collective only records, so no peer waits on a failed capture; but every rank must then time
        # the same variants, or their collectives would pair up wrongly
        captured = torch.tensor([0 if failure else 1], dtype=torch.int64, device=hidden.device)
        dist.all_reduce(captured, op=dist.ReduceOp.MIN, group=group)
        if captured.item() and replay is not None:
            out["layer:all_to_all_padded+graph"] = (replay, None)
        else:
            skipped["layer:all_to_all_padded+graph"] = failure or "the capture failed on another rank"
    all_to_all_ep, why = transformers_all_to_all()
    if all_to_all_ep is None:
        skipped["transformers:all_to_all"] = why
    else:
        dispatch.set_requested_implementation(local, backend)  # Transformers calls the experts' own forward
        theirs = all_to_all_ep(local, setup.ep_mesh, setup.tp_mesh)
        out["transformers:all_to_all"] = (
            lambda: theirs(hidden, index, weights),
            moved("transformers", pair_send.tolist(), pair_recv.tolist()),
        )
    return out


def _iters_for(clock: _Clock, fn: Callable[[], Any], group: Any, device: str) -> int:
    """Calls per round, the same on every rank: from the slowest rank's warm-up time."""
    import torch
    import torch.distributed as dist

    fn()  # first call: compiles, allocates, chooses
    seconds = torch.tensor([clock.time(fn, 1)], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return max(1, min(200, math.ceil(TARGET_ROUND_S / max(seconds.item(), 1e-7))))


def _rank_main(rank: int, world: int, rendezvous: str, options: dict[str, Any], result_path: str) -> None:
    import torch
    import torch.distributed as dist

    device = options["device"]
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend_name = "nccl" if device == "cuda" else "gloo"
    # a rank that fails leaves its peers waiting in a collective until this timeout: short, so the run ends
    dist.init_process_group(
        backend_name, init_method=rendezvous, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    rows: list[dict[str, Any]] = []
    skipped_all: dict[str, str] = {}
    error = ""
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (world, 1), mesh_dim_names=("ep", "tp"))
        group = mesh["ep"].get_group()
        setup = _RankSetup(rank, world, device, options["backend"], group, mesh["ep"], mesh["tp"])
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        clock = _Clock(device)
        for shape in (parse_shape(s) for s in options["shapes"]):
            local = _local_experts(shape, shape.num_experts // world, dtype, device, seed=10 + rank)
            for tokens in options["tokens"]:
                skipped: dict[str, str] = {}
                with torch.no_grad():
                    variants = _variants(setup, shape, tokens, local, skipped)
                    # every layer gives the exact all_to_all's output before any is timed (a fast wrong layer
                    # is no result)
                    reference = variants["layer:all_to_all"][0]()
                    diffs = {name: (variants[name][0]() - reference).abs().max().item() if tokens else 0.0
                             for name in ("layer:all_to_all_padded", "transformers:all_to_all") if name in variants}
                    iters = {name: _iters_for(clock, fn, group, device) for name, (fn, _) in variants.items()}
                    times: dict[str, list[float]] = {name: [] for name in variants}
                    for _ in range(options["rounds"]):  # interleaved: A B C A B C ...
                        for name, (fn, _) in variants.items():
                            dist.barrier(group=group)
                            times[name].append(clock.time(fn, iters[name]))
                for name, (_, moved) in variants.items():
                    median = statistics.median(times[name])
                    rows.append(
                        {
                            "shape": shape.name,
                            "tokens_per_rank": tokens,
                            "variant": name,
                            "rank": rank,
                            "median_s": median,
                            "min_s": min(times[name]),
                            "max_s": max(times[name]),
                            "iters": iters[name],
                            "rounds": len(times[name]),
                            "bytes_sent": moved,
                            "bandwidth_Bps": moved["total"] / median if moved and median > 0 else None,
                            "max_abs_diff_vs_all_to_all": diffs.get(name),
                        }
                    )
                skipped_all.update({f"{shape.name} T={tokens} {k}": v for k, v in skipped.items()})
            del local
            if device == "cuda":
                torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - written out, so the parent names the rank that failed
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    finally:
        Path(result_path).write_text(json.dumps({"rows": rows, "skipped": skipped_all, "error": error}))
        if not error:  # leave together: a gloo rank torn down while a peer still talks to it aborts the peer
            dist.barrier()
        dist.destroy_process_group()


# --- the parent: spawn, gather, render --------------------------------------------------------------------------------


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (shape, tokens, variant): the slowest rank's median, its spread, every rank's bandwidth."""
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["shape"], row["tokens_per_rank"], row["variant"]), []).append(row)
    out = []
    for (shape, tokens, variant), ranks in cells.items():
        slowest = max(ranks, key=lambda r: r["median_s"])
        spread = (slowest["max_s"] - slowest["min_s"]) / slowest["median_s"] if slowest["median_s"] > 0 else 0.0
        bandwidths = [r["bandwidth_Bps"] for r in sorted(ranks, key=lambda r: r["rank"])]
        diffs = [r["max_abs_diff_vs_all_to_all"] for r in ranks if r.get("max_abs_diff_vs_all_to_all") is not None]
        out.append(
            {
                "shape": shape,
                "tokens_per_rank": tokens,
                "variant": variant,
                "time_s": slowest["median_s"],
                "spread": spread,
                "ranks": len(ranks),
                "bandwidth_Bps_per_rank": bandwidths if any(b is not None for b in bandwidths) else None,
                "max_abs_diff_vs_all_to_all": max(diffs, default=None),
            }
        )
    return out


def _time_text(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def render_table(summary: Sequence[dict[str, Any]], skipped: dict[str, str]) -> str:
    """The short table: per cell and variant, time (spread), bandwidth per rank, and the layer vs Transformers."""
    head = f"{'shape':<16} {'T/rank':>6}  {'variant':<30} {'time':>10} {'spread':>7}"
    lines = [f"{head}  per-rank GB/s / vs transformers"]
    reference = {
        (s["shape"], s["tokens_per_rank"]): s["time_s"] for s in summary if s["variant"] == "transformers:all_to_all"
    }
    for s in summary:
        extra = ""
        if s["bandwidth_Bps_per_rank"]:
            extra = " ".join(f"{b / 1e9:.3g}" if b is not None else "-" for b in s["bandwidth_Bps_per_rank"])
        ref = reference.get((s["shape"], s["tokens_per_rank"]))
        if s["variant"].startswith("layer:") and ref:
            extra = f"{s['time_s'] / ref:.2f}x"
        lines.append(
            f"{s['shape']:<16} {s['tokens_per_rank']:>6}  {s['variant']:<30} {_time_text(s['time_s']):>10} "
            f"{s['spread'] * 100:>6.1f}%  {extra}"
        )
    for what, why in skipped.items():
        lines.append(f"not run: {what}: {why}")
    return "\n".join(lines)


def run(options: dict[str, Any], world: int) -> dict[str, Any]:
    """Spawn `world` ranks, each times every cell; the merged report (also what `--out` holds)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="selector-ep-") as folder:
        rendezvous = f"file://{folder}/rendezvous"
        paths = [os.path.join(folder, f"rank{r}.json") for r in range(world)]
        ranks = [ctx.Process(target=_rank_main, args=(r, world, rendezvous, options, paths[r])) for r in range(world)]
        for p in ranks:
            p.start()
        deadline = time.monotonic() + options["timeout_s"]  # for the whole run, not per rank
        for p in ranks:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join()
        results = [
            json.loads(Path(p).read_text())
            if os.path.exists(p)
            else {"rows": [], "skipped": {}, "error": "no result (the rank died or timed out)"}
            for p in paths
        ]
    errors = [r["error"] for r in results if r["error"]]
    errors += [f"rank {r}: exit code {p.exitcode}" for r, p in enumerate(ranks) if p.exitcode not in (0, None)]
    rows = [row for r in results for row in r["rows"]]
    skipped = {k: v for r in results for k, v in r["skipped"].items()}
    _, why = transformers_all_to_all()
    return {
        "schema": SCHEMA,
        "world": world,
        "options": options,
        "errors": errors,
        "skipped": skipped,
        "transformers": why or "AllToAllEP",
        "summary": summarise(rows),
        "rows": rows,
        "bytes": "bytes_sent: what a rank sends to other ranks (dispatch, combine); bandwidth = total / median time",
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m selector.parallel.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=Path, help="write the JSON report here")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--world", type=int, help="ranks (default: every CUDA GPU; 2 on the CPU)")
    parser.add_argument("--shape", action="append", dest="shapes",
                        help=f"a preset or name:E:H:I:k (repeat; default {', '.join(DEFAULT_PRESETS)})")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS), help="tokens per rank")
    parser.add_argument("--backend", default="auto", help="the local experts backend (selector name or auto)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per cell")
    parser.add_argument(
        "--timeout",
        type=int,
        default=420,
        dest="timeout_s",
        help="seconds for the whole run before the ranks are killed",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shapes = args.shapes or list(DEFAULT_PRESETS)
    for text in shapes:
        parse_shape(text)  # a bad shape fails here, not in every rank
    if args.device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if not count:
            print("no CUDA GPU visible: pass --device cpu (gloo) to run on the CPU", file=sys.stderr)
            return 2
        world = args.world or count
        if world > count:
            print(f"--world {world}: only {count} CUDA GPU(s) visible", file=sys.stderr)
            return 2
    else:
        world = args.world or 2
    for text in shapes:
        shape = parse_shape(text)
        if shape.num_experts % world:
            print(f"{shape.name}: {world} ranks cannot share {shape.num_experts} experts evenly", file=sys.stderr)
            return 2
    if min(args.tokens) < 1 or args.rounds < 1:
        print("--tokens and --rounds must be at least 1", file=sys.stderr)
        return 2
    options = {
        "device": args.device,
        "shapes": shapes,
        "tokens": args.tokens,
        "backend": args.backend,
        "rounds": args.rounds,
        "timeout_s": args.timeout_s,
    }
    report = run(options, world)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(render_table(report["summary"], report["skipped"]))
    if report["transformers"] != "AllToAllEP":
        print(f"Transformers' all_to_all not compared: {report['transformers']}")
    for error in report["errors"]:
        print(f"error: {error}", file=sys.stderr)
    print(f"wrote {args.out}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
