"""`selector.tune_model` and SELECTOR_TUNE_ON_LOAD, with a fake CPU backend that declares a kernel tuner (the real
one, the fused Triton kernel's tile search, runs on a CUDA GPU: tests/test_tile_tuning*.py and the GPU suite)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from experts_fixtures import make_experts

import selector
from selector import BackendSpec, Requirements, hookimpl
from selector.layers import find_experts
from selector.tune.model import TUNE_TOKENS, model_shapes, tune_model
from selector.tune.runner import TuneUnavailable
from selector.tune.store import TuneStore


class TunablePlugin:
    """A fake plugin whose tuner remembers the shapes it tuned and skips them after, as the real one does."""

    tuned: set[tuple[int, int, int, int]] = set()
    calls: list[tuple[tuple[int, int, int, int], tuple[int, ...], float]] = []

    @staticmethod
    @hookimpl
    def selector_backends():
        def tune(problem, token_counts, budget_s):
            shape = (problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k)
            TunablePlugin.calls.append((shape, tuple(token_counts), budget_s))
            if shape in TunablePlugin.tuned:
                return {"shape": str(shape), "tokens_tuned": [], "skipped": "already tuned"}
            TunablePlugin.tuned.add(shape)
            return {"shape": str(shape), "tokens_tuned": list(token_counts)}

        return [
            BackendSpec(
                name="fake_tunable",
                load=lambda: (lambda module, h, i, w: torch.zeros_like(h)),
                requirements=Requirements(devices=frozenset({"cpu"})),
                tune_kernels=tune,
            )
        ]


@pytest.fixture
def tunable(fresh_registry):
    TunablePlugin.tuned = set()
    TunablePlugin.calls = []
    fresh_registry(fake_tunable=TunablePlugin)
    return TunablePlugin


def _experts(e: int, h: int, i: int) -> torch.nn.Module:
    module = make_experts(e, h, i)
    module.top_k = 2  # as a model's experts module declares it
    return module


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_experts(4, 16, 8), _experts(4, 16, 8), _experts(6, 16, 12)])


def test_find_experts_and_the_distinct_shapes() -> None:
    model = Model()
    assert [p for p, _ in find_experts(model)] == ["layers.0", "layers.1", "layers.2"]
    shapes = model_shapes(model)
    assert [(p.num_experts, p.intermediate_size) for p in shapes] == [(4, 8), (6, 12)]


def test_each_distinct_shape_is_tuned_once_within_the_budget(tunable, tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    done = tune_model(Model(), budget_s=10.0, progress=lambda what, i, n: seen.append((what, i, n)),
                      store=TuneStore(tmp_path / "store.sqlite3"))  # fmt: skip
    assert [c[0] for c in tunable.calls] == [(4, 16, 8, 2), (6, 16, 12, 2)]
    assert all(c[1] == TUNE_TOKENS for c in tunable.calls)
    # the budget shared: the first of two shapes may take half, the second what the first left
    assert 4.0 < tunable.calls[0][2] <= 5.0 and 9.0 < tunable.calls[1][2] <= 10.0
    assert len(done.tuned) == 2 and done.seconds < 10.0
    assert seen[0] == ("fake_tunable E=4 H=16 I=8 k=2", 0, 2) and seen[-1] == ("done", 2, 2)
    again = tune_model(Model(), budget_s=10.0, progress=False, store=TuneStore(tmp_path / "store.sqlite3"))
    assert again.tuned == []  # covered already: nothing measured twice


def test_a_second_process_waits_for_the_lock_then_finds_the_shapes_tuned(tunable, tmp_path: Path) -> None:
    store_path = tmp_path / "store.sqlite3"
    held = threading.Event()

    def first() -> None:  # another tuner holding the GPU's lock (a thread opens its own lock file: flock sees two)
        from selector.environment import current_environment
        from selector.tune.runner import lock_name

        with TuneStore(store_path).measurement_lock(lock_name(current_environment(), "cpu"), 5.0) as got:
            assert got
            held.set()
            TunablePlugin.tuned |= {(4, 16, 8, 2), (6, 16, 12, 2)}
            time.sleep(0.5)

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(5)
    start = time.perf_counter()
    done = tune_model(Model(), budget_s=10.0, progress=False, store=TuneStore(store_path))
    thread.join()
    assert time.perf_counter() - start >= 0.3  # it waited
    assert done.tuned == [] and len(done.summaries) == 2


def test_a_lock_held_too_long_is_a_clear_error(tunable, tmp_path: Path) -> None:
    from selector.environment import current_environment
    from selector.tune.runner import lock_name

    store = TuneStore(tmp_path / "store.sqlite3")
    with store.measurement_lock(lock_name(current_environment(), "cpu"), 1.0):
        with pytest.raises(TuneUnavailable, match="holds the measurement lock"):
            tune_model(Model(), budget_s=5.0, lock_timeout_s=0.2, progress=False, store=TuneStore(store.path))


def test_shapes_nothing_here_can_tune_are_listed() -> None:
    done = tune_model(Model(), budget_s=5.0, progress=False)  # the CPU: the fused kernel's tuner needs CUDA
    assert done.summaries == [] and set(done.untunable) == {"E=4 H=16 I=8 k=2", "E=6 H=16 I=12 k=2"}
    assert "declares a kernel tuner" in done.untunable["E=4 H=16 I=8 k=2"]
    with pytest.raises(ValueError, match="budget_s must be positive"):
        tune_model(Model(), budget_s=0)


def test_tune_on_load_runs_after_a_transformers_load(tunable, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("SELECTOR_TUNE_ON_LOAD", "20")
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(tmp_path / "store.sqlite3"))
    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    selector.from_config(transformers.AutoModelForCausalLM, config)
    assert [c[0] for c in tunable.calls] == [(4, 16, 8, 2)]  # two layers, one shape, tuned once
