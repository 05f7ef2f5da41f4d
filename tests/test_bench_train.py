"""`selector bench --modes train` on the CPU: one sample is a training step (forward under autograd, then the
backward); only backends with a backward for every input are timed, their gradients checked against float64, the
layer's frozen weights restored for the other modes, and no train cell becomes a tuning record. The times mean
nothing here; the harness is what is checked."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from selector import BackendSpec, Requirements, hookimpl
from selector.bench import BenchOptions, run_bench, write_outputs
from selector.bench import grid as grid_module
from selector.bench.cells import BenchResult, Cell, choice_quality
from selector.bench.grid import records_from_bench, trainable
from selector.bench.layer import grad_errors, make_layer, random_routing, temp_bytes_estimate
from selector.dispatch import backend_forward
from selector.presets import preset
from selector.types import GRAD_INPUTS

CEILINGS = {"bandwidth_Bps": 4.25e12, "bf16_flops": 782e12}
TINY = replace(preset("qwen3-30b-a3b"), num_experts=4, hidden_size=32, intermediate_size=16, top_k=2)
TORCH_BACKENDS = ["eager", "batched_mm", "grouped_mm"]


def _grouped(module: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    return backend_forward("grouped_mm")(module, hidden_states, top_k_index, top_k_weights)


def _detached(module: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """Right forward, wrong backward: the expert weights' gradient never reaches the module."""
    twin = make_layer(torch, TINY, hidden_states.dtype, hidden_states.device, 0,
                      weights=(module.gate_up_proj.detach(), module.down_proj.detach()))  # fmt: skip
    return backend_forward("grouped_mm")(twin, hidden_states, top_k_index, top_k_weights)


class FakeKernels:
    """A fake plugin on the CPU: a forward-only backend estimated fastest (auto's inference pick), one whose
    backward covers the hidden states only, one that declares nothing about its backward, and one that declares
    every gradient but drops the expert weights' (its gradient check must fail)."""

    @staticmethod
    @hookimpl
    def selector_backends():  # noqa: ANN205
        cpu = Requirements(devices=frozenset({"cpu"}))
        fast = lambda problem, env: 0.0  # noqa: E731
        slow = lambda problem, env: 1e9  # noqa: E731
        return [
            BackendSpec(name="fake_forward_only", load=lambda: _grouped, requirements=cpu, estimate=fast,
                        differentiable=frozenset()),
            BackendSpec(name="fake_hidden_only", load=lambda: _grouped, requirements=cpu, estimate=slow,
                        differentiable=frozenset({"hidden_states"})),
            BackendSpec(name="fake_undeclared", load=lambda: _grouped, requirements=cpu, estimate=slow),
            BackendSpec(name="fake_detached", load=lambda: _detached, requirements=cpu, estimate=slow,
                        differentiable=frozenset(GRAD_INPUTS)),
        ]  # fmt: skip


def _run(backends: list[str], modes: list[str], shape: str = "tiny", **kw: Any) -> BenchResult:
    options = {"dtype_name": "float32", "device": "cpu", "ceilings": CEILINGS, "rounds": 2, "with_peers": False, **kw}
    return run_bench({shape: TINY}, [5], BenchOptions(backends=backends, modes=modes, **options))


def _cells(result: BenchResult, mode: str) -> dict[str, Cell]:
    return {c.backend: c for c in result.cells if c.mode == mode}


def test_train_mode_times_a_training_step_of_the_torch_backends_with_exact_gradients() -> None:
    result = _run(TORCH_BACKENDS, ["train"])
    rows = _cells(result, "train")
    assert set(rows) == {*TORCH_BACKENDS, "auto"}
    for name, cell in rows.items():
        assert cell.skipped is None, (name, cell.skipped)
        assert cell.time_s and cell.rounds == 2 and cell.tflops is not None
        assert cell.rel_error is not None and cell.rel_error < 1e-5
        assert cell.grad_rel_errors is not None and set(cell.grad_rel_errors) == set(GRAD_INPUTS)
        assert cell.grad_rel_error == max(cell.grad_rel_errors.values()) and cell.grad_rel_error < 1e-5
    assert rows["auto"].picked in TORCH_BACKENDS and rows[rows["auto"].picked].auto_pick
    # the step's floor: three times the forward's FLOPs, so above the forward's floor
    forward = _cells(_run(["grouped_mm"], ["eager"]), "eager")["grouped_mm"]
    assert rows["grouped_mm"].floor_s > forward.floor_s


def test_train_mode_checks_the_gradients_of_the_gpt_oss_layout_biases_included() -> None:
    """Transposed, interleaved gate/up, biases, clamped SwiGLU: the float64 gradients follow the layout."""
    layout = replace(preset("gpt-oss-20b"), num_experts=4, hidden_size=32, intermediate_size=16, top_k=2)
    options = BenchOptions(
        dtype_name="float32",
        backends=["grouped_mm", "batched_mm"],
        modes=["train"],
        with_peers=False,
        device="cpu",
        ceilings=CEILINGS,
        rounds=1,
    )
    result = run_bench({"oss": layout}, [5], options)
    rows = _cells(result, "train")
    for name in ("grouped_mm", "batched_mm"):
        assert rows[name].grad_rel_error is not None and rows[name].grad_rel_error < 1e-5, rows[name]


def test_backends_without_a_full_backward_are_skipped_and_auto_trains_with_another(fresh_registry: Any) -> None:
    fresh_registry(FakeKernels)
    names = ["fake_forward_only", "fake_hidden_only", "fake_undeclared", "fake_detached", "grouped_mm"]
    result = _run(names, ["train", "eager"])
    train, eager = _cells(result, "train"), _cells(result, "eager")
    assert train["fake_forward_only"].skipped.startswith(
        "no backward for hidden_states, routing_weights, expert_weights: has no backward")
    assert "has no gradient for routing_weights, expert_weights" in train["fake_hidden_only"].skipped
    assert "declared (the backend sets no differentiable=)" in train["fake_undeclared"].skipped
    assert all(train[n].time_s is None for n in ("fake_forward_only", "fake_hidden_only", "fake_undeclared"))
    # a declared backward that loses the expert weights' gradient is timed, and its check reads it
    detached = train["fake_detached"]
    assert detached.time_s and detached.grad_rel_errors["expert_weights"] == pytest.approx(1.0)
    assert detached.grad_rel_errors["hidden_states"] < 1e-5 and detached.grad_rel_error == pytest.approx(1.0)
    assert train["grouped_mm"].grad_rel_error < 1e-5
    # auto: the forward-only backend when nothing is differentiated, a differentiable one in the training step;
    # the eager mode ran after train mode, so the layer's weights were frozen again
    assert eager["auto"].picked == "fake_forward_only" and all(c.time_s for c in eager.values())
    assert train["auto"].picked not in (None, "fake_forward_only", "fake_hidden_only") and train["auto"].time_s


def test_the_layer_weights_are_frozen_again_after_train_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Any] = []

    def keep(*args: Any, **kw: Any) -> Any:
        built.append(make_layer(*args, **kw))
        return built[-1]

    monkeypatch.setattr(grid_module, "make_layer", keep)
    result = _run(["grouped_mm"], ["train"])
    assert _cells(result, "train")["grouped_mm"].time_s
    (layer,) = built
    assert [(p.requires_grad, p.grad) for p in layer.parameters()] == [(False, None), (False, None)]


def test_trainable_restores_each_flag_even_when_the_block_raises() -> None:
    layer = make_layer(torch, TINY, torch.float32, torch.device("cpu"), 0)
    layer.down_proj.requires_grad_(True)
    with pytest.raises(RuntimeError, match="inside"):
        with trainable(layer) as params:
            assert all(p.requires_grad for p in params) and len(params) == 2
            layer.gate_up_proj.sum().backward()
            raise RuntimeError("inside the block")
    assert (layer.gate_up_proj.requires_grad, layer.down_proj.requires_grad) == (False, True)
    assert layer.gate_up_proj.grad is None


def test_grad_errors_reads_float32_gradients_as_close_and_a_missing_one_as_far() -> None:
    layer = make_layer(torch, TINY, torch.float32, torch.device("cpu"), 0)
    index, weights = random_routing(torch, 6, 4, 2, torch.device("cpu"), seed=1)
    x, g = torch.randn(6, 32), torch.randn(6, 32)
    xs, ws = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    with trainable(layer):
        backend_forward("eager")(layer, xs, index, ws).backward(g)
        grads = {"hidden_states": xs.grad, "routing_weights": ws.grad,
                 "gate_up_proj": layer.gate_up_proj.grad, "down_proj": layer.down_proj.grad}  # fmt: skip
        exact = grad_errors(torch, layer, TINY, x, index, weights, g, grads)
        missing = grad_errors(torch, layer, TINY, x, index, weights, g, {**grads, "down_proj": None})
    assert list(exact) == list(GRAD_INPUTS) and max(exact.values()) < 1e-5  # float32 against float64
    assert 0.1 < missing["expert_weights"] < 1 and missing["hidden_states"] < 1e-5


def test_train_cells_stay_out_of_tuning_records_and_choice_quality_keys_by_mode(tmp_path: Path) -> None:
    # named as a preset, so that records_from_bench finds its problem (it keys records by the preset's)
    result = _run(["grouped_mm", "batched_mm"], ["eager", "train"], shape="qwen3-30b-a3b")
    records = records_from_bench(result)
    assert sorted((r["backend"], r["mode"]) for r in records) == [("batched_mm", "eager"), ("grouped_mm", "eager")]
    rows = choice_quality(result.cells)["rows"]
    assert sorted(r["mode"] for r in rows) == ["eager", "train"]
    write_outputs(result, tmp_path)
    table = (tmp_path / "bench.md").read_text()
    assert "| qwen3-30b-a3b | 5 | train | dense |" in table and "Gradient check" in table
    assert '"grad_rel_error"' in (tmp_path / "bench.json").read_text()


def test_train_mode_memory_estimate_counts_activations_and_weight_gradients() -> None:
    big = preset("deepseek-v3")
    forward = temp_bytes_estimate("grouped_mm", 4096, big, 2)
    step = temp_bytes_estimate("grouped_mm", 4096, big, 2, train=True)
    assert step > 2 * forward + 3 * big.num_experts * big.hidden_size * big.intermediate_size * 2
    # a cap between the tiny layer's forward temporaries (5 KB) and its training step's (40 KB)
    assert temp_bytes_estimate("grouped_mm", 5, TINY, 4) < 20e3 < temp_bytes_estimate("grouped_mm", 5, TINY, 4, True)
    result = _run(["grouped_mm"], ["train", "eager"], memory_cap_gb=20e3 / 2**30)
    train, eager = _cells(result, "train"), _cells(result, "eager")
    assert (train["grouped_mm"].skipped or "").startswith("a training step needs more than 1.86265e-05 GB")
    assert eager["grouped_mm"].time_s and train["grouped_mm"].time_s is None


def test_cli_parses_train_mode_and_refuses_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    from selector.cli import build_parser

    args = build_parser().parse_args(["bench", "--modes", "eager,train"])
    assert args.modes == ["eager", "train"]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--modes", "train,backprop"])
    assert exit_info.value.code == 2
    assert "backprop: expected some of eager, graph, compile, train" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown mode"):
        run_bench({"tiny": TINY}, [1], BenchOptions(modes=["backprop"], device="cpu", ceilings=CEILINGS))


@pytest.mark.gpu
def test_train_mode_on_the_gpu_times_triton_fused_and_checks_its_gradients() -> None:
    """The fused kernel's backward against float64 in bf16, beside grouped_mm, timed in one interleaved run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = replace(preset("qwen3-30b-a3b"), num_experts=16)
    options = BenchOptions(
        backends=["triton_fused", "grouped_mm"], modes=["train"], with_peers=True, ceilings=CEILINGS, rounds=3
    )
    result = run_bench({"small": shape}, [64, 512], options)
    train = [c for c in result.cells if c.mode == "train"]
    for name in ("triton_fused", "grouped_mm", "auto"):
        cells = [c for c in train if c.backend == name]
        assert len(cells) == 2 and all(c.time_s and c.skipped is None for c in cells), cells
        assert all(c.grad_rel_error is not None and c.grad_rel_error < 3e-2 for c in cells), cells
        assert all(c.extra_memory_bytes and c.extra_memory_bytes > 0 for c in cells)
    assert all(c.picked for c in train if c.backend == "auto")
