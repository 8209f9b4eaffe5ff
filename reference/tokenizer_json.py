"""A tokenizer from a Hugging Face `tokenizer.json` and the files beside it.

`tokenizer_json_parts(path)` reads the files into the `TokenizerParts` a
`Tokenizer` is made of (`Tokenizer.from_file` calls it). The `tokenizers`
library runs the tokenizer itself; what is read here is what an engine needs
around it: the raw bytes of every token, the special ids, BOS and EOS and
whether `encode` adds them, and the chat template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import tokenizers

from .chat_template import chat_template_of
from .tokenizer_parts import SPM_SPACE, TokenizerParts, byte_level_bytes, sentencepiece_bytes


def tokenizer_json_parts(path: str | os.PathLike[str]) -> TokenizerParts:
    """Read a Hugging Face tokenizer: `tokenizer.json` and the files beside it.

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
        the parts of the tokenizer.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a valid `tokenizer.json`, or its model
            or decoder is not supported (WordPiece, WordLevel, ...).
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

    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    template_tokens = {name: _token_content(config.get(name)) for name in names}
    if template_tokens["bos_token"] is None and bos is not None:
        template_tokens["bos_token"] = backend.id_to_token(bos)
    if template_tokens["eos_token"] is None and eos_ids:
        template_tokens["eos_token"] = backend.id_to_token(eos_ids[0])
    return TokenizerParts(
        backend,
        token_bytes=table,
        special_ids=special_ids,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        add_bos=bool(add_bos),
        add_eos=bool(add_eos),
        chat_template=chat_template_of(config, directory),
        template_tokens=template_tokens,
        strip_leading_space=strip_leading_space,
    )


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
            if pattern.get("String") == SPM_SPACE and step.get("content") == " ":
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
