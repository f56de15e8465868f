"""`specgraph serve` under clients that misbehave: long outputs with many stop strings, huge
prompts and bodies, cross-site and rebound requests, clients that hang up, malformed input, no
API key. Each test checks what the server guarantees: the scheduler's work per round does not
grow with the output, the event loop keeps answering, only JSON from allowed hosts with the key
runs, a request whose client left frees its row, and client input never causes a 5xx.

A live server (uvicorn on a loopback port) on the tiny model with a character tokenizer, eager
rounds; raw HTTP through http.client and sockets."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
from hypothesis import given, settings, strategies as st  # noqa: E402

import specgraph  # noqa: E402
from specgraph.serving import ServingEngine  # noqa: E402
from specgraph.serving.engine import Event, ServeRequest  # noqa: E402
from specgraph.serving.guard import default_hosts, host_name  # noqa: E402
from specgraph.serving.server import OpenAIServer, create_app, metrics_text  # noqa: E402
from specgraph.serving.text import TextTracker  # noqa: E402
from live_server import Live, eager_engine, hf_greedy, tiny_model  # noqa: E402

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def served(char_tokenizer):
    model, tok, engine = eager_engine(char_tokenizer)
    app = create_app(engine, tok, "tiny", api_key=KEY)
    live = Live(app)
    yield model, tok, engine, live, app.state.server
    live.stop()


def call(live, method, path, body=None, *, raw=None, headers=None, timeout=30):
    """(status, parsed JSON body or raw bytes) of one request; the API key and a JSON content type
    unless ``headers`` replace them."""
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=timeout)
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})}
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, body=data, headers={k: v for k, v in hdrs.items() if v is not None})
        r = conn.getresponse()
        payload = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(payload)
    except ValueError:
        return r.status, payload


def assert_openai_error(status, body, want_status, code=None):
    assert status == want_status, (status, body)
    assert isinstance(body, dict) and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body


def wait_until(cond, timeout=10.0):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            return False
        time.sleep(0.01)
    return True


# ----------------------------------------------------------------------------------------------
# stop strings: the text cut exactly, the work per round bounded


def byte_tokenizer():
    """A byte-level tokenizer (a token per UTF-8 byte, and two merges): a character of 2-4 bytes
    spans tokens, a prefix of a character's tokens decodes to a replacement character, and a
    token may hold the end of one character and the start of the next (" " + the first byte of
    "😀", "b" + the first byte of "é")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("Ġ", "ð"), ("b", "Ã")]  # the byte-level spellings of b" \xf0" and b"b\xc3"
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>")


def shortest_stop_prefix(tok, ids, stops):
    """The reference: the fewest leading tokens whose whole decoded text contains a stop string."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        if any(s in text for s in stops):
            return n
    return None


@pytest.fixture(scope="module")
def tokenizers_(char_tokenizer):
    return {"char": char_tokenizer(), "byte": byte_tokenizer()}


CHARS = "ab c.\n" + "é中😀"


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(["char", "byte"]), text=st.text(alphabet=CHARS, min_size=1, max_size=40),
       spans=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), max_size=3),
       others=st.lists(st.text(alphabet=CHARS, min_size=1, max_size=4), min_size=1, max_size=13),
       rounds=st.lists(st.integers(1, 6), min_size=1, max_size=60), eos_at=st.sets(st.integers(0, 40), max_size=4))
def test_stop_cut_is_the_shortest_prefix_with_a_stop(tokenizers_, kind, text, spans, others, rounds, eos_at):
    """Fed the output round by round, stop_cut answers, at the round that completes the first stop
    string, the fewest tokens whose text contains it; and the streamed deltas join to the text
    before it (special tokens, without text, among the output; multi-byte characters split).
    Stop strings: pieces of the text and others."""
    tok = tokenizers_[kind]
    stops = [text[i: i + n] for i, n in spans if text[i: i + n]] + others
    ids = tok(text, add_special_tokens=False).input_ids
    for j in sorted(eos_at, reverse=True):
        ids.insert(min(j, len(ids)), tok.eos_token_id)
    want = shortest_stop_prefix(tok, ids, stops)
    cutter, streamer = TextTracker(tok, stops), TextTracker(tok, stops)
    end, got, streamed = 0, None, ""
    for r in rounds + [len(ids)]:
        end = min(len(ids), end + r)
        got = cutter.stop_cut(ids[:end])
        if got is not None or end == len(ids):
            break
        streamed += streamer.delta(ids[:end], False)
    assert got == want
    out = ids[: got or len(ids)]
    streamed += streamer.delta(out, True)
    assert streamed == streamer.final_text(out, got is not None)
    assert not any(s in streamed for s in stops)


class CountingTokenizer:
    """A tokenizer whose decode counts the tokens it is given."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def decoded_per_round(tok, n_tokens, round_size=5):
    """Tokens decoded by stop_cut in each round of an output of ``n_tokens`` tokens, with 16 stop
    strings, the first of them completed by the output's last token."""
    body = "the cat sat on the mat; " * (n_tokens // 24 + 1)
    ids = tok(body[: n_tokens - 4] + "STOP", add_special_tokens=False).input_ids
    assert len(ids) == n_tokens
    counting = CountingTokenizer(tok)
    tracker = TextTracker(counting, ["STOP"] + [f"<never {i}>" for i in range(15)])
    per_round, cut = [], None
    for end in range(round_size, n_tokens + round_size, round_size):
        before = counting.decoded
        cut = tracker.stop_cut(ids[: min(end, n_tokens)])
        per_round.append(counting.decoded - before)
    assert cut == n_tokens
    return per_round


def test_stop_check_work_per_round_does_not_grow_with_the_output(char_tokenizer):
    """With 16 stop strings, each round's stop check decodes a bounded number of tokens, the same
    at 2,000 tokens of output as at 200, in the rounds before the match and in the round of it."""
    tok = char_tokenizer()
    short, long = decoded_per_round(tok, 200), decoded_per_round(tok, 2000)
    assert max(long) == max(short) <= 60, (max(short), max(long))
    assert long[-1] <= 60  # the round that completes the stop string


def test_many_stop_strings_over_http(served):
    """A request with 16 stop strings gets the text before the first one, streamed or not."""
    model, tok, engine, live, _ = served
    prompt = "the cat sat on the mat. the cat sat on the"
    status, full = call(live, "POST", "/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0})
    assert status == 200
    text = full["choices"][0]["text"]
    assert len(text) > 8, text
    stop = text[5:8]
    stops = [f"<not {i}>" for i in range(15)] + [stop]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stops}
    status, r = call(live, "POST", "/v1/completions", body)
    assert status == 200 and r["choices"][0]["text"] == text[: text.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"
    chunks = stream_texts(live, {**body, "stream": True})
    assert "".join(chunks) == text[: text.find(stop)]


def stream_texts(live, body):
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200
    out = []
    for line in r.read().decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out += [c["text"] for c in json.loads(line[6:])["choices"]]
    conn.close()
    return out


# ----------------------------------------------------------------------------------------------
# big prompts and bodies


class SlowTokenizer:
    """The served tokenizer, ``delay`` seconds slower to encode; counts its encode calls."""

    def __init__(self, tok, delay):
        self.tok, self.delay, self.calls, self.started = tok, delay, 0, threading.Event()

    def __call__(self, *a, **kw):
        self.calls += 1
        self.started.set()
        time.sleep(self.delay)
        return self.tok(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_health_answers_while_a_prompt_is_tokenized(served, monkeypatch):
    """Tokenization runs off the event loop: /health answers at once while a prompt is being
    tokenized, and the request then completes."""
    model, tok, engine, live, server = served
    slow = SlowTokenizer(tok, 2.0)
    monkeypatch.setattr(server, "tok", slow)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=call(live, "POST", "/v1/completions",
                                                           {"model": "tiny", "prompt": "abc", "max_tokens": 4})))
    t.start()
    assert slow.started.wait(10)
    t0 = time.perf_counter()
    status, body = call(live, "GET", "/health", timeout=10)
    waited = time.perf_counter() - t0
    t.join(30)
    assert status == 200 and body == {"status": "ok"}
    assert waited < 0.5, f"/health took {waited:.2f} s while a prompt was tokenized"
    assert out["r"][0] == 200


def test_long_prompt_refused_before_tokenizing(served, monkeypatch):
    """A prompt (or messages' text) longer than the character limit gets a 400
    (context_length_exceeded) without being tokenized; a body past the size limit gets a 413."""
    model, tok, engine, live, server = served
    counting = SlowTokenizer(tok, 0.0)
    monkeypatch.setattr(server, "tok", counting)
    n = server.max_prompt_chars + 1
    status, body = call(live, "POST", "/v1/completions", {"model": "tiny", "prompt": "a" * n, "max_tokens": 4})
    assert_openai_error(status, body, 400, "context_length_exceeded")
    msgs = [{"role": "user", "content": "a" * (n // 2)}, {"role": "user", "content": "b" * (n // 2 + 1)}]
    status, body = call(live, "POST", "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 4})
    assert_openai_error(status, body, 400, "context_length_exceeded")
    assert counting.calls == 0
    t0 = time.perf_counter()
    status, body = call(live, "POST", "/v1/completions", {"model": "tiny", "prompt": "a" * (4 << 20)})
    assert_openai_error(status, body, 413, "request_too_large")
    assert time.perf_counter() - t0 < 5.0
    # a body without a length (chunked) is cut off at the limit as it is read
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    chunks = (b"x" * (1 << 16) for _ in range(64))  # 4 MiB
    conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                          "Transfer-Encoding": "chunked"})
    assert conn.getresponse().status == 413
    conn.close()


# ----------------------------------------------------------------------------------------------
# cross-site requests, DNS rebinding, the API key


def test_posts_must_be_json(served):
    """A POST whose Content-Type is not application/json (what a cross-site form or fetch sends
    without a preflight) gets a 415 and runs nothing."""
    model, tok, engine, live, _ = served
    before = engine.stats.requests
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4}
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        status, r = call(live, "POST", "/v1/completions", body,
                         headers={"Content-Type": ctype, "Origin": "http://evil.example"})
        assert_openai_error(status, r, 415, "unsupported_media_type")
    assert engine.stats.requests == before
    status, _ = call(live, "POST", "/v1/completions", body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert status == 200


def test_host_header_must_name_an_allowed_host(served):
    """Every route answers only requests whose Host is an allowed name (any port): a page that
    rebinds its own name to 127.0.0.1 gets a 400 (invalid_host)."""
    model, tok, engine, live, _ = served
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 2}
    for host in ("evil.example", f"evil.example:{live.port}", "127.0.0.1.evil.example", ""):
        status, r = call(live, "POST", "/v1/completions", body, headers={"Host": host})
        assert_openai_error(status, r, 400, "invalid_host")
        status, r = call(live, "GET", "/health", headers={"Host": host})
        assert_openai_error(status, r, 400, "invalid_host")
    for host in (f"127.0.0.1:{live.port}", "localhost", f"LOCALHOST:{live.port}", "[::1]:1234"):
        assert call(live, "POST", "/v1/completions", body, headers={"Host": host})[0] == 200, host


def test_host_names_and_defaults():
    assert host_name("[::1]:8000") == "::1" and host_name("Example.COM.:80") == "example.com"
    assert host_name("localhost") == "localhost" and host_name("::1") == "::1"
    assert default_hosts("10.0.0.5") == ("10.0.0.5", "localhost", "127.0.0.1", "::1")
    assert default_hosts("127.0.0.1") == ("127.0.0.1", "localhost", "::1")
    assert default_hosts("0.0.0.0") is None and default_hosts("::") is None


def test_api_key_guards_v1_routes(served):
    """With an API key, every /v1 route needs it (401, invalid_api_key, otherwise); /health and
    /metrics stay open."""
    model, tok, engine, live, _ = served
    for auth in (None, "Bearer wrong", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x", "Bearer \u00e9"):
        status, r = call(live, "GET", "/v1/models", headers={"Authorization": auth})
        assert_openai_error(status, r, 401, "invalid_api_key")
        status, r = call(live, "POST", "/v1/completions", {"model": "tiny", "prompt": "a"},
                         headers={"Authorization": auth})
        assert_openai_error(status, r, 401, "invalid_api_key")
    assert call(live, "GET", "/v1/models", headers={"Authorization": f"bearer {KEY}"})[0] == 200
    assert call(live, "GET", "/health", headers={"Authorization": None})[0] == 200
    assert call(live, "GET", "/metrics", headers={"Authorization": None})[0] == 200


def serve_args(*argv):
    from specgraph.cli import build_parser

    return build_parser().parse_args(["serve", "m", *argv])


def test_serve_flags_set_key_hosts_and_prompt_limit(monkeypatch):
    from specgraph.cli import _serve_guard_settings

    monkeypatch.delenv("SPECGRAPH_API_KEY", raising=False)
    assert _serve_guard_settings(serve_args()) == {
        "api_key": None, "allowed_hosts": ("127.0.0.1", "localhost", "::1"), "max_prompt_chars": None}
    got = _serve_guard_settings(serve_args("--api-key", "k", "--allowed-hosts", "a.example,b", "--max-prompt-chars",
                                           "100", "--host", "0.0.0.0"))
    assert got == {"api_key": "k", "allowed_hosts": ("a.example", "b"), "max_prompt_chars": 100}
    assert _serve_guard_settings(serve_args("--host", "0.0.0.0"))["allowed_hosts"] is None
    assert _serve_guard_settings(serve_args("--allowed-hosts", "*"))["allowed_hosts"] is None
    monkeypatch.setenv("SPECGRAPH_API_KEY", "from-env")
    assert _serve_guard_settings(serve_args())["api_key"] == "from-env"
    assert _serve_guard_settings(serve_args("--api-key", "flag"))["api_key"] == "flag"


# ----------------------------------------------------------------------------------------------
# clients that hang up


def test_non_streaming_client_that_disconnects_frees_its_row(served, monkeypatch):
    """A non-streaming client that closes its connection while its tokens flow is cancelled
    within a few rounds, long before max_tokens."""
    model, tok, engine, live, _ = served
    real_round = engine._round

    def slow_round():  # 20 ms rounds: 400 tokens would take seconds
        time.sleep(0.02)
        real_round()

    monkeypatch.setattr(engine, "_round", slow_round)
    cancelled, length, tokens = engine.stats.finished["cancelled"], engine.stats.finished["length"], engine.stats.tokens
    body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", live.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
              + b"\r\n\r\n" + body)
    assert wait_until(lambda: engine.stats.tokens >= tokens + 10)
    s.close()
    t0 = time.perf_counter()
    assert wait_until(lambda: engine.stats.finished["cancelled"] > cancelled, timeout=5)
    assert time.perf_counter() - t0 < 1.0
    assert wait_until(lambda: engine.occupancy == 0)
    assert engine.stats.finished["length"] == length
    assert engine.stats.tokens - tokens < 400


def test_request_cancelled_while_queued_is_counted(char_tokenizer):
    """A request cancelled before it got a row counts as finished "cancelled" (/metrics)."""
    fast = specgraph.compile(tiny_model(), None, max_batch_size=1, max_seq_len=64, backend="eager")
    engine = ServingEngine(fast, max_queue=4)
    events = []
    engine.submit(ServeRequest([5, 6, 7], 4), events.append).cancel()
    engine.step()  # not started: one scheduler pass, by hand
    assert events == [Event(finish="cancelled")]
    assert engine.queue_depth == 0 and engine.occupancy == 0
    assert engine.stats.finished["cancelled"] == 1
    text = metrics_text(OpenAIServer(engine, char_tokenizer(), "tiny")).decode()
    assert 'specgraph_requests_finished_total{reason="cancelled"} 1.0' in text


# ----------------------------------------------------------------------------------------------
# malformed input


@pytest.mark.parametrize("raw", [
    pytest.param(b'{"model": "tiny", "prompt": "\\ud800 abc", "max_tokens": 2}', id="lone-surrogate"),
    pytest.param(b'{"model": "tiny", "prompt": "abc", "temperature": NaN}', id="nan"),
    pytest.param(b'{"model": "tiny", "prompt": "abc", "temperature": 1e400}', id="infinite"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-nesting"),
    pytest.param(b'{"model": "tiny", "prompt": "abc"', id="truncated"),
    pytest.param(b"\xff\xfe\x00", id="not-utf8"),
    pytest.param(b'"a string"', id="not-an-object"),
])
def test_malformed_completions_are_400(served, raw):
    """A body that is not a JSON object the server can run (bad text, non-finite numbers, deep
    nesting, broken JSON) gets a 400 with OpenAI's error body, not a 5xx."""
    model, tok, engine, live, _ = served
    status, body = call(live, "POST", "/v1/completions", raw=raw)
    assert_openai_error(status, body, 400)


def test_chat_template_errors_are_400(served, monkeypatch):
    """A chat template that fails on the messages, or messages it cannot render, gets a 400 with
    OpenAI's error body naming messages."""
    model, tok, engine, live, _ = served
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    status, body = call(live, "POST", "/v1/chat/completions", raw=raw)
    assert_openai_error(status, body, 400)
    monkeypatch.setattr(tok, "chat_template", "{{ raise_exception('no system role') }}")
    status, body = call(live, "POST", "/v1/chat/completions",
                        {"model": "tiny", "messages": [{"role": "system", "content": "x"}], "max_tokens": 2})
    assert_openai_error(status, body, 400)
    assert body["error"]["param"] == "messages" and "no system role" in body["error"]["message"]
    monkeypatch.setattr(tok, "chat_template", "{{ messages[0]['content'].upper() }}")
    status, body = call(live, "POST", "/v1/chat/completions",
                        {"model": "tiny", "messages": [{"role": "user", "content": [1, 2]}], "max_tokens": 2})
    assert_openai_error(status, body, 400)


def test_server_faults_are_500_with_a_json_body(served, monkeypatch):
    """A fault of the server's own (not the request's) is a 500 with OpenAI's error body."""
    model, tok, engine, live, server = served

    async def broken(*a, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "complete", broken)
    status, body = call(live, "POST", "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 2})
    assert_openai_error(status, body, 500)
    assert body["error"]["type"] == "server_error"


# ----------------------------------------------------------------------------------------------
# fields


def test_fields_without_effect_are_accepted_whatever_their_value(served):
    """user, store, metadata, service_tier, parallel_tool_calls and stream_options are ignored:
    the tokens are those of the same request without them."""
    model, tok, engine, live, _ = served
    base = {"model": "tiny", "prompt": "hello world, hello", "max_tokens": 12, "temperature": 0}
    extra = {"user": "alice", "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
             "parallel_tool_calls": True, "stream_options": {"include_usage": True}, "n": 1, "logit_bias": {},
             "echo": False, "presence_penalty": 0.0}
    status, plain = call(live, "POST", "/v1/completions", base)
    status2, with_extra = call(live, "POST", "/v1/completions", {**base, **extra})
    assert status == status2 == 200, with_extra
    assert with_extra["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert plain["choices"][0]["token_ids"] == hf_greedy(model, tok(base["prompt"]).input_ids, 12)[
        : len(plain["choices"][0]["token_ids"])]


def test_unknown_model_is_404_and_missing_model_is_served(served):
    model, tok, engine, live, _ = served
    status, body = call(live, "POST", "/v1/completions", {"model": "gpt-4", "prompt": "abc", "max_tokens": 2})
    assert_openai_error(status, body, 404, "model_not_found")
    status, body = call(live, "POST", "/v1/chat/completions",
                        {"model": "other", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert_openai_error(status, body, 404, "model_not_found")
    assert call(live, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 2})[0] == 200


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "stream", "no"),
    ("/v1/completions", "stream", 1),
    ("/v1/completions", "ignore_eos", "yes"),
    ("/v1/completions", "echo", 0),
    ("/v1/completions", "n", True),
    ("/v1/chat/completions", "logprobs", "true"),
    ("/v1/chat/completions", "stream", 0),
])
def test_booleans_are_booleans(served, path, field, value):
    """A boolean field given another JSON type (a string, a number), or a count given a boolean,
    gets a 400 naming it."""
    model, tok, engine, live, _ = served
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "abc"})
    status, r = call(live, "POST", path, body)
    assert_openai_error(status, r, 400)
    assert r["error"]["param"] == field
