"""The `decodespec` command on the bundled SmolLM2-135M-Instruct: output, flags, errors.

The model loads once per module. Each CLI call runs in-process (`decodespec.reference.cli.main`)
with the commands' loader (`cli_options.load_model_with_progress`, as `cli_generate` and
`cli_serve` imported it) patched to return
that model, so a call costs its generation only; a `--model PATH` still goes to the real loader. Two
runs of the installed command check the real process. The greedy continuation is
compared token for token with transformers reading the same GGUF file.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import io
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from decodespec import kernels
from decodespec.reference import cli, cli_demo, cli_generate, cli_options, cli_serve
from decodespec.reference import runner as runner_module
from decodespec.reference.engine import Engine
from decodespec.reference.loader import load_model
from decodespec.reference.model_files import bundled_model_path
from decodespec.reference.weight_formats import convert_weights
from decodespec.spec.params import PARAMETERS, SamplingParams
from tests.engine.checkpoints import hf_model_from_gguf

QUESTION = "What is the capital of France?"
REPO = Path(__file__).resolve().parents[2]
REAL_LOAD = cli_options.load_model_with_progress  # the CLI's own loader, before any test patches it
JSON_KEYS = {
    "text",
    "token_ids",
    "finish_reason",
    "seed",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "ttft_s",
    "tokens_per_s",
    "path",
}
STATS = re.compile(
    r"^\[(?P<tokens>\d+) tokens, finish: (?P<finish>\w+), seed: (?P<seed>\d+), "
    r"TTFT (?P<ttft>[\d.]+ s|-), (?P<rate>[\d.]+|-) tokens/s, "
    r"prompt (?P<prompt>\d+) tokens \((?P<cached>\d+) cached\), "
    r"backend (?P<backend>\w+)(?P<naive>, naive)?\]$",
    re.MULTILINE,
)
GREEDY_TOKENS = 12


# ---------------------------------------------------------------- running the CLI


@dataclasses.dataclass
class Run:
    code: int
    out: str
    err: str
    loads: list[str | None]  # the --model values the CLI asked its loader for

    def json(self) -> dict:
        assert self.code == 0, self.err
        lines = self.out.splitlines()
        assert len(lines) == 1 and self.out == lines[0] + "\n", f"not one line: {self.out!r}"
        return json.loads(lines[0])

    def error_line(self) -> str:
        """The one `decodespec: error:` line, last on stderr, after no traceback."""
        assert "Traceback" not in self.err, self.err
        lines = self.err.splitlines()
        errors = [line for line in lines if line.startswith("decodespec: error: ")]
        assert errors == lines[-1:], f"expected one final error line: {self.err!r}"
        return errors[0]


def run_cli(model: tuple | None, *argv: str) -> Run:
    """`decodespec ARGV` in-process, the default model being `model`."""
    loads: list[str | None] = []

    def load(path: str | None, weights: str | None = None) -> tuple:
        loads.append(path)
        if path is not None:
            return REAL_LOAD(path, weights)
        # The bundled file's own format (`auto`, the default) is int4; the stand-in
        # stays float32, the references these tests compare against. The real default
        # is checked in a real process (test_installed_command_end_to_end).
        if weights in (None, "float32", "auto"):
            return model
        return convert_weights(model[0], weights), model[1]

    out, err = io.StringIO(), io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        for command in (cli_generate, cli_serve):
            patch.setattr(command, "load_model_with_progress", load)
        code = cli.main(list(argv))
    return Run(code, out.getvalue(), err.getvalue(), loads)


def installed_command() -> list[str]:
    script = Path(sys.executable).with_name("decodespec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "decodespec.reference"]


class Installed:
    """The installed command in a real process, started now and read when needed."""

    def __init__(self, *argv: str) -> None:
        self.process = subprocess.Popen(
            [*installed_command(), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            cwd=REPO,
            env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        )
        self._result: tuple[int, str, str] | None = None

    def result(self) -> tuple[int, str, str]:
        """(exit status, stdout, stderr)."""
        if self._result is None:
            out, err = self.process.communicate(timeout=300)
            self._result = (self.process.returncode, out, err)
        return self._result

    def close(self) -> None:
        if self._result is None:
            self.process.kill()
            self.result()


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


# ---------------------------------------------------------------- shared runs


@pytest.fixture(scope="module")
def bundled() -> Path:
    try:
        return bundled_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def model(bundled):
    return load_model(bundled)


# The greedy run shared by several tests (and repeated with --naive).
GREEDY_ARGS = (
    "generate",
    QUESTION,
    "--json",
    "--ignore-eos",
    "--max-tokens",
    str(GREEDY_TOKENS),
    "--logprobs",
    "5",
)


@pytest.fixture(scope="module")
def greedy(model) -> dict:
    """The greedy continuation of QUESTION past EOS, with top-5 logprobs (`--json`)."""
    return run_cli(model, *GREEDY_ARGS).json()


def eos_index(greedy: dict, tokenizer) -> int:
    """Where the greedy answer reaches EOS (the runs below rely on it being early)."""
    ids = greedy["token_ids"]
    hits = [i for i, t in enumerate(ids) if t in tokenizer.eos_token_ids]
    assert hits and hits[0] < len(ids) - 2, f"precondition: an early EOS in {ids}"
    return hits[0]


@pytest.fixture(scope="module")
def installed_answer(bundled):
    """`decodespec generate QUESTION` in a real process, running in the background."""
    run = Installed("generate", QUESTION, "--max-tokens", str(GREEDY_TOKENS))
    yield run
    run.close()


@pytest.fixture(scope="module")
def peer(bundled, installed_answer):
    """transformers' own model from the same GGUF file (its reader, not ours).

    Reading the file takes transformers ~20 s of one core; the installed command's own
    run (`installed_answer`) is started first, so that it runs meanwhile on another.
    """
    pytest.importorskip("transformers")
    hf = hf_model_from_gguf(bundled)
    hf.generation_config.eos_token_id = None  # the greedy run goes past EOS, like --ignore-eos
    return hf


# ---------------------------------------------------------------- generate


def test_generate_streams_the_answer_and_reports_stats(model, greedy):
    _, tokenizer = model
    run = run_cli(model, "generate", QUESTION)
    assert run.code == 0, run.err
    assert run.loads == [None]  # no --model: the bundled model
    eos = eos_index(greedy, tokenizer)
    assert "Paris" in run.out
    assert run.out == tokenizer.decode(greedy["token_ids"][: eos + 1]) + "\n"
    stats = STATS.search(run.err)
    assert stats, run.err
    assert int(stats["tokens"]) == eos + 1
    assert stats["finish"] == "stop"
    assert stats["backend"] == "torch" and not stats["naive"]
    assert float(stats["ttft"].removesuffix(" s")) >= 0 and float(stats["rate"]) > 0
    assert "Traceback" not in run.err


def test_installed_command_exits_2_on_bad_input():
    code, out, err = Installed("generate", "hi", "--top-p", "0").result()
    assert code == 2
    assert out == ""
    assert err.splitlines() == [err.strip()]
    assert err.startswith("decodespec: error: top_p must be in (0, 1]"), err


# ---------------------------------------------------------------- --json


@pytest.mark.clause("STOP-ID-1")
def test_json_is_one_object_and_eos_stays_in_the_ids(model, greedy):
    _, tokenizer = model
    data = run_cli(model, "generate", QUESTION, "--json", "--seed", "5").json()
    assert set(data) == JSON_KEYS  # no logprobs unless asked
    eos = eos_index(greedy, tokenizer)
    ids = data["token_ids"]
    assert ids == greedy["token_ids"][: eos + 1]
    assert data["finish_reason"] == "stop"
    # EOS is the last id but has no text.
    assert ids[-1] in tokenizer.eos_token_ids
    assert data["text"] == tokenizer.decode(ids[:-1]) and "Paris" in data["text"]
    assert "<|im_end|>" not in data["text"]
    assert data["seed"] == 5
    assert data["prompt_tokens"] == len(cli_options.prompt_ids(tokenizer, QUESTION, raw=False))
    assert data["completion_tokens"] == len(ids)
    assert isinstance(data["ttft_s"], float) and data["ttft_s"] > 0
    assert isinstance(data["tokens_per_s"], float) and data["tokens_per_s"] > 0
    assert data["path"].startswith("projections float32 ×211") and "backend torch" in data["path"]


def test_json_logprobs_have_token_rank_and_top_n(model, greedy):
    assert set(greedy) == JSON_KEYS | {"logprobs"}
    assert greedy["finish_reason"] == "length"
    assert greedy["completion_tokens"] == len(greedy["token_ids"]) == GREEDY_TOKENS
    assert len(greedy["logprobs"]) == GREEDY_TOKENS
    for token, entry in zip(greedy["token_ids"], greedy["logprobs"], strict=True):
        assert set(entry) == {"token_id", "logprob", "rank", "top"}
        assert entry["token_id"] == token
        assert entry["logprob"] <= 0 and entry["rank"] == 1  # greedy takes the top token
        top = entry["top"]
        assert len(top) == 5 and all(set(t) == {"token_id", "logprob"} for t in top)
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True)
        assert len({t["token_id"] for t in top}) == 5
        assert (top[0]["token_id"], top[0]["logprob"]) == (token, entry["logprob"])
        assert math.fsum(math.exp(v) for v in values) <= 1 + 1e-5

    zero = run_cli(model, "generate", QUESTION, "--json", "--max-tokens", "2", "--logprobs", "0")
    entries = zero.json()["logprobs"]
    assert [e["top"] for e in entries] == [[], []]
    assert [e["logprob"] for e in entries] == pytest.approx(
        [e["logprob"] for e in greedy["logprobs"][:2]], abs=1e-6
    )


# ---------------------------------------------------------------- greedy = transformers = naive


@pytest.mark.clause("SAMPLE-GREEDY-1", "LOGPROB-RAW-1", "LOGPROB-TOP-1")
def test_greedy_continuation_matches_transformers(model, greedy, peer):
    """Same tokens as transformers' greedy `generate` on the same GGUF (past EOS), and
    logprobs equal to the log-softmax of its logits."""
    _, tokenizer = model
    prompt = torch.tensor([cli_options.prompt_ids(tokenizer, QUESTION, raw=False)])
    with torch.inference_mode():
        result = peer.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = result.sequences[0, prompt.shape[1] :].tolist()
    assert len(expected) == GREEDY_TOKENS, "transformers stopped early"
    for step, logits in enumerate(result.logits):
        reference = torch.log_softmax(logits[0].double(), dim=-1)
        top = reference.topk(6)
        margin = float(top.values[0] - top.values[1])
        assert greedy["token_ids"][step] == expected[step], (
            f"step {step}: ours {greedy['token_ids'][step]}, transformers {expected[step]} "
            f"(its top-2 margin {margin:.2e})"
        )
        entry = greedy["logprobs"][step]
        assert entry["logprob"] == pytest.approx(float(reference[expected[step]]), abs=1e-3)
        ours = [t["logprob"] for t in entry["top"]]
        assert ours == pytest.approx(top.values[:5].tolist(), abs=1e-3)
    assert greedy["token_ids"] == expected


def test_installed_command_end_to_end(bundled, installed_answer):
    """The console script, in a real process: loads the bundled model, streams, reports.
    Its answer is an in-process engine's with the command's defaults (the file's own
    int4 blocks, the torch backend: QUANT-A8-1, as llama.cpp computes the file). On this
    question that is "L'Étoile, la Marseillaise," where float32 answers Paris: a near
    tie of a 135M model, which llama-cpp-python breaks the same way."""
    weights, tokenizer = load_model(bundled, weights="auto")
    engine = Engine(weights, tokenizer, backend="torch")
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS)
    ids = cli_options.prompt_ids(tokenizer, QUESTION, raw=False)
    answer = [e.token_id for e in engine.generate(ids, params) if e.token_id is not None]
    stopped = any(t in tokenizer.eos_token_ids for t in answer)
    code, out, err = installed_answer.result()
    assert code == 0, err
    assert out == tokenizer.decode(answer) + "\n"
    assert "loaded SmolLM2-135M-Instruct.Q4_1.gguf in" in err
    # The file's own format by default, said: int4 with the Q4_1 blocks kept.
    assert "int4 (auto: the file's Q4_1 blocks): 210 kept from Q4_1 blocks" in err
    assert "path: projections int4 g32 ×210, int8 ×1" in err and "backend torch" in err
    stats = STATS.search(err)
    assert stats and int(stats["tokens"]) == len(answer), err
    assert stats["finish"] == ("stop" if stopped else "length"), err
    assert "Traceback" not in err


@pytest.mark.clause("FWD-CACHE-1")
def test_naive_mode_gives_the_same_tokens(model, greedy, monkeypatch):
    calls = {"naive": 0, "cached": 0}

    def counted(kind: str, function):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        runner_module, "forward_naive", counted("naive", runner_module.forward_naive)
    )
    monkeypatch.setattr(  # every pass over the cache, on the native step or not
        runner_module, "hidden_states", counted("cached", runner_module.hidden_states)
    )
    naive = run_cli(
        model,
        *GREEDY_ARGS,
        "--naive",
    ).json()
    assert calls == {"naive": GREEDY_TOKENS, "cached": 0}  # --naive recomputed every step
    assert naive["token_ids"] == greedy["token_ids"]
    assert naive["text"] == greedy["text"]
    for cached, recomputed in zip(greedy["logprobs"], naive["logprobs"], strict=True):
        assert recomputed["logprob"] == pytest.approx(cached["logprob"], abs=1e-4)
        assert [t["logprob"] for t in recomputed["top"]] == pytest.approx(
            [t["logprob"] for t in cached["top"]], abs=1e-4
        )


# ---------------------------------------------------------------- seeded sampling

SAMPLED_FLAGS = ("--temperature", "0.8", "--top-p", "0.9", "--seed", "7")


@pytest.mark.clause("SAMPLE-RNG-3")
def test_seeded_sampling_is_reproducible_and_batch_invariant(model, greedy):
    weights, tokenizer = model
    prompt = cli_options.prompt_ids(tokenizer, QUESTION, raw=False)
    other = cli_options.prompt_ids(tokenizer, "Name three colours.", raw=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)

    # Alone, twice on one engine (the second run reuses the first one's cache blocks).
    engine = Engine(weights, tokenizer)
    first = engine.add_request(prompt, params)
    drain(engine)
    second = engine.add_request(prompt, params)
    drain(engine)
    alone = engine.output(first).token_ids
    assert len(alone) == 8
    assert engine.output(second).token_ids == alone
    assert alone != greedy["token_ids"][:8]  # it did sample

    # In a batch: it joins while another request decodes (row 1), that one finishes
    # (row 0), and a third joins behind it.
    batched = Engine(weights, tokenizer)
    batched.add_request(other, SamplingParams(temperature=1.0, seed=1, max_tokens=5))
    batched.step()
    batched.step()
    target = batched.add_request(prompt, params)
    batched.step()
    batched.add_request(other[:-2], SamplingParams(temperature=0.0, max_tokens=4))
    drain(batched)
    assert batched.output(target).token_ids == alone

    # The command line, with the same flags.
    data = run_cli(
        model, "generate", QUESTION, *SAMPLED_FLAGS, "--max-tokens", "8", "--ignore-eos", "--json"
    ).json()
    assert data["token_ids"] == alone
    assert data["seed"] == 7


@pytest.mark.clause("SAMPLE-SEED-1")
def test_unseeded_run_reports_the_seed_that_replays_it(model):
    args = ("generate", QUESTION, "--temperature", "1.0", "--max-tokens", "6", "--json")
    first = run_cli(model, *args, "--ignore-eos").json()
    assert isinstance(first["seed"], int) and 0 <= first["seed"] < 2**64
    replay = run_cli(model, *args, "--ignore-eos", "--seed", str(first["seed"])).json()
    assert replay["token_ids"] == first["token_ids"]
    assert replay["seed"] == first["seed"]


# ---------------------------------------------------------------- stop conditions


def stop_across_tokens(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A stop string starting inside token k and ending inside token k + 1 of `ids`
    (its first occurrence in their text), and k + 1."""
    text = tokenizer.decode(ids)
    ends = []
    for k in range(len(ids)):
        prefix = tokenizer.decode(ids[: k + 1])
        assert text.startswith(prefix)
        ends.append(len(prefix))
    for k in range(len(ids) - 1):
        begin, boundary, end = (ends[k - 1] if k else 0), ends[k], ends[k + 1]
        if boundary - begin >= 3 and end - boundary >= 3:
            stop = text[boundary - 2 : boundary + 2]
            if text.find(stop) == boundary - 2:
                return stop, k + 1
    pytest.fail(f"precondition: no two neighbouring tokens of 3+ characters in {text!r}")


@pytest.mark.clause("STOP-STR-1", "STOP-STREAM-1")
def test_stop_string_across_tokens_cuts_the_text(model, greedy):
    _, tokenizer = model
    ids = greedy["token_ids"]
    stop, completing = stop_across_tokens(tokenizer, ids)
    args = (
        "generate",
        QUESTION,
        "--ignore-eos",
        "--max-tokens",
        str(GREEDY_TOKENS),
        "--stop",
        "no such text",
        "--stop",
        stop,
    )
    data = run_cli(model, *args, "--json").json()
    expected = greedy["text"][: greedy["text"].index(stop)]
    assert data["text"] == expected
    assert data["finish_reason"] == "stop"
    # The token that completed the match stays, though part of its text is cut.
    assert data["token_ids"] == ids[: completing + 1]

    # Streamed: no part of the stop string was ever printed.
    streamed = run_cli(model, *args)
    assert streamed.code == 0
    assert streamed.out == expected + "\n"
    assert STATS.search(streamed.err)["finish"] == "stop"


@pytest.mark.clause("STOP-LEN-1", "STOP-STREAM-1")
def test_max_tokens_finishes_with_length(model, greedy):
    _, tokenizer = model
    data = run_cli(model, "generate", QUESTION, "--max-tokens", "3", "--json").json()
    assert data["finish_reason"] == "length"
    assert data["completion_tokens"] == 3
    assert data["token_ids"] == greedy["token_ids"][:3]
    text = tokenizer.decode(greedy["token_ids"][:3])
    assert data["text"] == text

    # A text ending in the start of a stop string is held back while streaming,
    # then printed whole when the length limit finishes the request.
    held = run_cli(model, "generate", QUESTION, "--max-tokens", "3", "--stop", text[-2:] + "qq")
    assert held.out == text + "\n"
    assert STATS.search(held.err)["finish"] == "length"


@pytest.mark.clause("STOP-ID-2", "STOP-LEN-1")
def test_ignore_eos_runs_to_the_limit(model, greedy):
    _, tokenizer = model
    eos = eos_index(greedy, tokenizer)  # generated early, and it did not stop the request
    assert greedy["finish_reason"] == "length"
    assert greedy["completion_tokens"] == GREEDY_TOKENS
    assert greedy["token_ids"][eos] in tokenizer.eos_token_ids
    assert greedy["text"] == tokenizer.decode(greedy["token_ids"])  # EOS has no text


@pytest.mark.clause("STOP-PREC-1")
def test_eos_on_the_last_allowed_token_reports_stop(model, greedy):
    _, tokenizer = model
    eos = eos_index(greedy, tokenizer)
    data = run_cli(model, "generate", QUESTION, "--max-tokens", str(eos + 1), "--json").json()
    assert data["token_ids"] == greedy["token_ids"][: eos + 1]
    assert data["finish_reason"] == "stop"


@pytest.mark.clause("STOP-UTF8-1", "STOP-STREAM-1")
def test_characters_split_across_tokens_stream_whole(model):
    """Japanese output: each character's bytes are split over two tokens."""
    weights, tokenizer = model
    prompt = cli_options.prompt_ids(tokenizer, "Write 'naïve café' in Japanese.", raw=False)
    engine = Engine(weights, tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    events = list(engine.generate(prompt, params))
    out = engine.output(events[0].request_id)
    pieces = [tokenizer.token_bytes(t) for t in out.token_ids]

    def incomplete(piece: bytes) -> bool:
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            return True
        return False

    assert any(incomplete(p) for p in pieces), f"precondition: a split character in {pieces}"
    assert out.text == b"".join(pieces).decode("utf-8", errors="replace")
    assert "".join(e.text for e in events) == out.text
    for event in events[:-1]:  # only the final flush may show U+FFFD (a dangling lead byte)
        assert "\ufffd" not in event.text


# ---------------------------------------------------------------- --show-probs

CELL = re.compile(
    r"(?P<mark>[▶ ])(?P<token>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")(?: +(?P<percent>\d+\.\d)%)?"
)


def parse_step(line: str) -> list[tuple[bool, str, float | None]]:
    """(chosen, token text, percent) per cell of one `--show-probs` line."""
    cells = list(CELL.finditer(line))
    assert "  ".join(c.group(0) for c in cells) == line, f"unparsed line {line!r}"
    return [
        (
            c["mark"] == "▶",
            ast.literal_eval(c["token"]),
            float(c["percent"]) if c["percent"] else None,
        )
        for c in cells
    ]


def show_probs_run(run: Run, steps: int) -> tuple[list[list], str]:
    assert run.code == 0, run.err
    lines = run.out.split("\n")
    # `steps` lines, an empty line, the final text, the trailing newline.
    assert len(lines) == steps + 3 and lines[-3] == "" and lines[-1] == "", run.out
    return [parse_step(line) for line in lines[:steps]], lines[-2]


def test_show_probs_prints_candidates_and_the_chosen_token(model, greedy):
    _, tokenizer = model
    ids = greedy["token_ids"][:6]
    run = run_cli(model, "generate", QUESTION, "--show-probs", "5", "--max-tokens", "6")
    steps, final = show_probs_run(run, 6)
    assert final == tokenizer.decode(ids)
    chosen = []
    for cells, token in zip(steps, ids, strict=True):
        assert 1 <= len(cells) <= 5
        marked = [c for c in cells if c[0]]
        assert len(marked) == 1
        assert cells[0][0]  # greedy: the most likely candidate is the one chosen
        assert marked[0][1] == tokenizer.decode([token], skip_special_tokens=False)
        percents = [c[2] for c in cells]
        assert None not in percents and percents == sorted(percents, reverse=True)
        assert math.fsum(percents) <= 100 + 0.05 * len(percents)  # each rounded to 0.1%
        chosen.append(marked[0][1])
    assert "".join(chosen) == final


def test_show_probs_shows_the_distribution_after_the_filters(model):
    run = run_cli(
        model,
        "generate",
        QUESTION,
        "--show-probs",
        "5",
        "--max-tokens",
        "4",
        "--temperature",
        "0.8",
        "--top-k",
        "3",
        "--seed",
        "1",
    )
    steps, final = show_probs_run(run, 4)
    chosen = []
    for cells in steps:
        assert 1 <= len(cells) <= 3  # top-k removed the rest
        percents = [c[2] for c in cells]
        assert None not in percents  # the sampled token is one of the kept candidates
        # Every kept token is shown: the probabilities add up to 100%, up to rounding.
        assert math.fsum(percents) == pytest.approx(100, abs=0.05 * len(cells) + 1e-9)
        [marked] = [c for c in cells if c[0]]
        chosen.append(marked[1])
    assert "".join(chosen) == final


def first_token_lines(err: str) -> list[list]:
    """The cells of each `--first-probs` line on stderr."""
    prefix = "first token: "
    return [parse_step(line[len(prefix) :]) for line in err.splitlines() if line.startswith(prefix)]


def test_first_probs_shows_the_first_steps_candidates_on_stderr(model, greedy):
    """`--first-probs N` (what `make run` passes): one line on stderr per prompt, before
    its answer, with the first step's top N, the chosen one marked; stdout is the answer
    as without it, and the first token's probabilities are its logprobs'."""
    _, tokenizer = model
    run = run_cli(model, "generate", QUESTION, "--first-probs", "3", "--max-tokens", "4")
    assert run.code == 0, run.err
    assert run.out == tokenizer.decode(greedy["token_ids"][:4]) + "\n"
    [cells] = first_token_lines(run.err)
    assert run.err.index("first token: ") < STATS.search(run.err).start()
    assert len(cells) == 3 and [c[0] for c in cells] == [True, False, False]
    top = greedy["logprobs"][0]["top"][:3]
    decode = [tokenizer.decode([t["token_id"]], skip_special_tokens=False) for t in top]
    assert [c[1] for c in cells] == decode
    assert [c[2] for c in cells] == pytest.approx(
        [100 * math.exp(t["logprob"]) for t in top], abs=0.051
    )
    # With --show-probs: each step's line its own N, the first step's stderr line its N;
    # with two prompts, a line each.
    both = run_cli(
        model, "generate", QUESTION, "Hi", "--first-probs", "4", "--show-probs", "2",
        "--max-tokens", "3",
    )  # fmt: skip
    assert both.code == 0, both.err
    assert [len(cells) for cells in first_token_lines(both.err)] == [4, 4]
    lines = both.out.splitlines()  # per prompt: 3 steps, an empty line, the text
    assert len(lines) == 10 and lines[3] == lines[8] == "", both.out
    assert [len(parse_step(line)) for line in lines[:3] + lines[5:8]] == [2] * 6
    assert first_token_lines(run_cli(model, "generate", QUESTION, "--max-tokens", "2").err) == []


# ---------------------------------------------------------------- bad input


def _random_file(tmp_path: Path, name: str, head: bytes = b"") -> Path:
    path = tmp_path / name
    path.write_bytes(head + random.Random(name).randbytes(4096))
    return path


def _gpt2_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return tmp_path


def assert_usage_error(run: Run, message: str) -> None:
    """Exit status 2, nothing on stdout, one `decodespec: error:` line, no traceback."""
    assert run.code == 2, run.err
    assert run.out == ""
    assert re.search(message, run.error_line()), run.err


@pytest.mark.parametrize(
    ("make_file", "message"),
    [
        pytest.param(
            lambda tmp: tmp / "missing.gguf", r"missing\.gguf does not exist", id="missing"
        ),
        pytest.param(
            lambda tmp: _random_file(tmp, "x.gguf"),
            r"x\.gguf: not a readable GGUF file",
            id="random-bytes-gguf",
        ),
        pytest.param(
            lambda tmp: _random_file(tmp, "y.gguf", b"GGUF"),
            r"y\.gguf: not a readable GGUF file",
            id="gguf-magic-then-garbage",
        ),
        pytest.param(
            lambda tmp: _random_file(tmp, "model.bin"),
            r"pickled PyTorch checkpoints are refused",
            id="pickle",
        ),
        pytest.param(lambda tmp: _random_file(tmp, "notes.txt"), r"not a model", id="not-a-model"),
        pytest.param(_gpt2_dir, r"unsupported architecture 'gpt2'", id="gpt2-architecture"),
    ],
)
def test_bad_model_path_exits_2(model, tmp_path, make_file, message):
    path = str(make_file(tmp_path))
    run = run_cli(model, "generate", "hi", "--model", path)
    assert_usage_error(run, message)
    assert run.loads == [path]  # the real loader, given --model


# ---------------------------------------------------------------- several prompts


@pytest.mark.clause("LOOP-PREFIX-1")
def test_later_prompts_reuse_the_system_prompts_blocks(model):
    """Two questions after one system message, answered one after another: the
    second maps the cached blocks of the shared prefix, says how many tokens they
    hold, and answers as it does with prefix caching off."""
    _, tokenizer = model
    system = "You are a geography teacher. Answer with one word, then stop."
    argv = ("generate", QUESTION, "Name the largest ocean.", "--system", system)
    flags = ("--max-tokens", "4", "--ignore-eos", "--json")
    cached = run_cli(model, *argv, *flags)
    plain = run_cli(model, *argv, *flags, "--no-prefix-caching")
    first, second = [json.loads(line) for line in cached.out.splitlines()]
    assert cached.code == plain.code == 0, cached.err + plain.err
    ids = [cli_options.prompt_ids(tokenizer, q, False, system) for q in argv[1:3]]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    # The shared prefix's whole blocks, and the rest of it copied from the block of the
    # first request that holds it, if that request's answer filled the block.
    registered = (len(ids[0]) + 4 - 1) // 16 * 16  # the first's prompt and answer
    expected = shared if registered > shared // 16 * 16 else shared // 16 * 16
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == expected > 0
    assert [json.loads(line)["cached_tokens"] for line in plain.out.splitlines()] == [0, 0]
    assert [first["token_ids"], second["token_ids"]] == [
        json.loads(line)["token_ids"] for line in plain.out.splitlines()
    ]
    text = run_cli(model, *argv, "--max-tokens", "2")
    stats = [m["cached"] for m in STATS.finditer(text.err)]
    assert stats == ["0", str(second["cached_tokens"])], text.err


def test_a_system_message_needs_the_chat_template():
    run = run_cli(None, "generate", "hi", "--raw", "--system", "Be brief.")
    assert_usage_error(run, r"--system needs the chat template")
    assert run.loads == []


@pytest.mark.clause("PARAM-RANGE-1")
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "0"], r"top_p must be in \(0, 1\], got 0"),
        (["--temperature", "-1"], r"temperature must be in \[0, inf\), got -1"),
        (["--temperature", "nan"], r"temperature must be in \[0, inf\), got nan"),
        (["--logprobs", "50"], r"logprobs must be in \[0, 20\], got 50"),
        (["--max-tokens", "0"], r"max_tokens must be in \[1, inf\), got 0"),
        (["--top-k", "-1"], r"top_k must be in \[0, inf\), got -1"),
        (["--stop", ""], r"stop strings must be non-empty"),
        (["--seed", "-1"], r"seed must be in \[0, 2\*\*64\), got -1"),
    ],
)
def test_invalid_parameter_exits_2_before_loading(flags, message):
    run = run_cli(None, "generate", "hi", *flags)
    assert_usage_error(run, message)
    assert run.loads == []  # invalid parameters fail before the model loads


@pytest.mark.clause("PARAM-REQUEST-1")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["", "--raw"], r"at least one token", id="empty-raw-prompt"),
        pytest.param(
            ["hi", "--max-tokens", "9000"],
            r"max_tokens=9000 .* exceeds the model's context of 8192",
            id="max-tokens-past-context",
        ),
        pytest.param(
            ["hello " * 8200, "--raw"],
            r"has 8201 tokens; the model's context of 8192 leaves no room",
            id="prompt-longer-than-context",
        ),
    ],
)
def test_request_that_does_not_fit_the_model_exits_2(model, args, message):
    assert_usage_error(run_cli(model, "generate", *args), message)


def test_show_probs_out_of_range_exits_2(model):
    assert_usage_error(
        run_cli(model, "generate", "hi", "--show-probs", "50"), r"show.probs must be in \[0, 20\]"
    )


def test_first_probs_out_of_range_exits_2():
    run = run_cli(None, "generate", "hi", "--first-probs", "21")
    assert_usage_error(run, r"--first-probs must be in \[0, 20\]")
    assert run.loads == []


def test_triton_backend_gives_the_spec_backends_greedy_tokens(model, greedy, monkeypatch):
    """The bundled model through the Triton kernels (in the interpreter without a GPU)."""
    calls = dict.fromkeys(("paged_attention", "append_kv", "sample", "compute_logprobs"), 0)
    for op in calls:
        function = getattr(kernels, op)

        def counted(*args, _op=op, _function=function, **kwargs):
            calls[_op] += 1
            return _function(*args, **kwargs)

        monkeypatch.setattr(kernels, op, counted)
    triton = run_cli(model, *GREEDY_ARGS, "--backend", "triton").json()
    forwards = GREEDY_TOKENS  # the prefill, then one decode step per further token
    num_layers = len(model[0].layers)
    assert calls["paged_attention"] == calls["append_kv"] == forwards * num_layers
    assert calls["sample"] == calls["compute_logprobs"] == forwards
    assert triton["token_ids"] == greedy["token_ids"]
    assert triton["text"] == greedy["text"]
    for spec_step, triton_step in zip(greedy["logprobs"], triton["logprobs"], strict=True):
        assert triton_step["logprob"] == pytest.approx(spec_step["logprob"], abs=1e-4)
        assert triton_step["rank"] == spec_step["rank"]
        assert [t["token_id"] for t in triton_step["top"]] == [
            t["token_id"] for t in spec_step["top"]
        ]


@pytest.mark.clause("SAMPLE-RNG-3")
def test_triton_backend_gives_the_spec_backends_seeded_tokens(model):
    args = ("generate", QUESTION, *SAMPLED_FLAGS, "--max-tokens", "8", "--ignore-eos", "--json")
    spec = run_cli(model, *args).json()
    triton = run_cli(model, *args, "--backend", "triton").json()
    assert triton["seed"] == spec["seed"] == 7
    assert triton["token_ids"] == spec["token_ids"]
    assert triton["text"] == spec["text"]


# ---------------------------------------------------------------- speculative decoding

REPEAT = (
    "Repeat this paragraph exactly: The river runs past the old mill, under the stone "
    "bridge and into the valley, where the farmers bring their grain to market every week."
)


@pytest.mark.clause("VERIFY-GREEDY-1")
@pytest.mark.parametrize("drafter", ["ngram", "layers:8", "model:BUNDLED"])
def test_speculation_gives_the_greedy_tokens_and_reports_its_rates(model, greedy, drafter):
    """Each drafter from the CLI: plain greedy's tokens and logprobs, and the JSON adds
    the acceptance rate and tokens per target pass. model:PATH loads the bundled
    file a second time as its own draft model."""
    drafter = drafter.replace("BUNDLED", str(bundled_model_path()))
    # The draft model in the stand-in target's format (float32), so that it drafts
    # exactly what the target computes.
    same_format = ("--weights", "float32") if drafter.startswith("model:") else ()
    run = run_cli(model, *GREEDY_ARGS, *same_format, "--speculate", drafter, "--num-draft", "3")
    result = run.json()
    assert result["token_ids"] == greedy["token_ids"]
    assert result["text"] == greedy["text"]
    for plain, speculative in zip(greedy["logprobs"], result["logprobs"], strict=True):
        assert speculative["logprob"] == pytest.approx(plain["logprob"], abs=1e-4)
        assert speculative["rank"] == plain["rank"]
    drafted, accepted = result["draft_tokens"], result["accepted_tokens"]
    assert 0 <= accepted <= drafted
    assert result["acceptance_rate"] == (accepted / drafted if drafted else None)
    passes = result["completion_tokens"] / result["tokens_per_target_pass"]
    assert passes == pytest.approx(GREEDY_TOKENS - accepted)  # one token a pass, plus drafts
    if drafter.startswith("model:"):
        assert result["acceptance_rate"] == 1.0  # the target drafting for itself
        assert run.loads == [None, drafter.removeprefix("model:")]


def test_prompt_lookup_speeds_up_a_repeated_paragraph(model):
    """Prompt lookup on text the answer copies: most drafts pass, several tokens a pass,
    and still exactly plain greedy's tokens; the stats line reports the rates."""
    args = ("generate", REPEAT, "--max-tokens", "32")
    plain = run_cli(model, *args, "--json").json()
    speculative = run_cli(model, *args, "--json", "--speculate", "ngram").json()
    assert speculative["token_ids"] == plain["token_ids"]
    assert speculative["acceptance_rate"] > 0.5
    assert speculative["tokens_per_target_pass"] > 2
    text = run_cli(model, *args, "--speculate", "ngram")
    assert text.code == 0 and text.out.strip() == plain["text"].strip()
    assert re.search(
        r", ngram: \d+% of \d+ drafts accepted, [\d.]+ tokens per target pass\]", text.err
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculate", "medusa"], r"--speculate must be ngram, layers:N or model:PATH"),
        (["--speculate", "layers:x"], r"N of layers:N must be a positive integer"),
        (["--speculate", "model:/no/such/model"], r"no file or directory /no/such/model"),
        (["--speculate", "ngram", "--num-draft", "0"], r"--num-draft must be >= 1, got 0"),
    ],
)
def test_bad_speculation_flags_exit_2_before_loading(flags, message):
    run = run_cli(None, "generate", "hi", *flags)
    assert_usage_error(run, message)
    assert run.loads == []


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--token-budget", "-1"], r"--token-budget must be >= 0, got -1"),
        (["--long-prompt-chunk", "-8"], r"--long-prompt-chunk must be >= 0, got -8"),
        (["--long-prompt-interval", "0"], r"--long-prompt-interval must be >= 1, got 0"),
    ],
)
def test_bad_budget_flags_exit_2_before_loading(command, flags, message):
    run = run_cli(None, command, *(["hi"] if command == "generate" else []), *flags)
    assert_usage_error(run, message)
    assert run.loads == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculate", "layers:31"], r"layers:N needs 1 <= N <= 30"),
        (["--speculate", "ngram", "--naive"], r"needs the KV cache"),
    ],
)
def test_speculation_the_model_cannot_run_exits_2(model, flags, message):
    assert_usage_error(run_cli(model, "generate", "hi", *flags), message)


def test_request_error_exits_1_without_traceback(model):
    """A model whose logits are NaN: the request fails, the process reports it."""
    weights, tokenizer = model
    broken = (
        dataclasses.replace(weights, final_norm=torch.full_like(weights.final_norm, math.nan)),
        tokenizer,
    )
    run = run_cli(broken, "generate", QUESTION, "--max-tokens", "3")
    assert run.code == 1
    assert "NaN or infinite logits" in run.error_line()
    assert STATS.search(run.err)["finish"] == "error"

    data = run_cli(broken, "generate", QUESTION, "--max-tokens", "3", "--json")
    assert data.code == 1
    [line] = data.out.splitlines()
    result = json.loads(line)
    assert result["finish_reason"] == "error" and result["token_ids"] == []
    assert "NaN or infinite logits" in result["error"]


def test_closed_stdout_ends_quietly(model):
    """A reader that stops early (`| head`): the command ends without a traceback."""

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            if self.tell() >= 3:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    err = io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(ClosedPipe()),
        contextlib.redirect_stderr(err),
    ):
        patch.setattr(cli_generate, "load_model_with_progress", lambda path, weights=None: model)
        code = cli.main(["generate", QUESTION, "--max-tokens", "4"])
    assert code != 0
    assert "Traceback" not in err.getvalue()


# ---------------------------------------------------------------- demo

DEMO_ROW = re.compile(
    r"^(?P<token>'[^']*')\s+(?P<raw>\d\.\d{4})\s+(?P<kept>\d\.\d{4})(?P<gone>  \(removed\))?$"
)


def parse_demo(out: str) -> tuple[list[tuple[str, float, float, bool]], list[str]]:
    lines = out.splitlines()
    rows = [DEMO_ROW.match(line) for line in lines]
    table = [
        (ast.literal_eval(m["token"]), float(m["raw"]), float(m["kept"]), not m["gone"])
        for m in rows
        if m
    ]
    draws_at = next(i for i, line in enumerate(lines) if line.endswith("seeded draws:"))
    return table, lines[draws_at + 1].split()


def test_demo_shows_the_filters_and_seeded_draws():
    run = run_cli(None, "demo")
    assert run.code == 0 and run.loads == []  # no model needed
    assert run.out.splitlines()[0] == "temperature=1.0 top_k=0 top_p=0.9 min_p=0.0 seed=0"
    table, draws = parse_demo(run.out)
    assert len(table) == len(cli_demo.EXAMPLE_TOKENS)
    assert math.fsum(r[1] for r in table) == pytest.approx(1, abs=1e-3)
    assert math.fsum(r[2] for r in table) == pytest.approx(1, abs=1e-3)
    mass_above = 0.0
    for _token, raw, kept_p, kept in table:  # sorted by raw probability
        assert kept == (mass_above < 0.9)  # top-p 0.9
        assert (kept_p > raw) if kept else (kept_p == 0)
        mass_above += raw
    kept_words = {token.strip() for token, _, _, kept in table if kept}
    assert len(draws) == 12 and set(draws) <= kept_words
    assert run_cli(None, "demo").out == run.out  # seeded

    top2 = run_cli(None, "demo", "--top-k", "2", "--top-p", "1", "--seed", "3", "--draws", "5")
    table, draws = parse_demo(top2.out)
    assert [r[0] for r in table if r[3]] == [" Paris", " a"]
    assert len(draws) == 5 and set(draws) <= {"Paris", "a"}


def test_the_demo_takes_and_shows_the_declared_parameters():
    """The demo's parameters are `SamplingParams`' own: their declared flags, each
    shown by its field name in the first line; a name that declares no flag is refused."""
    demo = next(
        action.choices["demo"]
        for action in cli.build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    flags = {o for action in demo._actions for o in action.option_strings}
    assert {PARAMETERS[name].flag for name in cli_demo.SHOWN} <= flags
    shown = run_cli(None, "demo", "--draws", "1").out.splitlines()[0]
    assert [pair.split("=")[0] for pair in shown.split()] == list(cli_demo.SHOWN)
    for name in ("min-p", "top_logprobs_x", "logit_bias"):  # not a field; no flag
        with pytest.raises(ValueError, match=name):
            cli_options.add_sampling_flags(argparse.ArgumentParser(), [name])
    with pytest.raises(ValueError, match="topp"):
        cli_options.add_sampling_flags(argparse.ArgumentParser(), topp=0.9)


# ---------------------------------------------------------------- structured outputs

PARIS = "Give me a JSON object with the name and population of Paris."


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--json-schema", '{"type": "object",'], r"--json-schema: not JSON"),
        (["--json-schema", "no-such-schema.json"], r"--json-schema no-such-schema\.json: No such"),
        (["--grammar", "no-such.ebnf"], r"--grammar no-such\.ebnf: No such"),
        (["--choice", "yes", "--choice", ""], r"--choice must be a list of non-empty strings"),
    ],
)
def test_a_bad_structured_output_flag_exits_2_before_loading(flags, message):
    run = run_cli(None, "generate", "hi", *flags)
    assert_usage_error(run, message)
    assert run.loads == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--regex", "a(b"], r"--regex: .*unclosed group"),
        (["--json-schema", '{"type": "objec"}'], r"--json-schema: .*objec"),
        (["--grammar", "{grammar}"], r"--grammar: the grammar admits no string"),
        (["--json-object", "--ignore-eos"], r"ignore_eos cannot be combined"),
    ],
)
def test_a_grammar_that_does_not_compile_exits_2_before_generating(model, tmp_path, flags, message):
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= root "a"')
    flags = [f.replace("{grammar}", str(grammar)) for f in flags]
    run = run_cli(model, "generate", "hi", *flags)
    assert_usage_error(run, message)


def test_json_object_and_json_schema_answers_are_json(model, tmp_path):
    """Unconstrained, the same sampled request writes a fenced, broken object; under
    --json-object it is a JSON object, and under a schema it fits the schema."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "population"],
    }
    path = tmp_path / "city.json"
    path.write_text(json.dumps(schema))
    sampled = ("--temperature", "0.7", "--seed", "3", "--max-tokens", "80", "--json")
    for flags in (["--json-object"], ["--json-schema", str(path)]):
        run = run_cli(model, "generate", PARIS, *sampled, *flags)
        answer = json.loads(run.out)
        assert run.code == 0 and answer["finish_reason"] == "stop", run.err
        value = json.loads(answer["text"])
        assert isinstance(value, dict)
        if "--json-schema" in flags:
            jsonschema.validate(value, schema)  # other properties are allowed: not closed
    plain = json.loads(run_cli(model, "generate", PARIS, *sampled).out)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain["text"])


# ---------------------------------------------------------------- --weights


def test_weights_int4_runs_on_the_cpu_kernels_and_says_what_it_holds(model):
    run = run_cli(model, "generate", QUESTION, "--weights", "int4", "--backend", "torch",
                  "--max-tokens", "8", "--ignore-eos")  # fmt: skip
    assert run.code == 0, run.err
    assert "path: projections int4 g32 ×210, int8 ×1; activations float32" in run.err
    assert len(run.out.strip()) > 0 and "Traceback" not in run.err


def test_a_model_the_format_cannot_hold_exits_2_naming_the_tensor(model, tmp_path):
    """A checkpoint whose projections are not whole groups of 32: refused before any
    generation, the tensor and the format named."""
    from tests.engine.checkpoints import hf_model, save_hf

    directory = save_hf(hf_model("llama", hidden_size=48), tmp_path)  # weights first: no tokenizer
    run = run_cli(model, "generate", "hi", "--model", str(directory), "--weights", "int4")
    assert_usage_error(
        run,
        r"tensor model\.layers\.0\.self_attn\.q_proj\.weight \[\d+, 48\] cannot be int4: "
        r"in_features 48 is not a multiple of 32",
    )


def test_an_unknown_weight_format_exits_2_listing_the_choices(model, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "hi", "--weights", "int3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'int3'" in err and "int4" in err
