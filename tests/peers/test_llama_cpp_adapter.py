"""The llama.cpp adapter (tests/peers/llama_cpp_ops.py) and loop comparison, directly.

llama.cpp runs in a process of its own (tests/peers/child.py): if it dies (SIGILL
from a build for another CPU), a test fails naming it and the signal."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

if importlib.util.find_spec("llama_cpp") is None:  # not imported here: it loads llama.cpp
    pytest.skip("llama-cpp-python is not installed (make test builds it)", allow_module_level=True)

from decodespec.spec import logits as spec_logits
from decodespec.spec import sampling as spec
from decodespec.spec import softmax as spec_softmax
from tests.peers.child import PeerProcess


@pytest.fixture(scope="module")
def ops():
    with PeerProcess("tests.peers.llama_cpp_ops", peer="llama.cpp") as peer:
        yield peer


# Distinct values: no ties anywhere, so every rule has one answer.
X = torch.tensor(
    [
        [0.5, 2.25, -1.0, 3.5, 0.0, -2.5],
        [1.75, -0.25, 0.75, -3.0, 2.5, 1.0],
    ]
)


def test_peer_description(ops):
    assert ops.PEER["name"] == "llama.cpp"
    assert ops.PEER["package"] == "llama_cpp_python"
    assert "llama_sampler_apply" in ops.PEER["functions"]
    assert set(ops.CONFORMANCE_UNSUPPORTED) == {"float64", "min_tokens", "token_bitmask"}
    for missing in ("sample", "uniform", "apply_min_tokens"):
        with pytest.raises(AttributeError):
            getattr(ops, missing)


def test_greedy_agrees_with_the_spec(ops):
    assert torch.equal(ops.greedy(X), spec.greedy(X))
    assert ops.greedy(X).tolist() == [3, 4]


def test_greedy_takes_float16(ops):
    assert ops.greedy(X.half()).tolist() == [3, 4]


@pytest.mark.parametrize("k", [0, 1, 2, 5, 6, 10])
def test_top_k_agrees_with_the_spec(ops, k):
    k_rows = torch.tensor([k, k])
    assert torch.equal(ops.top_k_mask(X, k_rows), spec.top_k_mask(X, k_rows))


@pytest.mark.parametrize("m", [0.0, 0.05, 0.3, 1.0])
def test_min_p_agrees_with_the_spec(ops, m):
    m_rows = torch.tensor([m, m])
    assert torch.equal(ops.min_p_mask(X, m_rows), spec.min_p_mask(X, m_rows))


def test_top_p_runs_and_keeps_the_maximum(ops):
    mask = ops.top_p_mask(X, torch.tensor([0.5, 1.0]))
    assert mask.dtype == torch.bool and mask.shape == X.shape
    assert mask[0].tolist() == [False, False, False, True, False, False]
    assert bool(mask[1].all())


def test_masks_drop_masked_tokens(ops):
    x = torch.tensor([[1.0, -math.inf, 0.5]])
    assert ops.top_k_mask(x, torch.tensor([3])).tolist() == [[True, False, True]]
    assert ops.min_p_mask(x, torch.tensor([0.0])).tolist() == [[True, False, True]]


def test_temperature_is_llama_cpps_division(ops):
    out = ops.apply_temperature(X, torch.tensor([0.5, 2.0]))
    assert out.dtype == torch.float32
    assert torch.equal(out, X / torch.tensor([[0.5], [2.0]]))  # z / T, not shifted
    greedy_row = ops.apply_temperature(X[:1], torch.tensor([0.0]))
    assert greedy_row[0, 3].item() == 3.5
    assert int(torch.isinf(greedy_row).sum()) == X.shape[1] - 1


def test_logit_bias_agrees_with_the_spec(ops):
    bias = torch.zeros_like(X)
    bias[0, 1], bias[1, 5] = -100.0, 7.5
    out = ops.apply_logit_bias(X, bias)
    assert torch.equal(out, spec_logits.apply_logit_bias(X, bias))


def test_penalties_run_and_match_the_spec_without_prompt_frequency(ops):
    prompt = torch.tensor([[True, False, False, False, False, False]] * 2)
    counts = torch.tensor([[0, 2, 0, 1, 0, 0]] * 2, dtype=torch.int32)
    rep = torch.tensor([1.5, 2.0])
    zero = torch.zeros(2)
    out = ops.apply_penalties(X, prompt, counts, rep, zero, zero)
    assert torch.allclose(out, spec_logits.apply_penalties(X, prompt, counts, rep, zero, zero))
    # llama.cpp counts prompt tokens in the frequency penalty too (token 0: once).
    freq = torch.tensor([0.5, 0.5])
    out = ops.apply_penalties(X, prompt, counts, torch.ones(2), freq, zero)
    assert out[0, 0].item() == pytest.approx(0.5 - 0.5)
    assert out[0, 1].item() == pytest.approx(2.25 - 1.0)


def test_process_logits_chain(ops):
    args = {
        "temperature": torch.tensor([0.5, 1.0]),
        "top_k": torch.tensor([3, 0]),
        "top_p": torch.tensor([1.0, 0.9]),
        "min_p": torch.tensor([0.0, 0.1]),
    }
    out = ops.process_logits(X, **args)
    ref = spec.process_logits(X, **args)
    assert out.dtype == torch.float32 and out.shape == X.shape
    assert torch.equal(torch.isinf(out), torch.isinf(ref))  # the same tokens kept
    # kept tokens hold z / T, where the spec has (z - max z) / T
    kept = ~torch.isinf(out)
    scaled = X / args["temperature"][:, None]
    assert torch.equal(out[kept], scaled[kept])
    shifted = spec_softmax.apply_temperature(X, args["temperature"])
    assert torch.allclose(out - out.amax(-1, keepdim=True), shifted.masked_fill(~kept, -math.inf))
    with pytest.raises(NotImplementedError):
        ops.process_logits(
            X,
            temperature=torch.ones(2),
            stop_token_mask=torch.zeros_like(X, dtype=torch.bool),
            min_tokens=torch.ones(2, dtype=torch.int64),
        )


def test_process_logits_greedy_row_keeps_only_the_first_maximum(ops):
    out = ops.process_logits(X, temperature=torch.zeros(2))
    assert (~torch.isinf(out)).sum(-1).tolist() == [1, 1]
    assert out.argmax(-1).tolist() == spec.greedy(X).tolist()


# ---------------------------------------------------------------- the loop


@pytest.fixture(scope="module")
def loop_report():
    with PeerProcess("tests.peers.llama_cpp_loop", peer="llama.cpp") as loop:
        return loop.compare_loop(["The capital of France is", "Hello, my name is"], max_tokens=4)


def test_compare_loop_report(loop_report):
    assert {"model", "max_tokens", "threads", "versions", "prompts", "tokens_per_s"} <= set(
        loop_report
    )
    assert loop_report["max_tokens"] == 4
    assert len(loop_report["prompts"]) == 2
    for row in loop_report["prompts"]:
        assert {
            "prompt",
            "tokenizer_equal",
            "tokenizer_first_difference",
            "first_difference",
            "llama_cpp_tokens",
            "our_tokens",
        } <= set(row)
        assert row["tokenizer_equal"], row  # plain ASCII: the same ids
        assert row["tokenizer_first_difference"] is None
        assert len(row["llama_cpp_tokens"]) == len(row["our_tokens"]) == 4
        assert row["first_difference"] is None or 0 <= row["first_difference"] < 4
    rates = loop_report["tokens_per_s"]
    assert rates["llama_cpp"] > 0 and rates["ours"] > 0
