"""The response objects of the OpenAI API: the whole answer, or a stream's chunks.

`Responder` writes them for one parsed request (`openai_api.APIRequest`):
choices, logprobs in the chat format or the legacy completions format, usage,
and decodespec's extensions (the seed used, the timings). With `echo` the
prompt comes first — in the text and in the legacy logprobs — and with
`max_tokens: 0` the one token the engine ran is left out of all of them;
vLLM's `prompt_logprobs` is a field of the choice (`scoring_api.py`).
"""

from __future__ import annotations

import time
import uuid

from decodespec.spec.generate import TokenLogprobs

from .openai_api import APIRequest
from .request import RequestOutput, RequestStepOutput
from .scoring_api import finite, legacy_prompt_logprobs, legacy_top
from .scoring_api import vllm_prompt_logprobs as vllm_prompt
from .tokenizer import Tokenizer


class Responder:
    """The response objects of one request: chunks while it streams, or the whole."""

    def __init__(self, request: APIRequest, tokenizer: Tokenizer) -> None:
        self.request = request
        self.tokenizer = tokenizer
        prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text_offset = 0  # completions' logprobs: where the next token's text starts
        self.echoed = False  # a stream with echo: the prompt went out

    def _object(self, chunk: bool) -> dict:
        if self.request.kind == "chat":
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.request.model}

    # -- streaming

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role."""
        if self.request.kind != "chat":
            return None
        return self._chunk({"role": "assistant", "content": ""}, None)

    def chunk(self, event: RequestStepOutput) -> dict | None:
        """One event as a chunk; None when it carries nothing to send."""
        scoring, text, logprobs = self.request.scoring, event.text, None
        echo: dict = {"text": "", "logprobs": None}
        if scoring.echo and not self.echoed:  # the prompt goes first
            self.echoed = True
            echo = self._echo(event.prompt_logprobs)
        if self.request.logprobs and event.logprobs is not None and not scoring.score_only:
            logprobs = self.logprobs([event.logprobs])
        text = echo["text"] + ("" if scoring.score_only else text)
        logprobs = _join(echo["logprobs"], logprobs)
        extra = self._prompt_logprobs(event.prompt_logprobs)
        if not text and logprobs is None and not extra:
            return None
        if self.request.kind == "chat":
            return self._chunk({"content": text}, logprobs, extra)
        return self._chunk(text, logprobs, extra)

    def last_chunk(self, output: RequestOutput) -> dict:
        """The chunk with the finish reason, the seed and the timings."""
        chunk = self._chunk({} if self.request.kind == "chat" else "", None)
        chunk["choices"][0]["finish_reason"] = _finish_reason(output, self.request)
        return {**chunk, **self.extensions(output)}

    def usage_chunk(self, output: RequestOutput) -> dict:
        """`stream_options.include_usage`: a last chunk with no choices and the usage."""
        return {**self._object(chunk=True), "choices": [], "usage": usage(output, self.request)}

    def _chunk(self, delta: dict | str, logprobs: dict | None, extra: dict | None = None) -> dict:
        choice: dict = {"index": 0}
        if self.request.kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice |= {"logprobs": logprobs, "finish_reason": None, **(extra or {})}
        return {**self._object(chunk=True), "choices": [choice]}

    # -- whole

    def response(self, output: RequestOutput) -> dict:
        """The non-streamed response."""
        scoring = self.request.scoring
        echo: dict = {"text": "", "logprobs": None}
        if scoring.echo:  # the prompt first; the completion's offsets follow it
            echo = self._echo(output.prompt_logprobs)
        steps = [] if scoring.score_only else output.logprobs or []
        logprobs = self.logprobs(steps) if self.request.logprobs else None
        text = echo["text"] + ("" if scoring.score_only else output.text)
        logprobs = _join(echo["logprobs"], logprobs)
        choice: dict = {"index": 0}
        if self.request.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice |= {"logprobs": logprobs, "finish_reason": _finish_reason(output, self.request)}
        choice |= self._prompt_logprobs(output.prompt_logprobs)
        return {
            **self._object(chunk=False),
            "choices": [choice],
            "usage": usage(output, self.request),
            **self.extensions(output),
        }

    def extensions(self, output: RequestOutput) -> dict:
        """decodespec's fields: the seed used, the timings and what computed them."""
        timing = {
            "path": output.path,
            "ttft_s": output.ttft_s,
            "tokens_per_s": output.tokens_per_s,
            "prompt_tokens_per_s": output.prompt_tokens_per_s,
            "inter_token_latencies_s": output.inter_token_latencies_s,
        }
        if output.draft_tokens:
            timing["acceptance_rate"] = output.acceptance_rate
            timing["tokens_per_target_pass"] = output.tokens_per_target_pass
        return {"seed": output.seed, "timing": timing}

    # -- scoring (`scoring_api.py`)

    def _echo(self, records: list | None) -> dict:
        """The echoed prompt's text, and its legacy logprobs (completion offsets then
        start after it)."""
        scoring, logprobs = self.request.scoring, None
        if self.request.logprobs and records is not None:
            top = self.request.params.top_logprobs or 0
            ids = self.request.prompt_ids
            logprobs = legacy_prompt_logprobs(ids, records, top, self._legacy_token, self._text)
        self.text_offset = len(scoring.prompt_text)
        return {"text": scoring.prompt_text, "logprobs": logprobs}

    def _prompt_logprobs(self, records: list | None) -> dict:
        """vLLM's `prompt_logprobs` field of a choice, when asked and at hand."""
        top = self.request.scoring.prompt_logprobs
        if top is None or records is None:
            return {}
        return {"prompt_logprobs": vllm_prompt(records, top, self._text)}

    # -- logprobs

    def logprobs(self, steps: list[TokenLogprobs]) -> dict:
        """Chat: `{"content": [...]}` with bytes and the token's rank (an extension), and
        for a structured output each alternative's `allowed` (False: the grammar
        removed it; an extension); completions: the legacy `tokens`,
        `token_logprobs`, `top_logprobs`, `text_offset`."""
        if self.request.kind == "chat":
            content = []
            constrained = self.request.options.structured_output is not None
            for step in steps:
                entry = self._token(step.token_id, step.logprob)
                entry["top_logprobs"] = [self._token(t, lp) for t, lp in step.top]
                if constrained:
                    for alternative, (t, _) in zip(entry["top_logprobs"], step.top, strict=True):
                        alternative["allowed"] = t not in step.removed
                entry["rank"] = step.rank
                content.append(entry)
            return {"content": content}
        legacy: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for step in steps:
            legacy["tokens"].append(self._legacy_token(step.token_id))
            legacy["token_logprobs"].append(finite(step.logprob))
            legacy["top_logprobs"].append(legacy_top(step.top, self._legacy_token))
            legacy["text_offset"].append(self.text_offset)
            self.text_offset += len(self._text(step.token_id))
        return legacy

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _legacy_token(self, token_id: int) -> str:
        """The token as the legacy format names it: its text, or, for a token that holds
        part of a UTF-8 character, `bytes:\\xNN...` as OpenAI writes it. Every such
        token would otherwise decode to the same "\ufffd" and, as a key of
        `top_logprobs`, overwrite the others."""
        raw = self.tokenizer.token_bytes(token_id)
        if raw:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
        return self._text(token_id)

    def _token(self, token_id: int, logprob: float) -> dict:
        # A token may hold part of a UTF-8 character: `bytes` is exact, `token` not.
        raw = self.tokenizer.token_bytes(token_id) or self._text(token_id).encode()
        return {"token": self._text(token_id), "logprob": finite(logprob), "bytes": list(raw)}


def usage(output: RequestOutput, request: APIRequest | None = None) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the prefix cache served.
    A request with `max_tokens: 0` completed nothing (its one token is dropped)."""
    completion = 0 if request is not None and request.scoring.score_only else None
    completion = output.completion_tokens if completion is None else completion
    total = output.prompt_tokens + completion
    return {
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
    }


def _finish_reason(output: RequestOutput, request: APIRequest) -> str | None:
    """`max_tokens: 0` finishes for its length, whatever ended its dropped token."""
    if request.scoring.score_only and output.finish_reason in ("stop", "length"):
        return "length"
    return output.finish_reason


def _join(first: dict | None, second: dict | None) -> dict | None:
    """Two runs of legacy logprobs, one after the other."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}
