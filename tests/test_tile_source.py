"""Where a fused layer's tiles come from (`configs.tile_source`): this node's table, the shipped one for the GPU, the
nearest tabled shape's, or the heuristics, with a fake GPU name and table folders in tmp_path (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selector.plugins.triton_fused import configs

SHAPE = configs.LayerShape(128, 2048, 768, torch.bfloat16)
CUDA = torch.device("cuda", 0)


@pytest.fixture
def tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    shipped.mkdir()
    user.mkdir()
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_CONFIG_DIR", str(shipped))
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", str(user))
    monkeypatch.setattr(configs, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    configs.clear_caches()
    yield shipped, user
    configs.clear_caches()


def _write(folder: Path, key: str) -> None:
    entry = {"BLOCK_M": 64, "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64}, "down": {"BLOCK_N": 64, "BLOCK_K": 64}}
    path = folder / configs.config_file_name("NVIDIA H100 80GB HBM3")
    path.write_text(json.dumps({"version": 1, "configs": {key: {"4096": entry}}}))
    configs.clear_caches()


def test_a_shape_in_no_table_runs_on_heuristic_tiles(tables) -> None:
    assert configs.tile_source(SHAPE, 8, CUDA) == "heuristic"
    assert configs.tile_source(SHAPE, 8, torch.device("cpu")) == ""  # no tables off CUDA: nothing to tell


def test_the_shipped_table_then_this_nodes_tuning(tables) -> None:
    shipped, user = tables
    _write(shipped, configs.shape_key(128, 2048, 768, 8))
    assert configs.tile_source(SHAPE, 8, CUDA) == "table"
    assert configs.tile_source(SHAPE, 4, CUDA) == "nearest"  # k is part of the shape's key: tiles are borrowed
    _write(user, configs.shape_key(128, 2048, 768, 8))
    assert configs.tile_source(SHAPE, 8, CUDA) == "tuned"


def test_a_layout_falls_back_to_its_plain_shape_as_the_lookup_does(tables) -> None:
    shipped, _ = tables
    _write(shipped, configs.shape_key(128, 2048, 768, 8))
    transposed = SHAPE._replace(transposed=True, interleaved=True)
    assert configs.tile_source(transposed, 8, CUDA) == "table"
    assert configs.tile_source(SHAPE._replace(dtype=torch.float32), 8, CUDA) == "heuristic"


def test_the_source_is_the_entry_the_lookup_reads(tables) -> None:
    """A layer's own layout in the shipped table wins over its plain shape tuned on this node, in the lookup and in
    what the source says alike."""
    shipped, user = tables
    transposed = SHAPE._replace(transposed=True)
    own = configs.layout_key(configs.shape_key(128, 2048, 768, 8), transposed=True)
    _write(shipped, own)
    _write(user, configs.shape_key(128, 2048, 768, 8))
    assert configs.tile_source(transposed, 8, CUDA) == "table"
    assert configs.tile_source(SHAPE, 8, CUDA) == "tuned"
