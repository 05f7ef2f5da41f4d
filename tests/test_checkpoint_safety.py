"""Checkpoints with missing, misshapen or mistyped tensors, bad weight scales, another hidden size than the model's,
or an unreadable config.json or index raise, naming the tensor and its file; never a dense or silent load."""

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


# Weight scales that are not finite and positive, wrong-shape weights, a bad config.json or index, and a hidden size
# other than the model's: each refused at load, the message naming the tensor's checkpoint key and its file.

SCALE = f"{P}.1.up_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("value", "shown"), [(float("nan"), "nan"), (float("inf"), "inf"), (0.0, "0.0"), (-0.5, "-0.5")]
)
def test_a_weight_scale_that_is_not_finite_and_positive_is_named_with_its_file(
    tmp_path: Path, value: float, shown: str
) -> None:
    t = fp8_tensors()
    t[SCALE] = t[SCALE].clone()
    t[SCALE][1, 0] = value
    source = write(tmp_path, t, FP8_CONFIG)
    with pytest.raises(ValueError) as info:
        load(source)
    assert str(info.value).startswith(
        f"{SCALE} (in {source / 'model.safetensors'}) has 1 of 4 scale value(s) that are not finite and positive, "
        f"the first {shown} at index [1, 0]"
    )


def test_a_nan_ue8m0_scale_is_named_with_its_file(tmp_path: Path) -> None:
    t = fp8_tensors("ue8m0")
    raw = t[SCALE].view(torch.uint8).clone()
    raw[0, 1] = 0xFF  # the one e8m0 byte that is no power of two: NaN
    t[SCALE] = raw.view(t[SCALE].dtype)
    source = write(tmp_path, t)
    with pytest.raises(ValueError) as info:
        load(source)
    msg = str(info.value)
    assert msg.startswith(f"{SCALE} (in {source / 'model.safetensors'}) has 1 of 4 scale value(s)")
    assert "the first NaN (byte 0xff) at index [0, 1]" in msg


def test_a_bad_fused_scale_is_named_with_its_file(tmp_path: Path) -> None:
    t = fused_tensors()
    name = f"{P}.down_proj_scale_inv"
    t[name] = t[name].clone()
    t[name][2, 1, 0] = -1.0
    source = write(tmp_path, t, FP8_CONFIG)
    with pytest.raises(ValueError) as info:
        load(source)
    msg = str(info.value)
    assert msg.startswith(f"{name} (in {source / 'model.safetensors'}) has 1 of 12 scale value(s)")
    assert "the first -1.0 at index [2, 1, 0]" in msg


def write_sharded(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    """Experts 0 in one shard, the others in a second, with the index Transformers writes; returns the shards."""
    first = {k: v for k, v in tensors.items() if k.startswith(f"{P}.0.")}
    rest = {k: v for k, v in tensors.items() if k not in first}
    shards = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    save_file(first, str(shards[0]))
    save_file(rest, str(shards[1]))
    weight_map = {k: (shards[0] if k in first else shards[1]).name for k in tensors}
    (tmp_path / C.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return shards


def test_a_bad_scale_in_a_sharded_checkpoint_names_its_own_shard(tmp_path: Path) -> None:
    t = fp8_tensors()
    t[SCALE] = torch.full_like(t[SCALE], float("nan"))
    _, second = write_sharded(tmp_path, t)
    with pytest.raises(ValueError) as info:
        load(tmp_path)
    assert str(info.value).startswith(f"{SCALE} (in {second}) has 4 of 4 scale value(s)")


def test_an_intact_sharded_checkpoint_loads(tmp_path: Path) -> None:
    t = fp8_tensors()
    write_sharded(tmp_path, t)
    module = load(tmp_path)
    assert torch.equal(module.down_proj_scale_inv[2], t[f"{P}.2.down_proj.weight_scale_inv"])


def test_a_weight_of_the_wrong_intermediate_size_is_named_with_its_file(tmp_path: Path) -> None:
    t = fp8_tensors()
    name = f"{P}.2.down_proj.weight"
    t[name] = t[name][:, :32].contiguous()
    t[f"{P}.2.down_proj.weight_scale_inv"] = t[f"{P}.2.down_proj.weight_scale_inv"][:, :1].contiguous()  # fits it
    source = write(tmp_path, t, FP8_CONFIG)
    with pytest.raises(ValueError) as info:
        load(source)
    assert str(info.value) == (
        f"{name} has shape [64, 32] (in {source / 'model.safetensors'}): expected [64, 64] "
        "(hidden size 64, intermediate size 64 as most weights say)"
    )


def test_a_weight_of_the_wrong_rank_is_named_with_its_file(tmp_path: Path) -> None:
    t = fp8_tensors()
    name = f"{P}.1.gate_proj.weight"
    t[name] = t[name][None].contiguous()
    source = write(tmp_path, t, FP8_CONFIG)
    with pytest.raises(ValueError) as info:
        load(source)
    file = source / "model.safetensors"
    assert str(info.value).startswith(f"{name} has shape [1, 64, 64] (in {file}): expected a 2-D")


def test_a_fused_weight_of_the_wrong_shape_is_named_with_its_file(tmp_path: Path) -> None:
    t = fused_tensors()
    name = f"{P}.down_proj"
    t[name] = t[name][:, :, :32].contiguous()
    source = write(tmp_path, t, FP8_CONFIG)
    with pytest.raises(ValueError) as info:
        load(source)
    file = source / "model.safetensors"
    assert str(info.value).startswith(f"{name} has shape [3, 64, 32] (in {file}): expected [3, 64, 64]")


def test_a_dense_weight_of_the_wrong_shape_is_named_with_its_file(tmp_path: Path) -> None:
    t = dense_tensors()
    name = f"{P}.0.up_proj.weight"
    t[name] = t[name][:48].contiguous()
    source = write(tmp_path, t)
    with pytest.raises(ValueError) as info:
        load(source)
    file = source / "model.safetensors"
    assert str(info.value).startswith(f"{name} has shape [48, 64] (in {file}): expected [64, 64]")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "cannot read {file}: Expecting property name"),
        ("[1, 2]", "{file} holds a JSON list, expected an object"),
        ('{"quantization_config": "fp8"}', "{file}: quantization_config must be a JSON object or null, found 'fp8'"),
        ('{"quantization_config": {"quant_method": "fp8", "weight_block_size": "32"}}',
         "{file}: quantization_config.weight_block_size must be two positive integers, found '32'"),
        ('{"quantization_config": {"quant_method": 8}}', "{file}: quantization_config.quant_method must be a string"),
        ('{"quantization_config": {"quant_method": "fp8", "dequantize": "yes"}}',
         "{file}: quantization_config.dequantize must be true or false, found 'yes'"),
        ('{"quantization_config": {"quant_method": "fp8", "scale_fmt": "e5m2"}}', "{file}: scale_fmt must be"),
    ],
    ids=["not-json", "a-list", "config-a-string", "block-a-string", "method-a-number", "dequantize-a-string",
         "unknown-scale-format"],
)  # fmt: skip
def test_a_bad_config_json_is_named(tmp_path: Path, text: str, message: str) -> None:
    write(tmp_path, fp8_tensors())
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError) as info:
        load(tmp_path)
    assert str(info.value).startswith(message.format(file=tmp_path / "config.json"))


def test_an_index_without_a_weight_map_is_named(tmp_path: Path) -> None:
    write(tmp_path, fp8_tensors(), FP8_CONFIG)
    (tmp_path / C.INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError) as info:
        load(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / C.INDEX_FILE}: 'weight_map' must be an object")


def test_an_index_listing_a_missing_shard_names_both(tmp_path: Path) -> None:
    write(tmp_path, fp8_tensors(), FP8_CONFIG)
    (tmp_path / C.INDEX_FILE).write_text(json.dumps({"weight_map": {f"{P}.0.up_proj.weight": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError) as info:
        load(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'gone.safetensors'}, listed in {tmp_path / C.INDEX_FILE}")


def test_a_file_that_is_not_safetensors_is_named(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError) as info:
        load(tmp_path)
    assert str(info.value).startswith(f"cannot read {tmp_path / 'model.safetensors'} as safetensors")


def hidden_mismatch(name: str, shape: list[int], file: Path, checkpoint: int, model: int) -> str:
    return (f"hidden size mismatch: {name} {shape} (in {file}) has hidden size {checkpoint}, "
            f"the model's experts {model}")  # fmt: skip


@pytest.mark.parametrize("model_hidden", [32, 128])
def test_a_checkpoint_of_another_hidden_size_is_refused_naming_both(tmp_path: Path, model_hidden: int) -> None:
    source = write(tmp_path, fp8_tensors(), FP8_CONFIG)
    with pytest.raises(ValueError) as info:
        C.load_experts(make_experts(E, model_hidden, I), source, P)
    want = hidden_mismatch(f"{P}.0.down_proj.weight", [H, I], source / "model.safetensors", H, model_hidden)
    assert str(info.value).startswith(want)


def test_a_fused_checkpoint_of_another_hidden_size_is_refused_naming_both(tmp_path: Path) -> None:
    source = write(tmp_path, fused_tensors(), FP8_CONFIG)
    with pytest.raises(ValueError) as info:
        C.load_experts(make_experts(E, 2 * H, I), source, P)
    want = hidden_mismatch(f"{P}.gate_up_proj", [E, 2 * I, H], source / "model.safetensors", H, 2 * H)
    assert str(info.value).startswith(want)


def test_an_fp4_checkpoint_of_another_hidden_size_is_refused_naming_both(tmp_path: Path) -> None:
    source = write(tmp_path, C.experts_state_dict(Q.quantize_experts(make_experts(E, H, I, seed=3), "fp4"), P))
    with pytest.raises(ValueError) as info:
        C.load_experts(make_experts(E, 2 * H, I), source, P)
    want = hidden_mismatch(f"{P}.0.down_proj.weight", [H, I // 2], source / "model.safetensors", H, 2 * H)
    assert str(info.value).startswith(want)


def test_a_dense_checkpoint_of_another_hidden_size_is_refused_naming_both(tmp_path: Path) -> None:
    source = write(tmp_path, dense_tensors())
    with pytest.raises(ValueError) as info:
        C.load_experts(make_experts(E, 2 * H, I), source, P)
    want = hidden_mismatch(f"{P}.0.down_proj.weight", [H, I], source / "model.safetensors", H, 2 * H)
    assert str(info.value).startswith(want)


def test_one_expert_of_another_hidden_size_is_named(tmp_path: Path) -> None:
    t = fp8_tensors()
    name = f"{P}.2.gate_proj.weight"
    t[name] = torch.cat([t[name], t[name]], dim=1)  # [I, 2H]
    t[f"{P}.2.gate_proj.weight_scale_inv"] = torch.ones(2, 4)
    source = write(tmp_path, t, FP8_CONFIG)
    with pytest.raises(ValueError) as info:
        load(source)
    assert str(info.value).startswith(hidden_mismatch(name, [I, 2 * H], source / "model.safetensors", 2 * H, H))
