"""The experts shapes a model's Transformers config.json describes, and how each one's kernel choice is covered on
this machine (`selector doctor --model`).

The config is read as JSON (no download, no Transformers, no model built, no torch), with the rules
`selector tune` reads it by (`selector.tune.inputs.problem_from_config`), so a shape tuned from the same file has
the same key. Every sub-config that declares experts (a multimodal model's `text_config`, a talker's) adds its
shape; equal shapes are listed once. Per shape:
- tabled: the fused Triton kernel's tile table for this GPU holds its tiles (the one shipped, or one tuned on
  this node by `selector tune`);
- tuned: the tuning store holds measured times for it that are current here;
- estimated: neither, so `auto` ranks by static estimates and the fused kernel borrows the tiles of the nearest
  shape a table holds (plugins/triton_fused/nearest.py).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from selector.probes import Environment
from selector.tuning import CPU, TuningTable, problem_key
from selector.types import Problem

TABLED, TUNED, ESTIMATED = "tabled", "tuned", "estimated"
_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_MAX_DEPTH = 4  # sub-configs nest one or two levels deep; deeper is data, not a model part


class ModelConfigError(ValueError):
    """A path that is not a readable Transformers config of an MoE model: one line naming the fix."""


@dataclass(frozen=True)
class ModelShape:
    """One distinct experts layer of the model and how its kernel choice is covered here."""

    scopes: tuple[str, ...]  # where in the config it was read ("" the top level, "text_config", ...)
    problem: Problem  # token count unset
    status: str  # TABLED, TUNED or ESTIMATED
    tile_table: str | None  # "shipped" or "node" (tuned on this node) when the fused kernel's table holds it
    measured: dict[str, tuple[int, ...]]  # mode -> token counts measured (current records of the store)
    tune_command: str
    notes: tuple[str, ...] = ()

    @property
    def layout(self) -> str:
        """The weight layout in words: "plain", or its departures from it ("bias, transposed, interleaved")."""
        p = self.problem
        departures = (
            ("non-gated", not p.gated),
            ("bias", p.has_bias),
            ("transposed", p.is_transposed),
            ("interleaved", p.interleaved),
        )
        flags = [name for name, on in departures if on]
        if p.weight_format != "dense":
            flags.append(p.weight_format if p.scale_format is None else f"{p.weight_format}/{p.scale_format}")
        return ", ".join(flags) or "plain"

    def to_dict(self) -> dict[str, Any]:
        p = self.problem
        return {
            "scopes": list(self.scopes),
            "experts": p.num_experts,
            "hidden": p.hidden_size,
            "intermediate": p.intermediate_size,
            "top_k": p.top_k,
            "dtype": p.dtype,
            "layout": self.layout,
            "activation": p.activation if p.gate.is_default else p.gate.label(),
            "key": problem_key(p),
            "status": self.status,
            "tile_table": self.tile_table,
            "measured": {mode: list(tokens) for mode, tokens in self.measured.items()},
            "tune_command": self.tune_command,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class ModelSection:
    """The doctor report's model section: the config read and each distinct experts shape."""

    source: str  # the config.json read
    name: str  # the model's name as the config gives it, else its folder
    gpu: str  # the GPU the coverage is judged for ("cpu" without one)
    shapes: tuple[ModelShape, ...]
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "name": self.name,
            "gpu": self.gpu,
            "shapes": [s.to_dict() for s in self.shapes],
            "notes": list(self.notes),
        }


def read_model_config(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The config.json at `path` (or in the folder `path`) and its JSON object; ModelConfigError otherwise."""
    path = Path(path).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no config.json" if path.is_dir() else f"{path} does not exist"
        raise ModelConfigError(
            f"{where}: give a Transformers config.json or the model folder holding one (a hub model: download its "
            "config.json first)"
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelConfigError(f"{file} is not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{file} holds a JSON {type(config).__name__}, not a config object")
    return file, config


def _moe_configs(config: Mapping[str, Any], scope: str = "", depth: int = 0) -> Iterator[tuple[str, Mapping]]:
    """(scope, sub-config) of every part of `config` that declares experts, the top level first."""
    if any(isinstance(config.get(k), int) and not isinstance(config.get(k), bool) for k in _EXPERTS_KEYS):
        yield scope, config
    if depth < _MAX_DEPTH:
        for key, value in config.items():
            if isinstance(value, Mapping):
                yield from _moe_configs(value, f"{scope}.{key}" if scope else str(key), depth + 1)


def config_shapes(config: Mapping[str, Any], source: str) -> tuple[list[tuple[tuple[str, ...], Problem]], list[str]]:
    """The distinct experts layers `config` describes ((scopes, problem) in config order) and notes on how they
    were read; ModelConfigError when it describes none."""
    from selector.tune.inputs import TuneInputError, problem_from_config

    shapes: dict[Problem, list[str]] = {}
    notes: list[str] = []
    errors: list[str] = []
    for scope, part in _moe_configs(config):
        try:
            target = problem_from_config(part, f"{source}:{scope}" if scope else source)
        except TuneInputError as exc:
            errors.append(str(exc))
            continue
        shapes.setdefault(target.problem, []).append(scope)
        notes += [f"{scope or 'config'}: {n}" for n in target.notes if f"{scope or 'config'}: {n}" not in notes]
    if not shapes:
        why = "; ".join(errors) or f"no {' / '.join(_EXPERTS_KEYS)} field anywhere in it"
        raise ModelConfigError(f"{source} describes no experts layer ({why}): is it an MoE model's config.json?")
    return [(tuple(scopes), problem) for problem, scopes in shapes.items()], notes


def tile_table(problem: Problem, gpu: str) -> str | None:
    """"node" or "shipped" when the fused kernel's tile table for `gpu` holds tiles for `problem` (its own layout's
    entry, else the plain layout's of the same shape, as the kernel looks them up: the node's table first, and
    only for gated bfloat16 / float16 layers of dense weights: quantised ones run other kernels), else None."""
    if gpu == CPU or not problem.gated or problem.dtype not in ("bfloat16", "float16"):
        return None
    if problem.weight_format != "dense":
        return None
    from selector.plugins.triton_fused.tables import lookup_keys, table_source  # torch-free

    size = (problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k)
    keys = lookup_keys(*size, transposed=problem.is_transposed, interleaved=problem.interleaved)
    return {"tuned": "node", "table": "shipped", None: None}[table_source(gpu, keys)]


def _measured(table: TuningTable, gpu: str, problem: Problem) -> dict[str, tuple[int, ...]]:
    found = {}
    for mode in ("eager", "graph"):
        tokens = table.token_counts(gpu, replace(problem, call=replace(problem.call, cuda_graph=mode == "graph")))
        if tokens:
            found[mode] = tuple(tokens)
    return found


def tune_command(problem: Problem, source: Path, from_file: Problem | None) -> str:
    """The `selector tune` command that measures `problem`: the config file when it reads as this shape, else
    the size flags (with --dtype and --format)."""
    if problem == from_file:
        return f"selector tune {shlex.quote(str(source))}"
    flags = (
        f"selector tune --experts {problem.num_experts} --hidden {problem.hidden_size} --intermediate "
        f"{problem.intermediate_size} --top-k {problem.top_k} --dtype {problem.dtype}"
    )
    formats = {("fp8_block", "float32"): "fp8-f32", ("fp8_block", "ue8m0"): "fp8-ue8m0", ("fp4", "ue8m0"): "fp4"}
    fmt = formats.get((problem.weight_format, problem.scale_format))
    return flags + (f" --format {fmt}" if fmt else "")


def model_section(path: str | Path, env: Environment, table: TuningTable) -> ModelSection:
    """The model section of `selector doctor --model`: every distinct experts shape of the config at `path` and
    its coverage on this machine's first GPU (the CPU without one), with `table` as the measured times trusted
    here. ModelConfigError when `path` is no MoE model's config."""
    from selector.tune.inputs import TuneInputError, problem_from_config

    file, config = read_model_config(path)
    found, notes = config_shapes(config, str(file))
    try:
        from_file: Problem | None = problem_from_config(config, str(file)).problem  # what `selector tune FILE` runs
    except TuneInputError:
        from_file = None
    gpu = env.gpu.devices[0].name if env.gpu.devices else CPU
    shapes = []
    for scopes, problem in found:
        tiles, measured = tile_table(problem, gpu), _measured(table, gpu, problem)
        status = TUNED if measured else TABLED if tiles else ESTIMATED
        command = tune_command(problem, file, from_file)
        shapes.append(ModelShape(scopes, problem, status, tiles, measured, command, _layout_notes(problem, from_file)))
    name = str(config.get("_name_or_path") or (file.parent.name if file.parent.name else config.get("model_type")))
    return ModelSection(str(file), name, gpu, tuple(shapes), tuple(notes))


def _layout_notes(problem: Problem, from_file: Problem | None) -> tuple[str, ...]:
    plain = not (problem.has_bias or problem.is_transposed or problem.interleaved or not problem.gate.is_default)
    if problem == from_file or plain:
        return ()
    return ("the size flags describe the plain layout only: tune this shape from a config.json of its own",)


def status_counts(shapes: Sequence[ModelShape]) -> dict[str, int]:
    """How many shapes are tabled, tuned and estimated."""
    return {s: sum(shape.status == s for shape in shapes) for s in (TUNED, TABLED, ESTIMATED)}
