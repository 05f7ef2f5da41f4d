"""The quantised tuner's candidate runs on CPU: Triton's interpreter runs each candidate's launches, and a fake
timer (named so: the real one needs CUDA) records them instead of timing. What is checked is that every candidate
the tuner would time runs the layer's own launches (x's quantisation zeroing the counters and, with pair blocks,
the output; the down kernel's own combine) and that the config it returns is one the layer accepts."""

from __future__ import annotations

import math

import pytest
import torch

from selector.dispatch import reset_selection_caches

pytestmark = pytest.mark.interpreter


@pytest.fixture(autouse=True)
def fresh():
    reset_selection_caches()
    yield
    reset_selection_caches()


def test_tuner_candidates_run_the_layers_launches(monkeypatch):
    from selector.plugins.quant_kernels import activation_quant, configs, projection, tune
    from selector.plugins.triton_common import align, combine

    launched = []

    def spy(real):
        return lambda fn, grid, args, consts, *a: launched.append((fn.__name__, consts)) or real(fn, grid, args, consts, *a)

    for module in (activation_quant, projection, align, combine):  # every module the tuner's candidates launch from
        monkeypatch.setattr(module, "launch", spy(module.launch))
    timed = []
    monkeypatch.setattr(tune, "_time", lambda fn, graph: timed.append(fn()) or 1e-6 * len(timed))  # fake timer
    monkeypatch.setattr(tune, "GATE_UP", {16: ((32, 4, 4), (32, 4, 4, 2))})
    monkeypatch.setattr(tune, "DOWN", {"small": ((32, 4, 4), (32, 4, 4, 2)), "large": ((32, 4, 4),)})
    monkeypatch.setattr(tune, "SWAPPED", {"gate_up": ((32, 4, 4, 1, 1),), "down": ((32, 4, 4, 1, 1),)})
    monkeypatch.setattr(tune, "block_m_candidates", lambda pairs, e: (16,))
    torch.manual_seed(0)
    e, h, i, k = 4, 1024, 768, 2  # gate_up: 8 K steps (split 2 allowed); down: 6 (split 2 allowed for pair blocks)
    w1, s1 = tune._weights(e, 2 * i, h, False, torch.device("cpu"))
    w2, s2 = tune._weights(e, h, i, False, torch.device("cpu"))
    best = tune.tune_cell(w1, s1, w2, s2, False, 1, k, math.inf, log=lambda *_: None)

    quants = [c for n, c in launched if n == "_quant_rows_kernel"]
    assert any(c["ZERO"] and c["COUNTS"] for c in quants)  # pair blocks: out and every counter zeroed up front
    grouped = [c for n, c in launched if n == "_grouped_kernel"]
    assert any(c["COMBINE"] and c["SPLIT_K"] == 2 for c in grouped)  # a split pair-block down, combined in-kernel
    assert any(c["FINISH"] and c["SPLIT_K"] == 2 for c in grouped)  # a split gate_up, finished in-kernel
    assert "_combine_kernel" in [n for n, _ in launched]  # sorted blocks: the combine launch
    assert any(c["SWAP"] for c in grouped) and not all(c["SWAP"] for c in grouped)  # swapped tiles tried too
    assert any(c["ALIGN"] for c in quants)  # sorted blocks' align timed riding on x's quantisation, as the layer runs
    config = configs.normalize(best["config"])
    assert config["ROUTE"] in ("pairs", "sorted") and config["gate_up"]["BLOCK_N"] == 32
