"""selector inside Hugging Face Transformers: names, "auto", dicts per sub-config, the decode-phase swap.

Tiny randomly initialised models built from configs (no downloads), fp32 on the CPU. The experts weights
are re-drawn larger than Transformers' init so that the experts (and GPT-OSS's clamped gate) really
shape the logits: a backend that computed the wrong thing would change them.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import pytest
import torch

transformers = pytest.importorskip("transformers")

import selector  # noqa: E402
import selector.hf as hf  # noqa: E402
from selector.dispatch import clear_last_backend, last_backend, reset_selection_caches  # noqa: E402
from selector.hf import decode as hf_decode
from selector.hf import quantized as hf_quantized
from selector.hf import registration as hf_registration
from selector.registry import register_plugin, unregister_plugin  # noqa: E402
from selector.types import Status  # noqa: E402

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

VOCAB = 100
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              initializer_range=0.2)  # larger than the default: logits that the experts visibly move


def _qwen3_vl_moe_config() -> Qwen3VLMoeConfig:
    text = dict(COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                head_dim=8, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                  deepstack_visual_indexes=[0])
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision)


CONFIGS = {
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                        num_experts_per_tok=2, head_dim=8),
    "deepseek_v3": lambda: DeepseekV3Config(**dict(COMMON, num_key_value_heads=4), intermediate_size=64, moe_intermediate_size=32,
                                            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                            first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
                                            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    # bias, transposed, interleaved gate/up and its clamped gate; a low limit so the clamp bites
    "gpt_oss": lambda: GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                    head_dim=8, sliding_window=8, swiglu_limit=0.5),
    "qwen3_vl_moe": _qwen3_vl_moe_config,
}
MOE_SCOPE = {"qwen3_vl_moe": "text_config"}  # where the experts live; "" (the model's own config) otherwise


def _build(kind: str, implementation: object = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    cls = Qwen3VLMoeForConditionalGeneration if kind == "qwen3_vl_moe" else AutoModelForCausalLM
    model = selector.from_config(cls, config, experts_implementation=implementation)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for members in hf.experts_modules(model).values():
            for _, module in members:
                for name, param in module.named_parameters():
                    fan_in = param.shape[-1] if param.dim() == 3 and not module.is_transposed else param.shape[-2]
                    scale = 0.3 if name.endswith("bias") else 2.0 * fan_in**-0.5
                    param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {}


def _model(models: dict[str, torch.nn.Module], kind: str) -> torch.nn.Module:
    if kind not in models:
        models[kind] = _build(kind)
    model = models[kind]
    model.set_experts_implementation("eager")
    return model


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for members in hf.experts_modules(model).values() for _, m in members]


def _prompt(batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(2))


def _runnable_here(model: torch.nn.Module) -> tuple[set[str], dict[str, Status]]:
    entry = hf.selection_report(model).entries[0]
    ranking = selector.explain_module(_experts(model)[0], top_k=entry.problem.top_k)
    return {c.name for c in ranking.candidates}, {n: a.status for n, a in ranking.excluded.items()}


@pytest.fixture(autouse=True)
def _accelerator_default():
    yield
    hf.set_accelerator_check(None)


KINDS = list(CONFIGS)


# ---------------------------------------------------------------------------------------------------------
# Registration and names
# ---------------------------------------------------------------------------------------------------------


def test_registration_is_idempotent_and_keeps_transformers_names():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward, grouped_mm_experts_forward

    first = hf.register_with_transformers()
    second = hf.register_with_transformers()
    assert first == second
    registry = selector.get_registry()
    for backend in registry.names:
        assert first[hf.PREFIX + backend] == backend
        assert hf.PREFIX + backend in ALL_EXPERTS_FUNCTIONS
    assert first["auto"] == "auto"
    # Transformers' own names keep Transformers' functions; "eager" stays the module's own loop
    assert ALL_EXPERTS_FUNCTIONS["grouped_mm"] is grouped_mm_experts_forward
    assert ALL_EXPERTS_FUNCTIONS["batched_mm"] is batched_mm_experts_forward
    assert "eager" not in ALL_EXPERTS_FUNCTIONS
    assert "triton_fused" in first  # no clash: the bare name is ours too
    names = hf.accepted_names()
    assert {"auto", "eager", "grouped_mm", "selector:grouped_mm", "triton_fused"} <= set(names)


def test_missing_experts_interface_names_the_version(monkeypatch):
    from transformers.modeling_utils import PreTrainedModel

    monkeypatch.delattr(PreTrainedModel, "get_experts_implementation")
    with pytest.raises(ImportError, match=r"transformers>=5\.14.*get_experts_implementation"):
        hf.register_with_transformers()
    with pytest.raises(ImportError, match=r"transformers>=5\.14"):
        selector.from_config(AutoModelForCausalLM, CONFIGS["mixtral"]())


# ---------------------------------------------------------------------------------------------------------
# Every backend against eager, for every model
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_backends_match_eager_logits_and_greedy_tokens(models, kind):
    model = _model(models, kind)
    ids = _prompt()
    runnable, excluded = _runnable_here(model)
    assert {"eager", "batched_mm", "grouped_mm"} <= runnable
    scope = MOE_SCOPE.get(kind, "")
    for m in _experts(model):
        clear_last_backend(m)
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert all(last_backend(m) is None for m in _experts(model)), "'eager' is the module's own loop"
    names = ["auto"] + [hf.PREFIX + n for n in sorted(runnable)] + ["grouped_mm", "batched_mm"]
    for name in names:
        for m in _experts(model):
            clear_last_backend(m)
        model.set_experts_implementation(name)
        assert hf.get_experts_implementation(model)[scope] == name
        with torch.no_grad():
            logits = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4, msg=lambda m: f"{kind} {name}: {m}")
        assert torch.equal(tokens, ref_tokens), f"{kind} {name}: greedy tokens differ"
        ran = {last_backend(m) for m in _experts(model)}
        if name.startswith(hf.PREFIX):
            assert ran == {name[len(hf.PREFIX):]}, f"{kind} {name} ran {ran}"
        elif name == "auto":
            assert ran and ran <= runnable, f"auto ran {ran}, runnable here: {runnable}"
        else:  # Transformers' own functions: selector is not involved
            assert ran == {None}
    # what cannot run here: the model loads, the first forward says why
    for name, status in excluded.items():
        model.set_experts_implementation(hf.PREFIX + name)
        with pytest.raises(status.error_type, match=name):
            with torch.no_grad():
                model(ids)
    model.set_experts_implementation("eager")


def test_gpt_oss_custom_gate_is_used(models):
    model = _model(models, "gpt_oss")
    ids = _prompt()
    with torch.no_grad():
        model.set_experts_implementation("selector:grouped_mm")
        clamped = model(ids).logits
        cls = type(_experts(model)[0])
        gate = cls._apply_gate
        try:
            cls._apply_gate = lambda self, x: torch.nn.functional.silu(x[..., ::2]) * x[..., 1::2]
            plain = model(ids).logits
        finally:
            cls._apply_gate = gate
    assert (clamped - plain).abs().max() > 1e-3, "the clamped gate must shape the output"
    problem = hf.selection_report(model).entries[0].problem
    assert problem.interleaved and problem.has_bias and problem.is_transposed
    assert problem.gate.name == "clamped_swiglu" and not problem.custom_gate  # recognised: selector.gates


# ---------------------------------------------------------------------------------------------------------
# "auto": the choice and the report
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen2_moe", "gpt_oss", "qwen3_vl_moe"])
def test_auto_report_per_sub_config(models, kind):
    model = _model(models, kind)
    model.set_experts_implementation("auto")
    report = hf.selection_report(model)
    scope = MOE_SCOPE.get(kind, "")
    assert list(report.scopes) == [scope]
    entry = report[scope]
    runnable, excluded = _runnable_here(model)
    assert entry.requested == "auto" and entry.runs == "selector"
    assert entry.chosen in runnable
    assert set(entry.by_tokens) == set(hf.REPORT_TOKENS) and set(entry.by_tokens.values()) <= runnable
    assert entry.excluded.keys() == excluded.keys()
    assert entry.excluded["triton_fused"].status is Status.UNSUPPORTED_DEVICE  # a CUDA-only backend, here on CPU
    assert entry.problem.num_experts == _experts(model)[0].num_experts and entry.problem.device == "cpu"
    text = str(report)
    assert "auto ->" in text and "not triton_fused" in text
    assert report.to_dict()["entries"][0]["chosen"] == entry.chosen
    model.set_experts_implementation("eager")


def test_auto_logs_its_choice(models, caplog):
    model = _model(models, "mixtral")
    with caplog.at_level(logging.INFO, logger="selector.hf"):
        hf.log_selection(model)
        model.set_experts_implementation("auto")
        hf_registration._LOGGED.clear()
        with torch.no_grad():
            model(_prompt())
    text = caplog.text
    assert "eager" in text  # the load-time line for the current request
    assert "selector auto: MixtralExperts" in text and "12 tokens (bucket 16) ->" in text
    model.set_experts_implementation("eager")


def test_explicit_backend_that_cannot_run_loads_then_raises_at_first_forward(models):
    model = _model(models, "qwen3_moe")
    model.set_experts_implementation("triton_fused")
    entry = hf.selection_report(model)[""]
    assert entry.chosen == "triton_fused" and entry.error and "cuda" in entry.error
    with pytest.raises(ImportError, match="triton_fused.*cuda"):
        with torch.no_grad():
            model(_prompt())
    model.set_experts_implementation("eager")


class _TokenCountPlugin:
    """Two third-party backends whose estimates depend on the token count: auto must switch between them."""

    @staticmethod
    @selector.hookimpl
    def selector_backends():
        from selector.plugins.batched_mm.forward import batched_mm_experts_forward
        from selector.plugins.grouped_mm.forward import grouped_mm_experts_forward

        def cost(small: bool):
            # cheaper than every built-in (their estimates are microseconds or more)
            return lambda problem, env: (1e-12 if (problem.num_tokens or 0) <= 4 else 1.0) if small else 2e-12

        return [
            selector.BackendSpec(name="few_tokens", load=lambda: batched_mm_experts_forward, estimate=cost(True)),
            selector.BackendSpec(name="many_tokens", load=lambda: grouped_mm_experts_forward, estimate=cost(False)),
        ]


@contextmanager
def _token_count_plugin():
    register_plugin(_TokenCountPlugin, "token_count_test_plugin")
    reset_selection_caches()
    try:
        yield
    finally:
        unregister_plugin("token_count_test_plugin")
        reset_selection_caches()
        hf.register_with_transformers()


def _spy(model: torch.nn.Module) -> tuple[list[tuple[int, str | None]], list]:
    """Records (tokens, backend that ran) for every experts forward; None: selector did not run it."""
    calls: list[tuple[int, str | None]] = []

    def pre_hook(module, args):
        clear_last_backend(module)

    def hook(module, args, output):
        calls.append((args[0].shape[0], last_backend(module)))

    handles = [m.register_forward_pre_hook(pre_hook) for m in _experts(model)]
    handles += [m.register_forward_hook(hook) for m in _experts(model)]
    return calls, handles


def test_third_party_backends_registered_and_auto_switches_per_call_in_generate(models):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model = _model(models, "qwen2_moe")
    ids = _prompt(batch=2, length=6)
    with _token_count_plugin():
        names = hf.register_with_transformers()
        assert names["few_tokens"] == "few_tokens" and names["selector:many_tokens"] == "many_tokens"
        model.set_experts_implementation("many_tokens")  # a third-party name, bare
        with torch.no_grad():
            model(ids)
        assert {last_backend(m) for m in _experts(model)} == {"many_tokens"}

        model.set_experts_implementation("auto")
        calls, handles = _spy(model)
        try:
            with torch.no_grad():
                model.generate(ids, max_new_tokens=3, do_sample=False)
        finally:
            for h in handles:
                h.remove()
        layers = len(_experts(model))
        assert calls[:layers] == [(12, "many_tokens")] * layers  # prefill: 2 x 6 tokens
        assert calls[layers:] == [(2, "few_tokens")] * (2 * layers)  # two decode steps of 2 tokens
        assert hf.selection_report(model)[""].by_tokens[1] == "few_tokens"
    # gone with its plugin
    assert "few_tokens" not in ALL_EXPERTS_FUNCTIONS and "selector:many_tokens" not in ALL_EXPERTS_FUNCTIONS
    model.set_experts_implementation("eager")


# ---------------------------------------------------------------------------------------------------------
# Per-backbone dicts
# ---------------------------------------------------------------------------------------------------------


def test_dict_per_sub_config(models):
    model = _model(models, "qwen3_vl_moe")
    hf.set_experts_implementation(model, {"text_config": "selector:grouped_mm", "vision_config": "eager"})
    current = hf.get_experts_implementation(model)
    assert current["text_config"] == "selector:grouped_mm" and current["vision_config"] == "eager"
    with torch.no_grad():
        model(_prompt())
    assert {last_backend(m) for m in _experts(model)} == {"grouped_mm"}
    assert hf.selection_report(model)["text_config"].chosen == "grouped_mm"
    model.set_experts_implementation("eager")


def test_dict_with_unknown_key_or_name_is_a_clear_error(models):
    model = _model(models, "qwen3_vl_moe")
    with pytest.raises(ValueError, match=r"'txt_config'.*match no sub-config.*'text_config'"):
        hf.set_experts_implementation(model, {"txt_config": "auto"})
    with pytest.raises(ValueError, match=r"'textconfig'.*Qwen3VLMoeConfig"):
        selector.from_config(Qwen3VLMoeForConditionalGeneration, _qwen3_vl_moe_config(),
                             experts_implementation={"textconfig": "auto"})
    with pytest.raises(ValueError, match=r"unknown experts implementation 'fastest'.*selector:grouped_mm"):
        hf.set_experts_implementation(model, {"text_config": "fastest"})
    mixtral = _model(models, "mixtral")
    with pytest.raises(ValueError, match="match no sub-config.*none"):
        hf.set_experts_implementation(mixtral, {"text_config": "auto"})


def test_from_config_with_dict(models):
    model = selector.from_config(Qwen3VLMoeForConditionalGeneration, _qwen3_vl_moe_config(),
                                 experts_implementation={"": "auto", "text_config": "selector:batched_mm"})
    assert hf.get_experts_implementation(model)["text_config"] == "selector:batched_mm"
    with torch.no_grad():
        model(_prompt())
    assert {last_backend(m) for m in _experts(model)} == {"batched_mm"}


def test_from_pretrained_local_directory(tmp_path, models):
    source = _model(models, "qwen2_moe")
    source.save_pretrained(tmp_path)
    model = selector.from_pretrained(AutoModelForCausalLM, tmp_path, experts_implementation="auto")
    assert hf.get_experts_implementation(model)[""] == "auto"
    ids = _prompt()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=1e-4, atol=1e-4)
    assert {last_backend(m) for m in _experts(model)} <= _runnable_here(model)[0]
    with pytest.raises(ValueError, match="match no sub-config"):
        selector.from_pretrained(AutoModelForCausalLM, tmp_path, experts_implementation={"vision_config": "auto"})
    with pytest.raises(ValueError, match="unknown experts implementation 'nope'"):
        selector.from_pretrained(AutoModelForCausalLM, tmp_path, experts_implementation="nope")
    # Transformers' own loader accepts our names once selector.hf is imported
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="selector:grouped_mm")
    assert plain.get_experts_implementation()[""] == "selector:grouped_mm"


# ---------------------------------------------------------------------------------------------------------
# Decode-phase swap in generate()
# ---------------------------------------------------------------------------------------------------------


def _generate_observed(model, ids, new_tokens=3, **kw):
    calls, handles = _spy(model)
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **kw)
    finally:
        for h in handles:
            h.remove()
    return out, calls


def _phases(calls, layers):
    prefill = {name for _, name in calls[:layers]}
    decode = [{name for _, name in calls[i : i + layers]} for i in range(layers, len(calls), layers)]
    return prefill, decode


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_vl_moe"])
def test_decode_swap_on_accelerator_and_restore(models, kind):
    model = _model(models, kind)
    scope = MOE_SCOPE.get(kind, "")
    hf.set_accelerator_check(lambda device: True)  # the GPU branch, on this CPU
    request = {scope: "selector:grouped_mm"} if scope else "selector:grouped_mm"
    model.set_experts_implementation(request)
    before = hf.get_experts_implementation(model)
    ids = _prompt(batch=2, length=5)
    out, calls = _generate_observed(model, ids, new_tokens=3)
    layers = len(_experts(model))
    prefill, decode = _phases(calls, layers)
    assert prefill == {"grouped_mm"} and calls[0][0] == 10
    assert decode == [{"batched_mm"}, {"batched_mm"}] and all(t == 2 for t, _ in calls[layers:])
    assert hf.get_experts_implementation(model) == before  # restored
    # same tokens as eager
    model.set_experts_implementation("eager")
    with torch.no_grad():
        assert torch.equal(out, model.generate(ids, max_new_tokens=3, do_sample=False))


def test_decode_swap_restored_when_generate_raises(models):
    model = _model(models, "qwen3_vl_moe")
    hf.set_accelerator_check(lambda device: True)
    model.set_experts_implementation({"text_config": "selector:grouped_mm"})
    before = hf.get_experts_implementation(model)
    seen: list[str] = []

    class Boom(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(hf.get_experts_implementation(model)["text_config"])
            if len(seen) == 2:
                raise RuntimeError("boom in the decode loop")
            return scores

    with pytest.raises(RuntimeError, match="boom"):
        with torch.no_grad():
            model.generate(_prompt(), max_new_tokens=4, do_sample=False,
                           logits_processor=transformers.LogitsProcessorList([Boom()]))
    assert seen == ["selector:batched_mm", "selector:batched_mm"]  # swapped while decoding...
    assert hf.get_experts_implementation(model) == before  # ...and restored after the error


def test_cpu_is_left_alone(models):
    model = _model(models, "qwen3_moe")  # default check: this is a CPU model
    for name in ("selector:grouped_mm", "grouped_mm"):
        model.set_experts_implementation(name)
        _, calls = _generate_observed(model, _prompt())
        expected = "grouped_mm" if name.startswith(hf.PREFIX) else None
        assert {n for _, n in calls} == {expected}
        assert hf.get_experts_implementation(model)[""] == name
    assert hf.decode_request(model)[0] == hf.decode_request(model)[1]
    model.set_experts_implementation("eager")


@pytest.mark.parametrize("name", ["selector:batched_mm", "selector:eager", "auto", "eager", "batched_mm"])
def test_other_backends_untouched_on_accelerator(models, name):
    model = _model(models, "deepseek_v3")
    hf.set_accelerator_check(lambda device: True)
    model.set_experts_implementation(name)
    current, target = hf.decode_request(model)
    assert current == target
    seen = []

    class Watch(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(hf.get_experts_implementation(model)[""])
            return scores

    with torch.no_grad():
        model.generate(_prompt(), max_new_tokens=3, do_sample=False,
                       logits_processor=transformers.LogitsProcessorList([Watch()]))
    assert set(seen) == {name}
    model.set_experts_implementation("eager")


def test_composes_with_transformers_own_decode_swap(models):
    """Ours wraps Transformers' hook: it swaps selector's names first, Transformers then swaps its own."""
    from transformers.generation.utils import GenerationMixin

    hook = GenerationMixin._optimize_model_for_decode
    assert getattr(hook, "_selector_wraps", None) is not None, "the hook must wrap Transformers' own"
    model = _model(models, "qwen3_vl_moe")
    hf.set_accelerator_check(lambda device: True)
    # a model whose sub-configs mix selector's grouped_mm and Transformers' grouped_mm
    model.set_experts_implementation({"": "grouped_mm", "text_config": "selector:grouped_mm"})
    before = hf.get_experts_implementation(model)
    seen_by_transformers = []

    @contextmanager
    def transformers_hook(m):  # stands in for Transformers' own (which only swaps on a real non-CPU device)
        seen_by_transformers.append(dict(m.get_experts_implementation()))
        current = m.get_experts_implementation()
        m.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in current.items()})
        try:
            yield
        finally:
            m.set_experts_implementation(current)

    with hf_decode._composed_decode(model, transformers_hook):
        inside = hf.get_experts_implementation(model)
    assert seen_by_transformers[0]["text_config"] == "selector:batched_mm"  # ours already swapped
    assert seen_by_transformers[0][""] == "grouped_mm"  # Transformers' own name left to Transformers
    assert inside["text_config"] == "selector:batched_mm" and inside[""] == "batched_mm"
    assert hf.get_experts_implementation(model) == before
    model.set_experts_implementation("eager")


# ---------------------------------------------------------------------------------------------------------
# Quantised experts (Transformers' FP8Experts): "auto" must not break them, and must see the format
# ---------------------------------------------------------------------------------------------------------


def _fp8_model(monkeypatch):
    """A tiny Qwen2-MoE whose experts are Transformers' FP8Experts; Transformers' FP8 functions are spied on
    (their kernels need a GPU) and return zeros."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers.integrations.moe import use_experts_implementation

    calls: list[tuple[str, int]] = []

    def spy(name):
        def forward(module, hidden_states, top_k_index, top_k_weights):
            calls.append((name, hidden_states.shape[0]))
            return torch.zeros_like(hidden_states)

        return forward

    for name in ("grouped_mm", "batched_mm"):
        monkeypatch.setitem(fp8.FP8ExpertsInterface._global_mapping, name, spy(name))
    model = _build("qwen2_moe", implementation="auto")
    cls = use_experts_implementation(fp8.FP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    gen = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        layer.mlp.experts = cls(model.config, block_size=(32, 32))
        with torch.no_grad():
            for param in layer.mlp.experts.parameters():
                if param.dtype.is_floating_point and param.element_size() == 1:  # fp8 weights
                    param.copy_((torch.randn(param.shape, generator=gen) * 0.5).to(param.dtype))
                else:  # scales
                    param.fill_(0.05)
    hf.register_with_transformers()
    return model, calls


@contextmanager
def _deny_all_backends(tmp_path, monkeypatch):
    """A config that keeps "auto" away from every selector backend (so it must fall back)."""
    path = tmp_path / "selector.yaml"
    path.write_text("deny: [" + ", ".join(selector.get_registry().names) + "]\n")
    monkeypatch.setenv("SELECTOR_CONFIG", str(path))
    reset_selection_caches()
    hf_quantized._QUANT_PLANS.clear()
    try:
        yield
    finally:
        monkeypatch.delenv("SELECTOR_CONFIG")
        reset_selection_caches()
        hf_quantized._QUANT_PLANS.clear()


def test_quantized_auto_falls_back_to_transformers_fp8_with_its_decode_rule(monkeypatch, tmp_path):
    model, calls = _fp8_model(monkeypatch)
    with _deny_all_backends(tmp_path, monkeypatch):
        _check_fp8_fallback(model, calls)


def _check_fp8_fallback(model, calls):
    layers = len(_experts(model))
    ids = _prompt(batch=2, length=5)
    report = hf.selection_report(model)[""]
    assert report.problem.weight_format == "fp8_block" and report.runs == "transformers"
    assert report.chosen == "transformers:grouped_mm"
    assert set(report.excluded) == set(selector.get_registry().names)  # each with its reason
    assert "Transformers' own FP8 function" in str(hf.selection_report(model))

    with torch.no_grad():  # CPU: grouped_mm throughout, as Transformers does
        model.generate(ids, max_new_tokens=3, do_sample=False)
    assert calls == [("grouped_mm", 10)] * layers + [("grouped_mm", 2)] * (2 * layers)
    calls.clear()
    hf.set_accelerator_check(lambda device: True)  # GPU rule: batched_mm for the decode steps
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
    assert calls == [("grouped_mm", 10)] * layers + [("batched_mm", 2)] * (2 * layers)
    assert {last_backend(m) for m in _experts(model)} == {"transformers:batched_mm"}



@pytest.mark.slow
def test_quantized_explicit_name_runs_or_fails_loudly(monkeypatch):
    model, calls = _fp8_model(monkeypatch)
    model.set_experts_implementation("selector:grouped_mm")
    hf.selection_report(model)  # marks the FP8Experts modules with their format, as the first forward does
    ranking = selector.explain_module(_experts(model)[0])
    assert ranking.problem.weight_format == "fp8_block"
    if "grouped_mm" in ranking.excluded:  # explicit: fails loudly, naming why
        why = ranking.excluded["grouped_mm"]
        with pytest.raises(why.status.error_type, match="grouped_mm"):
            with torch.no_grad():
                model(_prompt())
    else:  # selector's grouped_mm reads this format here
        with torch.no_grad():
            model(_prompt())
        assert calls == [] and {last_backend(m) for m in _experts(model)} == {"grouped_mm"}


class _Fp8Plugin:
    @staticmethod
    @selector.hookimpl
    def selector_backends():
        def forward(module, hidden_states, top_k_index, top_k_weights):
            return torch.zeros_like(hidden_states)

        dtypes = frozenset({"bfloat16", "float16", "float32", "float8_e4m3fn"})
        return [selector.BackendSpec(name="fake_fp8", load=lambda: forward, estimate=lambda p, e: 1e-12,
                                     requirements=selector.Requirements(weight_formats=frozenset({"fp8_block"}),
                                                                        dtypes=dtypes, custom_gate=True))]


def test_quantized_auto_takes_a_selector_backend_for_the_format(monkeypatch):
    model, calls = _fp8_model(monkeypatch)
    register_plugin(_Fp8Plugin, "fp8_test_plugin")
    reset_selection_caches()
    hf_quantized._QUANT_PLANS.clear()
    try:
        assert hf.selection_report(model)[""].chosen == "fake_fp8"
        with torch.no_grad():
            model(_prompt())
        assert calls == [] and {last_backend(m) for m in _experts(model)} == {"fake_fp8"}
    finally:
        unregister_plugin("fp8_test_plugin")
        reset_selection_caches()
        hf_quantized._QUANT_PLANS.clear()
        hf.register_with_transformers()


# ---------------------------------------------------------------------------------------------------------
# torch.compile: the Transformers path through selector traces as one graph
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.compile
@pytest.mark.parametrize("name", ["selector:grouped_mm", "selector:batched_mm"])
def test_selector_names_trace_fullgraph(models, name):
    model = _model(models, "qwen3_moe")
    model.set_experts_implementation(name)
    ids = _prompt()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            ref = model(ids).logits
            compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
            torch.testing.assert_close(compiled(ids).logits, ref, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()
        model.set_experts_implementation("eager")


def test_core_set_experts_implementation_reaches_transformers_models():
    model = _build("qwen3_moe")
    selector.set_experts_implementation(model, "selector:grouped_mm")  # the core call, not selector.hf's
    assert set(selector.hf.get_experts_implementation(model).values()) == {"selector:grouped_mm"}
    with pytest.raises(ValueError):
        selector.set_experts_implementation(model, {"vision_config": "eager"})  # no such sub-config


@pytest.mark.compile
@pytest.mark.parametrize("warm", [True, False], ids=["after-an-eager-call", "cold"])
def test_quantized_auto_compiles_as_one_graph(monkeypatch: pytest.MonkeyPatch, warm: bool) -> None:
    """FP8 experts with "auto" under torch.compile(fullgraph=True): one graph after an eager call (the decode flag
    is read outside the traced code); without one, the clear "call the model once" error, not a KeyError."""
    model, _ = _fp8_model(monkeypatch)
    register_plugin(_Fp8Plugin, "fp8_test_plugin")
    reset_selection_caches()
    hf_quantized._QUANT_PLANS.clear()
    torch._dynamo.reset()
    try:
        ids = _prompt()
        with torch.no_grad():
            if warm:
                eager = model(ids).logits
                compiled = torch.compile(model.forward, backend="eager", fullgraph=True)(ids).logits
                torch.testing.assert_close(compiled, eager)
            else:
                with pytest.raises(Exception, match="call the model once before compiling"):
                    torch.compile(model.forward, backend="eager", fullgraph=True)(ids)
    finally:
        unregister_plugin("fp8_test_plugin")
        reset_selection_caches()
        hf_quantized._QUANT_PLANS.clear()
        hf.register_with_transformers()
        torch._dynamo.reset()


def test_core_get_and_explain_answer_for_transformers_models(caplog):
    model = _build("qwen3_vl_moe", "auto")
    assert selector.get_experts_implementation(model) == {"": "auto", "vision_config": "auto", "text_config": "auto"}
    selector.set_experts_implementation(model, "selector:batched_mm")
    assert set(selector.get_experts_implementation(model).values()) == {"selector:batched_mm"}
    paths = [p for members in hf.experts_modules(model).values() for p, _ in members]
    with caplog.at_level("WARNING", logger="selector"):
        explained = selector.explain_model(model, num_tokens=4)
    assert sorted(explained) == sorted(paths) and paths
    assert all(r.problem.top_k == 2 and r.best for r in explained.values())  # k from the config, not 1
    assert "guess" not in caplog.text


def test_transformers_request_of_the_wrong_type_is_a_type_error():
    model = _build("qwen3_moe")
    with pytest.raises(TypeError, match=r"got int 3"):
        selector.set_experts_implementation(model, 3)
    with pytest.raises(TypeError, match=r"experts_implementation is a name.*got NoneType None; accepted names: .*eag"):
        hf.validate_request(model.config, None)
