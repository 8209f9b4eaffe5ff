"""What a `Tokenizer` is assembled from, and the raw bytes of single tokens.

The builders (`tokenizer_json.py` for a Hugging Face `tokenizer.json`,
`tokenizer_gguf.py` for a GGUF file) each produce a `TokenizerParts`; the
runtime `Tokenizer` (`tokenizer.py`) is made from one.

The byte-level decoding below is here because the `tokenizers` library
cannot do it: its decoders turn a whole sequence into text, while the stop
stage needs the raw bytes of each token alone, a partial UTF-8 character
included (STOP-UTF8-1), so that a character split across tokens is never
shown in halves. `byte_level_bytes` reads a byte-level BPE token (GPT-2's
alphabet), `sentencepiece_bytes` a SentencePiece one; nothing else of a
tokenizer is reimplemented.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import tokenizers


@dataclass(frozen=True)
class TokenizerParts:
    """Everything a `Tokenizer` holds, as a builder read it from files.

    Args:
        backend: the `tokenizers.Tokenizer` that splits text into ids; its
            special tokens are matched whole in text. Its post-processor is not
            used: BOS and EOS are added by `encode` as `add_bos`/`add_eos` say.
        token_bytes: the raw bytes of every id, `b""` for special tokens.
        special_ids: ids that `decode` skips when asked to and whose bytes are
            `b""`.
        bos_token_id: the beginning-of-sequence id, or None.
        eos_token_ids: every id that ends a generation.
        add_bos: whether `encode` prepends BOS (with add_special_tokens).
        add_eos: whether `encode` appends the first EOS id (with add_special_tokens).
        chat_template: the Jinja chat template, or None.
        template_tokens: token strings passed to the template (bos_token,
            eos_token, unk_token, pad_token).
        strip_leading_space: whether `decode` drops one leading space (the
            prefix space SentencePiece tokenizers add and their decoders strip).
    """

    backend: tokenizers.Tokenizer
    token_bytes: Sequence[bytes]
    special_ids: Sequence[int] | frozenset[int] = ()
    bos_token_id: int | None = None
    eos_token_ids: Sequence[int] = ()
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None
    template_tokens: Mapping[str, str | None] = field(default_factory=dict)
    strip_leading_space: bool = False


# --------------------------------------------------------------------------------------
# Byte-level alphabet (GPT-2): every byte is spelled as one printable character.


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: byte -> the character that spells it in a byte-level vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE: dict[int, str] = _bytes_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPM_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def byte_level_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token spells.

    A character outside GPT-2's alphabet (never in a well-formed byte-level
    vocabulary) stands for its own UTF-8 encoding, as in llama.cpp.

    Args:
        token: the token as the vocabulary spells it.

    Returns:
        the raw bytes.

    Example:
        >>> byte_level_bytes("Ġcaf"), byte_level_bytes("Ã©")
        (b' caf', b'\\xc3\\xa9')
    """
    return b"".join(
        bytes((UNICODE_TO_BYTE[c],)) if c in UNICODE_TO_BYTE else c.encode("utf-8") for c in token
    )


def sentencepiece_bytes(token: str, *, byte_fallback: bool = True) -> bytes:
    """The bytes a SentencePiece token spells: "▁" is a space, "<0xNN>" one byte.

    Args:
        token: the token as the vocabulary spells it.
        byte_fallback: whether "<0xNN>" tokens stand for a single byte.

    Returns:
        the raw bytes.

    Example:
        >>> sentencepiece_bytes("▁hello"), sentencepiece_bytes("<0xE2>")
        (b' hello', b'\\xe2')
    """
    if byte_fallback:
        match = _BYTE_TOKEN.fullmatch(token)
        if match:
            return bytes((int(match.group(1), 16),))
    return token.replace(SPM_SPACE, " ").encode("utf-8")
