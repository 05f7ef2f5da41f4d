"""When selector.graphs records a call (CPU: a fake recording stands in for the CUDA graph)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from selector import graphs


@pytest.fixture
def module(fake_recordings):  # noqa: ANN001
    return torch.nn.Linear(2, 2)


@pytest.fixture
def made(fake_recordings) -> Callable[[], list[int]]:  # noqa: ANN001
    """The token count of each recording made so far (conftest's fake recording stands in for the CUDA graph)."""
    return lambda: [shapes[0][0] for shapes in fake_recordings]


def _call(module, tokens: int) -> torch.Tensor:  # noqa: ANN001
    x = torch.full((tokens, 2), 3.0)
    return graphs.replay(module, "test", ("shape", tokens), lambda a: a * 2, (x,))


def test_decode_sizes_record_on_first_use(module, made) -> None:  # noqa: ANN001
    assert torch.equal(_call(module, graphs.DECODE_TOKENS), torch.full((graphs.DECODE_TOKENS, 2), 6.0))
    _call(module, graphs.DECODE_TOKENS)
    assert made() == [graphs.DECODE_TOKENS]


def test_larger_calls_record_when_their_shape_comes_back(module, made) -> None:  # noqa: ANN001
    big = graphs.DECODE_TOKENS + 1
    assert torch.equal(_call(module, big), torch.full((big, 2), 6.0))  # direct, nothing recorded
    assert made() == []
    for _ in range(3):
        _call(module, big)
    assert made() == [big]  # recorded on the second call, replayed after


def test_one_off_sizes_never_record_and_are_forgotten(module, made) -> None:  # noqa: ANN001
    sizes = range(graphs.DECODE_TOKENS + 1, graphs.DECODE_TOKENS + 2 + graphs.SEEN_PER_MODULE)
    for tokens in sizes:
        _call(module, tokens)
    assert made() == [] and len(graphs.graphs_of(module, "test/seen")) == graphs.SEEN_PER_MODULE
    _call(module, sizes[0])  # forgotten (least recent beyond SEEN_PER_MODULE): direct again
    assert made() == []
    _call(module, sizes[-1])
    assert made() == [sizes[-1]]


def test_large_calls_run_direct_above_the_byte_cap(module, made) -> None:  # noqa: ANN001
    tokens = graphs.REPEAT_MAX_BYTES // 8 + 1  # two [T, 2] float32 buffers (input, output) above the cap
    for _ in range(3):
        out = _call(module, tokens)
    assert made() == [] and torch.equal(out, torch.full((tokens, 2), 6.0))


def test_input_copies_take_any_dtype_and_stride() -> None:
    """The replay's one-call copy into the recorded buffers: mixed dtypes, a transposed and a sliced source."""
    buffers = (torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2))
    values = (torch.randn(3, 4).t().to(torch.bfloat16), torch.arange(16).reshape(4, 4)[:, ::2], torch.rand(4, 2))
    graphs.copy_inputs(buffers, values)
    assert all(torch.equal(b, v) for b, v in zip(buffers, values))


def test_graphs_of_a_dead_module_live_until_the_next_replay(fake_recordings) -> None:  # noqa: ANN001
    """A module in a reference cycle dies whenever the garbage collector runs, possibly while someone captures a
    CUDA graph: its own graphs must not be destroyed then, only at the next replay (never inside a capture)."""
    import gc
    import weakref

    graphs.release_dead()
    doomed = torch.nn.Linear(2, 2)
    doomed.cycle = [doomed]  # collected by the garbage collector only, as a model in a cycle would be
    _call(doomed, 1)
    recording = next(iter(graphs.graphs_of(doomed, "test").values()))
    alive = weakref.ref(recording)
    del doomed, recording
    gc.collect()
    assert alive() is not None  # the module is gone, its recording kept
    survivor = torch.nn.Linear(2, 2)
    _call(survivor, 1)  # the next replay releases it
    assert alive() is None
    assert graphs.release_dead() == 0


def test_forgotten_graphs_are_released_at_the_next_replay(module, fake_recordings) -> None:  # noqa: ANN001
    import weakref

    graphs.release_dead()
    _call(module, 1)
    alive = weakref.ref(next(iter(graphs.graphs_of(module, "test").values())))
    graphs.forget(module)
    assert alive() is not None
    assert graphs.release_dead() == 1
    assert alive() is None


@pytest.mark.gpu
def test_a_dead_modules_recorded_graph_survives_someone_elses_capture() -> None:
    """The real case: a module whose own graph was recorded dies in a cycle while another graph is captured
    (the collector runs inside the capture); the capture must still succeed, the graph go at the next replay."""
    import gc
    import weakref

    from experts_fixtures import make_experts

    import selector

    m = make_experts(8, 64, 32, dtype=torch.bfloat16, device="cuda", seed=1).requires_grad_(False)
    selector.set_experts_implementation(m, "triton_fused")
    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3]], device="cuda")
    w = torch.full((2, 2), 0.5, device="cuda", dtype=torch.bfloat16)
    m(x, ids, w)
    (recorded,) = graphs.graphs_of(m, "triton_fused").values()  # recorded on first use at decode size
    alive = weakref.ref(recorded)
    m.__dict__["_cycle"] = [m]  # dies only when the collector runs
    del m, recorded
    graphs.release_dead()
    counter = torch.zeros(4, device="cuda")
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        counter.add_(1)
        gc.collect()  # the dead module's CUDA graph must not be destroyed here
        counter.add_(1)
    captured.replay()
    torch.cuda.synchronize()
    assert counter.tolist() == [2.0] * 4
    assert alive() is not None  # dead module, graph kept through the capture
    assert graphs.release_dead() >= 1  # (other tests' garbage may have died in that collection too)
    assert alive() is None


class _FakeGraph:
    """Stands in for a CUDA graph on the CPU: 'replays' by running the captured function again."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class _CpuRecordedCall(graphs.RecordedCall):
    """RecordedCall's own policy (static buffers, direct graphs on repeated addresses) with the CUDA mechanics
    faked: `record` and `capture` build fake graphs, `new_output` hands out the blocks a test chooses (as the
    caching allocator hands back a freed block of the same size)."""

    captures = 0

    def __init__(self, run, inputs, blocks: list[torch.Tensor]) -> None:  # noqa: ANN001
        self.blocks = blocks
        super().__init__(run, inputs)

    @staticmethod
    def record(run, buffers):  # noqa: ANN001, ANN205
        output = run(*buffers)
        return _FakeGraph(lambda: output.copy_(run(*buffers))), output

    def new_output(self) -> torch.Tensor:
        return self.blocks.pop(0) if self.blocks else torch.empty_like(self.output)

    def capture(self, fn):  # noqa: ANN001, ANN201
        type(self).captures += 1
        return _FakeGraph(fn)


def _double(a: torch.Tensor) -> torch.Tensor:
    return a * 2


def test_repeated_addresses_replay_a_graph_on_the_callers_tensors(monkeypatch) -> None:  # noqa: ANN001
    """Same input and output addresses twice in a row: recorded once more on them; from then on the replay reads
    the caller's tensor where it is (its new contents) and writes the block handed out, with no copy and no
    clone; the static buffers are not touched."""
    monkeypatch.setattr(_CpuRecordedCall, "captures", 0)
    x = torch.full((3, 2), 1.0)
    block = torch.empty(3, 2)
    call = _CpuRecordedCall(_double, (x,), blocks=[block] * 4)
    copies = []
    monkeypatch.setattr(graphs, "copy_inputs", lambda buffers, values: copies.append(1) or torch._foreach_copy_(buffers, values))
    first = call((x,), _double)  # addresses seen once: through the static buffers
    assert copies == [1] and first is not block and torch.equal(first, torch.full((3, 2), 2.0))
    x.fill_(5.0)
    second = call((x,), _double)  # the same addresses again: recorded on them
    assert _CpuRecordedCall.captures == 1 and second is block and torch.equal(second, torch.full((3, 2), 10.0))
    x.fill_(7.0)
    third = call((x,), _double)
    assert third is block and torch.equal(third, torch.full((3, 2), 14.0))
    assert copies == [1] and _CpuRecordedCall.captures == 1  # no copy in, no new recording
    assert torch.equal(call.inputs[0], torch.full((3, 2), 1.0))  # the static buffer still holds the first call's


def test_new_addresses_go_through_the_static_buffers(monkeypatch) -> None:  # noqa: ANN001
    """An input at another address (or an output block that differs) never replays a graph recorded elsewhere."""
    monkeypatch.setattr(_CpuRecordedCall, "captures", 0)
    x = torch.full((3, 2), 1.0)
    block = torch.empty(3, 2)
    call = _CpuRecordedCall(_double, (x,), blocks=[block] * 3)
    call((x,), _double)
    call((x,), _double)  # recorded on (x, block)
    y = torch.full((3, 2), 4.0)
    other = call((y,), _double)  # y sits elsewhere: static path, correct values
    assert _CpuRecordedCall.captures == 1 and torch.equal(other, torch.full((3, 2), 8.0))
    kept = call((x,), _double)  # x again with a fresh output block: not the recorded one
    assert torch.equal(kept, torch.full((3, 2), 2.0))


def test_addresses_that_never_settle_stop_recording(monkeypatch) -> None:  # noqa: ANN001
    """Each pair of equal calls at new addresses records one graph, up to DIRECT_RECORDINGS for the call; beyond,
    the static path; at most DIRECT_PER_CALL graphs are kept."""
    monkeypatch.setattr(_CpuRecordedCall, "captures", 0)
    x = torch.full((2, 2), 1.0)
    call = _CpuRecordedCall(_double, (x,), blocks=[])
    for i in range(graphs.DIRECT_RECORDINGS + 3):
        fresh = torch.full((2, 2), float(i))
        block = torch.empty(2, 2)
        call.blocks = [block, block]
        call((fresh,), _double)
        out = call((fresh,), _double)
        assert torch.equal(out, torch.full((2, 2), 2.0 * i))
    assert _CpuRecordedCall.captures == graphs.DIRECT_RECORDINGS
    assert len(call.direct) == graphs.DIRECT_PER_CALL


def test_addresses_alternating_between_two_blocks_settle_too(monkeypatch) -> None:  # noqa: ANN001
    """A loop whose output alternates between two blocks (the allocator hands back the one freed longest ago)
    records one graph per block and then replays without copies."""
    monkeypatch.setattr(_CpuRecordedCall, "captures", 0)
    x = torch.full((3, 2), 1.0)
    a, b = torch.empty(3, 2), torch.empty(3, 2)
    call = _CpuRecordedCall(_double, (x,), blocks=[a, b] * 4)
    outs = []
    for step in range(8):
        x.fill_(float(step))
        outs.append(call((x,), _double).clone())
    assert _CpuRecordedCall.captures == 2 and set(call.direct) == {graphs._addresses((x, a)), graphs._addresses((x, b))}
    assert all(torch.equal(out, torch.full((3, 2), 2.0 * step)) for step, out in enumerate(outs))


def test_direct_replays_switch_off(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("SELECTOR_DIRECT_REPLAYS", "0")
    monkeypatch.setattr(_CpuRecordedCall, "captures", 0)
    x = torch.full((3, 2), 1.0)
    block = torch.empty(3, 2)
    call = _CpuRecordedCall(_double, (x,), blocks=[block] * 3)
    for _ in range(3):
        out = call((x,), _double)
    assert _CpuRecordedCall.captures == 0 and out is not block and torch.equal(out, torch.full((3, 2), 2.0))


def test_the_graphs_weak_map_does_not_keep_a_module_alive(monkeypatch) -> None:  # noqa: ANN001
    """The recorded call keeps no reference to the call it replays, which holds the module: the module's graphs
    live in a weak map keyed by the module, so a reference from them would keep it alive for ever."""
    import gc
    import weakref

    class Inert(_CpuRecordedCall):  # fake graphs that hold nothing, as a real CUDA graph holds no Python object
        @staticmethod
        def record(run, buffers):  # noqa: ANN001, ANN205
            return _FakeGraph(lambda: None), run(*buffers)

        def capture(self, fn):  # noqa: ANN001, ANN201
            return _FakeGraph(lambda: None)

    monkeypatch.setattr(graphs, "RecordedCall", lambda run, inputs: Inert(run, inputs, blocks=[]))
    graphs.release_dead()
    doomed = torch.nn.Linear(2, 2)
    alive = weakref.ref(doomed)
    x = torch.ones(1, 2)
    for _ in range(3):
        graphs.replay(doomed, "test", ("shape", 1), lambda a, m=doomed: m.weight.detach().sum() * a, (x,))
    assert len(graphs.graphs_of(doomed, "test")) == 1
    del doomed
    gc.collect()
    assert alive() is None


def test_a_failed_recording_on_the_callers_addresses_keeps_the_copying_replay(monkeypatch) -> None:  # noqa: ANN001
    """Recording on the caller's addresses is an optimisation: if it fails the call still runs (the static
    buffers' replay), with a warning, and no such recording is tried again for that recorded call."""
    x = torch.full((3, 2), 1.0)
    block = torch.empty(3, 2)
    call = _CpuRecordedCall(_double, (x,), blocks=[block] * 4)

    def broken(fn):  # noqa: ANN001, ANN202
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(call, "capture", broken)
    call((x,), _double)
    with pytest.warns(RuntimeWarning, match="keeps the copying replay"):
        out = call((x,), _double)
    assert torch.equal(out, torch.full((3, 2), 2.0)) and out is not block
    assert call.direct_left == 0 and not call.direct
    assert torch.equal(call((x,), _double), torch.full((3, 2), 2.0))
