"""Every Python example of the documentation runs, so none can rot.

Each ```python block of every page under docs/ is executed in a fresh
namespace, in the order of its page; none is skipped. A block that talks to
`decodespec serve` at its documented address (LIVE_URL, the Serve page's
examples) runs against a live server of the bundled model, started once per
session and only when such a block runs, with that address replaced by the
live server's; the code otherwise runs as written.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PYTHON_BLOCK = re.compile(r"^[ \t]*```python\n(.*?)^[ \t]*```", re.S | re.M)  # nested in lists too
# Where the documentation's examples find `decodespec serve` (its default host and port).
LIVE_URL = "http://127.0.0.1:8000"


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


def test_the_serve_page_has_examples_that_need_the_live_server():
    blocks = [code for page, _, code in python_blocks() if page == "serve.md"]
    assert blocks and all(LIVE_URL in code for code in blocks)


@pytest.mark.parametrize(
    ("page", "index", "code"),
    [pytest.param(*block, id=f"{block[0]}-{block[1]}") for block in python_blocks()],
)
def test_python_example_runs(page, index, code, request):
    if LIVE_URL in code:
        code = code.replace(LIVE_URL, request.getfixturevalue("live_server").url)
    # dont_inherit: run it as a user's script runs, without this module's
    # `from __future__ import annotations` (pydantic models need real annotations).
    name = f"docs/{page} (python block {index})"
    exec(compile(code, name, "exec", dont_inherit=True), {"__name__": "__doc__"})
