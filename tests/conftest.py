"""Shared test setup: the Triton interpreter switch, the GPU skips, the lane check, and the selection state every
test starts from.

Triton's interpreter must be switched on before triton is imported, so it is set here, once, and only on
machines without a usable CUDA device: on the GPU machine the same tests run the compiled kernels.

Lanes: a test carries its lane marker where it stands (`pytestmark` for a whole file, a decorator on one test):
`interpreter` (runs Triton kernels: the interpreter on a CPU, compiled kernels on a GPU), `compile` (torch.compile or
Dynamo), `slow` (seconds on a CPU for another reason). The fast lane is `-m "not interpreter and not compile and not
slow"`, the rest `-m "interpreter or compile or slow"`. On a machine without CUDA a passing test with none of the
three whose call takes longer than LANE_LIMIT_S is named in the run's summary with the marker to add, and one that
takes LANE_FAIL_FACTOR times as long fails, so the fast lane stays fast while a slow or shared CI machine's noise
(a 0.06 s test once took 7.6 s there) names a test instead of failing the run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from selector.probes import Environment
    from selector.registry import Registry

pytest_plugins = ["pytester"]  # tests/test_lanes.py runs the lane check in a pytest of its own


def _cuda_present() -> bool:
    # Cheap and without importing torch: a CUDA box has the driver's device nodes or nvidia-smi.
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

LANE_MARKERS = ("interpreter", "compile", "slow")
# The longest call a test of the fast lane may take on a 2-core CPU. Off where CUDA is: there the first call of a
# kernel builds it from a cold cache, and the GPU lanes are chosen with `gpu` and `slow`.
LANE_LIMIT_S = 5.0
LANE_FAIL_FACTOR = 4.0
LANE_PROPERTY = "lane_overrun"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lane-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"name a passing test that carries none of the markers {', '.join(LANE_MARKERS)} and whose call takes "
        f"longer, fail it at {LANE_FAIL_FACTOR:g} times as long (default: {LANE_LIMIT_S:g} without CUDA, off with it; "
        "0 turns it off)",
    )


def load_factor() -> float:
    """How many times busier than its cores the machine was over the last minute (at least 1): on a machine shared
    with other work a test's wall time stretches by about that much, and the lane limit with it, so the check names
    slow tests, not a busy machine."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:
        return 1.0


def lane_overrun(nodeid: str, markers: Iterable[str], seconds: float, limit: float) -> str | None:
    """Why a test whose call took `seconds` does not belong in the fast lane, or None where it does."""
    if limit <= 0 or seconds <= limit or set(markers) & set(LANE_MARKERS):
        return None
    return (
        f"{nodeid} took {seconds:.1f} s, more than the fast lane's {limit:g} s, and carries none of the lane markers. "
        "Mark it where it stands: @pytest.mark.interpreter if it runs Triton kernels, @pytest.mark.compile if it "
        "calls torch.compile or Dynamo, else @pytest.mark.slow (a whole file: pytestmark = pytest.mark.<name>)."
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" and report.passed:
        limit = item.config.getoption("--lane-limit")
        if limit is None:
            limit = 0.0 if _cuda_present() else LANE_LIMIT_S * load_factor()
        message = lane_overrun(item.nodeid, (m.name for m in item.iter_markers()), call.duration, limit)
        if message is not None and call.duration > limit * LANE_FAIL_FACTOR:
            report.outcome = "failed"
            report.longrepr = message
        elif message is not None:
            report.user_properties.append((LANE_PROPERTY, message))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # The reports come back from xdist's workers with their user properties, so the controller lists them all.
    named = [
        value
        for report in terminalreporter.stats.get("passed", [])
        for key, value in getattr(report, "user_properties", ())
        if key == LANE_PROPERTY
    ]
    if named:
        terminalreporter.section("slow for the fast lane")
        for message in named:
            terminalreporter.line(message)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    has_cuda = torch.cuda.is_available()
    cc = torch.cuda.get_device_capability() if has_cuda else (0, 0)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_sm90 = pytest.mark.skip(reason="needs compute capability >= 9.0")
    for item in items:
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
    """No test reads or writes the user's own tuning store or cache folder (tile tables, the plugin check's verdicts)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SELECTOR_TUNING_STORE", str(tmp_path_factory.mktemp("store") / "tuning.sqlite3"))
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
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
