"""generate() decode steps through selector: compiled as one graph, recorded graphs replayed, not re-recorded.

Tiny randomly initialised Qwen2-MoE models, fp32 on the CPU. The fused Triton backend runs on the CPU through
Triton's interpreter (tests/conftest.py switches it on on machines without CUDA), registered here as a CPU
backend "fused_cpu" so that "auto" picks it, as it picks triton_fused on a GPU.
"""

from __future__ import annotations

import inspect
import os
import types
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

import selector  # noqa: E402
import selector.hf as hf  # noqa: E402
from selector import BackendSpec, Requirements, graphs, hookimpl  # noqa: E402
from selector.dispatch import clear_last_backend, last_backend, reset_selection_caches  # noqa: E402
from selector.registry import register_plugin, unregister_plugin  # noqa: E402

from transformers import AutoModelForCausalLM, CompileConfig, Qwen2MoeConfig, StaticCache  # noqa: E402

pytestmark = pytest.mark.compile

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="runs Triton kernels on the CPU (interpreter)")
VOCAB = 64


def _model(implementation: str = "auto") -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            initializer_range=0.2)
    model = selector.from_config(AutoModelForCausalLM, config, experts_implementation=implementation)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model.eval()


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for members in hf.experts_modules(model).values() for _, m in members]


def _prompt(batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(2))


def _load_fused():  # noqa: ANN202
    from selector.plugins.triton_fused.forward import triton_fused_experts_forward

    return triton_fused_experts_forward


def _prepare_fused(module, problem):  # noqa: ANN001, ANN202
    from selector.plugins.triton_fused.forward import prepare

    return prepare(module, problem)


@hookimpl
def _fused_cpu_backends():
    # the real triton_fused adapter (graph replay at decode sizes, custom op under torch.compile), on the CPU
    return [BackendSpec(name="fused_cpu", load=_load_fused, prepare=_prepare_fused,
                        requirements=Requirements(devices=frozenset({"cpu"})), estimate=lambda problem, env: 1e-9)]


@pytest.fixture
def fused_cpu() -> Iterator[None]:
    register_plugin(types.SimpleNamespace(selector_backends=_fused_cpu_backends), "fused_cpu_test_plugin")
    reset_selection_caches()
    hf.register_with_transformers()
    try:
        yield
    finally:
        unregister_plugin("fused_cpu_test_plugin")
        reset_selection_caches()
        hf.register_with_transformers()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_generate(model, ids, cache, new_tokens: int, config=None) -> torch.Tensor:
    """generate() with Transformers' compiled decode step (CPU: its own test switch), one reused cache."""
    config = config or CompileConfig(backend="eager", fullgraph=True)
    config._compile_all_devices = True
    cache.reset()
    # the cache's keyword: "cache" from Transformers 5.2x, "past_key_values" before
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, compile_config=config, **{name: cache})


# ---------------------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["auto", "selector:grouped_mm"])
def test_tracing_leaves_the_experts_modules_untouched(name):
    # Dynamo in torch 2.11 cannot trace calls on a module's __dict__ (a setdefault there broke the graph at
    # every layer on the GPU machine); newer versions trace them as side effects. Either way tracing must
    # neither read nor write selector's per-module caches.
    # (auto's opaque op runs the eager path when the compiled graph runs: the state is read at compile time)
    model = _model(name)  # loading reports the choice: each module already has its id and problem
    before = [set(m.__dict__) for m in _experts(model)]
    traced = []

    def snapshot(gm, example_inputs):
        traced.append([set(m.__dict__) for m in _experts(model)])
        return gm.forward

    ids = _prompt()
    with torch.no_grad():
        out = torch.compile(model.forward, backend=snapshot, fullgraph=True)(ids).logits
        assert traced == [before]
        torch.testing.assert_close(out, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert any(set(m.__dict__) - b for m, b in zip(_experts(model), before))  # eager calls do cache


@pytest.mark.interpreter
@needs_interpreter
def test_compiled_decode_is_one_graph_that_runs_the_fused_kernel(fused_cpu, monkeypatch):
    from selector.plugins.triton_fused import forward as fused_forward
    from selector.plugins.triton_fused import kernels

    model = _model("auto")
    ids = _prompt(batch=1, length=5)
    with torch.no_grad():
        eager_tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                      min_new_tokens=4, do_sample=False)
    assert {last_backend(m) for m in _experts(model)} == {"fused_cpu"}
    calls: list[int] = []
    impl = kernels.fused_experts_impl

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])  # (layer record, hidden_states, ...)
        return impl(*args, **kwargs)

    monkeypatch.setattr(kernels, "fused_experts_impl", counted)  # what the custom op runs
    monkeypatch.setattr(fused_forward, "fused_experts_impl", counted)  # what the plan runs inside the opaque op
    from torch._dynamo.utils import counters

    counters.clear()
    cache = StaticCache(config=model.config, max_cache_len=16)
    for _ in range(3):  # later calls reuse the compiled step: no recompiles
        tokens = _compiled_generate(model, ids, cache, 4)
        torch.testing.assert_close(tokens, eager_tokens, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1  # fullgraph: a break would have raised
    assert not counters["graph_break"]
    assert calls.count(1) == 3 * 3 * len(_experts(model))  # 3 compiled decode steps per call, every layer


@pytest.mark.interpreter
def test_compile_config_with_module_guards_skipped(fused_cpu, monkeypatch):
    """selector.hf.compile_config(skip_module_guards=True) reaches torch.compile through generate(): Dynamo
    consults the guard filter, and the compiled decode gives the eager tokens."""
    model = _model("auto")
    ids = _prompt(batch=1, length=5)
    with torch.no_grad():
        eager_tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                      min_new_tokens=3, do_sample=False)
    consulted = []
    real = torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe
    monkeypatch.setattr(torch.compiler, "skip_guard_on_inbuilt_nn_modules_unsafe",
                        lambda entries: consulted.append(len(entries)) or real(entries))
    config = hf.compile_config(backend="eager", skip_module_guards=True)
    assert config.mode is None and config.fullgraph and "guard_filter_fn" in config.options
    torch._dynamo.reset()
    tokens = _compiled_generate(model, ids, StaticCache(config=model.config, max_cache_len=16), 3, config)
    torch._dynamo.reset()  # the next test compiles with guards again
    torch.testing.assert_close(tokens, eager_tokens, rtol=0, atol=0)
    assert consulted and max(consulted) > 0
    plain = hf.compile_config()
    assert plain.mode == "reduce-overhead" and plain.fullgraph and not plain.options
    inductor = hf.compile_config(skip_module_guards=True)  # the mode travels as its Inductor options
    assert inductor.mode is None and inductor.options["triton.cudagraphs"] is True
    default = hf.compile_config(mode=None, skip_module_guards=True)  # Inductor's default mode: no extra options
    assert set(default.options) == {"guard_filter_fn"}


# ---------------------------------------------------------------------------------------------------------
# recorded graphs at decode sizes (selector.graphs)
# ---------------------------------------------------------------------------------------------------------


class _FakeRecording:
    """Stands in for a CUDA graph on the CPU: counts recordings, 'replays' by running the call again."""

    made: list[tuple] = []

    def __init__(self, run, inputs) -> None:
        self.run = run
        _FakeRecording.made.append(tuple(t.shape for t in inputs))

    def __call__(self, inputs, run):  # noqa: ANN001
        return self.run(*inputs)


@pytest.mark.interpreter
@needs_interpreter
def test_decode_steps_replay_their_graph_and_never_record_again(fused_cpu, monkeypatch):
    monkeypatch.setattr(graphs, "graphs_enabled", lambda x, max_tokens, variable: 0 < x.shape[0] <= max_tokens)
    monkeypatch.setattr(graphs, "RecordedCall", _FakeRecording)
    _FakeRecording.made = []
    model = _model("auto")
    ids = _prompt(batch=2, length=6)
    layers = len(_experts(model))
    with torch.no_grad():
        for new_tokens in (5, 5, 8):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False)
            # one recording per layer and shape (prefill: 12 tokens, decode: 2), whatever the number of steps
            assert sorted(shapes[0][0] for shapes in _FakeRecording.made) == [2] * layers + [12] * layers
    assert {last_backend(m) for m in _experts(model)} == {"fused_cpu"}


@pytest.mark.gpu
def test_gpu_decode_graphs_recorded_once_per_shape():
    model = _model("triton_fused").to("cuda")
    ids = _prompt(batch=2, length=6).to("cuda")
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        first = graphs.recordings()
        for _ in range(2):
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                           do_sample=False)
    assert graphs.recordings() == first
