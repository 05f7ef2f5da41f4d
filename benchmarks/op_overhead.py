"""What the opaque `selector::experts` op adds to an experts call: the op called directly (as a compiled
model's wrapper calls it, without torch.compile) against the module's own uncompiled call, interleaved rounds.

    python benchmarks/op_overhead.py --device cpu                       # tiny layer, host clock
    python benchmarks/op_overhead.py --device cuda --preset qwen3-30b-a3b --tokens 1,8

Per token count, four runners in rotated rounds: the module call and the op, each with the backend `auto`
picks (`--backend` names another) and with a backend that does no work (it returns its input, so only
selector's own cost is left: dispatch, checks, lookups, the op's wrapper). One sample is the host clock around
n calls back to back, then one device sync; the figure is the median sample per call, with the spread (max - min)
of the rounds. SELECTOR_VALIDATE is "shapes" (the layer is timed, not the per-call value checks), unless set.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("SELECTOR_VALIDATE", "shapes")

import torch  # noqa: E402

import selector  # noqa: E402
from selector.dispatch import last_backend, requested_implementation, reset_selection_caches, track  # noqa: E402
from selector.registry import register_plugin  # noqa: E402

NOOP = "op_overhead_noop"


class NoWork:
    """A backend that returns its input: what is left of a call is selector's own cost."""

    @staticmethod
    @selector.hookimpl
    def selector_backends() -> list[selector.BackendSpec]:
        return [selector.BackendSpec(name=NOOP, load=lambda: (lambda module, x, index, weights: x),
                                     estimate=lambda problem, env: 1.0)]  # fmt: skip


def _layer(args: argparse.Namespace) -> torch.nn.Module:
    dtype = getattr(torch, args.dtype)
    if args.preset:
        from selector.bench.layer import make_layer
        from selector.presets import preset

        return make_layer(torch, preset(args.preset), dtype, args.device, seed=0)
    from selector.testing import make_experts

    return make_experts(4, 16, 8, dtype=dtype, device=args.device, seed=0).requires_grad_(False)


def _time(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--preset", default=None, help="a shape preset (default: a tiny layer, E=4 H=16 I=8 k=2)")
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--backend", default="auto", help="what the module and the op run besides the no-work backend")
    p.add_argument("--calls", type=int, default=2000, help="calls per sample")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu":
        torch.set_num_threads(1)  # a tiny layer: threads only add noise
    register_plugin(NoWork, name=NOOP)
    reset_selection_caches()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    layer = _layer(args)
    weight = layer.gate_up_proj
    experts, hidden_size = weight.shape[0], weight.shape[-1]
    from selector.presets import preset

    top_k = preset(args.preset).top_k if args.preset else 2
    lines = ["| T | backend | module call µs (spread) | op direct µs (spread) | op − module µs |", "|---|---|---|---|---|"]
    with torch.no_grad():
        for tokens in (int(t) for t in args.tokens.split(",")):
            index = torch.rand(tokens, experts, device=args.device).topk(top_k, dim=1).indices
            weights = torch.softmax(torch.randn(tokens, top_k, device=args.device), dim=1)
            x = torch.randn(tokens, hidden_size, device=args.device, dtype=weight.dtype)
            runners: dict[str, Callable[[], Any]] = {}
            ran: dict[str, str | None] = {}
            for name in (args.backend, NOOP):
                selector.set_experts_implementation(layer, name)
                uid = track(layer)
                args_ = (x, index, weights)
                runners[f"{name}|module"] = lambda args_=args_: layer(*args_)
                runners[f"{name}|op"] = lambda name=name, uid=uid, args_=args_: torch.ops.selector.experts(
                    uid, name if name != "auto" else "", *args_, weight)
            samples: dict[str, list[float]] = {key: [] for key in runners}
            names = list(runners)
            for key in names:  # warm: the choice, the backend's own graphs
                for _ in range(5):
                    _set(layer, key)
                    runners[key]()
                    ran[key] = last_backend(layer)
            sync()
            for r in range(args.rounds):
                for key in names[r % len(names):] + names[: r % len(names)]:
                    _set(layer, key)
                    samples[key].append(_time(runners[key], args.calls, sync))
            for name in (args.backend, NOOP):
                module_s, module_spread = _median_spread(samples[f"{name}|module"])
                op_s, op_spread = _median_spread(samples[f"{name}|op"])
                label = "no work" if name == NOOP else f"{name} ({ran[f'{name}|module']} / op: {ran[f'{name}|op']})"
                lines.append(f"| {tokens} | {label} | {module_s * 1e6:.1f} ({module_spread * 1e6:.1f}) | "
                             f"{op_s * 1e6:.1f} ({op_spread * 1e6:.1f}) | {(op_s - module_s) * 1e6:+.1f} |")  # fmt: skip
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{device}, {args.preset or 'tiny layer'}, {args.dtype}, SELECTOR_VALIDATE={os.environ['SELECTOR_VALIDATE']}")
    print("\n".join(lines))
    return 0


def _median_spread(samples: list[float]) -> tuple[float, float]:
    """(median, max - min) of one runner's rounds, seconds per call."""
    return statistics.median(samples), max(samples) - min(samples)


def _set(layer: torch.nn.Module, key: str) -> None:
    """The module's request for a runner: the module call runs what the module asks for."""
    name = key.split("|")[0]
    if requested_implementation(layer) != name:
        selector.set_experts_implementation(layer, name)


if __name__ == "__main__":
    raise SystemExit(main())
