"""Quantised checkpoints with missing, misshapen or mistyped tensors raise, naming the tensor; never a dense load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from experts_fixtures import make_experts
from safetensors.torch import save_file

from selector import checkpoints as C
from selector import quant as Q

P = "mlp.experts"
E, H, I = 3, 64, 64  # block 32: fp8 scales [2, 2] per projection


def fp8_tensors(scale_format: str = "float32") -> dict[str, torch.Tensor]:
    module = Q.quantize_experts(make_experts(E, H, I, seed=3), "fp8_block", scale_format, (32, 32))
    return C.experts_state_dict(module, P)


def write(tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "float"}}


def load(source: Path, **kw) -> torch.nn.Module:
    return C.load_experts(make_experts(E, H, I, seed=9), source, P, **kw)


def drop(tensors: dict[str, torch.Tensor], *names: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k not in names}


def all_scales(tensors: dict[str, torch.Tensor], expert: int | None = None) -> list[str]:
    return [k for k in tensors if k.endswith("weight_scale_inv") and (expert is None or k.startswith(f"{P}.{expert}."))]


def test_intact_fp8_checkpoint_still_loads(tmp_path: Path) -> None:
    module = load(write(tmp_path, fp8_tensors(), FP8_CONFIG))
    assert Q.quant_format(module).weight_format == "fp8_block"


@pytest.mark.parametrize("with_config", [True, False], ids=["config", "no-config"])
def test_all_scales_missing_raises(tmp_path: Path, with_config: bool) -> None:
    t = fp8_tensors()
    source = write(tmp_path, drop(t, *all_scales(t)), FP8_CONFIG if with_config else None)
    with pytest.raises(ValueError) as info:
        load(source)
    msg = str(info.value)
    assert msg.startswith(f"checkpoint has no {P}.0.down_proj.weight_scale_inv (also looked for ")
    assert f"for the quantised {P}.0.down_proj.weight" in msg
    if with_config:
        assert "expected float32 [2, 2]" in msg
    else:
        assert "expected float32" in msg and "its weights are quantised" not in msg


def test_expert_zero_scales_missing_raise_with_the_shape(tmp_path: Path) -> None:
    t = fp8_tensors()
    source = write(tmp_path, drop(t, *all_scales(t, expert=0)))  # no config: the block is read off expert 1
    with pytest.raises(ValueError, match=rf"checkpoint has no {P}\.0\.down_proj\.weight_scale_inv .*expected float32 \[2, 2\]"):
        load(source)


def test_one_scale_missing_is_named(tmp_path: Path) -> None:
    t = fp8_tensors()
    source = write(tmp_path, drop(t, f"{P}.2.up_proj.weight_scale_inv"), FP8_CONFIG)
    with pytest.raises(ValueError, match=rf"checkpoint has no {P}\.2\.up_proj\.weight_scale_inv .*expected float32 \[2, 2\]"):
        load(source)


@pytest.mark.parametrize("with_config", [True, False], ids=["config", "no-config"])
def test_misshapen_scale_is_named_with_the_expected_shape(tmp_path: Path, with_config: bool) -> None:
    t = fp8_tensors()
    t[f"{P}.1.gate_proj.weight_scale_inv"] = torch.ones(2, 3)
    source = write(tmp_path, t, FP8_CONFIG if with_config else None)
    with pytest.raises(ValueError) as info:
        load(source)
    msg = str(info.value)
    assert msg.startswith(f"{P}.1.gate_proj.weight_scale_inv has shape [2, 3]: expected float32 [2, 2] for {P}.1.gate_proj.weight [64, 64]")
    assert ("read off the config" if with_config else f"read off {P}.0.down_proj.weight_scale_inv") in msg


def test_first_scale_fitting_no_block_is_named(tmp_path: Path) -> None:
    t = fp8_tensors()
    t[f"{P}.0.down_proj.weight_scale_inv"] = torch.ones(3, 2)
    with pytest.raises(ValueError, match=rf"{P}\.0\.down_proj\.weight_scale_inv has shape \[3, 2\], which fits no block size"):
        load(write(tmp_path, t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int32])
def test_mistyped_scale_is_named_with_the_expected_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    t = fp8_tensors()
    t[f"{P}.2.down_proj.weight_scale_inv"] = t[f"{P}.2.down_proj.weight_scale_inv"].to(dtype)
    with pytest.raises(ValueError, match=rf"{P}\.2\.down_proj\.weight_scale_inv is {dtype}: expected float32 \[2, 2\]"):
        load(write(tmp_path, t, FP8_CONFIG))


def test_ue8m0_scales_under_a_float_config_are_refused(tmp_path: Path) -> None:
    t = fp8_tensors("ue8m0")
    with pytest.raises(ValueError, match=rf"{P}\.0\.down_proj\.weight_scale_inv is torch\.float8_e8m0fnu: expected float32"):
        load(write(tmp_path, t, FP8_CONFIG))


def test_one_dense_expert_in_an_fp8_checkpoint_is_named(tmp_path: Path) -> None:
    t = fp8_tensors()
    t[f"{P}.1.up_proj.weight"] = t[f"{P}.1.up_proj.weight"].to(torch.bfloat16)
    with pytest.raises(ValueError, match=rf"{P}\.1\.up_proj\.weight is torch\.bfloat16, but the checkpoint is fp8 "
                                         r"\(its weights are quantised\): expected float8_e4m3fn"):  # fmt: skip
        load(write(tmp_path, t))


def dense_tensors() -> dict[str, torch.Tensor]:
    return C.experts_state_dict(make_experts(E, H, I, seed=4), P)


def test_fp8_config_over_dense_tensors_raises(tmp_path: Path) -> None:
    source = write(tmp_path, dense_tensors(), FP8_CONFIG)
    with pytest.raises(ValueError) as info:
        load(source)
    msg = str(info.value)
    assert msg.startswith(f"{P}.0.down_proj.weight is torch.float32, but the checkpoint is fp8 "
                          "(config.json's quantization_config says so): expected float8_e4m3fn")  # fmt: skip
    assert "fix: remove quantization_config from config.json" in msg


def test_explicit_fp8_config_over_a_dense_file_raises(tmp_path: Path) -> None:
    write(tmp_path, dense_tensors())
    with pytest.raises(ValueError, match="but the checkpoint is fp8 .*quantization_config says so"):
        load(tmp_path / "model.safetensors", quantization_config={"quant_method": "fp8"})


@pytest.mark.parametrize("config", [None, {}, {"quantization_config": None}], ids=["none", "empty", "null"])
def test_dense_checkpoint_without_a_quantisation_config_loads(tmp_path: Path, config: dict | None) -> None:
    src = make_experts(E, H, I, seed=4)
    module = load(write(tmp_path, C.experts_state_dict(src, P), config))
    assert Q.quant_format(module) is None
    assert torch.equal(module.gate_up_proj, src.gate_up_proj) and torch.equal(module.down_proj, src.down_proj)


def test_fp4_missing_scale_names_the_ue8m0_shape(tmp_path: Path) -> None:
    module = Q.quantize_experts(make_experts(E, H, I, seed=3), "fp4")
    t = C.experts_state_dict(module, P)
    source = write(tmp_path, drop(t, f"{P}.0.gate_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=rf"no {P}\.0\.gate_proj\.weight_scale_inv .*expected float8_e8m0fnu or uint8 \[64, 2\]"):
        load(source)


def fused_tensors() -> dict[str, torch.Tensor]:
    module = Q.quantize_experts(make_experts(E, H, I, seed=3), "fp8_block", "float32", (32, 32))
    names = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")
    return {f"{P}.{n}": getattr(module, n).detach().cpu() for n in names}


def test_fused_naming_missing_scale_is_named(tmp_path: Path) -> None:
    source = write(tmp_path, drop(fused_tensors(), f"{P}.down_proj_scale_inv"), FP8_CONFIG)
    with pytest.raises(ValueError, match=rf"checkpoint has no {P}\.down_proj_scale_inv for the quantised "
                                         rf"{P}\.down_proj .*expected float32 \[3, 2, 2\]"):  # fmt: skip
        load(source)


def test_fused_naming_misshapen_scale_is_named(tmp_path: Path) -> None:
    t = fused_tensors()
    t[f"{P}.gate_up_proj_scale_inv"] = torch.ones(3, 2, 2)
    with pytest.raises(ValueError, match=rf"{P}\.gate_up_proj_scale_inv has shape \[3, 2, 2\]: expected float32 \[3, 4, 2\]"):
        load(write(tmp_path, t, FP8_CONFIG))


def test_dequantize_key_alone_does_not_declare_fp8(tmp_path: Path) -> None:
    """{"dequantize": True} over a dense file is no FP8 claim: the dense experts load as they are."""
    src = make_experts(E, H, I, seed=4)
    write(tmp_path, C.experts_state_dict(src, P))
    module = load(tmp_path / "model.safetensors", quantization_config={"dequantize": True})
    assert Q.quant_format(module) is None and torch.equal(module.down_proj, src.down_proj)


def test_fused_naming_without_down_proj_is_named(tmp_path: Path) -> None:
    source = write(tmp_path, drop(fused_tensors(), f"{P}.down_proj", f"{P}.down_proj_scale_inv"))
    with pytest.raises(KeyError, match=rf"checkpoint has {P}\.gate_up_proj but no {P}\.down_proj"):
        load(source)


def static_fp8_tensors() -> dict[str, torch.Tensor]:
    module = make_experts(E, H, I, seed=3)
    x = torch.randn(16, H)
    idx = torch.randint(0, E, (16, 2))
    scales = Q.calibrate_activation_scales(module, x, idx)
    Q.quantize_experts(module, "fp8_block", "float32", (32, 32), activation_quant="static", activation_scales=scales)
    return C.experts_state_dict(module, P)


def test_intact_static_checkpoint_loads_its_activation_scales(tmp_path: Path) -> None:
    t = static_fp8_tensors()
    assert f"{P}.1.down_proj.activation_scale" in t
    module = load(write(tmp_path, t))
    assert Q.quant_format(module).activation_quant == "static"


def test_one_expert_without_its_activation_scale_is_named(tmp_path: Path) -> None:
    t = static_fp8_tensors()
    source = write(tmp_path, drop(t, f"{P}.2.down_proj.activation_scale"))
    with pytest.raises(ValueError, match=rf"{P}\.2\.down_proj: no activation_scale tensor, but expert 0 has one"):
        load(source)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.ones(2), r"expected 1 activation scale value\(s\), found shape \(2,\)"),
        (torch.ones((), dtype=torch.int32), "activation scales must be floating point, found torch.int32"),
        (torch.tensor(float("nan")), "activation scales must be finite and positive"),
        (torch.tensor(-0.5), r"activation scales must be finite and positive, found \[-0.5\]"),
        (torch.tensor(0.0), "activation scales must be finite and positive"),
    ],
)
def test_a_misshapen_mistyped_or_bad_activation_scale_is_named(tmp_path: Path, bad: torch.Tensor, message: str) -> None:
    t = static_fp8_tensors()
    t[f"{P}.1.up_proj.activation_scale"] = bad
    with pytest.raises(ValueError, match=rf"{P}\.1\.up_proj\.activation_scale: {message}"):
        load(write(tmp_path, t))


def static_fused_tensors() -> dict[str, torch.Tensor]:
    """Transformers' fused naming of a static-activation FP8 module: one [E] activation scale per projection."""
    module = make_experts(E, H, I, seed=3)
    scales = Q.calibrate_activation_scales(module, torch.randn(16, H), torch.randint(0, E, (16, 2)))
    Q.quantize_experts(module, "fp8_block", "float32", (32, 32), activation_quant="static", activation_scales=scales)
    names = ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv",
             "gate_up_proj_activation_scale", "down_proj_activation_scale")  # fmt: skip
    return {f"{P}.{n}": getattr(module, n).detach().cpu().clone() for n in names}


STATIC_CONFIG = {"quantization_config": {**FP8_CONFIG["quantization_config"], "activation_scheme": "static"}}


@pytest.mark.parametrize("config", [STATIC_CONFIG, None], ids=["static_config", "no_config"])
def test_fused_naming_static_checkpoint_loads_its_activation_scales(tmp_path: Path, config: dict | None) -> None:
    t = static_fused_tensors()
    module = load(write(tmp_path, t, config))
    assert Q.quant_format(module).activation_quant == "static"
    for name in ("gate_up_proj_activation_scale", "down_proj_activation_scale"):
        assert torch.equal(getattr(module, name).float().cpu().reshape(E), t[f"{P}.{name}"].float().reshape(E))


@pytest.mark.parametrize("kept", ["gate_up_proj_activation_scale", "down_proj_activation_scale"])
def test_fused_naming_with_one_projection_s_activation_scales_is_refused(tmp_path: Path, kept: str) -> None:
    other = "down_proj_activation_scale" if kept.startswith("gate") else "gate_up_proj_activation_scale"
    source = write(tmp_path, drop(static_fused_tensors(), f"{P}.{other}"), STATIC_CONFIG)
    with pytest.raises(ValueError, match=rf"{P}: static activation scales for only one of gate_up_proj and down_proj"):
        load(source)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (torch.ones(E + 1), rf"expected {E} activation scale value\(s\), found shape \({E + 1},\)"),
        (torch.ones(E, dtype=torch.int32), "activation scales must be floating point, found torch.int32"),
        (torch.tensor([1.0, float("nan"), 1.0]), "activation scales must be finite and positive"),
        (torch.tensor([1.0, float("inf"), 1.0]), "activation scales must be finite and positive"),
        (torch.tensor([0.5, -0.5, 1.0]), r"activation scales must be finite and positive, found \[0.5, -0.5, 1.0\]"),
        (torch.zeros(E), "activation scales must be finite and positive"),
    ],
)
@pytest.mark.parametrize("name", ["gate_up_proj_activation_scale", "down_proj_activation_scale"])
def test_fused_naming_bad_activation_scale_is_named(tmp_path: Path, name: str, bad: torch.Tensor, message: str) -> None:
    t = static_fused_tensors()
    t[f"{P}.{name}"] = bad
    with pytest.raises(ValueError, match=rf"{P}\.{name}: {message}"):
        load(write(tmp_path, t, STATIC_CONFIG))
