"""What plugin authors get from selector: the contract check over every combination of the layout flags a backend
declares (and its failure when it checked nothing), the tuning-record type, and `selector store import`'s word on
keys outside the record format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selector import BackendSpec, Requirements, TuningRecord
from selector.cli import main
from selector.dispatch import get_backend_registry
from selector.testing import Layout, assert_backend_contract, check_backend_contract, contract_layouts, declared_flags
from selector.tuning_store import TuningStore
from selector.types import GateSupport, Problem


def _eager():  # noqa: ANN202
    return get_backend_registry().get("eager").load()


def _bias_lost_when_transposed():  # noqa: ANN202
    """A forward right in each layout alone that drops the biases of transposed weights only."""
    eager = _eager()

    def forward(module, x, idx, w):  # noqa: ANN001, ANN202
        saved = module.has_bias
        module.has_bias = saved and not module.is_transposed  # the bug: the transposed path forgets the biases
        try:
            return eager(module, x, idx, w)
        finally:
            module.has_bias = saved

    return forward


# --- the layouts the check builds --------------------------------------------------------------------------------


def test_every_combination_of_four_declared_flags_is_checked() -> None:
    req = Requirements(bias=True, transposed=True, interleaved=True, expert_parallel=True)
    names = [name for name, _ in contract_layouts(req)]
    assert len(names) == 16 and names[0] == "plain" and names[-1] == "bias+transposed+interleaved+expert_parallel"
    report = assert_backend_contract(BackendSpec("fake_four", load=_eager, requirements=req), device="cpu")
    assert report.checked == names
    assert report.results["post_expert_norm"] == report.results["non_gated"] == "not declared"
    assert report.describe().startswith("fake_four on cpu (float32): 16 layouts checked\n  plain: ok")


def test_layouts_that_make_no_layer_are_left_out() -> None:
    req = Requirements(gating=GateSupport(non_gated=True, custom=True), interleaved=True, bias=True)
    layouts = dict(contract_layouts(req))
    # a non-gated layer has no gate channels to interleave or gate; the clamped SwiGLU reads interleaved channels
    assert not any(n.startswith("non_gated+") and ("interleaved" in n or "custom" in n) for n in layouts)
    assert layouts["custom_gate"] == Layout(custom_gate=True, interleaved=True)
    assert "interleaved+custom_gate" not in layouts  # the same layer as custom_gate
    assert layouts["non_gated+bias"] == Layout(gated=False, bias=True)
    only_plain_experts = Requirements(gating=GateSupport(gated=False, non_gated=True), bias=True)
    assert [n for n, _ in contract_layouts(only_plain_experts)] == ["non_gated", "non_gated+bias"]


def test_a_gate_declared_by_name_counts_as_the_custom_gate_flag() -> None:
    clamped = GateSupport(gates=frozenset({"act_mul", "clamped_swiglu"}))
    assert declared_flags(Requirements(gating=clamped, interleaved=True)) == ("interleaved", "custom_gate")
    assert declared_flags(Requirements(gating=clamped)) == ()  # the clamped SwiGLU reads interleaved channels
    assert declared_flags(Requirements(gating=GateSupport(custom=True))) == ("custom_gate",)


# --- what the check catches --------------------------------------------------------------------------------------


def test_a_bias_lost_only_in_the_transposed_layout_is_caught() -> None:
    spec = BackendSpec("fake_half_bias", load=_bias_lost_when_transposed,
                       requirements=Requirements(bias=True, transposed=True))  # fmt: skip
    report = check_backend_contract(spec, device="cpu")
    assert {n: report.results[n] for n in ("plain", "bias", "transposed")} == dict.fromkeys(
        ("plain", "bias", "transposed"), "ok")  # each flag alone passes: the check of one flag at a time missed it
    assert report.results["bias+transposed"].startswith("T=1: differs from the float64 reference")
    assert len(report.failures) == 1 and report.failures[0].startswith(
        "fake_half_bias declares bias=True, transposed=True but T=1: differs from the float64 reference")
    with pytest.raises(AssertionError, match="declares bias=True, transposed=True"):
        assert_backend_contract(spec, device="cpu")


def test_a_backend_that_checked_no_layout_fails() -> None:
    bf16_only = BackendSpec("fake_bf16", load=_eager, requirements=Requirements(dtypes=frozenset({"bfloat16"}),
                                                                                 bias=True))  # fmt: skip
    report = check_backend_contract(bf16_only, device="cpu")
    assert not report.ok and report.checked == []
    assert report.results["bias"] == "cannot run here: does not run float32 experts (supports bfloat16)"
    assert report.failures == [
        "fake_bf16 checked no layout on cpu (float32): does not run float32 experts (supports bfloat16). A check "
        "that runs nothing proves nothing: pass the device and dtype it runs (check_backend_contract(spec, "
        "device=..., dtype=...)), or skip the test on a machine where it cannot run"
    ]
    with pytest.raises(AssertionError, match="checked no layout"):
        assert_backend_contract(bf16_only, device="cpu")
    no_layout = BackendSpec("fake_none", load=_eager, requirements=Requirements(gating=GateSupport(gated=False)))
    assert "declares no layout" in check_backend_contract(no_layout, device="cpu").failures[0]


def test_the_check_builds_its_experts_with_an_activation_the_backend_runs() -> None:
    gelu_only = Requirements(gating=GateSupport(activations=frozenset({"gelu"})), bias=True)
    report = assert_backend_contract(BackendSpec("fake_gelu", load=_eager, requirements=gelu_only), device="cpu")
    assert report.checked == ["plain", "bias"]


# --- the tuning record -------------------------------------------------------------------------------------------

PROBLEM = Problem(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2, dtype="float32", device="cpu",
                  has_bias=True)  # fmt: skip
FP = "f" * 32


def test_a_tuning_record_is_built_from_a_problem_and_validated() -> None:
    record = TuningRecord.for_problem(PROBLEM, backend="my_kernel", tokens=64, time_s=2e-4, fingerprint=FP,
                                      gpu="cpu", spread=0.02, tool="my-bench")  # fmt: skip
    assert record.to_dict() == {"fingerprint": FP, "gpu": "cpu", "mode": "eager", "tokens": 64,
                                "problem": "E8-H64-I32-k2/float32/dense/silu/gated+has_bias",
                                "backend": "my_kernel", "time_s": 2e-4, "spread": 0.02, "tool": "my-bench"}  # fmt: skip
    assert TuningRecord.from_dict(record.to_dict()) == record
    with pytest.raises(ValueError, match="tokens 0 outside"):
        TuningRecord.for_problem(PROBLEM, backend="my_kernel", tokens=0, time_s=2e-4, fingerprint=FP, gpu="cpu")
    with pytest.raises(ValueError, match="unknown key 'time_ms'"):
        TuningRecord.from_dict({**record.to_dict(), "time_ms": 0.2})
    with pytest.raises(ValueError, match="missing field 'gpu'"):
        TuningRecord.from_dict({k: v for k, v in record.to_dict().items() if k != "gpu"})


def test_store_import_warns_of_each_unknown_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    store_path = tmp_path / "node" / "tuning.sqlite3"
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(store_path))
    good = TuningRecord.for_problem(PROBLEM, backend="my_kernel", tokens=64, time_s=2e-4, fingerprint=FP,
                                    gpu="cpu").to_dict()  # fmt: skip
    misspelt = {**{k: v for k, v in good.items() if k != "time_s"}, "tokens": 8, "time_ms": 0.2}
    extra = {**good, "tokens": 16, "note": "warm cache", "sprd": 0.1}
    file = tmp_path / "records.json"
    file.write_text(json.dumps({"schema": "selector.tuning/2", "records": [good, misspelt, extra]}))
    assert main(["store", "import", str(file)]) == 0
    captured = capsys.readouterr()
    key = good["problem"]
    assert captured.err.splitlines() == [
        f"warning: record 2 (backend my_kernel, problem {key}, tokens 8): unknown key 'time_ms' "
        "(did you mean 'time_s'?), not stored",
        f"warning: record 3 (backend my_kernel, problem {key}, tokens 16): unknown key 'note', not stored",
        f"warning: record 3 (backend my_kernel, problem {key}, tokens 16): unknown key 'sprd' "
        "(did you mean 'spread'?), not stored",
    ]
    assert "stored 2, refused 1" in captured.out and "missing field 'time_s'" in captured.out
    assert sorted(r["tokens"] for r in TuningStore(store_path).records()) == [16, 64]
    assert all("note" not in r for r in TuningStore(store_path).records())
