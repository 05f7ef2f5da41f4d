"""The `selector bench` command: arguments, the run, its files, and the tuning records it can save."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from selector.arguments import number, whole_number, whole_numbers
from selector.bench.cells import DEFAULT_PRESETS, DEFAULT_TOKENS, FORMATS, MODES, BenchResult, measured_rows
from selector.bench.grid import BenchOptions

DEFAULT_MODES = ["eager", "graph"]


def _ints_text(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _some_of(text: str, allowed: Sequence[str]) -> list[str]:
    """The comma list `text`, every name one of `allowed` (else a usage error naming them)."""
    names = _names(text)
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'}: expected some of {', '.join(allowed)}")
    return names


def _formats(text: str) -> list[str]:
    return _some_of(text, tuple(FORMATS))


def _modes(text: str) -> list[str]:
    return _some_of(text, tuple(MODES))


def _compile_modes(text: str) -> list[str]:
    from selector.types import COMPILE_MODES

    return _some_of(text, tuple(COMPILE_MODES))


def _preset(text: str) -> str:
    """A preset's name as `selector.presets` spells it; a usage error listing the known ones."""
    from selector.presets import preset

    try:
        preset(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.lower()


def _layers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of layers, at least 1")
    return value


def _cmd_compiled(args: argparse.Namespace) -> int:
    """`--compile`: compiled against uncompiled per backend and mode, a table and compiled.json."""
    import json

    from selector.bench.compiled import COMPILE_BACKENDS, COMPILE_PRESETS, COMPILE_TOKENS, compiled_table
    from selector.bench.compiled import run_compiled_bench

    result = run_compiled_bench(
        presets=args.preset or list(COMPILE_PRESETS),
        tokens=args.tokens or list(COMPILE_TOKENS),
        modes=args.compile,
        backends=args.backends or list(COMPILE_BACKENDS),
        dtype_name=args.dtype,
        rounds=args.rounds,
        progress=_progress(),
        stack=args.stack or 1,
        train=args.modes == ["train"],
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiled.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    print(compiled_table(result))
    for key, why in result.skipped.items():
        print(f"skipped {key}: {why}")
    firsts = ", ".join(f"{k} {v:.1f} s" for k, v in result.compile_s.items())
    print(f"first calls (trace, compile, record) per preset/backend/mode: {firsts}")
    print(f"wrote {out / 'compiled.json'}")
    return 0


def _progress() -> Callable[[str], None]:
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    bar = tqdm(unit="cell", file=sys.stderr)

    def step(msg: str) -> None:
        bar.set_description(msg)
        bar.update(1)

    return step


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """The grid's options as the flags give them."""
    return BenchOptions(
        dtype_name=args.dtype,
        backends=args.backends,
        modes=args.modes,
        formats=args.formats,
        graph_max_tokens=args.graph_max_tokens,
        memory_cap_gb=args.memory_cap_gb,
        with_peers=not args.no_peers,
        rounds=args.rounds,
    )


def usage_problem(args: argparse.Namespace) -> str | None:
    """What makes the flags unusable together, or None: checked before torch is imported or a GPU looked for."""
    if args.stack is not None and not args.compile:
        return "--stack goes with --compile (layers per compiled module)"
    if args.compile and args.modes not in (DEFAULT_MODES, ["train"]):
        return "with --compile, --modes is train (a training step per call) or left out (a forward)"
    if args.compile and (args.merge or args.resume):
        return "--merge and --resume go with the grid, not --compile"
    if args.backends:
        from selector.registry import get_registry

        names = get_registry().names
        known = [*names, "auto"] if args.compile else names  # --compile times auto as one of its backends
        unknown = [n for n in args.backends if n not in known]
        if unknown:
            return f"--backends {', '.join(unknown)}: no such backend; registered: {', '.join(known)}"
    return None


def _cmd_bench(args: argparse.Namespace) -> int:
    problem = usage_problem(args)
    if problem is not None:
        print(f"selector bench: {problem}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():  # before any cell: the run times kernels against the GPU's floor
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        print(
            f"selector bench: needs a CUDA GPU and none is visible (torch {torch.__version__}, {build}); "
            "run it on a GPU node, `selector doctor` says what this machine lacks",
            file=sys.stderr,
        )
        return 1
    if args.compile:
        return _cmd_compiled(args)
    from selector.bench.grid import run_bench
    from selector.bench.render import markdown_table, write_outputs

    out = Path(args.out)
    previous = None
    if args.merge or args.resume:
        previous = previous_result(out, torch.cuda.get_device_name())
        if isinstance(previous, str):
            print(f"selector bench: {previous}", file=sys.stderr)
            return 2
    skip = measured_rows(previous, args.dtype, args.modes) if args.resume and previous else set()

    def whole(run: BenchResult) -> BenchResult:  # this run, merged into what --out held where asked
        return run.merged_into(previous) if previous is not None else run

    written: list[list[Path]] = []  # the files of each finished shape

    result = run_bench(
        args.preset or list(DEFAULT_PRESETS),
        args.tokens or list(DEFAULT_TOKENS),
        bench_options(args),
        progress=_progress(),
        skip=skip,
        after_shape=lambda partial: written.append(write_outputs(whole(partial), out)),  # a stopped run keeps them
    )
    # the last shape's files hold the whole run already; only a run that measured nothing new writes here
    paths = written[-1] if written else write_outputs(whole(result), out)
    from selector.bench.grid import records_from_bench
    from selector.tuning_store import default_store, save_records, write_export

    records = records_from_bench(result)
    write_export(Path(args.out) / "tuning.json", records)
    paths.append(Path(args.out) / "tuning.json")
    if args.save_tuning:
        saved = save_records(records)
        print(f"tuning store {default_store().path}: stored {saved.stored}, refused {len(saved.refused)}")
        from selector.daemon.client import share_tuning_records

        share_tuning_records(records)  # with the other processes of this node at once, where a daemon runs
    print(markdown_table(whole(result)))
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def previous_result(out: Path, device: str) -> BenchResult | str | None:
    """The result --out already holds for --merge / --resume: None when there is none, a message when it cannot
    be merged with a run on `device`."""
    path = out / "bench.json"
    if not path.exists():
        return None
    try:
        previous = BenchResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path} cannot be merged into ({type(exc).__name__}: {exc}); pick another --out"
    if previous.device != device:
        return f"{path} was measured on {previous.device}, this GPU is {device}: pick another --out"
    return previous


def register(sub: Any) -> None:
    """Add the `bench` subcommand to the CLI's subparsers."""
    bench = sub.add_parser("bench", help="time every backend per cell against the floor and Transformers' backends")
    bench.add_argument(
        "--preset", action="append", type=_preset, help=f"shape preset (repeatable); default: {', '.join(DEFAULT_PRESETS)}"
    )
    bench.add_argument(
        "--tokens",
        type=whole_numbers(1),
        help=f"comma list of token counts; default: {_ints_text(DEFAULT_TOKENS)} (with --compile: 1,8,64,512,4096)",
    )
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bench.add_argument("--backends", type=_names, help="comma list of selector backends (default: all registered)")
    bench.add_argument(
        "--modes",
        type=_modes,
        default=DEFAULT_MODES,
        help="comma list of eager,graph,compile,train; train: one training step per call (forward "
        "under autograd, then the backward of a fixed gradient; the differentiable backends only, "
        "their gradients checked against float64; never saved as tuning records); with --compile "
        "only train, to time training steps compiled against uncompiled",
    )
    bench.add_argument("--graph-max-tokens", type=whole_number(0), default=4096, help="graph mode up to this token "
                       "count (0: none)")
    bench.add_argument("--rounds", type=whole_number(1), default=5,
                       help="interleaved rounds per cell (all backends each round)")
    bench.add_argument("--memory-cap-gb", type=number(0.0, inclusive=False), default=40.0,
                       help="skip cells needing more temporaries")
    bench.add_argument("--no-peers", action="store_true", help="leave out Transformers' backends")
    bench.add_argument(
        "--formats",
        type=_formats,
        default=["dense"],
        help=f"comma list of weight formats to time side by side: {', '.join(FORMATS)}",
    )
    bench.add_argument("--out", default="bench-results", help="folder for bench.json, bench.md, bench.png, tuning.json")
    bench.add_argument("--save-tuning", action="store_true", help="let auto use these timings on this machine")
    bench.add_argument(
        "--merge",
        action="store_true",
        help="keep the result --out holds: this run's rows replace the same rows there, the others "
        "stay (each row's backends still timed together in one run)",
    )
    bench.add_argument(
        "--resume",
        action="store_true",
        help="as --merge, but rows --out already holds are not measured again: repeat the same "
        "command until the grid is done (the files are written after every shape)",
    )
    bench.add_argument(
        "--compile",
        type=_compile_modes,
        metavar="MODES",
        help="instead of the grid: each backend compiled in these torch.compile modes (comma list, e.g. "
        "default,reduce-overhead) against itself uncompiled; default presets qwen3-30b-a3b, "
        "qwen1.5-moe-a2.7b, backends auto, triton_fused, grouped_mm; writes compiled.json",
    )
    bench.add_argument(
        "--stack",
        type=_layers,
        metavar="N",
        help="with --compile: N layers of the shape, each with its own weights, in one module "
        "(x = x + layer_i(x, ...)) compiled as one, as in a model; times per layer (default 1: the "
        "layer alone); holds N layers' weights per preset",
    )
    bench.set_defaults(func=_cmd_bench)
