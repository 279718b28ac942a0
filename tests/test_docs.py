"""The docs stay true: the support matrix matches the backends' declarations, and every
```python block in docs/*.md and README.md runs.

Blocks of one page run in order in one fresh interpreter (so a page can build on its
earlier blocks, and environment variables or registrations do not leak between pages).
A block preceded by ``<!-- no-test ... -->`` is skipped: keep that for GPU-only or
compile-heavy snippets.
"""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md")) + ([REPO / "README.md"] if (REPO / "README.md").exists() else [])
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.S)


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_backends", DOCS / "gen_backends.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a markdown page, minus those marked <!-- no-test -->."""
    blocks = []
    for match in BLOCK.finditer("\n" + text):
        if "<!-- no-test" not in match.group("before"):
            blocks.append(match.group("code"))
    return blocks


def test_support_matrix_matches_declarations():
    gen = _load_generator()
    page = (DOCS / "backends.md").read_text()
    assert gen.splice(page, gen.render()) == page, (
        "docs/backends.md drifted from the backends' declarations: run `python docs/gen_backends.py` and commit it")


def test_generator_sees_every_builtin_backend():
    """Every backend folder in this checkout is in the matrix, whatever is installed here."""
    import attnx.backends

    present = [name for name in attnx.backends.BUILTIN if (REPO / "backends" / name).is_dir()]
    assert [b.name for b in _load_generator().builtin_backends()] == present


_RUNNER = """
import json, sys, traceback
page, blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__docs__"}
for index, code in enumerate(blocks):
    try:
        exec(compile(code, f"{page} python block {index + 1}", "exec"), namespace)
    except BaseException:
        print(f"--- {page}: python block {index + 1} failed:\\n{code}\\n---", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_code_examples_run(page):
    blocks = python_blocks(page.read_text())
    if not blocks:
        pytest.skip("no python blocks")
    env = {k: v for k, v in __import__("os").environ.items() if k != "ATTNX_BACKEND"}
    env["PYTHONPATH"] = str(REPO) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "")  # examples are CPU-sized
    proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps([page.name, blocks]), cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
