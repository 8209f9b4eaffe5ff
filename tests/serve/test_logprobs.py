"""Logprobs over HTTP, exactly as a live `decodespec serve` writes them (raw JSON).

Pinned here:

- chat with `"logprobs": true` and no `top_logprobs` answers one entry per
  generated token, each with `"top_logprobs": []` (present and empty, as
  OpenAI answers), streamed or not;
- a stream that holds text back (STOP-STREAM-1: the start of a stop string;
  STOP-UTF8-1: half a UTF-8 character, which the byte-level tokenizer splits
  over several tokens) still sends a logprob for every token, in the chunk of
  the step that made it: the streamed logprobs, concatenated, are the whole
  answer's, token for token, for `/v1/completions` and `/v1/chat/completions`;
- in the legacy completions format, a token that holds part of a character is
  named `bytes:\\xNN...` (as OpenAI does), so such tokens never collide as
  keys of `top_logprobs`.

The prompts are ones the bundled SmolLM2 answers greedily with emoji or kana,
three or two tokens a character; each of those tests also checks that its
stream really held text back, so none can pass vacuously.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.live import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NO_TOPS = {"messages": QUESTION, "max_tokens": 5, "temperature": 0, "logprobs": True}
# Greedy: 😏😐😑😑..., each emoji three tokens (f0 9f | 98 | 8x).
EMOJI_PROMPT = "Emoji: 😀😃😄😁😆😅😂"
# "😐" is held back (it could start "😐😐") until 😑 shows it does not; "😑😑" ends it.
EMOJI_STOP = ["😐😐", "😑😑"]
# Greedy: おわんでんは..., each kana two tokens (e3 8x | xx).
KANA_QUESTION = [{"role": "user", "content": "Say hello in Japanese."}]
# "ん" is held back (it could start "んは"): released before で, matched before は.
KANA_STOP = ["んは"]


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.url, trust_env=False, timeout=120) as client:
        yield client


def post(http: httpx.Client, route: str, body: dict) -> dict:
    response = http.post(route, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(http: httpx.Client, route: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed answer (usage chunk included), checked to end with [DONE]."""
    body = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
    response = http.post(route, json=body)
    assert response.status_code == 200, response.text
    text = response.text
    assert text.endswith("data: [DONE]\n\n"), f"the stream does not end with [DONE]: {text[-200:]}"
    blocks = text.strip().split("\n\n")[:-1]
    assert all(b.startswith("data: ") for b in blocks), f"not SSE data lines: {blocks}"
    return [json.loads(b.removeprefix("data: ")) for b in blocks]


def choices(chunks: list[dict]) -> list[dict]:
    """The chunks' choices (the usage chunk has none)."""
    return [c["choices"][0] for c in chunks if c["choices"]]


def close(value: object) -> object:
    """`value` with every float a `pytest.approx`: the whole answer and the stream may
    each find the prompt's first blocks in the prefix cache or not, which moves a
    logprob in its sixth digit."""
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-4, abs=1e-6)
    if isinstance(value, list):
        return [close(v) for v in value]
    if isinstance(value, dict):
        return {k: close(v) for k, v in value.items()}
    return value


def completion_tokens(chunks: list[dict]) -> int:
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    return usage["completion_tokens"]


def streamed_chat_entries(chunks: list[dict]) -> list[dict]:
    """All the streamed chat logprob entries, in order."""
    return [e for ch in choices(chunks) if ch["logprobs"] for e in ch["logprobs"]["content"]]


def streamed_legacy(chunks: list[dict]) -> dict:
    """The streamed completions logprobs, concatenated field by field."""
    fields = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    merged: dict = {field: [] for field in fields}
    for choice in choices(chunks):
        if choice["logprobs"] is not None:
            assert set(choice["logprobs"]) == set(fields), choice["logprobs"]
            for field in fields:
                merged[field] += choice["logprobs"][field]
    return merged


# ---------------------------------------------------------------- logprobs without top_logprobs


def check_empty_tops(entries: list[dict], tokens: int) -> None:
    assert len(entries) == tokens, f"{len(entries)} logprob entries for {tokens} tokens"
    for i, entry in enumerate(entries):
        assert "top_logprobs" in entry, f"entry {i} has no top_logprobs: {entry}"
        assert entry["top_logprobs"] == [], f"entry {i}: top_logprobs should be [], got {entry}"
        assert isinstance(entry["logprob"], float) and entry["token"], entry


def test_whole_chat_logprobs_without_top_logprobs_have_empty_top_lists(http):
    response = post(http, "/v1/chat/completions", NO_TOPS)
    logprobs = response["choices"][0]["logprobs"]
    assert logprobs is not None and set(logprobs) == {"content"}, logprobs
    check_empty_tops(logprobs["content"], response["usage"]["completion_tokens"])


def test_streamed_chat_logprobs_without_top_logprobs_have_empty_top_lists(http):
    chunks = stream(http, "/v1/chat/completions", NO_TOPS)
    check_empty_tops(streamed_chat_entries(chunks), completion_tokens(chunks))


# ---------------------------------------------------------------- held-back text


def utf8_complete(data: bytes) -> bool:
    """Whether `data` ends on a whole UTF-8 character."""
    try:
        data.decode()
    except UnicodeDecodeError as error:
        return error.reason != "unexpected end of data"
    return True


@pytest.mark.clause("STOP-STREAM-1", "STOP-UTF8-1")
def test_streamed_completion_logprobs_cover_held_back_tokens(http):
    body = {
        "prompt": EMOJI_PROMPT,
        "max_tokens": 16,
        "temperature": 0,
        "stop": EMOJI_STOP,
        "logprobs": 2,
    }
    whole = post(http, "/v1/completions", body)
    chunks = stream(http, "/v1/completions", body)
    expected = whole["choices"][0]["logprobs"]
    tokens = whole["usage"]["completion_tokens"]

    # Not vacuously: a stop string ended it, after a token that was part of a
    # character (STOP-UTF8-1) and after "😐", held back while it could start
    # "😐😐" (STOP-STREAM-1); fewer chunks carry text than there are tokens.
    text = whole["choices"][0]["text"]
    assert whole["choices"][0]["finish_reason"] == "stop" and "😐" in text, whole["choices"][0]
    assert any(token.startswith("bytes:\\x") for token in expected["tokens"]), (
        f"no token is part of a character: {expected['tokens']}"
    )
    # Tokens that hold part of a character are named by their bytes (`bytes:\xNN`, as
    # OpenAI writes them), so no two of them share a key of `top_logprobs`: each step
    # lists its 2 alternatives, the greedy token among them with its own logprob.
    for token, logprob, top in zip(
        expected["tokens"], expected["token_logprobs"], expected["top_logprobs"], strict=True
    ):
        assert len(top) == 2 and top.get(token) == logprob, (token, logprob, top)
    assert completion_tokens(chunks) == tokens
    streamed_text = [ch["text"] for ch in choices(chunks)]
    assert "".join(streamed_text) == text
    with_text = sum(1 for t in streamed_text if t)
    assert with_text < tokens, f"{with_text} chunks with text for {tokens} tokens: none held back"

    assert len(expected["tokens"]) == tokens
    streamed = streamed_legacy(chunks)
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert streamed[field] == close(expected[field]), (
            f"streamed {field} differ from the whole answer's:\n{streamed[field]}\n"
            f"!=\n{expected[field]}"
        )


@pytest.mark.clause("STOP-STREAM-1", "STOP-UTF8-1")
def test_streamed_chat_logprobs_cover_held_back_tokens(http):
    body = {
        "messages": KANA_QUESTION,
        "max_tokens": 16,
        "temperature": 0,
        "stop": KANA_STOP,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = post(http, "/v1/chat/completions", body)
    chunks = stream(http, "/v1/chat/completions", body)
    expected = whole["choices"][0]["logprobs"]["content"]
    tokens = whole["usage"]["completion_tokens"]
    assert len(expected) == tokens
    assert whole["choices"][0]["finish_reason"] == "stop", whole["choices"][0]
    assert completion_tokens(chunks) == tokens

    streamed = streamed_chat_entries(chunks)
    assert len(streamed) == tokens, f"{len(streamed)} streamed logprob entries for {tokens} tokens"
    for i, (got, want) in enumerate(zip(streamed, expected, strict=True)):
        assert got == close(want), f"token {i}: streamed {got} != whole {want}"

    # Not vacuously: chunk by chunk (before the last token, which ends it on the
    # stop string), some chunk's tokens end inside a character (STOP-UTF8-1), and
    # some end on whole characters the stream still holds back because they could
    # start the stop string (STOP-STREAM-1).
    sent, text, states = b"", "", []
    for choice in choices(chunks):
        text += choice["delta"].get("content") or ""
        if choice["logprobs"] is not None:
            sent += b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"])
            states.append((sent, text))
    assert text == whole["choices"][0]["message"]["content"]
    split = [s for s, _ in states[:-1] if not utf8_complete(s)]
    assert split, "no chunk ended inside a UTF-8 character: nothing to hold back"
    held = [(s, t) for s, t in states[:-1] if utf8_complete(s) and len(s.decode()) > len(t)]
    assert held, "no chunk held back whole characters for the stop string"
