"""MkDocs hook: the performance page, the peers page and every figure, from measured data.

At build time it adds `performance.md` (rendered from `results/*.json` by
`docs.tools.performance`) and the SVG figures under `assets/figures/` (drawn
from `results/` and `docs/data/` by `docs.tools.figures`) to the site's files,
and fills each page's `<!-- measured: NAME -->` markers with the device,
date and command of that data file, so pages, figures and captions always
show the data files they were built with. It fills `peers.md` from
`results/peers.json` (`make peers`) with `docs.tools.peers`, and the
`<!-- structured-results -->` marker of `structured.md` from
`results/structured-cpu.json` (`make bench-structured`), and the
`<!-- quant-results -->` marker of `quantization.md` from
`results/quant-cpu.json` (`make bench-quant`) with `docs.tools.quant`, and the
Determinism page's tables from `results/determinism*.json` with `docs.tools.determinism`,
and the `<!-- checks-table -->` marker of `peers.md` from `results/check-*.json`
(`make check-servers`) with `docs.tools.checks`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

# MkDocs loads hooks by path: make the repository's `docs.tools` importable.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from docs.tools import checks, determinism, peers  # noqa: E402
from docs.tools.figures import RESULTS_DIR, all_figures, fill_captions, read_json  # noqa: E402
from docs.tools.performance import (  # noqa: E402
    STRUCTURED_FILE,
    performance_figures,
    performance_page,
    structured_section,
)
from docs.tools.quant import QUANT_FILE, QUANT_MARKER, quant_figures, quant_section  # noqa: E402

PERFORMANCE_PAGE = "performance.md"
STRUCTURED_MARKER = "<!-- structured-results -->"


def generated_files(config: MkDocsConfig) -> list[File]:
    """The performance page and the figures, as files MkDocs builds like any other."""
    contents = {
        PERFORMANCE_PAGE: performance_page(),
        **all_figures(),
        **performance_figures(),
        **quant_figures(),
    }
    return [File.generated(config, path, content=content) for path, content in contents.items()]


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated files, replacing any file of the same path in `docs/`."""
    for file in generated_files(config):
        existing = files.get_file_from_path(file.src_uri)
        if existing is not None:
            files.remove(existing)
        files.append(file)
    return files


def peers_page(markdown: str) -> str:
    """peers.md: the matrix of `results/peers.json`, the peers' versions, the loop and
    mask-order comparisons, and `decodespec check`'s table of `results/check-*.json`."""
    matrix = peers.load()
    machine = matrix["machine"]
    measured = (
        f"*Measured {matrix['date']} on {machine['device']} ({machine['cores']} cores, "
        f"torch {machine['torch']}, Python {machine['python']}) with `{matrix['command']}`, "
        f"hypothesis profile `{matrix['hypothesis_profile']}`: `results/peers.json`.*"
    )
    for marker, text in (
        ("<!-- peers-measured -->", measured),
        ("<!-- peers-versions -->", peers.versions_markdown(matrix)),
        ("<!-- peers-matrix -->", peers.matrix_markdown(matrix)),
        ("<!-- peers-loop -->", peers.loop_markdown(matrix)),
        ("<!-- peers-mask-order -->", peers.mask_order_markdown(matrix)),
        (checks.MARKER, checks.section()),
    ):
        markdown = markdown.replace(marker, text)
    return markdown


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Fill the `<!-- measured: NAME -->` captions under the figures, the peers page and
    the structured-outputs and weight-formats pages' results."""
    if page.file.src_uri == "peers.md":
        markdown = peers_page(markdown)
    if page.file.src_uri == "structured.md":
        report = read_json(RESULTS_DIR / STRUCTURED_FILE)
        markdown = markdown.replace(STRUCTURED_MARKER, structured_section(report, link=False))
    if page.file.src_uri == "quantization.md":
        report = read_json(RESULTS_DIR / QUANT_FILE)
        markdown = markdown.replace(QUANT_MARKER, quant_section(report, level=3))
    if page.file.src_uri == "determinism.md":
        markdown = determinism.fill(markdown)
    return fill_captions(markdown)
