"""The default path on the weights it really gets: a GGUF file laid out as the bundled one.

`make run` and `decodespec serve` load the bundled GGUF in its own format (`auto`:
int4, its Q4_1 blocks kept) and run the torch backend's native step, whose products
hold the blocks' float16 scales and offsets in float16 (`cpu_linear`'s `half`) and are
told so by a flag in the step's table. Random weights (tests/engine/test_native_step.py's
first test) never have float16 scales, so a flag read wrong there goes unseen; here
every field the default path reads comes from a file that has them:

- the C product on GGUF blocks (Q4_0, Q4_1, Q8_0, and the tied int8 output projection
  quantized from the Q8_0 embedding) against QUANT-A8-1's definition and the values
  gguf-py reads from the same bytes;
- the whole default path (the loader's `auto`, the torch backend, the native step, the
  output projection) on a small GGUF file against the spec's decoder on the file's
  values as gguf-py reads them: the next-token distributions close (KL) and the same
  most likely token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from decodespec.reference import cpu_linear
from decodespec.reference.backend import DEFAULT_BACKEND
from decodespec.reference.engine import Engine
from decodespec.reference.gguf_fast import groups_fast
from decodespec.reference.loader import load_weights
from decodespec.reference.native_step import NativeStep
from decodespec.reference.weight_formats import AUTO, LoadSummary, int8_per_channel
from decodespec.spec.forward import forward_naive, project_logits
from decodespec.spec.params import SamplingParams
from tests.engine import checkpoints
from tests.engine.test_weight_formats import F32_RTOL, a8_error
from tests.engine.toy import ByteTokenizer, random_weights, small_config


def gguf_weight(dense: torch.Tensor, type_name: str):
    """`dense` through `type_name` blocks as the loader holds them: `groups_fast` on the
    raw bytes (the loader's reading; Q8_0 by the spec's `gguf_groups`), and the values
    gguf-py reads from the same bytes."""
    raw = torch.from_numpy(checkpoints.gguf_bytes(dense, type_name))
    return groups_fast(raw, type_name, dense.shape[1]), checkpoints.gguf_values(dense, type_name)


@pytest.mark.clause("QUANT-A8-1", "QUANT-TOL-1", "GGUF-GROUPS-1")
@pytest.mark.parametrize("layout", ["Q4_0", "Q4_1", "Q8_0", "tied int8 output"])
def test_the_c_product_on_gguf_blocks_is_the_activation_quantized_linear(layout):
    """A projection in GGUF blocks, packed for the torch backend, is held with its float16
    fields in float16 (`half`), holds the file's values exactly, and multiplies as
    QUANT-A8-1 defines at float32's tolerance, from 1 to 9 tokens (the tiles' row counts)
    and at 40 (threaded). "tied int8 output" is the bundled file's output projection:
    int8 per channel of its Q8_0 embedding, whose row maxima are 127 times a block's
    float16 scale, so its scales are float16 values too."""
    g = torch.Generator().manual_seed(63)
    dense = torch.randn(45, 320, generator=g) / 320**0.5  # 45 rows: a last tile of five
    if layout == "tied int8 output":
        weight = int8_per_channel(checkpoints.gguf_values(dense * 40, "Q8_0"))
        values = weight.dequantize()
    else:
        weight, values = gguf_weight(dense, layout)
    kernel = cpu_linear.pack(weight)
    assert isinstance(kernel, cpu_linear.ActivationQuantizedLinear), layout
    assert kernel.half, f"{layout}: its scales and offsets are float16 values"
    assert torch.equal(kernel.dequantize(), values), layout
    x = torch.randn(40, 320, generator=g) * 3
    for tokens in (*range(1, 10), 40):
        out = kernel.linear(x[:tokens])
        assert a8_error(out, x[:tokens], weight) < F32_RTOL, (layout, tokens)


# ---------------------------------------------------------------- the default path, end to end

CONFIG = dict(vocab_size=288, hidden_size=128, intermediate_size=256, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=32, max_context=256,
              tie_word_embeddings=True)  # fmt: skip
PROMPT, NEW = 40, 24
# Measured on this model: top-1 agreement 62/63, KL mean 9.5e-4, max 5.6e-3 (the
# activations' int8 codes of QUANT-A8-1, and the output projection requantized per
# channel); with the step's float16 flag passed as 0: agreement 0, KL mean 3.8.
MIN_TOP1 = 0.9
MAX_KL_MEAN = 5e-3
MAX_KL = 5e-2
EMBEDDING_SCALE = 0.15  # logits of std ~3.5, the top token's probability ~0.65 on average


@pytest.fixture(scope="module")
def toy_gguf(tmp_path_factory):
    """A small random model (tied embedding) written as the bundled file is laid out, and
    the float32 weights the file holds (gguf-py's reading of its blocks). The embedding
    is scaled down so that the next-token distributions are spread as a language
    model's are: with the toy's own scale they are one-hot and KL would see nothing."""
    model = random_weights(small_config(**CONFIG), seed=0)
    table = model.embedding * EMBEDDING_SCALE
    model = dataclasses.replace(model, embedding=table, output=table)  # still tied
    path = checkpoints.write_toy_gguf(tmp_path_factory.mktemp("default") / "toy.gguf", model)
    return path, checkpoints.gguf_file_values(model)


@pytest.mark.clause("FWD-QUANT-1", "QUANT-A8-1", "GGUF-GROUPS-1")
def test_the_default_path_on_a_gguf_file_is_the_definition_on_its_values(toy_gguf, monkeypatch):
    """What `decodespec serve` runs by default, on a small file laid out as the bundled
    one: loaded in its own format (auto: int4, its Q4_1 blocks kept, the tied Q8_0
    embedding int8 per channel), the torch backend, the native step on every pass, every
    product with its float16 flag set (checked: the case this test is for). A prompt in
    one pass, then greedy decode steps; at each of the 63 positions the engine's
    next-token distribution (its step's hidden states through its output projection)
    against the spec's decoder on the file's values: KL(definition ‖ engine) small, the
    same most likely token; and each token the engine chose is the most likely under its
    own logits (the rows compared are those it sampled from)."""
    path, values = toy_gguf
    messages = []
    weights = load_weights(path, weights=AUTO, progress=messages.append)
    (summary,) = [m for m in messages if isinstance(m, LoadSummary)]
    assert summary.weights == "int4" and "14 kept from Q4_1 blocks" in summary, summary
    engine = Engine(weights, ByteTokenizer(), backend=DEFAULT_BACKEND)
    step = engine.runner.native
    assert isinstance(step, NativeStep), engine.path
    kernels = [k for layer in engine.weights.layers
               for k in (layer.q_proj.shared.kernel, layer.o_proj,
                         layer.gate_proj.shared.kernel, layer.down_proj)]  # fmt: skip
    assert all(k.half for k in [*kernels, engine.weights.output]), "float16 fields expected"

    hidden = []
    call = NativeStep.__call__

    def recording(self, token_ids, paged, kv_cache):
        out = call(self, token_ids, paged, kv_cache)
        hidden.append(out)
        return out

    monkeypatch.setattr(NativeStep, "__call__", recording)
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    output = [e.token_id for e in engine.generate(prompt, greedy) if e.token_id is not None]
    assert len(output) == NEW
    assert [h.shape[0] for h in hidden] == [PROMPT] + [1] * (NEW - 1), "every pass native"

    ours = project_logits(torch.cat(hidden), engine.weights.output).double()
    sequence = torch.tensor(prompt + output)
    definition = forward_naive(values, sequence)[:-1].double()
    assert torch.equal(ours[PROMPT - 1 :].argmax(-1), torch.tensor(output))
    log_p, log_q = definition.log_softmax(-1), ours.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    top1 = float((definition.argmax(-1) == ours.argmax(-1)).double().mean())
    figures = f"top-1 {top1:.3f}, KL mean {float(kl.mean()):.2e} max {float(kl.max()):.2e}"
    assert top1 >= MIN_TOP1, figures
    assert float(kl.mean()) <= MAX_KL_MEAN and float(kl.max()) <= MAX_KL, figures
