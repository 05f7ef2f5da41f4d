"""Which config file counts, what a pin that cannot run does, and which names are selector's.

- The project file is the project root's `selector.yaml` (nearest folder up with pyproject.toml or .git), never
  a sub-folder's; SELECTOR_CONFIG replaces it; the user file is read first either way.
- A pin that cannot run here: auto ranks the others and warns once; the same name asked for explicitly raises.
- A CUDA-only backend asked for on a CPU says it needs a CUDA GPU before anything about dtypes or packages.
"""

from __future__ import annotations

import os

import re
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from experts_fixtures import make_experts, random_routing

import selector
from selector import BackendSpec, Requirements, config, hookimpl
from selector.config import ConfigError, config_paths, load_config, project_root
from selector.dispatch import backend_forward, last_backend, run_experts
from selector.presets import preset
from selector.probes import collect_environment
from selector.requirements import evaluate
from selector.types import Status

README = Path(__file__).resolve().parents[1] / "README.md"
NO_GPU = {"SELECTOR_GPUS": "", "PATH": ""}


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user config folder, in tmp_path (platformdirs reads XDG_CONFIG_HOME on Linux)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SELECTOR_CONFIG", raising=False)
    folder = Path(config.user_config_path()).parent
    folder.mkdir(parents=True)
    return folder


def _project(tmp_path: Path, marker: str = "pyproject.toml") -> tuple[Path, Path]:
    """A project folder with `marker` and a sub-folder two levels down; (root, sub-folder)."""
    root = tmp_path / "project"
    sub = root / "scripts" / "bench"
    sub.mkdir(parents=True)
    (root / marker).mkdir() if marker == ".git" else (root / marker).write_text("")
    return root, sub


# ---------------------------------------------------------------------------------------------------------
# Where the config comes from
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("marker", ["pyproject.toml", ".git"])
def test_the_project_file_is_the_roots_not_a_sub_folders(tmp_path, monkeypatch, user_dir, marker) -> None:
    root, sub = _project(tmp_path, marker)
    (root / "selector.yaml").write_text("prefer: [eager]\n")
    (sub / "selector.yaml").write_text("deny: [grouped_mm]\n")  # beneath the root: never read
    assert project_root(sub) == root.resolve() and project_root(root) == root.resolve()
    monkeypatch.chdir(sub)
    loaded = load_config(registered=("eager", "grouped_mm"))
    assert loaded.prefer == ("eager",) and loaded.deny == frozenset()
    assert loaded.files == (str(root.resolve() / "selector.yaml"),)


def test_a_git_file_marks_a_root_too(tmp_path) -> None:
    root, sub = _project(tmp_path, "pyproject.toml")
    (root / "pyproject.toml").unlink()
    (root / ".git").write_text("gitdir: elsewhere\n")  # a worktree or a submodule
    assert project_root(sub) == root.resolve()


def test_without_a_marker_the_current_directory_is_the_root(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(config, "PROJECT_MARKERS", ("no-folder-holds-this",))
    assert project_root(tmp_path) == tmp_path.resolve()
    assert config_paths(environ={}, cwd=tmp_path)[-1] == tmp_path.resolve() / "selector.yaml"


def test_a_deleted_working_directory_reads_no_project_file(tmp_path, monkeypatch, user_dir) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert project_root() is None
    assert config_paths(environ={}) == [config.user_config_path()]


def test_the_user_file_comes_first_and_the_project_file_overrides_it(tmp_path, monkeypatch, user_dir) -> None:
    root, sub = _project(tmp_path)
    (user_dir / "config.yaml").write_text("prefer: [grouped_mm]\ndeny: [batched_mm]\n")
    (root / "selector.yaml").write_text("prefer: [eager]\n")
    monkeypatch.chdir(sub)
    loaded = load_config(registered=("eager", "grouped_mm", "batched_mm"))
    assert loaded.prefer == ("eager",) and loaded.deny == frozenset({"batched_mm"})
    assert loaded.sources["prefer"].endswith("selector.yaml") and loaded.sources["deny"].endswith("config.yaml")


def test_selector_config_replaces_the_project_file(tmp_path, monkeypatch, user_dir) -> None:
    root, sub = _project(tmp_path)
    (user_dir / "config.yaml").write_text("deny: [batched_mm]\n")
    (root / "selector.yaml").write_text("prefer: [eager]\npin: eager\n")
    explicit = tmp_path / "ci.yaml"
    explicit.write_text("prefer: [grouped_mm]\n")
    monkeypatch.chdir(sub)
    monkeypatch.setenv("SELECTOR_CONFIG", str(explicit))
    loaded = load_config(registered=("eager", "grouped_mm", "batched_mm"))
    assert loaded.prefer == ("grouped_mm",) and loaded.pin is None  # nothing of the project file
    assert loaded.deny == frozenset({"batched_mm"})  # the user file still counts
    assert loaded.files == (str(user_dir / "config.yaml"), str(explicit))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing.yaml", "no such file; fix the path or unset SELECTOR_CONFIG"),
        ("folder", "a folder; name the YAML file itself"),
        ("plain.txt/c.yaml", r"cannot be read \(Not a directory\)"),
    ],
)
def test_selector_config_must_name_a_readable_file(tmp_path, name, message) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "plain.txt").write_text("")
    path = tmp_path / name
    with pytest.raises(ConfigError, match=f"^SELECTOR_CONFIG={re.escape(str(path))}: {message}"):
        load_config(environ={"SELECTOR_CONFIG": str(path)})


# ---------------------------------------------------------------------------------------------------------
# A pin that cannot run here
# ---------------------------------------------------------------------------------------------------------


class GpuOnly:
    """A fake plugin: one backend that runs on CUDA only, named for this file (warnings are once per process)."""

    @staticmethod
    @hookimpl
    def selector_backends():  # noqa: ANN205
        return [BackendSpec(name="fake_rules_gpu_only", load=lambda: backend_forward("grouped_mm"),
                            requirements=Requirements(devices=frozenset({"cuda"})))]  # fmt: skip


def _pin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Path:
    path = tmp_path / "pin.yaml"
    path.write_text(f"pin: {name}\n")
    monkeypatch.setenv("SELECTOR_CONFIG", str(path))
    selector.reset_selection_caches()
    return path


def test_a_pin_that_cannot_run_here_falls_back_with_one_warning(tmp_path, monkeypatch, fresh_registry) -> None:
    fresh_registry(GpuOnly)
    path = _pin(tmp_path, monkeypatch, "fake_rules_gpu_only")
    module = make_experts(4, 16, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in (3, 40, 3):  # two token buckets: two rankings, one warning
            idx, w = random_routing(tokens, 4, 2)
            module(torch.randn(tokens, 16), idx, w)
            assert last_backend(module) != "fake_rules_gpu_only"
    said = [str(c.message) for c in caught if "pinned backend" in str(c.message)]
    assert len(said) == 1, said
    assert said[0].startswith(f"selector: pinned backend 'fake_rules_gpu_only' (from {path}) cannot run here "
                              "(unsupported_device: needs a CUDA GPU: runs on cuda, not on cpu)")
    assert "auto picks from the other backends" in said[0] and "or remove the pin" in said[0]
    # the same name asked for explicitly is a request, not a preference: it raises
    idx, w = random_routing(3, 4, 2)
    with pytest.raises(ImportError, match="'fake_rules_gpu_only' cannot run here: needs a CUDA GPU"):
        run_experts(module, torch.randn(3, 16), idx, w, implementation="fake_rules_gpu_only")


def test_a_built_in_gpu_pin_on_a_cpu_runs_the_ranking(tmp_path, monkeypatch) -> None:
    _pin(tmp_path, monkeypatch, "triton_fused")
    module = make_experts(4, 16, 8)
    idx, w = random_routing(3, 4, 2)
    hidden = torch.randn(3, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said once per process: an earlier test may have seen it
        out = module(hidden, idx, w)
    assert last_backend(module) in {c.name for c in selector.explain_module(module, top_k=2).candidates}
    assert last_backend(module) != "triton_fused"
    assert torch.allclose(out, backend_forward("eager")(module, hidden, idx, w), atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# The device requirement first, and selector's names under Transformers
# ---------------------------------------------------------------------------------------------------------


def test_the_device_is_reported_before_dtype_and_packages() -> None:
    bf16_gpu_kernel = BackendSpec(
        name="fake_bf16_gpu", load=lambda: None,
        requirements=Requirements(devices=frozenset({"cuda"}), dtypes=frozenset({"bfloat16"}),
                                  packages={"not-installed-anywhere": ""}),
    )  # fmt: skip
    env = collect_environment(environ=NO_GPU)
    layer = preset("mixtral-8x7b")
    on_cpu = evaluate(bf16_gpu_kernel, replace(layer, device="cpu", dtype="float32"), env)
    assert on_cpu.status is Status.UNSUPPORTED_DEVICE and on_cpu.status.error_type is ImportError
    assert on_cpu.reason == "needs a CUDA GPU: runs on cuda, not on cpu"
    on_missing_gpu = evaluate(bf16_gpu_kernel, replace(layer, device="cuda", dtype="float32"), env)
    assert on_missing_gpu.status is Status.UNSUPPORTED_HARDWARE and "needs a CUDA GPU" in on_missing_gpu.reason
    assert "bfloat16" not in on_cpu.reason + on_missing_gpu.reason


def test_deepgemm_asked_on_a_cpu_says_it_needs_a_gpu() -> None:
    module = make_experts(4, 16, 8)  # float32 on the CPU: both the device and the dtype are wrong for deepgemm
    idx, w = random_routing(3, 4, 2)
    with pytest.raises(ImportError, match="'deepgemm' cannot run here: needs a CUDA GPU") as info:
        run_experts(module, torch.randn(3, 16), idx, w, implementation="deepgemm")
    assert "bfloat16" not in str(info.value)


def _readme_spellings() -> dict[str, str]:
    """{backend: the name README's backends table gives it under Transformers}."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Backends") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| `([a-z0-9_:]+)` \|", section, flags=re.M)
    return dict(rows)


def test_readme_names_each_backend_as_transformers_runs_it() -> None:
    pytest.importorskip("transformers")
    import selector.hf as hf
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    spellings = _readme_spellings()
    assert set(spellings) == set(selector.get_registry().names)
    names = hf.transformers_names()
    for backend, spelled in spellings.items():
        assert names.get(spelled) == backend, f"README: {spelled!r} does not run selector's {backend} here"
        if backend in ALL_EXPERTS_FUNCTIONS and backend not in names:  # Transformers' own function
            assert spelled == hf.PREFIX + backend
    # Transformers' own "deepgemm" keeps running Transformers' function; "selector:deepgemm" is selector's
    assert names["selector:deepgemm"] == "deepgemm" and names.get("deepgemm") in (None, "deepgemm")
    module = make_experts(4, 16, 8)
    idx, w = random_routing(3, 4, 2)
    with pytest.raises(ImportError, match="needs a CUDA GPU"):
        ALL_EXPERTS_FUNCTIONS["selector:deepgemm"](module, torch.randn(3, 16), idx, w)


def test_a_transformers_name_selector_also_has_says_how_to_ask_for_selector_s_and_why_it_cannot_run() -> None:
    """Under Transformers a bare name it knows runs Transformers' function: the selection report says which name
    runs selector's and, where selector's cannot run here (a CUDA kernel on this CPU), why, in selector's words."""
    import torch
    import transformers

    import selector
    from selector import hf

    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = selector.from_config(transformers.AutoModelForCausalLM, config, experts_implementation="grouped_mm")
    entry = hf.selection_report(model).entries[0]
    assert entry.runs == "transformers" and entry.hint == "`selector:grouped_mm` runs selector's"
    assert "`selector:grouped_mm` runs selector's" in entry.lines()[0]
    if torch.cuda.is_available():
        pytest.skip("deepgemm may run on this GPU: the CPU case is the one checked")
    model.set_experts_implementation("deepgemm")
    entry = hf.selection_report(model).entries[0]
    if entry.runs == "selector":
        pytest.skip("this Transformers has no deepgemm of its own: the bare name is selector's")
    assert entry.hint.startswith("`selector:deepgemm` runs selector's, which cannot run here: ")
    assert "CUDA" in entry.hint and entry.to_dict()["hint"] == entry.hint


def test_a_pin_of_a_blocked_backend_falls_back_with_a_warning(tmp_path, monkeypatch) -> None:
    """A pin naming a backend its plugin keeps away (SELECTOR_PLUGINS_BLOCK) is no unknown name: auto ranks the
    others and says why once."""
    import warnings

    import torch

    import selector
    from selector import dispatch
    from selector.registry import reset_registry
    from selector.testing import make_experts

    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "selector.yaml").write_text("pin: batched_mm\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SELECTOR_PLUGINS_BLOCK", "batched_mm")
    reset_registry()
    dispatch.reset_selection_caches()
    try:
        module = make_experts(4, 16, 8)
        x = torch.randn(3, 16)
        idx = torch.tensor([[0, 1], [1, 2], [2, 3]])
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            module(x, idx, torch.full((3, 2), 0.5))
        assert selector.last_backend(module) not in (None, "batched_mm")
        said = [str(w.message) for w in caught if "pinned backend 'batched_mm'" in str(w.message)]
        assert len(said) == 1 and "SELECTOR_PLUGINS_BLOCK" in said[0], said
    finally:
        monkeypatch.delenv("SELECTOR_PLUGINS_BLOCK")
        reset_registry()
        dispatch.reset_selection_caches()


def test_a_config_file_another_user_may_write_is_ignored_with_a_warning(tmp_path, monkeypatch) -> None:
    import warnings

    from selector import config as cfg

    (tmp_path / "pyproject.toml").write_text("")
    project = tmp_path / "selector.yaml"
    project.write_text("prefer: [eager]\n")
    project.chmod(0o666)  # anyone may write it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = cfg.load_config(paths=[project], registered=["eager"])
    assert loaded.prefer == () and any("another user may write it" in str(w.message) for w in caught)
    project.chmod(0o644)
    assert cfg.load_config(paths=[project], registered=["eager"]).prefer == ("eager",)


def test_a_marker_another_user_owns_marks_no_project_root(tmp_path, monkeypatch) -> None:
    from selector import config as cfg

    shared, mine = tmp_path / "shared", tmp_path / "shared" / "work"
    mine.mkdir(parents=True)
    (shared / ".git").mkdir()
    assert cfg.project_root(mine) == shared
    if not hasattr(os, "getuid") or os.getuid() != 0:
        pytest.skip("making a file another user owns needs root")
    os.chown(shared / ".git", 12345, 12345)  # planted by another user
    assert cfg.project_root(mine) == mine
