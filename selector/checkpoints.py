"""Load pre-quantised experts from safetensors checkpoints (DeepSeek naming) into experts modules; save them.

DeepSeek-V3 naming, one tensor per expert and projection (``prefix`` is the experts module's path, e.g.
``model.layers.3.mlp.experts``)::

    {prefix}.{e}.gate_proj.weight            float8_e4m3fn [I, H]     (fp4: int8 [I, H/2])
    {prefix}.{e}.gate_proj.weight_scale_inv  float32 [ceil(I/128), ceil(H/128)]  (ue8m0: float8_e8m0fnu or uint8;
                                             fp4: [I, ceil(H/32)]); also read as `.scale` or `.qscale_weight`
    {prefix}.{e}.up_proj.weight / .weight_scale_inv      (same shapes)
    {prefix}.{e}.down_proj.weight / .weight_scale_inv    [H, I] ...
    {prefix}.{e}.{gate,up,down}_proj.activation_scale    float32 scalar, only with static activation quantisation

The fused naming Transformers uses for experts modules (``{prefix}.gate_up_proj``, ``{prefix}.gate_up_proj_scale_inv``,
``{prefix}.down_proj``, ...) is read too. Non-gated experts have no ``gate_proj``.

The format comes from the checkpoint's quantisation config (``config.json``'s ``quantization_config``:
``weight_block_size``, ``scale_fmt``, ``expert_dtype``, ``activation_scheme``, ``dequantize``), read through
Transformers' ``FineGrainedFP8Config`` where Transformers is installed (which validates it) and as a plain
dict otherwise; what the config leaves out is read off the tensors (dtypes, scale grid). ``dequantize=True``
(or the config's own ``dequantize``) turns the experts into dense ones in the compute dtype, as
``FineGrainedFP8Config(dequantize=True)`` does in Transformers: the bf16 backends then run them.

Loading checks every tensor once, before anything is put on the module; each error names the tensor's checkpoint
key and its file: a weight or scale missing or of the wrong dtype or shape, a hidden size other than the model's,
a weight scale that is NaN, infinite, zero or negative (one reduction per scale tensor, never per forward), and a
config.json or index that cannot be read or holds values of the wrong type.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from selector import layers
from selector import quant as Q

SCALE_SUFFIXES = ("weight_scale_inv", "scale", "qscale_weight")
ACTIVATION_SCALE_SUFFIXES = ("activation_scale", "input_scale")
INDEX_FILE = "model.safetensors.index.json"


# ----------------------------------------------------------------------------------------------------------------
# Quantisation config.
# ----------------------------------------------------------------------------------------------------------------


def _transformers_config_class() -> Any:
    try:
        from transformers import FineGrainedFP8Config
    except Exception:  # Transformers missing or broken: read the dict ourselves
        return None
    return FineGrainedFP8Config


def read_quantization_config(config: Any) -> dict[str, Any]:
    """Normalise a quantisation config to {weight_format, scale_format, block_size, activation_quant, dequantize}.

    `config`: None, a dict (a config.json's ``quantization_config``, or the whole config.json), a Transformers
    ``FineGrainedFP8Config``, or a path to a checkpoint directory / config.json. Keys it does not give are None.
    """
    if config is None:
        return {
            "weight_format": None,
            "scale_format": None,
            "block_size": None,
            "activation_quant": None,
            "dequantize": False,
        }
    if isinstance(config, (str, os.PathLike)):
        path = _config_file(config)
        data = _read_json_object(path) if path.exists() else {}
        try:
            return _normalise_quantization_config(data)
        except (ValueError, TypeError) as exc:  # the file's values: name the file
            raise ValueError(f"{path}: {exc}") from exc
    return _normalise_quantization_config(config)


def _config_file(config: str | os.PathLike) -> Path:
    path = Path(config)
    return path / "config.json" if path.is_dir() else path


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or a ValueError naming the file (unreadable, not JSON, not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def _check_config_types(config: Mapping[str, Any]) -> None:
    """Types the config checks of Transformers do not make (a string block size passes their length test)."""
    block = config.get("weight_block_size")
    if block is not None and not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"quantization_config.weight_block_size must be two positive integers, found {block!r}")
    for key in ("quant_method", "fmt", "scale_fmt", "activation_scheme", "expert_dtype"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ValueError(f"quantization_config.{key} must be a string, found {config[key]!r}")
    if config.get("dequantize") is not None and not isinstance(config["dequantize"], bool):
        raise ValueError(f"quantization_config.dequantize must be true or false, found {config['dequantize']!r}")


def _normalise_quantization_config(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping) and "quantization_config" in config:
        config = config["quantization_config"]
        if config is None:  # a dense model's config.json
            return read_quantization_config(None)
        if not isinstance(config, Mapping):
            raise ValueError(f"quantization_config must be a JSON object or null, found {config!r}")
    expert_dtype = None
    if isinstance(config, Mapping):
        _check_config_types(config)
        method = str(config.get("quant_method", "fp8")).lower()
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method is {method!r}: only fine-grained 'fp8' checkpoints load here")
        plain = _PlainConfig(config)  # DeepSeek-V4's expert_dtype, which Transformers' config may not keep
        expert_dtype = plain.expert_dtype
        cls = _transformers_config_class()
        if cls is not None:
            config = cls(**{k: v for k, v in config.items() if k != "quant_method"})  # validates, like from_pretrained
        else:
            config = plain
    expert_dtype = expert_dtype or getattr(config, "expert_dtype", "fp8") or "fp8"
    scale_fmt = getattr(config, "scale_fmt", None)
    block = getattr(config, "weight_block_size", None)
    return {
        "weight_format": "fp4" if expert_dtype == "fp4" else "fp8_block",
        "scale_format": None if scale_fmt is None else ("ue8m0" if scale_fmt == "ue8m0" else "float32"),
        "block_size": None if block is None or expert_dtype == "fp4" else tuple(int(b) for b in block),
        "activation_quant": getattr(config, "activation_scheme", None),
        "dequantize": bool(getattr(config, "dequantize", False)),
    }


_QUANT_KEYS = ("quant_method", "weight_block_size", "scale_fmt", "activation_scheme", "expert_dtype", "fmt")


def _declares_quantisation(config: Any) -> bool:
    """Whether `config` (as `read_quantization_config` takes it) says the checkpoint is quantised.

    A config.json without ``quantization_config`` (what `save_experts` writes for dense experts) says dense; a
    bare dict says quantised when it holds any quantisation key; a FineGrainedFP8Config object always does.
    """
    if config is None:
        return False
    if isinstance(config, (str, os.PathLike)):
        path = _config_file(config)
        return path.exists() and _read_json_object(path).get("quantization_config") is not None
    if isinstance(config, Mapping):
        if "quantization_config" in config:
            return config["quantization_config"] is not None
        return any(k in config for k in _QUANT_KEYS)
    return True


class _PlainConfig:
    """The same checks FineGrainedFP8Config.post_init makes, for when Transformers is not installed."""

    def __init__(self, d: Mapping[str, Any]) -> None:
        self.activation_scheme = str(d.get("activation_scheme") or "dynamic").lower()  # null: the default
        self.weight_block_size = d.get("weight_block_size", (128, 128))
        self.dequantize = bool(d.get("dequantize", False))
        self.scale_fmt = d.get("scale_fmt") or "float"
        self.expert_dtype = d.get("expert_dtype") or "fp8"
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"Activation scheme {self.activation_scheme} not supported")
        if self.weight_block_size is not None and (len(self.weight_block_size) != 2 or min(self.weight_block_size) <= 0):
            raise ValueError("weight_block_size must be a tuple of two positive integers")
        if self.scale_fmt not in ("float", "ue8m0"):
            raise ValueError(f"scale_fmt must be 'float' or 'ue8m0'; got {self.scale_fmt!r}")
        if self.expert_dtype not in ("fp8", "fp4"):
            raise ValueError(f"expert_dtype must be 'fp8' or 'fp4'; got {self.expert_dtype!r}")


def quantization_config_dict(fmt: Q.QuantFormat) -> dict[str, Any]:
    """The config.json ``quantization_config`` for a format (what Transformers and DeepSeek write)."""
    out: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": fmt.activation_quant,
        "scale_fmt": "ue8m0" if fmt.scale_format == "ue8m0" else "float",
        "weight_block_size": [128, 128] if fmt.weight_format == "fp4" else list(fmt.block_size),
    }
    if fmt.weight_format == "fp4":
        out["expert_dtype"] = "fp4"
    return out


# ----------------------------------------------------------------------------------------------------------------
# Reading safetensors.
# ----------------------------------------------------------------------------------------------------------------


class _Checkpoint:
    """Lazy access to the tensors of one or more safetensors files."""

    def __init__(self, source: str | os.PathLike | Iterable[str | os.PathLike]) -> None:
        from safetensors import safe_open

        files = self._files(source)
        if not files:
            raise FileNotFoundError(f"no .safetensors files at {source}")
        self._where: dict[str, tuple[Any, Path]] = {}  # key -> (open file, its path)
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except FileNotFoundError:
                raise
            except Exception as exc:  # safetensors' own error type: a header it cannot parse
                raise ValueError(f"cannot read {file} as safetensors: {exc}") from exc
            for key in handle.keys():
                self._where[key] = (handle, file)
        self.files = files

    @staticmethod
    def _files(source: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            if path.is_dir():
                index = path / INDEX_FILE
                if index.exists():
                    return _indexed_files(index)
                return sorted(path.glob("*.safetensors"))
            return [path]
        return [Path(p) for p in source]

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        return self._where[key][0].get_tensor(key)

    def file_of(self, key: str) -> Path:
        """The file that holds `key` (what an error about the tensor names)."""
        return self._where[key][1]

    def first(self, base: str, suffixes: Iterable[str]) -> torch.Tensor | None:
        for suffix in suffixes:
            if f"{base}.{suffix}" in self:
                return self.get(f"{base}.{suffix}")
        return None


def _indexed_files(index: Path) -> list[Path]:
    """The files an index's ``weight_map`` lists, each checked to exist; errors name the index."""
    weight_map = _read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        found = repr(weight_map)[:80]
        raise ValueError(f"{index}: 'weight_map' must be an object of tensor name -> file name, found {found}")
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.exists():
            raise FileNotFoundError(f"{file}, listed in {index}, does not exist")
    return files


def _as_weight(t: torch.Tensor) -> torch.Tensor:
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is not None and t.dtype == fp4:
        return t.view(torch.int8)
    if t.dtype == torch.uint8:
        return t.view(torch.int8)
    return t


def _as_scale(t: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    if ue8m0 and t.dtype == torch.uint8 and Q.ue8m0_dtype() != torch.uint8:
        return t.view(Q.ue8m0_dtype())
    return t


def _infer_block(rows: int, cols: int, scale: torch.Tensor) -> tuple[int, int]:
    """The block size that turns [rows, cols] into the scale grid's shape (128 preferred)."""
    sr, sc = scale.shape[-2:]
    picks = []
    for total, count in ((rows, sr), (cols, sc)):
        found = [b for b in (128, 64, 32, 256, 16, 512, 1) if -(-total // b) == count]
        if not found:
            raise ValueError(f"cannot infer the block size: {total} channels with {count} scale blocks")
        picks.append(found[0])
    return picks[0], picks[1]


_UE8M0_DTYPES = tuple(dict.fromkeys((Q.ue8m0_dtype(), torch.uint8)))
_FP4_WEIGHT_DTYPES = tuple(
    d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None
)


def _is_quantised_weight(t: torch.Tensor) -> bool:
    return t.dtype == Q.FP8_DTYPE or t.dtype in _FP4_WEIGHT_DTYPES


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


class _Expect:
    """What every weight and scale tensor of one quantised experts module must be, and the checks."""

    def __init__(
        self,
        prefix: str,
        qc: Mapping[str, Any],
        declared: bool,
        first_weight: torch.Tensor,
        first_scale: torch.Tensor | None,
        where: str,
    ) -> None:
        self.prefix, self.where = prefix, where
        self.why = "config.json's quantization_config says so" if declared else "its weights are quantised"
        fp4 = first_weight.dtype in _FP4_WEIGHT_DTYPES
        self.fp4 = qc["weight_format"] == "fp4" if declared and qc["weight_format"] else fp4
        if self.fp4:
            self.weight_dtypes: tuple[torch.dtype, ...] = _FP4_WEIGHT_DTYPES
            self.scale_dtypes: tuple[torch.dtype, ...] = _UE8M0_DTYPES
        else:
            self.weight_dtypes = (Q.FP8_DTYPE,)
            fmt = qc["scale_format"]
            if fmt is None and first_scale is not None:
                fmt = "ue8m0" if Q.is_ue8m0_tensor(first_scale) else "float32"
            self.scale_dtypes = _UE8M0_DTYPES if fmt == "ue8m0" else (torch.float32,)
        self.block: tuple[int, int] | None = (1, Q.FP4_GROUP) if self.fp4 else qc["block_size"]
        self.block_from = "the config" if self.block is not None else ""

    @property
    def pack(self) -> int:
        """Weights per stored element along the input dim (fp4 packs two in a byte)."""
        return 2 if self.fp4 else 1

    def weight(self, name: str, t: torch.Tensor, file: Path) -> None:
        if t.dtype not in self.weight_dtypes:
            kind = "fp4" if self.fp4 else "fp8"
            fix = "store every expert's weights in one format"
            if "config" in self.why:
                fix = (
                    "remove quantization_config from config.json if the checkpoint is dense, or load the quantised "
                    "checkpoint"
                )
            raise ValueError(
                f"{name} is {t.dtype}, but the checkpoint is {kind} ({self.why}): expected "
                f"{_names(self.weight_dtypes)} (in {file}); fix: {fix}"
            )

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        if self.fp4:
            return rows, -(-(cols * 2) // Q.FP4_GROUP)
        assert self.block is not None
        return -(-rows // self.block[0]), -(-cols // self.block[1])

    def scale(
        self, weight_name: str, w: torch.Tensor, s: torch.Tensor | None, scale_names: Iterable[str], file: Path | None
    ) -> None:
        """`s` (found under scale_names[0], in `file`) fits `w` in dtype and shape, and holds only usable values."""
        names = list(scale_names)
        if s is not None and s.dim() >= 2 and self.block is None:  # no config block: read it off the first scale
            try:
                self.block = _infer_block(w.shape[-2], w.shape[-1], s)
            except ValueError as exc:
                raise ValueError(
                    f"{names[0]} has shape {list(s.shape)}, which fits no block size for {weight_name} "
                    f"{list(w.shape)}: {exc} (in {file})"
                ) from None
            self.block_from = names[0]
        shape = None if self.block is None else [*w.shape[:-2], *self.scale_shape(w.shape[-2], w.shape[-1])]
        want = f"{_names(self.scale_dtypes)}" + ("" if shape is None else f" {shape}")
        if s is None:
            also = f" (also looked for {', '.join(names[1:])})" if len(names) > 1 else ""
            raise ValueError(
                f"checkpoint has no {names[0]}{also} for the quantised {weight_name} ({self.where}): expected "
                f"{want}; fix: load the checkpoint with all its scale tensors (loading the weights without them "
                "would be wrong by their scales)"
            )
        if s.dtype not in self.scale_dtypes:
            raise ValueError(f"{names[0]} is {s.dtype}: expected {want} for {weight_name} (in {file})")
        if list(s.shape) != shape:
            block = "" if self.fp4 else f", block {self.block} read off {self.block_from}"
            raise ValueError(
                f"{names[0]} has shape {list(s.shape)}: expected {want} for {weight_name} "
                f"{list(w.shape)}{block} (in {file})"
            )
        _check_scale_values(names[0], s, file)


def _check_scale_values(name: str, s: torch.Tensor, file: Path | None) -> None:
    """Every weight scale finite and positive, or a ValueError naming the tensor and its file.

    A NaN scale makes the layer's output NaN; an inf, zero or negative one gives weights off by that factor with
    a finite output, so nothing later would notice. One pass over the tensor, at load only: never per forward.
    """
    if s.dtype in _UE8M0_DTYPES:  # a power of two per byte, every one positive; 0xFF is NaN
        bad = s.view(torch.uint8) == 0xFF
    else:
        bad = ~((s > 0) & (s < math.inf))  # NaN compares false
    if not bool(bad.any()):
        return
    first = tuple(bad.nonzero()[0].tolist())
    value = "NaN (byte 0xff)" if s.dtype in _UE8M0_DTYPES else f"{s[first].item()}"
    raise ValueError(
        f"{name} (in {file}) has {int(bad.sum())} of {s.numel()} scale value(s) that are not finite and positive, "
        f"the first {value} at index {list(first)}: the weights it scales would be NaN or wrong by that factor; fix: "
        "re-export or repair the checkpoint"
    )


def _scale_names(base: str, ckpt: "_Checkpoint") -> list[str]:
    found = [f"{base}.{s}" for s in SCALE_SUFFIXES if f"{base}.{s}" in ckpt]
    return found[:1] + [f"{base}.{s}" for s in SCALE_SUFFIXES if f"{base}.{s}" not in found[:1]]


def _most_common(values: Iterable[int]) -> int:
    return Counter(values).most_common(1)[0][0]


def _check_weight_shapes(
    ckpt: "_Checkpoint",
    weights: list[tuple[str, torch.Tensor, bool]],
    hidden: int | None,
    pack: int,
    fused: bool,
) -> None:
    """Every weight of one experts module fits the model's hidden size and the checkpoint's intermediate size; a
    ValueError names the first that does not, with its file.

    `weights`: (checkpoint key, tensor, is_down): per expert [out, in], fused [E, out, in]; down_proj [.., H, I / pack],
    the others [.., I, H / pack], a fused gate_up_proj [E, 2 I, H / pack] (`pack`: 2 for fp4, two values a byte).
    `hidden` is the model's H (None: read off the checkpoint); I is what most weights say, so the odd one is named.
    """
    ndim = 3 if fused else 2
    up_rows = 2 if fused and weights[0][0].endswith("gate_up_proj") else 1
    for name, w, _ in weights:
        if w.dim() != ndim:
            raise ValueError(
                f"{name} has shape {list(w.shape)} (in {ckpt.file_of(name)}): expected a {ndim}-D weight "
                f"[{'E, ' if ndim == 3 else ''}out, in]"
            )

    def hidden_of(w: torch.Tensor, down: bool) -> int:
        return w.shape[-2] if down else w.shape[-1] * pack

    def inter_of(w: torch.Tensor, down: bool) -> int:
        return w.shape[-1] * pack if down else w.shape[-2] // up_rows

    h = hidden if hidden is not None else _most_common(hidden_of(w, down) for _, w, down in weights)
    inter = _most_common(inter_of(w, down) for _, w, down in weights)
    for name, w, down in weights:
        want = [*w.shape[:-2], *((h, inter // pack) if down else (up_rows * inter, h // pack))]
        if list(w.shape) == want:
            continue
        if hidden is not None and hidden_of(w, down) != hidden:
            raise ValueError(
                f"hidden size mismatch: {name} {list(w.shape)} (in {ckpt.file_of(name)}) has hidden size "
                f"{hidden_of(w, down)}, the model's experts {hidden}; fix: load the checkpoint made for this model "
                "(or build the model from that checkpoint's config)"
            )
        raise ValueError(
            f"{name} has shape {list(w.shape)} (in {ckpt.file_of(name)}): expected {want} (hidden size {h}, "
            f"intermediate size {inter}{'' if fused else ' as most weights say'})"
        )


def _check_per_expert(
    ckpt: "_Checkpoint",
    prefix: str,
    projections: Mapping[str, tuple[list, list]],
    qc: Mapping[str, Any],
    declared: bool,
    hidden: int | None = None,
) -> bool:
    """True when the per-expert tensors are quantised (and then every one is checked); raises on any gap."""
    everything = [(proj, e, w, s) for proj, (ws, ss) in projections.items() for e, (w, s) in enumerate(zip(ws, ss))]
    quantised = declared or any(s is not None or _is_quantised_weight(w) for _, _, w, s in everything)
    expect = None
    if quantised:
        first = next((s for _, _, _, s in everything if s is not None), None)
        where = f"looked in {', '.join(map(str, ckpt.files))}"
        expect = _Expect(prefix, qc, declared, everything[0][2], first, where)
        for proj, e, w, _ in everything:
            name = f"{prefix}.{e}.{proj}.weight"
            expect.weight(name, w, ckpt.file_of(name))
    weights = [(f"{prefix}.{e}.{proj}.weight", w, proj == "down_proj") for proj, e, w, _ in everything]
    _check_weight_shapes(ckpt, weights, hidden, expect.pack if expect else 1, fused=False)
    if expect is None:
        return False
    checks = expect

    def check_scale(proj: str, e: int, w: torch.Tensor, s: torch.Tensor | None) -> None:
        base = f"{prefix}.{e}.{proj}"
        names = _scale_names(base, ckpt)
        checks.scale(f"{base}.weight", w, s, names, ckpt.file_of(names[0]) if s is not None else None)

    # the first scale present sets the block (when the config gives none), so a missing one is told its shape
    for proj, e, w, s in everything:
        if s is not None:
            check_scale(proj, e, w, s)
            break
    for proj, e, w, s in everything:
        check_scale(proj, e, w, s)
    return True


def _check_fused(
    ckpt: "_Checkpoint",
    prefix: str,
    tensors: Mapping[str, Any],
    fused_up: str,
    qc: Mapping[str, Any],
    declared: bool,
    hidden: int | None = None,
) -> bool:
    pairs = [
        (fused_up, tensors["up"], tensors["up_scale"]),
        (f"{prefix}.down_proj", tensors["down"], tensors["down_scale"]),
    ]
    quantised = declared or any(s is not None or _is_quantised_weight(w) for _, w, s in pairs)
    expect = None
    if quantised:
        first = next((s for _, _, s in pairs if s is not None), None)
        expect = _Expect(prefix, qc, declared, pairs[0][1], first, f"looked in {', '.join(map(str, ckpt.files))}")
        for name, w, _ in pairs:
            expect.weight(name, w, ckpt.file_of(name))
    weights = [(name, w, name.endswith(".down_proj")) for name, w, _ in pairs]
    _check_weight_shapes(ckpt, weights, hidden, expect.pack if expect else 1, fused=True)
    if expect is None:
        return False
    for name, w, s in pairs:
        scale_name = f"{name}_scale_inv"
        expect.scale(name, w, s, [scale_name], ckpt.file_of(scale_name) if s is not None else None)
    return True


def _stack_projection(ckpt: _Checkpoint, prefix: str, proj: str, num_experts: int) -> tuple[list, list, list]:
    weights, scales, act = [], [], []
    for e in range(num_experts):
        base = f"{prefix}.{e}.{proj}"
        if f"{base}.weight" not in ckpt:
            raise KeyError(f"checkpoint has no {base}.weight (looked in {', '.join(map(str, ckpt.files))})")
        weights.append(ckpt.get(f"{base}.weight"))  # raw dtype: the checks name what is stored
        scales.append(ckpt.first(base, SCALE_SUFFIXES))
        act.append(ckpt.first(base, ACTIVATION_SCALE_SUFFIXES))
    return weights, scales, act


def _stack_activation_scales(prefix: str, proj: str, scales: list[torch.Tensor | None]) -> torch.Tensor | None:
    """[E] float32 static activation scales of one projection, None when no expert has one. Refuses a set with some
    experts missing, a tensor that is not one value, not floating point, not finite or not positive: each names
    the tensor, as a wrong activation scale quantises every activation of that expert wrongly."""
    present = [e for e, t in enumerate(scales) if t is not None]
    if not present:
        return None
    if len(present) != len(scales):
        missing = next(e for e, t in enumerate(scales) if t is None)
        raise ValueError(
            f"{prefix}.{missing}.{proj}: no activation_scale tensor, but expert {present[0]} has one "
            "(static activation quantisation needs one per expert and projection)"
        )
    for e, t in enumerate(scales):
        _check_activation_scale(f"{prefix}.{e}.{proj}.activation_scale", t, 1)  # type: ignore[arg-type]
    return torch.stack([t.reshape(()).float() for t in scales])  # type: ignore[union-attr]


def _check_activation_scale(name: str, t: torch.Tensor, count: int) -> None:
    """`t` holds `count` finite positive floating-point values, or a ValueError naming `name`."""
    if t.numel() != count:
        raise ValueError(f"{name}: expected {count} activation scale value(s), found shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name}: activation scales must be floating point, found {t.dtype}")
    values = t.float()
    if not torch.isfinite(values).all() or not (values > 0).all():
        raise ValueError(f"{name}: activation scales must be finite and positive, found {values.flatten()[:4].tolist()}")


def _up_down_from_checkpoint(
    ckpt: _Checkpoint,
    prefix: str,
    num_experts: int,
    gated: bool,
    interleaved: bool,
    qc: Mapping[str, Any] | None = None,
    declared: bool = False,
    hidden: int | None = None,
) -> dict:
    """{up, up_scale, down, down_scale, act1, act2} stacked over experts; scales None for dense checkpoints.

    A weight of the wrong shape or hidden size (`hidden`: the model's), and in a quantised checkpoint (by its
    config or its tensors) a weight or scale tensor missing, of the wrong dtype or shape, or a scale that is not
    finite and positive, raise a ValueError naming the tensor and its file: loading it would run with wrong weights.
    """
    qc = qc if qc is not None else read_quantization_config(None)
    fused_up = f"{prefix}.gate_up_proj" if gated else f"{prefix}.up_proj"
    if fused_up in ckpt:  # Transformers' fused experts naming
        def opt(key):  # noqa: ANN001, ANN202
            return ckpt.get(key) if key in ckpt else None

        if f"{prefix}.down_proj" not in ckpt:
            files = ", ".join(map(str, ckpt.files))
            raise KeyError(f"checkpoint has {fused_up} but no {prefix}.down_proj (looked in {files})")
        fused = {
            "up": ckpt.get(fused_up),
            "up_scale": opt(f"{fused_up}_scale_inv"),
            "down": ckpt.get(f"{prefix}.down_proj"),
            "down_scale": opt(f"{prefix}.down_proj_scale_inv"),
            "act1": opt(f"{prefix}.gate_up_proj_activation_scale"),
            "act2": opt(f"{prefix}.down_proj_activation_scale"),
        }
        for name, key in ((fused_up, "up"), (f"{prefix}.down_proj", "down")):
            if fused[key].dim() == 3 and fused[key].shape[0] != num_experts:
                raise ValueError(
                    f"checkpoint has {fused[key].shape[0]} experts, the module {num_experts}: {name} "
                    f"{list(fused[key].shape)} (in {ckpt.file_of(name)})"
                )
        if not _check_fused(ckpt, prefix, fused, fused_up, qc, declared, hidden):
            fused["up_scale"] = fused["down_scale"] = None
        for key, name in (("act1", "gate_up_proj"), ("act2", "down_proj")):
            if (fused["act1"] is None) != (fused["act2"] is None):
                raise ValueError(f"{prefix}: static activation scales for only one of gate_up_proj and down_proj")
            if fused[key] is not None:
                _check_activation_scale(f"{prefix}.{name}_activation_scale", fused[key], num_experts)
                fused[key] = fused[key].reshape(num_experts).float()
        fused["up"], fused["down"] = _as_weight(fused["up"]), _as_weight(fused["down"])
        return fused
    dw, ds, da = _stack_projection(ckpt, prefix, "down_proj", num_experts)
    uw, us, ua = _stack_projection(ckpt, prefix, "up_proj", num_experts)
    projections = {"down_proj": (dw, ds), "up_proj": (uw, us)}
    if gated:
        gw, gs, ga = _stack_projection(ckpt, prefix, "gate_proj", num_experts)
        projections["gate_proj"] = (gw, gs)
    quantised = _check_per_expert(ckpt, prefix, projections, qc, declared, hidden)
    dw, uw = [_as_weight(w) for w in dw], [_as_weight(w) for w in uw]
    if gated:
        gw = [_as_weight(w) for w in gw]
        if interleaved:
            up = torch.stack([torch.stack([g, u], dim=1).reshape(-1, g.shape[-1]) for g, u in zip(gw, uw)])
            up_scale = None
            if quantised:
                if gs[0].shape[0] != gw[0].shape[0]:
                    raise ValueError(
                        f"{_scale_names(f'{prefix}.0.gate_proj', ckpt)[0]} {list(gs[0].shape)}: interleaved gate/up "
                        "experts need one scale row per weight row (fp4, or fp8 with block n = 1) to interleave "
                        "DeepSeek-style gate_proj/up_proj scales"
                    )
                up_scale = torch.stack([torch.stack([a, b], dim=1).reshape(-1, a.shape[-1]) for a, b in zip(gs, us)])
        else:
            up = torch.stack([torch.cat([g, u]) for g, u in zip(gw, uw)])
            up_scale = torch.stack([torch.cat([a, b]) for a, b in zip(gs, us)]) if quantised else None
        # gate and up read the same activations: one scale serves both (the gate's, where the checkpoint has it)
        gate_act, up_act = _stack_activation_scales(prefix, "gate_proj", ga), _stack_activation_scales(prefix, "up_proj", ua)
        act1 = gate_act if gate_act is not None else up_act
    else:
        up = torch.stack(uw)
        up_scale = torch.stack(us) if quantised else None
        act1 = _stack_activation_scales(prefix, "up_proj", ua)
    acts = act1, _stack_activation_scales(prefix, "down_proj", da)
    if (acts[0] is None) != (acts[1] is None):
        raise ValueError(f"{prefix}: static activation scales for only one of the up and down projections")
    return {
        "up": up,
        "up_scale": up_scale,
        "down": torch.stack(dw),
        "down_scale": torch.stack(ds) if quantised else None,
        "act1": acts[0],
        "act2": acts[1],
    }


# ----------------------------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------------------------


def _module_dense_dtype(module: torch.nn.Module) -> torch.dtype:
    compute = getattr(module, "selector_compute_dtype", None)
    if compute is not None:
        return compute
    w = getattr(module, "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj")
    return w.dtype if w.is_floating_point() and w.element_size() > 1 else torch.bfloat16


@torch.no_grad()
def load_experts(
    module: torch.nn.Module,
    source: str | os.PathLike | Iterable[str | os.PathLike],
    prefix: str,
    *,
    quantization_config: Any = None,
    dequantize: bool | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.nn.Module:
    """Load one experts module's weights from safetensors (DeepSeek or Transformers naming), in place.

    `quantization_config` as in `read_quantization_config`; when None and `source` is a directory, its
    config.json is read. `dequantize` (default: the config's) turns the experts into dense `dtype` experts
    (default: the module's current dtype, bf16 for a module built on the meta device or already quantised).
    """
    if quantization_config is None and isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        quantization_config = source
    qc = read_quantization_config(quantization_config)
    declared = _declares_quantisation(quantization_config)
    if not declared:  # a directory without a quantization_config: its tensors say the format, not FP8's defaults
        qc = {**read_quantization_config(None), "dequantize": qc["dequantize"]}
    dequantize = qc["dequantize"] if dequantize is None else dequantize
    compute = dtype or _module_dense_dtype(module)
    gated = bool(getattr(module, "has_gate", True))
    interleaved = gated and not getattr(module, "is_concatenated", True)
    up_name = "gate_up_proj" if gated else "up_proj"
    old = getattr(module, up_name)
    device = torch.device(device) if device is not None else (old.device if old.device.type != "meta" else torch.device("cpu"))
    num_experts = int(getattr(module, "num_experts", old.shape[0]))

    ckpt = _Checkpoint(source)
    hidden = layers.dims(module)[1]
    t = _up_down_from_checkpoint(ckpt, prefix, num_experts, gated, interleaved, qc, declared, hidden)
    up, down = t["up"], t["down"]
    if up.shape[0] != num_experts or down.shape[0] != num_experts:
        raise ValueError(f"{prefix}: checkpoint has {up.shape[0]} experts, the module {num_experts}")

    if t["up_scale"] is None:  # a dense checkpoint
        if getattr(module, "is_transposed", False):
            up, down = up.transpose(1, 2), down.transpose(1, 2)
        _replace_dense(module, up_name, up.to(device=device, dtype=compute), down.to(device=device, dtype=compute))
        return module

    fp4 = up.dtype == torch.int8
    weight_format = qc["weight_format"] if qc["weight_format"] is not None else ("fp4" if fp4 else "fp8_block")
    if (weight_format == "fp4") != fp4:
        raise ValueError(f"{prefix}: the config says {weight_format} experts but the checkpoint holds {up.dtype} weights")
    ue8m0 = Q.is_ue8m0_tensor(t["up_scale"])
    scale_format = qc["scale_format"] or ("ue8m0" if ue8m0 else "float32")
    if scale_format == "ue8m0" and not ue8m0:
        raise ValueError(f"{prefix}: the config says ue8m0 scales but the checkpoint holds {t['up_scale'].dtype} scales")
    block = qc["block_size"]
    if block is None and not fp4:
        block = _infer_block(down.shape[1], down.shape[2], t["down_scale"])
    activation_quant = qc["activation_quant"] or ("static" if t["act1"] is not None else "dynamic")
    fmt = Q.make_format(weight_format, scale_format, block, activation_quant)
    if activation_quant == "static" and (t["act1"] is None or t["act2"] is None):
        raise ValueError(f"{prefix}: static activation quantisation but the checkpoint has no activation_scale tensors")

    scales = (_as_scale(t["up_scale"], ue8m0).to(device), _as_scale(t["down_scale"], ue8m0).to(device))
    acts = (t["act1"].to(device), t["act2"].to(device)) if activation_quant == "static" else None
    Q.set_quantized(module, fmt, up.to(device), scales[0], down.to(device), scales[1], compute, acts)
    if dequantize:
        Q.dequantize_experts(module, compute)  # dense [E, out, in] (is_transposed False)
    return module


def _replace_dense(module: torch.nn.Module, up_name: str, up: torch.Tensor, down: torch.Tensor) -> None:
    for name, value in ((up_name, up), ("down_proj", down)):
        if name in module._parameters:
            del module._parameters[name]
        elif hasattr(module, name):
            delattr(module, name)
        module.register_parameter(name, torch.nn.Parameter(value.contiguous()))
    Q.forget_caches(module)


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every experts module: selector-decorated, or Transformers-style (gate_up_proj/down_proj)."""
    out = []
    for path, m in model.named_modules():
        if getattr(type(m), "_selector_experts", False) or (
            hasattr(m, "down_proj")
            and (hasattr(m, "gate_up_proj") or hasattr(m, "up_proj"))
            and isinstance(getattr(m, "down_proj"), torch.Tensor)
        ):
            out.append((path, m))
    return out


def load_model_experts(
    model: torch.nn.Module,
    source: str | os.PathLike | Iterable[str | os.PathLike],
    *,
    quantization_config: Any = None,
    dequantize: bool | None = None,
    dtype: torch.dtype | None = None,
    key_prefix: str = "",
) -> list[str]:
    """Load every experts module of `model` (checkpoint keys `key_prefix + module path`); returns the paths."""
    loaded = []
    for path, module in experts_modules(model):
        load_experts(
            module,
            source,
            key_prefix + path,
            quantization_config=quantization_config,
            dequantize=dequantize,
            dtype=dtype,
        )
        loaded.append(path)
    return loaded


def experts_state_dict(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The module's experts as DeepSeek-named tensors (per expert, gate/up/down), quantised or dense."""
    fmt = Q.quant_format(module)
    gated = bool(getattr(module, "has_gate", True))
    interleaved = gated and not getattr(module, "is_concatenated", True)
    up_name = "gate_up_proj" if gated else "up_proj"
    up, down = getattr(module, up_name).detach(), module.down_proj.detach()
    up_s = down_s = None
    if fmt is None and getattr(module, "is_transposed", False):
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    if fmt is not None:
        up_s, down_s = getattr(module, f"{up_name}_scale_inv").detach(), module.down_proj_scale_inv.detach()
    out: dict[str, torch.Tensor] = {}

    def put(e: int, proj: str, w: torch.Tensor, s: torch.Tensor | None, act: torch.Tensor | None) -> None:
        base = f"{prefix}.{e}.{proj}"
        out[f"{base}.weight"] = w.contiguous().cpu()
        if s is not None:
            out[f"{base}.weight_scale_inv"] = s.contiguous().cpu()
        if act is not None:
            out[f"{base}.activation_scale"] = act.reshape(()).float().cpu().clone()  # gate and up: own storage

    static = fmt is not None and fmt.activation_quant == "static"
    a1 = module.gate_up_proj_activation_scale.detach() if static else None
    a2 = module.down_proj_activation_scale.detach() if static else None
    inter = down.shape[2] * (2 if fmt is not None and fmt.weight_format == "fp4" else 1)
    for e in range(up.shape[0]):
        act1 = None if a1 is None else a1[e]
        if gated:
            if interleaved:
                if fmt is not None and up_s.shape[1] != up.shape[1]:
                    raise ValueError(
                        "interleaved gate/up fp8 experts with block n > 1 cannot be split into DeepSeek's "
                        "gate_proj/up_proj (a scale block spans gate and up rows)"
                    )
                gate_w, up_w = up[e, 0::2], up[e, 1::2]
                gate_s, up_sc = (None, None) if up_s is None else (up_s[e, 0::2], up_s[e, 1::2])
            else:
                gate_w, up_w = up[e, :inter], up[e, inter:]
                if up_s is None:
                    gate_s = up_sc = None
                else:
                    rows = inter if fmt.weight_format == "fp4" else -(-inter // fmt.block_size[0])
                    gate_s, up_sc = up_s[e, :rows], up_s[e, rows:]
            put(e, "gate_proj", gate_w, gate_s, act1)
            put(e, "up_proj", up_w, up_sc, act1)
        else:
            put(e, "up_proj", up[e], None if up_s is None else up_s[e], act1)
        put(e, "down_proj", down[e], None if down_s is None else down_s[e], None if a2 is None else a2[e])
    return out


def save_experts(
    modules: torch.nn.Module | Mapping[str, torch.nn.Module],
    path: str | os.PathLike,
    prefix: str = "experts",
    *,
    write_config: bool = True,
) -> Path:
    """Save experts in DeepSeek naming to `path` (a directory: model.safetensors + config.json's
    quantization_config; or a .safetensors file). `modules`: one module (keys under `prefix`) or {prefix: module}."""
    from safetensors.torch import save_file

    items = {prefix: modules} if isinstance(modules, torch.nn.Module) else dict(modules)
    tensors: dict[str, torch.Tensor] = {}
    formats = set()
    for pre, module in items.items():
        tensors.update(experts_state_dict(module, pre))
        formats.add(Q.quant_format(module))
    path = Path(path)
    if path.suffix == ".safetensors":
        path.parent.mkdir(parents=True, exist_ok=True)
        file, directory = path, None
    else:
        path.mkdir(parents=True, exist_ok=True)
        file, directory = path / "model.safetensors", path
    save_file(tensors, str(file), metadata={"format": "pt"})
    if directory is not None and write_config:
        fmts = [f for f in formats if f is not None]
        if len(fmts) > 1:
            raise ValueError(f"modules in different formats cannot share one quantization_config: {fmts}")
        config: dict[str, Any] = {}
        if fmts:
            config["quantization_config"] = quantization_config_dict(fmts[0])
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return file


__all__ = [
    "experts_modules",
    "experts_state_dict",
    "load_experts",
    "load_model_experts",
    "quantization_config_dict",
    "read_quantization_config",
    "save_experts",
]
