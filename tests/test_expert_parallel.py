"""Expert parallelism over torch.distributed (gloo, on the CPU): every CPU backend as the local experts of both
strategies gives the single-process layer's result, on 2 and 4 ranks.

One spawn per world size runs every case inside (spawning costs seconds; the cases cost milliseconds). Each rank
writes the failures it saw to a JSON file that the test reads, so a failure names its rank, case and backend.
"""

from __future__ import annotations

import copy
import datetime
import json
import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import selector

pytestmark = pytest.mark.slow

E, H, I, K = 8, 16, 8, 2
BACKENDS = ("eager", "grouped_mm", "batched_mm", "auto")
GPU_BACKENDS = (*BACKENDS, "triton_fused")
SEED = 1234


# --- the spawned ranks ---------------------------------------------------------------------------------------------


def _routing(tokens: int, allowed: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token drawn from `allowed`, softmax weights."""
    rows = [torch.tensor(allowed)[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(tokens)]
    index = torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), dim=1)
    return index, weights


def _cases(world: int, rank: int) -> list[tuple[str, bool, int, list[int], bool]]:
    """(name, same tokens on every rank, this rank's token count, experts routed to, global sentinel slots)."""
    per_rank = E // world
    every = list(range(E))
    cases = [
        ("mixed", False, 5 + rank, every, False),
        ("mixed-same-count", False, 5, every, False),
        ("global-sentinel-slots", False, 6, every, True),
        ("empty-rank", False, 0 if rank == 1 else 4, every, False),
        ("skewed-to-rank-0", False, 7, every[:per_rank], False),
        ("T=0", False, 0, every, False),
        ("T=1", False, 1, every, False),
    ]
    if world > 1:  # nothing routed to the last rank's experts
        cases.append(("sentinel-only-last-rank", False, 5, every[: E - per_rank], False))
    # all_reduce: every rank holds the same tokens
    cases += [(f"same-{name}", True, tokens, allowed, sentinel) for name, _, tokens, allowed, sentinel in cases
              if name not in ("mixed", "empty-rank")]  # fmt: skip
    return cases


# The layers every case runs, by label: (strategy, capacity). The padded exchange without a capacity runs only where
# every rank holds the same token count; with a capacity of the largest count of any case it runs everywhere.
CAPACITY = 8  # the most tokens of any rank in any case (mixed: 5 + rank on 4 ranks)
VARIANTS = {
    "all_to_all": ("all_to_all", None),
    "all_reduce": ("all_reduce", None),
    "all_to_all_padded": ("all_to_all_padded", None),
    f"all_to_all_padded@{CAPACITY}": ("all_to_all_padded", CAPACITY),
}
UNEQUAL_COUNTS = ("mixed", "empty-rank")  # the cases whose ranks hold different token counts


def _variants_for(case: str, same: bool) -> tuple[str, ...]:
    if same:
        return tuple(VARIANTS)
    if case in UNEQUAL_COUNTS:
        return ("all_to_all", f"all_to_all_padded@{CAPACITY}")
    return ("all_to_all", "all_to_all_padded", f"all_to_all_padded@{CAPACITY}")


def _rank_main(rank: int, world: int, rendezvous: str, out_dir: str, device: str = "cpu") -> None:
    import torch.distributed as dist

    from selector import dispatch
    from selector.parallel import ExpertParallel, expert_parallel_forward, parallelize_experts, shard_experts
    from selector.testing import make_experts, reference_experts

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", init_method=rendezvous, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    backends = BACKENDS if device == "cpu" else GPU_BACKENDS
    tolerance = 2e-5 if device == "cpu" else 2e-3  # on a GPU a float32 kernel may run its dots in TF32
    failures: list[str] = []
    ran: dict[str, int] = {}
    strategies_ran: dict[str, int] = {}
    try:
        full = make_experts(E, H, I, seed=SEED, device=device)  # the same weights on every rank
        full.requires_grad_(False)  # forward only (the collectives carry no gradient); triton_fused has no backward
        full._is_expert_parallel = True  # the single-process run sees the global sentinel slots too
        locals_ = {}
        for label, (strategy, capacity) in VARIANTS.items():
            for backend in backends:
                layer = shard_experts(
                    copy.deepcopy(full), strategy=strategy, same_tokens=True, implementation=backend, capacity=capacity
                )
                assert isinstance(layer, ExpertParallel) and layer.strategy == strategy
                locals_[label, backend] = layer
        for case, same, tokens, allowed, sentinel in _cases(world, rank):
            gen = torch.Generator().manual_seed(SEED + (0 if same else 1000 * (rank + 1)) + len(case))
            hidden = torch.randn(tokens, H, generator=gen)
            index, weights = _routing(tokens, allowed, gen)
            if sentinel and tokens:
                index[::2, -1] = E
            ref = reference_experts(full, hidden, index, weights)
            hidden, index, weights = hidden.to(device), index.to(device), weights.to(device)
            for label in _variants_for(case, same):
                for backend in backends:
                    where = f"rank {rank}/{world} case {case} {label} {backend}"
                    layer = locals_[label, backend]
                    out = layer(hidden, index, weights)
                    again = layer(hidden, index, weights)
                    strategies_ran[label] = strategies_ran.get(label, 0) + 1
                    single = selector.dispatch.run_experts(full, hidden, index, weights, backend)
                    if out.shape != (tokens, H) or out.dtype != torch.float32:
                        failures.append(f"{where}: output {tuple(out.shape)} {out.dtype}")
                        continue
                    if not torch.equal(out, again):
                        failures.append(f"{where}: two calls differ (not deterministic)")
                    err = (out.double().cpu() - ref).abs().max().item() if tokens else 0.0
                    err_single = (out - single).abs().max().item() if tokens else 0.0
                    if err > tolerance or err_single > tolerance:
                        failures.append(f"{where}: max error {err:.2e} vs float64, {err_single:.2e} vs one process")
                    last = dispatch.last_backend(layer.experts)
                    if last is not None:
                        ran[last] = ran.get(last, 0) + 1
                    if backend != "auto" and last not in (None, backend):
                        failures.append(f"{where}: local experts ran {last}")
        # the padded exchange refuses ranks that disagree on the token count, on every rank alike (no rank hangs);
        # a world of one cannot disagree with itself
        padded = locals_["all_to_all_padded", "eager"]
        count = 2 + rank
        try:
            padded(torch.randn(count, H, device=device), *(t.to(device) for t in _routing(count, list(range(E)), gen)))
            if world > 1:
                failures.append(f"rank {rank}: all_to_all_padded ran with unequal token counts and no capacity")
        except ValueError as exc:
            if world == 1 or "needs the same token count on every rank" not in str(exc):
                failures.append(f"rank {rank}: unequal counts raised {exc}")
        tight = locals_[f"all_to_all_padded@{CAPACITY}", "eager"]
        count = CAPACITY + 1 if rank == 0 else 1
        try:
            tight(torch.randn(count, H, device=device), *(t.to(device) for t in _routing(count, list(range(E)), gen)))
            failures.append(f"rank {rank}: all_to_all_padded ran {CAPACITY + 1} tokens at capacity {CAPACITY}")
        except ValueError as exc:
            if f"pass a capacity of at least {CAPACITY + 1}" not in str(exc):
                failures.append(f"rank {rank}: a capacity too small raised {exc}")
        # the function form and the model-tree form give the same as the wrapper
        gen = torch.Generator().manual_seed(SEED + rank)
        hidden = torch.randn(3, H, generator=gen)
        index, weights = _routing(3, list(range(E)), gen)
        ref = reference_experts(full, hidden, index, weights)
        hidden, index, weights = hidden.to(device), index.to(device), weights.to(device)
        local = locals_["all_to_all", "eager"].experts
        out = expert_parallel_forward(local, None, E, hidden, index, weights, implementation="grouped_mm")
        if (out.double().cpu() - ref).abs().max().item() > tolerance:
            failures.append(f"rank {rank}: expert_parallel_forward differs from the reference")

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.experts = copy.deepcopy(full)

        block = Block()
        replaced = parallelize_experts(block)
        if replaced != ["experts"] or not isinstance(block.experts, ExpertParallel):
            failures.append(f"rank {rank}: parallelize_experts replaced {replaced}")
        elif block.experts.experts.num_experts != E // world or block.experts.first_expert != rank * (E // world):
            failures.append(f"rank {rank}: the shard holds {block.experts.experts.num_experts} experts")
        elif (block.experts(hidden, index, weights).double().cpu() - ref).abs().max().item() > tolerance:
            failures.append(f"rank {rank}: parallelize_experts' layer differs from the reference")
    except Exception as exc:  # noqa: BLE001 - reported through the file, the peers may hang otherwise
        failures.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        report = {"failures": failures, "ran": ran, "strategies": strategies_ran}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        _teardown(dist)


def _teardown(dist) -> None:  # noqa: ANN001 - torch.distributed
    """Leave together, then end the rank without the interpreter's teardown: gloo's threads sometimes abort a
    rank there ("terminate called without an active exception", about one run in three), after its report was
    written; the report, not the exit code, carries the result."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _spawn(world: int, tmp_path: Path, main: Callable[..., None] = _rank_main, *extra: object) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    rendezvous = f"file://{tmp_path}/rendezvous"
    ranks = [ctx.Process(target=main, args=(r, world, rendezvous, str(tmp_path), *extra)) for r in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(300)
    for p in ranks:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in ranks] == [0] * world
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_every_cpu_backend_under_both_strategies_matches_one_process(world: int, tmp_path: Path) -> None:
    reports = _spawn(world, tmp_path)
    failures = [f for report in reports for f in report["failures"]]
    assert not failures, "\n".join(failures)
    ran = set().union(*(report["ran"] for report in reports))
    assert {"eager", "grouped_mm", "batched_mm"} <= ran, ran
    assert set(reports[0]["strategies"]) == set(VARIANTS)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
def test_nccl_ranks_on_gpus_match_one_process(world: int, tmp_path: Path) -> None:
    """The same cases on CUDA over nccl, `triton_fused` among the local backends, every strategy; a world of one
    runs every collective on one GPU."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, {torch.cuda.device_count()} visible")
    reports = _spawn(world, tmp_path, _rank_main, "cuda")
    failures = [f for report in reports for f in report["failures"]]
    assert not failures, "\n".join(failures)
    assert {"eager", "grouped_mm", "batched_mm", "triton_fused"} <= set().union(*(r["ran"] for r in reports))
    assert set(reports[0]["strategies"]) == set(VARIANTS)


GRAPH_BACKENDS = ("auto", "triton_fused")
GRAPH_TOKENS = (1, 3)  # the replays' token count never changes: the padded exchange's shapes are the capacity's


def _graph_rank_main(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    """A CUDA graph captures an `auto` ExpertParallel layer (which takes all_to_all_padded there) and replays it on
    new routing; the replays must match float64 and the eager layer."""
    import torch.distributed as dist

    from selector.parallel import ExpertParallel, shard_experts
    from selector.testing import make_experts, reference_experts

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=rendezvous, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    failures: list[str] = []
    try:
        full = make_experts(E, H, I, seed=SEED, device="cuda").requires_grad_(False)  # forward only
        full._is_expert_parallel = True
        for backend in GRAPH_BACKENDS:
            for tokens in GRAPH_TOKENS:
                where = f"rank {rank}/{world} {backend} T={tokens}"
                layer = shard_experts(copy.deepcopy(full), implementation=backend)
                assert isinstance(layer, ExpertParallel) and layer.strategy == "all_to_all"
                if layer.captured_strategy != "all_to_all_padded":
                    failures.append(f"{where}: a captured call would run {layer.captured_strategy}")
                    continue
                gen = torch.Generator().manual_seed(SEED + 7 * rank + tokens)
                first = (torch.randn(tokens, H, generator=gen), *_routing(tokens, list(range(E)), gen))
                static = [t.cuda() for t in first]
                # the eager padded call proves the capacity and initialises the communicator before the capture
                layer.strategy = "all_to_all_padded"
                eager_padded = layer(*static)
                side = torch.cuda.Stream()  # the warm-up CUDA graphs want, on a side stream
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    layer(*static)
                torch.cuda.current_stream().wait_stream(side)
                layer.strategy = "all_to_all"
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = layer(*static)
                for replay in range(3):
                    fresh = (torch.randn(tokens, H, generator=gen), *_routing(tokens, list(range(E)), gen))
                    for buffer, value in zip(static, fresh):
                        buffer.copy_(value)
                    graph.replay()
                    torch.cuda.synchronize()
                    ref = reference_experts(full, *fresh)
                    eager = layer(*static)  # the eager all_to_all on the same inputs
                    err = (out.double().cpu() - ref).abs().max().item()
                    err_eager = (out - eager).abs().max().item()
                    if err > 2e-3 or err_eager > 2e-3:
                        failures.append(
                            f"{where} replay {replay}: error {err:.2e} vs float64, {err_eager:.2e} vs eager"
                        )
                if (eager_padded.shape, eager_padded.dtype) != ((tokens, H), torch.float32):
                    failures.append(f"{where}: the eager padded call gave {tuple(eager_padded.shape)}")
    except Exception as exc:  # noqa: BLE001 - reported through the file, the peers may hang otherwise
        failures.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"failures": failures}))
        _teardown(dist)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_a_cuda_graph_captures_the_padded_exchange_over_nccl(world: int, tmp_path: Path) -> None:
    """No host sync per layer: `auto` under capture takes all_to_all_padded, and its replays stay right."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, {torch.cuda.device_count()} visible")
    reports = _spawn(world, tmp_path, _graph_rank_main)
    failures = [f for report in reports for f in report["failures"]]
    assert not failures, "\n".join(failures)


def _compile_rank_main(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    """torch.compile(fullgraph=True) of an `auto` layer: no graph break, so no host sync (all_to_all_padded)."""
    import torch.distributed as dist

    from selector.parallel import shard_experts
    from selector.testing import make_experts, reference_experts

    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    failures: list[str] = []
    try:
        full = make_experts(E, H, I, seed=SEED).requires_grad_(False)  # forward only
        full._is_expert_parallel = True
        # a capacity: eager auto calls run all_to_all, which proves nothing about the padded exchange's counts
        layer = shard_experts(copy.deepcopy(full), implementation="grouped_mm", capacity=4)
        gen = torch.Generator().manual_seed(SEED + rank)
        inputs = [(torch.randn(4, H, generator=gen), *_routing(4, list(range(E)), gen)) for _ in range(2)]
        layer(*inputs[0])  # selector chooses inside torch.compile only for modules it has seen
        compiled = torch.compile(layer, fullgraph=True)  # a host sync would be a graph break: an error here
        for n, args in enumerate(inputs):
            err = (compiled(*args).double() - reference_experts(full, *args)).abs().max().item()
            if err > 2e-5:
                failures.append(f"rank {rank} input {n}: compiled error {err:.2e}")
        if layer.strategy != "all_to_all" or layer.captured_strategy != "all_to_all_padded":
            failures.append(f"rank {rank}: strategies {layer.strategy}, {layer.captured_strategy}")
    except Exception as exc:  # noqa: BLE001 - reported through the file, the peers may hang otherwise
        failures.append(f"rank {rank}: {type(exc).__name__}: {str(exc)[:2000]}")
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"failures": failures}))
        _teardown(dist)


@pytest.mark.compile
def test_torch_compile_traces_the_auto_layer_without_a_graph_break(tmp_path: Path) -> None:
    reports = _spawn(2, tmp_path, _compile_rank_main)
    failures = [f for report in reports for f in report["failures"]]
    assert not failures, "\n".join(failures)


# --- Transformers' own expert parallelism with selector backends as the local experts ------------------------------

HF_IMPLEMENTATIONS = ("selector:eager", "selector:grouped_mm", "selector:batched_mm", "auto")
EP_IMPLEMENTATIONS = ("all_to_all", "all_reduce")


def _hf_rank_main(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from selector import dispatch, hf

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # read by Transformers' loader
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    failures: list[str] = []
    ran: dict[str, int] = {}
    try:
        ids = torch.load(Path(out_dir, "ids.pt"))
        expected = torch.load(Path(out_dir, "logits.pt"))
        for ep_implementation in EP_IMPLEMENTATIONS:
            config = DistributedConfig(tp_size=world, ep_size=world, ep_implementation=ep_implementation)
            model = selector.from_pretrained(
                AutoModelForCausalLM, Path(out_dir, "model"), experts_implementation="auto", distributed_config=config
            ).eval()
            experts = [m for members in hf.experts_modules(model).values() for _, m in members]
            if not experts or any(m.num_experts != E // world or not m._is_expert_parallel for m in experts):
                failures.append(f"rank {rank}: the experts were not sharded: {[m.num_experts for m in experts]}")
            for implementation in HF_IMPLEMENTATIONS:
                where = f"rank {rank}/{world} {ep_implementation} {implementation}"
                model.set_experts_implementation(implementation)
                for m in experts:
                    dispatch.clear_last_backend(m)
                with torch.no_grad():
                    logits = model(ids).logits
                err = (logits - expected).abs().max().item()
                if err > 1e-4:
                    failures.append(f"{where}: logits differ from one process by {err:.2e}")
                backends = {dispatch.last_backend(m) for m in experts}
                if None in backends or (implementation != "auto" and backends != {implementation.split(":")[1]}):
                    failures.append(f"{where}: the local experts ran {backends}")
                for name in backends - {None}:
                    ran[name] = ran.get(name, 0) + 1
    except Exception as exc:  # noqa: BLE001 - reported through the file, the peers may hang otherwise
        failures.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"failures": failures, "ran": ran}))
        _teardown(dist)


def test_transformers_expert_parallel_runs_selector_backends_as_local_experts(tmp_path: Path) -> None:
    """Transformers' `DistributedConfig(ep_size=2)` shards the experts and routes other ranks' slots to the sentinel;
    every selector backend, as the local experts, gives the single-process logits under both of its strategies."""
    pytest.importorskip("accelerate", reason="Transformers' distributed loading needs accelerate")
    transformers = pytest.importorskip("transformers")
    from selector.requirements import version_tuple

    if version_tuple(transformers.__version__) < (5, 23):
        pytest.skip(f"Transformers {transformers.__version__} has no DistributedConfig(ep_size=...) (5.23+)")
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=100, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        initializer_range=0.2, intermediate_size=32, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.save(model(ids).logits, tmp_path / "logits.pt")
    torch.save(ids, tmp_path / "ids.pt")
    reports = _spawn(2, tmp_path, _hf_rank_main)
    failures = [f for report in reports for f in report["failures"]]
    assert not failures, "\n".join(failures)
    assert {"eager", "grouped_mm", "batched_mm"} <= set().union(*(report["ran"] for report in reports))
