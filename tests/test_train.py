"""Drafter training (specgraph.train): data sources, the unrolled EAGLE objective against slot-cache
drafting, the feature cache, training + resume, Medusa offsets, the command. Tiny random llama
targets and a byte tokenizer: every test runs in seconds."""
from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specgraph import train as T
from specgraph.heads import EagleHead, HeadFileError, MedusaHeads, load_head, model_fingerprint

NEG = float("-inf")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=2048)


class ByteTok:
    """Bytes as token ids (clipped to the vocabulary); no chat template, no EOS."""

    pad_token_id = 0
    eos_token_id = None

    def __init__(self, vocab=128):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [min(b, self.vocab - 1) for b in text.encode("utf-8")]}


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", **TINY)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None
    m.requires_grad_(False)
    return m


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def cached(target, tmp_path_factory):
    """A small feature cache: generated answers + teacher-forced stdlib text."""
    root = tmp_path_factory.mktemp("cache")
    cache = T.FeatureCache(root, model_fingerprint(target), {"test": 1})
    T.build_cache(target, ByteTok(), cache, seed=0, max_len=96, max_tokens=4000, deadline=time.time() + 120,
                  gen_share=0.2, gen_new_tokens=12, gen_batch=4, batch_tokens=512, shard_tokens=1024, progress=False,
                  log=lambda *a: None)
    return cache


# ----------------------------------------------------------------------------------------------- data


def test_documents_are_only_stdlib_and_pydoc():
    root = T.stdlib_root()
    topics = T.pydoc_topics()
    docs = list(T.iter_documents(seed=3))
    kinds = {d.source.split(":", 1)[0] for d in docs}
    assert kinds == {"stdlib", "pydoc"}
    assert len(docs) > 200
    for d in docs:
        kind, name = d.source.split(":", 1)
        if kind == "pydoc":
            assert d.text == topics[name]
        else:
            p = (root / name).resolve()
            assert p.is_relative_to(root) and p.suffix == ".py" and p.is_file()
            assert not set(p.relative_to(root).parts) & {"site-packages", "dist-packages", "test", "tests"}
            assert d.text == p.read_text(encoding="utf-8")


def _decode(ids):
    return bytes(ids).decode("utf-8", errors="replace").rstrip("\ufffd")


def test_examples_and_prompts_quote_the_documents_verbatim():
    tok = ByteTok(vocab=256)  # lossless bytes
    texts = {d.source: d.text for d in T.iter_documents(0)}
    stream = T.tf_examples(tok, seed=0, max_len=200)
    for _ in range(40):
        ex = next(stream)
        assert ex.source in texts and 0 < ex.loss_start < len(ex.ids) <= 200
        body = _decode(ex.ids[ex.loss_start:])
        if body.startswith("```python\n"):
            body = body[len("```python\n"):].split("\n```")[0]
        assert body and body in texts[ex.source]
    prompts = T.gen_prompts(tok, seed=0)
    for _ in range(20):
        source, ids = next(prompts)
        text = _decode(ids)
        snippet = text.split("```python\n", 1)[1].split("\n```")[0] if "```python\n" in text else text.split("\n\n", 1)[1].rstrip("\n")
        assert snippet.strip() and snippet.strip() in texts[source]


def test_compiled_answer_engine_caches_the_same_examples_as_hf(target, tmp_path, monkeypatch):
    """The default engine of the generated answers is specgraph's compiled prompt-lookup decoder:
    the cached examples (prompt + greedy answer, token for token) must be HF generate's."""
    fp = model_fingerprint(target)
    caches, engines, make = {}, [], T.answer_engine
    monkeypatch.setattr(T, "answer_engine", lambda *a: engines.append(make(*a)) or engines[-1])
    for engine in ("specgraph", "hf"):
        cache = T.FeatureCache(tmp_path / engine, fp, {"test": 1})
        T.build_cache(target, ByteTok(), cache, seed=0, max_len=400, max_tokens=900, deadline=time.time() + 600,
                      gen_share=1.0, gen_new_tokens=10, gen_batch=3, batch_tokens=512, shard_tokens=1024,
                      progress=False, log=lambda *a: None, gen_engine=engine)
        caches[engine] = cache.load()
    hf, sg = caches["hf"], caches["specgraph"]
    assert hf["ids"].numel() >= 900 and torch.equal(hf["ids"], sg["ids"]) and torch.equal(hf["labels"], sg["labels"])
    assert engines[1] is None and engines[0].stats.emitted > 0  # the answers really came from the compiled engine
    with pytest.raises(ValueError, match="gen-engine"):
        T.answer_engine(target, "vllm", 2)


def test_chunk_text_bounds():
    text = "a\n" * 50 + "x" * 250 + "\nend\n"
    chunks = T.chunk_text(text, 40)
    assert all(len(c) <= 40 for c in chunks)
    assert "".join(chunks) == text


def test_draft_vocab_most_frequent():
    labels = torch.tensor([5, 5, 5, 9, 9, 2, 7, 7, 7, 7])
    d2t, cover = T.build_draft_vocab(labels, 16, 2)
    assert d2t.tolist() == [5, 7] and cover == pytest.approx(0.7)
    d2t, cover = T.build_draft_vocab(labels, 16, 6)  # fewer distinct labels: filled by id
    assert d2t.tolist() == [0, 1, 2, 5, 7, 9] and cover == 1.0


# ------------------------------------------------------------------------------------- objective


def test_unrolled_training_equals_slot_cache_drafting(target):
    """The parallel depth-j training pass computes exactly what chained drafting computes: depth 1
    over the real prefix through the slot cache, then the head's own feature fed back."""
    torch.manual_seed(0)
    head = EagleHead(target.config).bind(target).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    B, L = 2, 12
    batch = {"features": torch.randn(B, L, 64), "ids": torch.randint(0, 128, (B, L)), "lengths": torch.tensor([L, L])}
    outs = T.eagle_forward(head, batch, depth=3)
    x = batch["ids"]
    for r in (0, 3, 7):
        S = L + 4
        k, v = head.new_cache(B, S)
        pos = torch.arange(r + 1).expand(B, -1)
        s = torch.arange(S)
        causal = torch.where(s.view(1, S) <= torch.arange(r + 1).view(-1, 1), 0.0, NEG).expand(B, 1, r + 1, S)
        out1 = head(x[:, 1:r + 2], batch["features"][:, :r + 1], pos, causal, pos.clone(), k, v)
        torch.testing.assert_close(out1[:, r], outs[0][0][:, r], atol=1e-5, rtol=1e-5)
        g = out1[:, r:r + 1]
        for j in (2, 3):
            p = r + j - 1  # the depth-j node sits at position p (slot p)
            mask = torch.where(s <= p, 0.0, NEG).view(1, 1, 1, S).expand(B, 1, 1, S)
            pp = torch.full((B, 1), p)
            g = head(x[:, p + 1:p + 2], g, pp, mask, pp.clone(), k, v)
            torch.testing.assert_close(g[:, 0], outs[j - 1][0][:, p], atol=1e-5, rtol=1e-5)
            assert bool(outs[j - 1][1][:, p].all())


def test_unroll_mask_rows_never_empty():
    for j in (1, 2, 4):
        m = T._unroll_mask(6, j, "cpu")
        assert m.shape == (1, 1, 6, 6 * j)
        assert bool((m == 0).any(-1).all())


# ------------------------------------------------------------------------------------ feature cache


def test_cache_contents(cached, target):
    data = cached.load()
    n = len(data["sources"])
    assert data["offsets"].shape == (n + 1,) and int(data["offsets"][-1]) == data["ids"].shape[0] == cached.index["tokens"]
    assert data["features"].dtype == torch.float16 and data["features"].shape == (data["ids"].shape[0], 64)
    assert (data["kind"] == 1).any() and (data["kind"] == 0).any()
    assert all(s.startswith(("stdlib:", "pydoc:")) for s in data["sources"])
    # the cached features/labels are the target's final features and greedy tokens
    i = int((data["kind"] == 0).nonzero()[0])
    s, e = int(data["offsets"][i]), int(data["offsets"][i + 1])
    ids = data["ids"][s:e].long().unsqueeze(0)
    out = target(ids, output_hidden_states=True)
    torch.testing.assert_close(data["features"][s:e].float(), out.hidden_states[-1][0], atol=2e-3, rtol=2e-3)
    assert (data["labels"][s:e].long() == out.logits[0].argmax(-1)).float().mean() > 0.97


def test_cache_resumes_after_a_crash(target, tmp_path, monkeypatch):
    kw = dict(seed=1, max_len=64, max_tokens=2500, gen_share=0.0, gen_new_tokens=8, batch_tokens=256,
              shard_tokens=256, progress=False, log=lambda *a: None)
    full = T.FeatureCache(tmp_path / "full", "fp", {})
    T.build_cache(target, ByteTok(), full, deadline=time.time() + 120, **kw)
    crashy = T.FeatureCache(tmp_path / "crash", "fp", {})
    real, calls = T.target_features, []

    def boom(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(T, "target_features", boom)
    with pytest.raises(KeyboardInterrupt):
        T.build_cache(target, ByteTok(), crashy, deadline=time.time() + 120, **kw)
    monkeypatch.setattr(T, "target_features", real)
    assert 0 < crashy.index["tokens"] < full.index["tokens"] and not crashy.index["tf_done"]
    resumed = T.FeatureCache(tmp_path / "crash", "fp", {})
    T.build_cache(target, ByteTok(), resumed, deadline=time.time() + 120, **kw)
    a, b = full.load(), resumed.load()
    assert a["sources"] == b["sources"]
    for k in ("ids", "labels", "features", "offsets", "loss_start"):
        assert torch.equal(a[k], b[k]), k
    with pytest.raises(ValueError, match="another model"):
        T.FeatureCache(tmp_path / "full", "other-fp", {})


def test_cache_stopped_by_its_budget_stays_open(target, tmp_path):
    """A data phase that ends on its deadline or token cap (not because the documents ran out)
    leaves the cache open: a later run with the same --cache adds to it, continuing the stream."""
    kw = dict(seed=1, max_len=64, gen_share=0.0, gen_new_tokens=8, batch_tokens=256, shard_tokens=256,
              progress=False, log=lambda *a: None)
    one = T.FeatureCache(tmp_path / "one", "fp", {})
    T.build_cache(target, ByteTok(), one, deadline=time.time() + 120, max_tokens=3000, **kw)
    two = T.FeatureCache(tmp_path / "two", "fp", {})
    T.build_cache(target, ByteTok(), two, deadline=time.time() + 120, max_tokens=1200, **kw)
    assert not two.index["tf_done"] and two.index["tokens"] < one.index["tokens"]
    T.build_cache(target, ByteTok(), two, deadline=time.time() + 120, max_tokens=3000, **kw)
    a, b = one.load(), two.load()
    assert a["sources"] == b["sources"] and torch.equal(a["ids"], b["ids"])


# ------------------------------------------------------------------------------------------ training


def _cfg(**kw):
    base = dict(kind="eagle", max_steps=36, checkpoint_every=12, batch_tokens=384, lr=3e-3, warmup=4, eval_tokens=1024)
    return T.TrainConfig(**{**base, **kw})


def test_eagle_training_decreases_loss_and_resumes_exactly(target, cached, tmp_path):
    data = cached.load()
    d2t, _ = T.build_draft_vocab(data["labels"], 128, 64)
    head_a, log_a = T.train_head(target, data, tmp_path / "a", _cfg(), d2t=d2t, progress=False, log=lambda *a: None)
    losses = [h["loss"] for h in log_a["loss_curve"]]
    assert len(losses) == 36
    kl = [h["parts"][0]["kl"] for h in log_a["loss_curve"]]  # depth-1 KL to the target's distribution
    assert sum(losses[-6:]) < sum(losses[:6]) - 6 * 0.3 and sum(kl[-6:]) < 0.5 * sum(kl[:6])
    assert log_a["final_eval"]["all"]["chain_tau"] >= 1.0 and "top1_depth4" in log_a["final_eval"]["all"]
    assert json.loads((tmp_path / "a" / "train_log.json").read_text())["steps"] == 36
    # interrupted after 17 steps (between checkpoints), then resumed: the same final state
    _, log_b1 = T.train_head(target, data, tmp_path / "b", _cfg(), d2t=d2t, stop_at=17, progress=False, log=lambda *a: None)
    assert log_b1["steps"] == 17 and not log_b1["finished"]
    head_b, log_b = T.train_head(target, data, tmp_path / "b", _cfg(), d2t=torch.arange(3), resume=True, progress=False,
                                 log=lambda *a: None)
    assert [h["loss"] for h in log_b["loss_curve"]] == losses
    sa, sb = head_a.state_dict(), head_b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    _, oa, _, st_a = T.load_checkpoint(tmp_path / "a" / "checkpoint.safetensors")
    _, ob, _, st_b = T.load_checkpoint(tmp_path / "b" / "checkpoint.safetensors")
    assert all(torch.equal(oa["state"][i][n], ob["state"][i][n]) for i in oa["state"] for n in oa["state"][i])
    assert st_a["step"] == st_b["step"] == 36


def test_budget_schedule_is_replanned_when_steps_slow_down(target, cached, tmp_path, monkeypatch):
    """A time budget plans the cosine schedule from the first 10 steps; when later steps get slower
    (another job on the machine), the plan is redone at each checkpoint, so the learning rate has
    decayed when the budget ends instead of being cut off mid-schedule."""
    data = cached.load()
    d2t, _ = T.build_draft_vocab(data["labels"], 128, 64)
    real_loss, calls = T.eagle_loss, [0]

    def slower_after_10(*a, **kw):
        calls[0] += 1
        if calls[0] > 10:
            time.sleep(0.15)
        return real_loss(*a, **kw)

    monkeypatch.setattr(T, "eagle_loss", slower_after_10)
    cfg = _cfg(max_steps=None, checkpoint_every=4, eval_tokens=256)
    _, log = T.train_head(target, data, tmp_path / "a", cfg, d2t=d2t, deadline=time.time() + 12, progress=False,
                          log=lambda *a: None)
    last_lr = log["loss_curve"][-1]["lr"]
    # unplanned (the first 10 steps' rate) the run would stop early in its schedule, lr near its peak
    assert log["stopped_by"] in ("steps", "time budget") and log["steps"] > 20
    assert last_lr < cfg.lr * 0.4, (last_lr, log["steps"])
    assert T.plan_total_steps(5, 100.0, 2.0, margin=1.0, now=60.0) == 25  # 40 s left at 2 s/step


def test_checkpoint_loader_refuses_pickles(tmp_path):
    p = tmp_path / "checkpoint.safetensors"
    torch.save({"a": torch.zeros(1)}, p)
    with pytest.raises(HeadFileError, match="safetensors"):
        T.load_checkpoint(p)


def _periodic_data(target, n_seq=24, L=48, seed=0):
    """Sequences that follow one fixed permutation cycle of the vocabulary: the future token t+k is
    a function of token t, so head k can learn the target's distribution at t+k from feature t."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(128, generator=g)
    seqs = []
    for _ in range(n_seq):
        x = [int(torch.randint(0, 128, (1,), generator=g))]
        for _ in range(L - 1):
            x.append(int(perm[x[-1]]))
        seqs.append(x)
    feats, labels = T.target_features(target, seqs)
    return {"features": torch.cat(feats), "labels": torch.cat(labels), "ids": torch.tensor(sum(seqs, []), dtype=torch.int32),
            "offsets": torch.arange(n_seq + 1) * L, "loss_start": torch.zeros(n_seq, dtype=torch.long),
            "kind": torch.zeros(n_seq, dtype=torch.int8), "sources": [f"stdlib:synthetic{i}" for i in range(n_seq)]}


def test_medusa_head_k_learns_token_t_plus_k_plus_1(tmp_path):
    target = tiny_llama(0)
    with torch.no_grad():  # a random tiny model is nearly uniform; sharpen it so there is something to learn
        target.lm_head.weight.mul_(40)
    data = _periodic_data(target)
    cfg = _cfg(kind="medusa", max_steps=60, checkpoint_every=1000, lr=1e-2, batch_tokens=4 * 48, holdout=0.0)
    d2t = torch.arange(128)
    all_idx = list(range(len(data["sources"])))
    batch = T.collate(data, all_idx, "cpu")

    def per_head(heads):
        with torch.no_grad():
            _, parts, m = T.medusa_loss(heads, batch, cfg, metrics=True)
        return [p["kl"] for p in parts], [float(t1.sum() / v.sum()) for t1, _, v in m]

    fresh = MedusaHeads.for_target(target.config, 3, 2, d2t).bind(target)
    ce0, acc0 = per_head(fresh)
    heads, log = T.train_head(target, data, tmp_path / "m", cfg, d2t=d2t, medusa_heads=3, medusa_layers=2,
                              progress=False, log=lambda *a: None)
    ce1, acc1 = per_head(heads.eval())
    for k in range(3):
        assert ce1[k] < 0.5 * ce0[k], (k, ce0, ce1)
        assert acc1[k] > acc0[k] + 0.2, (k, acc0, acc1)
    # head k predicts the target's token at t+k (i.e. token t+k+1), not its neighbours'
    with torch.no_grad():
        logits = heads.logits(heads(batch["features"]))
    y = batch["labels"]
    for k in range(1, 4):
        pred = heads.d2t[logits[:, : 48 - 3, k - 1].argmax(-1)]
        own = (pred == y[:, k: 48 - 3 + k]).float().mean()
        for other in {1, 2, 3} - {k}:
            assert own > (pred == y[:, other: 48 - 3 + other]).float().mean() + 0.1


# ------------------------------------------------------------------------------------------- command


def test_command_end_to_end(target, tmp_path):
    out = tmp_path / "run"
    argv = ["--kind", "medusa", "--out", str(out), "--time-budget", "3", "--max-tokens", "1500", "--seq-len", "80",
            "--batch-tokens", "320", "--max-steps", "5", "--checkpoint-every", "3", "--gen-new-tokens", "8",
            "--gen-batch", "2", "--gen-engine", "hf", "--draft-vocab", "48", "--medusa-heads", "2", "--no-progress"]
    log = T.run(T.build_parser().parse_args(argv), model=target, tok=ByteTok())
    assert log["steps"] == 5 and (out / "head.safetensors").exists() and log["head_bytes"] < 200_000
    saved = json.loads((out / "train_log.json").read_text())
    assert saved["kind"] == "medusa" and saved["draft_vocab_size"] == 48 and saved["cache_tokens"] >= 1500
    heads = load_head(out / "head.safetensors", target)
    assert isinstance(heads, MedusaHeads) and heads.num_heads == 2 and heads.draft_vocab_size == 48
    with pytest.raises(ValueError, match="--resume"):
        T.run(T.build_parser().parse_args(argv), model=target, tok=ByteTok())
    log2 = T.run(T.build_parser().parse_args(argv + ["--resume"]), model=target, tok=ByteTok())
    assert log2["steps"] == 5


def test_main_argument_errors(capsys):
    with pytest.raises(SystemExit) as e:
        T.main(["--help"])
    assert e.value.code == 0
    assert "--time-budget" in capsys.readouterr().out
    assert T.main(["--kind", "eagle", "--out", "/nonexistent/x", "--time-budget", "0"]) == 2
    assert T.main(["--kind", "eagle", "--out", "/nonexistent/x", "--unroll", "0"]) == 2
    assert "--unroll must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        T.main(["--kind", "lstm", "--out", "x"])
