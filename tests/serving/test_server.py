"""`specgraph serve` end to end: the `openai` client against a live server (uvicorn on a loopback
port, in this process) on a tiny model with a character tokenizer.

Exactness: every greedy response equals ``model.generate`` on its prompt, with 8 clients at
once (rows joining and leaving between rounds, long prompts prefilled in chunks). Negative
control: the same comparison flags a response whose rows were mixed up."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

import specgraph  # noqa: E402
from specgraph.serving import ServingEngine  # noqa: E402
from specgraph.serving.server import create_app  # noqa: E402
from live_server import Live, eager_engine, greedy_choices, hf_greedy, tiny_model  # noqa: E402

@pytest.fixture(scope="module")
def served(char_tokenizer):
    model, tok, engine = eager_engine(char_tokenizer, max_logprobs=3)
    live = Live(create_app(engine, tok, "tiny"))
    yield model, tok, engine, live
    live.stop()


def client(live, **kw):
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, **kw)


PROMPTS = ["the cat sat on the mat. the cat sat on the", "abcabcabcabc", "hello world, hello", "x",
           "1 2 3 4 5 6 7 8 9 10 11 12 " * 6, "Speculative decoding drafts tokens and verifies them.",
           "aaaa bbbb aaaa bbbb aaaa", "zq"]


def test_concurrent_greedy_equals_generate(served):
    model, tok, engine, live = served
    rounds0 = engine.stats.rounds
    choices = greedy_choices(live, PROMPTS, 40)
    mismatched = []
    for p, ch in zip(PROMPTS, choices):
        ids = tok(p).input_ids
        want = hf_greedy(model, ids, 40)
        got = ch.model_extra["token_ids"]
        if got != want[: len(got)] or (ch.finish_reason == "length" and len(got) != 40):
            mismatched.append(p)
        assert ch.text == tok.decode(got, skip_special_tokens=True)
    assert not mismatched
    assert engine.stats.rounds > rounds0
    # negative control: the check sees a response swapped with another prompt's
    a, b = choices[0].model_extra["token_ids"], hf_greedy(model, tok(PROMPTS[1]).input_ids, 40)
    assert a != b[: len(a)]


def test_chat_streaming_and_stop(served):
    model, tok, engine, live = served
    c = client(live)
    msgs = [{"role": "user", "content": "say abc abc abc"}]
    full = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert full.choices[0].message.model_extra.get("token_ids") is None  # token ids sit on the choice
    assert full.choices[0].model_extra["token_ids"] == hf_greedy(model, list(ids), 30)[:len(full.choices[0].model_extra["token_ids"])]
    text = full.choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in
             c.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0, stream=True)]
    assert "".join(parts) == text and len([p for p in parts if p]) >= 2
    # a stop string: the text ends before it, streamed or not
    if len(text) > 6:
        stop = text[3:6]
        cut = text[: text.find(stop)]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0, stop=[stop])
        assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
        s = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=30, temperature=0, stop=stop, stream=True))
        assert s == cut


def test_seeded_sampling_reproduces_alone_and_in_a_batch(served):
    model, tok, engine, live = served
    c = client(live)
    kw = dict(model="tiny", prompt="abcabcabc abcabc", max_tokens=30, temperature=1.0, seed=1234)
    alone = c.completions.create(**kw).choices[0].model_extra["token_ids"]
    ac = openai.AsyncOpenAI(base_url=live.url, api_key="none", max_retries=0)

    async def crowd():
        others = [ac.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=0.7, seed=i)
                  for i, p in enumerate(PROMPTS[:3])]
        return await asyncio.gather(ac.completions.create(**kw), *others)

    together = asyncio.run(crowd())[0].choices[0].model_extra["token_ids"]
    assert together == alone
    other = c.completions.create(**{**kw, "seed": 99}).choices[0].model_extra["token_ids"]
    assert other != alone  # the seed matters (negative control)


def test_logprobs(served):
    model, tok, engine, live = served
    c = client(live)
    r = c.completions.create(model="tiny", prompt="hello hello", max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    ids = tok("hello hello").input_ids
    ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    want = [torch.log_softmax(x[0].float(), -1) for x in ref.logits]
    got_ids = r.choices[0].model_extra["token_ids"]
    assert len(lp.token_logprobs) == len(got_ids)
    for j, t in enumerate(got_ids):
        assert abs(lp.token_logprobs[j] - float(want[j][t])) < 1e-4
        assert len(lp.top_logprobs[j]) == 2
        assert max(lp.top_logprobs[j].values()) == pytest.approx(float(want[j].max()), abs=1e-4)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0, logprobs=True, top_logprobs=1)
    assert len(chat.choices[0].logprobs.content) == len(chat.choices[0].model_extra["token_ids"])


def test_errors_models_health_metrics(served):
    model, tok, engine, live = served
    c = client(live)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        c.completions.create(model="tiny", prompt="a", max_tokens=4, presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="n=2"):
        c.completions.create(model="tiny", prompt="a", max_tokens=4, n=2)
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):
        c.completions.create(model="tiny", prompt="a", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="top_p.*start it with --top-p 0.5"):
        c.completions.create(model="tiny", prompt="a", max_tokens=4, temperature=1.0, top_p=0.5)
    import json
    import urllib.request

    base = live.url.rsplit("/v1", 1)[0]
    assert json.loads(urllib.request.urlopen(f"{base}/health").read()) == {"status": "ok"}
    text = urllib.request.urlopen(f"{base}/metrics").read().decode()
    for name in ("specgraph_requests_total", "specgraph_generation_tokens_total", "specgraph_queue_depth",
                 "specgraph_batch_occupancy", "specgraph_depth_rounds_total", "specgraph_tokens_per_second"):
        assert name in text, name


def test_overload_429_and_cancellation(served):
    model, tok, engine, live = served
    ac = openai.AsyncOpenAI(base_url=live.url, api_key="none", max_retries=0)

    async def flood():
        # 4 rows + 8 queued fit; the rest are refused at once
        reqs = [ac.completions.create(model="tiny", prompt="abc" * 10, max_tokens=200, temperature=0,
                                      extra_body={"ignore_eos": True}) for _ in range(16)]
        return await asyncio.gather(*reqs, return_exceptions=True)

    out = asyncio.run(flood())
    limited = [r for r in out if isinstance(r, openai.RateLimitError)]
    ok = [r for r in out if not isinstance(r, Exception)]
    assert limited and ok and len(limited) + len(ok) == 16
    assert all(len(r.choices[0].model_extra["token_ids"]) == 200 for r in ok)

    # a streaming client that goes away frees its row
    async def leave_early():
        ac = openai.AsyncOpenAI(base_url=live.url, api_key="none", max_retries=0)
        stream = await ac.completions.create(model="tiny", prompt="abc", max_tokens=400, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()

    before = engine.stats.finished["cancelled"]
    asyncio.run(leave_early())
    t0 = time.time()
    while engine.stats.finished["cancelled"] == before and time.time() - t0 < 30:
        time.sleep(0.05)
    assert engine.stats.finished["cancelled"] > before
    t0 = time.time()
    while engine.occupancy and time.time() - t0 < 30:
        time.sleep(0.05)
    assert engine.occupancy == 0


def test_shutdown_with_requests_in_flight(char_tokenizer):
    """Stopping the server while requests run: each gets a full response or an error, none hangs."""
    model = tiny_model()
    # eager rounds: a compile still running in the scheduler thread would outlive the test
    fast = specgraph.compile(model, None, max_batch_size=2, max_seq_len=512, backend="eager")
    engine = ServingEngine(fast, max_queue=8)
    live = Live(create_app(engine, char_tokenizer(), "tiny"))
    ac = openai.AsyncOpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)

    stopper = threading.Thread(target=live.stop)

    async def run():
        reqs = [asyncio.create_task(ac.completions.create(model="tiny", prompt="abc", max_tokens=300, temperature=0,
                                                          extra_body={"ignore_eos": True})) for _ in range(5)]
        await asyncio.sleep(1.0)
        stopper.start()
        return await asyncio.wait_for(asyncio.gather(*reqs, return_exceptions=True), 90)

    out = asyncio.run(run())
    stopper.join(60)
    assert len(out) == 5
    for r in out:
        assert isinstance(r, Exception) or len(r.choices[0].model_extra["token_ids"]) == 300
    assert not engine.running  # the scheduler thread ended with the server
