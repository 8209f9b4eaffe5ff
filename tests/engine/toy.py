"""Small random models, a byte tokenizer and helpers that drive an engine, for engine
tests (no files, no network)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from decodespec.spec.forward import LayerWeights, ModelConfig, ModelWeights, RopeScaling
from decodespec.spec.params import SamplingParams

if TYPE_CHECKING:
    from decodespec.reference.engine import Engine


def random_weights(
    config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32
) -> ModelWeights:
    """A model with random weights of a realistic scale (logits of order 1-10)."""
    g = torch.Generator().manual_seed(seed)
    hidden, d = config.hidden_size, config.head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / cols**0.5).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)

    def bias(size: int) -> torch.Tensor | None:
        return (0.1 * torch.randn(size, generator=g)).to(dtype) if config.attention_bias else None

    layers = [
        LayerWeights(
            attn_norm=norm(),
            q_proj=matrix(config.num_heads * d, hidden),
            k_proj=matrix(config.num_kv_heads * d, hidden),
            v_proj=matrix(config.num_kv_heads * d, hidden),
            o_proj=matrix(hidden, config.num_heads * d),
            mlp_norm=norm(),
            gate_proj=matrix(config.intermediate_size, hidden),
            up_proj=matrix(config.intermediate_size, hidden),
            down_proj=matrix(hidden, config.intermediate_size),
            q_bias=bias(config.num_heads * d),
            k_bias=bias(config.num_kv_heads * d),
            v_bias=bias(config.num_kv_heads * d),
        )
        for _ in range(config.num_layers)
    ]
    embedding = (torch.randn(config.vocab_size, hidden, generator=g) * 2).to(dtype)
    output = embedding if config.tie_word_embeddings else matrix(config.vocab_size, hidden) * 4
    return ModelWeights(config, embedding, layers, norm(), output)


def small_config(**overrides: object) -> ModelConfig:
    base = dict(
        vocab_size=260,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        max_context=128,
        rope_theta=10_000.0,
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


LLAMA3_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=32
)


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS, 257..259 are special (no text)."""

    eos_token_ids = (256,)
    bos_token_id = None
    special_token_ids = frozenset({256, 257, 258, 259})
    vocab_size = 260
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode(errors="replace")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def record_admissions(engine: Engine) -> list[tuple[int, int]]:
    """(request id, positions mapped from the prefix cache) of every admission that
    succeeds, in order; admissions that do not fit are left out."""
    log: list[tuple[int, int]] = []
    admit = engine.scheduler.admit

    def recording_admit(request):
        admitted = admit(request)
        if admitted:
            log.append((request.id, request.num_cached))
        return admitted

    engine.scheduler.admit = recording_admit
    return log


def run_to_end(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()
