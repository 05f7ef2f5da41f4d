"""The `selector` command: doctor, plugins (and bench, tune where installed).

Exit codes: 0 usable, 1 something requested or required is broken, 2 usage error. An error is one line
naming what is wrong and the fix; `selector --debug ...` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace

from selector.types import COMPILE_MODES, GRAD_INPUTS, CallMode, Problem

EXIT_OK, EXIT_BROKEN, EXIT_USAGE = 0, 1, 2
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")  # what backends declare; anything else is "custom:<name>"


class UsageError(ValueError):
    """A flag or argument that cannot be used: one line, exit 2."""


def _positive(flag: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"{flag} must be at least {minimum}, got {value}")


def check_problem(problem: Problem) -> Problem:
    """UsageError unless the sizes describe a layer that can exist (positive sizes, 1 <= k <= E)."""
    _positive("--experts", problem.num_experts)
    _positive("--hidden", problem.hidden_size)
    _positive("--intermediate", problem.intermediate_size)
    _positive("--top-k", problem.top_k)
    _positive("--tokens", problem.num_tokens)
    named_by_gate = problem.activation == problem.gate.name  # a gate other than act_mul names itself (GPT-OSS)
    if problem.activation not in ACTIVATIONS and not named_by_gate and not (
            problem.activation.startswith("custom:") and len(problem.activation) > len("custom:")):
        raise UsageError(f"--activation {problem.activation!r} is not one of {', '.join(ACTIVATIONS)} "
                         "or custom:<name>")
    if problem.top_k > problem.num_experts:
        raise UsageError(f"--top-k {problem.top_k} is more than the {problem.num_experts} experts (--experts); "
                         "k must be between 1 and E")
    return problem


def _add_problem_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("experts configuration (ranks the backends for it)")
    g.add_argument("--preset", help="a known model: qwen1.5-moe-a2.7b, qwen3-30b-a3b, mixtral-8x7b, deepseek-v3, gpt-oss-20b")
    g.add_argument("--experts", type=int, help="number of experts E")
    g.add_argument("--hidden", type=int, help="hidden size H")
    g.add_argument("--intermediate", type=int, help="intermediate size I per expert")
    g.add_argument("--top-k", type=int, help="experts per token k")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    g.add_argument("--device", choices=["cuda", "cpu"])
    g.add_argument("--tokens", type=int, help="tokens per forward (decode: 1..64, prefill: 512+)")
    g.add_argument("--activation", help="silu, gelu, gelu_tanh, relu, ...")
    g.add_argument("--weight-format", choices=["dense", "fp8_block", "fp4"])
    g.add_argument("--scale-format", choices=["float32", "ue8m0"])
    for flag in ("non-gated", "bias", "transposed", "interleaved", "custom-gate"):
        g.add_argument(f"--{flag}", action="store_true")
    g.add_argument("--compile-mode", choices=list(COMPILE_MODES), help="called under torch.compile in this mode")
    g.add_argument("--fullgraph", action="store_true", help="called under torch.compile(fullgraph=True)")
    g.add_argument("--grad", action="store_true", help="autograd records (training): backends need a backward")


SIZE_FLAGS = ("--experts", "--hidden", "--intermediate", "--top-k")
# What the other layer options are read from (argparse's dest, flag), each only with a layer to apply it to
LAYER_OPTIONS = (("dtype", "--dtype"), ("device", "--device"), ("tokens", "--tokens"), ("activation", "--activation"),
                 ("weight_format", "--weight-format"), ("scale_format", "--scale-format"), ("non_gated", "--non-gated"),
                 ("bias", "--bias"), ("transposed", "--transposed"), ("interleaved", "--interleaved"),
                 ("custom_gate", "--custom-gate"), ("compile_mode", "--compile-mode"), ("fullgraph", "--fullgraph"),
                 ("grad", "--grad"))


def problem_from_args(args: argparse.Namespace, default_device: str) -> Problem | None:
    """The Problem the options describe, or None when none was given. UsageError for layer options without a
    layer (--preset, or all four sizes): nothing would read them."""
    from selector.presets import preset

    sizes = (args.experts, args.hidden, args.intermediate, args.top_k)
    missing = ", ".join(flag for flag, v in zip(SIZE_FLAGS, sizes) if v is None)
    if args.preset is None and all(v is None for v in sizes):
        given = [flag for dest, flag in LAYER_OPTIONS if getattr(args, dest) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)} describe a layer and no layer is given: add --preset NAME, or all "
                             f"of {' '.join(SIZE_FLAGS)} (missing: {missing})")
        return None
    if args.preset is not None:
        base = preset(args.preset)
    elif missing:
        raise UsageError(f"give --preset, or all of {' '.join(SIZE_FLAGS)} (missing: {missing})")
    else:
        base = Problem(num_experts=args.experts, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       top_k=args.top_k)
    changes = {
        "num_experts": args.experts, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
        "top_k": args.top_k, "dtype": args.dtype, "num_tokens": args.tokens, "activation": args.activation,
        "weight_format": args.weight_format, "scale_format": args.scale_format,
    }
    problem = replace(base, device=args.device or default_device, **{k: v for k, v in changes.items() if v is not None})
    flags = {"gated": not args.non_gated, "has_bias": args.bias or base.has_bias,
             "is_transposed": args.transposed or base.is_transposed, "interleaved": args.interleaved or base.interleaved,
             "custom_gate": args.custom_gate or base.custom_gate}
    problem = replace(problem, **flags)
    if args.compile_mode or args.fullgraph or args.grad:  # how the layer is called, not only its shapes
        call = CallMode(compile=bool(args.compile_mode or args.fullgraph), compile_mode=args.compile_mode,
                        fullgraph=args.fullgraph, grad_inputs=GRAD_INPUTS if args.grad else ())
        problem = replace(problem, call=call)
    if problem.dtype == "bfloat16" and problem.device == "cpu" and args.dtype is None:
        problem = replace(problem, dtype="float32")
    return check_problem(problem)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from selector.doctor import build_report
    from selector.registry import load_checked_registry
    from selector.probes import collect_environment
    from selector.render import render_json, render_markdown, render_text

    _positive("--ep-size", args.ep_size)
    env = collect_environment()
    try:
        problem = problem_from_args(args, "cuda" if env.gpu.devices else "cpu")
    except ValueError as exc:  # a bad size, or an unknown preset (its message lists the known ones)
        raise UsageError(str(exc)) from exc
    registry = load_checked_registry()  # a plugin that exits or stalls a process is found in a child first
    unknown = [name for name in args.require or () if name not in registry.specs]
    if unknown:
        raise UsageError(f"--require {', '.join(unknown)}: no such backend; registered: {', '.join(registry.names)}")
    from selector import tuning_store
    from selector.tuning import TuningTable

    table = TuningTable.from_records(tuning_store.known_records(), tuning_store.current_fingerprints(env, registry))
    parallel = None
    if args.ep_size is not None:  # judge the expert-parallel strategies for a group of that size
        from selector.doctor import default_problem
        from selector.parallel.report import build_section, doctor_facts

        experts = (problem or default_problem(env)).num_experts
        facts, nccl = doctor_facts(env, args.ep_size, experts, args.ep_backend, args.ep_same_tokens)
        parallel = build_section(facts, f"--ep-size {args.ep_size}", nccl)
    model = None
    if args.model is not None:  # the model's experts shapes: tabled, tuned or estimated here
        from selector.model_shapes import ModelConfigError, model_section

        try:
            model = model_section(args.model, env, table)
        except ModelConfigError as exc:
            raise UsageError(str(exc)) from None
    report = build_report(env, registry, problem=problem, required=args.require or (), tuning=table,
                          tuning_store=tuning_store.describe_sources(), parallel=parallel, model=model)
    if args.markdown:
        print(render_markdown(report, registry.specs.values()))
    else:
        print((render_json if args.json else render_text)(report))
    return report.exit_code


def _cmd_plugins(args: argparse.Namespace) -> int:
    from selector.registry import load_checked_registry

    registry = load_checked_registry()
    if args.json:
        print(json.dumps({"plugins": [p.to_dict() for p in registry.plugins], "problems": registry.problems}, indent=2))
    else:
        for p in registry.plugins:
            state = f"ERROR {p.error}" if p.error else f"skipped ({p.skipped})" if p.skipped else ", ".join(p.backends)
            print(f"{p.name:<16} {p.distribution:<24} {p.target:<28} {state}")
        for problem in registry.problems:
            print(f"! {problem}")
    return EXIT_BROKEN if any(p.error for p in registry.plugins) else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from selector.settings import help_table

    parser = argparse.ArgumentParser(prog="selector", description="Pick and explain Mixture-of-Experts experts backends.")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser(
        "doctor",
        help="check this machine and every backend",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Checks GPU/driver, CUDA toolkit, packages and plugins, then says which backends can run "
        "here and why not.\nExit 0: usable; 1: something requested or required is broken (a --require backend, a "
        "config that does not load, a config pin that cannot run here: a pin is an explicit request, or a config "
        "that denies every runnable backend); 2: usage error (a bad flag).",
        epilog=help_table(),
    )
    out = doctor.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="machine-readable report (schema selector.doctor/1)")
    out.add_argument("--markdown", action="store_true", help="markdown report")
    doctor.add_argument("--require", action="append", metavar="BACKEND", help="exit 1 unless this backend can run here")
    doctor.add_argument("--model", metavar="CONFIG", help="a Transformers config.json (or the model folder holding "
                        "one): list its experts shapes, each tabled, tuned or estimated here, and how to tune it")
    ep = doctor.add_argument_group("expert parallelism (judges the strategies for a group of ranks)")
    ep.add_argument("--ep-size", type=int, metavar="N",
                    help="ranks of the expert-parallel group; exit 1 if no strategy runs")  # fmt: skip
    ep.add_argument("--ep-backend", choices=["nccl", "gloo"],
                    help="default: nccl where torch has CUDA and a GPU is seen")  # fmt: skip
    ep.add_argument("--ep-same-tokens", action="store_true", help="every rank holds the same tokens (all_reduce)")
    _add_problem_options(doctor)
    doctor.set_defaults(func=_cmd_doctor)

    plugins = sub.add_parser("plugins", help="list loaded plugins, their distributions and failures")
    plugins.add_argument("--json", action="store_true")
    plugins.set_defaults(func=_cmd_plugins)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub: argparse._SubParsersAction) -> None:
    """Commands that live in their own modules (bench, daemon, store, tune), registered without importing torch."""
    from importlib import util

    for module in ("selector.bench", "selector.daemon.commands", "selector.store_commands", "selector.tune"):
        if util.find_spec(module) is not None:
            __import__(module, fromlist=["register"]).register(sub)


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message with whitespace folded (the type where the message is empty)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"selector {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line with the fix; --debug shows where it came from
        if args.debug:
            raise
        if isinstance(exc, UsageError):
            print(f"selector {args.command}: {one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE
        print(f"selector {args.command}: {type(exc).__name__}: {one_line(exc)} (rerun with --debug for the "
              "traceback)", file=sys.stderr)
        return EXIT_BROKEN


if __name__ == "__main__":
    sys.exit(main())
