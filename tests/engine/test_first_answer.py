"""`make run`'s answer: the first thing a newcomer sees is a short, right answer.

The test reads the question and the command line of `make run` from the Makefile
and runs that command (in-process, `decodespec.reference.cli.main`) on the bundled
model's default path: the GGUF file's own int4 blocks, the torch backend, greedy.
The answer must end at EOS ("stop") well before the token limit, not loop, and say
Paris; its first token must be a clear choice, not a near tie that a rounding could
turn (the question alone, "What is the capital of France?", is one on this path:
'L' 14.2% against 'The' 14.2%, and greedy follows 'L' into a loop; README, Quick
start).
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from decodespec.reference import cli
from decodespec.reference.model_files import bundled_model_path

REPO = Path(__file__).resolve().parents[2]
STATS = re.compile(r"^\[(?P<tokens>\d+) tokens, finish: (?P<finish>\w+),", re.MULTILINE)
CELL = re.compile(  # one candidate of the `first token:` line, as test_cli's parse_step reads
    r"(?P<mark>[▶ ])(?P<token>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\") +(?P<p>[\d.]+)%"
)
MAX_TOKENS = 256  # generate's default limit, which make run keeps


def make_run_argv() -> list[str]:
    """The `decodespec` arguments `make run` passes, with the Makefile's default PROMPT."""
    makefile = (REPO / "Makefile").read_text()
    prompt = re.search(r"^PROMPT \?= (.*)$", makefile, re.MULTILINE)
    recipe = re.search(r"^run:.*\n\t(.*)$", makefile, re.MULTILINE)
    assert prompt and recipe, "the Makefile has no PROMPT default or no run recipe"
    command = shlex.split(recipe[1].replace("$(PROMPT)", prompt[1].strip()))
    assert command[:2] == ["$(VENV)/bin/decodespec", "generate"], command
    return command[1:]


def repeated_ngram(words: list[str], n: int) -> tuple[str, ...] | None:
    """The first run of n words that occurs twice in `words`, or None."""
    seen: set[tuple[str, ...]] = set()
    for i in range(len(words) - n + 1):
        gram = tuple(words[i : i + n])
        if gram in seen:
            return gram
        seen.add(gram)
    return None


@pytest.fixture(scope="module")
def make_run() -> tuple[list[str], int, str, str]:
    """(argv, exit status, stdout, stderr) of `make run`'s generation."""
    try:
        bundled_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    argv = make_run_argv()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return argv, code, out.getvalue(), err.getvalue()


def test_make_run_runs_the_default_path(make_run):
    argv, code, _, err = make_run
    assert code == 0, err
    # No flag that leaves the default path: the file's own int4 blocks, greedy.
    for flag in ("--weights", "--backend", "--temperature", "--system", "--raw", "--model"):
        assert flag not in argv, argv
    assert "int4 (auto: the file's Q4_1 blocks)" in err, err
    assert "backend torch" in err, err


def test_make_run_answers_paris_and_stops(make_run):
    _, code, out, err = make_run
    assert code == 0, err
    answer = out.strip()
    stats = STATS.search(err)
    assert stats, err
    assert stats["finish"] == "stop", f"no EOS: {answer!r}"
    assert int(stats["tokens"]) <= 32 < MAX_TOKENS, answer
    words = re.findall(r"\w+", answer.lower())
    assert repeated_ngram(words, 3) is None, f"a loop: {answer!r}"
    assert "Paris" in answer, answer


def test_make_run_shows_a_clear_first_token(make_run):
    """The first step's candidates are on stderr (`--first-probs`), the chosen one the
    most likely, and not a near tie: at least twice as likely as the runner-up."""
    _, code, out, err = make_run
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("first token: ")]
    assert len(lines) == 1, err
    cells = list(CELL.finditer(lines[0]))
    assert len(cells) >= 2, lines[0]
    assert cells[0]["mark"] == "▶" and all(c["mark"] == " " for c in cells[1:]), lines[0]
    assert out.startswith(ast.literal_eval(cells[0]["token"])), (out, lines[0])
    first, second = float(cells[0]["p"]), float(cells[1]["p"])
    assert first >= 2 * second, f"a near tie: {lines[0]}"
