"""Ctrl-C on `decodespec generate`: exit status 130 and one line, never a traceback.

The installed command runs in a real process and gets SIGINT in each phase of
its life: while Python imports torch (before the model starts loading), while
the model loads, and while tokens stream. A phase is recognised from what the
process has printed, and each test checks afterwards that the signal really
arrived in that phase.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from decodespec.reference.weight_formats import WEIGHT_FORMATS
from tests.engine.test_cli import REPO, installed_command

INTERRUPTED = "decodespec: interrupted"
# What the command may print on stderr before it is interrupted: load progress.
# The load, the format's summary (`int4 (auto: ...): ...`), then what computes the answers.
PROGRESS = ("loading ", *(f"{name} " for name in WEIGHT_FORMATS), "loaded ", "path: ")
TIMEOUT_S = 120


class Command:
    """`decodespec generate` in a process whose output is read as it comes."""

    def __init__(self, *argv: str) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [*installed_command(), "generate", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        )
        self._out = bytearray()
        self._err = bytearray()
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self._out)),
            threading.Thread(target=self._read, args=(self.process.stderr, self._err)),
        ]
        for reader in self._readers:
            reader.start()

    def maps_torch(self) -> bool:
        """Whether the process has mapped a file of torch's (its import has begun)."""
        try:
            return "torch" in Path(f"/proc/{self.process.pid}/maps").read_text()
        except OSError:  # no /proc (not Linux), or the process has ended
            return True

    @staticmethod
    def _read(pipe, into: bytearray) -> None:
        while chunk := os.read(pipe.fileno(), 4096):
            into.extend(chunk)

    @property
    def out(self) -> str:
        return self._out.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self._err.decode("utf-8", "replace")

    def wait_for(self, what: str, condition) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(f"the command ended before {what}:\n{self.out}\n{self.err}")
            if time.monotonic() > deadline:
                self.process.kill()
                pytest.fail(f"no {what} within {TIMEOUT_S} s")
            time.sleep(0.005)

    def interrupt(self) -> tuple[int, str, str]:
        """SIGINT now; (exit status, stdout, stderr) once the process has ended."""
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout=TIMEOUT_S)
        finally:
            self.process.kill()
            for reader in self._readers:
                reader.join(timeout=10)
        return code, self.out, self.err


def assert_one_line(code: int, err: str) -> None:
    assert code == 130, f"exit status {code}, stderr:\n{err}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = err.splitlines()
    assert lines[-1] == INTERRUPTED, err
    assert all(line.startswith(PROGRESS) for line in lines[:-1]), err


def test_interrupt_while_python_imports():
    """The signal goes in as torch starts loading: the command's handler is in by then
    (`reference/__main__.py`). Not after a fixed delay: on a busy machine the
    interpreter's own startup, which is Python's to interrupt, can outlast it."""
    command = Command("Tell me a story.", "--max-tokens", "64")
    command.wait_for("torch's import", command.maps_torch)
    assert not command.err, "the command got past its imports before the signal"
    code, out, err = command.interrupt()
    assert_one_line(code, err)
    assert not err.startswith(PROGRESS), "the signal arrived after the imports"
    assert out == ""


@pytest.mark.parametrize("delay_s", [0.1, 0.6, 1.5])
def test_interrupt_at_any_early_moment(delay_s):
    """A spread of moments from the first tenth of a second of the imports on: each
    is an import, the loader or the first steps, and each ends the same way.

    The moments count from when torch starts loading, which is after the command's
    handler is in (`reference/__main__.py`): the interpreter's own startup comes
    before it, and on a busy machine it alone can take longer than 0.1 s."""
    command = Command("Tell me a story.", "--max-tokens", "64")
    command.wait_for("torch's import", command.maps_torch)
    started = time.monotonic()
    time.sleep(max(0.0, delay_s - (time.monotonic() - started)))
    assert_one_line(*command.interrupt()[::2])


def test_interrupt_while_the_model_loads():
    command = Command("Tell me a story.", "--max-tokens", "64")
    command.wait_for("the model load", lambda: "loading " in command.err)
    code, out, err = command.interrupt()
    assert_one_line(code, err)
    assert "loaded " not in err, "the signal arrived after the model had loaded"
    assert out == ""


def test_interrupt_while_tokens_stream():
    """The text already streamed stays on stdout; no stats line follows it."""
    command = Command("Tell me a long story about a dragon.", "--max-tokens", "200")
    command.wait_for("the first token", lambda: command.out.strip() != "")
    code, out, err = command.interrupt()
    assert_one_line(code, err)
    assert out.strip(), "the streamed text is kept"
    assert "finish:" not in err, "the command had finished before the signal"


def test_the_command_imports_nothing_heavy_before_taking_over_sigint():
    """The console script's module must not import torch (or anything slow) before it
    installs its handler: that import would be a window where Ctrl-C prints a
    traceback."""
    probe = (
        "import sys; import decodespec.reference.__main__ as entry; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'numpy', 'typing', 'decodespec'}))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=Path("/")
    ).stdout.strip()
    assert loaded == "['decodespec', 'decodespec.reference', 'decodespec.reference.__main__']"
