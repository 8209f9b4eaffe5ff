"""Chat templates: a model's Jinja template rendered as Hugging Face renders it.

`ChatTemplate.render` runs the template in jinja2's immutable sandbox with
the environment and variables Hugging Face's `apply_chat_template` uses:
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `unk_token`,
`pad_token`, the `raise_exception` and `strftime_now` functions and a
`tojson` filter that does not escape HTML. `chat_template_of` finds the
template of a Hugging Face tokenizer directory.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox


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


class ChatTemplate:
    """A chat template, compiled on first use.

    Args:
        source: the Jinja source.
        special_tokens: token strings passed to the template (bos_token,
            eos_token, unk_token, pad_token; None where the tokenizer has none).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        self.source = source
        self._special_tokens = dict(special_tokens)
        self._compiled: jinja2.Template | None = None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, object],
    ) -> str:
        """The prompt text of a conversation (see the module doc for the variables).

        Raises:
            ValueError: the messages are not a list of dicts with a "role".
            ChatTemplateError: the template does not compile or fails, or
                calls its `raise_exception`.
        """
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for k, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(f"messages[{k}] must be a dict with a 'role', got {message!r}")
        if self._compiled is None:
            self._compiled = _compile_chat_template(self.source)
        context = {**self._special_tokens, **variables}
        context.update(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt
        )
        try:
            return self._compiled.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from error


def chat_template_of(config: Mapping[str, Any], directory: Path) -> str | None:
    """The chat template of a Hugging Face tokenizer directory, or None.

    `chat_template.jinja` wins over tokenizer_config's `chat_template`, as in
    transformers; of named templates (a list), "default", else the first.
    """
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None
