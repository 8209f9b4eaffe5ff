"""Text to token ids and back, for the reference engine.

One `Tokenizer` class, built either from a Hugging Face `tokenizer.json`
(`Tokenizer.from_file`) or from the metadata of a GGUF file
(`Tokenizer.from_gguf`). Both run on the `tokenizers` library; what this module
adds is what an engine needs around it:

- `token_bytes(id)`: the raw bytes of one token, precomputed for the whole
  vocabulary. The stop stage decodes the output text incrementally from these
  bytes (STOP-UTF8-1), so a character split across tokens is never shown in
  halves. Special (control) tokens have `b""`: they never appear in output
  text.
- `decode(ids)`: the UTF-8 decoding (invalid bytes become U+FFFD) of the
  concatenated token bytes, so a full decode and a streamed decode agree.
- `encode(text)`: special tokens written in the text ("<|im_start|>") become
  their single ids; BOS is prepended only when the tokenizer says so.
- `apply_chat_template(messages)`: the model's Jinja chat template, rendered
  in a sandbox with the variables Hugging Face passes.
- `eos_token_ids`: every id that ends a generation.

GGUF tokenizers
---------------
A GGUF file stores the vocabulary under llama.cpp's keys. Supported:
`tokenizer.ggml.model == "gpt2"`, byte-level BPE (`tokenizer.ggml.tokens`,
`tokenizer.ggml.merges`), with the pre-tokenizer named by
`tokenizer.ggml.pre`, reproduced from llama.cpp's table (`llama-vocab.cpp`):
each pre-type is a list of regular expressions applied in turn, each one
splitting every piece into its matches and the text between them. "smollm"
(like "starcoder", "refact", "command-r", ...) first isolates every digit and
then applies GPT-2's regex: exactly the original SmolLM2 `tokenizer.json`
(`Sequence([Digits(individual_digits=True), ByteLevel(use_regex=True)])`).
"gpt-2" applies GPT-2's regex alone. An unknown pre-type raises ValueError.
SentencePiece GGUF vocabularies (`"llama"`) raise ValueError: load such a
model from its Hugging Face directory.

Token types (`tokenizer.ggml.token_type`): 1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte. Control and unknown tokens are special
(matched whole in text, `b""` as bytes, skipped by `decode`); user-defined
tokens are matched whole in text and keep their text as bytes, as llama.cpp
does.
"""

from __future__ import annotations

import datetime
import json
import operator
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

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
_SPM_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


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
    return token.replace(_SPM_SPACE, " ").encode("utf-8")


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

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


# --------------------------------------------------------------------------------------
# Chat templates.


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rendered (or called raise_exception)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's override: jinja2's own tojson escapes HTML characters.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a template in the environment Hugging Face's `apply_chat_template` uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the chat template does not compile: {error}") from error


# --------------------------------------------------------------------------------------


class Tokenizer:
    """A tokenizer for the reference engine: ids, raw token bytes, chat template, EOS ids.

    Build one with `Tokenizer.from_file` (a Hugging Face `tokenizer.json`) or
    `Tokenizer.from_gguf` (a GGUF file's metadata); the constructor takes the
    already assembled parts.

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

    Example:
        >>> from decodespec.reference.model_files import bundled_model_path
        >>> tok = Tokenizer.from_gguf(bundled_model_path())
        >>> ids = tok.encode("<|im_start|>user\\nHi 42<|im_end|>")
        >>> ids
        [1, 4093, 198, 26843, 216, 36, 34, 2]
        >>> tok.decode(ids), tok.token_bytes(ids[3]), tok.eos_token_ids
        ('user\\nHi 42', b'Hi', (2,))
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        token_bytes: Sequence[bytes],
        special_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        template_tokens: Mapping[str, str | None] | None = None,
        strip_leading_space: bool = False,
    ) -> None:
        self._backend = backend
        self._token_bytes = [bytes(b) for b in token_bytes]
        n = len(self._token_bytes)
        self._special_ids = frozenset(operator.index(i) for i in special_ids)
        self._bos_token_id = None if bos_token_id is None else operator.index(bos_token_id)
        self._eos_token_ids = tuple(dict.fromkeys(operator.index(i) for i in eos_token_ids))
        for name, ids in (
            ("special_ids", self._special_ids),
            ("eos_token_ids", self._eos_token_ids),
            ("bos_token_id", () if self._bos_token_id is None else (self._bos_token_id,)),
        ):
            bad = sorted(i for i in ids if not 0 <= i < n)
            if bad:
                raise ValueError(f"{name} {bad} lie outside the vocabulary of {n} tokens")
        if add_bos and self._bos_token_id is None:
            raise ValueError("add_bos is set but the tokenizer has no BOS token")
        if add_eos and not self._eos_token_ids:
            raise ValueError("add_eos is set but the tokenizer has no EOS token")
        self._add_bos = bool(add_bos)
        self._add_eos = bool(add_eos)
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self._template_tokens = dict(template_tokens or {})
        self._strip_leading_space = strip_leading_space

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer: `tokenizer.json` and the files beside it.

        Read when present in the same directory: `tokenizer_config.json`
        (chat_template, bos/eos/unk/pad tokens, add_bos_token, add_eos_token),
        `chat_template.jinja` (preferred over tokenizer_config's template, as
        in transformers), `generation_config.json` and `config.json`
        (`eos_token_id`: an id or a list; `bos_token_id`). The EOS ids are the
        tokenizer's eos token, then generation_config's, then config's,
        without repeats. Without an explicit `add_bos_token`, BOS is added
        when the `tokenizer.json` post-processor adds it.

        Token bytes follow the decoder: a ByteLevel decoder means byte-level
        BPE (GPT-2 alphabet); a Metaspace decoder, or a sequence of
        Replace("▁", " ") / ByteFallback / Fuse / Strip, means SentencePiece
        ("▁" is a space, "<0xNN>" one byte).

        Args:
            path: a `tokenizer.json` file, or the directory holding one.

        Returns:
            the tokenizer.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not a valid `tokenizer.json`, or its model
                or decoder is not supported (WordPiece, WordLevel, ...).

        Example:
            >>> tok = Tokenizer.from_file("models/smollm2/tokenizer.json")  # doctest: +SKIP
        """
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            text = path.read_text(encoding="utf-8")
            spec = json.loads(text)
            if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
                raise ValueError("the JSON has no 'model' object")
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as error:  # bad UTF-8, bad JSON, or rejected by `tokenizers`
            raise ValueError(f"{path} is not a valid tokenizer.json: {error}") from error

        model_type = spec["model"].get("type")
        if model_type not in ("BPE", "Unigram"):
            raise ValueError(
                f"{path}: unsupported tokenizer model {model_type!r}; supported: BPE "
                f"(byte-level or SentencePiece-style) and Unigram"
            )
        scheme, strip_leading_space = _decoder_scheme(spec.get("decoder"), path)
        byte_fallback = bool(spec["model"].get("byte_fallback", False)) or scheme == "spm+bytes"

        directory = path.parent
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")
        model_config = _read_json(directory / "config.json")

        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = {int(t["id"]): t for t in spec.get("added_tokens") or [] if isinstance(t, dict)}
        special_ids = {i for i, t in added.items() if t.get("special")}
        table: list[bytes] = []
        for i in range(vocab_size):
            token = backend.id_to_token(i)
            if token is None or i in special_ids:
                table.append(b"")
            elif i in added:
                table.append(str(added[i].get("content", token)).encode("utf-8"))
            elif scheme == "byte-level":
                table.append(byte_level_bytes(token))
            else:
                table.append(sentencepiece_bytes(token, byte_fallback=byte_fallback))

        def token_id(name: str) -> int | None:
            token = _token_content(config.get(name))
            if token is None:
                return None
            found = backend.token_to_id(token)
            if found is None:
                raise ValueError(f"{directory}: {name} {token!r} is not in the vocabulary")
            return found

        bos = token_id("bos_token")
        if bos is None:
            bos = _first_id(generation.get("bos_token_id"), model_config.get("bos_token_id"))
        eos_ids = [i for i in (token_id("eos_token"),) if i is not None]
        for source in (generation, model_config):
            eos_ids += _id_list(source.get("eos_token_id"))

        # BOS/EOS: as tokenizer_config says, else as the post-processor does.
        with_specials = backend.encode("a", add_special_tokens=True).ids
        plain = backend.encode("a", add_special_tokens=False).ids
        prefix, suffix = _added_around(with_specials, plain)
        if bos is None and len(prefix) == 1:
            bos = prefix[0]
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = bos is not None and prefix == [bos]
        add_eos = config.get("add_eos_token")
        if add_eos is None:
            add_eos = bool(eos_ids) and suffix == [eos_ids[0]]

        chat_template = _chat_template_of(config, directory)
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        template_tokens = {name: _token_content(config.get(name)) for name in names}
        if template_tokens["bos_token"] is None and bos is not None:
            template_tokens["bos_token"] = backend.id_to_token(bos)
        if template_tokens["eos_token"] is None and eos_ids:
            template_tokens["eos_token"] = backend.id_to_token(eos_ids[0])
        return cls(
            backend,
            token_bytes=table,
            special_ids=special_ids,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos=bool(add_bos),
            add_eos=bool(add_eos),
            chat_template=chat_template,
            template_tokens=template_tokens,
            strip_leading_space=strip_leading_space,
        )

    @classmethod
    def from_gguf(cls, reader_or_path: gguf.GGUFReader | str | os.PathLike[str]) -> Tokenizer:
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
            reader_or_path: an open `gguf.GGUFReader` (share it with the weight
                loader: opening a file takes seconds), or the file's path.

        Returns:
            the tokenizer.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a GGUF file, no tokenizer in it, an unsupported
                tokenizer model or pre-type, or inconsistent metadata.

        Example:
            >>> from decodespec.reference.model_files import bundled_model_path
            >>> tok = Tokenizer.from_gguf(bundled_model_path())
            >>> tok.vocab_size, tok.bos_token_id, tok.eos_token_ids
            (49152, 1, (2,))
            >>> tok.encode("12345")  # digits one by one, as SmolLM2 was trained
            [33, 34, 35, 36, 37]
        """
        reader = _open_gguf(reader_or_path)
        where = "the GGUF file" if reader is reader_or_path else str(reader_or_path)

        def field(key: str, default: object = None) -> Any:  # noqa: ANN401
            found = reader.fields.get(key)
            if found is None:
                return default
            try:
                return found.contents()
            except Exception as error:  # malformed value
                raise ValueError(f"{where}: cannot read {key}: {error}") from error

        model = field("tokenizer.ggml.model")
        if model is None:
            raise ValueError(f"{where} has no tokenizer (no tokenizer.ggml.model key)")
        if model != "gpt2":
            kind = {"llama": "SentencePiece", "bert": "WordPiece", "t5": "Unigram"}.get(
                model, "unknown"
            )
            raise ValueError(
                f"{where}: unsupported GGUF tokenizer model {model!r} ({kind}); the reference "
                f"tokenizer supports 'gpt2' (byte-level BPE) GGUF vocabularies. Load this "
                f"model from its Hugging Face directory (tokenizer.json) instead."
            )
        tokens = field("tokenizer.ggml.tokens")
        merges = field("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{where}: a gpt2 tokenizer needs tokenizer.ggml.tokens and .merges")
        n = len(tokens)
        types = field("tokenizer.ggml.token_type") or [_NORMAL] * n
        if len(types) != n:
            raise ValueError(f"{where}: {len(types)} token types for {n} tokens")

        pre_name = field("tokenizer.ggml.pre")
        if pre_name is None:
            warnings.warn(
                f"{where} names no tokenizer.ggml.pre; using llama.cpp's 'default' "
                f"pre-tokenizer, which may not be the one the model was trained with",
                stacklevel=2,
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
        pairs = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep or not left or not right:
                raise ValueError(f"{where}: malformed merge {merge!r}")
            pairs.append((left, right))
        try:
            backend = tokenizers.Tokenizer(
                models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges, fuse_unk=False)
            )
        except Exception as error:
            raise ValueError(f"{where}: invalid vocabulary or merges: {error}") from error
        backend.pre_tokenizer = pre.build()
        backend.decoder = decoders.ByteLevel()

        special_ids: list[int] = []
        table: list[bytes] = []
        specials: list[AddedToken] = []
        user_defined: list[AddedToken] = []
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
            if kind in (_CONTROL, _UNKNOWN, _UNUSED):
                special_ids.append(i)
                table.append(b"")
                if kind != _UNUSED and vocab[token] == i:
                    specials.append(AddedToken(token, special=True, normalized=False))
            elif kind == _USER_DEFINED:
                table.append(token.encode("utf-8"))
                if vocab[token] == i:
                    user_defined.append(AddedToken(token, special=False, normalized=False))
            elif kind == _BYTE:
                table.append(sentencepiece_bytes(token))
            else:
                table.append(byte_level_bytes(token))
        backend.add_special_tokens(specials)
        backend.add_tokens(user_defined)  # both reuse the tokens' ids: they are in the vocab

        def token_id(key: str) -> int | None:
            value = field(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            if not 0 <= int(value) < n:
                raise ValueError(f"{where}: tokenizer.ggml.{key} = {value} is not a token id")
            return int(value)

        bos = token_id("bos_token_id")
        eos_ids = [
            i
            for k in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (i := token_id(k)) is not None
        ]
        add_bos = field("tokenizer.ggml.add_bos_token")
        if add_bos is None:
            add_bos = pre.add_bos
        add_eos = bool(field("tokenizer.ggml.add_eos_token", False))

        def content(i: int | None) -> str | None:
            return None if i is None else tokens[i]

        template_tokens = {
            "bos_token": content(bos),
            "eos_token": content(eos_ids[0] if eos_ids else None),
            "unk_token": content(token_id("unknown_token_id")),
            "pad_token": content(token_id("padding_token_id")),
        }
        return cls(
            backend,
            token_bytes=table,
            special_ids=special_ids,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos=bool(add_bos) and bos is not None,
            add_eos=add_eos and bool(eos_ids),
            chat_template=field("tokenizer.chat_template"),
            template_tokens=template_tokens,
        )

    # ---------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        """The number of token ids (added and special tokens included)."""
        return len(self._token_bytes)

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, or None."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (the tokenizer's EOS first)."""
        return self._eos_token_ids

    @property
    def add_bos(self) -> bool:
        """Whether `encode` prepends BOS when add_special_tokens is set."""
        return self._add_bos

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens: `b""` as bytes, skipped by `decode`."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, or None when the tokenizer has none."""
        return self._chat_template

    # ---------------------------------------------------------------- text <-> ids

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text.

        Special tokens written in the text ("<|im_start|>") become their ids.

        Args:
            text: the text.
            add_special_tokens: add BOS (and EOS) where the tokenizer says so
                (`add_bos`); pass False for text that already carries them,
                such as a rendered chat template.

        Returns:
            the ids.

        Raises:
            ValueError: text is not a str.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self._add_bos:
                ids.insert(0, self._bos_token_id)
            if self._add_eos:
                ids.append(self._eos_token_ids[0])
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (`b""` for a special token).

        O(1): the table is computed once for the whole vocabulary. A token
        may hold part of a UTF-8 character; decode a sequence of them
        incrementally (`decodespec.spec.stop.IncrementalDetokenizer`).

        Args:
            token_id: the id, in [0, vocab_size).

        Returns:
            the bytes.

        Raises:
            ValueError: the id lies outside the vocabulary.
        """
        try:
            if token_id >= 0:
                return self._token_bytes[token_id]
        except (IndexError, TypeError):
            pass
        raise ValueError(f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids: UTF-8 of the concatenated token bytes.

        Invalid or incomplete UTF-8 becomes U+FFFD, as in the streamed output
        text (STOP-UTF8-1).

        Args:
            ids: token ids.
            skip_special_tokens: leave special tokens out; with False they
                appear as their text ("<|im_end|>").

        Returns:
            the text.

        Raises:
            ValueError: an id lies outside the vocabulary.
        """
        pieces = []
        for token_id in ids:
            token_id = operator.index(token_id)
            if token_id in self._special_ids:
                if not skip_special_tokens:
                    pieces.append(self._special_text(token_id).encode("utf-8"))
            else:
                pieces.append(self.token_bytes(token_id))
        text = b"".join(pieces).decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def token_to_id(self, token: str) -> int | None:
        """The id of a token as the vocabulary spells it ("<|im_end|>", "Ġthe"), or None."""
        return self._backend.token_to_id(token)

    def _special_text(self, token_id: int) -> str:
        return self._backend.id_to_token(token_id) or ""

    # ---------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **variables: object,
    ) -> str:
        """Render a conversation with the model's chat template.

        The template runs in jinja2's immutable sandbox with the environment
        and variables Hugging Face's `apply_chat_template` uses: `messages`,
        `add_generation_prompt`, `bos_token`, `eos_token`, `unk_token`,
        `pad_token`, the `raise_exception` and `strftime_now` functions and a
        `tojson` filter that does not escape HTML. Encode the result with
        `add_special_tokens=False`: the template writes the special tokens.

        Args:
            messages: the conversation, dicts with a "role" (and usually a
                "content").
            add_generation_prompt: end with the header of an assistant turn.
            **variables: more template variables (for example `tools`).

        Returns:
            the prompt text.

        Raises:
            ValueError: the tokenizer has no chat template, the messages are
                malformed, or the template fails (ChatTemplateError, also
                raised by the template's own `raise_exception`).

        Example:
            >>> from decodespec.reference.model_files import bundled_model_path
            >>> tok = Tokenizer.from_gguf(bundled_model_path())
            >>> print(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
            <|im_start|>system
            You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
            <|im_start|>user
            Hi<|im_end|>
            <|im_start|>assistant
            <BLANKLINE>
        """
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template; encode the prompt directly")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for k, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(f"messages[{k}] must be a dict with a 'role', got {message!r}")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self._chat_template)
        context = {**self._template_tokens, **variables}
        context.update(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt
        )
        try:
            return self._compiled_template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from error

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self._bos_token_id}, "
            f"eos_token_ids={self._eos_token_ids}, add_bos={self._add_bos}, "
            f"chat_template={'yes' if self._chat_template else 'no'})"
        )


# --------------------------------------------------------------------------------------
# Helpers.


def _open_gguf(reader_or_path: gguf.GGUFReader | str | os.PathLike[str]) -> gguf.GGUFReader:
    if isinstance(reader_or_path, gguf.GGUFReader):
        return reader_or_path
    if not isinstance(reader_or_path, (str, os.PathLike)):
        raise ValueError(
            f"expected a gguf.GGUFReader or a path, got {type(reader_or_path).__name__}"
        )
    path = Path(reader_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as error:
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error


def _decoder_scheme(decoder: object, path: Path) -> tuple[str, bool]:
    """("byte-level" | "spm" | "spm+bytes", strips a leading space) from a decoder's JSON."""
    if not isinstance(decoder, dict):
        raise ValueError(f"{path}: unsupported tokenizer.json decoder {decoder!r}")
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
    kinds = [step.get("type") for step in steps or [] if isinstance(step, dict)]
    if "ByteLevel" in kinds:
        return "byte-level", False
    spm = False
    strip = False
    for step in steps or []:
        kind = step.get("type")
        if kind == "Metaspace":
            spm = True
            scheme = step.get(
                "prepend_scheme", "always" if step.get("add_prefix_space") else "never"
            )
            strip = strip or scheme in ("always", "first")
        elif kind == "Replace":
            pattern = step.get("pattern", {})
            if pattern.get("String") == _SPM_SPACE and step.get("content") == " ":
                spm = True
        elif kind == "Strip":
            strip = strip or (step.get("content") == " " and int(step.get("start", 0)) > 0)
        elif kind not in ("ByteFallback", "Fuse"):
            spm = False
            break
    if not spm:
        raise ValueError(
            f"{path}: unsupported tokenizer.json decoder {kinds or decoder.get('type')}; "
            f"supported: ByteLevel (byte-level BPE) and SentencePiece-style "
            f"(Metaspace, or Replace('▁', ' ') with ByteFallback/Fuse/Strip)"
        )
    return ("spm+bytes" if "ByteFallback" in kinds else "spm"), strip


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from an optional side file; {} when absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: object) -> str | None:
    """A special token from tokenizer_config: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"eos_token_id must be an id or a list of ids, got {value!r}")


def _first_id(*values: object) -> int | None:
    for value in values:
        ids = _id_list(value)
        if ids:
            return ids[0]
    return None


def _added_around(with_specials: list[int], plain: list[int]) -> tuple[list[int], list[int]]:
    """The ids a post-processor put before and after the plain encoding."""
    for start in range(len(with_specials) - len(plain) + 1):
        if with_specials[start : start + len(plain)] == plain:
            return with_specials[:start], with_specials[start + len(plain) :]
    return [], []


def _chat_template_of(config: Mapping[str, Any], directory: Path) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None
