"""The lane check (tests/conftest.py): a passing test that carries no lane marker and whose call takes longer than
the fast lane's limit is named with the markers to add, and fails at LANE_FAIL_FACTOR times the limit; a marked one,
a quick one, or a check that is switched off passes unnamed."""

from __future__ import annotations

import pytest

import conftest


class LaneCheck:
    """The check's two hooks alone, without the rest of the conftest."""

    pytest_addoption = staticmethod(conftest.pytest_addoption)
    pytest_runtest_makereport = staticmethod(conftest.pytest_runtest_makereport)
    pytest_terminal_summary = staticmethod(conftest.pytest_terminal_summary)


def test_an_unmarked_test_over_the_limit_is_named_with_the_markers_to_add() -> None:
    message = conftest.lane_overrun("tests/test_x.py::test_y", ["parametrize", "gpu"], 6.2, 5.0)
    assert message is not None
    assert "tests/test_x.py::test_y took 6.2 s" in message
    for marker in ("@pytest.mark.interpreter", "@pytest.mark.compile", "@pytest.mark.slow"):
        assert marker in message


@pytest.mark.parametrize("marker", conftest.LANE_MARKERS)
def test_a_lane_marker_lets_a_test_take_its_time(marker: str) -> None:
    assert conftest.lane_overrun("t.py::t", [marker], 600.0, 5.0) is None


def test_a_quick_test_or_a_check_turned_off_passes() -> None:
    assert conftest.lane_overrun("t.py::t", [], 5.0, 5.0) is None
    assert conftest.lane_overrun("t.py::t", [], 60.0, 0.0) is None


def test_the_check_names_then_fails_in_a_pytest_of_its_own(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nmarkers =\n    interpreter: x\n    compile: x\n    slow: x\n")
    pytester.makepyfile(
        test_inner="""
        import time
        import pytest

        def test_unmarked_and_slow():
            time.sleep(0.6)

        def test_unmarked_and_a_little_slow():
            time.sleep(0.2)

        @pytest.mark.slow
        def test_marked_and_slow():
            time.sleep(0.3)

        def test_quick():
            pass
        """
    )
    result = pytester.runpytest_inprocess("--lane-limit=0.1", plugins=[LaneCheck()])
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*FAILURES*", "*test_unmarked_and_slow took * s, more than the fast lane's 0.1 s*"])
    result.stdout.fnmatch_lines(["*slow for the fast lane*", "*test_unmarked_and_a_little_slow took * s*"])
    assert "test_marked_and_slow took" not in result.stdout.str()


def test_the_limit_stretches_with_the_machines_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest.os, "getloadavg", lambda: (8.0, 8.0, 8.0))
    monkeypatch.setattr(conftest.os, "cpu_count", lambda: 2)
    assert conftest.load_factor() == 4.0
    monkeypatch.setattr(conftest.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert conftest.load_factor() == 1.0
