"""Dynamo guards of a compiled decode step: what "auto" adds over Transformers' own batched_mm.

Every call of a torch.compile'd model first evaluates its guards on the host; in a host-bound decode loop
(compiled generate(), CUDA graphs) that time is part of every token. These tests read the guards of the
compiled decode step of tiny Qwen2-MoE models (fp32, CPU) and bound what selector's dispatch adds:
- no NO_HASATTR guard on an experts module: each is evaluated through nn.Module.__getattr__ raising
  AttributeError (Python, ~1 us), once per layer and call; selector pins the attributes it and the backends
  read with a default (selector.dispatch.PINNED_DEFAULTS, the k of the last call);
- no guard on os.environ through selector's modules (environment reads stay out of traced code);
- per layer at most one more guard evaluated in Python than batched_mm, and a bounded number of C++ ones.
"""

from __future__ import annotations

import inspect
import re
import types
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

import selector  # noqa: E402
import selector.hf as hf  # noqa: E402
from selector.dispatch import clear_last_backend, last_backend, reset_selection_caches  # noqa: E402
from selector.registry import register_plugin, unregister_plugin  # noqa: E402

from transformers import AutoModelForCausalLM, CompileConfig, Qwen2MoeConfig, StaticCache  # noqa: E402

from test_hf_compile_decode import INTERPRETER, _fused_cpu_backends  # noqa: E402

pytestmark = pytest.mark.compile

VOCAB = 64
# What "auto" may add over batched_mm (measured with torch 2.13, transformers 5.24: 60-71 for the model,
# 5-9 per layer of which 0-1 are evaluated in Python; before selector pinned its defaults, 3 per layer were)
# selector's functions and module globals: C++ identity checks (the routing guard's code and tag: 6 of them)
FIXED_EXTRA = 86
EXTRA_PER_LAYER = 12  # C++ type/value checks of the flags selector reads (has_gate, uid, weight format, ...)
PYTHON_PER_LAYER = 1


def _model(implementation: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            initializer_range=0.2)
    model = selector.from_config(AutoModelForCausalLM, config, experts_implementation=implementation)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def _guard_lines(manager) -> list[str]:  # noqa: ANN001 - torch._dynamo.guards.GuardManagerWrapper
    """One line per guard evaluated on a call (its type, code and source line), from the guard tree's dump."""
    return [line.split("+- ", 1)[1] for line in str(manager).splitlines() if _GUARD.match(line)]


_GUARD = re.compile(r"^[| ]*\+- [A-Z][A-Z_]+:")  # guards (TYPE_MATCH: ...), not managers (GuardManager: ...)


def _decode_guards(implementation: str, layers: int) -> tuple[list[str], torch.nn.Module]:
    """The guards (one line each) of generate()'s compiled decode step, after it ran."""
    torch._dynamo.reset()
    model = _model(implementation, layers)
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    cache = StaticCache(config=model.config, max_cache_len=16)
    config = CompileConfig(backend="eager", fullgraph=True)
    config._compile_all_devices = True  # Transformers' switch for compiling the decode step on the CPU
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                       do_sample=False, compile_config=config, **{name: cache})
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    forward = type(model).forward
    codes = {id(f.__code__): f.__code__ for f in (forward, inspect.unwrap(forward))}
    entries = [e for code in codes.values() for e in _debug_get_cache_entry_list(code)]
    assert len(entries) == 1, f"expected one compiled decode step, found {len(entries)}"
    return _guard_lines(entries[0].guard_manager), model


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["auto", pytest.param("fused", marks=pytest.mark.skipif(
    not INTERPRETER, reason="runs Triton kernels on the CPU (interpreter)"))])
def auto_backend(request) -> Iterator[str]:  # noqa: ANN001
    """ "auto" as it resolves on a CPU, or picking the real triton_fused adapter (registered as a CPU backend)."""
    if request.param == "auto":
        yield "auto"
        return
    register_plugin(types.SimpleNamespace(selector_backends=_fused_cpu_backends), "fused_cpu_guards_plugin")
    reset_selection_caches()
    hf.register_with_transformers()
    try:
        yield "fused_cpu"
    finally:
        unregister_plugin("fused_cpu_guards_plugin")
        reset_selection_caches()
        hf.register_with_transformers()


def test_auto_adds_no_slow_guards_over_batched_mm(auto_backend):
    lines: dict[tuple[str, int], list[str]] = {}
    for implementation in ("auto", "batched_mm"):
        for layers in (1, 3):
            lines[implementation, layers], model = _decode_guards(implementation, layers)
            if implementation == "auto":
                ran = {last_backend(m) for m in model.modules() if last_backend(m) is not None}
                assert ran == {auto_backend} if auto_backend != "auto" else len(ran) == 1
    auto = lines["auto", 3]
    slow = [line for line in auto if line.startswith("NO_HASATTR") and "_modules['experts']" in line]
    assert not slow, "NO_HASATTR guards on experts modules:\n" + "\n".join(slow)
    environ = [line for line in auto if "__import_selector" in line and ".os" in line]
    assert not environ, "selector's traced code reads the environment:\n" + "\n".join(environ)

    def per_layer(implementation: str, kinds: tuple[str, ...] = ()) -> float:
        def count(found: list[str]) -> int:
            return sum(1 for line in found if not kinds or line.startswith(kinds))

        return (count(lines[implementation, 3]) - count(lines[implementation, 1])) / 2

    # Python-evaluated guards per layer: at most the one LAMBDA_GUARD that selector.problem.activation_name
    # adds (type(act_fn) of every layer is that of the first) when the triton_fused adapter calls it
    python = ("LAMBDA_GUARD", "NO_HASATTR")
    assert per_layer("auto", python) <= per_layer("batched_mm", python) + PYTHON_PER_LAYER
    assert per_layer("auto") <= per_layer("batched_mm") + EXTRA_PER_LAYER
    assert len(lines["auto", 1]) - len(lines["batched_mm", 1]) <= FIXED_EXTRA
