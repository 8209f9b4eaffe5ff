"""The model loader (`decodespec.reference.loader`): checkpoints load into the spec's decoder.

The decoder of `decodespec.spec.forward` fed by the loader must compute what
transformers computes from the same checkpoint:

- small random Llama / Mistral / Qwen2 models saved as safetensors;
- GGUF files written from such models the way llama.cpp's converter does
  (Q/K rows permuted), F32 and quantized;
- the bundled SmolLM2-135M-Instruct GGUF, loaded by transformers' own GGUF
  code and by ours: the test that proves the Q/K un-permutation on a real
  file. Its tests are named `test_bundled_gguf_*` (`pytest -k bundled_gguf`).

and refused or corrupt input must raise the documented error with a helpful
message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from decodespec.reference.gguf_checkpoint import unpermute_rope_rows
from decodespec.reference.loader import load_weights
from decodespec.spec.forward import ModelWeights, forward_naive
from tests.engine import checkpoints

FORWARD_CLAUSES = (
    "FWD-EMBED-1",
    "FWD-NORM-1",
    "FWD-ROPE-1",
    "FWD-ATTN-1",
    "FWD-MLP-1",
    "FWD-LAYER-1",
    "LOGITS-PROJ-1",
)
PROMPT_LENGTH = 12
NEW_TOKENS = 8
RTOL = 1e-4  # max |ours - transformers| / max(1, max |transformers|), float32


def random_prompt(vocab: int, length: int = PROMPT_LENGTH, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].to(torch.float32)


def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids)[None],
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
        )
    return out[0, ids.shape[0] :].tolist()


def spec_greedy(weights: ModelWeights, ids: torch.Tensor, steps: int) -> list[int]:
    tokens = ids.clone()
    for _ in range(steps):
        next_id = forward_naive(weights, tokens, last_only=True)[0].argmax()
        tokens = torch.cat([tokens, next_id[None]])
    return tokens[ids.shape[0] :].tolist()


def relative_difference(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max()) / max(1.0, float(reference.abs().max()))


def assert_same_function(weights: ModelWeights, model: torch.nn.Module, steps: int = NEW_TOKENS):
    """Logits within float32 tolerance and a token-identical greedy continuation."""
    ids = random_prompt(weights.config.vocab_size)
    ours = forward_naive(weights, ids)
    reference = hf_logits(model, ids)
    assert ours.shape == reference.shape
    difference = relative_difference(ours, reference)
    assert difference < RTOL, f"logits differ from transformers' by {difference:.2e} (relative)"
    assert spec_greedy(weights, ids, steps) == hf_greedy(model, ids, steps)
    return difference


# ---------------------------------------------------------------------------
# Hugging Face safetensors directories.
# ---------------------------------------------------------------------------

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # with head_dim 32 and θ = 5e5 the wavelengths 6.3, 14.3 | 32.4 | 73.6, ...
    # fall in all three bands (kept < 16 <= interpolated <= 64 < divided)
    "original_max_position_embeddings": 64,
}

HF_CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 24}),
    "qwen2": ("qwen2", {"head_dim": None}),  # head_dim = hidden / heads = 16
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 6}),
}


def _zero_output_bias(model: torch.nn.Module) -> None:
    """Our decoder has no o_proj bias; a Llama with attention_bias loads when it is zero."""
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn.o_proj.bias is not None:
                layer.self_attn.o_proj.bias.zero_()


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """name -> (transformers model, directory it was saved to)."""
    built = {}
    for seed, (name, (kind, overrides)) in enumerate(HF_CASES.items()):
        model = checkpoints.hf_model(kind, seed=seed, **overrides)
        _zero_output_bias(model)
        directory = checkpoints.save_hf(model, tmp_path_factory.mktemp(name))
        built[name] = (model, directory)
    return built


@pytest.mark.clause(*FORWARD_CLAUSES)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.clause("FWD-ROPE-2")) if "llama3" in name else name
        for name in HF_CASES
    ],
)
def test_hf_checkpoint_matches_transformers(hf_checkpoints, name):
    model, directory = hf_checkpoints[name]
    weights = load_weights(directory)
    assert weights.dtype == torch.float32
    difference = assert_same_function(weights, model)
    print(f"{name}: max relative logit difference {difference:.2e}")


def test_hf_config_mapping(hf_checkpoints):
    config = load_weights(hf_checkpoints["llama"][1]).config
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (6, 2, 32)
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (96, 96, 2)
    assert config.max_context == 128 and config.rms_norm_eps == 1e-5
    assert not config.tie_word_embeddings and not config.attention_bias
    assert config.rope_scaling is None

    tied = load_weights(hf_checkpoints["llama-tied"][1])
    assert tied.config.tie_word_embeddings and tied.output is tied.embedding

    scaled = load_weights(hf_checkpoints["llama-llama3-rope"][1]).config
    assert scaled.rope_theta == 500_000.0
    assert scaled.rope_scaling is not None and scaled.rope_scaling.original_context == 64

    qwen = load_weights(hf_checkpoints["qwen2"][1])
    assert qwen.config.attention_bias and qwen.config.head_dim == 16
    assert qwen.layers[0].q_bias is not None and qwen.layers[0].q_bias.abs().sum() > 0

    assert load_weights(hf_checkpoints["llama-attention-bias"][1]).config.attention_bias


def test_llama3_scaling_changes_the_logits(hf_checkpoints):
    """The llama3 case above would catch a loader that dropped the scaling."""
    weights = load_weights(hf_checkpoints["llama-llama3-rope"][1])
    unscaled = ModelWeights(
        config=type(weights.config)(**{**weights.config.__dict__, "rope_scaling": None}),
        embedding=weights.embedding,
        layers=weights.layers,
        final_norm=weights.final_norm,
        output=weights.output,
    )
    ids = random_prompt(weights.config.vocab_size)
    assert relative_difference(forward_naive(unscaled, ids), forward_naive(weights, ids)) > 1e-2


def test_sliding_window_caps_the_context(hf_checkpoints):
    """Mistral's window (24) is below max_position_embeddings (128): the context is capped."""
    assert load_weights(hf_checkpoints["mistral-sliding-window"][1]).config.max_context == 24


def test_sharded_checkpoint_and_file_paths(hf_checkpoints, tmp_path):
    model, directory = hf_checkpoints["llama"]
    sharded = checkpoints.save_hf(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    whole = load_weights(directory)
    for path in (sharded, str(sharded), directory / "config.json", directory / "model.safetensors"):
        loaded = load_weights(path)
        assert torch.equal(loaded.embedding, whole.embedding)
        assert torch.equal(loaded.layers[1].k_proj, whole.layers[1].k_proj)
        assert torch.equal(loaded.output, whole.output)


def test_dtype_and_progress(hf_checkpoints):
    messages: list[str] = []
    weights = load_weights(
        hf_checkpoints["qwen2"][1], dtype=torch.bfloat16, progress=messages.append
    )
    assert weights.dtype == torch.bfloat16
    assert all(
        t.dtype == torch.bfloat16 for t in (weights.layers[0].q_proj, weights.layers[0].q_bias)
    )
    assert messages and "model.safetensors" in messages[0]


# ---------------------------------------------------------------------------
# GGUF files written like llama.cpp's converter.
# ---------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    generator = torch.Generator().manual_seed(0)
    for heads, head_dim, columns in ((6, 16, 5), (2, 16, 5), (3, 64, 1)):
        weight = torch.randn(heads * head_dim, columns, generator=generator)
        permuted = torch.from_numpy(checkpoints.llama_cpp_permute(weight.numpy(), heads))
        assert not torch.equal(permuted, weight)
        assert torch.equal(unpermute_rope_rows(permuted, heads), weight)
        bias = weight[:, 0].contiguous()
        permuted_bias = torch.from_numpy(checkpoints.llama_cpp_permute(bias.numpy(), heads))
        assert torch.equal(unpermute_rope_rows(permuted_bias, heads), bias)


@pytest.mark.clause(*FORWARD_CLAUSES)
@pytest.mark.parametrize("name", ["llama", "llama-tied"])
def test_llama_gguf_f32_matches_the_hf_model(hf_checkpoints, tmp_path, name):
    """F32 GGUF with llama.cpp's Q/K permutation (GQA 3, head_dim != hidden/heads) → same model."""
    model, _ = hf_checkpoints[name]
    path = checkpoints.write_gguf(
        tmp_path / "model.gguf", "llama", model.config, checkpoints.gguf_tensors(model, "llama")
    )
    weights = load_weights(path)
    assert weights.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert (weights.config.num_heads, weights.config.num_kv_heads) == (6, 2)
    assert_same_function(weights, model)


@pytest.mark.clause(*FORWARD_CLAUSES)
def test_qwen2_gguf_quantized_matches_transformers(hf_checkpoints, tmp_path):
    """Qwen2 (biases, no permutation) with Q8_0, F16 and BF16 tensors vs transformers' GGUF load."""
    model, _ = hf_checkpoints["qwen2"]
    tensors = checkpoints.gguf_tensors(model, "qwen2")
    quantize = {
        "blk.0.attn_q.weight": "Q8_0",
        "blk.0.ffn_down.weight": "F16",
        "blk.1.attn_k.weight": "BF16",
        "output.weight": "Q8_0",
        "token_embd.weight": "Q4_1",
    }
    path = checkpoints.write_gguf(
        tmp_path / "qwen2.gguf", "qwen2", model.config, tensors, quantize=quantize
    )
    weights = load_weights(path)
    assert weights.config.attention_bias
    reference = checkpoints.hf_model_from_gguf(path)
    assert_same_function(weights, reference)
    # quantization really happened: the weights differ from the float32 model's
    assert not torch.equal(weights.embedding, model.model.embed_tokens.weight)


# ---------------------------------------------------------------------------
# The bundled SmolLM2-135M-Instruct GGUF (Q4_1, Q8_0, F32; Llama architecture).
# ---------------------------------------------------------------------------

SMOLLM_PROMPT = torch.tensor([1, 504, 3458, 282, 4649, 314, 3444, 30, 378, 1978, 253, 2, 28, 79])


@pytest.fixture(scope="module")
def bundled_gguf() -> Path:
    try:
        return checkpoints.bundled_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def bundled_ours(bundled_gguf):
    messages: list[str] = []
    weights = load_weights(bundled_gguf, progress=messages.append)
    return weights, messages


@pytest.fixture(scope="module")
def bundled_transformers(bundled_gguf):
    return checkpoints.hf_model_from_gguf(bundled_gguf)


def test_bundled_gguf_config(bundled_ours):
    weights, messages = bundled_ours
    config = weights.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 576, 1536)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert config.max_context == 8192 and config.rope_theta == 100_000.0
    assert config.tie_word_embeddings and weights.output is weights.embedding
    assert not config.attention_bias and config.rope_scaling is None
    assert len(messages) > 5 and messages[-1] == "dequantizing GGUF tensors 272/272"


@pytest.mark.clause(*FORWARD_CLAUSES)
def test_bundled_gguf_matches_transformers(bundled_ours, bundled_transformers):
    """Same logits as transformers' own GGUF loading: proves the Q/K un-permutation."""
    weights, _ = bundled_ours
    ours = forward_naive(weights, SMOLLM_PROMPT)
    reference = hf_logits(bundled_transformers, SMOLLM_PROMPT)
    difference = relative_difference(ours, reference)
    print(f"bundled SmolLM2: max relative logit difference {difference:.2e}")
    assert difference < RTOL
    steps = 5
    assert spec_greedy(weights, SMOLLM_PROMPT, steps) == hf_greedy(
        bundled_transformers, SMOLLM_PROMPT, steps
    )


def test_bundled_gguf_without_unpermute_is_wrong(bundled_ours, bundled_transformers):
    """The comparison above is sensitive: re-applying llama.cpp's permutation breaks it."""
    weights, _ = bundled_ours
    layer = weights.layers[0]
    permuted = ModelWeights(
        config=weights.config,
        embedding=weights.embedding,
        layers=[
            type(layer)(
                **{
                    **layer.__dict__,
                    "q_proj": torch.from_numpy(
                        checkpoints.llama_cpp_permute(layer.q_proj.numpy(), 9)
                    ),
                    "k_proj": torch.from_numpy(
                        checkpoints.llama_cpp_permute(layer.k_proj.numpy(), 3)
                    ),
                }
            ),
            *weights.layers[1:],
        ],
        final_norm=weights.final_norm,
        output=weights.output,
    )
    ours = forward_naive(permuted, SMOLLM_PROMPT)
    reference = hf_logits(bundled_transformers, SMOLLM_PROMPT)
    assert relative_difference(ours, reference) > 1e-3


# ---------------------------------------------------------------------------
# Refused and corrupt input.
# ---------------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_weights(missing)


def test_random_bytes_gguf(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=r"random\.gguf: not a readable GGUF file") as info:
        load_weights(path)
    assert info.value.__cause__ is not None


def test_truncated_gguf(hf_checkpoints, tmp_path):
    model, _ = hf_checkpoints["llama"]
    path = checkpoints.write_gguf(
        tmp_path / "whole.gguf", "llama", model.config, checkpoints.gguf_tensors(model, "llama")
    )
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"truncated\.gguf: not a readable GGUF file"):
        load_weights(truncated)


def test_gguf_unsupported_architecture_and_rope_freqs(hf_checkpoints, tmp_path):
    model, _ = hf_checkpoints["llama"]
    tensors = checkpoints.gguf_tensors(model, "llama")
    gpt2 = checkpoints.write_gguf(tmp_path / "gpt2.gguf", "gpt2", model.config, tensors)
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2' \(supported: llama"):
        load_weights(gpt2)
    freqs = {**tensors, "rope_freqs.weight": np.ones(8, dtype=np.float32)}
    llama3 = checkpoints.write_gguf(tmp_path / "llama3.gguf", "llama", model.config, freqs)
    with pytest.raises(ValueError, match=r"rope_freqs\.weight .* not supported"):
        load_weights(llama3)


def test_gguf_missing_metadata_and_tensor(hf_checkpoints, tmp_path):
    model, _ = hf_checkpoints["llama"]
    tensors = checkpoints.gguf_tensors(model, "llama")
    bare = checkpoints.write_gguf(
        tmp_path / "bare.gguf", "llama", model.config, tensors, metadata=False
    )
    with pytest.raises(ValueError, match=r"bare\.gguf: GGUF metadata llama\.\S+ is missing"):
        load_weights(bare)
    del tensors["blk.1.ffn_up.weight"]
    partial = checkpoints.write_gguf(tmp_path / "partial.gguf", "llama", model.config, tensors)
    with pytest.raises(
        ValueError, match=r"partial\.gguf: tensor blk\.1\.ffn_up\.weight is missing"
    ):
        load_weights(partial)


def test_truncated_safetensors(hf_checkpoints, tmp_path):
    model, _ = hf_checkpoints["llama"]
    directory = checkpoints.save_hf(model, tmp_path / "model")
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_weights(directory)


def _copy_config(source: Path, destination: Path, **changes: object) -> Path:
    destination.mkdir()
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def test_unsupported_architecture(hf_checkpoints, tmp_path):
    directory = _copy_config(hf_checkpoints["llama"][1], tmp_path / "gpt2", model_type="gpt2")
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'gpt2' \(supported: llama, mistral, qwen2\)"
    ):
        load_weights(directory)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "unsupported rope type 'yarn'"),
        ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}, "llama3 rope scaling lacks"),
    ],
)
def test_unsupported_rope(hf_checkpoints, tmp_path, rope, message):
    source = hf_checkpoints["llama"][1]
    directory = _copy_config(source, tmp_path / "rope", rope_parameters=rope)
    (directory / "model.safetensors").symlink_to(source / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_weights(directory)


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_weights(tmp_path)


def test_pickled_only_directory_is_refused(hf_checkpoints, tmp_path):
    directory = _copy_config(hf_checkpoints["llama"][1], tmp_path / "pickled")
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match=r"pickled .* refused .* convert .* to safetensors"):
        load_weights(directory)
    with pytest.raises(ValueError, match="pickled"):
        load_weights(directory / "pytorch_model.bin")
    (directory / "config.json").unlink()  # only pytorch_model.bin: still the pickle refusal
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: pickled .* refused"):
        load_weights(directory)


def test_config_tensor_shape_mismatch(hf_checkpoints, tmp_path):
    source = hf_checkpoints["llama"][1]
    directory = _copy_config(source, tmp_path / "wide", intermediate_size=128)
    (directory / "model.safetensors").symlink_to(source / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"wide: tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \[96, 96\], "
        r"the config implies \[128, 96\]",
    ):
        load_weights(directory)


def test_missing_and_unexpected_tensors(hf_checkpoints, tmp_path):
    source = hf_checkpoints["llama"][1]
    tensors = load_file(source / "model.safetensors")

    missing = _copy_config(source, tmp_path / "missing")
    save_file(
        {k: v for k, v in tensors.items() if k != "lm_head.weight"}, missing / "model.safetensors"
    )
    with pytest.raises(ValueError, match=r"missing: tensor lm_head\.weight is missing"):
        load_weights(missing)

    extra = _copy_config(source, tmp_path / "extra")
    save_file(
        {**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(32)},
        extra / "model.safetensors",
    )
    with pytest.raises(ValueError, match=r"unexpected tensors model\.layers\.0\.self_attn\.q_norm"):
        load_weights(extra)


def test_nonzero_output_bias_is_refused(tmp_path):
    model = checkpoints.hf_model("llama", seed=3, attention_bias=True)  # o_proj bias random
    directory = checkpoints.save_hf(model, tmp_path / "bias")
    with pytest.raises(ValueError, match=r"o_proj\.bias is a nonzero attention output bias"):
        load_weights(directory)


def test_non_float_dtype_is_refused(hf_checkpoints):
    with pytest.raises(ValueError, match="floating-point"):
        load_weights(hf_checkpoints["llama"][1], dtype=torch.int32)
