"""The expert-parallel benchmark's logic: shapes, bytes moved, the summary and table, and one tiny run over gloo
ranks on the CPU (the same code the GPUs run over nccl)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selector.parallel import bench


def test_shapes_come_from_presets_or_five_fields() -> None:
    assert bench.parse_shape("deepseek-v3") == bench.Shape("deepseek-v3", 256, 7168, 2048, 8)
    assert bench.parse_shape("qwen3-30b-a3b").num_experts == 128
    assert bench.parse_shape("tiny:8:16:4:2") == bench.Shape("tiny", 8, 16, 4, 2)
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        bench.parse_shape("nope")
    with pytest.raises(ValueError, match="must be integers"):
        bench.parse_shape("tiny:8:x:4:2")
    with pytest.raises(ValueError, match="plain gated SwiGLU"):
        bench.parse_shape("gpt-oss-20b")


def test_bytes_sent_per_strategy() -> None:
    # rank 0 of 3: all_to_all sends 4 and 2 token rows to ranks 1 and 2 and gets 5 and 1 rows back to return
    exact = bench.sent_bytes("all_to_all", 0, 3, [9, 4, 2], [9, 5, 1], 10, 10, row_bytes=100, meta_bytes=10)
    assert exact == {"dispatch": 6 * 110, "combine": 6 * 100, "total": 1260}
    # padded: capacity rows to each of the 2 other ranks, and the same count of result rows back
    padded = bench.sent_bytes("all_to_all_padded", 0, 3, [], [], 10, 12, row_bytes=100, meta_bytes=10)
    assert padded == {"dispatch": 2 * 12 * 110, "combine": 2 * 12 * 100, "total": 5040}
    theirs = bench.sent_bytes("transformers", 1, 2, [3, 7], [2, 7], 5, 5, row_bytes=100, meta_bytes=10)
    assert theirs == {"dispatch": 300, "combine": 200, "total": 500}
    with pytest.raises(ValueError, match="no byte count for 'ring'"):
        bench.sent_bytes("ring", 0, 2, [], [], 1, 1, 1, 1)


def test_all_to_all_rows_count_each_token_once_per_owner() -> None:
    import torch

    index = torch.tensor([[0, 1], [0, 5], [6, 7]])  # 8 experts over 2 ranks: 0-3 on rank 0, 4-7 on rank 1
    assert bench.all_to_all_rows(index, per_rank=4, world=2) == [2, 2]


def _row(variant: str, rank: int, median: float, bandwidth: float | None = None) -> dict:
    return {"shape": "s", "tokens_per_rank": 4, "variant": variant, "rank": rank, "median_s": median,
            "min_s": median * 0.9, "max_s": median * 1.2, "bandwidth_Bps": bandwidth,
            "max_abs_diff_vs_all_to_all": None}  # fmt: skip


def test_summary_takes_the_slowest_rank_and_the_table_compares_with_transformers() -> None:
    rows = [
        _row("exchange:all_to_all", 0, 1e-4, 2e9), _row("exchange:all_to_all", 1, 2e-4, 1e9),
        _row("layer:all_to_all", 0, 3e-4), _row("layer:all_to_all", 1, 4e-4),
        _row("transformers:all_to_all", 0, 8e-4), _row("transformers:all_to_all", 1, 5e-4),
    ]
    summary = {s["variant"]: s for s in bench.summarise(rows)}
    assert summary["exchange:all_to_all"]["time_s"] == 2e-4
    assert summary["exchange:all_to_all"]["bandwidth_Bps_per_rank"] == [2e9, 1e9]
    assert summary["layer:all_to_all"]["spread"] == pytest.approx(0.3)
    table = bench.render_table(list(summary.values()), {"s T=4 layer:all_to_all_padded+graph": "no CUDA"})
    assert "0.50x" in table  # 400 µs against Transformers' 800 µs
    assert "2 1" in table  # GB/s per rank
    assert "not run: s T=4 layer:all_to_all_padded+graph: no CUDA" in table


@pytest.mark.slow
def test_a_tiny_gloo_run_times_every_variant_and_agrees_with_transformers(tmp_path: Path) -> None:
    out = tmp_path / "ep.json"
    code = bench.main(["--device", "cpu", "--world", "2", "--shape", "tiny:8:16:8:2", "--tokens", "1", "3",
                       "--rounds", "2", "--out", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["schema"] == bench.SCHEMA and report["errors"] == [] and report["world"] == 2
    variants = {s["variant"] for s in report["summary"]}
    expected = {"exchange:all_to_all", "exchange:all_to_all_padded", "layer:all_to_all", "layer:all_to_all_padded"}
    assert expected <= variants
    if report["transformers"] == "AllToAllEP":
        assert "transformers:all_to_all" in variants
    else:
        assert report["skipped"] and "transformers:all_to_all" not in variants
    assert len(report["rows"]) == 2 * 2 * len(variants)  # 2 ranks x 2 token counts
    for row in report["rows"]:
        assert row["median_s"] > 0 and row["rounds"] == 2
        if row["variant"].startswith("exchange:"):
            assert row["bytes_sent"]["total"] > 0 and row["bandwidth_Bps"] > 0
        if row["max_abs_diff_vs_all_to_all"] is not None:
            assert row["max_abs_diff_vs_all_to_all"] < 1e-5, row
    # padded at capacity T moves T rows each way to the other rank: 3 x (16 x 4 + 2 x (8 + 4)) + 3 x 16 x 4 bytes
    padded = next(r for r in report["rows"]
                  if r["variant"] == "exchange:all_to_all_padded" and r["tokens_per_rank"] == 3)  # fmt: skip
    assert padded["bytes_sent"] == {"dispatch": 3 * (64 + 24), "combine": 3 * 64, "total": 3 * 64 * 2 + 72}


def test_the_command_refuses_what_it_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "x.json")
    assert bench.main(["--device", "cpu", "--world", "3", "--shape", "tiny:8:16:8:2", "--out", out]) == 2
    assert "3 ranks cannot share 8 experts evenly" in capsys.readouterr().err
    assert bench.main(["--device", "cpu", "--shape", "tiny:8:16:8:2", "--tokens", "0", "--out", out]) == 2
    assert "--tokens and --rounds must be at least 1" in capsys.readouterr().err
