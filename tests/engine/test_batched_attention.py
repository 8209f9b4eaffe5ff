"""The `torch` backend: paged attention batched across sequences (reference/batched_attention.py).

It is an implementation of the spec's operation like any other, so the
conformance suite is its main test (run here through `--impl`); the tests
below cover what the suite cannot see: its grouping and splitting, and the
engine running on it.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from decodespec.reference import batched_attention
from decodespec.reference.backend import SPEC_BACKEND, STAGE_OPERATIONS, get_backend
from decodespec.reference.cli import build_parser
from decodespec.reference.engine import Engine
from decodespec.spec.attention import paged_attention as spec_paged_attention
from decodespec.spec.params import SamplingParams
from tests.engine.toy import ByteTokenizer, random_weights, small_config
from tests.test_harness import run_suite

ATTENTION_TESTS = ("tests/conformance/test_attention.py", "tests/conformance/test_append_kv.py")


def test_the_conformance_suite_passes_it():
    """Every attention and append conformance test runs against it and passes, none
    skipped (it provides both operations)."""
    run = run_suite(*ATTENTION_TESTS, "--impl=decodespec.reference.batched_attention")
    assert run.returncode == 0, run.stdout[-3000:]
    skips = re.findall(r"SKIPPED \[\d+\] .*", run.stdout)
    assert not skips, skips
    passed = int(re.search(r"(\d+) passed", run.stdout).group(1))
    assert passed >= 50, run.stdout[-2000:]


def mixed_batch(dtype: torch.dtype, poison: float = math.nan):
    """A batch of every kind of sequence: decodes of different lengths, two
    verifying three drafts each, a prompt chunk, a whole prompt, one without
    keys and one without rows; unused cache slots and table entries are poison."""
    torch.manual_seed(0)
    block_size, num_blocks, kv_heads, q_heads, head_dim = 4, 64, 2, 6, 8
    seq_lens = [9, 1, 17, 12, 13, 20, 7, 0, 5]
    q_lens = [1, 1, 1, 4, 4, 6, 7, 2, 0]
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), poison, dtype=dtype)
    v_cache = k_cache.clone()
    block_table = torch.full((len(seq_lens), 6), -1)
    free = torch.randperm(num_blocks).tolist()
    for b, n in enumerate(seq_lens):
        for i in range(-(-n // block_size)):
            block = free.pop()
            block_table[b, i] = block
            used = min(block_size, n - i * block_size)
            k_cache[block, :used] = torch.randn(used, kv_heads, head_dim, dtype=dtype)
            v_cache[block, :used] = torch.randn(used, kv_heads, head_dim, dtype=dtype)
    query_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    q = torch.randn(int(query_start[-1]), q_heads, head_dim, dtype=dtype)
    return q, k_cache, v_cache, block_table, torch.tensor(seq_lens), query_start


@pytest.mark.clause("ATTN-PACK-1", "ATTN-BOUNDS-1", "ATTN-EMPTY-1")
@pytest.mark.parametrize("max_scores", [batched_attention.MAX_SCORES_PER_MATMUL, 1, 2000])
def test_every_kind_of_sequence_in_one_batch_and_split_groups(monkeypatch, max_scores):
    """Groups by row count, each split when its padded scores pass the limit
    (1: one sequence per matmul), give the spec's rows in the spec's order."""
    monkeypatch.setattr(batched_attention, "MAX_SCORES_PER_MATMUL", max_scores)
    args = mixed_batch(torch.float64)
    out, lse = batched_attention.paged_attention(*args, return_lse=True)
    expected_out, expected_lse = spec_paged_attention(*args, return_lse=True)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(out).all()
    seq_lens, query_start = args[4], args[5]
    empty = slice(int(query_start[7]), int(query_start[8]))  # rows of the keyless sequence
    assert seq_lens[7] == 0 and (out[empty] == 0).all() and (lse[empty] == -math.inf).all()


def test_chunks_respect_the_score_budget(monkeypatch):
    monkeypatch.setattr(batched_attention, "MAX_SCORES_PER_MATMUL", 100)
    lens = [10, 10, 30, 5, 40, 1]
    # 2 scores per key: [0, 1] pads to 10 (40 scores), adding 2 would pad to 30 (180).
    assert batched_attention._chunks(list(range(6)), lens, 2) == [[0, 1], [2], [3], [4], [5]]
    assert batched_attention._chunks([4], lens, 1000) == [[4]]  # alone past the budget


def test_the_torch_backend_is_the_spec_with_batched_attention():
    """Its attention and append batched; its sampling stages the spec's, on one thread
    (`lone_row_on_one_thread`: `__wrapped__` is the spec's function)."""
    backend = get_backend("torch")
    assert backend.paged_attention is batched_attention.paged_attention
    assert backend.append_kv is batched_attention.append_kv
    for op in STAGE_OPERATIONS:
        if op not in ("paged_attention", "append_kv"):
            assert getattr(backend, op).__wrapped__ is getattr(SPEC_BACKEND, op), op
    assert backend.kernel_ops == ()


def test_the_engine_speculates_on_it_with_the_spec_backends_tokens():
    """Drafts verified in one forward pass (q_len = K + 1 per request, a group of
    its own next to plain decodes): the spec backend's tokens. The batches
    without drafts: tests/engine/test_engine.py, every backend."""
    model = random_weights(small_config(), seed=3)
    prompts = [list(b"abab abab ab"), list(b"a"), list(b"cdcd cd cdcd")]
    outputs = {}
    for backend in ("spec", "torch"):
        engine = Engine(model, ByteTokenizer(), backend=backend, block_size=3, speculate="ngram")
        ids = [
            engine.add_request(
                p, SamplingParams(temperature=0.9 * i, seed=i, max_tokens=10, ignore_eos=True)
            )
            for i, p in enumerate(prompts)
        ]
        while engine.has_unfinished():
            engine.step()
        outputs[backend] = [engine.output(i).token_ids for i in ids]
    assert outputs["torch"] == outputs["spec"]


def test_both_commands_default_to_it_and_the_files_own_format():
    """The fastest path that conforms is the default (issue 41); the spec on request."""
    parser = build_parser()
    for argv in (["serve"], ["generate", "hi"]):
        args = parser.parse_args(argv)
        assert (args.backend, args.weights, args.token_budget) == ("torch", "auto", 128)
        assert (args.long_prompt_chunk, args.long_prompt_interval) == (64, 12)
    assert parser.parse_args(["generate", "hi", "--backend", "spec"]).backend == "spec"


def test_layers_reuse_the_first_layers_plan_and_a_new_batch_gets_its_own():
    """forward_cached validates (and plans) at layer 0 only: later layers reuse the plan
    for the same layout tensors; the next pass, with another layout, plans again. Each
    pass's logits are the spec attention's."""
    from decodespec.spec.forward import PagedBatch, forward_cached

    model = random_weights(small_config(num_layers=3), seed=4)
    config = model.config
    shape = (8, 4, config.num_kv_heads, config.head_dim)
    caches = {
        name: [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
        for name in ("spec", "torch")
    }
    passes = [  # (tokens per sequence, KV length per sequence): prefill then mixed decode
        ([5, 3], [5, 3]),
        ([1, 1], [6, 4]),
        ([1, 2], [7, 6]),
    ]
    g = torch.Generator().manual_seed(0)
    for q_lens, seq_lens in passes:
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        positions = torch.cat(
            [torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens, strict=True)]
        )
        table = torch.tensor([[0, 1, -1], [2, 3, -1]])
        slots = torch.cat(
            [
                table[b, p // 4] * 4 + p % 4
                for b, (n, s) in enumerate(zip(q_lens, seq_lens, strict=True))
                for p in [torch.arange(s - n, s)]
            ]
        )
        batch = PagedBatch(
            positions=positions,
            query_start=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            block_table=table,
            slot_mapping=slots,
            logits_indices=torch.tensor(starts[1:]) - 1,
        )
        ids = torch.randint(0, config.vocab_size, (starts[-1],), generator=g)
        spec = forward_cached(model, ids, batch, caches["spec"])
        ours = forward_cached(
            model, ids, batch, caches["torch"], attention=batched_attention.paged_attention
        )
        assert torch.allclose(ours, spec, rtol=1e-5, atol=1e-5), (q_lens, seq_lens)
