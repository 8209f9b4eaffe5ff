"""The HTTP API on a small random model: errors the OpenAI way, the SSE format,
a failing request in a stream, and no user input that makes a 500.

These run the ASGI app in-process (Starlette's TestClient, lifespan included),
so they are fast; `test_openai_client.py` talks to a live server over loopback.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from decodespec.reference.engine import Engine
from decodespec.reference.openai_api import FIELDS
from decodespec.reference.server import create_app
from tests.engine.toy import ByteTokenizer, random_weights, small_config

MODEL = "toy"
MAX_CONTEXT = 96


class ChatByteTokenizer(ByteTokenizer):
    """The byte tokenizer with a minimal chat template."""

    chat_template = "<role>content"

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def weights():
    return random_weights(small_config(max_context=MAX_CONTEXT), seed=11)


@pytest.fixture(scope="module")
def engine(weights):
    return Engine(weights, ChatByteTokenizer(), block_size=4, cache_tokens=1024, seed=0)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, MODEL), raise_server_exceptions=False) as client:
        yield client


def sse_payloads(text: str) -> list:
    """The `data:` payloads of an event stream, `[DONE]` as the string."""
    assert text.endswith("data: [DONE]\n\n"), f"the stream does not end with [DONE]: {text[-200:]}"
    payloads = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), f"not an SSE data line: {block!r}"
        data = block.removeprefix("data: ")
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


# ---------------------------------------------------------------- errors

CHAT = [{"role": "user", "content": "hi"}]

BAD_COMPLETIONS = [
    # (body, status, param, code)
    ({"prompt": "hi", "top-p": 0.5}, 400, "top-p", None),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": "hi", "n": 2}, 400, "n", None),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ({"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, 400, "stream_options", None),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ({"prompt": "hi", "top_k": -1}, 400, "top_k", None),
    ({"prompt": "hi", "min_p": 2}, 400, "min_p", None),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ({"prompt": "hi", "logprobs": True}, 400, "logprobs", None),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", None),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 5}, 400, "min_tokens", None),
    ({"prompt": "hi", "stop": [""]}, 400, "stop", None),
    ({"prompt": "hi", "stop": 5}, 400, "stop", None),
    ({"prompt": "hi", "seed": -1}, 400, "seed", None),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed", None),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias", None),
    ({"prompt": "hi", "logit_bias": [1]}, 400, "logit_bias", None),
    ({"prompt": "hi", "frequency_penalty": 3}, 400, "frequency_penalty", None),
    ({"prompt": "hi", "presence_penalty": -2.5}, 400, "presence_penalty", None),
    ({"prompt": "hi", "ignore_eos": "no"}, 400, "ignore_eos", None),
    ({"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    ({"prompt": "hi", "logprobs_mode": "cooked"}, 400, "logprobs_mode", None),
    ({"prompt": "hi", "echo": "yes"}, 400, "echo", None),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs", None),
    ({"prompt": "hi", "num_draft": 2}, 400, "num_draft", None),  # no drafter on this server
    ({"prompt": "hi", "num_draft": -1}, 400, "num_draft", None),
    ({"prompt": "hi", "num_draft": "2"}, 400, "num_draft", None),
    ({"prompt": [99999]}, 400, "prompt", None),
    ({"prompt": [1.5]}, 400, "prompt", None),
    ({"prompt": ""}, 400, "prompt", None),
    ({"prompt": ["a", "b"]}, 400, "prompt", None),
    ({"prompt": {"text": "hi"}}, 400, "prompt", None),
    ({}, 400, "prompt", None),
    ({"prompt": "x" * 200}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": 500}, 400, "max_tokens", "context_length_exceeded"),
]

BAD_CHATS = [
    ({"messages": []}, 400, "messages", None),
    ({"messages": "hi"}, 400, "messages", None),
    ({"messages": ["hi"]}, 400, "messages", None),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages", None),
    ({"messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs", None),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ({"messages": CHAT, "logprobs": 3}, 400, "logprobs", None),
    (
        {"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 5},
        400,
        "max_completion_tokens",
        None,
    ),
    ({"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    (
        {"messages": CHAT, "max_completion_tokens": 500},
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    (
        {"messages": [{"role": "user", "content": "x" * 200}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ({"prompt": "hi"}, 400, "prompt", None),  # a completions field
]


def check_error(response, status: int, param: str | None, code: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    assert error["code"] == code, error
    assert error["message"], error
    if param is not None and status == 400:
        assert param.split(".")[0] in error["message"], f"the message should name {param}"
    return error


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD_COMPLETIONS, ids=repr)
def test_a_bad_completions_request_is_refused_naming_the_parameter(
    client, body, status, param, code
):
    check_error(client.post("/v1/completions", json=body), status, param, code)


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD_CHATS, ids=repr)
def test_a_bad_chat_request_is_refused_naming_the_parameter(client, body, status, param, code):
    check_error(client.post("/v1/chat/completions", json=body), status, param, code)


@pytest.mark.parametrize(
    "content", [b"{bad", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"null"], ids=repr
)
def test_a_body_that_is_not_a_json_object_is_a_400(client, content):
    response = client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    check_error(response, 400, None, None)


def test_unknown_routes_and_methods_answer_with_error_objects(client):
    check_error(client.get("/v1/nothing"), 404, None, None)
    check_error(client.get("/v1/completions"), 405, None, None)
    check_error(client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_CONTEXT
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/health").json() == {"status": "ok"}


# ---------------------------------------------------------------- responses


def test_a_completion_has_the_openai_shape(client, engine):
    body = {"prompt": "abc", "max_tokens": 5, "ignore_eos": True, "seed": 3, "logprobs": 2}
    response = client.post("/v1/completions", json=body).json()
    assert response["object"] == "text_completion" and response["model"] == MODEL
    assert response["id"].startswith("cmpl-")
    (choice,) = response["choices"]
    assert choice["finish_reason"] == "length"
    assert response["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 5
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert response["seed"] == 3
    timing = response["timing"]
    assert timing["ttft_s"] > 0 and len(timing["inter_token_latencies_s"]) == 4
    assert not engine.requests


@pytest.mark.clause("LOOP-PREFIX-1")
def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client):
    """Chats with one system message: the second maps the blocks (of 4 tokens) of
    their common prefix, the third also the first two positions of the second's
    question ("Wh"), copied from its block; each says so as OpenAI does, streamed
    usage too."""
    system = {"role": "system", "content": "Answer in French, briefly, always."}
    common = len(f"<system>{system['content']}<user>")  # one byte, one token
    assert common % 4 == 0  # the questions start a block
    cached = []
    for question, stream in (("Hi?", False), ("Why?", False), ("Who?", True)):
        body = {"messages": [system, {"role": "user", "content": question}], "max_tokens": 2}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            response = client.post("/v1/chat/completions", json=body)
            usage = sse_payloads(response.text)[-2]["usage"]
        else:
            usage = client.post("/v1/chat/completions", json=body).json()["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, common, common + 2]


def test_a_stream_is_server_sent_events_ending_with_done(client):
    body = {
        "messages": CHAT,
        "max_tokens": 6,
        "ignore_eos": True,
        "seed": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    *chunks, usage, done = sse_payloads(text)
    assert done == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "timing" in chunks[-1] and chunks[-1]["seed"] == 5
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    twin = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    whole = client.post("/v1/chat/completions", json=twin).json()
    assert streamed == whole["choices"][0]["message"]["content"]


def test_a_request_that_fails_mid_stream_gets_an_error_event_and_others_finish(client, engine):
    """A fault inside the engine fails only its request: its stream carries an error
    object (then [DONE]); a request alongside ends normally."""
    from tests.engine.test_robustness import faulty  # the robustness tests' injector

    healthy = engine.backend
    victim = 777

    def victim_seed(*args, seed=None, **kwargs):
        return seed is not None and bool((seed == victim).any())

    faulty_backend = dataclasses.replace(healthy, sample=faulty(healthy.sample, victim_seed))
    engine.runner.backend = engine.sampler.backend = faulty_backend
    try:
        base = {"prompt": "abc", "max_tokens": 4, "ignore_eos": True, "temperature": 0.8}
        with client.stream(
            "POST", "/v1/completions", json={**base, "seed": victim, "stream": True}
        ) as r:
            payloads = sse_payloads(r.read().decode())
        fine = client.post("/v1/completions", json={**base, "seed": 1}).json()
        failed = client.post("/v1/completions", json={**base, "seed": victim})
    finally:
        engine.runner.backend = engine.sampler.backend = healthy
    assert "injected fault" in payloads[-2]["error"]["message"]
    assert fine["choices"][0]["finish_reason"] == "length"
    assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
    assert engine.block_manager.allocator.num_free == engine.block_manager.allocator.num_blocks


def test_speculation_per_request_on_a_server_with_a_drafter(weights):
    """`num_draft` caps a request's drafts (0: none); the text is the same either way
    (greedy), and the timing reports the drafts' acceptance."""
    engine = Engine(weights, ChatByteTokenizer(), cache_tokens=1024, speculate="ngram", num_draft=3)
    body = {"prompt": "abcabcabcabc", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    with TestClient(create_app(engine, MODEL)) as client:
        plain = client.post("/v1/completions", json={**body, "num_draft": 0}).json()
        drafted = client.post("/v1/completions", json={**body, "num_draft": 2}).json()
        check_error(
            client.post("/v1/completions", json={**body, "num_draft": 4}), 400, "num_draft", None
        )
    assert "acceptance_rate" not in plain["timing"]
    assert "acceptance_rate" in drafted["timing"]
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"]


# ---------------------------------------------------------------- no 500 from user input

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def request_bodies(draw, kind: str) -> dict:
    names = sorted(FIELDS[kind])
    body = draw(st.dictionaries(st.sampled_from(names), JSON_VALUES, max_size=6))
    if draw(st.booleans()):  # often well-formed where it matters, to get past the first check
        body["prompt" if kind == "completion" else "messages"] = (
            "hi" if kind == "completion" else CHAT
        )
    # Bounded work: a valid request generates a few tokens at most.
    if not (isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] <= 3):
        body["max_tokens"] = draw(st.sampled_from([1, 3, 0, -1, None, "2"]))
    body.pop("max_completion_tokens", None)
    body.pop("min_tokens", None)
    return body


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_no_request_body_makes_a_server_error(client, engine, kind, data):
    body = data.draw(request_bodies(kind), label="body")
    route = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    response = client.post(route, json=body)
    assert response.status_code in (200, 400, 404), (response.status_code, response.text)
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert response.text.endswith("data: [DONE]\n\n")
    assert not engine.has_unfinished()
