"""The expert-parallel strategies judged without a process group, and doctor's section that shows the verdicts."""

from __future__ import annotations

import json

import pytest
from selector.probes import collect_environment

from selector.parallel import PREFERENCE, STRATEGIES, ParallelFacts, check_strategy, choose, explain
from selector.parallel.report import build_section, doctor_facts, no_group_section
from selector.types import Status

E, H, I = 8, 16, 8
H200 = {"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "SELECTOR_TORCH_CUDA": "12.8", "PATH": ""}
NO_NCCL_DIST = {f"SELECTOR_PACKAGE_NVIDIA_NCCL_CU{v}": "" for v in (11, 12, 13)}


def _facts(**over: object) -> ParallelFacts:
    base = {"has_group": True, "world_size": 4, "backend": "gloo", "num_experts": 8, "same_tokens": False}
    base.update(over)
    return ParallelFacts(**base)  # type: ignore[arg-type]


def test_auto_takes_all_to_all_and_all_reduce_needs_the_same_tokens() -> None:
    assert choose(_facts()) == "all_to_all"
    verdicts = explain(_facts())
    assert list(verdicts) == list(PREFERENCE) == ["all_to_all", "all_reduce", "all_to_all_padded"]
    assert verdicts["all_to_all"].ok and not verdicts["all_reduce"].ok and verdicts["all_to_all_padded"].ok
    assert "same_tokens=True" in verdicts["all_reduce"].remedy
    assert choose(_facts(same_tokens=True), "all_reduce") == "all_reduce"
    assert choose(_facts(same_tokens=True)) == "all_to_all"  # eager: the exact exchange computes each slot once
    with pytest.raises(ValueError, match="did not say every rank holds the same tokens"):
        choose(_facts(), "all_reduce")


def test_under_capture_auto_takes_a_strategy_without_host_sync() -> None:
    captured = _facts(capturing=True)
    verdict = check_strategy(STRATEGIES["all_to_all"], captured)
    assert verdict.status is Status.UNSUPPORTED_CONFIG and "reads its split sizes back to the host" in verdict.reason
    assert "all_to_all_padded" in verdict.remedy
    assert choose(captured) == "all_to_all_padded"
    assert choose(_facts(capturing=True, same_tokens=True)) == "all_reduce"  # no token moves: fewer bytes
    with pytest.raises(ValueError, match="a CUDA graph cannot capture"):
        choose(captured, "all_to_all")
    assert [s.name for s in STRATEGIES.values() if s.capturable] == ["all_to_all_padded", "all_reduce"]
    assert all(s.tradeoff for s in STRATEGIES.values())


def test_strategies_refuse_without_group_on_other_backends_and_uneven_experts() -> None:
    no_group = check_strategy(STRATEGIES["all_to_all"], _facts(has_group=False, world_size=0, backend=None))
    assert no_group.status is Status.UNSUPPORTED_CONFIG and "needs a torch.distributed process group" in no_group.reason
    mpi = check_strategy(STRATEGIES["all_to_all_padded"], _facts(backend="mpi"))
    assert "gloo or nccl" in mpi.reason and "'mpi'" in mpi.reason
    uneven = check_strategy(STRATEGIES["all_reduce"], _facts(world_size=3, same_tokens=True))
    assert "size 3 must divide the 8 experts" in uneven.reason
    with pytest.raises(ValueError, match=r"no expert-parallel strategy runs here \(all_to_all: .*size 3"):
        choose(_facts(world_size=3))
    known = "unknown expert-parallel strategy 'ring'; known: auto, all_reduce, all_to_all, all_to_all_padded"
    with pytest.raises(ValueError, match=known):
        choose(_facts(), "ring")


def test_nccl_missing_or_too_old_is_a_missing_package() -> None:
    missing = _facts(backend="nccl", nccl_problem="torch 2.13.0 is a CPU build, without NCCL")
    verdict = check_strategy(STRATEGIES["all_to_all"], missing)
    assert verdict.status is Status.MISSING_PACKAGE and "needs NCCL: torch 2.13.0 is a CPU build" in verdict.reason
    with pytest.raises(ImportError, match="needs NCCL"):  # something missing: ImportError, as for backends
        choose(missing, "all_to_all_padded")
    assert choose(_facts(backend="gloo", nccl_problem="no GPU")) == "all_to_all"  # gloo needs no NCCL
    old = _facts(backend="nccl", nccl_version=(2, 8, 3))
    assert check_strategy(STRATEGIES["all_to_all"], old).ok  # all_to_all_single needs 2.7
    too_old = check_strategy(STRATEGIES["all_to_all_padded"], old)
    assert too_old.status is Status.PACKAGE_TOO_OLD and "needs NCCL 2.9.6 or newer" in too_old.reason
    assert "NCCL 2.8.3" in too_old.found
    assert check_strategy(STRATEGIES["all_to_all_padded"], _facts(backend="nccl")).ok  # version unknown: not refused


def test_one_rank_runs_and_says_nothing_is_spread() -> None:
    verdict = check_strategy(STRATEGIES["all_to_all"], _facts(world_size=1))
    assert verdict.ok and "one rank holds every expert" in verdict.reason


def test_a_layer_without_process_group_refuses_before_cutting_weights() -> None:
    from selector.parallel import ExpertParallel, shard_experts
    from selector.testing import make_experts

    experts = make_experts(E, H, I, seed=1)
    with pytest.raises(ValueError, match="needs a torch.distributed process group.*fix: call torch.distributed.init"):
        shard_experts(experts)
    assert experts.gate_up_proj.shape[0] == E and experts.num_experts == E
    with pytest.raises(ValueError, match="needs a torch.distributed process group"):
        ExpertParallel(experts, num_experts=E)
    with pytest.raises(ValueError, match="needs a torch.distributed process group"):
        shard_experts(experts, strategy="all_to_all_padded", capacity=4)


# --- doctor -----------------------------------------------------------------------------------------------------------


def test_doctor_facts_read_nccl_off_the_probes() -> None:
    env = collect_environment({**H200, "SELECTOR_PACKAGE_NVIDIA_NCCL_CU12": "2.27.3"})
    facts, source = doctor_facts(env, 2, 256, environ={"SELECTOR_PACKAGE_NVIDIA_NCCL_CU12": "2.27.3"})
    assert (facts.backend, facts.world_size, facts.nccl_version, facts.nccl_problem) == ("nccl", 2, (2, 27, 3), None)
    assert "nvidia-nccl-cu12 2.27.3" in source
    cpu = collect_environment({"SELECTOR_TORCH_CUDA": "", "SELECTOR_GPUS": "", "PATH": ""})
    facts, source = doctor_facts(cpu, 2, 8, environ=NO_NCCL_DIST)
    assert facts.backend == "gloo" and "is a CPU build, without NCCL" in (facts.nccl_problem or "") and source == ""
    facts, _ = doctor_facts(cpu, 2, 8, backend="nccl", environ=NO_NCCL_DIST)
    assert not build_section(facts, "test").lines[0].verdict.ok


def _report(parallel: object = None) -> object:
    from selector.doctor import build_report
    from selector.registry import get_registry

    env = collect_environment(H200)
    return build_report(env, get_registry(), parallel=parallel)


def test_doctor_renders_each_strategy_with_its_verdicts_in_text_json_and_markdown() -> None:
    from selector.render import render_json, render_markdown, render_text

    env = collect_environment(H200)
    facts, nccl = doctor_facts(env, 2, 256, environ={"SELECTOR_PACKAGE_NVIDIA_NCCL_CU12": "2.27.3"})
    report = _report(build_section(facts, "--ep-size 2", nccl))
    text = render_text(report)
    assert "Expert parallelism (2 ranks over nccl, NCCL 2.27.3, E=256; --ep-size 2): auto runs all_to_all; " \
           "under CUDA graphs and torch.compile all_to_all_padded" in text  # fmt: skip
    assert "✗ all_reduce" in text and "fix: pass same_tokens=True" in text
    assert "under CUDA graphs / torch.compile: excluded, expert-parallel strategy 'all_to_all' reads" in text
    assert "trade-off: moves (world - 1) x capacity rows" in text
    section = json.loads(render_json(report))["expert_parallel"]
    assert section["auto"] == "all_to_all" and section["auto_captured"] == "all_to_all_padded"
    assert section["nccl_version"] == "2.27.3" and section["world_size"] == 2
    by_name = {s["name"]: s for s in section["strategies"]}
    assert by_name["all_to_all"]["status"] == "ok"
    assert by_name["all_to_all"]["captured"]["status"] == "unsupported_config"
    assert by_name["all_to_all_padded"]["capturable"] is True
    markdown = render_markdown(report)
    assert "| all_to_all_padded | ok | ok |" in markdown and "| all_reduce | unsupported_config |" in markdown
    assert report.exit_code == 0


def test_doctor_without_a_group_says_so_and_a_group_where_nothing_runs_is_broken() -> None:
    from selector.render import render_text

    report = _report()
    assert "Expert parallelism: no process group (`selector doctor --ep-size N`" in render_text(report)
    assert report.to_dict()["expert_parallel"]["has_group"] is False and report.exit_code == 0
    assert no_group_section(8).chosen is None
    from selector.parallel.report import group_section

    live = group_section(None, 8)  # no process group initialised in this process
    assert live.source == "no process group" and not live.facts.has_group
    uneven = _report(build_section(_facts(world_size=3), "--ep-size 3"))
    assert uneven.exit_code == 1
    assert any("expert parallelism over 3 ranks: no strategy runs (all_to_all:" in b for b in uneven.broken)


def test_cli_doctor_ep_size(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from selector import cli

    for name, value in {**H200, **NO_NCCL_DIST, "SELECTOR_PACKAGE_NVIDIA_NCCL_CU12": "2.21.5"}.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["doctor", "--json", "--preset", "qwen3-30b-a3b", "--ep-size", "4", "--ep-same-tokens"]) == 0
    section = json.loads(capsys.readouterr().out)["expert_parallel"]
    assert (section["world_size"], section["num_experts"], section["backend"]) == (4, 128, "nccl")
    assert section["auto_captured"] == "all_reduce" and section["same_tokens"] is True
    assert cli.main(["doctor", "--ep-size", "3"]) == 1  # 3 ranks cannot share the 8 experts of the default layer
    assert "no strategy runs" in capsys.readouterr().out
    assert cli.main(["doctor", "--ep-size", "0"]) == 2
    assert "--ep-size must be at least 1" in capsys.readouterr().err
    assert cli.main(["doctor", "--ep-size", "2", "--ep-backend", "gloo"]) == 0
    assert "2 ranks over gloo" in capsys.readouterr().out


def test_captured_padded_exchange_needs_a_capacity_or_an_eager_proof(tmp_path, monkeypatch) -> None:
    """Under capture or compile each rank would pad to its own count: refused unless the counts were proved equal
    (an eager padded call) or a capacity is given. A world of one, over gloo, in this process."""
    import torch
    import torch.distributed as dist

    from selector.parallel import layer as ep_layer
    from selector.parallel import shard_experts
    from selector.testing import make_experts

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        full = make_experts(4, 16, 8, seed=0).requires_grad_(False)
        x, ids = torch.randn(3, 16), torch.tensor([[0, 1], [2, 3], [1, 2]])
        w = torch.full((3, 2), 0.5)
        auto = shard_experts(full, implementation="eager")
        bounded = shard_experts(make_experts(4, 16, 8, seed=0).requires_grad_(False), implementation="eager",
                                capacity=3)  # fmt: skip
        monkeypatch.setattr(ep_layer, "capturing_now", lambda t: True)
        assert auto.captured_strategy == "all_to_all_padded"
        with pytest.raises(ValueError, match="pass capacity="):
            auto.strategy_for(x)
        assert bounded.strategy_for(x) == "all_to_all_padded"
        with pytest.raises(ValueError, match="pass capacity="):
            ep_layer.expert_parallel_forward(full, None, 4, x, ids, w)
        monkeypatch.setattr(ep_layer, "capturing_now", lambda t: False)
        auto.strategy = "all_to_all_padded"
        auto(x, ids, w)  # the eager padded call proves the counts agree
        monkeypatch.setattr(ep_layer, "capturing_now", lambda t: True)
        assert auto.strategy_for(x) == "all_to_all_padded"
    finally:
        dist.destroy_process_group()
