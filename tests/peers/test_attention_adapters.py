"""Direct checks of the attention peer adapters on one tiny paged batch.

The conformance suite (`pytest tests/conformance --impl tests.peers.<module>`)
is what measures the peers; these checks only show that each adapter runs,
lays the pages out right (it agrees with the spec, in float32, where the peer
conforms) and refuses clearly what it cannot do.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from decodespec.spec.attention import paged_attention as spec_paged_attention

CPU_PEERS = ("torch_sdpa", "torch_flex", "transformers_eager", "transformers_sdpa")
GPU_PEERS = ("flashinfer_ops", "vllm_ops")
NO_LSE = ("torch_sdpa", "transformers_eager", "transformers_sdpa")


def peer(name: str):
    return importlib.import_module(f"tests.peers.{name}")


def tiny_batch(block_size: int = 3) -> dict:
    """A decode, a chunk, a whole prompt and an idle sequence; GQA 6 over 2; NaN-filled pages."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 1), (10, 4), (5, 5), (4, 0)]  # (seq_len, q_len)
    num_kv_heads, num_q_heads, head_dim = 2, 6, 16
    used = [-(-n // block_size) for n, _ in shapes]
    num_blocks = sum(used) + 2
    order = torch.randperm(num_blocks, generator=g)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    block_table = torch.full((len(shapes), max(used) + 1), -1, dtype=torch.int32)
    taken, starts = 0, [0]
    for b, (seq_len, q_len) in enumerate(shapes):
        blocks = order[taken : taken + used[b]]
        taken += used[b]
        block_table[b, : used[b]] = blocks
        position = torch.arange(seq_len)
        k_cache[blocks[position // block_size], position % block_size] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=g
        )
        v_cache[blocks[position // block_size], position % block_size] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=g
        )
        starts.append(starts[-1] + q_len)
    return {
        "q": torch.randn(starts[-1], num_q_heads, head_dim, generator=g),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": block_table,
        "seq_lens": torch.tensor([n for n, _ in shapes], dtype=torch.int32),
        "query_start": torch.tensor(starts, dtype=torch.int32),
    }


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CPU_PEERS)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_adapter_agrees_with_the_spec_on_a_tiny_batch(name, scale):
    args = tiny_batch()
    out = peer(name).paged_attention(**args, scale=scale)
    assert_close(out, spec_paged_attention(**args, scale=scale))


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_flex_log_sum_exp_is_the_natural_one(block_size):
    args = tiny_batch(block_size)
    out, lse = peer("torch_flex").paged_attention(**args, return_lse=True)
    ref_out, ref_lse = spec_paged_attention(**args, return_lse=True)
    assert_close(out, ref_out)
    assert_close(lse, ref_lse)


@pytest.mark.parametrize("name", NO_LSE)
def test_peers_without_log_sum_exp_say_so(name):
    with pytest.raises(NotImplementedError, match="log-sum-exp"):
        peer(name).paged_attention(**tiny_batch(), return_lse=True)


@pytest.mark.parametrize("name", CPU_PEERS + GPU_PEERS)
def test_every_peer_names_its_package_and_functions(name):
    info = peer(name).PEER
    assert set(info) == {"name", "package", "functions"}
    assert all(isinstance(v, str) and v for v in info.values())


@pytest.mark.parametrize("name", GPU_PEERS)
def test_gpu_peers_declare_cuda(name):
    assert peer(name).PEER_REQUIRES == "cuda"


GPU_CALLS = {
    "flashinfer_ops": {
        "paged_attention": lambda m: m.paged_attention(**tiny_batch()),
        "top_k_mask": lambda m: m.top_k_mask(torch.zeros(2, 5), torch.tensor([1, 0])),
        "top_p_mask": lambda m: m.top_p_mask(torch.zeros(2, 5), torch.tensor([0.5, 1.0])),
    },
    "vllm_ops": {
        "top_k_mask": lambda m: m.top_k_mask(torch.zeros(2, 5), torch.tensor([1, 0])),
        "top_p_mask": lambda m: m.top_p_mask(torch.zeros(2, 5), torch.tensor([0.5, 1.0])),
    },
}


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal without CUDA; this machine has CUDA"
)
@pytest.mark.parametrize(
    ("name", "operation"), [(n, op) for n, calls in GPU_CALLS.items() for op in calls]
)
def test_gpu_peers_refuse_clearly_without_cuda(name, operation):
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU: torch\.cuda\.is_available\(\)"):
        GPU_CALLS[name][operation](peer(name))
