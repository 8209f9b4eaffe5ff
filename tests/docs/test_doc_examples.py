"""Every Python example of the documentation runs, so none can rot.

Each ```python block of every page under docs/ is executed in a fresh
namespace, in the order of its page; none is skipped.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PYTHON_BLOCK = re.compile(r"^[ \t]*```python\n(.*?)^[ \t]*```", re.S | re.M)  # nested in lists too


def python_blocks() -> list[tuple[str, int, str]]:
    """(page, index of the block on its page, code) of every python block under docs/."""
    blocks = []
    for page in sorted(DOCS.rglob("*.md")):
        name = page.relative_to(DOCS).as_posix()
        for index, code in enumerate(PYTHON_BLOCK.findall(page.read_text())):
            blocks.append((name, index, textwrap.dedent(code)))
    return blocks


def test_the_documentation_has_python_examples():
    assert python_blocks(), "no ```python block under docs/"


@pytest.mark.parametrize(
    ("page", "index", "code"),
    [pytest.param(*block, id=f"{block[0]}-{block[1]}") for block in python_blocks()],
)
def test_python_example_runs(page, index, code):
    exec(compile(code, f"docs/{page} (python block {index})", "exec"), {"__name__": "__doc__"})
