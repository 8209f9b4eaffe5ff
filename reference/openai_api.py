"""The OpenAI API's requests and responses, mapped onto the engine's.

`parse_request` turns the JSON body of `/v1/completions` or
`/v1/chat/completions` into prompt ids and `SamplingParams`, or raises
`APIError` naming the parameter at fault (HTTP 400, the OpenAI error object).
The body fields of the sampling parameters are those `SamplingParams`
declares (`api`), and every check of a value's range is the spec's own
(`SamplingParams`, `validate_request`), whose errors name the field in
`.param`; this module adds the JSON types and the API's names.
The response objects and the stream's chunks are `completions_format.py`'s.

Beyond the OpenAI fields, a request may carry decodespec's other parameters
as extra body fields, as vLLM accepts them: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids` and
`logprobs_mode` ("raw", the default: the model's distribution; "processed":
the one the token was drawn from, after penalties, temperature and filters),
and, on a server started with a drafter (`--speculate`), `num_draft`: at
most this many draft tokens per step for the request (0: none).
Structured outputs: OpenAI's `response_format` (json_object, json_schema) and
vLLM's `structured_outputs` (json, regex, grammar, choice) and `guided_*`
(`structured_api.py`). Scoring text: `echo`, `max_tokens: 0` with echo, and
vLLM's `prompt_logprobs` (`scoring_api.py`).
Each response carries two more fields: `seed` (the one used, drawn when the
request had none) and `timing` (time to first token, inter-token latencies
and tokens per second, measured from the moment the request arrived).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from decodespec.spec.checks import ContextLengthError, ParameterError
from decodespec.spec.params import PARAMETERS, SamplingParams, validate_request

from .grammar import GrammarError
from .request_options import API_FIELDS as OPTION_FIELDS
from .request_options import OPTIONS, RequestOptions
from .scoring_api import FIELDS as SCORING_FIELDS
from .scoring_api import Scoring, ScoringError, parse_scoring
from .structured_api import FIELDS as STRUCTURED_FIELDS
from .structured_api import parse_structured_output
from .tokenizer import Tokenizer

Kind = Literal["completion", "chat"]

# The sampling parameters' body fields, as `SamplingParams` declares them: body name -> field.
PARAMETER_FIELDS = {p.api: name for name, p in PARAMETERS.items() if p.api is not None}
# Fields the endpoints take. OpenAI rejects a field it does not know; so does
# this server, so that a typo ("top-p") is an error and not a silent default.
COMMON_FIELDS = {
    "model",
    "stream",
    "stream_options",
    "n",
    "user",
    *OPTION_FIELDS,
    *PARAMETER_FIELDS,
    *STRUCTURED_FIELDS,
}
FIELDS = {
    "completion": COMMON_FIELDS | {"prompt", "logprobs", *SCORING_FIELDS["completion"]},
    "chat": COMMON_FIELDS
    | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", *SCORING_FIELDS["chat"]},
}
# The default length: OpenAI's legacy completions stop at 16 tokens; a chat
# answer runs until it ends or fills the context.
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": None}
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An error response: the HTTP status and the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": {**error, "code": self.code}}


def bad_param(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class APIRequest:
    """A parsed request: what the engine runs and how to answer."""

    kind: Kind
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str
    # num_draft, the structured output, the engine's prompt_logprobs (`request_options.py`)
    options: RequestOptions = field(default_factory=RequestOptions)
    scoring: Scoring = field(
        default_factory=Scoring
    )  # echo, prompt_logprobs, max_tokens 0 (`scoring_api.py`)


# ---------------------------------------------------------------- parsing


def parse_request(
    body: object,
    kind: Kind,
    *,
    tokenizer: Tokenizer,
    model: str,
    vocab_size: int,
    max_context: int,
) -> APIRequest:
    """The body of a completions (`kind="completion"`) or chat request, checked.

    What depends on the engine beyond the model's sizes (a drafter for
    `num_draft`, the structured output's compilation) is checked by the engine
    when the request is added (`Engine.add_request`).

    Raises:
        APIError: 400 naming the parameter at fault; 404 for another model.
    """
    if not isinstance(body, dict):
        raise bad_param(None, f"the request body must be a JSON object, got {_json_kind(body)}")
    # null means "not given", as OpenAI and vLLM (whose pydantic models default to None)
    # read it: `"seed": null` is no seed, `"guided_json": null` no structured output.
    body = {k: v for k, v in body.items() if v is not None}
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad_param(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    requested = body.get("model", model)
    if requested != model:
        raise APIError(
            404,
            f"The model `{requested}` does not exist; this server serves `{model}`.",
            param="model",
            code="model_not_found",
        )
    if _get(body, "n", int, 1) != 1:
        raise bad_param("n", f"n must be 1 (one choice per request), got {body['n']}")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    options = {k: v for k, v in options.items() if v is not None}  # null: not given
    if options and not stream:
        raise bad_param("stream_options", "stream_options is only allowed when stream is true")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise bad_param("stream_options", f"stream_options has an unknown field {unknown[0]!r}")
    include_usage = _get(options, "include_usage", bool, False, "stream_options.include_usage")

    if kind == "chat":
        prompt_ids = _chat_prompt(body, tokenizer)
        if "max_tokens" in body and "max_completion_tokens" in body:
            raise bad_param(
                "max_completion_tokens", "give max_completion_tokens or max_tokens, not both"
            )
        length_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        logprobs = _get(body, "logprobs", bool, False)
        top_logprobs = body.get("top_logprobs")
        if top_logprobs is not None and not logprobs:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs set to true")
        top_n = (top_logprobs if top_logprobs is not None else 0) if logprobs else None
        top_name = "top_logprobs"
    else:
        prompt_ids = _completion_prompt(body, tokenizer)
        length_name = "max_tokens"
        top_n = body.get("logprobs")
        if isinstance(top_n, bool):  # JSON true is not a count
            raise bad_param("logprobs", f"logprobs must be an integer in [0, 20], got {top_n}")
        logprobs = top_n is not None
        top_name = "logprobs"

    names = {"max_tokens": length_name, "top_logprobs": top_name}
    names["prompt_token_ids"] = "messages" if kind == "chat" else "prompt"
    given = {name: body[api] for api, name in PARAMETER_FIELDS.items() if api in body}
    given["logit_bias"] = _logit_bias(given.get("logit_bias", {}))
    given["max_tokens"] = body.get(length_name, DEFAULT_MAX_TOKENS[kind])
    try:
        scoring = parse_scoring(body, kind, prompt_ids, tokenizer)
    except ScoringError as error:
        raise bad_param(error.param, str(error)) from None
    if scoring.score_only:  # run one token, which the answer drops
        given["max_tokens"] = 1
    try:
        params = SamplingParams(**given, top_logprobs=top_n)
        validate_request(params, prompt_ids, vocab_size=vocab_size, max_context=max_context)
    except ParameterError as error:
        raise refusal(error, names) from None
    try:
        options = RequestOptions(
            **{name: body[api] for api, name in OPTION_FIELDS.items() if api in body},
            structured_output=parse_structured_output(body),
            prompt_logprobs=scoring.engine_top(params.top_logprobs if logprobs else None),
        )
    except GrammarError as error:  # its .param is already the body field
        raise bad_param(error.param, str(error)) from None
    except ParameterError as error:
        raise refusal(error, {}) from None
    return APIRequest(
        kind, prompt_ids, params, stream, include_usage, logprobs, model, options, scoring
    )  # fmt: skip


def refusal(error: ParameterError, names: Mapping[str, str]) -> APIError:
    """A 400 for an error of the spec's validation, naming the API's parameter.

    The error names the field at fault (`.param`); `names` maps the fields
    whose API name differs from their body name.
    """
    message = str(error)
    code = "context_length_exceeded" if isinstance(error, ContextLengthError) else None
    field = error.param
    if field in names:
        param = names[field]
    elif field in PARAMETERS:
        param = PARAMETERS[field].api or field
    elif field in OPTIONS:
        param = OPTIONS[field].api or field
    else:  # not one of the request's fields
        return bad_param(None, message, code)
    if message.startswith(field):  # say it the way the client did
        message = param + message[len(field) :]
    return bad_param(param, message, code)


def cache_refusal(error: Exception, params: SamplingParams) -> APIError:
    """A 400 for the engine's refusal of a request the whole cache could never hold
    (prompt + max_tokens, or the context when max_tokens is None)."""
    code = "context_length_exceeded" if params.max_tokens is None else None
    return bad_param("max_tokens", str(error), code)


def _get(body: Mapping, name: str, kind: type, default: object, param: str | None = None) -> Any:  # noqa: ANN401 (a JSON value)
    """`body[name]` if it has the JSON type `kind`, `default` when absent."""
    value = body.get(name, default)
    wrong = isinstance(value, bool) != (kind is bool) if kind in (bool, int) else False
    if wrong or not isinstance(value, kind):
        expected = {bool: "a boolean", int: "an integer", dict: "an object"}[kind]
        raise bad_param(
            param or name, f"{param or name} must be {expected}, got {_json_kind(value)}"
        )
    return value


def _json_kind(value: object) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    names |= {list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _logit_bias(bias: object) -> dict[int, object]:
    """JSON object keys are strings: {"50256": -100} biases token 50256."""
    if not isinstance(bias, dict):
        raise bad_param("logit_bias", f"logit_bias must be an object, got {_json_kind(bias)}")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.strip().isdigit()):
            raise bad_param("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        out[int(key)] = value
    return out


def _completion_prompt(body: Mapping, tokenizer: Tokenizer) -> list[int]:
    """`prompt`: a string, or token ids; one of either in a list."""
    if "prompt" not in body:
        raise bad_param("prompt", "prompt is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_param(
                "prompt", f"prompt holds {len(prompt)} prompts: send one request per prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in prompt
    ):
        return prompt
    raise bad_param("prompt", "prompt must be a string or an array of token ids")


def _chat_prompt(body: Mapping, tokenizer: Tokenizer) -> list[int]:
    """`messages` through the model's chat template, ending with the assistant's turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "messages must be a non-empty array of messages")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_param("messages", f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise bad_param(
                "messages", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}"
            )
        conversation.append({**message, "content": _content(message.get("content"), i)})
    if tokenizer.chat_template is None:
        raise bad_param("messages", "this model has no chat template: use /v1/completions")
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    except ValueError as error:
        raise bad_param("messages", f"the chat template refused the messages: {error}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _content(content: object, i: int) -> str:
    """A message's text: a string, or an array of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise bad_param("messages", f"messages[{i}].content: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise bad_param("messages", f"messages[{i}].content: a text part needs a text")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_param("messages", f"messages[{i}].content must be a string or an array of parts")
