"""The `decodespec` command: `decodespec ...` or `python -m decodespec.reference ...`.

Ctrl-C at any moment (while Python imports torch, while the model loads,
while tokens stream) ends the command with exit status 130 and one line on
stderr, never a traceback. The handler goes in before anything else of the
command is imported: this module imports only `os`, `signal` and `sys` (not
even `typing`), and `cli` (torch, the spec, the engine) comes after.

The process ends in the handler, at once: raising KeyboardInterrupt instead
would unwind through half-imported modules and half-built state, any of which
may print a traceback of its own on the way out. What was printed stays
printed. Only the interpreter's own startup (tens of milliseconds, before any
code of ours runs) is out of reach: a Ctrl-C there is Python's.

`OMP_WAIT_POLICY` is set to PASSIVE here, before torch loads its OpenMP
runtime, unless the user set it: see `QUIET_OPENMP`.
"""

import os
import signal
import sys

# The exit status of a command ended by SIGINT (128 + 2), as shells report it.
INTERRUPTED_STATUS = 130
# PyTorch's OpenMP threads spin after each parallel operation (libgomp's default),
# holding the cores the quantized projections' own threads need between them
# (`cpu_linear`, `native_quantized.c`): SmolLM2-135M's int4 decode ran at 40
# tokens/s spun against, 63 with them asleep, and its prefill 2% slower (scratch
# runs in-process, 2 cores; docs/quantization.md).
QUIET_OPENMP = ("OMP_WAIT_POLICY", "PASSIVE")


def _interrupted(signum: int, frame: object) -> None:
    """SIGINT: flush what was written, say why it stopped in one line, exit 130."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C changes nothing
    try:
        sys.stdout.flush()
    except BaseException:  # a closed pipe, or a write in progress: what was written stays
        pass
    # On a terminal the interrupted text and the echoed ^C share a line: start a new one.
    newline = "\n" if sys.stderr.isatty() else ""
    try:
        sys.stderr.write(f"{newline}decodespec: interrupted\n")
        sys.stderr.flush()
    except BaseException:  # stderr is gone: the exit status still says it
        pass
    os._exit(INTERRUPTED_STATUS)


def main() -> None:
    """The console script's entry point."""
    signal.signal(signal.SIGINT, _interrupted)
    os.environ.setdefault(*QUIET_OPENMP)  # read once, when torch loads libgomp
    from .cli import main as run_command

    sys.exit(run_command())


if __name__ == "__main__":
    main()
