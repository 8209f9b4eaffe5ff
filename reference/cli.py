"""decodespec command line.

`decodespec generate PROMPT` streams a completion from the bundled
SmolLM2-135M-Instruct (or `--model PATH`, `cli_generate.py`); `decodespec
serve` answers the OpenAI API (`cli_serve.py`); `decodespec perplexity` scores
a text with each weight format (`perplexity.py`); `decodespec demo` shows the
sampling stage on example logits (`cli_demo.py`). Each command's module adds
its own subcommand; what they share is `cli_options.py`. The console script
enters through `__main__.py`, which takes over Ctrl-C before this module is
imported.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence

from . import cli_check, cli_demo, cli_generate, cli_serve, perplexity


def build_parser() -> argparse.ArgumentParser:
    """The `decodespec` parser: each command's module adds its own subcommand."""
    parser = argparse.ArgumentParser(prog="decodespec", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (cli_generate, cli_serve, cli_check, perplexity, cli_demo):
        command.add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        # Bad input is the user's to fix: a clear message, no traceback.
        print(f"decodespec: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Point stdout at /dev/null so
        # the interpreter's final flush does not raise again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            pass  # stdout is not a file descriptor (tests)
        return 1
