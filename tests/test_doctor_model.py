"""`selector doctor --model`: a model's config.json read without downloading or building the model, each distinct
experts shape tabled, tuned or estimated on an injected GPU, with the command that tunes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from selector.doctor import build_report
from selector.model_shapes import ModelConfigError, model_section
from selector.probes import collect_environment
from selector.registry import build_registry
from selector.render import render_json, render_markdown, render_text
from selector.tuning import Fingerprints, TuningTable, problem_key
from selector.tuning_store import current_fingerprints

H200 = {"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""}
H100 = {"SELECTOR_GPUS": "NVIDIA H100 80GB HBM3:9.0:80", "SELECTOR_PACKAGE_TRITON": "3.6.0", "PATH": ""}
QWEN3 = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}
GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "torch_dtype": "bfloat16",
}


def _model(tmp_path: Path, config: dict[str, Any], name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _section(folder: Path, environ: dict[str, str], records: list[dict[str, Any]] = (),
             fingerprints: Fingerprints | None = None) -> Any:
    env = collect_environment(environ)
    fps = fingerprints or current_fingerprints(env, build_registry(environ={}))
    return model_section(folder, env, TuningTable.from_records(list(records), fps))


def test_a_shape_in_the_shipped_h200_table_is_tabled(tmp_path: Path) -> None:
    section = _section(_model(tmp_path, QWEN3, "Qwen3-30B-A3B"), H200)
    assert section.gpu == "NVIDIA H200" and section.name == "Qwen3-30B-A3B" and len(section.shapes) == 1
    shape = section.shapes[0]
    p = shape.problem
    assert (p.num_experts, p.hidden_size, p.intermediate_size, p.top_k, p.dtype) == (128, 2048, 768, 8, "bfloat16")
    assert (shape.status, shape.tile_table, shape.layout) == ("tabled", "shipped", "plain")
    assert shape.tune_command == f"selector tune {tmp_path / 'Qwen3-30B-A3B' / 'config.json'}"


def test_the_same_shape_on_an_h100_is_estimated_until_tuned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_CONFIG_DIR", str(tmp_path / "no-tables"))  # no shipped table here
    folder = _model(tmp_path, QWEN3)
    assert _section(folder, H100).shapes[0].status == "estimated"
    env = collect_environment(H100)
    fps = current_fingerprints(env, build_registry(environ={}))
    key = problem_key(_section(folder, H100).shapes[0].problem)
    records = [{"fingerprint": fps.of(b), "gpu": "NVIDIA H100 80GB HBM3", "problem": key, "mode": "eager",
                "tokens": t, "backend": b, "time_s": 1e-4} for b in ("grouped_mm", "triton_fused") for t in (1, 64)]
    shape = _section(folder, H100, records, fps).shapes[0]
    assert shape.status == "tuned" and shape.measured == {"eager": (1, 64)}
    stale = [{**r, "fingerprint": "0" * 32} for r in records]  # measured under other facts: never trusted
    assert _section(folder, H100, stale, fps).shapes[0].status == "estimated"
    legacy = [{**r, "fingerprint": fps.legacy} for r in records]  # the older format, proven current here
    assert _section(folder, H100, legacy, fps).shapes[0].status == "tuned"


def test_tiles_tuned_on_this_node_count_as_tabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tables = tmp_path / "tiles"
    tables.mkdir()
    entry = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}
    table = {"configs": {"E=128,H=2048,I=768,k=8": {"1": entry}}}
    (tables / "NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps(table))
    monkeypatch.setenv("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", str(tables))
    shape = _section(_model(tmp_path, QWEN3), H100).shapes[0]
    assert (shape.status, shape.tile_table) == ("tabled", "node")


def test_gpt_oss_layout_and_a_float32_model(tmp_path: Path) -> None:
    shape = _section(_model(tmp_path, GPT_OSS), H200).shapes[0]
    assert shape.layout == "bias, transposed, interleaved" and shape.status == "tabled"
    fp32 = _section(_model(tmp_path, {**QWEN3, "torch_dtype": "float32"}, "fp32"), H200).shapes[0]
    assert fp32.problem.dtype == "float32" and fp32.status == "estimated"  # the fused tables hold 16-bit tiles


def test_every_distinct_shape_of_the_sub_configs_is_listed_once(tmp_path: Path) -> None:
    text = {**QWEN3, "model_type": "qwen3_vl_moe_text"}
    talker = {
        "hidden_size": 1024,
        "moe_intermediate_size": 384,
        "num_experts": 64,
        "num_experts_per_tok": 4,
        "torch_dtype": "bfloat16",
    }
    config = {"model_type": "omni", "text_config": text, "vision_config": {"hidden_size": 1152},
              "talker_config": {"text_config": talker}, "assistant_config": {"text_config": dict(text)}}
    section = _section(_model(tmp_path, config), H200)
    assert [s.scopes for s in section.shapes] == [("text_config", "assistant_config.text_config"),
                                                  ("talker_config.text_config",)]
    first, second = section.shapes
    assert first.tune_command.startswith("selector tune ") and first.tune_command.endswith("config.json")
    assert second.tune_command == ("selector tune --experts 64 --hidden 1024 --intermediate 384 --top-k 4 "
                                   "--dtype bfloat16")
    assert second.status == "estimated"


def test_fp8_weights_are_named_and_tuned_with_their_format(tmp_path: Path) -> None:
    config = {**QWEN3, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    shape = _section(_model(tmp_path, config), H200).shapes[0]
    assert shape.layout == "fp8_block/float32" and shape.status == "estimated"  # the dense tables do not apply


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008}, "describes no experts layer"),
        ({"num_experts": 8, "hidden_size": 64}, "no intermediate size per expert"),
    ],
)
def test_a_config_without_experts_says_so(tmp_path: Path, config: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        _section(_model(tmp_path, config), H200)
    with pytest.raises(ModelConfigError, match="does not exist"):
        _section(tmp_path / "missing", H200)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match="has no config.json"):
        _section(tmp_path / "empty", H200)


def test_one_report_renders_as_text_markdown_and_json(tmp_path: Path) -> None:
    folder = _model(tmp_path, QWEN3)
    env = collect_environment(H200)
    registry = build_registry(environ={})
    table = TuningTable.from_records([], current_fingerprints(env, registry))
    report = build_report(env, registry, tuning=table, model=model_section(folder, env, table))
    text = render_text(report)
    assert "Model model (" in text and "1 distinct experts shape (1 tabled)" in text
    assert "E=128 H=2048 I=768 k=8 bfloat16 plain" in text and "tabled: the shipped tile table" in text
    assert f"tune: selector tune {folder / 'config.json'}" in text
    markdown = render_markdown(report)
    assert "## Model model on NVIDIA H200" in markdown
    assert "| 128 | 2048 | 768 | 8 | bfloat16 | plain | tabled | the shipped tile table |" in markdown
    data = json.loads(render_json(report))
    shape = data["model"]["shapes"][0]
    key = problem_key(report.model.shapes[0].problem)
    assert (shape["status"], shape["key"], shape["tile_table"]) == ("tabled", key, "shipped")
    assert data["schema"] == "selector.doctor/1" and report.exit_code == 0


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **env}
    command = [sys.executable, "-m", "selector.cli", "doctor", *args]
    return subprocess.run(command, capture_output=True, text=True, env=environ, timeout=120)


def test_the_command_reads_a_folder_without_torch_or_network(tmp_path: Path) -> None:
    folder = _model(tmp_path, QWEN3)
    env = {
        "SELECTOR_GPUS": "NVIDIA H200:9.0:141",
        "SELECTOR_DRIVER_VERSION": "580.159.04",
        "SELECTOR_PACKAGE_TRITON": "3.6.0",
        "SELECTOR_TUNING_STORE": str(tmp_path / "store.sqlite3"),
        "HF_HUB_OFFLINE": "1",
    }
    result = _doctor("--json", "--model", str(folder), **env)
    assert result.returncode == 0, result.stderr
    shapes = json.loads(result.stdout)["model"]["shapes"]
    assert [(s["experts"], s["status"]) for s in shapes] == [(128, "tabled")]
    bad = _doctor("--model", str(tmp_path / "nowhere"), **env)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    script = (
        "import sys\n"
        "from selector.model_shapes import model_section\n"
        "from selector.probes import collect_environment\n"
        "from selector.tuning import TuningTable\n"
        f"s = model_section({str(folder)!r}, collect_environment({{'SELECTOR_GPUS': 'NVIDIA H200:9.0'}}), "
        "TuningTable('x'))\n"
        "assert s.shapes[0].status == 'tabled'\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
    )
    probe = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
