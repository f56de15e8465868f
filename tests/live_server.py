"""A live `specgraph serve` app for tests: uvicorn on a free loopback port, in a thread, and the
tiny model, chat template and greedy reference the server tests share."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import torch
import uvicorn

from tiny_models import tiny_causal_lm

EOS = 2  # the character tokenizer's </s>
CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_model():
    return tiny_causal_lm(eos=EOS)


class Live:
    """A server on a free loopback port, run by uvicorn in a thread."""

    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            assert time.time() - t0 < 60, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def eager_engine(char_tokenizer, *, max_seq_len: int = 512, **engine_kw):
    """(model, tokenizer, engine): the tiny model compiled with prompt lookup on eager rounds (the
    server tests test the server; the engine on compiled graphs is served in test_engine and
    test_serve_dir), the character tokenizer with :data:`CHAT`, and a warmed-up engine of 4 rows."""
    import specgraph
    from specgraph.serving import ServingEngine

    model = tiny_model()
    tok = char_tokenizer()
    tok.chat_template = CHAT
    fast = specgraph.compile(model, "ngram", max_batch_size=4, max_seq_len=max_seq_len, backend="eager")
    engine = ServingEngine(fast, max_queue=8, prefill_chunk=16, **engine_kw)
    engine.warmup(progress=False)
    return model, tok, engine


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    return out


def greedy_choices(live, prompts, max_tokens, model="tiny"):
    """The first choice of a greedy completion of each prompt, all sent at once to ``live`` (which
    serves ``model``)."""
    import openai

    client = openai.AsyncOpenAI(base_url=live.url, api_key="none", max_retries=0)

    async def one(p):
        r = await client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0)
        return r.choices[0]

    async def all_():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(all_())
