"""`specgraph serve` under random traffic (hypothesis): random JSON bodies (valid and invalid
fields, types and sizes), random headers (content type, Host, Origin, Authorization), random
routes, and clients that hang up at random points, against a live server on the tiny model with
eager rounds.

Properties: no answer is a 5xx, every request is answered within a timeout (no hang), every row
and queue slot is free once the clients are gone, and the server then still answers a greedy
request with ``model.generate``'s tokens. Negative control: the same client and check report a
5xx when the server has a fault."""
from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from specgraph.serving.server import create_app  # noqa: E402
from live_server import Live, eager_engine, hf_greedy  # noqa: E402

KEY = "sk-fuzz"
MAX_PROMPT_CHARS = 2000
MAX_BODY_BYTES = 64 << 10
ANSWER_TIMEOUT = 30.0  # seconds a request may take (max_tokens <= 64 on the tiny model: well under 1 s)


@pytest.fixture(scope="module")
def served(char_tokenizer):
    model, tok, engine = eager_engine(char_tokenizer, max_seq_len=256, max_logprobs=2)
    app = create_app(engine, tok, "tiny", api_key=KEY, max_prompt_chars=MAX_PROMPT_CHARS,
                     max_body_bytes=MAX_BODY_BYTES)
    live = Live(app)
    yield model, tok, engine, live, app.state.server
    live.stop()


# ----------------------------------------------------------------------------------------------
# requests

junk = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
# strings a tokenizer or template may choke on: a lone surrogate, NUL, direction marks, a
# character outside the tokenizer's alphabet, a special token's text, template syntax
NASTY = ["\ud800", "a\udfffb", "\x00", "\u202e", "\U0001f600", "</s>", "<s>", "{{ 1/0 }}", "{% raise %}", "\\"]
text = st.one_of(st.text(max_size=24), st.lists(st.sampled_from(NASTY), min_size=1, max_size=3).map("".join))
prompt = st.one_of(text.filter(bool), st.lists(st.integers(3, 97), min_size=1, max_size=20),
                   text.filter(bool).map(lambda t: [t]))
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": text})
# fields a client may send, with values the server runs
BENIGN = {
    "model": st.just("tiny"),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1]),
    "seed": st.integers(0, 2**64),
    "stop": st.one_of(text, st.lists(text, max_size=4)),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "user": text,
    "store": st.booleans(),
    "metadata": junk,
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    "echo": st.just(False),
    "n": st.just(1),
}
LOGPROBS = {"/v1/completions": {"logprobs": st.integers(0, 2)},
            "/v1/chat/completions": {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 2)}}
# values the server refuses, and fields it does not know
HOSTILE = st.one_of(
    st.tuples(st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
                               "seed", "stop", "stream", "ignore_eos", "logprobs", "top_logprobs", "top_p", "top_k",
                               "n", "echo", "suffix", "tools", "unknown"]), junk),
    st.sampled_from([("model", "other"), ("n", 2), ("top_p", 0.5), ("presence_penalty", 0.5), ("logprobs", 9),
                     ("stop", ["x"] * 17), ("max_tokens", 10**6), ("prompt", [10**6]), ("temperature", -1)]),
    st.integers(MAX_PROMPT_CHARS - 5, MAX_PROMPT_CHARS + 5).map(lambda n: ("prompt", "ab " * (n // 3))),
)


@st.composite
def request_body(draw, path: str) -> dict:
    """A request of ``path``'s kind: valid fields, and one time in three, one to three hostile ones."""
    chat = "chat" in path
    body = {"messages": draw(st.lists(message, min_size=1, max_size=3))} if chat else {"prompt": draw(prompt)}
    body["max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"] = draw(st.integers(1, 64))
    body.update(draw(st.fixed_dictionaries({}, optional={**BENIGN, **LOGPROBS[path]})))
    if draw(st.integers(0, 2)) == 0:
        body.update(draw(st.lists(HOSTILE, min_size=1, max_size=3)))
    return body


@st.composite
def requests_(draw):
    """(method, path, body bytes): mostly a completion or chat request of its route's kind."""
    method, path = draw(st.sampled_from(
        [("POST", "/v1/completions")] * 6 + [("POST", "/v1/chat/completions")] * 6
        + [("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"), ("POST", "/nope"),
           ("GET", "/v1/completions")]))
    kind = draw(st.sampled_from(["fields"] * 6 + ["other_route", "too_large", "json", "bytes"]))
    chat = ("chat" in path) != (kind == "other_route")
    fields = request_body("/v1/chat/completions" if chat else "/v1/completions")
    if kind in ("fields", "other_route"):
        body = json.dumps(draw(fields)).encode()
    elif kind == "too_large":
        body = json.dumps({**draw(fields), "user": "x" * (MAX_BODY_BYTES + 1)}).encode()
    elif kind == "json":
        body = json.dumps(draw(junk)).encode()
    else:
        body = draw(st.binary(max_size=64))
    return method, path, body if method == "POST" else b""


def header(valid: str, *invalid):
    """The valid value four times in five, else one of ``invalid`` (None: the header left out)."""
    return st.sampled_from([valid] * 4 * len(invalid) + list(invalid))


headers = st.fixed_dictionaries({
    "Content-Type": header("application/json", "application/json; charset=utf-8", "text/plain",
                           "application/x-www-form-urlencoded", None),
    "Host": header("127.0.0.1", "localhost:1", "[::1]", "evil.example", "", None),
    "Origin": st.sampled_from([None, "http://evil.example", "null"]),
    "Authorization": header(f"Bearer {KEY}", "Bearer nope", "", None),
})
# when the client goes away: never, right after sending, after the first bytes of the answer,
# or after a short wait
leaving = st.sampled_from(["stay"] * 6 + ["after_send", "after_first_bytes", "after_50ms"])


def send(live, method, path, body: bytes, hdrs: dict, leave: str) -> int | None:
    """The answer's status (None when the client left first); raises socket.timeout on a hang."""
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=ANSWER_TIMEOUT if leave != "after_50ms" else 0.05)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in hdrs.items():
            if value is not None:
                conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        if leave == "after_send":
            return None
        try:
            r = conn.getresponse()
        except (TimeoutError, socket.timeout):
            if leave == "after_50ms":
                return None
            raise
        if leave == "after_first_bytes":
            r.read(1)
            return r.status
        r.read()
        return r.status
    except (TimeoutError, socket.timeout):
        if leave == "after_50ms":
            return None
        raise
    finally:
        conn.close()


def server_errors(statuses) -> list[int]:
    return [s for s in statuses if s is not None and s >= 500]


def rows_freed(engine, timeout=30.0) -> bool:
    t0 = time.time()
    while engine.occupancy or engine.queue_depth:
        if time.time() - t0 > timeout:
            return False
        time.sleep(0.02)
    return True


def test_random_traffic_gets_no_5xx_and_frees_every_row(served):
    model, tok, engine, live, _ = served
    statuses: list[int | None] = []

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=requests_(), hdrs=headers, leave=leaving)
    def one(request, hdrs, leave):
        method, path, body = request
        status = send(live, method, path, body, hdrs, leave)
        statuses.append(status)
        assert not server_errors([status]), (method, path, body[:200], hdrs, leave)

    t0 = time.perf_counter()
    one()
    took = time.perf_counter() - t0
    answered = [s for s in statuses if s is not None]
    assert server_errors(statuses) == []
    assert 200 in answered and any(400 <= s < 500 for s in answered)  # both kinds of answers were exercised
    assert rows_freed(engine), (engine.occupancy, engine.queue_depth)
    prompt = "the cat sat on the mat. the cat sat on the"
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=ANSWER_TIMEOUT)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 24,
                                                        "temperature": 0}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    got = json.loads(r.read())["choices"][0]["token_ids"]
    conn.close()
    assert r.status == 200
    want = hf_greedy(model, tok(prompt).input_ids, 24)
    assert got == want[: len(got)] and len(got) >= 1
    assert took < 120, f"{len(statuses)} requests took {took:.0f} s"


def test_the_5xx_check_sees_a_server_fault(served, monkeypatch):
    """Negative control: with a fault in the server, the fuzz's client and check report the 5xx."""
    model, tok, engine, live, server = served

    async def broken(*a, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "complete", broken)
    body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 2}).encode()
    hdrs = {"Content-Type": "application/json", "Host": "127.0.0.1", "Authorization": f"Bearer {KEY}"}
    assert server_errors([send(live, "POST", "/v1/completions", body, hdrs, "stay")]) == [500]
