"""Recorded CUDA graphs for decode-sized and repeated calls: a backend's launches replayed as one graph.

At a handful of tokens a layer's kernels take tens of microseconds while launching them from Python takes
longer (on a slow host, up to a few hundred tokens: see DECODE_TOKENS / REPEAT_TOKENS). A backend records one
call per (module, shape) in a CUDA graph and replays it: the inputs are
copied into the graph's buffers, the graph replays, the output is cloned out (the caller may keep it).
Graphs are kept beside the module in a weak map, not in it: a CUDA graph cannot be deep-copied, and users
copy models. Never used while torch.compile traces or while the caller captures its own graph; a compiled model
calls the layer through an opaque op that replays these graphs on the default stream only (`own_graphs`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from selector import settings

GRAPHS_PER_MODULE = 8  # least recently used graphs beyond this are dropped
# Up to DECODE_TOKENS a call is recorded on first use. Above, up to REPEAT_TOKENS, only when its shape comes back
# (the second call with the same key): one launch from Python costs 40-60 us on the H200 machine's host, so a
# few hundred tokens' kernels still take less time than launching them (Qwen3 fp8, T=512: 775 us to issue the
# call, 240 us of kernels), while a prefill size seen once would pay a recording (a sync and a warm-up) for nothing.
DECODE_TOKENS = 64
REPEAT_TOKENS = 4096
REPEAT_MAX_BYTES = 16 << 20  # and only while its buffers (inputs, and an output like x) stay this small: a
# graph keeps them for as long as it lives, per layer (Qwen3 T=512: 4 MiB; DeepSeek T=4096: 117 MB, GPU-bound anyway)
SEEN_PER_MODULE = 16  # keys seen once (not recorded), remembered per module and backend, least recent dropped
_POOL: Any = None  # one memory pool for all graphs: they replay one after another on one stream
_GRAPHS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, OrderedDict]] = weakref.WeakKeyDictionary()
# Graphs of modules that died, kept until the next replay. A module in a reference cycle dies whenever the garbage
# collector runs, which may be while the caller (or torch.compile) captures a graph of its own; destroying a CUDA
# graph then invalidates that capture ("operation not permitted when stream is capturing").
_DEAD: list[dict[str, OrderedDict]] = []
_RECORDINGS = 0  # graphs recorded in this process: a decode loop that records more than once per shape is a bug
_SUPPRESSED = 0  # > 0 while `own_graphs(False)` is active: backends launch directly


@contextlib.contextmanager
def own_graphs(allowed: bool) -> Iterator[None]:
    """Within the block, backends record and replay their own graphs only if `allowed` (and as graphs_enabled says).

    The compiled path turns them off where a caller's graph machinery owns the stream: torch.compile's CUDA-graph
    modes warm a graph up on a side stream, routing every allocation of the thread into their own memory pool,
    and a graph recorded there would share that pool with theirs.
    """
    global _SUPPRESSED
    if allowed:
        yield
        return
    _SUPPRESSED += 1
    try:
        yield
    finally:
        _SUPPRESSED -= 1


def recordings() -> int:
    """How many graphs this process has recorded (each costs a device sync and a warm-up run: see RecordedCall)."""
    return _RECORDINGS


def graphs_enabled(x: torch.Tensor, max_tokens: int, variable: str) -> bool:
    """Small CUDA calls, outside torch.compile and outside a caller's capture, unless `variable`=0."""
    # is_compiling() first: while torch.compile traces nothing else is read (the environment lookup would
    # add guards that the compiled model checks on every call)
    return (
        not torch.compiler.is_compiling()
        and not _SUPPRESSED
        and x.is_cuda
        and 0 < x.shape[0] <= max_tokens
        and settings.get(variable)
        and not torch.cuda.is_current_stream_capturing()
    )


def graphs_of(module: torch.nn.Module, namespace: str) -> OrderedDict:
    """One backend's recorded graphs for one module, least recently used first."""
    per_module = _GRAPHS.get(module)
    if per_module is None:
        per_module = _GRAPHS[module] = {}
        weakref.finalize(module, _DEAD.append, per_module)  # outlives the module until release_dead()
    return per_module.setdefault(namespace, OrderedDict())


def release_dead() -> int:
    """Destroy the graphs of modules that died since the last call; how many modules' graphs that was. Runs at the
    start of every replay (never inside a capture: replay is not used while the stream captures)."""
    count = len(_DEAD)
    if count:
        _DEAD.clear()
    return count


def copy_inputs(buffers: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...]) -> None:
    """buffer.copy_(value) for each pair (any dtypes, any strides), in one call from Python."""
    torch._foreach_copy_(buffers, values)


class RecordedCall:
    """One captured call: static input buffers, the graph, its output buffer."""

    def __init__(self, run: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> None:
        global _POOL, _RECORDINGS
        if _POOL is None:
            _POOL = torch.cuda.graph_pool_handle()
        self.inputs = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream(device=inputs[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
            run(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=_POOL):
            self.output = run(*self.inputs)
        _RECORDINGS += 1  # counted once captured: a capture that raised recorded nothing

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        copy_inputs(self.inputs, inputs)
        self.graph.replay()
        return self.output.clone()


def replay(
    module: torch.nn.Module,
    namespace: str,
    key: Hashable,
    run: Callable[..., torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """run(*inputs) through a graph recorded for `key` (which must capture every shape/pointer): on its first use
    up to DECODE_TOKENS tokens (inputs[0].shape[0]), on its second above that (within REPEAT_MAX_BYTES); until
    then, and above the bytes, run(*inputs) directly."""
    if _DEAD:
        release_dead()
    graphs = graphs_of(module, namespace)
    recorded = graphs.get(key)
    if recorded is None and inputs[0].shape[0] > DECODE_TOKENS:
        if sum(t.nbytes for t in inputs) + inputs[0].nbytes > REPEAT_MAX_BYTES:
            return run(*inputs)
        seen = graphs_of(module, namespace + "/seen")
        if key not in seen:
            seen[key] = True
            while len(seen) > SEEN_PER_MODULE:
                seen.popitem(last=False)
            return run(*inputs)
        del seen[key]
    if recorded is None:
        recorded = graphs[key] = RecordedCall(run, inputs)
        while len(graphs) > GRAPHS_PER_MODULE:
            graphs.popitem(last=False)
    graphs.move_to_end(key)
    return recorded(inputs)


def forget(module: torch.nn.Module) -> None:
    """Drop every recorded graph of a module (its weights changed format), destroyed at the next replay."""
    per_module = _GRAPHS.pop(module, None)
    if per_module is not None:
        _DEAD.append(dict(per_module))
        per_module.clear()  # the module's finalizer holds this dict until the module dies
