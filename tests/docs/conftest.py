"""Fixtures of the documentation tests: the site, built once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `mkdocs build --strict` writes it, in a temporary directory.

    The build runs once per session with the interpreter running the tests,
    so the venv's mkdocs and the project's sources are the ones documented.
    A failed build fails every test that uses the site, with mkdocs' output.
    """
    site = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner, not a warning
        capture_output=True,
        text=True,
        timeout=600,
    )
    if build.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}")
    return site
