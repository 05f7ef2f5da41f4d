"""Recorded CUDA graphs for decode-sized and repeated calls: a backend's launches replayed as one graph.

At a handful of tokens a layer's kernels take tens of microseconds while launching them from Python takes
longer (on a slow host, up to a few hundred tokens: see DECODE_TOKENS / REPEAT_TOKENS). A backend records one
call per (module, shape) in a CUDA graph and replays it: the inputs are
copied into the graph's buffers, the graph replays, the output is cloned out (the caller may keep it). When the
same input and output addresses come back (a decode loop, a compiled model's buffers: the caching allocator hands
out the same blocks in the same order), a second graph recorded on those addresses replays with no copy in and no
clone out: one launch instead of five (see RecordedCall).
Graphs are kept beside the module in a weak map, not in it: a CUDA graph cannot be deep-copied, and users
copy models. Never used while torch.compile traces or while the caller captures its own graph; a compiled model
calls the layer through an opaque op that replays these graphs on the default stream only (`own_graphs`).
"""

from __future__ import annotations

import contextlib
import warnings
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
DIRECT_PER_CALL = 4  # graphs on the caller's own addresses per recorded call, least recently used beyond dropped
DIRECT_RECORDINGS = 8  # at most this many recorded per recorded call: addresses that never settle stop recording
SEEN_PER_MODULE = 16  # keys seen once (not recorded), remembered per module and backend, least recent dropped
_POOL: Any = None  # one memory pool for all graphs: they replay one after another on one stream
_GRAPHS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, OrderedDict]] = weakref.WeakKeyDictionary()
# Graphs of modules that died, kept until the next replay. A module in a reference cycle dies whenever the garbage
# collector runs, which may be while the caller (or torch.compile) captures a graph of its own; destroying a CUDA
# graph then invalidates that capture ("operation not permitted when stream is capturing").
_DEAD: list[dict[str, OrderedDict]] = []
_RECORDINGS = 0  # graphs recorded in this process: a decode loop that records more than once per shape is a bug
_DIRECT = [0, 0]  # graphs recorded on callers' addresses, and replays of them
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


def direct_counts() -> tuple[int, int]:
    """(graphs recorded on a caller's addresses, replays of them) in this process: how often a replay went
    without copies (see RecordedCall)."""
    return _DIRECT[0], _DIRECT[1]


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
    found = per_module.get(namespace)
    if found is None:
        found = per_module[namespace] = OrderedDict()
    return found


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


Signature = tuple[tuple[int, tuple[int, ...]], ...]


def _addresses(tensors: tuple[torch.Tensor, ...]) -> Signature:
    """Where each tensor's elements sit: what a graph recorded on them reads or writes."""
    return tuple([(t.data_ptr(), t.stride()) for t in tensors])  # a list first: half a generator's cost


class RecordedCall:
    """One captured call: static input buffers, the graph, its output buffer; and graphs of the same call recorded
    on the caller's own tensors, replayed while their addresses come back.

    A replay through the static buffers costs a copy in (one launch per input dtype) and a clone out besides the
    graph's launch: on a slow host each launch costs tens of microseconds, more than a decode step's kernels. When
    a call's input addresses and the address the allocator gives its output are those of the call before, the
    same call is recorded once more, on those addresses, with the result written into that output; from then on a
    call whose addresses match replays that graph alone. "The call before" is any of the last few calls: a loop
    whose blocks alternate between two addresses settles too. It reads the caller's tensors where they are (alive, being
    passed in) and writes into a tensor just allocated for this call, so nothing the caller holds is overwritten.
    Holding only addresses, never the tensors, leaves the allocator free to hand the same blocks out again.
    """

    def __init__(self, run: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> None:
        global _RECORDINGS
        self.inputs = tuple(t.clone() for t in inputs)
        self.graph, self.output = self.record(run, self.inputs)
        _RECORDINGS += 1  # counted once captured: a capture that raised recorded nothing
        self.direct: OrderedDict[Signature, Any] = OrderedDict()
        self.direct_left = DIRECT_RECORDINGS if settings.get("SELECTOR_DIRECT_REPLAYS") else 0
        self.seen: OrderedDict[Signature, None] = OrderedDict()  # recent addresses without a graph of their own

    @staticmethod
    def record(run: Callable[..., torch.Tensor], buffers: tuple[torch.Tensor, ...]) -> tuple[Any, torch.Tensor]:
        """(graph, output buffer) of run(*buffers): a warm-up on a side stream (kernels compile outside the
        capture), then the capture, in the pool all graphs share (they replay one after another on one stream)."""
        global _POOL
        if _POOL is None:
            _POOL = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=buffers[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(*buffers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=_POOL):
            output = run(*buffers)
        return graph, output

    def new_output(self) -> torch.Tensor:
        """A fresh tensor shaped like the output, from the allocator only (no launch)."""
        return torch.empty_like(self.output)

    def __call__(self, inputs: tuple[torch.Tensor, ...], run: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The recorded call on `inputs`; `run` is the call itself (passed each time, never kept: it may hold the
        module, which the weak map of graphs must not keep alive)."""
        if self.direct_left or self.direct:
            out = self.new_output()
            signature = _addresses((*inputs, out))
            graph = self.direct.get(signature)
            if graph is None and self.direct_left:
                if signature in self.seen:
                    del self.seen[signature]
                    try:
                        graph = self.record_direct(run, inputs, out, signature)
                    except RuntimeError as exc:  # an optimisation only: the static buffers still work
                        self.direct_left = 0
                        warnings.warn(f"selector: recording a replay on the caller's addresses failed ({exc}); "
                                      "this call keeps the copying replay", RuntimeWarning, stacklevel=2)  # fmt: skip
                else:
                    self.seen[signature] = None
                    while len(self.seen) > DIRECT_PER_CALL:
                        self.seen.popitem(last=False)
            if graph is not None:
                self.direct.move_to_end(signature)
                graph.replay()
                _DIRECT[1] += 1
                return out
        copy_inputs(self.inputs, inputs)
        self.graph.replay()
        return self.output.clone()

    def record_direct(
        self, run: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], out: torch.Tensor,
        signature: Signature,
    ) -> Any:
        """The call recorded on the caller's addresses, its result copied into `out` inside the graph."""
        self.direct_left -= 1
        graph = self.capture(lambda: out.copy_(run(*inputs)))
        _DIRECT[0] += 1
        self.direct[signature] = graph
        while len(self.direct) > DIRECT_PER_CALL:
            self.direct.popitem(last=False)
        return graph

    def capture(self, fn: Callable[[], Any]) -> Any:
        """fn's launches captured into a graph in the shared pool, on a side stream. Unlike `torch.cuda.graph`, no
        device sync and no emptying of the allocator's cache: the kernels are warm (this call was recorded
        before), and an emptied cache would move the very addresses this graph is recorded on."""
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device=self.output.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.capture_begin(pool=_POOL)
            try:
                fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        return graph


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
    return recorded(inputs, run)


def forget(module: torch.nn.Module) -> None:
    """Drop every recorded graph of a module (its weights changed format), destroyed at the next replay."""
    per_module = _GRAPHS.pop(module, None)
    if per_module is not None:
        _DEAD.append(dict(per_module))
        per_module.clear()  # the module's finalizer holds this dict until the module dies
