"""`decodespec perplexity`: perplexity, KL divergence and top-1 agreement per weight
format, computed as its docstring says (checked here against the spec's forward
on a small random model, independently of the module's own arithmetic)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from decodespec.reference import cli, perplexity
from decodespec.reference.weight_formats import convert_weights
from decodespec.spec.forward import forward_naive
from tests.engine.toy import ByteTokenizer, random_weights, small_config

TEXT = "Perplexity is the exponential of the mean negative log-likelihood. " * 6
CONFIG = small_config(
    hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
)


@pytest.fixture
def small_model(monkeypatch):
    """`loader.load_model` answering with a random model in the requested format."""
    loads = []

    def load_formats(path, formats, *, progress=None):
        loads.extend((path, name) for name in formats)
        weights = random_weights(CONFIG, seed=7)
        return {name: convert_weights(weights, name) for name in formats}, ByteTokenizer()

    monkeypatch.setattr(perplexity.loader, "load_formats", load_formats)
    return loads


def by_format(result: dict) -> dict:
    return {score["weights"]: score for score in result["formats"]}


def test_float32_against_itself_is_perfect_and_its_perplexity_is_the_forward_s(small_model):
    result = perplexity.score_formats("m", ["float32"], TEXT, context=32, max_tokens=200)
    ids = list(TEXT.encode())[:200]
    losses = []
    for start in range(0, len(ids) - 31, 32):
        window = ids[start : start + 32]
        log_probs = torch.log_softmax(
            forward_naive(random_weights(CONFIG, seed=7), torch.tensor(window)).double(), dim=-1
        )
        losses += [-float(log_probs[t, window[t + 1]]) for t in range(15, 31)]
    (score,) = result["formats"]
    assert result["windows"] == 6 and score["scored_tokens"] == 6 * 16 == len(losses)
    # the engine's float32 product (C, `cpu_linear.DenseLinear`) sums in another order
    # than the spec's GEMM: the same perplexity to float32's rounding (8e-8 measured)
    assert score["perplexity"] == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-6)
    assert score["kl_mean"] == score["kl_max"] == 0.0
    assert score["top1_agreement"] == 1.0


def test_each_format_is_scored_against_float32(small_model):
    result = perplexity.score_formats("m", ["int4", "int8", "bfloat16"], TEXT, context=32)
    scores = by_format(result)
    assert list(scores) == ["float32", "int4", "int8", "bfloat16"]  # the reference first
    assert [weights for _, weights in small_model] == list(scores)
    for name in ("int4", "int8", "bfloat16"):
        s = scores[name]
        assert 0 < s["kl_median"] <= s["kl_p99"] <= s["kl_max"]
        assert 0 < s["top1_agreement"] <= 1
        assert s["weight_bytes"] < scores["float32"]["weight_bytes"]
    # 4-bit weights move the distribution more than 8-bit ones on the same model.
    assert scores["int4"]["kl_mean"] > scores["int8"]["kl_mean"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(context=7), "even number"),
        (dict(context=2), "even number"),
        (dict(context=512), "longer than the model"),
        (dict(context=32, max_tokens=20), "fewer than one window"),
    ],
)
def test_bad_windows_are_refused(small_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        perplexity.score_formats("m", ["int4"], TEXT, **kwargs)


def test_an_unknown_format_is_refused_before_loading(small_model):
    with pytest.raises(ValueError, match="unknown weight format 'int2'"):
        perplexity.score_formats("m", ["int2"], TEXT)
    assert small_model == []


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_the_command_prints_a_row_per_format_and_writes_json(small_model, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out_json = tmp_path / "scores.json"
    code, out, _ = run(
        "perplexity", str(text), "--model", "m", "--weights", "int8,int4", "--context", "32",
        "--json", str(out_json),
    )  # fmt: skip
    assert code == 0
    rows = [line.split()[0] for line in out.splitlines()[2:]]
    assert rows == ["float32", "int8", "int4"]
    saved = json.loads(out_json.read_text())
    assert saved["text"] == str(text) and len(saved["formats"]) == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (("perplexity", "/no/such/file"), "does not exist"),
        (("perplexity", "--weights", "int3"), "unknown weight format 'int3'"),
        (("perplexity", "--context", "64", "--max-tokens", "32"), "less than --context"),
    ],
)
def test_bad_arguments_exit_2_naming_them(small_model, argv, message):
    code, _, err = run(*argv, "--model", "m")
    assert code == 2 and message in err and "Traceback" not in err


def test_the_default_text_ships_with_python_and_is_long_enough():
    text = perplexity.default_text()
    assert len(text) > 400_000  # about 100,000 SmolLM2 tokens; 20,480 are used
    assert text.startswith('The "assert" statement')
