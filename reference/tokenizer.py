"""Text to token ids and back, for the reference engine: the runtime `Tokenizer`.

One `Tokenizer` class, made from the parts a builder reads from files: a
Hugging Face `tokenizer.json` (`Tokenizer.from_file`, `tokenizer_json.py`) or
the metadata of a GGUF file (`Tokenizer.from_gguf`, `tokenizer_gguf.py`). Both
run on the `tokenizers` library; what this class adds is what an engine needs
around it:

- `token_bytes(id)`: the raw bytes of one token, precomputed for the whole
  vocabulary (`tokenizer_parts.py` says why `tokenizers` cannot give them).
  The stop stage decodes the output text incrementally from these bytes
  (STOP-UTF8-1), so a character split across tokens is never shown in halves.
  Special (control) tokens have `b""`: they never appear in output text.
- `decode(ids)`: the UTF-8 decoding (invalid bytes become U+FFFD) of the
  concatenated token bytes, so a full decode and a streamed decode agree.
- `encode(text)`: special tokens written in the text ("<|im_start|>") become
  their single ids; BOS is prepended only when the tokenizer says so.
- `apply_chat_template(messages)`: the model's Jinja chat template, rendered
  in a sandbox with the variables Hugging Face passes (`chat_template.py`).
- `eos_token_ids`: every id that ends a generation.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import gguf

from .chat_template import ChatTemplate
from .gguf_file import GGUFFile
from .tokenizer_gguf import gguf_tokenizer_parts
from .tokenizer_json import tokenizer_json_parts
from .tokenizer_parts import TokenizerParts


class Tokenizer:
    """A tokenizer for the reference engine: ids, raw token bytes, chat template, EOS ids.

    Build one with `Tokenizer.from_file` (a Hugging Face `tokenizer.json`) or
    `Tokenizer.from_gguf` (a GGUF file's metadata); the constructor takes the
    parts a builder assembled.

    Args:
        parts: the backend, token bytes, special ids, BOS/EOS and chat
            template (see `TokenizerParts`).

    Raises:
        ValueError: an id outside the vocabulary, or add_bos / add_eos set
            without a BOS / EOS token.

    Example:
        >>> from decodespec.reference.model_files import bundled_model_path
        >>> tok = Tokenizer.from_gguf(bundled_model_path())
        >>> ids = tok.encode("<|im_start|>user\\nHi 42<|im_end|>")
        >>> ids
        [1, 4093, 198, 26843, 216, 36, 34, 2]
        >>> tok.decode(ids), tok.token_bytes(ids[3]), tok.eos_token_ids
        ('user\\nHi 42', b'Hi', (2,))
    """

    def __init__(self, parts: TokenizerParts) -> None:
        self._backend = parts.backend
        self._token_bytes = [bytes(b) for b in parts.token_bytes]
        n = len(self._token_bytes)
        self._special_ids = frozenset(operator.index(i) for i in parts.special_ids)
        bos = parts.bos_token_id
        self._bos_token_id = None if bos is None else operator.index(bos)
        self._eos_token_ids = tuple(dict.fromkeys(operator.index(i) for i in parts.eos_token_ids))
        for name, ids in (
            ("special_ids", self._special_ids),
            ("eos_token_ids", self._eos_token_ids),
            ("bos_token_id", () if self._bos_token_id is None else (self._bos_token_id,)),
        ):
            bad = sorted(i for i in ids if not 0 <= i < n)
            if bad:
                raise ValueError(f"{name} {bad} lie outside the vocabulary of {n} tokens")
        if parts.add_bos and self._bos_token_id is None:
            raise ValueError("add_bos is set but the tokenizer has no BOS token")
        if parts.add_eos and not self._eos_token_ids:
            raise ValueError("add_eos is set but the tokenizer has no EOS token")
        self._add_bos = bool(parts.add_bos)
        self._add_eos = bool(parts.add_eos)
        self._chat_template = (
            None
            if parts.chat_template is None
            else ChatTemplate(parts.chat_template, parts.template_tokens)
        )
        self._strip_leading_space = parts.strip_leading_space

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer: `tokenizer.json` and the files beside it.

        See `tokenizer_json.tokenizer_json_parts` for what is read and how.

        Args:
            path: a `tokenizer.json` file, or the directory holding one.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not a valid `tokenizer.json`, or its model
                or decoder is not supported (WordPiece, WordLevel, ...).

        Example:
            >>> tok = Tokenizer.from_file("models/smollm2/tokenizer.json")  # doctest: +SKIP
        """
        return cls(tokenizer_json_parts(path))

    @classmethod
    def from_gguf(cls, file: GGUFFile | gguf.GGUFReader | str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its metadata.

        See `tokenizer_gguf.gguf_tokenizer_parts` for what is supported and read.

        Args:
            file: the file opened with `gguf_file.open_gguf`, a `gguf.GGUFReader`
                (share it with the weight loader: the file is then mapped and
                parsed once), or the file's path.

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
        return cls(gguf_tokenizer_parts(file))

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
        return None if self._chat_template is None else self._chat_template.source

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
        and variables Hugging Face's `apply_chat_template` uses (see
        `chat_template.py`). Encode the result with `add_special_tokens=False`:
        the template writes the special tokens.

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
        return self._chat_template.render(messages, add_generation_prompt, variables)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self._bos_token_id}, "
            f"eos_token_ids={self._eos_token_ids}, add_bos={self._add_bos}, "
            f"chat_template={'yes' if self._chat_template else 'no'})"
        )
