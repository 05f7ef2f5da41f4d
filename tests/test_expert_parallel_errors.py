"""Expert parallelism under bad input and errors (gloo, on the CPU, 2 and 4 spawned ranks).

Every rank's state travels in each eager call's status exchange, so bad input on one rank (ids outside [0, E] --
E is the global sentinel --, NaN / infinite weights, wrong shapes) raises the same error on every rank of the same
call, at every validation level but "off"; calls that may not sync (a capture, torch.compile, verify=False) poison
the same rows on every rank and the device guard records the fault, which the next eager call raises everywhere.
Ranks that disagree (token counts under all_reduce, strategies) get a clear error on every rank, and a rank that
never reaches its layer leaves the others waiting at most SELECTOR_EP_TIMEOUT seconds.

One spawn per world size runs every case (spawning costs seconds, a case milliseconds); each rank writes what it
saw to a JSON file, compared here across ranks.
"""

from __future__ import annotations

import copy
import datetime
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

E, H, I, K, T = 8, 16, 8, 2, 4
SEED = 4321
LEVELS = ("full", "first", "shapes")
STRATEGIES = ("all_to_all", "all_to_all_padded", "all_reduce")
REPS = 2  # every error case twice: the group stays in step after an error
BOUND_S = 2.0  # every rank raises within this of entering the call
TIMEOUT_S = 1  # SELECTOR_EP_TIMEOUT for the case of a rank that never reaches its layer


def _spoil_id_above(index: torch.Tensor, weights: torch.Tensor) -> None:
    index[1, 0] = E + 1


def _spoil_id_huge(index: torch.Tensor, weights: torch.Tensor) -> None:
    index[3, 1] = 1 << 40


def _spoil_id_negative(index: torch.Tensor, weights: torch.Tensor) -> None:
    index[2, 1] = -1


def _spoil_nan(index: torch.Tensor, weights: torch.Tensor) -> None:
    weights[0, 1] = float("nan")


def _spoil_inf(index: torch.Tensor, weights: torch.Tensor) -> None:
    weights[2, 0] = float("inf")


SPOILS: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], None], int]] = {  # the spoiler, the token it spoils
    "id=E+1": (_spoil_id_above, 1),
    "id=2^40": (_spoil_id_huge, 3),
    "id=-1": (_spoil_id_negative, 2),
    "nan-weight": (_spoil_nan, 0),
    "inf-weight": (_spoil_inf, 2),
}


def _inputs(tokens: int = T, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same tokens on every rank (all_reduce needs them): k distinct experts per token, softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=gen)
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]) if tokens else (
        torch.empty(0, K, dtype=torch.int64))  # fmt: skip
    return hidden, index, torch.softmax(torch.randn(tokens, K, generator=gen), dim=1)


def _rank_main(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    import torch.distributed as dist

    from selector import guard
    from selector.errors import ExpertsInputError
    from selector.parallel import shard_experts
    from selector.parallel.exchange import all_reduce_forward, all_to_all_padded_forward
    from selector.testing import make_experts, reference_experts

    os.environ["SELECTOR_EP_TIMEOUT"] = "20"  # a bug shows as a 20 s wait, not the default minute
    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    calls: list[dict] = []  # every case: name, outcome (error class or "ok"), message, seconds in the call
    failures: list[str] = []  # what a rank checks alone (clean calls after an error, poisoned rows)

    def call(case: str, fn: Callable[[], object]) -> object:
        start = time.perf_counter()
        result: object = None
        try:
            result = fn()
            outcome, message = "ok", ""
        except Exception as exc:  # noqa: BLE001 - the outcome is the result
            outcome, message = type(exc).__name__, str(exc)
            if isinstance(exc, ExpertsInputError):
                outcome = "ExpertsInputError"
        calls.append({"case": case, "outcome": outcome, "message": message,
                      "seconds": time.perf_counter() - start})  # fmt: skip
        return result

    try:
        full = make_experts(E, H, I, seed=SEED).requires_grad_(False)
        full._is_expert_parallel = True
        layers = {
            s: shard_experts(copy.deepcopy(full), strategy=s, same_tokens=True, implementation="eager")
            for s in STRATEGIES
        }
        clean = _inputs()
        expected = reference_experts(full, *clean)

        def check_clean(where: str, strategy: str) -> None:
            out = layers[strategy](*clean)
            err = (out.double() - expected).abs().max().item()
            if not err <= 2e-5:
                failures.append(f"rank {rank} {where}: a clean call after the error is off by {err:.2e}")

        # 1. one rank's bad ids / weights, every level, every strategy: the same error on every rank
        for level in LEVELS:
            os.environ["SELECTOR_VALIDATE"] = level
            for rep in range(REPS):
                for s_i, strategy in enumerate(STRATEGIES):
                    for b_i, (name, (spoil, _)) in enumerate(SPOILS.items()):
                        bad_rank = (rep + s_i + b_i) % world
                        hidden, index, weights = (t.clone() for t in clean)
                        if rank == bad_rank:
                            spoil(index, weights)
                        case = f"{level}/{strategy}/{name}/bad rank {bad_rank}/rep {rep}"
                        call(case, lambda: layers[strategy](hidden, index, weights))
                        check_clean(case, strategy)
            # two ranks bad at once: both named, in rank order
            hidden, index, weights = (t.clone() for t in clean)
            if rank == 0:
                _spoil_id_above(index, weights)
            if rank == world - 1:
                _spoil_nan(index, weights)
            call(f"{level}/all_to_all/two bad ranks", lambda: layers["all_to_all"](hidden, index, weights))
            check_clean(f"{level} two bad ranks", "all_to_all")
        os.environ.pop("SELECTOR_VALIDATE")

        # 2. a rank whose input fails the host checks still joins the status exchange: every rank raises
        hidden, index, weights = (t.clone() for t in clean)
        if rank == world - 1:
            hidden = torch.randn(T, H + 1)
        call("host/wrong hidden size", lambda: layers["all_to_all"](hidden, index, weights))
        hidden, index, weights = (t.clone() for t in clean)
        if rank == 0:
            index = index.to(torch.int16)
        call("host/int16 ids", lambda: layers["all_to_all_padded"](hidden, index, weights))
        check_clean("host checks", "all_to_all")

        # 3. ranks that disagree: unequal counts with same_tokens=True (all_reduce), strategies, capacity
        unequal = _inputs(tokens=3 + rank, seed=SEED + rank)
        call("mismatch/all_reduce unequal counts", lambda: layers["all_reduce"](*unequal))
        auto = shard_experts(copy.deepcopy(full), same_tokens=True, implementation="eager")  # eager: all_to_all
        out = call("mismatch/auto same_tokens unequal counts", lambda: auto(*unequal))
        if out is None or (out.double() - reference_experts(full, *unequal)).abs().max().item() > 2e-5:
            failures.append(f"rank {rank}: auto (all_to_all) with unequal counts did not give the reference")
        mixed = layers["all_to_all"] if rank == 0 else layers["all_reduce"]
        call("mismatch/strategies", lambda: mixed(*clean))
        check_clean("after mismatches", "all_reduce")

        # 4. no sync (verify=False, as under a CUDA graph or torch.compile): the same rows poisoned on every rank,
        # the fault recorded by the device guard, raised by the next eager call on every rank
        forwards = {"all_to_all_padded": all_to_all_padded_forward, "all_reduce": all_reduce_forward}
        for level in LEVELS:
            os.environ["SELECTOR_VALIDATE"] = level
            for strategy, forward in forwards.items():
                for b_i, (name, (spoil, token)) in enumerate(SPOILS.items()):
                    bad_rank = b_i % world
                    hidden, index, weights = (t.clone() for t in clean)
                    # all_reduce: every rank holds the same tokens, bad slot included; padded: one rank's
                    if strategy == "all_reduce" or rank == bad_rank:
                        spoil(index, weights)
                    local = layers[strategy].experts
                    case = f"poison/{level}/{strategy}/{name}"
                    out = call(case, lambda: forward(local, None, E, hidden, index, weights, "eager", verify=False))
                    nan_rows = [] if out is None else torch.isnan(out).any(dim=1).nonzero().view(-1).tolist()
                    poisoned = strategy == "all_reduce" or rank == bad_rank
                    if nan_rows != ([token] if poisoned else []):
                        failures.append(f"rank {rank} {case}: NaN rows {nan_rows}")
                    others = [t for t in range(T) if t != token]
                    if out is not None and (out[others].double() - expected[others]).abs().max().item() > 2e-5:
                        failures.append(f"rank {rank} {case}: a row without a bad slot changed")
                    recorded = guard.pending_faults(torch.device("cpu"))
                    if poisoned and not (recorded["bad_ids"] or recorded["bad_weights"]):
                        failures.append(f"rank {rank} {case}: the guard recorded nothing: {recorded}")
                    call(f"{case}/next eager call", lambda: layers[strategy](*clean))
                    check_clean(case, strategy)
        os.environ.pop("SELECTOR_VALIDATE")

        # 5. last (the group is out of step after it): the last rank never reaches its layer (it raised before),
        # the others wait at most SELECTOR_EP_TIMEOUT
        os.environ["SELECTOR_EP_TIMEOUT"] = str(TIMEOUT_S)
        if rank != world - 1:
            call("timeout/a rank never calls", lambda: layers["all_to_all"](*clean))
        else:
            calls.append({"case": "timeout/a rank never calls", "outcome": "skipped", "message": "", "seconds": 0})
            time.sleep(TIMEOUT_S + 2)  # alive, elsewhere (a rank that caught its own error): its peers time out
    except Exception as exc:  # noqa: BLE001 - reported through the file
        failures.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"calls": calls, "failures": failures}))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no barrier and no teardown: the last case leaves a gather pending on purpose


def _spawn(world: int, tmp_path: Path) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    rendezvous = f"file://{tmp_path}/rendezvous"
    ranks = [ctx.Process(target=_rank_main, args=(r, world, rendezvous, str(tmp_path))) for r in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    for p in ranks:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in ranks] == [0] * world
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _common(message: str) -> str:
    """The part of a message every rank shares (the rank that saw a problem adds what it saw)."""
    return message.split(". On this rank", 1)[0]


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_raises_the_same_error_on_the_same_call(world: int, tmp_path: Path) -> None:
    reports = _spawn(world, tmp_path)
    failures = [f for report in reports for f in report["failures"]]
    assert not failures, "\n".join(failures)
    cases = [c["case"] for c in reports[0]["calls"]]
    assert all([c["case"] for c in r["calls"]] == cases for r in reports), "the ranks ran different cases"
    by_case = {case: [r["calls"][n] for r in reports] for n, case in enumerate(cases)}
    slowest: dict[str, float] = {}
    for case, seen in by_case.items():
        kind = case.split("/")[0]
        if kind == "timeout":
            continue
        outcomes = {c["outcome"] for c in seen}
        messages = {_common(c["message"]) for c in seen}
        assert len(outcomes) == 1 and len(messages) == 1, f"{case}: ranks differ: {seen}"
        slowest[kind] = max(slowest.get(kind, 0.0), *(c["seconds"] for c in seen))
        assert max(c["seconds"] for c in seen) < BOUND_S, f"{case}: {seen}"
        outcome, message = seen[0]["outcome"], seen[0]["message"]
        if case.startswith(("full/", "first/", "shapes/")):
            assert outcome == "ExpertsInputError", f"{case}: {seen}"
            bad = case.split("bad rank ")[1].split("/")[0] if "bad rank " in case else None
            if bad is not None:
                assert f"rank {bad}: " in message and "Every rank raises this on the same call" in message, message
            if "id=E+1" in case:
                assert f"(one was {E + 1})" in message, message
            if "id=2^40" in case:
                assert f"(one was {1 << 40})" in message, message
            if "id=-1" in case:
                assert "(one was -1)" in message, message
            if "weight" in case:
                assert "1 NaN or infinite routing weight(s)" in message, message
            if "two bad ranks" in case:
                assert "rank 0: 1 expert id(s)" in message and f"rank {world - 1}: 1 NaN" in message, message
        elif case.startswith("host/"):
            assert outcome == "ExpertsInputError" and "refused its input" in message, f"{case}: {seen}"
            assert sum("On this rank" in c["message"] for c in seen) == 1, seen
        elif case == "mismatch/all_reduce unequal counts":
            assert outcome == "ValueError" and "all_reduce needs the same tokens on every rank" in message, seen
            assert str(list(range(3, 3 + world))) in message, message
        elif case == "mismatch/auto same_tokens unequal counts":
            assert outcome == "ok", seen
        elif case == "mismatch/strategies":
            assert outcome == "ValueError" and "run different expert-parallel strategies" in message, seen
        elif case.startswith("poison/") and case.endswith("next eager call"):
            assert outcome == "ExpertsInputError" and "routing guard recorded" in message, f"{case}: {seen}"
        elif case.startswith("poison/"):
            assert outcome == "ok", f"{case}: {seen}"
    timed = [r["calls"][-1] for r in reports[:-1]]
    assert all(c["outcome"] == "ExpertParallelError" for c in timed), timed
    assert all("SELECTOR_EP_TIMEOUT" in c["message"] and f"within {TIMEOUT_S} s" in c["message"] for c in timed)
    waited = [c["seconds"] for c in timed]
    assert all(TIMEOUT_S * 0.9 <= s < TIMEOUT_S + BOUND_S for s in waited), waited
    errors = sum(c["outcome"] not in ("ok", "skipped") for c in reports[0]["calls"])
    print(f"\n{world} ranks: {len(cases)} cases ({errors} raising), slowest rank per kind "
          f"{ {k: round(v, 3) for k, v in slowest.items()} } s; timeout case {[round(s, 2) for s in waited]} s")
