"""A tokenizer from a GGUF file's metadata (llama.cpp's `tokenizer.ggml.*` keys).

`gguf_tokenizer_parts(file)` builds the `TokenizerParts` a `Tokenizer` is made
of (`Tokenizer.from_gguf` calls it) from the vocabulary `gguf_file.py` reads.
Supported: `tokenizer.ggml.model == "gpt2"`, byte-level BPE
(`tokenizer.ggml.tokens`, `tokenizer.ggml.merges`), with the pre-tokenizer
named by `tokenizer.ggml.pre`, reproduced from llama.cpp's table
(`llama-vocab.cpp`): each pre-type is a list of regular expressions applied in
turn, each one splitting every piece into its matches and the text between
them. "smollm" (like "starcoder", "refact", "command-r", ...) first isolates
every digit and then applies GPT-2's regex: exactly the original SmolLM2
`tokenizer.json` (`Sequence([Digits(individual_digits=True),
ByteLevel(use_regex=True)])`). "gpt-2" applies GPT-2's regex alone. An unknown
pre-type raises ValueError. SentencePiece GGUF vocabularies (`"llama"`) raise
ValueError: load such a model from its Hugging Face directory.

Token types (`gguf.TokenType`): control and unknown tokens are special
(matched whole in text, `b""` as bytes, skipped by `decode`); user-defined
tokens are matched whole in text and keep their text as bytes, as llama.cpp
does; byte tokens ("<0xNN>") are one byte; unused tokens are special and
never matched.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence

import gguf
import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from .gguf_file import GGUFFile, open_gguf, read_vocabulary
from .tokenizer_parts import (
    UNICODE_TO_BYTE,
    TokenizerParts,
    byte_level_bytes,
    sentencepiece_bytes,
)

# --------------------------------------------------------------------------------------
# Pre-tokenizers of GGUF byte-level vocabularies (llama.cpp, llama-vocab.cpp).

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_V3 = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


class _PreType:
    """How one `tokenizer.ggml.pre` value splits text before BPE."""

    def __init__(
        self, splits: Sequence[str], *, ignore_merges: bool = False, add_bos: bool = False
    ) -> None:
        self.splits = tuple(splits)
        self.ignore_merges = ignore_merges  # a word that is a whole token is not merged
        self.add_bos = add_bos  # llama.cpp's default when the file has no add_bos_token

    def build(self) -> pre_tokenizers.PreTokenizer:
        if self.splits == (_GPT2,):
            return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.splits == (r"\p{N}", _GPT2):  # the form SmolLM2/StarCoder's tokenizer.json use
            return pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )


def _pre_types() -> dict[str, _PreType]:
    table: dict[str, _PreType] = {}

    def add(names: Iterable[str], pre: _PreType) -> None:
        table.update(dict.fromkeys(names, pre))

    add(
        ("default",),
        _PreType([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]),
    )
    add(
        (
            *("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling"),
            *("exaone4", "gigachat", "a.x-4.0", "mellum"),
        ),
        _PreType([_GPT2]),
    )
    add(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _PreType([r"\p{N}", _GPT2]),
    )
    add(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _PreType([_LLAMA3], ignore_merges=True, add_bos=True),
    )
    add(("dbrx", "smaug-bpe"), _PreType([_LLAMA3]))
    add(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"),
        _PreType([_QWEN2]),
    )
    add(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _PreType([_GPT4O]))
    add(("tekken",), _PreType([_TEKKEN], ignore_merges=True, add_bos=True))
    add(("falcon",), _PreType([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]))
    add(
        ("deepseek-coder",),
        _PreType(
            [
                r"[\r\n]",
                r"\s?\p{L}+",
                r"\s?\p{P}+",
                "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
                r"\p{N}",
            ]
        ),
    )
    add(
        ("deepseek-v3",),
        _PreType([r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK_V3]),
    )
    add(("poro-chat", "bloom", "gpt3-finnish"), _PreType([_BLOOM]))
    add(("viking",), _PreType([_BLOOM, r"\p{N}"]))
    return table


GGUF_PRE_TYPES: dict[str, _PreType] = _pre_types()
"""The `tokenizer.ggml.pre` values this module reproduces (llama.cpp's names)."""

# GGUF's byte-level alphabet -> the bytes it spells, as `str.translate` takes it: each
# character of the alphabet to the Latin-1 character of its byte; every other character
# below 256 to U+0100, which Latin-1 cannot encode (see `_byte_level_bytes`).
_TO_LATIN1 = {ord(char): byte for char, byte in UNICODE_TO_BYTE.items()} | {
    code: 0x100 for code in range(256) if chr(code) not in UNICODE_TO_BYTE
}


def _byte_level_bytes(token: str) -> bytes:
    """`tokenizer_parts.byte_level_bytes(token)`, by one `str.translate` where every
    character is of the alphabet (a vocabulary's tokens, but for rare ones): looked
    up one character at a time in Python, a 49,152-token vocabulary took a second."""
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the alphabet: its UTF-8 bytes
        return byte_level_bytes(token)


# --------------------------------------------------------------------------------------


def gguf_tokenizer_parts(
    file: GGUFFile | gguf.GGUFReader | str | os.PathLike[str],
) -> TokenizerParts:
    """Build the tokenizer a GGUF file describes in its metadata.

    Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE) with a
    `tokenizer.ggml.pre` from `GGUF_PRE_TYPES` (a missing pre-type
    is llama.cpp's "default", with a warning). Keys read:
    `tokenizer.ggml.{tokens, merges, token_type, pre, bos_token_id,
    eos_token_id, eot_token_id, eom_token_id, unknown_token_id,
    padding_token_id, add_bos_token, add_eos_token}` and
    `tokenizer.chat_template`. The EOS ids are eos, then eot and eom when
    present (the ids the file itself names as ends of a turn).

    Args:
        file: an open `GGUFFile` or `gguf.GGUFReader` (share it with the
            weight loader: the file is then mapped and parsed once), or the
            file's path.

    Returns:
        the parts of the tokenizer.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file, no tokenizer in it, an unsupported
            tokenizer model or pre-type, or inconsistent metadata.
    """
    file = open_gguf(file)
    where = file.source
    vocabulary = read_vocabulary(file)
    model = vocabulary.model
    if model != "gpt2":
        kind = {"llama": "SentencePiece", "bert": "WordPiece", "t5": "Unigram"}.get(
            model, "unknown"
        )
        raise ValueError(
            f"{where}: unsupported GGUF tokenizer model {model!r} ({kind}); the reference "
            f"tokenizer supports 'gpt2' (byte-level BPE) GGUF vocabularies. Load this "
            f"model from its Hugging Face directory (tokenizer.json) instead."
        )
    tokens = vocabulary.tokens
    if not tokens or vocabulary.merges is None:
        raise ValueError(f"{where}: a gpt2 tokenizer needs tokenizer.ggml.tokens and .merges")

    pre_name = vocabulary.pre
    if pre_name is None:
        warnings.warn(
            f"{where} names no tokenizer.ggml.pre; using llama.cpp's 'default' "
            f"pre-tokenizer, which may not be the one the model was trained with",
            stacklevel=3,  # the caller of Tokenizer.from_gguf
        )
        pre_name = "default"
    pre = GGUF_PRE_TYPES.get(pre_name)
    if pre is None:
        raise ValueError(
            f"{where}: unsupported tokenizer pre-type {pre_name!r} "
            f"(tokenizer.ggml.pre); supported: {sorted(GGUF_PRE_TYPES)}"
        )

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    try:
        backend = tokenizers.Tokenizer(
            models.BPE(vocab, vocabulary.merges, ignore_merges=pre.ignore_merges, fuse_unk=False)
        )
    except Exception as error:
        raise ValueError(f"{where}: invalid vocabulary or merges: {error}") from error
    backend.pre_tokenizer = pre.build()
    backend.decoder = decoders.ByteLevel()

    special_ids: list[int] = []
    table: list[bytes] = []
    specials: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    for i, (token, kind) in enumerate(zip(tokens, vocabulary.token_types, strict=True)):
        if kind == TokenType.NORMAL:  # most of them: first
            table.append(_byte_level_bytes(token))
        elif kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED):
            special_ids.append(i)
            table.append(b"")
            if kind != TokenType.UNUSED and vocab[token] == i:
                specials.append(AddedToken(token, special=True, normalized=False))
        elif kind == TokenType.USER_DEFINED:
            table.append(token.encode("utf-8"))
            if vocab[token] == i:
                user_defined.append(AddedToken(token, special=False, normalized=False))
        elif kind == TokenType.BYTE:
            table.append(sentencepiece_bytes(token))
        else:
            table.append(_byte_level_bytes(token))
    backend.add_special_tokens(specials)
    backend.add_tokens(user_defined)  # both reuse the tokens' ids: they are in the vocab

    bos = vocabulary.bos_token_id
    eos_ids = vocabulary.eos_token_ids
    add_bos = pre.add_bos if vocabulary.add_bos is None else vocabulary.add_bos

    def content(i: int | None) -> str | None:
        return None if i is None else tokens[i]

    template_tokens = {
        "bos_token": content(bos),
        "eos_token": content(eos_ids[0] if eos_ids else None),
        "unk_token": content(vocabulary.unknown_token_id),
        "pad_token": content(vocabulary.padding_token_id),
    }
    return TokenizerParts(
        backend,
        token_bytes=table,
        special_ids=special_ids,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        add_bos=add_bos and bos is not None,
        add_eos=bool(vocabulary.add_eos) and bool(eos_ids),
        chat_template=vocabulary.chat_template,
        template_tokens=template_tokens,
    )
