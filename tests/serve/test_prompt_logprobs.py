"""Scoring text over HTTP: `echo`, `max_tokens: 0` with echo, and vLLM's `prompt_logprobs`.

The scores are checked against the spec's own functions (`forward_naive`
logits, `log_softmax` at each position), the shapes against OpenAI's legacy
completions format and vLLM's prompt_logprobs format, and lm-eval's
loglikelihood request (`echo`, `max_tokens` 0 or 1, `logprobs: 1`,
`temperature: 0`) is answered so that the sum of the continuation's
`token_logprobs` is the model's log-likelihood of the continuation.
The app runs in-process (Starlette's TestClient), as in `test_api.py`.
"""

from __future__ import annotations

import math

import pytest
import torch
from starlette.testclient import TestClient

from decodespec.reference.engine import Engine
from decodespec.reference.server import create_app
from decodespec.spec.forward import forward_naive
from tests.engine.toy import random_weights, small_config
from tests.serve.test_api import ChatByteTokenizer, sse_payloads

MODEL = "toy"
CONTEXT = "The quick brown fox"
CONTINUATION = " jumps over"
PROMPT = CONTEXT + CONTINUATION
TOL = 1e-4


@pytest.fixture(scope="module")
def weights():
    return random_weights(small_config(max_context=96), seed=5)


@pytest.fixture(scope="module")
def client(weights):
    engine = Engine(weights, ChatByteTokenizer(), block_size=4, cache_tokens=1024, seed=0)
    with TestClient(create_app(engine, MODEL), raise_server_exceptions=False) as client:
        yield client


def post(client, body: dict, route: str = "/v1/completions") -> dict:
    response = client.post(route, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def spec_scores(weights, ids: list[int]) -> torch.Tensor:
    """`[len(ids), vocab]`: row t - 1 is log p(· | ids[:t]), from the spec's forward."""
    return torch.log_softmax(forward_naive(weights, torch.tensor(ids)).double(), dim=-1)


def test_lm_eval_loglikelihood_shape_scores_the_continuation(client, weights):
    ids = list(PROMPT.encode())
    ctxlen = len(CONTEXT.encode())
    lsm = spec_scores(weights, ids)
    want = sum(float(lsm[t - 1, ids[t]]) for t in range(ctxlen, len(ids)))
    body = {"echo": True, "logprobs": 1, "temperature": 0}
    for prompt in (PROMPT, [ids]):  # text, or token ids as lm-eval sends them
        answer = post(client, {**body, "prompt": prompt, "max_tokens": 0})
        choice = answer["choices"][0]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 0
        assert answer["usage"]["prompt_tokens"] == len(ids)
        lp = choice["logprobs"]
        assert lp["tokens"] == [chr(i) for i in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"] == list(range(len(ids)))
        assert math.isclose(sum(lp["token_logprobs"][ctxlen:]), want, abs_tol=TOL)
        for t in range(1, len(ids)):
            assert math.isclose(lp["token_logprobs"][t], float(lsm[t - 1, ids[t]]), abs_tol=TOL)
            (best,) = lp["top_logprobs"][t].values()
            assert math.isclose(best, float(lsm[t - 1].max()), abs_tol=TOL)
    # Older lm-eval sends max_tokens 1 and drops the last entry ([ctxlen:-1]).
    answer = post(client, {**body, "prompt": PROMPT, "max_tokens": 1})
    lp = answer["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and answer["usage"]["completion_tokens"] == 1
    assert math.isclose(sum(lp["token_logprobs"][ctxlen:-1]), want, abs_tol=TOL)


def test_echo_puts_the_prompt_before_the_completion(client):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2}
    plain = post(client, body)["choices"][0]
    echoed = post(client, {**body, "echo": True})
    choice = echoed["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    assert echoed["usage"]["completion_tokens"] == 5
    n = len(PROMPT.encode())
    lp = choice["logprobs"]
    # The same tokens and scores (the prefix cache may serve the plain request: last bits).
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    for a, b in zip(lp["token_logprobs"][n:], plain["logprobs"]["token_logprobs"], strict=True):
        assert math.isclose(a, b, abs_tol=TOL)
    for a, b in zip(lp["top_logprobs"][n:], plain["logprobs"]["top_logprobs"], strict=True):
        assert a.keys() == b.keys()
    assert lp["text_offset"][n:] == [n + o for o in plain["logprobs"]["text_offset"]]
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    no_logprobs = post(client, {**body, "echo": True, "logprobs": None})["choices"][0]
    assert no_logprobs["text"] == choice["text"] and no_logprobs["logprobs"] is None


def stream(client, body: dict) -> list[dict]:
    body = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return sse_payloads(response.text)[:-1]


def test_a_stream_with_echo_sends_the_prompt_first(client):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True}
    whole = post(client, body)["choices"][0]
    chunks = stream(client, body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in choices) == whole["text"]
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    scored = stream(client, {**body, "max_tokens": 0})
    choices = [c["choices"][0] for c in scored if c["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPT
    assert choices[-1]["finish_reason"] == "length"
    assert scored[-1]["usage"]["completion_tokens"] == 0
    assert len([t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]) == len(
        PROMPT.encode()
    )


def check_vllm_format(entries: list, ids: list[int], k: int, lsm: torch.Tensor) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for t in range(1, len(ids)):
        entry, row = entries[t], lsm[t - 1]
        own = entry[str(ids[t])]
        assert math.isclose(own["logprob"], float(row[ids[t]]), abs_tol=TOL)
        assert own["rank"] == 1 + int((row > row[ids[t]]).sum())
        assert own["decoded_token"] == chr(ids[t])
        top = [int(i) for i in row.argsort(descending=True, stable=True)[:k]]
        assert set(entry) == {str(i) for i in top} | {str(ids[t])}
        for rank, i in enumerate(top, start=1):
            assert entry[str(i)]["rank"] == rank
            assert math.isclose(entry[str(i)]["logprob"], float(row[i]), abs_tol=TOL)


def test_vllm_prompt_logprobs_on_completions_and_chat(client, weights):
    ids = list(PROMPT.encode())
    answer = post(client, {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3})
    check_vllm_format(answer["choices"][0]["prompt_logprobs"], ids, 3, spec_scores(weights, ids))
    assert answer["choices"][0]["text"] != "" and not answer["choices"][0]["text"].startswith("The")
    zero = post(client, {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0})
    assert all(len(e) == 1 for e in zero["choices"][0]["prompt_logprobs"][1:])
    messages = [{"role": "user", "content": "hi there"}]
    chat = post(
        client,
        {"messages": messages, "max_tokens": 2, "prompt_logprobs": 2},
        "/v1/chat/completions",
    )
    chat_ids = list(b"<user>hi there<assistant>")
    check_vllm_format(
        chat["choices"][0]["prompt_logprobs"], chat_ids, 2, spec_scores(weights, chat_ids)
    )
    plain = post(client, {"messages": messages, "max_tokens": 2}, "/v1/chat/completions")
    assert "prompt_logprobs" not in plain["choices"][0]


BAD = [
    # (route, body, param)
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": False}, "max_tokens"),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 1},
        "min_tokens",
    ),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1.5}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "echo": True},
        "echo",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 99},
        "prompt_logprobs",
    ),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD)
def test_bad_scoring_fields_are_400s_naming_the_field(client, route, body, param):
    response = client.post(route, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    answer = post(client, {"prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 0})
    assert answer["choices"][0]["text"].startswith("hi")


def streamed_choice(client, body: dict) -> dict:
    """A completions stream's chunks as one choice: the legacy logprobs joined, and the
    prompt_logprobs of the chunk that carries them."""
    choices = [c["choices"][0] for c in stream(client, body) if c["choices"]]
    logprobs = [c["logprobs"] for c in choices if c["logprobs"]]
    prompt = [c["prompt_logprobs"] for c in choices if "prompt_logprobs" in c]
    assert len(prompt) == 1, "prompt_logprobs come once, with the first token"
    joined = {key: [v for lp in logprobs for v in lp[key]] for key in logprobs[0]}
    return {"logprobs": joined, "prompt_logprobs": prompt[0]}


@pytest.mark.parametrize("max_tokens", [0, 2])
@pytest.mark.parametrize(("k", "m"), [(3, 1), (1, 4), (2, 0), (0, 3)])
def test_echo_logprobs_and_prompt_logprobs_keep_their_own_counts(client, weights, k, m, max_tokens):
    """echo with `logprobs: k` and `prompt_logprobs: m`: each echoed prompt token has
    the top k alternatives (the first none, as OpenAI answers), each generated
    token k too, and vLLM's prompt_logprobs the top m (and the token itself),
    whatever the other count — the whole answer and the stream alike."""
    ids = list(PROMPT.encode())
    lsm = spec_scores(weights, ids)
    body = {"prompt": PROMPT, "echo": True, "logprobs": k, "prompt_logprobs": m}
    body |= {"max_tokens": max_tokens, "temperature": 0}
    for choice in (post(client, body)["choices"][0], streamed_choice(client, body)):
        tops = choice["logprobs"]["top_logprobs"]
        assert len(tops) == len(ids) + max_tokens and tops[0] is None
        for t in range(1, len(ids)):
            want = lsm[t - 1].topk(k).values.tolist()
            got = sorted(tops[t].values(), reverse=True)
            assert len(got) == k, f"prompt token {t}: {len(got)} alternatives, logprobs is {k}"
            assert all(math.isclose(a, b, abs_tol=TOL) for a, b in zip(got, want, strict=True))
        assert all(len(top) == k for top in tops[len(ids) :])
        check_vllm_format(choice["prompt_logprobs"], ids, m, lsm)


def test_chat_top_logprobs_and_prompt_logprobs_keep_their_own_counts(client, weights):
    chat_ids = list(b"<user>hi there<assistant>")
    lsm = spec_scores(weights, chat_ids)
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}
    for k, m in ((3, 1), (1, 3)):
        fields = {"logprobs": True, "top_logprobs": k, "prompt_logprobs": m, "temperature": 0}
        choice = post(client, {**body, **fields}, "/v1/chat/completions")["choices"][0]
        assert [len(t["top_logprobs"]) for t in choice["logprobs"]["content"]] == [k, k]
        check_vllm_format(choice["prompt_logprobs"], chat_ids, m, lsm)
