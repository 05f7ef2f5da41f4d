"""The contract check plugin authors run (`selector.testing`): it passes the built-in backends and catches a
backend that gets a declared layout wrong, writes into its inputs, or returns the wrong thing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from selector import BackendSpec, Requirements
from selector.dispatch import get_backend_registry
from selector.testing import assert_backend_contract, check_backend_contract


@pytest.mark.parametrize("name", ["eager", "grouped_mm", "batched_mm"])
def test_the_cpu_builtins_keep_their_contract_on_every_layout(name: str) -> None:
    report = assert_backend_contract(name, device="cpu")
    assert set(report.results.values()) == {"ok"}  # they declare every layout
    assert report.describe().startswith(f"{name} on cpu (float32):")


def _eager_forward():  # noqa: ANN202
    return get_backend_registry().get("eager").load()


def test_a_backend_that_ignores_a_bias_it_declares_is_caught() -> None:
    eager = _eager_forward()

    def no_bias(module, x, idx, w):  # noqa: ANN001, ANN202
        saved = module.has_bias
        module.has_bias = False  # the bug: runs the matmuls without the biases
        try:
            return eager(module, x, idx, w)
        finally:
            module.has_bias = saved

    spec = BackendSpec("fake_no_bias", load=lambda: no_bias, requirements=Requirements(bias=True))
    report = check_backend_contract(spec, device="cpu")
    assert not report.ok and report.results["plain"] == "ok"
    assert report.failures[0].startswith("fake_no_bias declares bias=True but T=1: differs from the float64 reference")
    assert report.results["transposed"] == "not declared"
    with pytest.raises(AssertionError, match="declares bias=True"):
        assert_backend_contract(spec, device="cpu")


def test_a_backend_that_writes_into_its_inputs_or_returns_garbage_is_caught() -> None:
    eager = _eager_forward()

    def scribbles(module, x, idx, w):  # noqa: ANN001, ANN202
        out = eager(module, x, idx, w)
        w.mul_(2.0)
        return out

    report = check_backend_contract(BackendSpec("fake_scribbles", load=lambda: scribbles), device="cpu")
    # an empty batch has nothing to scribble on
    assert report.results["plain"] == "T=1: wrote into its inputs; T=7: wrote into its inputs; T=33: wrote into its inputs"

    half = BackendSpec("fake_half", load=lambda: lambda m, x, i, w: eager(m, x, i, w).half())
    assert "returned (0, 32) torch.float16, expected (0, 32) torch.float32" in check_backend_contract(half).failures[0]
    zeros = BackendSpec("fake_zeros", load=lambda: lambda m, x, i, w: torch.zeros_like(x))
    failure = check_backend_contract(zeros, device="cpu").failures[0]
    assert failure.startswith("fake_zeros runs the plain layout but T=1: differs from the float64 reference")


def test_a_backend_that_cannot_run_here_is_reported_and_fails_having_checked_nothing() -> None:
    gpu_only = BackendSpec("fake_gpu", load=_eager_forward, requirements=Requirements(devices=frozenset({"cuda"})))
    report = check_backend_contract(gpu_only, device="cpu")
    assert not report.ok and report.checked == []  # a check that ran nothing proves nothing
    assert report.failures[0].startswith("fake_gpu checked no layout on cpu (float32): ")
    assert report.results["plain"].startswith("cannot run here: needs a CUDA GPU: runs on cuda, not on cpu")
    assert report.results["bias"] == "not declared"


def test_the_check_takes_a_spec_or_a_name() -> None:
    with pytest.raises(TypeError, match="takes a BackendSpec or a backend name"):
        check_backend_contract(42)
    with pytest.raises(ValueError, match="unknown experts backend 'nope'"):
        check_backend_contract("nope")
    assert check_backend_contract(replace(get_backend_registry().get("eager"), name="copy"), device="cpu").ok
