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


def clean_up_tokenizer():
    """A byte-level tokenizer whose decode cleans up tokenization spaces
    (``clean_up_tokenization_spaces``, which some models' tokenizer configs set): the space
    before punctuation and contractions goes (" ," -> ",", " ' " -> "'", " n't" -> "n't"), so a
    token may change the text before it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<s>", "</s>", "Hello", "Ġ", ",", "Ġworld", "Ġ.", ".", "'", "Ġ'", "m", "s", "n", "Ġn", "'t", "t", "?",
              "!", "ve", "Ġ,", "a", "Ġa", "Ã", "©", "Ġ'm", "ĠĠ"]  # "Ã" "©": the bytes of "é"
    tk = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="a"))
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=True)


def sentencepiece_tokenizer():
    """A SentencePiece-style tokenizer with Llama 2's decoder: "▁" is a space, ``<0x..>`` tokens
    are bytes, and the text's first space is stripped (so a word decoded first has none)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁the", "▁word", "▁", "▁▁", "a", "▁a", ".", "<0x0A>", "<0xC3>", "<0xA9>"]
    tk = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def shortest_stop_prefix(tok, ids, stops):
    """The reference: the fewest leading tokens whose whole decoded text contains a stop string."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        if any(s in text for s in stops):
            return n
    return None


def token_units(tok):
    """What a model may output with ``tok``, a unit at a time: each token, "é" as its two byte
    tokens (a model's output is UTF-8), and runs of 1 to 6 special tokens."""
    vocab = tok.get_vocab()
    units = [[i] for p, i in sorted(vocab.items(), key=lambda x: x[1]) if p not in ("<0xC3>", "<0xA9>", "<unk>")]
    if "<0xC3>" in vocab:
        units.append([vocab["<0xC3>"], vocab["<0xA9>"]])
    return units + [[tok.eos_token_id] * n for n in range(1, 7)] + [[tok.bos_token_id, tok.eos_token_id] * 2]


@pytest.fixture(scope="module")
def tokenizers_(char_tokenizer):
    return {"char": char_tokenizer(), "byte": byte_tokenizer(), "clean-up": clean_up_tokenizer(),
            "sentencepiece": sentencepiece_tokenizer()}


CHARS = "ab c.\n" + "é中😀"


def output_ids(tok, kind, text, units, eos_at):
    """A model's output: the tokens of ``text`` with end-of-sequence tokens at ``eos_at`` (char,
    byte), or the tokenizer's units picked by ``units`` (clean-up, sentencepiece)."""
    if kind in ("clean-up", "sentencepiece"):
        choices = token_units(tok)
        return [i for u in units for i in choices[u % len(choices)]]
    ids = tok(text, add_special_tokens=False).input_ids
    for j in sorted(eos_at, reverse=True):
        ids.insert(min(j, len(ids)), tok.eos_token_id)
    return ids


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["char", "byte", "clean-up", "sentencepiece"]),
       text=st.text(alphabet=CHARS, min_size=1, max_size=40),
       units=st.lists(st.integers(0, 99), min_size=1, max_size=30),
       spans=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 4)), max_size=3),
       others=st.lists(st.text(alphabet=CHARS + ",'", min_size=1, max_size=4), min_size=1, max_size=13),
       rounds=st.lists(st.integers(1, 6), min_size=1, max_size=60), eos_at=st.sets(st.integers(0, 40), max_size=4))
def test_stop_cut_is_the_shortest_prefix_with_a_stop(tokenizers_, kind, text, units, spans, others, rounds, eos_at):
    """Fed the output round by round, stop_cut answers, at the round that completes the first stop
    string, the fewest tokens whose whole decode contains it; and the streamed deltas join to the
    text before it. Outputs with special tokens (without text, in runs) and split multi-byte
    characters; decoders that strip the text's first space or remove a space before punctuation.
    Stop strings: pieces of the text and others."""
    tok = tokenizers_[kind]
    ids = output_ids(tok, kind, text, units, eos_at)
    text = tok.decode(ids, skip_special_tokens=True)
    stops = [text[i: i + n] for i, n in spans if text[i: i + n]] + others
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


@pytest.mark.parametrize("kind, pieces, stops, cut, text", [
    ("clean-up", ["Hello", "Ġ", ",", "Ġworld"], [], None, "Hello, world"),  # "," takes the space before it
    ("clean-up", ["Hello", "Ġ", ",", "Ġworld"], ["o,"], 3, "Hell"),
    ("clean-up", ["Ġ", "'", "Ġ'"], ["''"], 3, ""),  # " ' '" -> "''": the window needs the first space
    ("clean-up", ["Ġ'", "s"], ["s"], 2, "'"),  # " 's" -> "'s": the stream holds the space back
    ("clean-up", ["ve", "Ġa", "Ġ'", "Ġ"], ["e a'"], 4, "v"),  # the stop appears as a space before it goes
    ("sentencepiece", ["▁the"] + ["</s>"] * 5 + ["▁word"], [], None, "the word"),  # " word" is not the first word
    ("sentencepiece", ["▁the"] + ["</s>"] * 5 + ["▁word"], [" word"], 7, "the"),
])
def test_text_is_the_whole_decode(tokenizers_, kind, pieces, stops, cut, text):
    """Tokens that change the text before them (a space cleaned up before punctuation), and a
    word after a run of special tokens (it keeps its leading space): fed a token at a time,
    stop_cut and the streamed deltas follow the decode of the whole output."""
    tok = tokenizers_[kind]
    ids = tok.convert_tokens_to_ids(pieces)
    assert shortest_stop_prefix(tok, ids, stops) == cut
    cutter, streamer = TextTracker(tok, stops), TextTracker(tok, stops)
    got, streamed = None, ""
    for n in range(1, len(ids) + 1):
        got = cutter.stop_cut(ids[:n])
        if got is not None:
            break
        streamed += streamer.delta(ids[:n], False)
    assert got == cut
    assert streamed + streamer.delta(ids[: got or len(ids)], True) == text


def test_last_delta_adds_nothing_to_a_stream_the_decode_changed(tokenizers_):
    """A later token may change text already streamed (with a byte-fallback decoder, an invalid
    byte turns the newline byte before it into a replacement character): no text after the
    streamed text would then be the whole decode's, and the last delta adds nothing."""
    tok = tokenizers_["sentencepiece"]
    ids = tok.convert_tokens_to_ids(["▁a", "<0x0A>", "<0xA9>"])
    assert tok.decode(ids, skip_special_tokens=True) == "a\ufffd\ufffd"
    streamer = TextTracker(tok, [])
    assert "".join(streamer.delta(ids[:n], False) for n in range(1, len(ids) + 1)) == "a\n"
    assert streamer.delta(ids, True) == ""


class CountingTokenizer:
    """A tokenizer whose decode counts the tokens it is given."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


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


def test_text_work_per_round_does_not_grow_over_special_tokens(char_tokenizer):
    """Special tokens decode to nothing: over a run of them (a model repeating its end-of-sequence
    token under ignore_eos), each round's stop check and stream decode a bounded number of
    tokens, as over text."""
    tok = char_tokenizer()
    ids = tok("the cat", add_special_tokens=False).input_ids + [tok.eos_token_id] * 2000
    counting = CountingTokenizer(tok)
    cutter, streamer = TextTracker(counting, ["STOP"]), TextTracker(counting, [])
    per_round = []
    for end in range(5, len(ids) + 5, 5):
        before = counting.decoded
        assert cutter.stop_cut(ids[:end]) is None
        streamer.delta(ids[:end], False)
        per_round.append(counting.decoded - before)
    assert max(per_round) <= 60, max(per_round)
    assert streamer.delta(ids, True) == "" and streamer.sent == len("the cat")


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


def test_messages_limit_counts_values_that_are_not_text(served, monkeypatch):
    """Message values that are not strings (content as a list of numbers) count the length of
    their JSON text toward the character limit, about what a template printing them renders: a
    body of them is refused before the template runs."""
    model, tok, engine, live, server = served
    rendered = []
    monkeypatch.setattr(tok, "chat_template", "{{ messages[0]['content'] }}")
    real = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **kw: rendered.append(1) or real(*a, **kw))
    content = [0] * (server.max_prompt_chars // 2)  # 3 characters each as text: "0, "
    status, body = call(live, "POST", "/v1/chat/completions",
                        {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert_openai_error(status, body, 400, "context_length_exceeded")
    assert rendered == []
    status, _ = call(live, "POST", "/v1/chat/completions",
                     {"model": "tiny", "messages": [{"role": "user", "content": [1, 2]}], "max_tokens": 2})
    assert status == 200 and rendered == [1]


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


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/no-such-route"])
def test_api_key_guards_every_other_route(served, path):
    """With an API key, the routes FastAPI adds (the API's description and its pages) and paths
    no route serves need it too: only /health and /metrics are open."""
    model, tok, engine, live, _ = served
    status, r = call(live, "GET", path, headers={"Authorization": None})
    assert_openai_error(status, r, 401, "invalid_api_key")
    assert call(live, "GET", path)[0] == (404 if path == "/no-such-route" else 200)


def test_api_key_guards_routes_under_a_path_prefix(served):
    """Mounted under a prefix, or served under a proxy's root_path, the app asks for the key on
    the same routes (the path its routes match is the request's less the prefix)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    model, tok, engine, live, _ = served
    app = create_app(engine, tok, "tiny", api_key=KEY)  # not started: /v1/models needs no scheduler
    outer = FastAPI()
    outer.mount("/llm", app)
    for client, prefix in ((TestClient(outer, base_url="http://localhost"), "/llm"),
                           (TestClient(app, base_url="http://localhost", root_path="/api"), "/api")):
        for path in ("/v1/models", "/openapi.json"):
            assert_openai_error(*json_of(client.get(prefix + path)), 401, "invalid_api_key")
            assert client.get(prefix + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert client.get(prefix + "/health").status_code == 200


def json_of(response):
    return response.status_code, response.json()


def test_empty_api_key_is_refused():
    """An empty API key is a configuration error, not a key that an empty Bearer token matches."""
    from specgraph.serving.launch import ServeConfig

    with pytest.raises(ValueError, match="api_key must be a non-empty string"):
        create_app(None, None, "tiny", api_key="")
    with pytest.raises(ValueError, match="api_key must be a non-empty string"):
        ServeConfig(api_key="")
    assert ServeConfig(api_key="k").api_key == "k" and ServeConfig().api_key is None


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
    monkeypatch.setenv("SPECGRAPH_API_KEY", "")  # empty: no key
    assert _serve_guard_settings(serve_args())["api_key"] is None
    assert _serve_guard_settings(serve_args("--api-key", ""))["api_key"] is None


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


def test_server_fault_while_parsing_is_500(served, monkeypatch):
    """An exception that client input cannot cause, raised while a request is parsed, is the
    server's fault: a 500 with OpenAI's error body, not a 400."""
    model, tok, engine, live, server = served

    def broken(body):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "_sampling", broken)
    status, body = call(live, "POST", "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 2})
    assert_openai_error(status, body, 500)
    assert body["error"]["type"] == "server_error"


def asgi_post(app, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a POST /v1/completions handed to the ASGI app itself, its headers
    as raw bytes (no HTTP parser in between to refuse them)."""
    import asyncio

    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


@pytest.mark.parametrize("length", ["\u00b2", "1\u00b9", "-1", "", "0x10"])
def test_content_length_that_is_not_a_number_is_400(served, length):
    """A Content-Length that is not ASCII digits ("²" is a digit to str.isdigit, not to int) gets
    a 400 naming it."""
    model, tok, engine, live, _ = served
    app = create_app(engine, tok, "tiny", api_key=KEY)  # not started: the body is refused before it runs
    body = b'{"model": "tiny", "prompt": "abc", "max_tokens": 2}'
    headers = [(b"host", b"localhost"), (b"content-type", b"application/json"),
               (b"authorization", f"Bearer {KEY}".encode()), (b"content-length", length.encode("latin-1"))]
    status, r = asgi_post(app, headers, body)
    assert_openai_error(status, r, 400)
    assert r["error"]["param"] == "Content-Length"


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
