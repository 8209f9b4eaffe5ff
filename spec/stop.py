"""Stop stage: when a request is finished, and what text it streams.

After the sampler has chosen a token, the engine appends it to the request's
output and asks this stage two questions: is the request finished (and why),
and which text is now safe to show the user? One `StopChecker` per request
answers both, token by token (SEMANTICS.md, "Stop"). The stop conditions are
tried in the order of the clauses below; the first that fires decides.

Finishing
---------
[STOP-ID-1] After token t is appended to a request's output, if t is one of
the request's stop ids (`SamplingParams.stop_ids`: the model's EOS ids unless
`ignore_eos`, plus the user's `stop_token_ids`), the request finishes with
reason "stop". The token stays in the output token ids (it was generated and
is reported); its text is not part of the output text.

[STOP-ID-2] A stop id finishes the request only if the request had already
produced at least `min_tokens` tokens before it. Sampling bans stop ids
exactly then (LOGITS-MINTOK-1: while step < min_tokens), so a sampled token
never meets this clause; it makes the checker agree with the sampler for a
token that did not come from the sampler (a forced or a draft token). A stop
id that does not finish the request is an ordinary token: its text is output
text and it counts towards max_tokens. So is EOS under `ignore_eos`.

[STOP-STR-1] Otherwise, if the output text now contains one of the user's
stop strings, the request finishes with reason "stop". The text is cut at the
start of the earliest-starting match over all stop strings: the stop string,
and anything after it, is not returned. The token ids are not cut: the token
that completed the match stays, even when part of its text precedes the
match. Stop strings are checked from the first token on (min_tokens delays
stop ids only). Differs from vLLM, which does not check stop strings before
the request has produced min_tokens tokens.

[STOP-LEN-1] Otherwise, if the request has now produced `max_tokens` tokens,
or the prompt and the output together fill the model's context
(prompt length + output length >= max_context), the request finishes with
reason "length". `max_tokens=None` means: until the context is full.

[STOP-PREC-1] A stop condition takes precedence over length when both fire
on the same token: a stop id, or a stop string completed by the token that
reaches max_tokens or fills the context, finishes the request with reason
"stop" (and STOP-ID-1 or STOP-STR-1 decide the text). Differs from vLLM's V1
scheduler (`check_stop`), which tests the length limit first and reports
"length" for an EOS that is also the last allowed token.

[STOP-MULTI-1] Several tokens appended in one step (speculative decoding: the
accepted draft tokens and the bonus token) are processed one at a time, in
order, each exactly as if it had been appended alone. The step is cut at the
first token that finishes the request: that token is kept (as the clauses
above say), the tokens after it are dropped (they are not in the output
token ids, and their text is never decoded).

Text
----
[STOP-UTF8-1] The output text is the UTF-8 decoding of the concatenated
bytes of the output tokens (`token_bytes(t)` for each, except a finishing
stop id), decoded incrementally. A multi-byte character whose bytes are split
across tokens is never emitted in halves: an incomplete trailing sequence is
held back until it completes. Invalid bytes decode to U+FFFD (one for each
maximal ill-formed subsequence, the Unicode recommended practice). When the
request finishes, an incomplete tail is flushed as U+FFFD; the flushed text is
output text like any other (stop strings are checked on it too; after a stop
string cut, the tail lies past the cut and is dropped).
`codecs.getincrementaldecoder("utf-8")(errors="replace")` implements exactly
this. Which bytes a token has is the tokenizer's business: an engine that
hides special tokens gives them `b""`.

[STOP-STREAM-1] Streaming never emits text that a later token could turn into
part of a stop string. After each token that does not finish the request,
the longest suffix of the not-yet-emitted text that is a proper prefix of
some stop string is held back (`stop_hold_back`) and the rest is emitted; a
future match can only start inside that suffix. When the request finishes,
everything still held that is part of the final text is emitted. Emitted
text is never taken back: the concatenation of all emitted deltas equals the
final output text. Differs from SEMANTICS.md's simpler rule, "hold back the
last max(len(stop)) − 1 characters": both give the same final text and the
same guarantee, but the minimal hold-back delays less (nothing at all when the
text cannot be the start of a stop string, or when there are no stop strings).
"""

from __future__ import annotations

import codecs
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from .params import SamplingParams

FinishReason = Literal["stop", "length"]


def _check_stop_strings(stop: Sequence[str]) -> None:
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")


def first_stop_match(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """The smallest index >= start at which any stop string occurs in text (STOP-STR-1).

    A checker that has already searched a text without finding a match only
    needs to search again from `max(0, old_len − max(len(s)) + 1)` after
    appending to it: a new match must end in the appended text.

    Args:
        text: the text to search.
        stop: non-empty stop strings.
        start: the first index at which a match may start, >= 0.

    Returns:
        the start of the earliest-starting match, or None if there is none.

    Example:
        >>> first_stop_match("say abcd", ["bc", "abcd"])
        4
        >>> first_stop_match("say abcd", ["bc"], start=6) is None
        True
    """
    _check_stop_strings(stop)
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found, default=None)


def stop_hold_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string.

    (STOP-STREAM-1.) These are the characters a later token could still turn
    into part of a stop string, so a stream must hold them back.

    Args:
        text: the text not yet emitted.
        stop: non-empty stop strings.

    Returns:
        the number of trailing characters to hold back (0 if none).

    Example:
        >>> stop_hold_back("The end", ["end.", "\\n\\n"])
        3
        >>> stop_hold_back("The end.", ["end.", "\\n\\n"])  # a full match is not a prefix
        0
    """
    _check_stop_strings(stop)
    longest = min(len(text), max((len(s) for s in stop), default=1) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stop):
            return k
    return 0


class IncrementalDetokenizer:
    """Token ids in, completed UTF-8 text out (STOP-UTF8-1).

    Args:
        token_bytes: the bytes of a token id.

    Example:
        >>> vocab = [b"caf", b"\\xc3", b"\\xa9", b"\\xe2\\x82"]
        >>> d = IncrementalDetokenizer(vocab.__getitem__)
        >>> d.push(0), d.push(1), d.push(2), d.push(3), d.flush()
        ('caf', '', 'é', '', '�')
    """

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token's bytes; return the characters they complete."""
        return self._decoder.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """End of output: an incomplete trailing sequence becomes U+FFFD ("" if none)."""
        return self._decoder.decode(b"", final=True)


@dataclass(frozen=True)
class StreamDelta:
    """What one append makes visible: new text, and the finish reason once finished."""

    text: str = ""
    finish_reason: FinishReason | None = None


class StopChecker:
    """Decide when one request finishes and what text it streams (all STOP clauses).

    Args:
        params: the request's parameters (stop, stop_token_ids, ignore_eos,
            max_tokens, min_tokens).
        eos_token_ids: the model's end-of-sequence ids.
        token_bytes: the bytes of a token id.
        prompt_len: the number of prompt tokens, >= 0.
        max_context: the model's context length, > prompt_len.

    Example:
        >>> vocab = [b"<eos>", b"Hel", b"lo", b" wor", b"ld\\n"]
        >>> checker = StopChecker(SamplingParams(stop=["world"]), eos_token_ids=[0],
        ...                       token_bytes=vocab.__getitem__, prompt_len=3, max_context=64)
        >>> [checker.append(t).text for t in (1, 2, 3)]  # " wor" could start "world"
        ['Hel', 'lo', ' ']
        >>> checker.append(4)
        StreamDelta(text='', finish_reason='stop')
        >>> checker.text, checker.token_ids
        ('Hello ', [1, 2, 3, 4])
    """

    def __init__(
        self,
        params: SamplingParams,
        *,
        eos_token_ids: Iterable[int],
        token_bytes: Callable[[int], bytes],
        prompt_len: int,
        max_context: int,
    ) -> None:
        if not 0 <= prompt_len < max_context:
            raise ValueError(
                f"need 0 <= prompt_len < max_context, got prompt_len={prompt_len}, "
                f"max_context={max_context}"
            )
        self._params = params
        self._stop_ids = params.stop_ids(eos_token_ids)
        self._stop = tuple(params.stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._prompt_len = prompt_len
        self._max_context = max_context
        self._detokenizer = IncrementalDetokenizer(token_bytes)
        self._token_ids: list[int] = []
        self._text = ""  # the output text decoded so far (the final text once finished)
        self._emitted = 0  # how many characters of _text the stream has emitted
        self._finish_reason: FinishReason | None = None

    @property
    def token_ids(self) -> list[int]:
        """The output token ids so far (a copy)."""
        return list(self._token_ids)

    @property
    def text(self) -> str:
        """The output text decoded so far, held-back part included; final once finished."""
        return self._text

    @property
    def finish_reason(self) -> FinishReason | None:
        """The finish reason, "stop" or "length", once finished; None before."""
        return self._finish_reason

    def append(self, token_id: int) -> StreamDelta:
        """Append one generated token (STOP-ID-1 to STOP-PREC-1, STOP-UTF8-1, STOP-STREAM-1).

        Args:
            token_id: the token; anything `operator.index` accepts.

        Returns:
            the text newly safe to emit, and the finish reason if this token
            finished the request.

        Raises:
            ValueError: the request had already finished.
        """
        token_id = operator.index(token_id)
        if self._finish_reason is not None:
            raise ValueError(
                f"cannot append token {token_id}: the request already finished "
                f"(finish_reason={self._finish_reason!r})"
            )
        produced_before = len(self._token_ids)
        self._token_ids.append(token_id)

        # STOP-ID-1, STOP-ID-2: the stop id's own bytes never reach the text.
        if token_id in self._stop_ids and produced_before >= self._params.min_tokens:
            self._add_text(self._detokenizer.flush())
            return self._finish("stop")
        # STOP-STR-1
        if self._add_text(self._detokenizer.push(token_id)):
            return self._finish("stop")
        # STOP-LEN-1; the flushed tail may still complete a stop string (STOP-PREC-1).
        produced = len(self._token_ids)
        max_tokens = self._params.max_tokens
        if (max_tokens is not None and produced >= max_tokens) or (
            self._prompt_len + produced >= self._max_context
        ):
            return self._finish("stop" if self._add_text(self._detokenizer.flush()) else "length")
        return self._emit()

    def extend(self, token_ids: Sequence[int]) -> tuple[int, StreamDelta]:
        """Append the tokens of one step in order, up to the first that finishes (STOP-MULTI-1).

        Args:
            token_ids: the step's tokens (for example accepted drafts + bonus).

        Returns:
            how many of the tokens were used (the rest are dropped), and the
            combined delta: the concatenated text and the finish reason, if any.

        Raises:
            ValueError: the request had already finished.

        Example:
            >>> checker = StopChecker(SamplingParams(), eos_token_ids=[0],
            ...                       token_bytes=[b"", b"a", b"b"].__getitem__,
            ...                       prompt_len=1, max_context=8)
            >>> checker.extend([1, 2, 0, 1])
            (3, StreamDelta(text='ab', finish_reason='stop'))
            >>> checker.token_ids
            [1, 2, 0]
        """
        if self._finish_reason is not None:
            raise ValueError(
                f"cannot extend: the request already finished "
                f"(finish_reason={self._finish_reason!r})"
            )
        pieces: list[str] = []
        used = 0
        for token_id in token_ids:
            delta = self.append(token_id)
            pieces.append(delta.text)
            used += 1
            if delta.finish_reason is not None:
                break
        return used, StreamDelta("".join(pieces), self._finish_reason)

    def _add_text(self, new: str) -> bool:
        """Append decoded text; on a stop string, cut the text there and return True."""
        if not new:
            return False
        old_len = len(self._text)
        self._text += new
        if not self._stop:
            return False
        # No match lay inside the old text, so a match must end in `new`.
        start = max(0, old_len - self._max_stop_len + 1)
        match = first_stop_match(self._text, self._stop, start)
        if match is None:
            return False
        self._text = self._text[:match]
        return True

    def _finish(self, reason: FinishReason) -> StreamDelta:
        self._finish_reason = reason
        return self._emit()

    def _emit(self) -> StreamDelta:
        """The text newly safe to emit (STOP-STREAM-1)."""
        end = len(self._text)
        if self._finish_reason is None and self._stop:
            # Only the last max_stop_len − 1 characters can start a stop string. Looking
            # at the not-yet-emitted text alone is enough: a suffix that started inside
            # the emitted text would have been held back at the previous token.
            window = max(self._emitted, end - self._max_stop_len + 1)
            end -= stop_hold_back(self._text[window:], self._stop)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return StreamDelta(delta, self._finish_reason)
