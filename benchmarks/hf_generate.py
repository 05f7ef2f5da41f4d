"""generate() on a randomly initialised, full-size Qwen1.5-MoE-A2.7B-shaped model: selector's "auto" beside
Transformers' own experts backends (eager, batched_mm, grouped_mm), in one run, no download.

    python benchmarks/hf_generate.py --out out/hf                          # on a GPU (~3 minutes)
    python benchmarks/hf_generate.py --out out/hf-tiny --tiny --device cpu # smoke test of the script itself

For each setting (batch x prompt length: 1x16, 4x128, 16x512) and backend:
- prefill ms: one generate() call with max_new_tokens=1 (time to first token, as a user sees it);
- decode ms/token: the median time between consecutive decode steps inside one generate() call (device
  events recorded by a logits processor, so no extra sync), after the first steps (compile, graph recording);
- decode wall ms/token: (generate with 1 + N new tokens - generate with 1) / N, which also charges any
  per-call cost (e.g. graphs recorded again in every call) to the tokens;
uncompiled (dynamic cache) and compiled: Transformers compiles the decode step when generate() gets a static
cache; we pass one StaticCache, reset between calls, as Transformers' docs advise (a fresh cache per call has
new tensor addresses, so CUDA graphs are recorded again in every call); the compile mode suits the backend:
"reduce-overhead" (CUDA graphs) where the backend is CUDA-graph safe, else "default". Compiled cells record
what torch.compile did (graphs, graph breaks, CUDA graph recordings and skips). Each new compiled setting
starts from torch._dynamo.reset(), as a process serving one shape would: Dynamo would otherwise compile the
second shape with dynamic shapes (its automatic dynamic).
Transformers' "grouped_mm" is timed as Transformers runs it in generate(): it swaps to batched_mm for the
decode steps on a GPU. The decode floor is the weight (and KV) bytes one step must read, over the bandwidth
of a device copy measured in the same run. Cells run in priority order under a time budget (--budget-s,
counted from the start); what does not fit is recorded as skipped. JSON is rewritten after every cell, so
a run cut short keeps what it measured. Prints a short markdown table last.

--interleave-compiled gives the compiled cells of one setting interleaved rounds too (auto against Transformers'
best backend under the same drift): one model, each backend's compiled decode step cached side by side by
Dynamo (the experts implementation is guarded), so it cannot go with --skip-module-guards.

--skip-module-guards compiles through selector.hf.compile_config(skip_module_guards=True): Dynamo stops
guarding torch's own nn modules (unsafe where modules change between calls); each compiled cell then starts
from torch._dynamo.reset(), so no cell finds another backend's graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

START = time.perf_counter()
# selector is imported as installed (`pip install -e .`): the checkout's own folder on sys.path would shadow a
# regular install and miss selector.probes / selector.plugins, which the install maps from probes/ and plugins/

import torch  # noqa: E402

TRANSFORMERS_BACKENDS = ("eager", "batched_mm", "grouped_mm")
DEFAULT_SETTINGS = "1x16,4x128,16x512"

# Qwen/Qwen1.5-MoE-A2.7B config.json (the shape only; weights are random)
QWEN15_MOE_A27B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    hidden_act="silu",
    max_position_embeddings=8192,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632,
    num_experts_per_tok=4,
    num_experts=60,
    norm_topk_prob=False,
    use_sliding_window=False,
)
TINY = dict(QWEN15_MOE_A27B, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for hf_generate.json and hf_generate.md")
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help="batch x prompt length, comma separated")
    p.add_argument("--backends", default="auto,eager,batched_mm,grouped_mm", help="uncompiled cells")
    p.add_argument("--compiled-backends", default="auto,batched_mm,grouped_mm,eager",
                   help="in priority order; cells that do not fit the budget are skipped")
    p.add_argument("--skip-module-guards", action="store_true",
                   help="compiled cells: selector.hf.compile_config(skip_module_guards=True) (see above)")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps timed, uncompiled")
    p.add_argument("--compiled-new-tokens", type=int, default=32, help="decode steps timed, compiled")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed rounds per cell: prefill is the fastest round, decode the median step of all rounds")
    p.add_argument("--budget-s", type=float, default=185.0, help="stop starting cells after this (from start)")
    p.add_argument("--compiled-cell-s", type=float, default=60.0,
                   help="a compiled cell is only started with at least this much budget left")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--interleave-compiled", action="store_true",
                   help="compiled cells of one setting take their rounds in turn (see above)")
    p.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decode step as one graph (a graph break is then an error, recorded)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled cells")
    p.add_argument("--compile-on-cpu", action="store_true",
                   help="compiled cells on a CPU too (smoke test; Transformers compiles only on accelerators)")
    p.add_argument("--skip-steps", type=int, default=2, help="decode steps left out of the per-step median")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same family (smoke test)")
    p.add_argument("--validate", choices=("full", "shapes", "off"), default=None,
                   help="SELECTOR_VALIDATE for the run (default: leave as is; selector's default is 'full')")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------------------


def ensure_backends() -> list[str]:
    """selector's registry; when selector is not pip-installed (no entry points), register the built-ins."""
    import selector
    from selector.dispatch import reset_selection_caches

    names = selector.get_registry().names
    if not names:
        import importlib

        for name in ("eager", "batched_mm", "grouped_mm", "triton_fused"):
            try:
                selector.register_plugin(importlib.import_module(f"selector.plugins.{name}"), name)
            except Exception as exc:  # noqa: BLE001
                log(f"built-in plugin {name} not registered: {exc}")
        reset_selection_caches()
        names = selector.get_registry().names
        log(f"selector is not installed as a distribution: registered built-ins in code: {names}")
    return names


def make_compile_config(backend: str, mode: str, fullgraph: bool, skip_module_guards: bool) -> Any:
    """generate()'s CompileConfig for a compiled cell: selector.hf.compile_config."""
    from selector.hf import compile_config

    return compile_config(mode, fullgraph=fullgraph, skip_module_guards=skip_module_guards, backend=backend)


def measure_bandwidth(device: torch.device) -> float | None:
    """Bytes per second of a device-to-device copy (read + write)."""
    if device.type != "cuda":
        return None
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    del a, b
    return 2 * n / seconds


def decode_floor_bytes(model: torch.nn.Module, cfg: dict, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step must read: every weight but the embedding table and the experts, the experts a
    batch of `batch` tokens hits (uniform routing: E(1 - (1 - k/E)^B) per layer), and the KV cache."""
    import selector.hf as hf

    experts = [m for members in hf.experts_modules(model).values() for _, m in members]
    expert_params = {id(p) for m in experts for p in m.parameters()}
    embed = model.get_input_embeddings().weight
    dense = sum(p.numel() * p.element_size() for p in model.parameters()
                if id(p) not in expert_params and p is not embed)
    e, k, layers = cfg["num_experts"], cfg["num_experts_per_tok"], len(experts)
    per_expert = sum(p.numel() * p.element_size() for p in experts[0].parameters()) / e
    hit = e * (1 - (1 - k / e) ** batch)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    elt = embed.element_size()
    kv = batch * context * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * elt
    return {"dense": dense, "experts": hit * per_expert * layers, "kv": kv, "experts_hit_per_layer": hit}


# ---------------------------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    import selector
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    cfg = dict(TINY if args.tiny else QWEN15_MOE_A27B)
    config = Qwen2MoeConfig(**cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = selector.from_config(AutoModelForCausalLM, config, experts_implementation="auto", dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model, cfg


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """A logits processor that stamps each generation step: a device event on CUDA (no sync), else the host
    clock. Transformers calls it once per step, after that step's forward was issued."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[Any] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(time.perf_counter())
        return scores

    def step_ms(self) -> list[float]:
        """Milliseconds between consecutive steps: entry i is decode step i + 1 (the prefill is step 0)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) for a, b in zip(self.stamps, self.stamps[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:])]


def timed_generate(model, ids, mask, new_tokens: int, device, extra: dict, clock: StepClock | None = None) -> float:
    from transformers import LogitsProcessorList

    cache = extra.get(cache_kwarg(model))
    if cache is not None:
        cache.reset()  # the same tensors, emptied: compiled graphs and CUDA graphs stay valid
    if clock is not None:
        extra = dict(extra, logits_processor=LogitsProcessorList([clock]))
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, **extra)
    sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens, f"generated {out.shape[1] - ids.shape[1]} tokens"
    return time.perf_counter() - t0


def cache_kwarg(model) -> str:
    """generate()'s name for a user's cache: "cache" from Transformers 5.2x, "past_key_values" before."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


_TREE_RECORDINGS = [0]  # CUDA graphs recorded by torch.compile's cudagraph trees (counted by a wrapper)
_RESETS = [0]  # torch._dynamo.reset() calls of this script: each drops every compiled cell's graphs


def reset_dynamo() -> None:
    """torch._dynamo.reset(), counted: an interleaved group warms again the cells whose graphs it dropped."""
    torch._dynamo.reset()
    _RESETS[0] += 1


def count_cudagraph_tree_recordings() -> None:
    """Wrap the cudagraph-tree manager's record_function once, to count recordings (private API: best effort)."""
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:
        return
    manager = getattr(cudagraph_trees, "CUDAGraphTreeManager", None)
    original = getattr(manager, "record_function", None)
    if original is None or getattr(original, "_counted", False):
        return

    def record_function(self, *args, **kwargs):
        _TREE_RECORDINGS[0] += 1
        return original(self, *args, **kwargs)

    record_function._counted = True
    manager.record_function = record_function


def compile_stats() -> dict[str, int]:
    """Counters of what torch.compile and selector did so far (a cell reports the difference)."""
    from torch._dynamo.utils import counters

    from selector import graphs

    return {
        "dynamo_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
        "cudagraph_tree_recordings": _TREE_RECORDINGS[0],
        "selector_graph_recordings": graphs.recordings(),
    }


def graph_break_reasons() -> list[str]:
    from torch._dynamo.utils import counters

    return [str(reason)[:200] for reason in counters["graph_break"]]


def observe_auto(model, ids, mask) -> dict[str, Any]:
    """Which selector backend ran the experts at prefill and at each decode step (uncompiled run)."""
    import selector.hf as hf
    from selector.dispatch import clear_last_backend, last_backend

    module = next(m for members in hf.experts_modules(model).values() for _, m in members)
    seen: list[tuple[int, str | None]] = []

    def pre(mod, args):
        clear_last_backend(mod)

    def post(mod, args, output):
        seen.append((int(args[0].shape[0]), last_backend(mod)))

    handles = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    return {"prefill": seen[0] if seen else None, "decode": sorted({name for _, name in seen[1:]}, key=str)}


def compile_mode_for(backend: str, model) -> str:
    """reduce-overhead (CUDA graphs) where what runs the decode step is graph safe, else default."""
    from dataclasses import replace

    import selector
    import selector.hf as hf
    from selector import dispatch

    if backend == "eager":
        return "default"  # the module's own loop reads expert ids on the host
    if backend != "auto":
        return "reduce-overhead"  # Transformers' batched_mm / grouped_mm have no host sync
    # auto under torch.compile (no autograd) is one opaque op that chooses per call, inside a CUDA-graph
    # capture among graph-safe backends only: reduce-overhead, as long as one of them runs this layer
    module = next(m for members in hf.experts_modules(model).values() for _, m in members)
    problem = replace(dispatch.problem_of(module, dispatch.declared_top_k(module)), compile=True, cuda_graph=True)
    pick = dispatch.rank_problem(problem).best
    spec = selector.get_registry().specs.get(pick)
    return "reduce-overhead" if spec is not None and spec.cuda_graph_safe else "default"


class CellRun:
    """One (mode, backend, setting) cell: warm-up, then timed rounds (uncompiled cells of one setting take
    their rounds in turn, so a drift in host speed hits every backend alike), then the summary."""

    def __init__(self, model, cfg, args, device, mode: str, backend: str, batch: int, length: int) -> None:
        self.model, self.cfg, self.args, self.device = model, cfg, args, device
        self.cell: dict[str, Any] = {"mode": mode, "backend": backend, "batch": batch, "prompt": length}
        gen = torch.Generator().manual_seed(batch * 1000 + length)
        self.ids = torch.randint(1, cfg["vocab_size"], (batch, length), generator=gen).to(device)
        self.mask = torch.ones_like(self.ids)
        self.n = args.compiled_new_tokens if mode == "compiled" else args.new_tokens
        self.t1: list[float] = []
        self.runs: list[tuple[float, list[float]]] = []
        self.seconds = 0.0
        self.timed_from: dict[str, int] | None = None  # --interleave-compiled: counts after the group's warm-ups
        self.extra: dict[str, Any] = {}
        if backend == "grouped_mm" and device.type == "cuda":
            self.cell["note"] = "Transformers swaps grouped_mm for batched_mm during decode on GPU"

    @property
    def ok(self) -> bool:
        return "status" not in self.cell

    def _compiled_extra(self, fullgraph: bool) -> dict[str, Any]:
        from transformers import StaticCache

        args, cell = self.args, self.cell
        config = make_compile_config(args.compile_backend, cell["compile_mode"], fullgraph, args.skip_module_guards)
        cell["skip_module_guards"] = args.skip_module_guards
        if self.device.type == "cpu":
            config._compile_all_devices = True  # Transformers' own switch for compiling on a CPU (tests)
        cell["fullgraph"] = fullgraph
        cell["cache"] = "one static cache, reset per call"
        cache = StaticCache(config=self.model.config, max_cache_len=self.ids.shape[1] + 1 + self.n)
        return {"compile_config": config, cache_kwarg(self.model): cache}

    def _guard(self, step) -> None:
        """Run one step of the cell; an error ends the cell (recorded), never the run."""
        t0 = time.perf_counter()
        self.model.set_experts_implementation(self.cell["backend"])
        try:
            step()
        except torch.cuda.OutOfMemoryError as exc:
            self.cell["status"] = "oom"
            self.cell["error"] = str(exc).splitlines()[0][:300]
        except Exception as exc:  # noqa: BLE001 - record and go on with the next cell
            self.cell["status"] = "error"
            self.cell["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            traceback.print_exc()
            if self.cell["mode"] == "compiled":
                reset_dynamo()  # a failed compile leaves nothing half-built for the next cell
        finally:
            self.seconds += time.perf_counter() - t0

    def warm(self) -> None:
        def step() -> None:
            if self.cell["mode"] == "compiled" and self.args.skip_module_guards:
                reset_dynamo()  # guards dropped: another backend's graph could pass them
            self.before = compile_stats()
            t0 = time.perf_counter()
            if self.cell["mode"] == "compiled":
                self.cell["compile_mode"] = compile_mode_for(self.cell["backend"], self.model)
                # warmed again after a reset: as it ended the first time (a fullgraph that failed would fail again)
                self.extra = self._compiled_extra(self.args.fullgraph and "fullgraph_error" not in self.cell)
                try:
                    self._generate(1 + self.n)
                # a graph break under fullgraph (Transformers' eager loop reads expert ids on the host: a
                # data-dependent size, which fullgraph reports as a UserError): say where, go on without it
                except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
                    self.cell["fullgraph_error"] = str(exc)[:600]
                    reset_dynamo()
                    self.extra = self._compiled_extra(False)
                    self._generate(1 + self.n)
                self._generate(1 + self.n)  # compile, CUDA-graph recording, autotuning caches
            else:
                self._generate(1 + self.n)
            self.cell["warmup_s"] = round(time.perf_counter() - t0, 2)
            self.warm_stats = compile_stats()

        self._guard(step)
        self.warm_resets = _RESETS[0]

    def _generate(self, new_tokens: int, clock: StepClock | None = None) -> float:
        return timed_generate(self.model, self.ids, self.mask, new_tokens, self.device, self.extra, clock)

    def round(self) -> None:
        def step() -> None:
            self.t1.append(self._generate(1))
            clock = StepClock(self.device)
            self.runs.append((self._generate(1 + self.n, clock), clock.step_ms()))

        if self.ok:
            self._guard(step)

    def finish(self, bw: float | None) -> dict[str, Any]:
        import selector.hf as hf

        cell, n = self.cell, self.n
        if self.ok and self.runs:
            t1 = min(self.t1)
            tn = min(wall for wall, _ in self.runs)
            steps = [ms for _, run in self.runs for ms in run[self.args.skip_steps:]]  # every round's steady steps
            cell["prefill_ms"] = t1 * 1e3
            cell["decode_wall_ms_per_token"] = max(tn - t1, 0.0) / n * 1e3
            cell["decode_ms_per_token"] = median(steps) or cell["decode_wall_ms_per_token"]
            cell["step_ms"] = [[round(v, 3) for v in run] for _, run in self.runs]
            cell["decode_tokens"] = n
            after = compile_stats()
            cell["warmup_counts"] = {k: self.warm_stats[k] - self.before[k] for k in self.before}
            timed_from = self.timed_from or self.warm_stats  # interleaved: after every cell of the group warmed
            cell["timed_counts"] = {k: after[k] - timed_from[k] for k in self.before}  # should all be 0
            if cell["warmup_counts"]["graph_breaks"]:
                cell["graph_break_reasons"] = graph_break_reasons()[-5:]

            def observe() -> None:
                backend, batch, length = cell["backend"], cell["batch"], cell["prompt"]
                if backend == "auto" and cell["mode"] == "uncompiled":
                    cell["auto_ran"] = observe_auto(self.model, self.ids, self.mask)
                if backend == "auto":
                    entry = hf.selection_report(self.model, tokens=(batch, batch * length)).entries[0]
                    cell["auto_picks"] = {str(t): p for t, p in entry.by_tokens.items()}

            self._guard(observe)
            cell.setdefault("status", "ok")
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        cell["cell_s"] = round(self.seconds, 2)
        floor = decode_floor_bytes(self.model, self.cfg, cell["batch"], cell["prompt"] + n)
        cell["floor_bytes"] = floor
        if bw:
            cell["decode_floor_ms"] = (floor["dense"] + floor["experts"] + floor["kv"]) / bw * 1e3
            if cell.get("decode_ms_per_token"):
                cell["decode_vs_floor"] = cell["decode_ms_per_token"] / cell["decode_floor_ms"]
                cell["decode_wall_vs_floor"] = cell["decode_wall_ms_per_token"] / cell["decode_floor_ms"]
        return cell


# ---------------------------------------------------------------------------------------------------------


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}x"


def markdown(result: dict) -> str:
    """One row per cell, then auto against the best Transformers backend of each setting."""
    lines = ["Run with: skip_module_guards.", ""] if result.get("options", {}).get("skip_module_guards") else []
    lines += [
        "| mode | bs x len | backend | prefill ms | decode ms/token | decode / floor | decode wall ms/token | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        note = c.get("status", "")
        if c.get("status") == "ok":
            note = c.get("note", "")
            if "auto_ran" in c:
                ran = c["auto_ran"]
                prefill = ran["prefill"][1] if ran["prefill"] else "?"
                note = f"ran: prefill {prefill}, decode {'/'.join(map(str, ran['decode']))}"
            elif "auto_picks" in c:
                note = "picks: " + ", ".join(f"T={t}: {p}" for t, p in c["auto_picks"].items())
            if c.get("compile_mode"):
                counts = c.get("warmup_counts", {})
                what = (f"{c['compile_mode']}, {counts.get('dynamo_graphs', '?')} graph(s), "
                        f"{counts.get('graph_breaks', '?')} break(s), "
                        f"{counts.get('cudagraph_tree_recordings', '?')} CUDA graph recording(s)")
                timed = c.get("timed_counts", {})
                if any(timed.values()):
                    what += "; while timed: " + ", ".join(f"{k} +{v}" for k, v in timed.items() if v)
                note = (note + "; " if note else "") + what
        elif c.get("error"):
            note = f"{c['status']}: {c['error'][:60]}"
        lines.append(
            f"| {c['mode']} | {c['batch']}x{c['prompt']} | {c['backend']} | {fmt(c.get('prefill_ms'))} | "
            f"{fmt(c.get('decode_ms_per_token'))} | {ratio(c.get('decode_vs_floor'))} | "
            f"{fmt(c.get('decode_wall_ms_per_token'))} | {note} |"
        )
    lines += ["", "auto vs the best Transformers backend in the same setting (lower is better for auto):", "",
              "| mode | bs x len | prefill auto / best (best) | decode auto / best (best) | decode wall auto / best |",
              "|---|---|---|---|---|"]
    for key, row in comparisons(result).items():
        lines.append(f"| {key[0]} | {key[1]}x{key[2]} | {row['prefill']} | {row['decode']} | {row['decode_wall']} |")
    return "\n".join(lines) + "\n"


def comparisons(result: dict) -> dict[tuple, dict[str, str]]:
    """Per (mode, batch, prompt): auto's time over the best Transformers backend's, for each metric."""
    out: dict[tuple, dict[str, str]] = {}
    groups: dict[tuple, list[dict]] = {}
    for c in result["cells"]:
        groups.setdefault((c["mode"], c["batch"], c["prompt"]), []).append(c)
    for key, cells in groups.items():
        auto = next((c for c in cells if c["backend"] == "auto" and c.get("status") == "ok"), None)
        peers = [c for c in cells if c["backend"] != "auto" and c.get("status") == "ok"]
        row: dict[str, str] = {}
        for metric, field in (("prefill", "prefill_ms"), ("decode", "decode_ms_per_token"),
                              ("decode_wall", "decode_wall_ms_per_token")):
            usable = [c for c in peers if c.get(field)]
            if auto is None or not auto.get(field) or not usable:
                row[metric] = "-"
                continue
            best = min(usable, key=lambda c: c[field])
            row[metric] = f"{auto[field] / best[field]:.2f}x ({best['backend']} {best[field]:.2f} ms)"
        out[key] = row
    return out


def build_plan(args: argparse.Namespace, settings: list[tuple[int, ...]]) -> list[tuple[str, str, int, int]]:
    """Cells in run order: uncompiled backends x settings, then compiled ones (auto and the first peer over every
    setting first, bs=1 first: the compiled decode target, then the rest)."""
    backends = [b for b in args.backends.split(",") if b]
    compiled = [b for b in args.compiled_backends.split(",") if b]
    plan: list[tuple[str, str, int, int]] = []
    for batch, length in settings:
        plan += [("uncompiled", b, batch, length) for b in backends]
    for tier in (compiled[:2], compiled[2:]):
        for batch, length in settings:
            plan += [("compiled", b, batch, length) for b in tier]
    return plan


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_generate.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "hf_generate.md").write_text(markdown(result))


def main() -> int:
    args = parse_args()
    if args.validate:
        os.environ["SELECTOR_VALIDATE"] = args.validate
    out = Path(args.out)
    device = torch.device(args.device if (args.device != "cuda" or torch.cuda.is_available()) else "cpu")
    dtype = getattr(torch, args.dtype)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    if hasattr(torch._dynamo.config, "cache_size_limit"):
        torch._dynamo.config.cache_size_limit = 64

    import transformers

    import selector
    import selector.hf as hf

    names = ensure_backends()
    hf.register_with_transformers()
    count_cudagraph_tree_recordings()
    settings = [tuple(int(x) for x in s.split("x")) for s in args.settings.split(",") if s]
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "triton": _version("triton"),
            "selector": selector.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "selector_backends": names,
            "selector_validate": os.environ.get("SELECTOR_VALIDATE", "default (values once per shape on GPUs)"),
        },
        "model": "random Qwen1.5-MoE-A2.7B shape" if not args.tiny else "tiny Qwen2-MoE (smoke test)",
        "dtype": args.dtype,
        "options": {"skip_module_guards": args.skip_module_guards, "fullgraph": args.fullgraph,
                    "compile_backend": args.compile_backend},
        "cells": [],
        "skipped": [],
    }
    log(f"building the model on {device} ({result['model']}, {args.dtype})")
    model, cfg = build_model(args, device, dtype)
    result["config"] = cfg
    result["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    log(f"model ready: {result['params_b']:.2f} B parameters")
    bw = measure_bandwidth(device)
    result["copy_bandwidth_tb_s"] = bw / 1e12 if bw else None
    report = hf.selection_report(model)
    result["auto_report"] = str(report)
    result["auto_report_json"] = report.to_dict()
    log("selection report:\n" + str(report))
    write(result, out)

    plan = build_plan(args, settings)
    can_compile = not args.no_compile and (device.type == "cuda" or args.compile_on_cpu)
    if not can_compile and any(mode == "compiled" for mode, *_ in plan):
        why = "--no-compile" if args.no_compile else "Transformers compiles generate() only on an accelerator"
        result["skipped"].append(f"compiled cells: {why}")
        plan = [item for item in plan if item[0] != "compiled"]

    # uncompiled cells of one setting are one group (their rounds interleave); each compiled cell is its own,
    # unless --interleave-compiled
    groups: list[list[tuple[str, str, int, int]]] = []
    together = {"uncompiled"} | ({"compiled"} if args.interleave_compiled else set())
    if args.interleave_compiled:
        if args.skip_module_guards:
            raise SystemExit("--interleave-compiled needs Dynamo's module guards: leave out --skip-module-guards")
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 8 * len(plan)))
    for item in plan:
        if item[0] in together and groups and groups[-1][0][0] == item[0] and groups[-1][0][2:] == item[2:]:
            groups[-1].append(item)
        else:
            groups.append([item])
    compiled_setting: tuple[int, int] | None = None
    for group in groups:
        left = args.budget_s - (time.perf_counter() - START)
        need = args.compiled_cell_s * len(group) if group[0][0] == "compiled" else 5.0 * len(group)
        if left < need:
            result["skipped"] += [f"{m} {b} {bs}x{ln}: time budget ({left:.0f}s left)" for m, b, bs, ln in group]
            continue
        if group[0][0] == "compiled" and group[0][2:] != compiled_setting:
            if compiled_setting is not None:
                reset_dynamo()  # else Dynamo compiles a second shape with dynamic shapes (automatic dynamic)
            compiled_setting = group[0][2:]
        runs = [CellRun(model, cfg, args, device, *item) for item in group]
        for run in runs:
            c = run.cell
            log(f"{c['mode']:10s} {c['backend']:10s} {c['batch']}x{c['prompt']} warm-up ...")
            run.warm()
        if len(runs) > 1 and group[0][0] == "compiled":
            # a later cell's reset (its compile failed, or fell back from fullgraph) dropped the graphs of the
            # cells warmed before it: warm those again, so that no timed round compiles
            for run in runs:
                if run.ok and run.warm_resets != _RESETS[0]:
                    log(f"compiled   {run.cell['backend']:10s} warm-up again (a later cell reset Dynamo)")
                    run.cell["warmed_again"] = True
                    run.warm()
            counts = compile_stats()
            for run in runs:
                run.timed_from = counts
        for _ in range(args.repeats):
            for run in runs:
                run.round()
        for run in runs:
            cell = run.finish(bw)
            log(f"  {cell['mode']} {cell['backend']} {cell['batch']}x{cell['prompt']} -> {cell.get('status')} prefill "
                f"{fmt(cell.get('prefill_ms'))} ms, decode {fmt(cell.get('decode_ms_per_token'))} ms/token "
                f"(wall {fmt(cell.get('decode_wall_ms_per_token'))}; {cell['cell_s']} s)")
            result["cells"].append(cell)
        write(result, out)
    model.set_experts_implementation("auto")
    result["total_s"] = time.perf_counter() - START
    write(result, out)
    if result["skipped"]:
        print("skipped: " + "; ".join(result["skipped"]))
    print(f"\n{result['model']}, {result['env']['device']}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; copy bandwidth {fmt(result['copy_bandwidth_tb_s'])} TB/s; "
          f"results in {out / 'hf_generate.json'}\n")
    print(markdown(result))
    return 0


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
