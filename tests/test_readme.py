"""The documentation's Python blocks run, so its examples never rot.

README.md: every ```python block runs as pasted, each in a fresh interpreter. docs/*.md named in DOCS: the blocks
of one page continue one another (a later block uses the model an earlier one built), so they run in order in one
interpreter, as a reader pastes them. A block that cannot run on a CPU box (a GPU, a long compile) says so on the
line above its fence, `<!-- not run: why -->`, and is left out (README's blocks may not). Nothing may reach
the network.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?:<!-- not run: (?P<why>.*?) -->\n)?```python\n(?P<code>.*?)^```", flags=re.S | re.M)
DOCS = ("docs/plugins.md", "docs/transformers.md")  # pages whose blocks run as one session
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# exec each block in turn in one namespace; a traceback names the page and block
SESSION = """
import json, sys
page, blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for number, code in blocks:
    print(f"--- {page}, python block {number}", flush=True)
    exec(compile(code, f"{page}, python block {number}", "exec"), namespace)
"""


def blocks(page: str) -> list[tuple[str, str | None]]:
    """(code, why it is not run or None) for every ```python block of a page."""
    return [(m["code"], m["why"]) for m in FENCE.finditer((ROOT / page).read_text())]


README_BLOCKS = blocks("README.md")


def _run(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, input=stdin, env=ENV, capture_output=True, text=True, timeout=300
    )


def test_the_readme_has_python_examples() -> None:
    assert len(README_BLOCKS) >= 6
    assert all(why is None for _, why in README_BLOCKS), "every README block runs"


@pytest.mark.slow
@pytest.mark.parametrize("code", [code for code, _ in README_BLOCKS],
                         ids=[f"block-{i}" for i in range(len(README_BLOCKS))])
def test_a_readme_block_runs_as_pasted(code: str, tmp_path: Path) -> None:
    run = _run(["-c", code], tmp_path)
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.stdout.strip(), "an example prints what it shows"


@pytest.mark.slow
@pytest.mark.parametrize("page", DOCS)
def test_a_pages_blocks_run_in_order(page: str, tmp_path: Path) -> None:
    found = blocks(page)
    runnable = [(number, code) for number, (code, why) in enumerate(found) if why is None]
    assert runnable, f"{page} has no runnable python block"
    run = _run(["-c", SESSION], tmp_path, stdin=json.dumps([page, runnable]))
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    shown = [line for line in run.stdout.splitlines() if not line.startswith(f"--- {page}, python block ")]
    assert shown, f"{page}: the examples print what they show"
