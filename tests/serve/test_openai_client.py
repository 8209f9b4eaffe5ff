"""The official `openai` client against a live `decodespec serve` on 127.0.0.1.

Streaming and not, chat and completions, logprobs, stop strings, seeds,
extra body fields, and bad parameters raising the client's own errors: what
any program written for the OpenAI API does, pointed at this server.
"""

from __future__ import annotations

import json
import math
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.serve.live import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=live_server.base_url, api_key="not-needed", max_retries=0)


def streamed_chat(client, **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_whole_and_streamed_give_the_same_answer(client, live_server):
    kwargs = dict(messages=QUESTION, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(model=MODEL, **kwargs)
    answer = whole.choices[0].message.content
    assert "Paris" in answer, answer
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    text, chunks = streamed_chat(client, **kwargs, stream_options={"include_usage": True})
    assert text == answer
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The same prompt again: all but the last token, which always runs, come from the
    # prefix cache (LOOP-PREFIX-1): its whole blocks (16 tokens each), and the rest
    # copied from the first answer's block if that answer filled it (registered).
    prompt = whole.usage.prompt_tokens
    written = prompt + whole.usage.completion_tokens - 1  # the last token never runs
    whole_blocks = (prompt - 1) // 16 * 16
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == (prompt - 1 if written // 16 * 16 > whole_blocks else whole_blocks) > 0
    timing = whole.model_extra["timing"]
    assert timing["ttft_s"] > 0 and len(timing["inter_token_latencies_s"]) == (
        whole.usage.completion_tokens - 1
    )
    live_server.wait_idle()
    assert live_server.free_blocks() == live_server.total_blocks()


def test_completions_whole_and_streamed_give_the_same_text(client):
    kwargs = dict(prompt="The three primary colours are", max_tokens=10, temperature=0.7, seed=9)
    whole = client.completions.create(model=MODEL, **kwargs)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 10
    stream = client.completions.create(model=MODEL, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text


def test_a_seed_reproduces_the_same_sampled_text(client):
    kwargs = dict(messages=QUESTION, max_tokens=16, temperature=1.2, top_p=0.95)
    first = client.chat.completions.create(model=MODEL, seed=1234, **kwargs)
    again = client.chat.completions.create(model=MODEL, seed=1234, **kwargs)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.model_extra["seed"] == 1234
    unseeded = client.chat.completions.create(model=MODEL, **kwargs)
    seed = unseeded.model_extra["seed"]  # drawn, and reported exactly even to JavaScript
    assert isinstance(seed, int) and 0 <= seed < 2**53


def test_a_stop_string_ends_the_answer_before_it(client):
    kwargs = dict(messages=QUESTION, max_tokens=12, temperature=0)
    answer = client.chat.completions.create(model=MODEL, **kwargs).choices[0].message.content
    assert " of " in answer, answer
    stopped = client.chat.completions.create(model=MODEL, stop=[" of "], **kwargs)
    assert stopped.choices[0].message.content == answer[: answer.index(" of ")]
    assert stopped.choices[0].finish_reason == "stop"
    text, _ = streamed_chat(client, stop=" of ", **kwargs)
    assert text == answer[: answer.index(" of ")]


def test_chat_logprobs_describe_each_token(client):
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for step in content:
        assert len(step.top_logprobs) == 3
        top = [t.logprob for t in step.top_logprobs]
        assert top == sorted(top, reverse=True)
        # greedy: the chosen token is the most likely one, rank 1
        assert step.model_extra["rank"] == 1 and step.logprob == top[0]
        assert step.token == step.top_logprobs[0].token
        assert bytes(step.bytes).decode("utf-8", "replace") == step.token
        assert sum(math.exp(lp) for lp in top) <= 1 + 1e-4
    text = "".join(step.token for step in content)
    assert text.startswith(response.choices[0].message.content)


def test_streamed_logprobs_match_the_whole_ones(client):
    kwargs = dict(messages=QUESTION, max_tokens=6, temperature=0.9, seed=5, logprobs=True)
    # Both answers below read the prompt's whole blocks from the prefix cache, so that
    # they run the same arithmetic whatever ran before (a cold prefill differs in the
    # last bits, which an exact comparison would see).
    client.chat.completions.create(model=MODEL, **kwargs)
    whole = client.chat.completions.create(model=MODEL, top_logprobs=2, **kwargs)
    _, chunks = streamed_chat(client, top_logprobs=2, **kwargs)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content
    ]


def test_completions_logprobs_in_the_legacy_format(client):
    response = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == response.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_extra_body_fields_reach_the_sampler(client, live_server):
    """top_k=1 at any temperature is greedy; a large logit_bias forces its token."""
    greedy = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0
    )
    top1 = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=1.5, extra_body={"top_k": 1}
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    (banana,) = live_server.tokenizer.encode(" banana", add_special_tokens=False)
    forced = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(banana): 100}
    )
    assert forced.choices[0].text == " banana" * 3


def test_max_completion_tokens_and_penalties(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_completion_tokens=4,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        extra_body={"min_tokens": 4, "repetition_penalty": 1.1},
    )
    assert response.usage.completion_tokens == 4
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"extra_body": {"top_k": -3}}, "top_k"),
        ({"extra_body": {"temprature": 0.5}}, "temprature"),
    ],
)
def test_a_bad_parameter_raises_bad_request_naming_it(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs)
    assert error.value.status_code == 400
    assert error.value.param == param
    assert param in error.value.message


def test_an_unknown_model_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
    assert error.value.code == "model_not_found"


def test_a_prompt_beyond_the_context_is_a_bad_request(client):
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=2)
    assert error.value.code == "context_length_exceeded"
    assert error.value.param == "messages"


# ---------------------------------------------------------------- structured outputs


class City(pydantic.BaseModel):
    """What the client's `parse` helper turns into a strict JSON Schema."""

    name: Literal["Paris", "Lyon", "Marseille"]
    is_capital: bool


def test_the_clients_parse_helper_gets_an_object_of_its_model(client):
    """`chat.completions.parse(response_format=City)` sends City's JSON Schema as
    `response_format` and parses the answer: the grammar makes it parse."""
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Which city is the capital of France? Answer in JSON."}
        ],
        response_format=City,
        temperature=0.7,
        seed=3,
        max_tokens=120,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City), choice.message


def test_json_object_mode_answers_a_json_object(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": "Give me a JSON object with the name and population of Paris.",
            }
        ],
        response_format={"type": "json_object"},
        temperature=0.7,
        seed=3,
        max_tokens=120,
    )
    assert answer.choices[0].finish_reason == "stop", answer
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_a_bad_schema_raises_bad_request_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objec"}},
            },
        )
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    assert "objec" in caught.value.body["message"]


@pytest.mark.clause("MASK-SOUND-1")
def test_the_issues_username_schema_answers_within_its_bounds(client):
    # Issue 37's example: pattern and maxLength together. The grammar library dropped
    # maxLength (an 11-character username finished "stop"); llguidance enforces both.
    schema = {
        "type": "object",
        "properties": {"username": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}},
        "required": ["username"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a username for John Johnson, as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "user", "strict": True, "schema": schema},
        },
        temperature=0,
        max_tokens=60,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)
