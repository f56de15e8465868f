"""Training EAGLE / Medusa drafter heads by self-distillation (``specgraph train-drafter``).

Data: text from Python's standard library only — the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (tests, site-packages, the ``encodings`` charmap tables and
``pydoc_data`` excluded) and the ``pydoc_data.topics.topics`` documentation — both present on
every Python install.

Self-distillation, and why it is mostly teacher-forced. The drafter must predict what the *target*
would emit, so every label is the target's own: its greedy token (argmax, cached) and its
distribution over the draft vocabulary (recomputed exactly from the cached final features, since
the LM head is frozen and shared). The question is which *contexts* to use. Letting the target
write its own answers gives exactly the contexts met at inference, but it is expensive here:
on a shared 2-core CPU (SmolLM2-135M, fp32, about one core effectively free), a
teacher-forced pass caches ~80 tokens/s (130 per CPU-second), while batched greedy generation
(HF ``generate``, 16 prompts) decodes ~15 tokens/s, i.e. ~5x more per answer token before its
prompt and the feature pass are paid. Generating everything would leave ~15k answer tokens in the
hour, too few for a 4M-weight head, so:

* most tokens (``1 - gen_share`` of the data time) are teacher-forced: a stdlib chunk is put in the
  target's chat format as the assistant's turn after a short request ("Show the source of ...",
  "Explain the Python topic ..."), the target reads it once, and its features + greedy labels at
  every position are cached (the target's greedy token equals the text's next token ~60% of the
  time; the labels are always the target's);
* ``gen_share`` of the data time (20% by default) goes to answers written by the target: chat
  prompts built from stdlib snippets (explain / summarize / docstring / test requests) are
  answered greedily (batched), and prompt + answer are cached the same way. These are exactly the
  sequences a greedy target produces; 20% of them are held out, so the held-out ``gen`` figures
  in ``train_log.json`` are the honest acceptance proxy.

Caching: target features ([T, H] fp16), tokens and target argmax labels go to safetensors shards
under ``cache/`` with an ``index.json`` updated atomically after every shard, so an interrupted
data phase resumes where it stopped; the cache does not depend on the head kind (``--cache`` lets an
EAGLE and a Medusa run share one).

Training (our formulation; see :mod:`specgraph.heads` for the heads):

* EAGLE: head position p reads (token_{p+1}, feature_p) and predicts feature_{p+1}. Loss = soft
  cross-entropy of the head's draft-vocabulary logits against the target's distribution at p+1
  (softmax of the same LM-head rows applied to the true feature_{p+1}) + ``feature_weight`` x
  smooth-L1 between the predicted and the true feature. ``unroll`` > 1 trains deeper drafting the
  way it runs: step j feeds the head's own step j-1 outputs back as features, in parallel over the
  sequence, attending to the step-1 keys of the real prefix and to its own chain's keys of steps
  2..j (an explicit block mask over the concatenated keys, exactly the attention a depth-j draft
  sees at inference). Uniform noise on the step-1 input features adds robustness.
* Medusa: head k (1..K) at position t: soft cross-entropy against the target's distribution at t+k
  (which predicts token t+k+1), weighted 0.8^(k-1).

AdamW, linear warm-up then cosine decay; when ``--max-steps`` is not given, the number of steps
is fixed after the first steps from the measured step time and the remaining budget (and stored,
so a resumed run follows the same schedule). Checkpoints (safetensors: head, optimizer moments,
noise-RNG state; JSON metadata: step, data position, log) every ``--checkpoint-every`` steps;
``--resume`` continues bit-for-bit. Outputs in ``--out``: ``head.safetensors`` (fp16) and
``train_log.json`` (loss curves, held-out top-1 acceptance per draft depth and a chain proxy of
tokens emitted per round).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specgraph.heads import EagleHead, MedusaHeads, model_fingerprint, save_head

CACHE_VERSION = 1
CKPT_FORMAT = "specgraph-train-checkpoint"
# tests, installed packages, charmap tables (encodings/*) and pydoc_data (its topics come in as text)
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings",
                       "pydoc_data"})
PYDOC_PREFIX = "pydoc:"
STDLIB_PREFIX = "stdlib:"


# ==============================================================================================
# documents (stdlib + pydoc only)


@dataclass(frozen=True)
class Doc:
    source: str  # "stdlib:<path relative to the stdlib root>" or "pydoc:<topic>"
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_files() -> list[Path]:
    """Sorted ``.py`` files of the standard library (no tests, no site-packages)."""
    root = stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        out += [Path(d) / f for f in files if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(out)


def pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(topics)


def documents(seed: int = 0) -> list[tuple[str, callable]]:
    """All document sources in a seeded order, as (source, loader) pairs (texts read lazily)."""
    root = stdlib_root()
    topics = pydoc_topics()
    items = [(STDLIB_PREFIX + str(p.relative_to(root)), (lambda p=p: p.read_text(encoding="utf-8")))
             for p in stdlib_files()]
    items += [(PYDOC_PREFIX + k, (lambda k=k: topics[k])) for k in sorted(topics)]
    random.Random(seed).shuffle(items)
    return items


def iter_documents(seed: int = 0):
    """Yield :class:`Doc` for every stdlib file and pydoc topic (unreadable files skipped)."""
    for source, load in documents(seed):
        try:
            text = load()
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            yield Doc(source, text)


def _module_name(source: str) -> str:
    rel = source[len(STDLIB_PREFIX):]
    name = rel[:-3].replace(os.sep, ".").replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def chunk_text(text: str, max_chars: int) -> list[str]:
    """Split at line boundaries into pieces of at most ``max_chars`` (long lines are cut)."""
    chunks, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:
            if cur:
                chunks.append("".join(cur))
                cur, n = [], 0
            chunks.append(line[:max_chars])
            line = line[max_chars:]
        if n + len(line) > max_chars and cur:
            chunks.append("".join(cur))
            cur, n = [], 0
        cur.append(line)
        n += len(line)
    if cur:
        chunks.append("".join(cur))
    return [c for c in chunks if c.strip()]


# ==============================================================================================
# examples: token sequences in the target's chat format


@dataclass
class Example:
    source: str
    ids: list[int]
    loss_start: int  # first token of the assistant's turn
    kind: int = 0  # 0 teacher-forced text, 1 generated answer


def _encode(tok, text: str) -> list[int]:
    if hasattr(tok, "__call__"):
        out = tok(text, add_special_tokens=False)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return list(tok.encode(text))


def chat_prompt_ids(tok, user: str) -> list[int]:
    """Token ids of a user turn followed by the assistant header (plain text without a template)."""
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
        return _encode(tok, text)
    return _encode(tok, user + "\n")


def chat_example_ids(tok, user: str, assistant: str) -> tuple[list[int], int]:
    """(ids, loss_start) of a user turn + assistant turn: the prompt is tokenized on its own, as at
    inference, and the assistant's text (with the template's end marker) after it."""
    prompt = chat_prompt_ids(tok, user)
    if getattr(tok, "chat_template", None):
        p_text = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
                                       tokenize=False)
        rest = full[len(p_text):] if full.startswith(p_text) else assistant
        return prompt + _encode(tok, rest), len(prompt)
    return prompt + _encode(tok, assistant), len(prompt)


_TF_CODE = ("Show the source code of the Python standard-library module `{m}`{part}.",
            "Print the implementation of `{m}` from CPython's standard library{part}.",
            "What does the code of the `{m}` module look like{part}?")
_TF_DOC = ("Explain the Python topic \"{t}\".", "What does the Python reference say about {t}?",
           "Describe {t} in Python.")
_GEN_CODE = ("Explain what this Python code does:\n```python\n{s}\n```",
             "Summarize this code in a few sentences:\n```python\n{s}\n```",
             "Write a short docstring for the following code:\n```python\n{s}\n```",
             "Suggest one improvement to this Python code and show the changed code:\n```python\n{s}\n```",
             "Write a pytest test for this code:\n```python\n{s}\n```")
_GEN_DOC = ("Summarize this part of the Python documentation:\n\n{s}",
            "Explain the following with a short code example:\n\n{s}",
            "Answer briefly: what is the key point of this text?\n\n{s}")


def _doc_chunks(doc: Doc, max_chars: int, rnd: random.Random) -> list[tuple[int, str]]:
    """(index in the document, chunk) in a seeded order."""
    chunks = list(enumerate(chunk_text(doc.text, max_chars)))
    rnd.shuffle(chunks)
    return chunks


def tf_examples(tok, seed: int = 0, max_len: int = 512, chunks_per_doc: int = 2, chars_per_token: float = 3.2):
    """Endless deterministic stream of teacher-forced examples: pass r takes chunks
    ``[r*c, (r+1)*c)`` of every document's seeded chunk order (c = ``chunks_per_doc``), so a
    time-limited run sees many documents before it sees more of any one."""
    body_chars = max(64, int((max_len - 48) * chars_per_token))
    r = 0
    while True:
        any_left = False
        for doc in iter_documents(seed + r):
            chunks = _doc_chunks(doc, body_chars, random.Random(f"{seed}:{doc.source}"))  # same order every pass
            pick = chunks[r * chunks_per_doc:(r + 1) * chunks_per_doc]
            rnd = random.Random(f"{seed}:{r}:{doc.source}")
            if not pick:
                continue
            any_left = True
            for j, chunk in pick:
                if doc.source.startswith(PYDOC_PREFIX):
                    user = rnd.choice(_TF_DOC).format(t=doc.source[len(PYDOC_PREFIX):])
                    body = chunk
                else:
                    part = f" (part {j + 1} of {len(chunks)})" if len(chunks) > 1 else ""
                    user = rnd.choice(_TF_CODE).format(m=_module_name(doc.source), part=part)
                    body = "```python\n" + chunk.rstrip("\n") + "\n```"
                ids, start = chat_example_ids(tok, user, body)
                yield Example(doc.source, ids[:max_len], min(start, max_len - 1), 0)
        if not any_left:
            return
        r += 1


def gen_prompts(tok, seed: int = 0, snippet_tokens: int = 160, chars_per_token: float = 3.2):
    """Endless deterministic stream of (source, prompt ids) for the target to answer."""
    max_chars = int(snippet_tokens * chars_per_token)
    r = 0
    while True:
        for doc in iter_documents(seed + 7919 + r):
            rnd = random.Random(f"gen:{seed}:{r}:{doc.source}")
            chunks = chunk_text(doc.text, max_chars)
            if not chunks:
                continue
            snip = rnd.choice(chunks).strip("\n")
            tmpl = _GEN_DOC if doc.source.startswith(PYDOC_PREFIX) else _GEN_CODE
            yield doc.source, chat_prompt_ids(tok, rnd.choice(tmpl).format(s=snip))
        r += 1


# ==============================================================================================
# target passes


def _pad_right(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def target_features(model, seqs: list[list[int]], pad_id: int = 0):
    """The target's final features (``hidden_states[-1]``, what :class:`specgraph.capture.Step`
    returns) and greedy labels (argmax of its logits) for each sequence: lists of [L, H], [L]."""
    dev = next(model.parameters()).device
    ids, mask = _pad_right(seqs, pad_id)
    ids, mask = ids.to(dev), mask.to(dev)
    try:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    except TypeError:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    h = out.hidden_states[-1]
    lm = model.get_output_embeddings()
    labels = torch.empty(ids.shape, dtype=torch.long, device=dev)
    for s in range(0, ids.shape[1], 256):  # full-vocab logits a slice at a time
        labels[:, s:s + 256] = lm(h[:, s:s + 256]).argmax(-1)
    feats, labs = [], []
    for i, s in enumerate(seqs):
        feats.append(h[i, : len(s)].to("cpu", torch.float16))
        labs.append(labels[i, : len(s)].to("cpu", torch.int32))
    return feats, labs


GEN_ENGINES = ("specgraph", "hf")
GEN_MAX_SEQ = 1024  # the compiled engine's cache length (at most the model's positions); longer goes to HF generate


def answer_engine(model, kind: str, batch: int):
    """What writes the generated answers: ``"hf"`` (``model.generate``, None here) or
    ``"specgraph"``: this package's compiled prompt-lookup decoder, whose greedy tokens equal
    ``model.generate``'s (the project's contract, tested); answers about a snippet quote it, which
    prompt lookup drafts. No benchmark compares its data rate with HF generate's."""
    if kind not in GEN_ENGINES:
        raise ValueError(f"--gen-engine must be one of {', '.join(GEN_ENGINES)}, got {kind!r}")
    if kind == "hf":
        return None
    import specgraph

    from specgraph.limits import resolve_max_seq_len

    return specgraph.compile(model, "ngram", num_speculative_tokens=8, max_batch_size=batch,
                             max_seq_len=resolve_max_seq_len(model, None, default=GEN_MAX_SEQ),
                             warmup=False)  # builds the shapes the data run uses


@torch.no_grad()
def generate_answers(model, prompts: list[list[int]], max_new_tokens: int, eos_id, pad_id: int,
                     engine=None) -> list[list[int]]:
    """Greedy answers of the target to a batch of prompts (left-padded; ``engine``: a compiled
    object from :func:`answer_engine`, else HF generate); each answer is cut after its first EOS."""
    dev = next(model.parameters()).device
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    if engine is not None and T + max_new_tokens <= engine.max_seq_len:
        out = engine.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                              eos_token_id=eos_id, pad_token_id=pad_id)
    else:
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_id, pad_token_id=pad_id, temperature=None, top_p=None,
                             top_k=None)
    eos = set(eos_id if isinstance(eos_id, (list, tuple)) else ([] if eos_id is None else [eos_id]))
    answers = []
    for row in out[:, T:].tolist():
        ans = []
        for t in row:
            ans.append(t)
            if t in eos:
                break
        answers.append(ans)
    return answers


# ==============================================================================================
# feature cache


def _held_out(source: str, seed: int, rate: float) -> bool:
    h = int(hashlib.sha256(f"{seed}:{source}".encode()).hexdigest()[:8], 16)
    return (h % 10000) < rate * 10000


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class FeatureCache:
    """Safetensors shards of (features, ids, labels) per example + a resume index."""

    def __init__(self, root, fingerprint: str, data_config: dict):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.index_path = self.root / "index.json"
        if self.index_path.exists():
            self.index = json.loads(self.index_path.read_text())
            if self.index.get("fingerprint") != fingerprint:
                raise ValueError(f"{self.root} caches features of another model (fingerprint "
                                 f"{self.index.get('fingerprint', '?')[:16]}..., this one {fingerprint[:16]}...); "
                                 "use another --out/--cache folder")
            if self.index.get("data_config") != data_config:
                raise ValueError(f"{self.root} was built with data settings {self.index.get('data_config')}, "
                                 f"not {data_config}; use another --out/--cache folder")
        else:
            self.index = {"version": CACHE_VERSION, "fingerprint": fingerprint, "data_config": data_config,
                          "shards": [], "tf_next": 0, "gen_next": 0, "tf_done": False, "gen_done": False,
                          "tokens": 0, "gen_tokens": 0}
            self._save_index()
        self._pending: list[tuple[Example, torch.Tensor, torch.Tensor]] = []

    def _save_index(self):
        _atomic_json(self.index_path, self.index)

    @property
    def tokens(self) -> int:
        return self.index["tokens"] + sum(len(e.ids) for e, _, _ in self._pending)

    def add(self, ex: Example, feats: torch.Tensor, labels: torch.Tensor):
        self._pending.append((ex, feats, labels))

    def flush(self, **counters):
        """Write pending examples as one shard and advance the index counters atomically."""
        from safetensors.torch import save_file

        if self._pending:
            n = len(self.index["shards"])
            name = f"shard_{n:05d}.safetensors"
            lens = [len(e.ids) for e, _, _ in self._pending]
            offsets = torch.tensor([0] + lens, dtype=torch.long).cumsum(0)
            tensors = {
                "features": torch.cat([f for _, f, _ in self._pending]).contiguous(),
                "labels": torch.cat([lb for _, _, lb in self._pending]).contiguous(),
                "ids": torch.tensor([t for e, _, _ in self._pending for t in e.ids], dtype=torch.int32),
                "offsets": offsets,
                "loss_start": torch.tensor([e.loss_start for e, _, _ in self._pending], dtype=torch.long),
                "kind": torch.tensor([e.kind for e, _, _ in self._pending], dtype=torch.int8),
            }
            sources = [e.source for e, _, _ in self._pending]
            tmp = self.root / (name + f".tmp{os.getpid()}")
            save_file(tensors, str(tmp), metadata={"sources": json.dumps(sources)})
            os.replace(tmp, self.root / name)
            toks = int(offsets[-1])
            self.index["shards"].append({"file": name, "examples": len(lens), "tokens": toks})
            self.index["tokens"] += toks
            self.index["gen_tokens"] += sum(len(e.ids) for e, _, _ in self._pending if e.kind == 1)
            self._pending = []
        self.index.update(counters)
        self._save_index()

    def load(self):
        """All cached examples: dict of concatenated tensors + per-example offsets/sources."""
        from safetensors import safe_open

        parts = {k: [] for k in ("features", "labels", "ids", "loss_start", "kind")}
        offsets, sources, base = [0], [], 0
        for sh in self.index["shards"]:
            with safe_open(str(self.root / sh["file"]), framework="pt") as f:
                for k in parts:
                    parts[k].append(f.get_tensor(k))
                off = f.get_tensor("offsets")
                sources += json.loads(f.metadata()["sources"])
            offsets += (off[1:] + base).tolist()
            base += int(off[-1])
        if not sources:
            raise ValueError(f"{self.root}: the feature cache is empty")
        data = {k: torch.cat(v) for k, v in parts.items()}
        data["offsets"] = torch.tensor(offsets, dtype=torch.long)
        data["sources"] = sources
        return data


def build_cache(model, tok, cache: FeatureCache, *, seed: int, max_len: int, max_tokens: int | None,
                deadline: float, gen_share: float, gen_new_tokens: int, gen_batch: int = 16,
                batch_tokens: int = 2048, shard_tokens: int = 16384, progress: bool = True, log=print,
                gen_engine: str = "hf"):
    """Fill the cache: generated answers for ``gen_share`` of the time (or tokens), then
    teacher-forced chunks until ``deadline`` or ``max_tokens``. Resumable through the index."""
    from tqdm.auto import tqdm

    pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else 0
    eos = getattr(tok, "eos_token_id", None)
    now = time.time()
    start_tokens = cache.tokens
    cap = max_tokens if max_tokens else None
    bar = tqdm(total=cap, initial=start_tokens, unit="tok", desc="caching target features", disable=not progress,
               dynamic_ncols=True)
    rates = {}

    # -- generated answers --
    if not cache.index["gen_done"] and gen_share > 0:
        gen_deadline = now + gen_share * max(0.0, deadline - now)
        gen_cap = None if cap is None else int(cap * gen_share)
        stream = gen_prompts(tok, seed)
        for _ in range(cache.index["gen_next"]):
            next(stream)
        t0, n0, g0 = time.time(), cache.tokens, 0
        engine = answer_engine(model, gen_engine, gen_batch)
        last = 0.0  # duration of the previous batch: do not start one that would overrun the slot
        while True:
            if time.time() + last >= gen_deadline or (gen_cap is not None and cache.index["gen_tokens"] >= gen_cap):
                break
            tb = time.time()
            batch = [next(stream) for _ in range(gen_batch)]
            answers = generate_answers(model, [p for _, p in batch], gen_new_tokens, eos, pad, engine)
            exs = [Example(s, (p + a)[:max_len], min(len(p), max_len - 1), 1) for (s, p), a in zip(batch, answers)]
            g0 += sum(len(a) for a in answers)
            feats, labs = target_features(model, [e.ids for e in exs], pad)
            for e, f, lb in zip(exs, feats, labs):
                cache.add(e, f, lb)
            cache.flush(gen_next=cache.index["gen_next"] + len(batch))
            bar.update(sum(len(e.ids) for e in exs))
            last = time.time() - tb
        cache.flush(gen_done=True)
        if g0:
            rates["generated_tokens_per_s"] = g0 / (time.time() - t0)
            rates["gen_cached_tokens_per_s"] = (cache.tokens - n0) / (time.time() - t0)

    # -- teacher-forced text --
    if not cache.index["tf_done"]:
        stream = tf_examples(tok, seed, max_len)
        for _ in range(cache.index["tf_next"]):
            next(stream, None)
        t0, n0 = time.time(), cache.tokens
        consumed = cache.index["tf_next"]
        exhausted = False
        pending_tokens = 0
        last = 0.0
        while not exhausted:
            if time.time() + last >= deadline or (cap is not None and cache.tokens >= cap):
                break
            tb = time.time()
            batch, n = [], 0
            while n < batch_tokens:
                ex = next(stream, None)
                if ex is None:
                    exhausted = True
                    break
                batch.append(ex)
                n += len(ex.ids)
            if not batch:
                break
            feats, labs = target_features(model, [e.ids for e in batch], pad)
            for e, f, lb in zip(batch, feats, labs):
                cache.add(e, f, lb)
            consumed += len(batch)
            pending_tokens += n
            bar.update(n)
            last = time.time() - tb
            if pending_tokens >= shard_tokens:
                cache.flush(tf_next=consumed)
                pending_tokens = 0
        # done only when the documents ran out: a run stopped by its deadline leaves the cache open,
        # so a later run with the same --cache (or --resume) adds to it
        cache.flush(tf_next=consumed, tf_done=exhausted)
        if cache.tokens > n0:
            rates["tf_cached_tokens_per_s"] = (cache.tokens - n0) / (time.time() - t0)
    bar.close()
    log(f"feature cache: {cache.index['tokens']} tokens ({cache.index['gen_tokens']} in generated examples) "
        f"in {len(cache.index['shards'])} shards; rates {json.dumps({k: round(v, 1) for k, v in rates.items()})}")
    return rates


# ==============================================================================================
# draft vocabulary


def build_draft_vocab(labels: torch.Tensor, vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent target labels (ties: lower id), sorted by id, and the share of
    ``labels`` they cover. Fewer distinct labels than ``size``: the rest by ascending id."""
    counts = torch.bincount(labels.long().flatten(), minlength=vocab_size).double()
    size = min(size, vocab_size)
    order = torch.argsort(-counts * (vocab_size + 1) + torch.arange(vocab_size, dtype=torch.double), stable=True)
    d2t = torch.sort(order[:size]).values
    cover = float(counts[d2t].sum() / counts.sum().clamp_min(1))
    return d2t, cover


# ==============================================================================================
# training


@dataclass
class TrainConfig:
    kind: str = "eagle"
    seed: int = 0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_tokens: int = 1024
    unroll: int = 2  # EAGLE: drafting depths trained (1 = plain teacher forcing)
    feature_weight: float = 1.0
    noise: float = 0.05  # EAGLE: uniform noise amplitude on step-1 input features, x feature RMS
    medusa_decay: float = 0.8
    eval_depth: int = 4  # EAGLE: depths measured on the held-out split
    eval_tokens: int = 4096
    checkpoint_every: int = 50
    max_steps: int | None = None
    holdout: float = 0.03  # held-out share of the teacher-forced documents
    holdout_gen: float = 0.2  # and of the generated answers (their acceptance is the honest proxy)


class Batches:
    """Deterministic epochs of token-budgeted batches over the training examples."""

    def __init__(self, lengths: list[int], indices: list[int], batch_tokens: int, seed: int):
        self.lengths, self.indices, self.batch_tokens, self.seed = lengths, indices, batch_tokens, seed

    def epoch(self, e: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 100003 + e)
        perm = [self.indices[i] for i in torch.randperm(len(self.indices), generator=g).tolist()]
        out, cur, n = [], [], 0
        for i in perm:
            if cur and n + self.lengths[i] > self.batch_tokens:
                out.append(cur)
                cur, n = [], 0
            cur.append(i)
            n += self.lengths[i]
        if cur:
            out.append(cur)
        return out


def collate(data, idx: list[int], device) -> dict:
    off = data["offsets"]
    lens = [int(off[i + 1] - off[i]) for i in idx]
    L = max(lens)
    H = data["features"].shape[1]
    B = len(idx)
    feats = torch.zeros(B, L, H, dtype=torch.float32)
    ids = torch.zeros(B, L, dtype=torch.long)
    labels = torch.zeros(B, L, dtype=torch.long)
    for b, i in enumerate(idx):
        s, e = int(off[i]), int(off[i + 1])
        feats[b, : e - s] = data["features"][s:e].float()
        ids[b, : e - s] = data["ids"][s:e].long()
        labels[b, : e - s] = data["labels"][s:e].long()
    return dict(features=feats.to(device), ids=ids.to(device), labels=labels.to(device),
                lengths=torch.tensor(lens, device=device),
                loss_start=data["loss_start"][idx].to(device), kind=data["kind"][idx].to(device))


def _unroll_mask(Lp: int, j: int, device) -> torch.Tensor:
    """Additive mask [1, 1, Lp, j*Lp] for step-j queries over the keys of steps 1..j.

    The depth-j draft at position p belongs to the chain whose depth-1 node is at r = p-j+1: it
    sees step-1 keys at positions <= r (the real prefix + the chain's first node) and the step-i
    key at position r+i-1 (i = 2..j, the chain's deeper nodes, itself last)."""
    p = torch.arange(Lp, device=device).view(Lp, 1)
    q = torch.arange(Lp, device=device).view(1, Lp)
    blocks = [q <= p - j + 1] + [q == p - j + i for i in range(2, j + 1)]
    vis = torch.cat(blocks, dim=1)
    zero = torch.zeros((), device=device)
    return torch.where(vis, zero, float("-inf")).view(1, 1, Lp, j * Lp)


def eagle_forward(head: EagleHead, batch: dict, depth: int, noise: float = 0.0, gen: torch.Generator | None = None):
    """Unrolled EAGLE drafting over a batch. Returns per depth j (1..depth): head logits, predicted
    features [B, Lp, H] and validity [B, Lp] (query p = 0..L-2 predicts feature p+1)."""
    f = batch["features"]
    B, L, H = f.shape
    Lp = L - 1
    dev = f.device
    tok_in = batch["ids"][:, 1:]
    feat_in = f[:, :-1]
    if noise > 0:
        rms = feat_in.pow(2).mean(-1, keepdim=True).sqrt()
        u = torch.rand(feat_in.shape, generator=gen, device="cpu").to(dev) * 2 - 1
        feat_in = feat_in + noise * rms * u
    pos = torch.arange(Lp, device=dev).expand(B, Lp)
    valid = pos < (batch["lengths"] - 1).unsqueeze(1)
    outs, ks, vs = [], [], []
    prev = None
    for j in range(1, depth + 1):
        fin = feat_in if j == 1 else torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        past_k = torch.cat(ks, dim=2) if ks else None
        past_v = torch.cat(vs, dim=2) if vs else None
        out, k, v = head.forward_seq(tok_in, fin, pos, _unroll_mask(Lp, j, dev), past_k, past_v)
        ks.append(k)
        vs.append(v)
        outs.append((out, valid & (pos >= j - 1)))
        prev = out
    return outs


def eagle_loss(head: EagleHead, batch: dict, cfg: TrainConfig, gen=None, depth=None, metrics=False):
    depth = depth or cfg.unroll
    f_tgt = batch["features"][:, 1:]
    y_tgt = batch["labels"][:, 1:]
    with torch.no_grad():
        t_logp = torch.log_softmax(head.logits(f_tgt).float(), dim=-1)
        teacher = t_logp.exp()
        t_ent = -(teacher * t_logp).sum(-1)  # CE - entropy = KL, logged
    outs = eagle_forward(head, batch, depth, cfg.noise if head.training else 0.0, gen)
    total, parts, matches = 0.0, [], []
    for j, (out, valid) in enumerate(outs, start=1):
        logits = head.logits(out).float()
        ce = -(teacher * torch.log_softmax(logits, dim=-1)).sum(-1)
        fl = nn.functional.smooth_l1_loss(out.float(), f_tgt, reduction="none").mean(-1)
        w = valid.float()
        denom = w.sum().clamp_min(1)
        lj = ((ce + cfg.feature_weight * fl) * w).sum() / denom
        total = total + lj
        parts.append({"ce": round(float((ce.detach() * w).sum() / denom), 5),
                      "kl": round(float(((ce.detach() - t_ent) * w).sum() / denom), 5),
                      "feat": round(float((fl.detach() * w).sum() / denom), 5)})
        if metrics:
            top = logits.topk(min(4, logits.shape[-1]), dim=-1).indices
            d2t = head.d2t
            matches.append(((d2t[top[..., 0]] == y_tgt) & valid, (d2t[top] == y_tgt.unsqueeze(-1)).any(-1) & valid, valid))
    return total / len(outs), parts, matches


def medusa_loss(heads: MedusaHeads, batch: dict, cfg: TrainConfig, metrics=False):
    f = batch["features"]
    B, L, H = f.shape
    y = batch["labels"]
    t = torch.arange(L, device=f.device).expand(B, L)
    with torch.no_grad():
        t_logp = torch.log_softmax(heads.logits(f).float(), dim=-1)  # [B, L, Vd], target dist at each position
        teacher = t_logp.exp()
        t_ent = -(teacher * t_logp).sum(-1)
    out = heads(f)  # [B, L, K, H]
    total, wsum, parts, matches = 0.0, 0.0, [], []
    for k in range(1, heads.num_heads + 1):
        if L - k <= 0:
            break
        logits = heads.logits(out[:, : L - k, k - 1]).float()
        valid = (t[:, : L - k] + k) < batch["lengths"].unsqueeze(1)
        ce = -(teacher[:, k:] * torch.log_softmax(logits, dim=-1)).sum(-1)
        w = valid.float()
        lk = (ce * w).sum() / w.sum().clamp_min(1)
        wk = cfg.medusa_decay ** (k - 1)
        total, wsum = total + wk * lk, wsum + wk
        parts.append({"ce": round(float(lk.detach()), 5),
                      "kl": round(float(((ce.detach() - t_ent[:, k:]) * w).sum() / w.sum().clamp_min(1)), 5)})
        if metrics:
            top = logits.topk(min(4, logits.shape[-1]), dim=-1).indices
            yk = y[:, k:]
            matches.append(((heads.d2t[top[..., 0]] == yk) & valid, (heads.d2t[top] == yk.unsqueeze(-1)).any(-1) & valid,
                            valid))
    return total / max(wsum, 1e-9), parts, matches


@torch.no_grad()
def evaluate(head, data, indices: list[int], cfg: TrainConfig, device) -> dict:
    """Held-out acceptance proxies on assistant positions: top-1 (and top-4) agreement with the
    target's greedy token per draft depth / Medusa head, and the chain proxy
    tau = 1 + E[number of consecutive depths that agree] (greedy tokens emitted per round with a
    chain of the evaluated depth), overall and on generated answers only."""
    was = head.training
    head.eval()
    sums = {}
    losses = []
    seen = 0
    for idx in Batches([int(data["offsets"][i + 1] - data["offsets"][i]) for i in range(len(data["sources"]))],
                       indices, cfg.batch_tokens, 0).epoch(0):
        batch = collate(data, idx, device)
        if cfg.kind == "eagle":
            loss, _, m = eagle_loss(head, batch, cfg, depth=max(cfg.eval_depth, cfg.unroll), metrics=True)
        else:
            loss, _, m = medusa_loss(head, batch, cfg, metrics=True)
        losses.append(float(loss.detach()))
        W = m[0][0].shape[1]
        gen_rows = (batch["kind"] == 1).unsqueeze(1)
        ls = batch["loss_start"].unsqueeze(1)
        # The chain rooted at column r drafts depth j at column r + j - 1 (EAGLE) or with head j at
        # column r (Medusa); both predict the label at position r + j (the target's token r + j + 1).
        run = torch.ones_like(m[0][0])
        acc_len = torch.zeros(m[0][0].shape, dtype=torch.float32, device=device)
        for j, (top1, top4, valid) in enumerate(m, start=1):
            col = torch.arange(top1.shape[1], device=device).unsqueeze(0)
            label_pos = col + 1 if cfg.kind == "eagle" else col + j
            ans = (label_pos + 1) >= ls  # the predicted token belongs to the assistant's turn
            for name, sel in (("all", ans & valid), ("gen", ans & valid & gen_rows)):
                d = sums.setdefault(name, {})
                d[f"top1_{j}"] = d.get(f"top1_{j}", 0) + int((top1 & sel).sum())
                d[f"top4_{j}"] = d.get(f"top4_{j}", 0) + int((top4 & sel).sum())
                d[f"n_{j}"] = d.get(f"n_{j}", 0) + int(sel.sum())
            shifted = torch.zeros_like(m[0][0])
            if cfg.kind == "eagle":
                shifted[:, : W - (j - 1)] = top1[:, j - 1:]
            else:
                shifted[:, : top1.shape[1]] = top1
            run = run & shifted
            acc_len += run.float()
        col = torch.arange(W, device=device).unsqueeze(0)
        root_ok = ((col + 2) >= ls) & m[0][2]
        for name, sel in (("all", root_ok), ("gen", root_ok & gen_rows)):
            d = sums.setdefault(name, {})
            d["chain_sum"] = d.get("chain_sum", 0.0) + float((acc_len * sel).sum())
            d["chain_n"] = d.get("chain_n", 0) + int(sel.sum())
        seen += int(batch["lengths"].sum())
        if seen >= cfg.eval_tokens:
            break
    head.train(was)
    out = {"loss": sum(losses) / max(len(losses), 1), "tokens": seen}
    for name, d in sums.items():
        r = {}
        j = 1
        while f"n_{j}" in d:
            n = max(d[f"n_{j}"], 1)
            r[f"top1_depth{j}"] = round(d[f"top1_{j}"] / n, 4)
            r[f"top4_depth{j}"] = round(d[f"top4_{j}"] / n, 4)
            j += 1
        r["chain_tau"] = round(1 + d["chain_sum"] / max(d["chain_n"], 1), 4)
        r["positions"] = d["chain_n"]
        out[name] = r
    return out


def lr_at(step: int, cfg: TrainConfig, total: int | None) -> float:
    warm = min(1.0, (step + 1) / max(cfg.warmup, 1))
    if not total:
        return cfg.lr * warm
    prog = min(1.0, step / max(total, 1))
    cos = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return cfg.lr * warm * cos


def plan_total_steps(step: int, deadline: float, seconds_per_step: float, margin: float = 0.98,
                     now: float | None = None) -> int:
    """Total steps for the learning-rate schedule: ``step`` plus the steps that fit before
    ``deadline`` at ``seconds_per_step`` (the rate includes evaluations and checkpoints), less a
    ``margin`` for the final evaluation; at least one more step."""
    left = deadline - (time.time() if now is None else now)
    return step + max(1, int(margin * left / max(seconds_per_step, 1e-9)))


def save_checkpoint(path: Path, head, opt, noise_gen: torch.Generator, state: dict) -> None:
    from safetensors.torch import save_file

    tensors = {f"head.{k}": v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        for name, t in st.items():
            if isinstance(t, torch.Tensor):
                tensors[f"opt.{i}.{name}"] = t.detach().cpu().contiguous()
    tensors["rng.noise"] = noise_gen.get_state()
    md = {"format": CKPT_FORMAT, "state": json.dumps(state), "param_groups": json.dumps(sd["param_groups"])}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=md)
    os.replace(tmp, path)


def load_checkpoint(path: Path):
    """(head tensors, optimizer state dict, noise RNG state, state dict) — safetensors only."""
    from safetensors import safe_open

    from specgraph.heads import read_safetensors_header

    md = read_safetensors_header(path).get("__metadata__") or {}
    if md.get("format") != CKPT_FORMAT:
        raise ValueError(f"{path} is not a specgraph training checkpoint")
    head_t, opt_state, rng = {}, {}, None
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            if k.startswith("head."):
                head_t[k[5:]] = t
            elif k.startswith("opt."):
                _, i, name = k.split(".", 2)
                opt_state.setdefault(int(i), {})[name] = t
            elif k == "rng.noise":
                rng = t
    opt_sd = {"state": opt_state, "param_groups": json.loads(md["param_groups"])}
    return head_t, opt_sd, rng, json.loads(md["state"])


def make_head(kind: str, model, d2t: torch.Tensor, medusa_heads: int = 4, medusa_layers: int = 1):
    if kind == "eagle":
        head = EagleHead(model.config, d2t)
        # start the output norm at the target's final-norm scale: predicted features then begin at
        # the magnitude of the real ones (SmolLM2's have RMS ~2, a unit norm would start at 1)
        dec = model.get_decoder() if hasattr(model, "get_decoder") else None
        w = getattr(getattr(dec, "norm", None), "weight", None)
        if isinstance(w, torch.Tensor) and w.shape == head.out_norm.weight.shape:
            with torch.no_grad():
                head.out_norm.weight.copy_(w.detach().float())
    elif kind == "medusa":
        head = MedusaHeads.for_target(model.config, medusa_heads, medusa_layers, d2t)
    else:
        raise ValueError(f"unknown kind {kind!r}: use eagle or medusa")
    p = next(model.parameters())
    return head.to(p.device).bind(model)


def train_head(model, data: dict, out: Path, cfg: TrainConfig, *, d2t: torch.Tensor, deadline: float | None = None,
               resume: bool = False, medusa_heads: int = 4, medusa_layers: int = 1, stop_at: int | None = None,
               progress: bool = True, extra_log: dict | None = None, log=print):
    """Train a head on cached data; checkpoint to ``out/checkpoint.safetensors``; returns (head, log).

    ``stop_at`` stops after that many steps without finishing (for interruption tests)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.safetensors"
    torch.manual_seed(cfg.seed)
    n_ex = len(data["sources"])
    lengths = [int(data["offsets"][i + 1] - data["offsets"][i]) for i in range(n_ex)]
    kinds = data["kind"].tolist()
    held = [i for i in range(n_ex) if _held_out(data["sources"][i] + ("#gen" if kinds[i] else ""), cfg.seed,
                                                 cfg.holdout_gen if kinds[i] else cfg.holdout)]
    if not held or len(held) == n_ex:
        held = list(range(n_ex - max(1, n_ex // 20), n_ex))
    held_set = set(held)
    train_idx = [i for i in range(n_ex) if i not in held_set] or held
    batches = Batches(lengths, train_idx, cfg.batch_tokens, cfg.seed)
    noise_gen = torch.Generator().manual_seed(cfg.seed + 1)

    state = {"kind": cfg.kind, "step": 0, "epoch": 0, "batch": 0, "total_steps": cfg.max_steps, "history": [],
             "evals": [], "tokens_seen": 0, "train_seconds": 0.0}
    if resume and ckpt.exists():
        head_t, opt_sd, rng, state = load_checkpoint(ckpt)
        if state.get("kind") != cfg.kind:
            raise ValueError(f"{ckpt} is a {state.get('kind')} checkpoint, not {cfg.kind}: use another --out")
        d2t = head_t["d2t"]
    head = make_head(cfg.kind, model, d2t, medusa_heads, medusa_layers)
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if resume and ckpt.exists():
        head.load_state_dict(head_t, strict=True)
        head.bind(model)
        opt.load_state_dict(opt_sd)
        noise_gen.set_state(rng)
        log(f"resumed from {ckpt} at step {state['step']}")

    total = state["total_steps"]
    bar = tqdm(total=total, initial=state["step"], unit="step", desc=f"training {cfg.kind}", disable=not progress,
               dynamic_ncols=True)
    epoch_batches = batches.epoch(state["epoch"])
    t_start = time.time()
    steps_here = 0
    ema = None

    def _ckpt():
        state["train_seconds"] = state.get("train_seconds", 0.0) + (time.time() - t_ckpt[0])
        t_ckpt[0] = time.time()
        save_checkpoint(ckpt, head, opt, noise_gen, state)

    t_ckpt = [time.time()]
    stopped_by = "steps"
    while True:
        step = state["step"]
        if total is not None and step >= total:
            break
        if stop_at is not None and steps_here >= stop_at:
            stopped_by = "stop_at"
            break
        if deadline is not None and time.time() >= deadline:
            stopped_by = "time budget"
            log(f"time budget reached at step {step}")
            break
        if state["batch"] >= len(epoch_batches):
            state["epoch"] += 1
            state["batch"] = 0
            epoch_batches = batches.epoch(state["epoch"])
        batch = collate(data, epoch_batches[state["batch"]], device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, total)
        if cfg.kind == "eagle":
            loss, parts, _ = eagle_loss(head, batch, cfg, noise_gen)
        else:
            loss, parts, _ = medusa_loss(head, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        state["step"] += 1
        state["batch"] += 1
        state["tokens_seen"] += int(batch["lengths"].sum())
        steps_here += 1
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        state["history"].append({"step": state["step"], "loss": round(lv, 5), "parts": parts,
                                 "lr": round(opt.param_groups[0]["lr"], 7), "grad_norm": round(float(gnorm), 4)})
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", epoch=state["epoch"])
        if total is None and steps_here == 10 and deadline is not None:
            rate = (time.time() - t_start) / steps_here
            total = plan_total_steps(state["step"], deadline, rate, margin=0.92)
            state["total_steps"] = total
            bar.total = total
            bar.refresh()
            log(f"{rate:.2f} s/step: planning {total} steps")
        if state["step"] % cfg.checkpoint_every == 0:
            ev = evaluate(head, data, held, cfg, device)
            ev["step"] = state["step"]
            state["evals"].append(ev)
            if total is not None and deadline is not None and cfg.max_steps is None:
                # a budget-planned schedule: the first plan came from 10 steps, before the machine's load
                # (another job, evaluations) showed; re-plan on the rate so far so it ends with the budget
                rate = (time.time() - t_start) / steps_here
                total = plan_total_steps(state["step"], deadline, rate)
                if total != state["total_steps"]:
                    log(f"step {state['step']}: {rate:.2f} s/step, re-planned {state['total_steps']} -> {total} steps")
                state["total_steps"] = bar.total = total
            _ckpt()
    bar.close()
    finished = stopped_by != "stop_at"
    if state["step"] and (not state["evals"] or state["evals"][-1]["step"] != state["step"]):
        ev = evaluate(head, data, held, cfg, device)
        ev["step"] = state["step"]
        state["evals"].append(ev)
    _ckpt()
    train_log = {
        "kind": cfg.kind, "config": cfg.__dict__, "steps": state["step"], "epochs": state["epoch"]
        + state["batch"] / max(len(epoch_batches), 1), "tokens_seen": state["tokens_seen"],
        "train_examples": len(train_idx), "held_out_examples": len(held),
        "train_tokens": sum(lengths[i] for i in train_idx), "held_out_tokens": sum(lengths[i] for i in held),
        "draft_vocab_size": int(head.draft_vocab_size), "loss_curve": state["history"], "evals": state["evals"],
        "final_eval": state["evals"][-1] if state["evals"] else None, "train_seconds": round(state["train_seconds"], 1),
        "finished": finished, "stopped_by": stopped_by, **(extra_log or {}),
    }
    _atomic_json(out / "train_log.json", train_log)
    return head, train_log


# ==============================================================================================
# command line


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a .gguf file or a local HF folder")
    p.add_argument("--kind", required=True, choices=["eagle", "medusa"])
    p.add_argument("--out", required=True, help="output folder: head.safetensors, train_log.json, checkpoint, cache/")
    p.add_argument("--resume", action="store_true", help="continue the cache and the training found in --out")
    p.add_argument("--time-budget", type=float, default=55.0, help="minutes for the whole run (data + training)")
    p.add_argument("--data-share", type=float, default=0.5, help="share of the budget for caching target features")
    p.add_argument("--gen-share", type=float, default=0.2,
                   help="share of the data time spent on answers generated by the target (the rest: teacher-forced text)")
    p.add_argument("--max-tokens", type=int, default=0, help="cap on cached tokens (0 = as many as the data time allows)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0 = the full vocabulary)")
    p.add_argument("--medusa-heads", type=int, default=4)
    p.add_argument("--medusa-layers", type=int, default=1)
    p.add_argument("--unroll", type=int, default=2, help="EAGLE: draft depths trained with the head's own features")
    p.add_argument("--max-steps", type=int, default=None, help="fixed number of training steps (default: from the budget)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    p.add_argument("--batch-tokens", type=int, default=1024, help="tokens per optimizer step (whole sequences)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--gen-new-tokens", type=int, default=128, help="longest generated answer")
    p.add_argument("--gen-batch", type=int, default=24, help="prompts answered together")
    p.add_argument("--gen-engine", choices=GEN_ENGINES, default="specgraph",
                   help="what writes the generated answers: specgraph's compiled prompt-lookup decoder (the same "
                        "greedy tokens as HF generate) or HF generate")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints + held-out evaluations")
    p.add_argument("--cache", default=None, help="feature-cache folder (default OUT/cache; may be shared between kinds)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="specgraph train-drafter",
                                                 description="Train an EAGLE or Medusa drafter head by self-distillation."))


def _log(msg: str) -> None:
    print(f"[train-drafter] {msg}", file=sys.stderr, flush=True)


def run(args, *, model=None, tok=None) -> dict:
    """Run ``train-drafter`` from parsed ``args`` (``model``/``tok`` may be given, e.g. in tests)."""
    t0 = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.time_budget <= 0:
        raise ValueError("--time-budget must be > 0 minutes")
    if not 0 < args.data_share < 1 or not 0 <= args.gen_share <= 1:
        raise ValueError("--data-share must be in (0, 1) and --gen-share in [0, 1]")
    for flag, value, low in (("--draft-vocab", args.draft_vocab, 0), ("--medusa-heads", args.medusa_heads, 1),
                             ("--medusa-layers", args.medusa_layers, 1), ("--unroll", args.unroll, 1),
                             ("--seq-len", args.seq_len, 16), ("--batch-tokens", args.batch_tokens, 16),
                             ("--gen-new-tokens", args.gen_new_tokens, 1), ("--gen-batch", args.gen_batch, 1),
                             ("--checkpoint-every", args.checkpoint_every, 1), ("--max-tokens", args.max_tokens, 0)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError("--max-steps must be >= 1")
    deadline = t0 + args.time_budget * 60 - 60  # keep time for the final evaluation and the save
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    out = Path(args.out)
    if ((out / "checkpoint.safetensors").exists() or (out / "head.safetensors").exists()) and not args.resume:
        raise ValueError(f"{out} already holds a training run: pass --resume to continue it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    if model is None:
        from specgraph.models import load_model

        _log(f"loading {args.model} ...")
        model, tok = load_model(args.model)
    model = model.to(device).eval()
    model.requires_grad_(False)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    fp = model_fingerprint(model)
    data_cfg = {"seed": args.seed, "seq_len": args.seq_len, "gen_new_tokens": args.gen_new_tokens, "version": CACHE_VERSION}
    cache = FeatureCache(Path(args.cache) if args.cache else out / "cache", fp, data_cfg)
    data_deadline = t0 + args.data_share * args.time_budget * 60
    rates = build_cache(model, tok, cache, seed=args.seed, max_len=args.seq_len, max_tokens=args.max_tokens or None,
                        deadline=data_deadline, gen_share=args.gen_share, gen_new_tokens=args.gen_new_tokens,
                        gen_batch=args.gen_batch, gen_engine=args.gen_engine,
                        progress=not args.no_progress, log=_log)
    data = cache.load()
    V = model.get_output_embeddings().out_features
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    size = args.draft_vocab if args.draft_vocab and args.draft_vocab < vocab_size else vocab_size
    d2t, cover = build_draft_vocab(data["labels"], min(V, vocab_size), size)
    _log(f"draft vocabulary: {d2t.numel()} tokens cover {cover:.2%} of the target's greedy tokens in the cache")
    cfg = TrainConfig(kind=args.kind, seed=args.seed, batch_tokens=args.batch_tokens, unroll=args.unroll,
                      checkpoint_every=args.checkpoint_every, max_steps=args.max_steps)
    if args.lr:
        cfg.lr = args.lr
    head, log = train_head(model, data, out, cfg, d2t=d2t, deadline=deadline, resume=args.resume,
                           medusa_heads=args.medusa_heads, medusa_layers=args.medusa_layers,
                           progress=not args.no_progress, log=_log,
                           extra_log={"model": args.model, "fingerprint": fp, "cache_tokens": cache.index["tokens"],
                                      "cache_gen_tokens": cache.index["gen_tokens"], "data_rates": rates,
                                      "draft_vocab_coverage": cover, "device": str(device)})
    path = save_head(head, out / "head.safetensors",
                     meta={"trained_by": "specgraph train-drafter", "steps": log["steps"], "tokens_seen": log["tokens_seen"],
                           "final_eval": log["final_eval"], "args": {k: v for k, v in vars(args).items() if k != "func"}})
    log["head_file"] = str(path)
    log["head_bytes"] = path.stat().st_size
    log["wall_seconds"] = round(time.time() - t0, 1)
    _atomic_json(out / "train_log.json", log)
    fe = log["final_eval"] or {}
    _log(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) after {log['steps']} steps, {log['wall_seconds']:.0f} s; "
         f"held-out: {json.dumps(fe.get('all', {}))}")
    return log


def cmd(args) -> int:
    """Entry point for a ``train-drafter`` subcommand: 0 on success, 2 (with a message) on bad input."""
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"specgraph train-drafter: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    return cmd(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
