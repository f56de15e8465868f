"""Drafter heads (specgraph.heads): shapes, explicit KV/mask semantics, safetensors IO, fingerprints.

All on tiny random llama targets (hidden 64, GQA 4/2 heads, vocab 128)."""
from __future__ import annotations

import json
import pickle

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specgraph.heads import (
    EagleHead, HeadFileError, HeadMismatchError, MedusaHeads, find_head, load_head, model_fingerprint,
    read_head_metadata, save_head,
)

NEG = float("-inf")
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def tiny_llama(seed=0, **over):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", **{**TINY, **over})
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def random_head(target, draft_vocab=None, seed=1):
    head = EagleHead(target.config, draft_vocab).bind(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial norms and biases too
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return head.eval()


def chain_mask(B, Q, S, start):
    """Query i (at slot start+i) sees slots 0..start+i."""
    s = torch.arange(S).view(1, S)
    q = torch.arange(Q).view(Q, 1) + start
    return torch.where(s <= q, 0.0, NEG).view(1, 1, Q, S).expand(B, 1, Q, S).contiguous()


def test_eagle_shapes_and_draft_vocab(target):
    d2t = torch.tensor([5, 7, 9, 11, 100, 3])
    head = random_head(target, d2t)
    assert head.config["draft_vocab_size"] == 6 and head.draft_vocab_size == 6
    B, Q, S = 2, 3, 8
    k, v = head.new_cache(B, S)
    assert k.shape == (B, 2, S, 16)
    tokens = torch.randint(0, 128, (B, Q))
    feats = torch.randn(B, Q, 64)
    pos = torch.arange(Q).expand(B, Q)
    out = head(tokens, feats, pos, chain_mask(B, Q, S, 0), pos.clone(), k, v)
    assert out.shape == (B, Q, 64)
    logits = head.logits(out)
    assert logits.shape == (B, Q, 6)
    # the reduced head is exactly the target's LM-head rows d2t
    full = target.lm_head(out)
    torch.testing.assert_close(logits, full[..., d2t])
    assert torch.equal(head.d2t, d2t)
    assert head.embed_weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()  # shared, not copied
    assert set(head.state_dict()) == {k for k, _ in head.named_parameters()} | {"d2t"}  # no target weights saved


def test_medusa_shapes_and_identity_init(target):
    heads = MedusaHeads.for_target(target.config, num_heads=3, draft_vocab=None).bind(target)
    f = torch.randn(2, 5, 64)
    out = heads(f)
    assert out.shape == (2, 5, 3, 64)
    assert heads.logits(out).shape == (2, 5, 3, 128)
    # zero-initialised residual blocks: every head starts as the target's own next-token head
    ids = torch.randint(0, 128, (1, 7))
    h = target(ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(heads.logits(heads(h))[:, :, 1], target(ids).logits)


def test_bind_required_and_shape_check(target):
    head = EagleHead(target.config)
    with pytest.raises(RuntimeError, match="bind"):
        head.logits(torch.zeros(1, 64))
    other = tiny_llama(0, hidden_size=32, intermediate_size=64)
    with pytest.raises(HeadMismatchError):
        head.bind(other)


def test_gqa_attention_matches_repeated_kv_reference(target):
    head = random_head(target)
    attn = head.layer.attn
    B, Q, S, D = 2, 3, 6, 16
    q = torch.randn(B, 2, 2, Q, D)  # [B, Hkv, G, Q, D]
    k, v = torch.randn(B, 2, S, D), torch.randn(B, 2, S, D)
    mask = torch.where(torch.rand(B, 1, Q, S) < 0.3, NEG, 0.0)
    mask[..., 0] = 0.0
    out = attn.attend(q, k, v, mask)
    # reference: HF layout, head h uses KV head h // G
    qh = q.reshape(B, 4, Q, D)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kr, vr, attn_mask=mask)
    ref = attn.o_proj(ref.transpose(1, 2).reshape(B, Q, 64))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_chain_step_equals_one_token_steps(target):
    """A step over Q tokens with a chain mask == Q one-token steps; caches written identically."""
    head = random_head(target, torch.arange(0, 128, 2))
    B, Q, S, P = 2, 4, 12, 3
    tokens = torch.randint(0, 128, (B, P + Q))
    feats = torch.randn(B, P + Q, 64)
    pos = torch.arange(P + Q).expand(B, -1)
    # prefix of P tokens first (one causal step), then the Q tokens together / one at a time
    k1, v1 = head.new_cache(B, S)
    head(tokens[:, :P], feats[:, :P], pos[:, :P], chain_mask(B, P, S, 0), pos[:, :P].clone(), k1, v1)
    k2, v2 = k1.clone(), v1.clone()
    together = head(tokens[:, P:], feats[:, P:], pos[:, P:], chain_mask(B, Q, S, P), pos[:, P:].clone(), k1, v1)
    single = []
    for i in range(Q):
        sl = slice(P + i, P + i + 1)
        single.append(head(tokens[:, sl], feats[:, sl], pos[:, sl], chain_mask(B, 1, S, P + i), pos[:, sl].clone(), k2, v2))
    torch.testing.assert_close(together, torch.cat(single, dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k1, k2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v1, v2, atol=1e-6, rtol=1e-6)
    assert k1[:, :, P + Q:].abs().sum() == 0  # nothing written past the used slots
    # the functional form (explicit past K/V instead of the slot cache) agrees
    out_seq, _, _ = head.forward_seq(tokens, feats, pos, chain_mask(B, P + Q, P + Q, 0))
    torch.testing.assert_close(out_seq[:, P:], together, atol=1e-5, rtol=1e-5)


def test_mask_and_slots_are_the_only_state(target):
    """Masked-out cache slots cannot influence the output; visible ones do; per-row slots."""
    head = random_head(target)
    B, S = 2, 10
    k, v = head.new_cache(B, S)
    k.normal_()
    v.normal_()
    tok = torch.randint(0, 128, (B, 1))
    f = torch.randn(B, 1, 64)
    slots = torch.tensor([[4], [6]])  # rows at different slots
    pos = slots.clone()
    mask = torch.full((B, 1, 1, S), NEG)
    mask[0, 0, 0, :5] = 0.0
    mask[1, 0, 0, :7] = 0.0
    base = head(tok, f, pos, mask, slots, k.clone(), v.clone())
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 7:] = 99.0  # hidden from row 0
    v2[1, :, 8:] = -5.0  # hidden from row 1
    torch.testing.assert_close(head(tok, f, pos, mask, slots, k2, v2), base)
    assert not torch.equal(k2[0, :, 4], k[0, :, 4]) and not torch.equal(k2[1, :, 6], k[1, :, 6])  # slots written
    k3 = k.clone()
    k3[0, :, 1] += 1.0  # visible to row 0 only
    out3 = head(tok, f, pos, mask, slots, k3, v.clone())
    assert not torch.allclose(out3[0], base[0]) and torch.allclose(out3[1], base[1])


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_save_load_round_trip_bit_exact(target, tmp_path, kind):
    if kind == "eagle":
        head = random_head(target, torch.tensor([1, 2, 3, 50, 60, 127]))
    else:
        head = MedusaHeads.for_target(target.config, num_heads=3, num_layers=2, draft_vocab=torch.arange(40)).bind(target)
        with torch.no_grad():
            for p in head.parameters():
                p.normal_(0, 0.02)
    path = save_head(head, tmp_path / "h.safetensors", meta={"note": "test"}, dtype=None)  # keep fp32
    loaded = load_head(path, target)
    assert type(loaded) is type(head)
    sd0, sd1 = head.state_dict(), loaded.state_dict()
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert sd0[k].dtype == sd1[k].dtype and torch.equal(sd0[k], sd1[k]), k
    md = read_head_metadata(path)
    assert md["kind"] == kind and md["fingerprint"] == model_fingerprint(target) and md["meta"] == {"note": "test"}
    assert int(md["draft_vocab_size"]) == head.draft_vocab_size
    assert not any(p.requires_grad for p in loaded.parameters())
    f = torch.randn(1, 3, 64)
    if kind == "eagle":
        args = (torch.tensor([[4, 5, 6]]), f, torch.arange(3).view(1, 3), chain_mask(1, 3, 3, 0), torch.arange(3).view(1, 3))
        assert torch.equal(head(*args, *head.new_cache(1, 3)), loaded(*args, *loaded.new_cache(1, 3)))
    else:
        assert torch.equal(head.logits(head(f)), loaded.logits(loaded(f)))
    # fp16 storage (the shipped format): load -> save again is byte-stable
    p16 = save_head(head, tmp_path / "h16.safetensors")
    again = save_head(load_head(p16, target), tmp_path / "h16b.safetensors")
    from safetensors.torch import load_file
    a, b = load_file(str(p16)), load_file(str(again))
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    assert a["d2t"].dtype == torch.long


def test_fingerprint_stable_and_sensitive(target):
    fp = model_fingerprint(target)
    assert len(fp) == 64
    same = tiny_llama(0)
    same.config.use_cache = not same.config.use_cache  # runtime switches are volatile
    same.config._name_or_path = "/somewhere/else"
    same.config.pad_token_id = 3  # set for batching; the network is unchanged
    assert model_fingerprint(same) == fp
    assert model_fingerprint(tiny_llama(0).to(torch.bfloat16)) == fp  # bf16 load of the same weights
    assert model_fingerprint(tiny_llama(1)) != fp  # other embedding
    assert model_fingerprint(tiny_llama(0, rope_theta=500.0)) != fp  # other config, same embedding
    m = tiny_llama(0)
    with torch.no_grad():
        m.get_input_embeddings().weight[3, 5] += 0.5  # fine-tuned embedding
    assert model_fingerprint(m) != fp


def test_fingerprint_mismatch_refused(target, tmp_path):
    path = save_head(random_head(target), tmp_path / "h.safetensors")
    other = tiny_llama(1)
    with pytest.raises(HeadMismatchError) as e:
        load_head(path, other)
    msg = str(e.value)
    assert "another model" in msg and "train-drafter" in msg and "fingerprint" in msg
    # explicitly skipping the check works when the shapes fit
    assert isinstance(load_head(path, other, check_fingerprint=False), EagleHead)


def test_non_safetensors_refused_without_unpickling(target, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    p1 = tmp_path / "evil.safetensors"
    p1.write_bytes(pickle.dumps({"x": Evil()}))
    p2 = tmp_path / "torch.safetensors"
    torch.save(random_head(target).state_dict(), p2)
    p3 = tmp_path / "text.safetensors"
    p3.write_text("hello world, not a head at all")
    p4 = tmp_path / "tiny.safetensors"
    p4.write_bytes(b"\x01\x02")
    for p in (p1, p2, p3, p4):
        with pytest.raises(HeadFileError) as e:
            load_head(p, target)
        assert "safetensors" in str(e.value)
    assert "never unpickles" in str(pytest.raises(HeadFileError, load_head, p1, target).value)
    assert not marker.exists()
    # safetensors, but not a specgraph head
    from safetensors.torch import save_file
    p5 = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(p5))
    with pytest.raises(HeadFileError, match="not a specgraph head"):
        load_head(p5, target)


def test_save_needs_fingerprint(target, tmp_path):
    head = EagleHead(target.config)
    with pytest.raises(ValueError, match="fingerprint"):
        save_head(head, tmp_path / "x.safetensors")
    save_head(head, tmp_path / "x.safetensors", meta={"fingerprint": model_fingerprint(target)})
    assert json.loads(json.dumps(read_head_metadata(tmp_path / "x.safetensors")["config"]))["hidden_size"] == 64


def test_find_head(target, tmp_path):
    other = tiny_llama(1)
    save_head(random_head(other), tmp_path / "a_other.safetensors")
    with pytest.raises(HeadMismatchError, match="no eagle head matches") as e:
        find_head(target, "eagle", dirs=[tmp_path])
    assert "a_other.safetensors" in str(e.value)
    mine = save_head(random_head(target), tmp_path / "b_mine.safetensors")
    assert find_head(target, "eagle", dirs=[tmp_path]) == mine
    with pytest.raises(HeadMismatchError):
        find_head(target, "medusa", dirs=[tmp_path])


def test_eagle_step_exports_as_a_static_graph(target):
    """The head step captures with torch.export (non-strict) like the target step; the in-place
    cache writes survive in the exported module."""
    head = random_head(target, torch.arange(0, 128, 2)).requires_grad_(False)
    B, Q, S = 2, 3, 8
    args = (torch.randint(0, 128, (B, Q)), torch.randn(B, Q, 64), torch.arange(Q).expand(B, Q).contiguous(),
            chain_mask(B, Q, S, 0), torch.arange(Q).expand(B, Q).contiguous())
    gm = torch.export.export(head, args + head.new_cache(B, S), strict=False).module()
    k1, v1 = head.new_cache(B, S)
    k2, v2 = head.new_cache(B, S)
    torch.testing.assert_close(gm(*args, k2, v2), head(*args, k1, v1))
    assert torch.equal(k1, k2) and torch.equal(v1, v2) and k2.abs().sum() > 0
