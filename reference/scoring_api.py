"""Scoring text over the API: `echo`, `max_tokens: 0` and vLLM's `prompt_logprobs`.

- `/v1/completions` with `echo: true`: the choice's text is the prompt and then
  the completion; with `logprobs: n` its legacy logprobs (`tokens`,
  `token_logprobs`, `top_logprobs`, `text_offset`) cover the prompt's tokens
  first — the first with a null logprob and null alternatives, as OpenAI and
  vLLM answer, the others with the top n alternatives whatever
  `prompt_logprobs` asks — then the completion's. A stream sends the prompt
  (and its logprobs) in the chunk of the first token.
- `echo: true` with `max_tokens: 0` scores the prompt only (lm-eval's
  loglikelihood requests): the engine runs the request for one token, which
  is dropped — from the text, the logprobs and the usage; the finish reason
  is "length". Without echo, `max_tokens: 0` stays an error.
- `prompt_logprobs: k` (vLLM's extra field, completions and chat): the choice
  gets `prompt_logprobs`, null for the first prompt token, then per token a
  dict `{token id: {"logprob", "rank", "decoded_token"}}` holding the prompt
  token and the top k.

The scores are the engine's (`Engine.add_request(prompt_logprobs=k)`): the
model's raw distribution at each prompt position, whatever the sampling
parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from decodespec.spec.checks import ParameterError
from decodespec.spec.generate import TokenLogprobs

from .request_options import check_prompt_logprobs
from .tokenizer import Tokenizer

FIELDS = {"completion": ("echo", "prompt_logprobs"), "chat": ("prompt_logprobs",)}
# JSON has no -inf: a token the filters removed ("processed" logprobs), or one the
# model gives probability 0, is reported at this logprob, as vLLM does.
MIN_LOGPROB = -9999.0


class ScoringError(ValueError):
    """A scoring field's invalid value; `.param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Scoring:
    """A request's scoring fields: `echo` (and the prompt's text to echo),
    `prompt_logprobs` (the client's k), `score_only` (`max_tokens: 0`)."""

    echo: bool = False
    prompt_logprobs: int | None = None
    score_only: bool = False
    prompt_text: str = ""

    def engine_top(self, legacy_top: int | None) -> int | None:
        """The engine's prompt_logprobs: enough alternatives for both formats."""
        wanted = [self.prompt_logprobs] if self.prompt_logprobs is not None else []
        if self.echo and legacy_top is not None:
            wanted.append(legacy_top)
        return max(wanted) if wanted else None


def parse_scoring(body: Mapping, kind: str, prompt_ids: list[int], tokenizer: Tokenizer) -> Scoring:
    """The scoring fields of a request body, checked (`ScoringError` naming the field).

    Example:
        >>> class Bytes:
        ...     def decode(self, ids, skip_special_tokens=True): return bytes(ids).decode()
        >>> parse_scoring({"prompt": "hi", "echo": True, "max_tokens": 0}, "completion", [104, 105],
        ...               Bytes())
        Scoring(echo=True, prompt_logprobs=None, score_only=True, prompt_text='hi')
    """
    k = body.get("prompt_logprobs")
    if k is not None:
        try:
            check_prompt_logprobs(k)  # the option's own check
        except ParameterError as error:
            raise ScoringError("prompt_logprobs", str(error)) from None
    echo = body.get("echo", False) if kind == "completion" else False
    if not isinstance(echo, bool):
        raise ScoringError("echo", f"echo must be a boolean, got {echo!r}")
    score_only = echo and body.get("max_tokens") == 0 and not isinstance(body["max_tokens"], bool)
    if score_only and body.get("min_tokens", 0) != 0:
        raise ScoringError("min_tokens", "min_tokens must be 0 when max_tokens is 0")
    text = ""
    if echo:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            text = prompt
        else:
            text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return Scoring(echo, k, bool(score_only), text)


def legacy_prompt_logprobs(
    prompt_ids: list[int],
    records: list[TokenLogprobs | None],
    top: int,
    name: Callable[[int], str],
    text: Callable[[int], str],
) -> dict:
    """The prompt's part of the legacy completions logprobs: `top` alternatives per
    token (null for the first token), offsets from the start of the prompt."""
    legacy: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, record in zip(prompt_ids, records, strict=True):
        legacy["tokens"].append(name(token))
        if record is None:
            legacy["token_logprobs"].append(None)
            legacy["top_logprobs"].append(None)
        else:
            legacy["token_logprobs"].append(finite(record.logprob))
            legacy["top_logprobs"].append(legacy_top(record.top[:top], name))
        legacy["text_offset"].append(offset)
        offset += len(text(token))
    return legacy


def legacy_top(alternatives: Iterable[tuple[int, float]], name: Callable[[int], str]) -> dict:
    """A legacy `top_logprobs` entry: the alternatives (most likely first) by name.

    Two tokens may share a name — special tokens without text, or
    SentencePiece's "▁a" and "a", each decoded alone. The more likely keeps
    it and the other is named `token_id:N` (vLLM's spelling for tokens as
    ids), so that the entry holds every one of the k alternatives asked for,
    each with its own logprob.

    Example:
        >>> legacy_top([(7, -0.5), (8, -1.0), (9, -2.0)], {7: "a", 8: "", 9: "a"}.get)
        {'a': -0.5, '': -1.0, 'token_id:9': -2.0}
    """
    entry: dict = {}
    for token, logprob in alternatives:
        key = name(token)
        entry[f"token_id:{token}" if key in entry else key] = finite(logprob)
    return entry


def vllm_prompt_logprobs(
    records: list[TokenLogprobs | None], top: int, text: Callable[[int], str]
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None, then per prompt token its own entry and the top
    `top` alternatives, keyed by token id; an alternative's rank counts the
    alternatives strictly more likely (LOGPROB-RANK-1)."""
    out: list[dict | None] = []
    for record in records:
        if record is None:
            out.append(None)
            continue
        entry = {}
        alternatives = record.top[:top]
        for i, (token, lp) in enumerate(alternatives):
            rank = 1 + sum(other > lp for _, other in alternatives[:i])
            entry[str(token)] = {"logprob": finite(lp), "rank": rank, "decoded_token": text(token)}
        entry[str(record.token_id)] = {
            "logprob": finite(record.logprob),
            "rank": record.rank,
            "decoded_token": text(record.token_id),
        }
        out.append(entry)
    return out


def finite(logprob: float) -> float:
    """A logprob JSON can carry (−inf becomes MIN_LOGPROB)."""
    return logprob if math.isfinite(logprob) else MIN_LOGPROB
