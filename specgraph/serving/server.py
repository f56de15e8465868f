"""The OpenAI-compatible HTTP server over a :class:`~specgraph.serving.engine.ServingEngine`
(FastAPI + uvicorn; ``pip install 'specgraph[serve]'``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat
template), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).
Requests carry OpenAI's fields: ``max_tokens`` (chat: also ``max_completion_tokens``),
``temperature`` (0 = greedy, the output ``model.generate`` gives), ``seed``, ``stop``,
``logprobs`` (chat: ``logprobs`` + ``top_logprobs``), ``stream`` (server-sent events), plus
vLLM's ``ignore_eos``. The sampling filters (top-k / top-p / min-p) are compiled into the
sampling graphs: a request may repeat them (``top_p``, ``top_k``, ``min_p`` equal to the
server's) but not change them. Settings the engine cannot honour exactly (``n`` > 1,
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``echo``, ``best_of``, ``suffix``,
tools) are refused with a 400 naming them; fields without effect on the output (``user``,
``store``, ``metadata``, ``service_tier``, ``parallel_tool_calls``, ``stream_options``) are
accepted whatever their value. ``model`` may be left out; another model's name is a 404
(``model_not_found``). A full queue answers 429, a request past ``request_timeout`` 504, a
stopping server 503. A client that disconnects frees its row within a round. Each choice also
carries ``token_ids``: the generated token ids.

Hostile clients (:mod:`specgraph.serving.guard` checks the first two on every request):

- the Host header must name an allowed host (400 ``invalid_host``; DNS rebinding);
- with an API key, every route needs ``Authorization: Bearer <key>`` (401; the ``/v1`` routes,
  FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json``) but ``/health`` and ``/metrics``, which
  stay open, wherever the app is mounted;
- a POST must be ``Content-Type: application/json`` (415: a cross-site form or ``fetch`` cannot
  send it without the browser asking first);
- a body past ``max_body_bytes`` is a 413 before it is read, a prompt (or messages' text: their
  strings, and the JSON text of any other value a template may print) past ``max_prompt_chars``
  a 400 (``context_length_exceeded``) before it is tokenized;
- parsing, tokenizing and the chat template run in a worker thread, not on the event loop;
- any error in a client's input (its JSON, a template that fails on its messages, text the
  tokenizer cannot take) is a 400 with OpenAI's error body; a fault of the server's is a 500
  with the same body.

Nothing here encrypts: serve on loopback (the default), or behind a TLS proxy.
"""

import asyncio
import collections
import contextlib
import json
import math
import time
import uuid

from specgraph.serving.engine import EngineStopped, Event, QueueFull, ServeRequest, ServingEngine
from specgraph.serving.guard import LOCAL_HOSTS, Guard, checked_api_key, error_body, error_bytes
from specgraph.serving.text import TextTracker

REQUEST_TIMEOUT = 600.0  # seconds from arrival to the last token
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default
# a prompt (or the messages' text) of more characters than this many per token of max_seq_len is
# refused before it is tokenized: no tokenizer makes tokens of 32 characters on average, so such
# a prompt could not fit anyway, and tokenizing it would only cost time
PROMPT_CHARS_PER_TOKEN = 32
BODY_BYTES_PER_CHAR = 8  # a body may spell each prompt character as a JSON escape (6 bytes: \uXXXX) ...
BODY_EXTRA_BYTES = 1 << 20  # ... plus the other fields
MAX_STOPS = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 1000  # each round looks for the stop strings in this many characters before its new text


def _client_errors() -> tuple[type[BaseException], ...]:
    """What a request's values can make parsing raise: wrong types and values (the tokenizer's
    errors among them: a lone surrogate is a TypeError), deep nesting, numbers too large for a
    float, and the chat template's errors."""
    errors = (ValueError, TypeError, LookupError, ArithmeticError, RecursionError)
    try:
        from jinja2 import TemplateError
    except ImportError:  # no chat templates without jinja2
        return errors
    return (*errors, TemplateError)


CLIENT_ERRORS = _client_errors()

# fields that do not change the output: accepted and ignored, whatever their value
IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls", "stream_options"}
# fields whose neutral values (what OpenAI clients send by default) the engine honours as sent;
# other values would change the output law and are refused
NEUTRAL = {"n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "echo": (False,),
           "logit_bias": ({},), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
           "response_format": ({"type": "text"},)}


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def _is_neutral(value, neutrals: tuple) -> bool:
    """Whether ``value`` is None or one of ``neutrals``, of the same JSON type (``true`` is not 1,
    ``0`` is not ``false``)."""
    def kind(v):
        return "bool" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else type(v).__name__
    return value is None or any(kind(value) == kind(n) and value == n for n in neutrals)


def _flag(body: dict, name: str) -> bool:
    """A boolean field (absent or null: false)."""
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(400, f"{name} must be a boolean, got {v!r}", param=name)
    return v


def _rendered_chars(x) -> int:
    """About the most characters a chat template renders from a JSON value: a string's length,
    an object's keys and values, and for any other value (a list, a number) the length of its
    JSON text, about what a template that prints it renders (``[1, 2]``)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, dict):
        return sum(len(k) + _rendered_chars(v) for k, v in x.items())
    return len(json.dumps(x, ensure_ascii=False))


FILTER_HINT = "start it with {flag} {value}"  # a server of a model: the filters are serve flags
DIR_FILTER_HINT = "compile the directory again with {flag} {value}"  # a compiled directory bakes them


class OpenAIServer:
    """Request parsing, generation and response shapes; :func:`create_app` mounts it on FastAPI."""

    def __init__(self, engine: ServingEngine, tokenizer, model_name: str, *, request_timeout: float = REQUEST_TIMEOUT,
                 filter_hint: str = FILTER_HINT, max_prompt_chars: int | None = None):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.request_timeout = request_timeout
        # longest prompt string, or total text of a request's messages, that is tokenized
        self.max_prompt_chars = (max_prompt_chars if max_prompt_chars is not None
                                 else PROMPT_CHARS_PER_TOKEN * engine.fast.max_seq_len)
        self.filter_hint = filter_hint  # how to serve another top-k / top-p / min-p: {flag} {value}
        gc = engine.fast.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else tokenizer.eos_token_id
        self.eos = tuple([eos] if isinstance(eos, int) else (eos or []))
        self.ttft: collections.deque[float] = collections.deque(maxlen=1000)  # arrival to first token, per request

    # ------------------------------------------------------------------------------------------
    # parsing

    def _check_fields(self, body: dict, allowed: set[str]) -> None:
        for name, value in body.items():
            if name in allowed or name in IGNORED:
                continue
            if name in NEUTRAL:
                if _is_neutral(value, NEUTRAL[name]):
                    continue
                only = " or ".join(repr(v) for v in NEUTRAL[name])
                raise RequestError(400, f"{name}={value!r} is not supported by specgraph serve "
                                        f"(only {only}): it would change the output law", param=name)
            raise RequestError(400, f"unknown field {name!r}", param=name)

    def _check_model(self, body: dict) -> None:
        """``model`` names the served model. It may be left out (OpenAI requires it; one model is
        served, so there is nothing to choose)."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(400, f"model must be a string, got {model!r}", param="model")
        if model is not None and model != self.model_name:
            raise RequestError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                               param="model", code="model_not_found")

    def _check_prompt_chars(self, n: int, param: str) -> None:
        if n > self.max_prompt_chars:
            raise RequestError(400, f"the {param} has {n} characters; this server tokenizes at most "
                                    f"{self.max_prompt_chars} (max_seq_len={self.engine.fast.max_seq_len} tokens)",
                               param=param, code="context_length_exceeded")

    def _sampling(self, body: dict) -> tuple[float, int | None]:
        t = body.get("temperature")
        t = 1.0 if t is None else t  # OpenAI's default
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise RequestError(400, f"temperature must be a number >= 0, got {t!r}", param="temperature")
        baked = self.engine.sampling
        for name, want, neutral in (("top_p", baked.top_p, 1.0), ("top_k", baked.top_k, -1), ("min_p", baked.min_p, 0.0)):
            got = body.get(name)
            if got is None or (float(t) == 0.0):
                continue
            same = got == want or (want is None and got in (neutral, 0 if name == "top_k" else neutral))
            if not same:
                hint = self.filter_hint.format(flag="--" + name.replace("_", "-"), value=got)
                raise RequestError(400, f"{name}={got!r}: this server's sampling graphs are compiled with {name}="
                                        f"{want!r}; {hint} to serve that", param=name)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError(400, f"seed must be an integer, got {seed!r}", param="seed")
        return float(t), (None if seed is None else seed % (1 << 63))

    def _stop(self, body: dict) -> list[str]:
        stop = body.get("stop")
        if stop is None:
            return []
        stop = [stop] if isinstance(stop, str) else stop
        if (not isinstance(stop, list) or len(stop) > MAX_STOPS
                or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stop)):
            raise RequestError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings, each of at "
                                    f"most {MAX_STOP_CHARS} characters", param="stop")
        return stop

    def _max_tokens(self, body: dict, names: tuple[str, ...], prompt_len: int) -> int:
        for name in names:
            v = body.get(name)
            if v is not None:
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise RequestError(400, f"{name} must be a positive integer, got {v!r}", param=name)
                return v
        if names[0] == "max_tokens" and "messages" not in body:
            return DEFAULT_MAX_TOKENS
        # chat without a limit: as long as the context allows
        return max(1, self.engine.fast.max_seq_len - prompt_len - self.engine.K - 1)

    def completion_prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            self._check_prompt_chars(len(p), "prompt")
            try:
                return self.tok(p, add_special_tokens=True).input_ids
            except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take (a lone surrogate) is the client's
                raise RequestError(400, f"the prompt cannot be tokenized: {type(e).__name__}: {e}",
                                   param="prompt") from e
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise RequestError(400, "prompt must be a string, a list of token ids, or a list holding one of them "
                                "(one prompt per request)", param="prompt")

    def chat_prompt(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise RequestError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
        if not getattr(self.tok, "chat_template", None):
            raise RequestError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
        self._check_prompt_chars(sum(_rendered_chars(m) for m in msgs), "messages")
        try:
            out = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001 - the template's error on these messages (or their text's)
            raise RequestError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                               param="messages") from e
        ids = out["input_ids"] if not isinstance(out, list) else out
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def build(self, body: dict, chat: bool) -> tuple[ServeRequest, TextTracker, int | None]:
        common = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                  "min_p", "seed", "stop", "stream", "logprobs", "top_logprobs", "ignore_eos"}
        self._check_fields(body, common)
        self._check_model(body)
        _flag(body, "stream")
        ignore_eos = _flag(body, "ignore_eos")
        ids = self.chat_prompt(body) if chat else self.completion_prompt(body)
        temperature, seed = self._sampling(body)
        stop = self._stop(body)
        n_top = None
        if chat:
            if _flag(body, "logprobs"):
                n_top = body.get("top_logprobs") or 0
        elif body.get("logprobs") is not None:
            n_top = body["logprobs"]
        if n_top is not None and (not isinstance(n_top, int) or isinstance(n_top, bool) or n_top < 0):
            raise RequestError(400, f"logprobs must be an integer >= 0, got {n_top!r}", param="logprobs")
        text = TextTracker(self.tok, stop)
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        req = ServeRequest(ids, self._max_tokens(body, names, len(ids)), temperature, seed,
                           eos=() if ignore_eos else self.eos, stop=text.stop_cut if stop else None,
                           logprobs=n_top)
        return req, text, n_top

    async def parse(self, body: dict, chat: bool) -> tuple[ServeRequest, TextTracker, int | None]:
        """:meth:`build` in a worker thread: tokenizing a long prompt, or rendering a chat
        template, does not hold up the event loop (other requests' streams, /health). Client input
        that fails in a way :meth:`build` does not name (``CLIENT_ERRORS``) is still the client's:
        a 400; any other exception is a fault of the server's (500)."""
        try:
            return await asyncio.to_thread(self.build, body, chat)
        except RequestError:
            raise
        except CLIENT_ERRORS as e:
            raise RequestError(400, f"the request cannot be read: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------------------------------
    # generation

    async def events(self, req: ServeRequest, is_disconnected=None):
        """Submit ``req`` and yield its :class:`Event` s; cancels it when the consumer goes away
        (a client that disconnected, checked at each event and every 0.5 s between them; a
        timeout)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        arrived = time.perf_counter()
        try:
            handle = self.engine.submit(req, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        except QueueFull as e:
            raise RequestError(429, f"server busy: {e}; retry later", kind="rate_limit_error") from e
        except EngineStopped as e:
            raise RequestError(503, str(e), kind="server_error") from e
        except ValueError as e:
            raise RequestError(400, str(e)) from e
        deadline = arrived + self.request_timeout
        done = False
        try:
            first = True
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise RequestError(504, f"the request took longer than {self.request_timeout:g} s", kind="timeout")
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=min(left, 0.5))
                except asyncio.TimeoutError:
                    ev = None
                # at every event too: a non-streaming client's tokens flow without reaching it, and
                # its row would run to max_tokens after it has gone
                if is_disconnected is not None and await is_disconnected():
                    return
                if ev is None:
                    continue
                if first and ev.tokens:
                    first = False
                    self.ttft.append(time.perf_counter() - arrived)
                if ev.error is not None:
                    done = True
                    raise RequestError(503, ev.error, kind="server_error")
                done = ev.finish is not None
                yield ev
                if done:
                    return
        finally:
            if not done:
                handle.cancel()

    # ------------------------------------------------------------------------------------------
    # responses

    def _logprobs_completion(self, ids, lps, offset0: int) -> dict:
        toks = [self.tok.decode([t]) for t in ids]
        offsets, o = [], offset0
        for s in toks:
            offsets.append(o)
            o += len(s)
        return {"tokens": toks, "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{self.tok.decode([i]): v for i, v in top} for _, top in lps], "text_offset": offsets}

    def _logprobs_chat(self, ids, lps) -> dict:
        def entry(t, lp):
            s = self.tok.decode([t])
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]} for t, (lp, top) in zip(ids, lps)]}

    async def complete(self, body: dict, chat: bool, is_disconnected=None) -> dict:
        req, text, n_top = await self.parse(body, chat)
        ids, lps, finish = [], [], None
        async for ev in self.events(req, is_disconnected):
            ids += ev.tokens
            lps += ev.logprobs or []
            finish = ev.finish
        if finish is None:  # disconnected: nobody reads this
            return {}
        out = text.final_text(ids, finish == "stop")
        usage = {"prompt_tokens": len(req.prompt), "completion_tokens": len(ids),
                 "total_tokens": len(req.prompt) + len(ids)}
        rid, created = uuid.uuid4().hex, int(time.time())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": finish,
                      "logprobs": self._logprobs_chat(ids, lps) if n_top is not None else None, "token_ids": ids}
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": out, "finish_reason": finish, "token_ids": ids,
                  "logprobs": self._logprobs_completion(ids, lps, 0) if n_top is not None else None}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [choice], "usage": usage}

    async def stream(self, body: dict, chat: bool, is_disconnected=None):
        """Server-sent events: one chunk per round that released text, then ``[DONE]``. Errors
        after the first chunk are sent as an ``error`` event (the status line is gone by then)."""
        req, text, n_top = await self.parse(body, chat)
        rid, created = uuid.uuid4().hex, int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": obj, "created": created,
                "model": self.model_name}
        opts = body.get("stream_options") or {}
        usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
        events = self.events(req, is_disconnected)
        try:
            first = await events.__anext__()  # 400 / 429 / 503 surface before the stream starts
        except StopAsyncIteration:
            return _empty()

        async def gen():
            ids, ev, sent_role, offset = [], first, False, 0
            try:
                while True:
                    ids += ev.tokens
                    delta = text.delta(ids, ev.finish is not None)
                    choice = {"index": 0, "finish_reason": ev.finish, "token_ids": ev.tokens}
                    if chat:
                        d = {"content": delta}
                        if not sent_role:
                            d, sent_role = {"role": "assistant", **d}, True
                        choice["delta"] = d
                        if n_top is not None:
                            choice["logprobs"] = self._logprobs_chat(ev.tokens, ev.logprobs or [])
                    else:
                        choice["text"] = delta
                        if n_top is not None:
                            choice["logprobs"] = self._logprobs_completion(ev.tokens, ev.logprobs or [], offset)
                    offset += len(delta)
                    if delta or ev.finish is not None or n_top is not None:
                        yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
                    if ev.finish is not None:
                        break
                    ev = await events.__anext__()
            except RequestError as e:
                yield f"data: {json.dumps(error_body(e.message, e.kind, e.param, e.code))}\n\n"
            except StopAsyncIteration:
                return
            finally:
                await events.aclose()
            if usage:  # OpenAI's last chunk with stream_options.include_usage: no choices, the counts
                counts = {"prompt_tokens": len(req.prompt), "completion_tokens": len(ids),
                          "total_tokens": len(req.prompt) + len(ids)}
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': counts})}\n\n"
            yield "data: [DONE]\n\n"
        return gen()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "specgraph", "max_model_len": self.engine.fast.max_seq_len}]}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def _empty():
    if False:
        yield ""


def metrics_text(server: OpenAIServer) -> bytes:
    """The engine's counters in the Prometheus text format (prometheus_client)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    eng, st = server.engine, server.engine.stats

    def plain():
        """(family class, name, help, value) of the metrics without labels."""
        yield CounterMetricFamily, "specgraph_requests", "requests accepted into the queue", st.requests
        yield CounterMetricFamily, "specgraph_generation_tokens", "tokens generated", st.tokens
        yield CounterMetricFamily, "specgraph_prompt_tokens", "prompt tokens computed by prefill", st.prefill_tokens
        yield (CounterMetricFamily, "specgraph_prefix_cache_tokens", "prompt tokens copied from the prefix cache",
               st.prefix_tokens)
        yield (GaugeMetricFamily, "specgraph_prefix_cache_blocks", "prompt blocks held by the prefix cache",
               eng.prefix.used if eng.prefix is not None else 0)
        yield CounterMetricFamily, "specgraph_rounds", "rounds run", st.rounds
        yield (GaugeMetricFamily, "specgraph_tokens_per_second", "tokens generated per second over the last 10 s",
               st.tokens_per_second())
        yield GaugeMetricFamily, "specgraph_queue_depth", "requests waiting for a row", eng.queue_depth
        yield GaugeMetricFamily, "specgraph_batch_occupancy", "rows in use (decoding or being prefilled)", eng.occupancy
        yield (GaugeMetricFamily, "specgraph_batch_occupancy_mean", "decoding rows per round, averaged over all rounds",
               st.occupancy_sum / st.rounds if st.rounds else 0.0)
        yield GaugeMetricFamily, "specgraph_max_batch_size", "rows the engine holds", eng.B

    class Collector:
        def collect(self):
            for family, name, doc, value in plain():
                m = family(name, doc)
                m.add_metric([], value)
                yield m
            f = CounterMetricFamily("specgraph_requests_finished", "requests finished, by reason", labels=["reason"])
            for reason, n in sorted(st.finished.items()):
                f.add_metric([reason], n)
            yield f
            d = CounterMetricFamily("specgraph_depth_rounds", "rounds run at each speculation depth (0 = plain)",
                                    labels=["depth"])
            for k, n in sorted(st.depth_rounds.items()):
                d.add_metric([str(k)], n)
            yield d
            a = GaugeMetricFamily("specgraph_acceptance", "fraction of drafts accepted at each drafted position "
                                  "(among drafts that reached it)", labels=["position"])
            for j, n in sorted(st.drafted.items()):
                a.add_metric([str(j)], st.accepted[j] / n if n else 0.0)
            yield a
            if server.ttft:
                ts = sorted(server.ttft)
                tt = GaugeMetricFamily("specgraph_time_to_first_token_seconds", "time to first token over the last "
                                       "1000 requests", labels=["quantile"])
                for q_ in (0.5, 0.9, 0.99):
                    tt.add_metric([str(q_)], ts[min(len(ts) - 1, int(q_ * len(ts)))])
                yield tt

    reg = CollectorRegistry()
    reg.register(Collector())
    return generate_latest(reg)


def create_app(engine: ServingEngine, tokenizer, model_name: str, *, request_timeout: float = REQUEST_TIMEOUT,
               filter_hint: str = FILTER_HINT, api_key: str | None = None, allowed_hosts=LOCAL_HOSTS,
               max_prompt_chars: int | None = None, max_body_bytes: int | None = None):
    """The FastAPI app. Its lifespan starts the engine's scheduler and, at shutdown, stops it:
    requests still queued or running then get an error (503), none hangs. ``filter_hint``: what a
    400 for an unserved top-k / top-p / min-p tells the client to do ({flag}, {value}).

    ``api_key``: the key every route but ``/health`` and ``/metrics`` requires
    (``Authorization: Bearer``), None for none; an empty string is an error (ValueError).
    ``allowed_hosts``: the host names the Host header may carry (any port; None: any host); the
    default is the loopback names. ``max_prompt_chars``: the longest prompt string (or total
    text of the messages) tokenized; default ``PROMPT_CHARS_PER_TOKEN`` per token of
    ``max_seq_len``. ``max_body_bytes``: the largest request body read; default
    ``BODY_BYTES_PER_CHAR`` bytes per prompt character plus ``BODY_EXTRA_BYTES``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    checked_api_key(api_key)  # now, not at the first request (Starlette builds middleware then)
    server = OpenAIServer(engine, tokenizer, model_name, request_timeout=request_timeout, filter_hint=filter_hint,
                          max_prompt_chars=max_prompt_chars)
    if max_body_bytes is None:
        max_body_bytes = BODY_BYTES_PER_CHAR * server.max_prompt_chars + BODY_EXTRA_BYTES

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="specgraph", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Guard, hosts=allowed_hosts, api_key=api_key)

    def error(e: RequestError):
        return Response(error_bytes(e.message, e.kind, e.param, e.code), status_code=e.status,
                        media_type="application/json")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes, wrong methods
        return Response(error_bytes(str(e.detail), code=str(e.status_code)), status_code=e.status_code,
                        headers=e.headers, media_type="application/json")

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):  # a fault of the server's, not the request's
        return Response(error_bytes(f"internal error: {type(e).__name__}", kind="server_error"), status_code=500,
                        media_type="application/json")

    async def read_body(request: Request) -> bytes:
        """The body, refused (413) past ``max_body_bytes`` before more of it is read; a
        Content-Length that is not ASCII digits is a 400 (``"²".isdigit()`` holds)."""
        too_big = RequestError(413, f"the request body is larger than this server reads ({max_body_bytes} bytes)",
                               code="request_too_large")
        size = request.headers.get("content-length")
        if size is not None and not (size.isascii() and size.isdigit()):
            raise RequestError(400, f"the Content-Length header {size!r} is not a number", param="Content-Length")
        if size is not None and int(size) > max_body_bytes:
            raise too_big
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > max_body_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def body_of(request: Request) -> dict:
        """The JSON object of a POST: ``Content-Type: application/json`` only (415 otherwise: a
        browser sends a cross-site POST without asking the server first only for the form and
        text types)."""
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise RequestError(415, f"the body must be sent as Content-Type: application/json, not {ctype!r}",
                               param="Content-Type", code="unsupported_media_type")
        raw = await read_body(request)
        try:
            body = await asyncio.to_thread(json.loads, raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise RequestError(400, f"the body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        return body

    async def handle(request: Request, chat: bool):
        try:
            body = await body_of(request)
            if _flag(body, "stream"):
                gen = await server.stream(body, chat, request.is_disconnected)
                return StreamingResponse(gen, media_type="text/event-stream")
            out = await server.complete(body, chat, request.is_disconnected)
            return JSONResponse(out)
        except RequestError as e:
            return error(e)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        ok = engine.running
        return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics_text(server), media_type=CONTENT_TYPE_LATEST)

    return app


__all__ = ["create_app", "OpenAIServer", "RequestError", "metrics_text", "REQUEST_TIMEOUT"]
