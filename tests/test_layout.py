"""The repository's layout rules, read from the source with `ast` (nothing here imports the modules it checks).

- the import graph of `selector`, `selector.plugins` (folder `plugins/`) and `selector.probes` (`probes/`) has no
  cycle; imports inside functions count, `if TYPE_CHECKING:` blocks and `selector`'s lazy `_LAZY` table do not;
- nothing outside `selector/dispatch.py` reads the dispatch core's private names or its per-module keys, and no
  module imports a `_private` name across package folders;
- the floors: probes import nothing of selector above them and no torch; the selection modules import no torch
  at module level and nothing of the runtime or the adapters;
- a wheel built from the tree installs `selector` alone, with the built-in entry points and package data.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"selector": "selector", "plugins": "selector.plugins", "probes": "selector.probes"}
CHECKED_TOO = ("benchmarks", "tests")  # read for private names; not importable as project modules
DISPATCH = "selector.dispatch"
DISPATCH_KEYS = frozenset({
    "_selector_implementation", "_selector_last_backend", "_selector_top_k", "_selector_uid",
    "_selector_problem", "_selector_facts", "_selector_choices", "_selector_checked",
})  # fmt: skip
SELECTION_FLOOR = (
    "selector.types", "selector.gates", "selector.requirements", "selector.costmodel", "selector.ranking",
    "selector.registry", "selector.config", "selector.tuning", "selector.compat",
)  # fmt: skip
RUNTIME_AND_ADAPTERS = ("selector.dispatch", "selector.model", "selector.hf", "selector.daemon", "selector.bench")
HEAVY = ("torch",)


@dataclass(frozen=True)
class Import:
    """One name an import statement brings in, resolved to the module it loads."""

    target: str  # the module loaded: `from X import Y` is X.Y where that is a module, else X
    name: str | None  # Y of `from X import Y` (None for `import X`)
    source: str | None  # X of `from X import Y`, resolved (None for `import X`)
    line: int
    module_level: bool


@dataclass(frozen=True)
class Module:
    name: str  # dotted, as installed
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        """The package whose folder holds this file."""
        return self.name if self.is_package else self.name.rpartition(".")[0]

    @property
    def where(self) -> str:
        return str(self.path.relative_to(ROOT)) if self.path.is_relative_to(ROOT) else str(self.path)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules_under(folder: str, prefix: str) -> Iterator[Module]:
    for path in sorted((ROOT / folder).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        yield Module(".".join([prefix, *parts]), path, is_package)


@cache
def project_modules() -> dict[str, Module]:
    """Every module the wheel installs, by its installed name."""
    return {m.name: m for folder, prefix in FOLDERS.items() for m in _modules_under(folder, prefix)}


@cache
def checked_modules() -> tuple[Module, ...]:
    """The project's modules plus benchmarks and tests (named by folder, for messages only)."""
    extra = [m for folder in CHECKED_TOO for m in _modules_under(folder, folder)]
    return (*project_modules().values(), *extra)


@cache
def tree_of(module: Module) -> ast.Module:
    return ast.parse(module.path.read_text(), filename=str(module.path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _base_of(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.package.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(module: Module) -> list[Import]:
    """Every import the module runs, at module level or inside a function; not those only type checkers see."""
    known = project_modules()
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, module_level)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, None, None, node.lineno, module_level) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base_of(module, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(sub if sub in known else base, alias.name, base, node.lineno, module_level))
        inner = module_level and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree_of(module), True)
    return found


@cache
def import_graph(module_level_only: bool = False) -> dict[str, dict[str, int]]:
    """{module: {project module it imports: line}}, self-imports left out."""
    known = project_modules()
    graph: dict[str, dict[str, int]] = {}
    for name, module in known.items():
        edges = graph.setdefault(name, {})
        for imp in imports_of(module):
            if imp.target in known and imp.target != name and (imp.module_level or not module_level_only):
                edges.setdefault(imp.target, imp.line)
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def _path(graph: dict[str, dict[str, int]], start: str, goals: set[str], within: set[str] | None = None) -> list[str]:
    """A shortest import chain from start to any goal (BFS), or [] when none."""
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, {})):
            if within is not None and nxt not in within:
                continue
            if nxt in goals:
                chain = [nxt, node]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])  # type: ignore[arg-type]
                return chain[::-1]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return []


def _chain_text(graph: dict[str, dict[str, int]], chain: list[str]) -> str:
    known = project_modules()
    steps = [f"{a} ({known[a].where}:{graph[a][b]})" for a, b in zip(chain, chain[1:])]
    return " -> ".join([*steps, chain[-1]])


def find_cycles() -> list[str]:
    """One cycle per strongly connected group of modules, as an import chain with file:line of each step."""
    graph = import_graph()
    cycles = []
    for component in _strongly_connected(graph):
        start = component[0]
        cycles.append(_chain_text(graph, _path(graph, start, {start}, within=set(component))))
    return cycles


# --- import graph ------------------------------------------------------------------------------------------------


def test_every_project_module_is_found() -> None:
    names = project_modules()
    for expected in ("selector", "selector.dispatch", "selector.plugins", "selector.probes", "selector.probes.gpu"):
        assert expected in names
    assert "selector.plugins.triton_fused.kernels" in names


def test_imports_resolve_submodules_and_relative_names(tmp_path: Path) -> None:
    """`from X import Y` is X.Y when Y is a module; `from . import Y` resolves in the file's package."""
    known = project_modules()
    fake = Module("selector.plugins.triton_fused.probe_me", tmp_path / "probe_me.py", False)
    fake.path.write_text(
        "from selector import layers, hookimpl\n"
        "from . import kernels\n"
        "from .. import tile_tables\n"
        "import selector.plugins.eager.forward as f\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from selector import dispatch\n"
        "def later():\n    from selector.probes import gpu\n"
    )
    got = {(i.target, i.module_level) for i in imports_of(fake) if i.target in known}
    assert got == {
        ("selector.layers", True),
        ("selector", True),
        ("selector.plugins.triton_fused.kernels", True),
        ("selector.plugins.tile_tables", True),
        ("selector.plugins.eager.forward", True),
        ("selector.probes.gpu", False),
    }


def test_cycle_finder_reports_a_circle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]
    assert _path(graph, "a", {"a"}) == ["a", "b", "c", "a"]


def test_lazy_attribute_table_is_not_an_import() -> None:
    """selector's `_LAZY` names modules to load on first attribute use; only its real imports are edges."""
    edges = import_graph()["selector"]
    assert "selector.types" in edges and "selector.hookspecs" in edges
    assert "selector.model" not in edges and "selector.hf" not in edges


def test_import_graph_has_no_cycle() -> None:
    cycles = find_cycles()
    assert not cycles, "import cycles (each listed as a chain of imports):\n" + "\n".join(cycles)


# --- private names -----------------------------------------------------------------------------------------------


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _dispatch_aliases(module: Module) -> set[str]:
    """Names bound to the dispatch module in this file (`import selector.dispatch as d`, `from selector import dispatch`)."""
    aliases = {DISPATCH}
    for node in ast.walk(tree_of(module)):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == DISPATCH and a.asname)
        elif isinstance(node, ast.ImportFrom) and _base_of(module, node) == "selector":
            aliases.update(a.asname or a.name for a in node.names if a.name == "dispatch")
    return aliases


def dispatch_private_uses(module: Module) -> list[str]:
    """Every place a file reads or names a private name of the dispatch core."""
    aliases = _dispatch_aliases(module)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree_of(module)):
        line = getattr(node, "lineno", 0)
        what = None
        if isinstance(node, ast.ImportFrom) and _base_of(module, node) == DISPATCH:
            private = [a.name for a in node.names if _is_private(a.name)]
            what = f"imports {', '.join(private)} from {DISPATCH}" if private else None
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and _dotted(node.value) in aliases:
            what = f"reads {_dotted(node.value)}.{node.attr}"
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and _dotted(node.args[0]) in aliases:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value):
                what = f"names {name.value!r} on the dispatch module"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in DISPATCH_KEYS:
                what = f"names the per-module key {node.value!r}"
            elif node.value.startswith(DISPATCH + "._"):
                what = f"names {node.value!r}"
        if what:
            found.append((line, f"{module.where}:{line}: {what}"))
    return [text for _, text in sorted(found)]


def private_imports_across_packages(module: Module) -> list[str]:
    """`from X import _y` where X lives in another package folder than the importing file."""
    known = project_modules()
    found = []
    for imp in imports_of(module):
        if imp.source is None:  # import a.b._c
            owner, _, name = imp.target.rpartition(".")
        else:  # from a.b import _c: the name belongs to a.b, whether _c is a module or not
            owner, name = imp.source, imp.name or ""
        if owner not in known or not _is_private(name):
            continue
        if known[owner].package != module.package:
            found.append(f"{module.where}:{imp.line}: imports {name} from {owner}")
    return found


def test_the_dispatch_finders_see_what_they_look_for(tmp_path: Path) -> None:
    fake = Module("tests.probe_me", tmp_path / "probe_me.py", False)
    fake.path.write_text(
        "from selector.dispatch import _RESOLVER, run_experts\n"
        "from selector import dispatch as core\n"
        "import selector.dispatch\n"
        "core._RESOLVER.reset()\n"
        "selector.dispatch._TRACKED.clear()\n"
        "setattr(core, '_NEXT_UID', None)\n"
        "m.__dict__['_selector_uid']\n"
        "monkeypatch.setattr('selector.dispatch._RESOLVER', None)\n"
        "from selector.plugins.triton_fused.kernels import _POISON\n"
        "from selector.probes import _private_helper\n"
    )
    assert [f.split(": ", 1)[1] for f in dispatch_private_uses(fake)] == [
        "imports _RESOLVER from selector.dispatch",
        "reads core._RESOLVER",
        "reads selector.dispatch._TRACKED",
        "names '_NEXT_UID' on the dispatch module",
        "names the per-module key '_selector_uid'",
        "names 'selector.dispatch._RESOLVER'",
    ]
    assert [f.split(": ", 1)[1] for f in private_imports_across_packages(fake)] == [
        "imports _RESOLVER from selector.dispatch",
        "imports _POISON from selector.plugins.triton_fused.kernels",
        "imports _private_helper from selector.probes",
    ]


def test_nothing_outside_dispatch_reads_its_private_names() -> None:
    mine = {ROOT / "selector" / "dispatch.py", Path(__file__).resolve()}
    found = [f for m in checked_modules() if m.path not in mine for f in dispatch_private_uses(m)]
    assert not found, "the dispatch core's private names, read from outside it:\n" + "\n".join(found)


def test_no_private_imports_across_packages() -> None:
    found = [f for m in checked_modules() for f in private_imports_across_packages(m)]
    assert not found, "private names imported from another package folder:\n" + "\n".join(found)


# --- floors --------------------------------------------------------------------------------------------------------


def _top(name: str) -> str:
    return name.split(".")[0]


def test_probes_import_nothing_above_them_and_no_torch() -> None:
    known = project_modules()
    found = []
    for module in known.values():
        if module.name != "selector.probes" and not module.name.startswith("selector.probes."):
            continue
        for imp in imports_of(module):
            above = imp.target in known and not imp.target.startswith("selector.probes")
            if above or _top(imp.target) in HEAVY:
                found.append(f"{module.where}:{imp.line}: imports {imp.target}")
    assert not found, "probes must stand alone (no selector above them, no torch):\n" + "\n".join(found)


def _heavy_at_module_level(name: str) -> list[Import]:
    return [i for i in imports_of(project_modules()[name]) if i.module_level and _top(i.target) in HEAVY]


def test_selection_floor_imports_no_torch_at_module_level() -> None:
    """Importing a selection module (and what it imports at module level) loads no torch."""
    graph = import_graph(module_level_only=True)
    heavy = {name for name in graph if _heavy_at_module_level(name)}
    found = []
    for name in SELECTION_FLOOR:
        chain = [name] if name in heavy else _path(graph, name, heavy)
        if chain:
            last = project_modules()[chain[-1]]
            imp = _heavy_at_module_level(chain[-1])[0]
            via = _chain_text(graph, chain) + " -> " if len(chain) > 1 else ""
            found.append(f"{name}: {via}{imp.target} ({last.where}:{imp.line})")
    assert not found, "selection modules that load torch on import:\n" + "\n".join(found)


def test_selection_floor_imports_nothing_of_the_runtime_or_adapters() -> None:
    """Not at module level, not inside a function, not through another module."""
    graph = import_graph()
    found = []
    for name in SELECTION_FLOOR:
        chain = _path(graph, name, set(RUNTIME_AND_ADAPTERS))
        if chain:
            found.append(f"{name}: {_chain_text(graph, chain)}")
    assert not found, "selection modules that reach the runtime or the adapters:\n" + "\n".join(found)


# --- the wheel -----------------------------------------------------------------------------------------------------


def _copy_sources(dest: Path) -> Path:
    """The files a build reads, without this checkout's build/, egg-info or caches (stale files must not leak)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", ".venv", ".git", "*.pyc")
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for extra in ("LICENSE", "MANIFEST.in", "setup.cfg"):
        if (ROOT / extra).exists():
            shutil.copy2(ROOT / extra, dest / extra)
    return dest


def _installed_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).parts
    return "/".join([*FOLDERS[folder].split("."), *rest])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    try:
        import setuptools  # noqa: F401
    except ImportError:
        pytest.skip("setuptools is not installed in this environment: the wheel cannot be built without isolation")
    base = tmp_path_factory.mktemp("wheel")
    source = _copy_sources(base / "src")
    out = base / "out"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = out.glob("moe_selector-*.whl")
    return zipfile.ZipFile(path)


@pytest.mark.slow
def test_wheel_installs_selector_alone(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    tops = {name.split("/")[0] for name in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and next(iter(dist_info)).startswith("moe_selector-")
    assert tops - dist_info == {"selector"}, f"top-level names in the wheel: {sorted(tops)}"
    sources = sorted(_installed_name(p) for m in project_modules().values() for p in [m.path])
    missing = [s for s in sources if s not in names]
    assert not missing, f"modules left out of the wheel: {missing}"


@pytest.mark.slow
def test_wheel_entry_points_name_the_installed_plugins(wheel: zipfile.ZipFile) -> None:
    (dist_info,) = {n.split("/")[0] for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info")}
    text = wheel.read(f"{dist_info}/entry_points.txt").decode()
    sections: dict[str, dict[str, str]] = {}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            current = line.strip("[]")
        elif "=" in line:
            key, value = (part.strip() for part in line.split("=", 1))
            sections.setdefault(current, {})[key] = value
    backends = sections.get("selector.backends", {})
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["selector.backends"]
    assert backends == declared and backends
    assert all(target.startswith("selector.plugins.") for target in backends.values()), backends
    names = set(wheel.namelist())
    for target in backends.values():
        path = target.split(":")[0].replace(".", "/")
        assert f"{path}/__init__.py" in names or f"{path}.py" in names, f"entry point {target} is not in the wheel"
    assert sections.get("console_scripts", {}).get("selector") == "selector.cli:main"


@pytest.mark.slow
def test_wheel_names_the_licence_and_carries_its_text(wheel: zipfile.ZipFile) -> None:
    (dist_info,) = {n.split("/")[0] for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info")}
    metadata = wheel.read(f"{dist_info}/METADATA").decode()
    headers = metadata.split("\n\n", 1)[0].splitlines()
    licence = [h for h in headers if h.startswith(("License:", "License-Expression:"))]
    assert licence and all(h.split(":", 1)[1].strip() == "Apache-2.0" for h in licence), headers
    licence_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence_text and "Version 2.0, January 2004" in licence_text
    (shipped,) = [n for n in wheel.namelist() if n.startswith(f"{dist_info}/") and n.rsplit("/", 1)[1] == "LICENSE"]
    assert wheel.read(shipped).decode() == licence_text


@pytest.mark.slow
def test_wheel_carries_the_package_data(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    expected = set()
    for package, patterns in data.items():
        folder = next(ROOT / f / package[len(p):].lstrip(".").replace(".", "/")
                      for f, p in sorted(FOLDERS.items(), key=lambda fp: -len(fp[1])) if package.startswith(p))  # fmt: skip
        for pattern in patterns:
            matched = sorted(folder.glob(pattern))
            assert matched, f"package data {package}:{pattern} matches nothing in the tree"
            expected.update(_installed_name(p) for p in matched)
    assert "selector/py.typed" in expected
    assert any(n.startswith("selector/plugins/triton_fused/configs/") and n.endswith(".json") for n in expected)
    missing = sorted(expected - names)
    assert not missing, f"package data left out of the wheel: {missing}"


# --- CI and README -------------------------------------------------------------------------------------------------


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)[:2]]


def test_ci_runs_the_readme_commands() -> None:
    """.ci/run does what the README's two commands at the top say: set up, doctor, the two test lanes."""
    setup, tests = _readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    plain = re.sub(r" -q\b", "", ci)
    for step in (part.strip() for part in setup.split("&&")):
        if step not in (". .venv/bin/activate", "python3 -m venv .venv"):
            assert step in plain, f"the README's set-up step {step!r} is not in .ci/run"
    lanes = re.findall(r'-m "([^"]+)"', tests)
    assigned = dict(re.findall(r"^(FAST|REST)='([^']+)'$", ci, flags=re.M))
    assert lanes == [assigned["FAST"], assigned["REST"]]
    assert {"interpreter", "compile", "slow"} <= set(re.findall(r"\w+", lanes[1]))
