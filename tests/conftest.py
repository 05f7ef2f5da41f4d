"""Shared test setup: the Triton interpreter switch, the lanes' markers, and the selection state every test starts from.

Triton's interpreter must be switched on before triton is imported, so it is set here, once, and only on
machines without a usable CUDA device: on the GPU machine the same tests run the compiled kernels.

Lanes: the fast lane is `-m "not interpreter and not compile and not slow"`, the rest `-m "interpreter or compile or
slow"`. The markers are given here by module and by name, so a test file need not carry them itself.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from selector.probes import Environment
    from selector.registry import Registry


def _cuda_present() -> bool:
    # Cheap and without importing torch: a CUDA box has the driver's device nodes or nvidia-smi.
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Files whose tests run Triton kernels; on a CPU that is the interpreter, slow at any size.
INTERPRETER_FILES = frozenset({
    "test_triton_fused_kernels.py", "test_triton_fused_graphs.py", "test_quant.py", "test_quant_grouped.py",
    "test_quant_tune.py", "test_tile_tuning_kernels.py", "test_gates_kernels.py",
})  # fmt: skip
# Fixtures that register the real Triton adapter as a CPU backend, so its kernels run in the interpreter.
INTERPRETER_FIXTURES = frozenset({"fused_cpu", "guard_interpreter"})
# Files where every test traces with torch.compile / Dynamo.
COMPILE_FILES = frozenset({"test_hf_compile_decode.py", "test_hf_guards.py"})
# Files and tests measured at a second or more each on a 2-core CPU (`--durations`) that neither run kernels in the
# interpreter nor compile: subprocesses, tiny models end to end, quantising on the CPU.
SLOW_FILES = frozenset({"test_hf_generate_script.py", "test_hf_generate_bench.py", "test_expert_parallel.py",
                        "test_compile_hf_generate.py"})
SLOW_TESTS = frozenset({
    "test_bench.py::test_format_layers_and_their_floor_bytes",
    "test_cli.py::test_required_backend_that_cannot_run_exits_1",
    "test_daemon.py::test_cli_start_status_stop",
    "test_daemon_reliability.py::test_32_concurrent_clients_lose_nothing",
    "test_daemon_reliability.py::test_slow_daemons_cost_a_client_at_most_its_deadline",
    "test_daemon_reliability.py::test_truncated_and_dripped_requests_are_dropped_and_the_daemon_lives",
    "test_hub_backends.py::test_deepgemm_quantised_forward_guards",
    "test_hub_backends.py::test_deepgemm_quantised_matches_reference",
    "test_hub_backends.py::test_deepgemm_runs_an_earlier_release_api_on_hopper",
    "test_gpu_kernels_real.py::test_sonicmoe_kernel_dir_loads_through_kernels",
    "test_hub_backends.py::test_kernels_itself_loads_what_locate_calls_cached",
    "test_hub_backends.py::test_megamoe_call_path_against_fake",
    "test_parallel_bench.py::test_a_tiny_gloo_run_times_every_variant_and_agrees_with_transformers",
    "test_tile_tuning.py::test_cli_without_triton_prints_one_line",
    "test_hub_backends.py::test_megamoe_forward_refuses_missing_group_and_wrong_weights",
    "test_transformers_integration.py::test_backends_match_eager_logits_and_greedy_tokens",
    "test_transformers_integration.py::test_decode_swap_on_accelerator_and_restore",
    "test_transformers_integration.py::test_quantized_explicit_name_runs_or_fails_loudly",
    "test_tune.py::test_a_cpu_run_measures_tunes_saves_and_plans",
})


_COMPILES = re.compile(r"torch\.compile\b|torch\._dynamo\b|\b_?compiled?_\w+\(")


@functools.cache
def _source_compiles(function: Callable[..., object]) -> bool:
    try:
        return _COMPILES.search(inspect.getsource(function)) is not None
    except (OSError, TypeError):
        return False


def _uses_compile(item: pytest.Item) -> bool:
    """torch.compile / Dynamo / a `compile_*` / `_compiled_*` helper called in the test body, a fixture named for
    compiling, or `torch_compile` in the name. ("compiles" alone in a name is often a hub kernel's JIT build.)"""
    function = getattr(item, "function", None)
    fixtures = getattr(item, "fixturenames", ())
    return (
        "torch_compile" in item.name
        or any("compile" in name for name in fixtures)
        or (function is not None and _source_compiles(function))
    )


def lane_markers(item: pytest.Item) -> set[str]:
    """The lane markers an item gets from its file, its fixtures and its name."""
    file = Path(str(item.fspath)).name
    key = f"{file}::{getattr(item, 'originalname', item.name)}"
    fixtures = set(getattr(item, "fixturenames", ()))
    marks: set[str] = set()
    if INTERPRETER and (file in INTERPRETER_FILES or fixtures & INTERPRETER_FIXTURES):
        marks.add("interpreter")
    if file in COMPILE_FILES or _uses_compile(item):
        marks.add("compile")
    if file in SLOW_FILES or key in SLOW_TESTS:
        marks.add("slow")
    return marks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    has_cuda = torch.cuda.is_available()
    cc = torch.cuda.get_device_capability() if has_cuda else (0, 0)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_sm90 = pytest.mark.skip(reason="needs compute capability >= 9.0")
    for item in items:
        for name in sorted(lane_markers(item) - set(item.keywords)):
            item.add_marker(name)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "sm90" in item.keywords and cc < (9, 0):
            item.add_marker(skip_sm90)


@pytest.fixture(scope="session")
def _probed_environment() -> Environment:
    """This machine's probe facts, probed once for the session (as the process would)."""
    from selector.environment import current_environment

    return current_environment()


@pytest.fixture(autouse=True, scope="session")
def _private_tuning_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test reads or writes the user's own tuning store."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SELECTOR_TUNING_STORE", str(tmp_path_factory.mktemp("store") / "tuning.sqlite3"))
        yield


@pytest.fixture(autouse=True)
def _fresh_selection_state(_probed_environment: Environment, request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test starts from the process's own state: no cached registry, config, verdicts, picks or measured
    timings, no probe facts a test before it injected (`set_environment`), no unreported routing fault. A GPU test
    also starts with the garbage of the tests before it collected: a CUDA graph left in a reference cycle (a test's
    frame kept by `pytest.raises`) would otherwise be destroyed whenever the collector runs, inside a capture too."""
    from selector import guard, tuning_store
    from selector.dispatch import reset_selection_caches
    from selector.environment import current_environment, set_environment

    if request.node.get_closest_marker("gpu") is not None:
        import gc

        gc.collect()
    reset_selection_caches()
    guard.clear()  # no routing fault a test before left unreported
    yield
    if current_environment() is not _probed_environment:  # injected, or forgotten and probed again
        set_environment(_probed_environment)
    tuning_store.reload()
    reset_selection_caches()


RegisterPlugins = Callable[..., "Registry"]


@pytest.fixture
def fresh_registry() -> Iterator[RegisterPlugins]:
    """`fresh_registry(plugin, ..., name=plugin, ...)` registers plugins for this test only and returns the
    registry dispatch now resolves against; the plugins are unregistered and the caches reset after the test.
    A positional plugin is named by its `__name__`; a keyword gives the name."""
    from selector.dispatch import get_backend_registry, reset_selection_caches
    from selector.registry import register_plugin, unregister_plugin

    names: list[str] = []

    def register(*plugins: object, **named: object) -> Registry:
        for plugin in plugins:
            named.setdefault(getattr(plugin, "__name__"), plugin)
        for name, plugin in named.items():
            register_plugin(plugin, name=name)
            names.append(name)
        reset_selection_caches()
        return get_backend_registry()

    try:
        yield register
    finally:
        for name in reversed(names):
            unregister_plugin(name)
        reset_selection_caches()


@pytest.fixture
def fake_recordings(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], ...]]:
    """CUDA graph recording faked for the CPU: `selector.graphs` records with a stand-in that 'replays' by running
    the call again. Returns the input shapes of every recording made, in order."""
    from selector import graphs

    made: list[tuple[tuple[int, ...], ...]] = []

    class FakeRecording:
        def __init__(self, run: Callable[..., object], inputs: tuple) -> None:
            self.run = run
            made.append(tuple(tuple(t.shape) for t in inputs))

        def __call__(self, inputs: tuple, run: Callable[..., object]) -> object:
            return self.run(*inputs)

    monkeypatch.setattr(graphs, "RecordedCall", FakeRecording)
    return made
