"""The process-wide budget for frozen graphs' weight copies (specgraph.freezing)."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

import specgraph
from specgraph import freezing

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: share test_compile's helpers
from test_compile import assert_same, hf_generate, left_pad, sg_generate, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")
CPU = torch.device("cpu")


def test_weight_bytes_counts_tied_weights_once():
    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    distinct = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    assert freezing.weight_bytes(model) == sum(distinct.values())
    assert freezing.weight_bytes(model, model, None) == freezing.weight_bytes(model)


def test_budget_reserves_up_to_its_limit_and_returns_on_collection():
    budget = freezing.FreezeBudget({"cpu": 100})

    class Owner:
        pass

    a, b = Owner(), Owner()
    acc_a, acc_b = {}, {}
    budget.track(a, acc_a)
    budget.track(b, acc_b)
    assert budget.reserve(CPU, 60, acc_a)
    assert not budget.reserve(CPU, 60, acc_b)  # 120 > 100
    assert budget.reserve(CPU, 40, acc_b)
    assert budget.used["cpu"] == 100 and acc_a == {"cpu": 60} and acc_b == {"cpu": 40}
    del a
    gc.collect()
    assert budget.used["cpu"] == 40 and acc_a == {}
    assert budget.reserve(CPU, 60, acc_b) and acc_b == {"cpu": 100}


def test_budget_limit_from_environment(monkeypatch):
    monkeypatch.setenv(freezing.ENV_BUDGET, "0.5")
    assert freezing.FreezeBudget().limit(CPU) == 2**29
    monkeypatch.setenv(freezing.ENV_BUDGET, "lots")
    with pytest.raises(ValueError, match="number of GB"):
        freezing.FreezeBudget().limit(CPU)
    monkeypatch.delenv(freezing.ENV_BUDGET)
    assert freezing.FreezeBudget().limit(CPU) == int(freezing.FREEZE_MEMORY_FRACTION * freezing.device_memory_bytes(CPU))


def test_graphs_past_the_budget_compile_unfrozen_and_stay_exact(monkeypatch):
    """A budget of one weight copy: the first object's graph is frozen; the second object's graphs,
    past the budget, compile unfrozen (with a warning) and stay exact; the reservation is returned
    when the first object goes."""
    model = tiny_model("llama")
    one = freezing.weight_bytes(model)
    budget = freezing.FreezeBudget({"cpu": int(1.5 * one)})
    monkeypatch.setattr(specgraph.compiler, "FREEZE_BUDGET", budget)
    kw = dict(backend="inductor", max_batch_size=1, max_seq_len=48)
    plain, ngram = specgraph.compile(model, **kw), specgraph.compile(model, "ngram", num_speculative_tokens=2, **kw)
    ids, mask = left_pad([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    ref = hf_generate(model, ids, mask, max_new_tokens=10)
    assert_same(model, ids, mask, ref, sg_generate(plain, ids, mask, max_new_tokens=10), "frozen")
    assert plain.graph_frozen and all(plain.graph_frozen.values())
    assert budget.used["cpu"] == one * len(plain.graph_frozen) == one
    with pytest.warns(UserWarning, match="without freezing"):
        out = sg_generate(ngram, ids, mask, max_new_tokens=10)
    assert_same(model, ids, mask, ref, out, "past the budget")
    assert ngram.graph_frozen and not any(ngram.graph_frozen.values())
    assert ngram.stats.accepted > 0
    del plain
    gc.collect()
    assert budget.used["cpu"] == 0
