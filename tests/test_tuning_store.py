"""The tuning store: records kept in one SQLite file, safe against damage, other users' files and concurrent writers;
the `selector store` command."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from selector import tuning, tuning_store
from selector.cli import main
from selector.probes import collect_environment
from selector.tuning import Fingerprints
from selector.tuning_store import TuningStore, TuningStoreWarning
from selector.types import Problem

FP = "c" * 32  # the current fingerprint in these tests
OLD = "0" * 32  # another environment's
PROBLEM = Problem(num_experts=8, hidden_size=16, intermediate_size=8, top_k=2, num_tokens=4)
KEY = tuning.problem_key(PROBLEM)
GPU = "NVIDIA H200"


def _record(**changes: Any) -> dict[str, Any]:
    r = {"fingerprint": FP, "gpu": GPU, "problem": KEY, "mode": "eager", "tokens": 4, "backend": "grouped_mm",
         "time_s": 1e-4}  # fmt: skip
    r.update(changes)
    return r


def _here(env: object = None, registry: object = None) -> Fingerprints:
    """This process's fingerprints in these tests: FP for each backend the records name."""
    return Fingerprints({b: FP for b in ("grouped_mm", "triton_fused", "batched_mm", "eager")})


@pytest.fixture
def store(tmp_path: Path) -> TuningStore:
    return TuningStore(tmp_path / "cache" / "tuning.sqlite3")


def test_put_and_read_back(store: TuningStore) -> None:
    a = _record(spread=0.02, rounds=5, tool="test")
    b = _record(backend="triton_fused", time_s=3e-5, fingerprint=OLD)
    result = store.put([a, {**b, "unknown_field": 1}])
    assert (result.stored, result.refused) == (2, [])
    assert store.records() == [a, b]  # the unknown field is not kept
    assert store.records(FP) == [a]
    assert oct(store.path.parent.stat().st_mode & 0o777) == "0o700"  # the folder selector made
    assert oct(store.path.stat().st_mode & 0o777) == "0o600"


def test_reading_a_missing_store_creates_nothing(store: TuningStore) -> None:
    assert store.records() == [] and store.summary(FP).current == 0
    assert not store.path.parent.exists()


def test_a_later_record_replaces_an_earlier_one(store: TuningStore) -> None:
    store.put([_record(time_s=1e-4), _record(tokens=8)])
    store.put([_record(time_s=2e-4)])
    assert sorted((r["tokens"], r["time_s"]) for r in store.records()) == [(4, 2e-4), (8, 1e-4)]


@pytest.mark.parametrize(("bad", "reason"), [
    ({"time_s": None}, "missing field 'time_s'"),
    ({"time_s": "fast"}, "field 'time_s' is str"),
    ({"time_s": math.nan}, "field 'time_s' is not finite"),
])  # fmt: skip
def test_invalid_records_are_dropped_with_a_warning(store: TuningStore, bad: dict[str, Any], reason: str) -> None:
    record = {k: v for k, v in _record(tokens=8, **bad).items() if v is not None}
    with pytest.warns(TuningStoreWarning, match=reason):
        result = store.put([_record(), record])
    assert result.stored == 1 and len(result.refused) == 1 and reason in result.refused[0]
    assert store.records() == [_record()]


def test_stale_records_are_counted_and_never_in_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(tmp_path / "tuning.sqlite3"))
    monkeypatch.setattr(tuning_store, "DATA_DIR", tmp_path / "no-shipped-files")
    monkeypatch.setattr(tuning_store, "shared_tuning_records", lambda fingerprint=None: [])
    monkeypatch.setattr(tuning_store, "current_fingerprints", _here)
    result = tuning_store.save_records([
        _record(backend="grouped_mm", time_s=2e-4),
        _record(backend="triton_fused", time_s=1e-6, fingerprint=OLD),
        _record(backend="batched_mm", time_s=1e-6, fingerprint=OLD),
    ])  # fmt: skip
    assert result.stored == 3
    summary = tuning_store.default_store().summary(FP)
    assert (summary.current, summary.stale, summary.by_fingerprint) == (1, 2, {OLD: 2, FP: 1})
    assert [(p.gpu, p.problem, p.mode, p.tokens, p.backends) for p in summary.problems] == [
        (GPU, KEY, "eager", (4,), ("grouped_mm",))]
    table = tuning_store.tuning_table()
    assert (len(table), table.stale) == (1, 2)
    env = collect_environment({"SELECTOR_GPUS": f"{GPU}:9.0:141", "PATH": ""})
    measured = tuning_store.measured_for(PROBLEM, env)
    assert measured is not None and {b: m.time_s for b, m in measured.items()} == {"grouped_mm": 2e-4}


def test_known_records_shipped_then_store_then_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = tmp_path / "tuning_data"
    shipped.mkdir()
    tuning_store.write_export(shipped / "h200.json", [_record(time_s=9e-4), _record(backend="eager", time_s=5e-4)])
    (shipped / "broken.json").write_text("{not json")
    monkeypatch.setattr(tuning_store, "DATA_DIR", shipped)
    monkeypatch.setattr(tuning_store, "shared_tuning_records", lambda fingerprint=None: [_record(backend="eager", time_s=1e-5)])
    monkeypatch.setattr(tuning_store, "current_fingerprints", _here)
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(tmp_path / "tuning.sqlite3"))
    assert tuning_store.save_records([_record(time_s=2e-4)]).stored == 1
    with pytest.warns(TuningStoreWarning, match="shipped tuning file skipped: .*broken.json: not JSON"):
        table = tuning_store.tuning_table()
    env = collect_environment({"SELECTOR_GPUS": f"{GPU}:9.0:141", "PATH": ""})
    measured = tuning.measured_for(PROBLEM, env, table)
    assert measured is not None
    assert {b: m.time_s for b, m in measured.items()} == {"grouped_mm": 2e-4, "eager": 1e-5}  # later sources win


def test_export_then_import_into_a_fresh_store(store: TuningStore, tmp_path: Path) -> None:
    records = [_record(tokens=t, backend=b) for t in (1, 8, 64) for b in ("grouped_mm", "triton_fused")]
    store.put(records + [_record(fingerprint=OLD)])
    out = tmp_path / "export" / "tuning.json"
    out.parent.mkdir()
    assert store.export(out) == 7
    data = json.loads(out.read_text())
    assert data["schema"] == "selector.tuning/2" and len(data["records"]) == 7
    assert [p.name for p in out.parent.iterdir()] == ["tuning.json"]  # the temporary file was renamed, not left
    fresh = TuningStore(tmp_path / "other" / "tuning.sqlite3")
    result = fresh.import_file(out)
    assert (result.stored, result.refused) == (7, [])
    assert fresh.records() == store.records()
    assert store.export(out, fingerprint=OLD) == 1
    assert json.loads(out.read_text())["records"] == [_record(fingerprint=OLD)]


def test_import_of_a_file_that_is_not_an_export_raises(store: TuningStore, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "selector.tuning/1", "records": []}))
    with pytest.raises(ValueError, match="not a tuning export .*found 'selector.tuning/1'"):
        store.import_file(bad)
    with pytest.raises(ValueError, match="no such file"):
        store.import_file(tmp_path / "missing.json")


def _foreign_sqlite(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE measurements (name TEXT, value REAL)")
    conn.execute("INSERT INTO measurements VALUES ('x', 1.0)")
    conn.commit()
    conn.close()


def _other_version(path: Path) -> None:
    TuningStore(path).put([_record()])
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()


@pytest.mark.parametrize(("make", "what"), [
    (lambda p: p.write_bytes(os.urandom(4096)), "not a readable SQLite store"),
    (_foreign_sqlite, "other tables \\(measurements\\)"),
    (_other_version, "store version 99, expected 1"),
])  # fmt: skip
def test_a_damaged_store_is_moved_aside_and_rebuilt(tmp_path: Path, make: Any, what: str) -> None:
    path = tmp_path / "tuning.sqlite3"
    make(path)
    before = path.read_bytes()
    store = TuningStore(path)
    with pytest.warns(TuningStoreWarning, match=f"was damaged \\(.*{what}.*moved it to .*tuning.sqlite3.corrupt-"):
        assert store.records() == []
    (aside,) = tmp_path.glob("tuning.sqlite3.corrupt-*")
    assert aside.read_bytes() == before  # kept for a look, never overwritten
    assert store.put([_record()]).stored == 1 and store.records() == [_record()]


def test_a_symlinked_store_is_refused(tmp_path: Path) -> None:
    real = TuningStore(tmp_path / "real.sqlite3")
    real.put([_record()])
    link = tmp_path / "tuning.sqlite3"
    link.symlink_to(real.path)
    store = TuningStore(link)
    with pytest.warns(TuningStoreWarning, match="is a symlink; refusing it"):
        assert store.records() == []
    result = store.put([_record(tokens=8)])
    assert result.stored == 0 and "symlink" in result.refused[0]
    assert real.records() == [_record()]  # untouched


def test_another_users_store_is_refused(store: TuningStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store.put([_record()])
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    fresh = TuningStore(store.path)
    with pytest.warns(TuningStoreWarning, match="belongs to another user"):
        assert fresh.records() == []


def test_an_unusable_location_warns_once_and_refuses(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    store = TuningStore(tmp_path / "a-file" / "tuning.sqlite3")  # its folder cannot exist
    with pytest.warns(TuningStoreWarning, match="tuning store not used: .*set SELECTOR_TUNING_STORE") as caught:
        first = store.put([_record()])
        second = store.put([_record(tokens=8), _record(tokens=16)])
        assert store.records() == []
    assert len([w for w in caught if issubclass(w.category, TuningStoreWarning)]) == 1
    assert (first.stored, second.stored, len(second.refused)) == (0, 0, 2)
    assert "a-file" in second.refused[0]


def _writer(path: str, worker: int, count: int, barrier: Any) -> None:
    store = TuningStore(Path(path))
    barrier.wait()
    for i in range(count):  # one transaction per record: as many chances to collide as there are records
        result = store.put([_record(tokens=i + 1, backend=f"worker{worker}")])
        if result.stored != 1:
            raise SystemExit(f"record {i} not stored: {result.refused}")


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite3"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    workers = [ctx.Process(target=_writer, args=(str(path), n, 200, barrier)) for n in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [0, 0]
    records = TuningStore(path).records()
    assert len(records) == 400
    assert {(r["backend"], r["tokens"]) for r in records} == {(f"worker{n}", t) for n in (0, 1) for t in range(1, 201)}


def test_two_processes_finding_one_damaged_store_move_it_aside_once(tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite3"
    path.write_bytes(os.urandom(4096))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    workers = [ctx.Process(target=_writer, args=(str(path), n, 20, barrier)) for n in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [0, 0]
    assert len(list(tmp_path.glob("tuning.sqlite3.corrupt-*"))) == 1  # the second found the rebuilt store
    assert len(TuningStore(path).records()) == 40


def test_a_repair_that_comes_second_keeps_the_rebuilt_store(tmp_path: Path) -> None:
    """The race the test above meets only now and then, played in order: B found the damage before A rebuilt."""
    path = tmp_path / "tuning.sqlite3"
    path.write_bytes(os.urandom(4096))
    first, second = TuningStore(path), TuningStore(path)
    with pytest.warns(TuningStoreWarning, match="moved it to"):
        assert first.put([_record()]).stored == 1
    second._repair("found before the first rebuilt it")
    assert len(list(tmp_path.glob("tuning.sqlite3.corrupt-*"))) == 1 and second.records() == [_record()]


def _tuner(path: str, barrier: Any, measured: Any) -> None:
    """A fake tuner: measures (sleeps, then stores a record) only what the store does not have yet."""
    store = TuningStore(Path(path))
    barrier.wait()
    with store.measurement_lock("gpu-0", timeout_s=60) as got:
        if not got:
            raise SystemExit("lock not got")
        if not store.is_measured(FP, GPU, KEY, "eager", 4, ["grouped_mm"]):
            time.sleep(0.5)  # the other process arrives meanwhile and waits
            store.put([_record()])
            with measured.get_lock():
                measured.value += 1


def test_measurement_lock_makes_two_processes_measure_once(tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite3"
    ctx = multiprocessing.get_context("spawn")
    barrier, measured = ctx.Barrier(2), ctx.Value("i", 0)
    tuners = [ctx.Process(target=_tuner, args=(str(path), barrier, measured)) for _ in range(2)]
    for t in tuners:
        t.start()
    for t in tuners:
        t.join(120)
    assert [t.exitcode for t in tuners] == [0, 0]
    assert measured.value == 1
    assert TuningStore(path).records() == [_record()]


def test_measurement_lock_times_out_while_held(store: TuningStore) -> None:
    with store.measurement_lock("gpu 0/../x", timeout_s=1) as first:
        assert first
        start = time.monotonic()
        with store.measurement_lock("gpu 0/../x", timeout_s=0.2) as second:
            assert not second
        assert 0.15 < time.monotonic() - start < 2
    assert [p.name for p in (store.path.parent / "locks").iterdir()] == ["gpu_0_.._x.lock"]  # stays in the folder
    with store.measurement_lock("gpu 0/../x", timeout_s=0) as again:
        assert again  # released when the body ended


def test_unmeasured_names_what_a_tuner_still_has_to_time(store: TuningStore) -> None:
    store.put([_record(backend="grouped_mm"), _record(backend="eager", tokens=8)])
    args = (FP, GPU, KEY, "eager", 4)
    assert store.unmeasured(*args, ["grouped_mm", "triton_fused", "eager"]) == ["triton_fused", "eager"]
    assert store.is_measured(*args, ["grouped_mm"]) and not store.is_measured(*args, ["grouped_mm", "eager"])
    assert not store.is_measured(OLD, GPU, KEY, "eager", 4, ["grouped_mm"])


# --- the command ---------------------------------------------------------------------------------------------


@pytest.fixture
def cli_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "node" / "tuning.sqlite3"
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(path))
    monkeypatch.setattr(tuning_store, "current_fingerprints", _here)
    return path


def test_cli_show_export_import_clear(cli_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    TuningStore(cli_store).put([_record(), _record(tokens=64, backend="triton_fused"), _record(fingerprint=OLD)])
    assert main(["store", "show"]) == 0
    out = capsys.readouterr().out
    assert str(cli_store) in out and FP in out and "2 current, 1 stale" in out
    assert f"{GPU} {KEY} eager: 2 records, tokens 4,64, backends grouped_mm, triton_fused" in out

    assert main(["store", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["schema"], shown["current"], shown["stale"], shown["usable"]) == ("selector.store/2", 2, 1, True)
    assert shown["fingerprints"]["by_backend"]["grouped_mm"] == FP and shown["stale_by_backend"] == {"grouped_mm": 1}

    export = tmp_path / "shipped.json"
    assert main(["store", "export", str(export)]) == 0
    assert "exported 3 records" in capsys.readouterr().out
    assert main(["store", "clear", "--stale"]) == 0
    assert "removed 1 record from" in capsys.readouterr().out
    assert TuningStore(cli_store).summary(FP).stale == 0
    assert main(["store", "clear"]) == 0
    assert "removed 2 records" in capsys.readouterr().out
    assert main(["store", "import", str(export)]) == 0
    assert "stored 3, refused 0" in capsys.readouterr().out
    assert len(TuningStore(cli_store).records()) == 3


def test_cli_import_reports_refused_records(cli_store: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "mixed.json"
    bad = {k: v for k, v in _record(tokens=8).items() if k != "time_s"}
    file.write_text(json.dumps({"schema": "selector.tuning/2", "records": [_record(), bad]}))
    assert main(["store", "import", str(file)]) == 0
    out = capsys.readouterr().out
    assert "stored 1, refused 1" in out and "refused 1: missing field 'time_s'" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["store", "import", "{tmp}/missing.json"], "missing.json: no such file; give a file written by"),
    (["store", "export", "{tmp}/no/such/folder/x.json"], "no folder"),
    (["store", "export", "{tmp}"], "is a folder; give a file name"),
])  # fmt: skip
def test_cli_user_errors_are_one_line_exit_2(cli_store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             argv: list[str], message: str) -> None:
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err


def test_cli_show_of_an_unusable_store_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    real = TuningStore(tmp_path / "real.sqlite3")
    real.put([_record()])
    (tmp_path / "link.sqlite3").symlink_to(real.path)
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(tmp_path / "link.sqlite3"))
    monkeypatch.setattr(tuning_store, "current_fingerprints", _here)
    with pytest.warns(TuningStoreWarning):
        assert main(["store", "show"]) == 1
    assert "not usable:  " in capsys.readouterr().out


def test_store_path_follows_the_setting(tmp_path: Path) -> None:
    assert tuning_store.store_path({"SELECTOR_TUNING_STORE": str(tmp_path / "s.db")}) == tmp_path / "s.db"
    assert tuning_store.store_path({}).name == "tuning.sqlite3"
