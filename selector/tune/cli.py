"""The `selector tune` command: arguments, the run with its progress, the plan table and the JSON file.

Exit codes as every selector command: 0 done, 1 measuring cannot run here (no CUDA GPU, the GPU's lock held),
2 a usage error (a bad flag, config file or preset name). Errors are one line with the fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from selector.arguments import number, whole_number, whole_numbers
from selector.bench.grid import BenchOptions
from selector.tune.inputs import DTYPES, FORMATS, GRID
from selector.tune.progress import ProgressBar
from selector.tune.runner import TuneOptions


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def targets_from_args(args: argparse.Namespace, device: str) -> list[Any]:
    """The layers the arguments name: config files or model directories, presets, or the size flags."""
    from selector.tune.inputs import TuneInputError, flag_target, preset_targets, read_config, with_overrides

    targets = [read_config(path) for path in args.config or ()]
    targets += preset_targets(args.preset or ())
    sizes = (args.experts, args.hidden, args.intermediate, args.top_k)
    if any(v is not None for v in sizes):
        if any(v is None for v in sizes):
            raise TuneInputError("give all of --experts --hidden --intermediate --top-k (or a config.json, or --preset)")
        targets.append(flag_target(*sizes))
    if not targets:
        raise TuneInputError(
            "nothing to tune: give a model's config.json (or its directory), --preset NAME "
            "(grid: the perf grid), or --experts --hidden --intermediate --top-k"
        )
    return [with_overrides(t, args.dtype, args.format, device) for t in targets]


def summary_lines(result: Any) -> list[str]:
    """What the run did, after the plans: first calls, kernel tuning, dropped backends, time spent, files."""
    from selector.tune.plan import render_plan

    lines = []
    for target in result.targets:
        for note in target.notes:
            lines.append(f"note: {target.name}: {note}")
    if result.dry_run:
        lines.append(f"dry run on {result.gpu}: {sum(1 for c in result.cells if c.backends)} cells")
        for c in result.cells:
            state = "already measured, skipped" if c.measured and not result.force else "to measure"
            if not c.backends:
                state = "no backend can run it here"
            lines.append(f"  {c.target} T={c.tokens} {c.mode}: {', '.join(c.backends) or '-'} ({state}; static pick "
                         f"{c.static or '-'})")
            for name, why in c.left_out.items():
                lines.append(f"    left out {name}: {why}")
        return lines
    lines += [render_plan(plan) for plan in result.plans]
    for target, firsts in result.first_calls.items():
        text = ", ".join(f"{b} {s:.2f}s" for b, s in sorted(firsts.items(), key=lambda kv: -kv[1]))
        lines.append(f"first call (JIT, autotuning) on {target}: {text}")
    for entry in result.kernel_tuning:
        from selector.tune.runner import _describe

        lines.append(f"kernel tuning {entry['target']} {entry['backend']}: {_describe(entry)}")
    left: dict[tuple[str, str, str], list[int]] = {}
    for c in result.cells:
        for name, why in c.left_out.items():
            left.setdefault((c.target, name, why), []).append(c.tokens)
    for (target, name, why), counts in left.items():
        lines.append(f"left out {name} from {target} at T={','.join(map(str, sorted(set(counts))))}: {why}")
    for e in result.errors:
        lines.append(f"dropped {e['backend']} from {e['target']} T={e['tokens']} {e['mode']}: {e['error']}")
    per = ", ".join(f"{name} {s:.1f}s" for name, s in result.durations.items())
    spent = f"{result.total_s:.1f}s in all" + (f" ({per})" if per else "")
    lines.append(f"tuning time: {spent}; {result.stored} records stored for {result.gpu}")
    return lines


def tune_options(args: argparse.Namespace) -> TuneOptions:
    """The run's options as the flags give them."""
    return TuneOptions(
        tokens=args.tokens,
        batch_sizes=args.batch_sizes or (),
        modes=args.modes,
        graph_max_tokens=args.graph_max_tokens,
        backends=args.backends,
        kernel_budget_s=args.kernel_budget_s,
        memory_cap_gb=args.memory_cap_gb,
        force=args.force,
        dry_run=args.dry_run,
        rounds=args.rounds,
        lock_timeout_s=args.lock_timeout,
    )


def check_options(args: argparse.Namespace) -> BenchOptions:
    """The options of `--check`'s bench run: the tuned cells' backends, modes and budgets."""
    return BenchOptions(
        backends=args.backends,
        modes=args.modes,
        graph_max_tokens=args.graph_max_tokens,
        memory_cap_gb=args.memory_cap_gb,
        rounds=args.rounds,
    )


def _cmd_tune(args: argparse.Namespace) -> int:
    from selector.cli import UsageError
    from selector.tune.inputs import TuneInputError
    from selector.tune.runner import TuneUnavailable, run_tune

    progress = ProgressBar()
    try:
        targets = targets_from_args(args, "cuda")
        result = run_tune(targets, tune_options(args), progress=progress, log=progress.line)
    except TuneInputError as exc:
        raise UsageError(str(exc)) from exc
    except TuneUnavailable as exc:
        print(f"selector tune: {exc}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    print("\n".join(summary_lines(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
        print(f"wrote {args.json}")
    if args.check and not args.dry_run:
        check_choice(args, targets, sorted({c.tokens for c in result.cells}))
    return 0


def check_choice(args: argparse.Namespace, targets: Sequence[Any], tokens: Sequence[int]) -> None:
    """A fresh interleaved run of `selector bench` over the tuned layers, in this process (so backends warmed
    by tuning stay warm), with `auto` choosing from the records just stored: the choice quality per cell."""
    from selector.bench.grid import run_bench
    from selector.bench.render import choice_table, write_outputs
    from selector.dispatch import reset_selection_caches
    from selector.tuning_store import reload

    reload()
    reset_selection_caches()
    progress = ProgressBar()
    try:
        bench = run_bench({t.name: t.problem for t in targets}, tokens, check_options(args), progress=progress.line)
    finally:
        progress.close()
    paths = write_outputs(bench, Path(args.check))
    print(choice_table(bench.cells).strip())
    print("wrote " + ", ".join(map(str, paths)))


def register(sub: Any) -> None:
    """Add the `tune` subcommand to the CLI's subparsers."""
    tune = sub.add_parser(
        "tune",
        help="measure every backend on this GPU for a model's layers, so that auto picks from measurements",
        description="Times every backend that can run each layer here, per token count and mode, in interleaved "
        "rounds; saves the records auto ranks by (skipping cells already measured under this environment's "
        "fingerprint) and prints the plan: which backend for which token range and the gain over the static "
        "choice. Exit 0: done; 1: cannot measure here (no CUDA GPU, the GPU's lock held); 2: usage error.",
    )
    tune.add_argument("config", nargs="*", help="a Transformers config.json, or a model directory holding one")
    tune.add_argument("--preset", action="append", help=f"a known shape (repeatable); grid: {', '.join(GRID)}")
    tune.add_argument("--experts", type=whole_number(1), help="number of experts E")
    tune.add_argument("--hidden", type=whole_number(1), help="hidden size H")
    tune.add_argument("--intermediate", type=whole_number(1), help="intermediate size I per expert")
    tune.add_argument("--top-k", type=whole_number(1), help="experts per token k")
    tune.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the config's, else bfloat16)")
    tune.add_argument("--format", choices=list(FORMATS), help="weight format (default: the config's, else dense)")
    tune.add_argument("--tokens", type=whole_numbers(1),
                      help="comma list of token counts (default: every power of two 1..16384)")
    tune.add_argument("--batch-sizes", type=whole_numbers(1),
                      help="the model's own batch sizes, added to the token counts")
    tune.add_argument("--modes", type=_names, default=["eager", "graph"], help="comma list of eager,graph")
    tune.add_argument("--graph-max-tokens", type=whole_number(0), default=512,
                      help="graph mode up to this token count (0: none)")
    tune.add_argument("--backends", type=_names, help="comma list of backends (default: every one that can run here)")
    tune.add_argument("--kernel-budget-s", type=number(0.0), default=60.0,
                      help="seconds per layer for kernel tuning hooks (0: none)")
    tune.add_argument("--rounds", type=whole_number(1), default=5, help="interleaved rounds per cell")
    tune.add_argument("--memory-cap-gb", type=number(0.0, inclusive=False), default=40.0,
                      help="leave out a backend needing more temporaries")
    tune.add_argument("--lock-timeout", type=number(0.0), default=600.0,
                      help="seconds to wait for another tuner on the GPU")
    tune.add_argument("--force", action="store_true", help="measure cells already measured under this fingerprint")
    tune.add_argument("--dry-run", action="store_true", help="list what would be measured; measure nothing")
    tune.add_argument("--check", metavar="DIR", help="then time auto against every backend in a fresh interleaved "
                      "run (selector bench, this process) and write its files to DIR: the choice quality")
    tune.add_argument("--json", metavar="FILE", help="write the run and the plan as JSON (schema selector.tune/1)")
    tune.set_defaults(func=_cmd_tune)

