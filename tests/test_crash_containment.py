"""A crash or a hang in a test fails `make test` promptly, with its summary, and never
hangs it (issue 58: a peer's SIGILL crashed two xdist workers, which were replaced,
and the run then waited at 98% for 40 minutes).

Each test runs pytest, as `make test` does (two workers, whole files each, this
project's pyproject.toml), on a small suite in a temporary folder in which one
test dies the way a native peer dies, or never returns. The stand-in dies inside
the test's own process, as an unguarded native call would: tests/peers/child.py
keeps llama.cpp's crashes out of the workers; this checks the last line of defence.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ("-n", "2", "--dist", "loadfile", "--max-worker-restart=0")  # the Makefile's
BOUND_S = 240  # pytest with two workers starting on a busy 2-core machine, and the tests

QUIET_TESTS = """
import time
import pytest

@pytest.mark.parametrize("i", range(4))
def test_quiet(i):
    time.sleep(0.2)
"""


def run_pytest(folder: Path) -> tuple[subprocess.CompletedProcess, float]:
    command = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml")]
    command += ["--rootdir", str(folder), "-p", "no:cacheprovider", *WORKERS, str(folder)]
    start = time.monotonic()
    done = subprocess.run(
        command, cwd=folder, capture_output=True, text=True, timeout=BOUND_S, check=False
    )  # a hang raises TimeoutExpired: this test fails
    return done, time.monotonic() - start


def write_suite(folder: Path, dying_test: str) -> None:
    """The stand-in suite, with this project's plugins (tests/conftest.py's)."""
    (folder / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\npytest_plugins = ['tests.watchdog']\n"
    )
    (folder / "test_quiet.py").write_text(QUIET_TESTS)
    (folder / "test_peer.py").write_text(textwrap.dedent(dying_test))


@pytest.mark.parametrize(
    ("signal_name", "words"), [("SIGILL", "Illegal instruction"), ("SIGSEGV", "Segmentation fault")]
)
def test_a_worker_killed_by_a_signal_fails_the_run_at_once(tmp_path, signal_name, words):
    write_suite(
        tmp_path,
        f"""
        import time
        from tests.peers import standin_peer

        def test_before():
            time.sleep(0.2)

        def test_the_peer_dies():
            standin_peer.die("{signal_name}")

        def test_after():
            time.sleep(0.2)
        """,
    )
    done, elapsed = run_pytest(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert "crashed while running 'test_peer.py::test_the_peer_dies'" in out, out[-4000:]
    assert f"Fatal Python error: {words}" in out, out[-4000:]
    assert "short test summary info" in done.stdout, out[-4000:]
    assert "FAILED test_peer.py::test_the_peer_dies" in done.stdout, out[-4000:]
    assert done.stdout.count("crashed while running") <= 2, "the crashing test was run again"
    assert elapsed < BOUND_S


def test_a_test_that_never_returns_fails_at_its_timeout(tmp_path):
    """pytest-timeout fails it, and the others run on."""
    write_suite(
        tmp_path,
        """
        import time
        import pytest

        @pytest.mark.timeout(5)
        def test_the_peer_hangs():
            time.sleep(3600)

        def test_after():
            pass
        """,
    )
    done, elapsed = run_pytest(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert "Failed: Timeout (>5.0s) from pytest-timeout" in done.stdout, out[-4000:]
    assert "FAILED test_peer.py::test_the_peer_hangs" in done.stdout, out[-4000:]
    assert "1 failed, 5 passed" in done.stdout, out[-4000:]
    assert elapsed < BOUND_S


def test_a_test_stuck_where_no_signal_reaches_ends_its_worker(tmp_path):
    """A test that pytest-timeout's signal cannot interrupt (stuck in C code; here the
    signal is blocked) is ended by the watchdog (tests/watchdog.py): its stack on
    stderr, its worker gone, the run over."""
    write_suite(
        tmp_path,
        """
        import signal
        import time
        import pytest

        @pytest.mark.timeout(3)
        def test_the_peer_hangs_in_c():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        """,
    )
    done, elapsed = run_pytest(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert "Timeout (0:00:08.3" in out and "in test_the_peer_hangs_in_c" in out, out[-4000:]
    assert "crashed while running 'test_peer.py::test_the_peer_hangs_in_c'" in out, out[-4000:]
    assert "short test summary info" in done.stdout, out[-4000:]
    assert elapsed < BOUND_S


def test_the_project_configures_both_guards():
    """What the two tests above rely on, in the configuration `make test` reads."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    options = options["ini_options"]
    assert options["timeout_method"] == "signal" and 0 < options["timeout"] <= 1800
    recipe = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "-n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0" in recipe
