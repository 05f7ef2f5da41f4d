"""The tile heuristic for layers no table holds (plugins/triton_fused/nearest.py, `configs.nearest_config`) and the
command that makes the shipped tables (`tune.tune_table`): fake GPU names, capabilities and table folders in
tmp_path, a fake search in place of the GPU timings (the real search runs in test_tile_tuning_kernels.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from selector.plugins import tile_tables
from selector.plugins.triton_fused import configs as C
from selector.plugins.triton_fused import nearest as N
from selector.plugins.triton_fused import tune as TU

from selector.presets import HELD_OUT_PRESETS, PRESETS, tabled_presets

CUDA = torch.device("cuda", 0)
GPU = "NVIDIA H100 80GB HBM3"


def _cfg(block_m: int, bn: int = 64) -> dict:
    return {"BLOCK_M": block_m, "gate_up": {"BLOCK_N": bn, "BLOCK_K": 64}, "down": {"BLOCK_N": bn, "BLOCK_K": 64}}


def _table(folder: Path, device: str, configs: dict, **header) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"version": 1, "device": device, "configs": configs, **header}
    (folder / C.config_file_name(device)).write_text(json.dumps(doc))
    C.clear_caches()


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fake Hopper GPU with empty shipped and user table folders; returns (shipped, user, set_gpu)."""
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    shipped.mkdir()
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_CONFIG_DIR", str(shipped))
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", str(user))

    def set_gpu(name: str, capability: tuple[int, int] = (9, 0), sms: int = 132) -> None:
        monkeypatch.setattr(C, "_device_name", lambda index: name)
        monkeypatch.setattr(C, "_capability", lambda index: capability)
        monkeypatch.setattr(C, "_num_sms", lambda index: sms)
        C.clear_caches()

    set_gpu(GPU)
    yield shipped, user, set_gpu
    C.clear_caches()


def test_keys_parse_back_to_layers() -> None:
    assert N.parse_key(C.shape_key(60, 2048, 1408, 4)) == N.Layer(60, 2048, 1408, 4)
    key = C.layout_key(C.shape_key(32, 2880, 2880, 4), transposed=True, interleaved=True)
    assert N.parse_key(key) == N.Layer(32, 2880, 2880, 4, True, True)
    assert N.parse_key("E=8,H=x,I=1,k=1") is None and N.parse_key("nonsense") is None
    assert N.parse_key("E=0,H=1,I=1,k=1") is None


def test_the_cell_with_the_nearest_rows_per_expert_wins() -> None:
    # Qwen3-30B-like at T=4096 sees 256 rows per expert; a table with 64-row and 256-row cells of other shapes
    table = {
        C.shape_key(64, 2048, 1024, 8): {512: _cfg(64), 4096: _cfg(128)},  # 64 and 512 rows per expert
        C.shape_key(8, 4096, 14336, 2): {512: _cfg(32)},  # 128 rows, far larger GEMMs
    }
    key, tokens, cfg = N.nearest_cell([table], N.Layer(128, 2048, 768, 8), 4096, pair_max_tokens=1,
                                      token_down_min_i=2048)  # fmt: skip
    assert (key, tokens, cfg["BLOCK_M"]) == (C.shape_key(64, 2048, 1024, 8), 4096, 128)
    key, tokens, _ = N.nearest_cell([table], N.Layer(128, 2048, 768, 8), 512, pair_max_tokens=1, token_down_min_i=2048)
    assert tokens == 512 and key == C.shape_key(64, 2048, 1024, 8)


def test_one_token_borrows_only_from_cells_that_run_the_same_kernels() -> None:
    table = {
        C.shape_key(8, 4096, 14336, 2): {1: _cfg(16, 32)},  # down as one K loop per token (I >= 2048)
        C.shape_key(128, 2048, 768, 8): {1: _cfg(16, 64), 8: _cfg(16, 128)},  # pair blocks; 8 tokens: sorted
    }
    got = N.nearest_cell([table], N.Layer(16, 4096, 6400, 2), 1, pair_max_tokens=1, token_down_min_i=2048)
    assert got[0] == C.shape_key(8, 4096, 14336, 2)
    got = N.nearest_cell([table], N.Layer(64, 2048, 1024, 8), 1, pair_max_tokens=1, token_down_min_i=2048)
    assert got[:2] == (C.shape_key(128, 2048, 768, 8), 1)
    # many tokens never take a one-token cell, however close its sizes
    assert N.nearest_cell([{C.shape_key(8, 4096, 14336, 2): {1: _cfg(16)}}], N.Layer(8, 4096, 14336, 2), 64,
                          pair_max_tokens=1, token_down_min_i=2048) is None  # fmt: skip


def test_the_same_layout_is_preferred_at_equal_sizes() -> None:
    plain, odd = C.shape_key(32, 2880, 2880, 4), C.layout_key(C.shape_key(32, 2880, 2880, 4), transposed=True)
    table = {plain: {4096: _cfg(64)}, odd: {4096: _cfg(128)}}
    got = N.nearest_cell([table], N.Layer(128, 2880, 2880, 4, True), 4096, pair_max_tokens=1, token_down_min_i=2048)
    assert got[0] == odd


def test_a_gpu_borrows_the_table_of_its_architecture_nearest_in_sms() -> None:
    headers = {
        "NVIDIA H200": {"capability": [9, 0], "num_sms": 132},
        "NVIDIA H20": {"capability": [9, 0], "num_sms": 78},
        "NVIDIA A100": {"capability": [8, 0], "num_sms": 108},
        "Old table": {},  # no capability in its header: never borrowed
    }
    assert N.sibling_table(headers, (9, 0), 114) == "NVIDIA H200"
    assert N.sibling_table(headers, (9, 0), 80) == "NVIDIA H20"
    assert N.sibling_table(headers, (8, 6), 84) == "NVIDIA A100"
    assert N.sibling_table(headers, (10, 0), 148) is None


def test_an_untabled_shape_runs_the_nearest_cells_tiles(gpu) -> None:
    shipped, user, _ = gpu
    _table(shipped, GPU, {C.shape_key(64, 2048, 1024, 8): {4096: _cfg(128, 128)}})
    shape = C.LayerShape(128, 2048, 768, torch.bfloat16)
    assert C.tile_source(shape, 8, CUDA) == "nearest"
    assert C.get_config(128, 2048, 768, 4096, 8, device="cuda") == C.normalize(_cfg(128, 128))
    default = C.normalize(C.default_config(128, 2048, 768, 4096, 8))
    assert default != C.normalize(_cfg(128, 128))  # so the lookup above did borrow
    # float32 layers have no tables: the built-in heuristics
    assert C.tile_source(shape._replace(dtype=torch.float32), 8, CUDA) == "heuristic"
    # this node's tuning of another shape counts as a table to borrow from too, and comes first
    _table(user, GPU, {C.shape_key(64, 2048, 1024, 8): {4096: _cfg(64, 32)}})
    assert C.get_config(128, 2048, 768, 4096, 8, device="cuda")["BLOCK_M"] == 64


def test_a_gpu_without_a_table_borrows_its_siblings_else_runs_the_heuristics(gpu) -> None:
    shipped, _, set_gpu = gpu
    _table(shipped, "NVIDIA H200", {C.shape_key(128, 2048, 768, 8): {4096: _cfg(128, 128)}},
           capability=[9, 0], num_sms=132)  # fmt: skip
    shape = C.LayerShape(128, 2048, 768, torch.bfloat16)
    set_gpu("NVIDIA H800", (9, 0), 132)
    assert C.tile_source(shape, 8, CUDA) == "nearest"
    assert C.get_config(128, 2048, 768, 4096, 8, device="cuda") == C.normalize(_cfg(128, 128))
    set_gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108)  # Hopper tiles (TMA, the persistent GEMM) are not for it
    assert C.tile_source(shape, 8, CUDA) == "heuristic"
    assert C.get_config(128, 2048, 768, 4096, 8, device="cuda") == C.normalize(C.default_config(128, 2048, 768, 4096, 8))


def test_the_shipped_tables_hold_no_held_out_shape_and_every_other_public_one() -> None:
    held = {C.shape_key(p.num_experts, p.hidden_size, p.intermediate_size, p.top_k)
            for p in (PRESETS[n] for n in HELD_OUT_PRESETS)}  # fmt: skip
    for path in sorted(C.CONFIG_DIR.glob("*.json")):
        keys = {key.split(",transposed")[0] for key in tile_tables.read_table(path, C.normalize)}
        assert not keys & held, f"{path.name} holds held-out shapes {sorted(keys & held)}"
    assert not set(tabled_presets()) & set(HELD_OUT_PRESETS) and len(HELD_OUT_PRESETS) >= 5
    h100 = tile_tables.read_table(C.CONFIG_DIR / C.config_file_name("NVIDIA H100 80GB HBM3"), C.normalize)
    assert set(h100) == {TU._table_key(p) for p in TU.table_problems(["public"], [])}, "every other public layer"


def test_the_table_command_tunes_each_layer_once_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    props = type("Props", (), {"name": "Fake Hopper", "multi_processor_count": 114})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    seen: list[tuple[str, float]] = []

    def fake_search(problem, token_counts, budget_s, *, force, directory, cost):  # as tune_kernels, no GPU
        assert force and Path(directory).is_dir()
        key = TU._table_key(problem)
        seen.append((key, budget_s))
        cost.compiled.add(("layer_persistent",))  # the first layer built the persistent kernel
        # the budget cut the first token count's search and never reached the last one
        configs = {t: _cfg(16 if t == 1 else 128) for t in token_counts}
        return {"skipped": None, "configs": configs, "tokens_tuned": list(token_counts[1:-1]),
                "tokens_partial": list(token_counts[:1]), "seconds": 1.0}  # fmt: skip

    problems = TU.table_problems(["grid", "qwen3-30b-a3b"], [(40, 1536, 896, 6)])
    assert len(problems) == 6 and all(p.dtype == "bfloat16" and p.device == "cuda" for p in problems)
    out = tmp_path / "table.json"
    TU.tune_table(problems[:2], out, (1, 64, 4096), 20.0, command="cmd", tune=fake_search)
    assert [b for _, b in seen] == [20.0 + TU.PERSISTENT_BUILD_GUESS_S, 20.0]  # the build is paid once
    doc = json.loads(out.read_text())
    assert doc["device"] == "Fake Hopper" and doc["capability"] == [9, 0] and doc["num_sms"] == 114
    assert doc["commands"] == ["cmd"] and len(doc["configs"]) == 2
    key = TU._table_key(problems[0])
    assert sorted(doc["configs"][key]) == ["1", "64"] and doc["tuned"][key] == [64], "measured cells only"
    seen.clear()
    TU.tune_table(problems, out, (1, 64, 4096), 20.0, resume=True, command="cmd2", tune=fake_search)
    assert json.loads(out.read_text())["commands"] == ["cmd", "cmd2"]
    assert [k for k, _ in seen] == [TU._table_key(p) for p in problems[2:]]
    assert len(tile_tables.read_table(out, C.normalize)) == 6


def test_the_table_command_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--shape", "8,64"], ["--tokens", "0"], ["--budget", "-1"], ["--preset", "nope"]):
        with pytest.raises(SystemExit) as info:
            TU.main(argv)
        assert info.value.code == 2
    assert "--budget: -1: expected a number > 0" in capsys.readouterr().err
    assert TU._shown_command(["--preset", "public", "--out", "/somewhere/NVIDIA_X.json", "--budget", "17"],
                             Path("/somewhere/NVIDIA_X.json")) == (
        "python -m selector.plugins.triton_fused.tune --preset public --budget 17 --out "
        "plugins/triton_fused/configs/NVIDIA_X.json")  # fmt: skip


@pytest.mark.parametrize("path", sorted(C.CONFIG_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_each_shipped_table_predicts_its_own_shapes_left_out(path: Path) -> None:
    """The heuristic's fit: every tabled shape left out in turn, the nearest remaining cell's BLOCK_M and persistent
    choice against the table's own, over the cells whose search finished (H100: 114 and 120 of 121; the H200's five
    shapes, all cells: 26 and 25 of 29)."""
    table = tile_tables.read_table(path, C.normalize)
    finished = json.loads(path.read_text()).get("tuned")  # cells whose search finished (older tables: every cell)
    same_bm = same_persistent = cells = 0
    for key, per_t in table.items():
        rest = {k: v for k, v in table.items() if k != key}
        for tokens, cfg in per_t.items():
            if finished is not None and tokens not in finished.get(key, ()):
                continue
            got = N.nearest_cell([rest], N.parse_key(key), tokens, pair_max_tokens=C.PAIR_BLOCK_MAX_TOKENS,
                                 token_down_min_i=C.TOKEN_DOWN_MIN_I)[2]  # fmt: skip
            cells += 1
            same_bm += got["BLOCK_M"] == cfg["BLOCK_M"]
            same_persistent += got["PERSISTENT"] == cfg["PERSISTENT"]
    assert same_bm >= 0.85 * cells and same_persistent >= 0.85 * cells, (same_bm, same_persistent, cells)
