"""The sampling wrappers' costs to the host, counted without a GPU (issue: kernels an
engine would vendor): with `errors=` given, no device-to-host sync, one launch, no
PyTorch operation besides allocations, and one compiled variant whatever the batch,
the vocabulary or the parameters' values.

The launches are stubbed (tests/kernels/contracts.py): nothing runs, so the tensors
are `meta` tensors, on which a sync cannot even produce a value.
"""

from __future__ import annotations

import pytest
import torch

from decodespec import kernels
from decodespec.kernels import sampling
from decodespec.kernels.checks import INTERPRET
from decodespec.spec.sampling import sample as spec_sample
from tests.kernels.contracts import memory_traffic, record

META = torch.device("meta")
VOCABULARIES = (32_000, 32_001, 128_256, 151_936)


def every_parameter(batch: int, vocab: int) -> dict[str, torch.Tensor]:
    """Every processor and filter of `sample`, on the meta device."""
    row = dict(device=META)
    return {
        "temperature": torch.empty(batch, **row),
        "top_k": torch.empty(batch, dtype=torch.int64, **row),
        "top_p": torch.empty(batch, **row),
        "min_p": torch.empty(batch, **row),
        "seed": torch.empty(batch, dtype=torch.int64, **row),
        "step": torch.empty(batch, dtype=torch.int64, **row),
        "token_bitmask": torch.empty(batch, (vocab + 31) // 32, dtype=torch.int32, **row),
        "logit_bias": torch.empty(batch, vocab, **row),
        "stop_token_mask": torch.empty(batch, vocab, dtype=torch.bool, **row),
        "min_tokens": torch.empty(batch, dtype=torch.int64, **row),
        "prompt_mask": torch.empty(batch, vocab, dtype=torch.bool, **row),
        "output_counts": torch.empty(batch, vocab, dtype=torch.int32, **row),
        "repetition_penalty": torch.empty(batch, **row),
        "frequency_penalty": torch.empty(batch, **row),
        "presence_penalty": torch.empty(batch, **row),
    }


def few_parameters(batch: int, vocab: int) -> dict[str, torch.Tensor]:
    full = every_parameter(batch, vocab)
    return {name: full[name] for name in ("temperature", "top_k", "top_p", "seed", "step")}


CONFIGURATIONS = {"every parameter": every_parameter, "temperature + top-k/top-p": few_parameters}


def sample_call(batch: int, vocab: int, configuration=few_parameters):
    logits = torch.empty(batch, vocab, dtype=torch.bfloat16, device=META)
    args = configuration(batch, vocab)
    errors = torch.empty(batch, dtype=torch.int32, device=META)
    return lambda: kernels.sample(logits, **args, errors=errors)


@pytest.mark.parametrize("configuration", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_sample_with_error_words_never_syncs_and_launches_once(configuration):
    recording = record(sample_call(4, 32_000, configuration))
    assert recording.syncs == []
    assert recording.kernels() == ["_sample_kernel"]
    assert recording.small_ops == []


@pytest.mark.parametrize("configuration", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_process_logits_with_error_words_never_syncs_and_launches_once(configuration):
    logits = torch.empty(3, 1000, device=META)
    args = configuration(3, 1000)
    del args["seed"]
    errors = torch.empty(3, dtype=torch.int32, device=META)
    recording = record(lambda: kernels.process_logits(logits, **args, errors=errors))
    assert (recording.syncs, recording.kernels(), recording.small_ops) == (
        [],
        ["_sample_kernel"],
        [],
    )


def test_greedy_never_syncs_and_launches_once():
    """Its invalid rows are −1 tokens, not an exception: nothing to read back."""
    recording = record(lambda: kernels.greedy(torch.empty(5, 1000, device=META)))
    assert (recording.syncs, recording.kernels(), recording.small_ops) == (
        [],
        ["_sample_kernel"],
        [],
    )


def test_without_error_words_the_wrapper_reads_them_once():
    """The default: zeroed words, one read (`bool(words.any())`), then the exception if
    any."""
    logits = torch.zeros(2, 40)
    args = few_parameters(2, 40)
    args = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in args.items()}
    recording = record(lambda: kernels.sample(logits, **args))
    assert recording.syncs == ["aten._local_scalar_dense"]
    assert recording.kernels() == ["_sample_kernel"]
    assert recording.small_ops == ["aten.zeros", "aten.any"]


def test_one_compiled_variant_for_every_batch_and_vocabulary():
    """A per-step integer that Triton specialised (a vocabulary divisible by 16, a batch
    of 1) would recompile mid-serving; absent parameters are constexpr flags, so only
    which parameters are given selects a variant."""
    keys = {
        (batch, vocab): record(sample_call(batch, vocab)).launches[0].compile_key
        for batch in (1, 2, 16, 17)
        for vocab in VOCABULARIES
    }
    first = keys[1, VOCABULARIES[0]]
    differences = {
        shape: sorted(set(key) ^ set(first)) for shape, key in keys.items() if key != first
    }
    assert differences == {}


def test_the_counter_sees_an_added_sync(monkeypatch):
    """The contract can fail: a wrapper that reads a value on the host is caught."""
    check = sampling._check_sampling_args

    def reads_the_temperature(logits, args):
        check(logits, args)
        bool((args["temperature"] > 0).any())

    monkeypatch.setattr(sampling, "_check_sampling_args", reads_the_temperature)
    logits = torch.zeros(2, 40)
    temperature, errors = torch.zeros(2), torch.empty(2, dtype=torch.int32)
    recording = record(lambda: kernels.sample(logits, temperature=temperature, errors=errors))
    assert recording.syncs == ["aten._local_scalar_dense"]
    assert recording.small_ops == ["aten.gt", "aten.any"]


def test_the_counter_sees_an_added_launch_and_op(monkeypatch):
    launch = sampling._launch

    def defaults_as_tensors(logits, args, *rest, **kwargs):
        args = {**args, "top_k": torch.full((logits.shape[0],), 0, device=logits.device)}
        launch(logits, args, *rest, **kwargs)
        return launch(logits, args, *rest, **kwargs)

    monkeypatch.setattr(sampling, "_launch", defaults_as_tensors)
    recording = record(sample_call(2, 1000))
    assert recording.kernels() == ["_sample_kernel", "_sample_kernel"]
    assert recording.small_ops == ["aten.full"]


# Reads of a row, in passes over its vocabulary, that `sampling.py`'s docstring gives
# for each configuration, on logits of standard deviation 3 (a trained model's are
# 2 to 4): pass 1 reads the row and keeps the candidates, the searches and the draw
# read those few; temperature alone draws from the whole row. The target is
# at most 2 for every configuration.
READ_PASSES = {
    "greedy": ({"temperature": 0.0}, 1.0),
    "temperature": ({"temperature": 0.7}, 2.0),
    "min-p": ({"temperature": 0.7, "min_p": 0.05}, 1.1),
    "top-k": ({"temperature": 0.7, "top_k": 50}, 1.3),
    "top-p": ({"temperature": 0.7, "top_p": 0.9}, 1.3),
    "top-k + top-p": ({"temperature": 0.7, "top_k": 50, "top_p": 0.9}, 1.4),
    "every filter": ({"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05}, 1.4),
}


def sampled_traffic(logits, values):
    batch = logits.shape[0]
    args = {name: torch.tensor([value] * batch) for name, value in values.items()}
    seed = torch.arange(batch) + 1
    return memory_traffic(lambda: kernels.sample(logits, **args, seed=seed))


def assert_same_tokens_as_the_spec(logits, values, seeds=range(8)):
    args = {name: torch.tensor([value] * logits.shape[0]) for name, value in values.items()}
    for seed in seeds:
        seed = torch.full((logits.shape[0],), seed)
        got = kernels.sample(logits, **args, seed=seed)
        want = spec_sample(logits.double(), **args, seed=seed)
        assert got.tolist() == want.tolist(), (seed, got, want)


@pytest.mark.skipif(not INTERPRET, reason="counts the Triton interpreter's loads")
@pytest.mark.parametrize("configuration", READ_PASSES.values(), ids=READ_PASSES.keys())
def test_reads_per_row_stay_within_the_documented_passes(configuration):
    values, passes = configuration
    batch, vocab = 2, 5000  # more than one chunk of the vocabulary
    logits = 3 * torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    traffic = sampled_traffic(logits, values)
    per_row_parameters = 16
    assert passes <= 2
    assert traffic.loaded <= batch * (passes * vocab + per_row_parameters)
    assert traffic.loaded > batch * (passes - 0.3) * vocab  # the budget is not slack


@pytest.mark.skipif(not INTERPRET, reason="counts the Triton interpreter's loads")
def test_a_flat_row_is_the_worst_case_the_docstring_gives():
    """Logits of standard deviation 1 at temperature 0.7: top-p 0.9 keeps most of the
    row, so its candidates are most of it and its searches read them 8 times over."""
    vocab = 5000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    assert sampled_traffic(logits, {"temperature": 0.7, "top_k": 50}).loaded <= 2 * 1.6 * vocab
    assert sampled_traffic(logits, {"temperature": 0.7, "top_p": 0.9}).loaded <= 2 * 9.5 * vocab


@pytest.mark.skipif(not INTERPRET, reason="counts the Triton interpreter's loads")
def test_a_bound_later_chunks_break_falls_back_to_the_exact_one():
    """Top-p alone's running bound is a guess: the first chunk (4,096 tokens in the
    interpreter) holds one token 3 above the second chunk's 4,096, so its bound sits
    above them, while their mass, 4,096 e⁻³, is most of the row's. The check at the
    end sees it, a pass bounds the row exactly and compacts again: more reads, the
    spec's tokens."""
    first, second = torch.full((4096,), -30.0), torch.full((4096,), 2.0)
    first[0] = 5.0
    logits = torch.cat([first, second])[None, :]
    values = {"temperature": 1.0, "top_p": 0.9}
    assert sampled_traffic(logits, values).loaded > 2.5 * logits.shape[1]
    assert_same_tokens_as_the_spec(logits, values)


@pytest.mark.skipif(not INTERPRET, reason="counts the Triton interpreter's loads")
def test_without_a_bound_the_row_is_searched_whole_and_the_token_is_the_same():
    """Logits 10 apart: at temperature 0.7 the 5th largest lies 57 below the maximum,
    past every pivot of the bound (−32), so every token is a candidate and the search
    walks them all (8 passes), and draws the token a close row's few candidates give."""
    vocab = 3000
    spread = (torch.arange(vocab, dtype=torch.float32) * 10.0).flip(0)[None, :]
    values = {"temperature": 0.7, "top_k": 5}
    assert sampled_traffic(spread, values).loaded > 9 * vocab
    close = (torch.arange(vocab, dtype=torch.float32) * 0.01).flip(0)[None, :]
    assert sampled_traffic(close, values).loaded < 2 * vocab
    for logits in (spread, close):
        assert_same_tokens_as_the_spec(logits, values)
