"""``num_speculative_tokens="auto"`` (specgraph.adaptive), the replay drafter, batch serving and the
planner, on tiny random models with the eager backend.

* greedy output equals ``model.generate`` with auto on, for every chain drafter, batch 1 and a
  left-padded batch of 5, while the depth really changes between rounds;
* the depth choices are a deterministic function of what was observed: the same seed gives the
  same sequence; speculation goes off (and is re-probed on a fixed schedule) when nothing is
  accepted and stays on when everything is;
* rows never affect each other: each row of a 32-row batch (ragged acceptance, rows stopping at
  different times) equals the row generated alone, and one depth serves the whole batch per round
  while the acceptance estimates are per row.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specgraph
from specgraph import adaptive
from specgraph.adaptive import (COST_MIN_PLAIN, COST_NEAR, PROBE_EVERY, PROBE_MAX, RECHECK_FIRST, AutoDepth, FixedDepth,
                                forced_depth)
from specgraph.drafters import ChainDrafter, ReplayDrafter
from specgraph.perfmodel import AcceptanceProfile, CostCurve, CostModel, LinearCost
from specgraph.planner import Plan
sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: share test_compile's helpers
from test_compile import PAD, PROMPT_1, PROMPTS_4, assert_same, hf_generate, left_pad, repeated, sg_generate, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

PROMPTS_5 = PROMPTS_4 + [repeated([3, 4, 5], 9)]
MAX_SEQ = 128


def cheap_plan(per_token: float = 0.05, beta: float = 0.6, depths=(2, 4, 8)) -> Plan:
    """A synthetic plan whose rounds are cheap (a GPU-like flat cost curve): auto speculates
    whenever rows accept, so the tests see it move between depths."""
    return Plan.from_measurements(CostModel(LinearCost(1.0, per_token)), AcceptanceProfile.from_beta(beta),
                                  [1, 2, 4, 8, 16, 32], depths)


def record_depths(fast) -> list[int]:
    """Every depth the policy chooses on ``fast`` from now on (traces are per call)."""
    seen = []
    orig = fast.policy.choose

    def choose(*a):
        k = orig(*a)
        seen.append(k)
        return k

    fast.policy.choose = choose
    return seen


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# ----------------------------------------------------------------------------------------------
# greedy equality with auto on


@pytest.mark.parametrize("kind", ["ngram", "suffix", "model", "self", "replay"])
def test_auto_greedy_equals_hf_generate(llama, kind):
    if kind == "model":
        draft = tiny_model("llama", seed=1)
    elif kind == "self":  # the draft cache must be caught up after plain rounds, or drafts go wrong
        draft = llama
    elif kind == "replay":
        draft = ReplayDrafter.from_model(llama, PROMPT_1 + PROMPTS_5, 24, beta=0.6, seed=3, eos_token_id=[])
    else:
        draft = kind
    fast = specgraph.compile(llama, draft, num_speculative_tokens="auto", plan=cheap_plan(), depths=[8, 2, 4],
                             backend="eager", max_batch_size=8, max_seq_len=MAX_SEQ)
    assert fast.k_ladder == [2, 4, 8] and fast.span == 9
    seen = record_depths(fast)
    for rows in (PROMPT_1, PROMPTS_5):
        ids, mask = left_pad(rows)
        ref = hf_generate(llama, ids, mask, max_new_tokens=24)
        out = sg_generate(fast, ids, mask, max_new_tokens=24)
        assert_same(llama, ids, mask, ref, out, f"auto draft={kind} B={len(rows)}")
        assert len(fast.policy.trace) == fast.stats.rounds  # one depth per round, shared by the batch
        if kind == "self":
            assert fast.stats.accepted == fast.stats.drafted, "a stale draft cache after plain rounds"
    assert set(seen) <= {0, 2, 4, 8}
    assert len(set(seen)) >= 2, f"auto never changed depth: {seen}"
    if kind in ("self", "replay"):
        assert any(k > 0 for k in seen)


def test_auto_with_default_cost_model_is_exact_and_turns_off_a_useless_draft(llama):
    """No plan: the conservative built-in curve; a draft as costly as the target never pays."""
    fast = specgraph.compile(llama, llama, num_speculative_tokens="auto", backend="eager", max_batch_size=8,
                             max_seq_len=MAX_SEQ)
    ids, mask = left_pad(PROMPTS_5)
    ref = hf_generate(llama, ids, mask, max_new_tokens=30)
    assert torch.equal(sg_generate(fast, ids, mask, max_new_tokens=30), ref)
    assert fast.policy.trace.count(0) >= 0.8 * len(fast.policy.trace), fast.policy.trace


# ----------------------------------------------------------------------------------------------
# gating: deterministic, off at β = 0, on at β = 1


def _replay_fast(model, rows, beta, n, **kw):
    rd = ReplayDrafter.from_model(model, rows, n, beta=beta, seed=0, eos_token_id=[])
    return specgraph.compile(model, rd, num_speculative_tokens="auto", backend="eager", max_batch_size=8,
                             max_seq_len=MAX_SEQ, **kw)


def test_gating_is_deterministic_under_a_seed(llama):
    fast = specgraph.compile(llama, "ngram", num_speculative_tokens="auto", plan=cheap_plan(), backend="eager",
                             max_batch_size=8, max_seq_len=MAX_SEQ)
    ids, mask = left_pad(PROMPTS_5)
    runs = []
    for _ in range(2):
        fast.policy.forget()  # the same state: otherwise the second call starts from the first's counts
        out = fast.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=True, temperature=0.8,
                            generator=torch.Generator().manual_seed(5), pad_token_id=PAD, eos_token_id=[])
        runs.append((out, list(fast.policy.trace)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
    assert len(set(runs[0][1])) >= 2, runs[0][1]


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_replay_beta_turns_speculation_off_or_keeps_it_on(llama, beta):
    ids, mask = left_pad(PROMPTS_4)
    fast = _replay_fast(llama, PROMPTS_4, beta, 60)
    ref = hf_generate(llama, ids, mask, max_new_tokens=60)
    out = sg_generate(fast, ids, mask, max_new_tokens=60)
    assert torch.equal(out, ref)
    trace = fast.policy.trace
    assert trace[:COST_MIN_PLAIN] == [0] * COST_MIN_PLAIN, trace  # plain rounds timed first
    if beta == 1.0:
        # every draft of the continuation is accepted: from the first drafted round (at once, or the
        # first re-probe: the prior's predicted gain is marginal for 4 rows under the built-in curve)
        # auto drafts every round, and goes to the deepest compiled depth (but for a last round
        # where every row has one token left: plain decoding emits it as well and costs less)
        on = trace.index(2)
        assert on in (COST_MIN_PLAIN, COST_MIN_PLAIN + PROBE_EVERY) and 0 not in trace[on:-1], trace
        assert 8 in trace and fast.stats.accepted >= 0.9 * fast.stats.drafted, (trace, fast.stats)
    else:
        assert fast.stats.accepted == 0
        on = [i for i, k in enumerate(trace) if k > 0]
        # off after the first drafted round (or from the start: the prior's predicted gain is
        # marginal for 4 rows under the built-in curve); then only the re-probe schedule: 8, 16, then
        # up to 32 plain rounds apart (the PROBE_BUDGET cap: a probe costs ~0.3 plain rounds here)
        gaps = [b - a - 1 for a, b in zip([COST_MIN_PLAIN - 1, *on], on)]
        start = gaps.index(8) if 8 in gaps else -1
        assert gaps[:start] in ([], [0]) and len(gaps) - start >= 2, trace
        probes = gaps[start:]
        assert probes[:2] == [8, 16] and all(16 <= b <= 2 * a for a, b in zip(probes[1:], probes[2:])), trace
        # probes run each depth not yet run in this call (nor timed at this bucket) once, smallest
        # first, then the smallest depth: every depth's in-loop cost is read before it is priced
        untimed = [d for d in (2, 4, 8) if d not in trace[: on[start]]]
        assert [trace[i] for i in on[start:]] == (untimed + [2] * len(on))[: len(on) - start], trace


def test_later_calls_start_from_what_earlier_calls_observed(llama):
    """A useless draft: the first call learns it (one drafted round, then plain); the second call's
    rows start from the pooled memory and never draft before the first re-probe. forget() brings the
    first call's behaviour back, round for round."""
    ids, mask = left_pad(PROMPTS_4)
    fast = _replay_fast(llama, PROMPTS_4, 0.0, 30)
    ref = hf_generate(llama, ids, mask, max_new_tokens=30)
    traces = []
    for forget in (False, False, True):
        if forget:
            fast.policy.forget()
        assert torch.equal(sg_generate(fast, ids, mask, max_new_tokens=30), ref)
        traces.append(list(fast.policy.trace))
        assert np.isnan(fast.policy.pooled_acceptance()[0]) == (len(traces) == 1 or forget)
    first, second, after_forget = traces
    c = COST_MIN_PLAIN  # the first call times plain rounds first; later ones need not
    on = first.index(2)  # at once, or at the first re-probe (the prior's gain is marginal here)
    assert first[:c] == [0] * c and on in (c, c + PROBE_EVERY) and first[on + 1] == 0, first
    assert second[: PROBE_EVERY] == [0] * PROBE_EVERY and second.count(2) < first.count(2), (first, second)
    assert after_forget == first


def test_memory_pools_rows_per_position_and_fades_per_call():
    pol = AutoDepth([2], CostModel(LinearCost(1.0, 0.05)), learn_cost=False)
    pol._reset(2, 2)
    assert np.isnan(pol.pooled_acceptance()).all()  # nothing earlier
    for _ in range(3):
        pol._update(2, [3, 1], [True, True])  # row 0 accepts both drafts, row 1 none
    pol._reset(1, 1)  # a new call: the two rows are pooled
    pooled = pol.pooled_acceptance()
    assert pooled[0] == pytest.approx(0.5) and pooled[1] == pytest.approx(1.0), pooled  # position 2 only saw row 0
    assert pol.acceptance()[0].tolist() == pytest.approx(pooled.tolist())  # the new row starts there
    for _ in range(4):  # calls that draft nothing: the memory halves each time, then is dropped
        pol._reset(1, 1)
    assert np.isnan(pol.pooled_acceptance()).all()
    assert pol.acceptance()[0, 0] == pytest.approx(0.5)  # back to the static prior


def test_memory_pools_whole_calls_not_the_rows_latest_rounds():
    """A call whose row accepts the first draft in 10 of 16 rounds, the last 6 rejected: the memory
    holds 10/16, not the row's EWMA at the call's end (which weighs its last ~6 rounds and can read
    a draft accepting 30% as ~10%)."""
    pol = AutoDepth([2], CostModel(LinearCost(1.0, 0.05)), learn_cost=False)
    pol._reset(1, 1)
    for r in range(16):
        pol._update(2, [2 if r < 10 else 1], [True])
    ewma = pol.acc[0, 0] / pol.cnt[0, 0]  # what pooling the rows' EWMA would give
    pol._reset(1, 1)
    assert pol.pooled_acceptance()[0] == pytest.approx(10 / 16)
    assert ewma < 0.35


def test_one_call_adds_at_most_call_obs_observations_to_the_memory():
    """A call is one sample of the workload whatever its batch: a B = 4 call drafting depth 4 for
    13 rounds (52 observations at position 1) enters the memory as CALL_OBS of them, so a later
    B = 2 call's 8 observations move it (uncapped, the B = 4 calls would hold the memory for
    several calls after the workload changes, each call starting from a stale acceptance)."""
    pol = AutoDepth([4], CostModel(LinearCost(1.0, 0.05)), learn_cost=False)
    pol._reset(4, 4)
    for _ in range(13):
        pol._update(4, [3] * 4, [True] * 4)  # every row accepts drafts 1-2, rejects draft 3
    pol._reset(2, 2)
    assert pol.mem_cnt.tolist() == pytest.approx([adaptive.CALL_OBS] * 3 + [0.0])
    assert pol.pooled_acceptance()[:3].tolist() == pytest.approx([1.0, 1.0, 0.0])
    for _ in range(4):
        pol._update(4, [1, 1], [True, True])  # the workload changed: nothing accepted
    pol._reset(2, 2)
    keep = adaptive.MEMORY_KEEP * adaptive.CALL_OBS
    assert pol.pooled_acceptance()[0] == pytest.approx(keep / (keep + 8.0))  # 1/3 (counts uncapped: 0.76)


def test_no_probe_in_a_round_that_can_only_emit_one_token():
    """A probe in a round where every live row has one token left emits nothing a plain round
    would not and costs a drafted round."""
    pol = AutoDepth([2], CostModel(LinearCost(1.0, 0.05)), learn_cost=False)
    pol._reset(2, 2)
    for _ in range(20):
        pol._update(2, [1, 1], [True, True])  # a useless draft: auto is off
    pol.off_rounds = pol.wait + 1  # a probe is due
    assert pol._decide([True, True], [1, 1]) == 0
    assert pol._decide([True, False], [2, 0]) == 2  # a live row has two tokens left: it probes


def test_pooled_memory_keeps_its_weight_through_a_row_s_unlucky_rounds():
    """Depth 2 costs 1.16x a plain round and the workload accepts 30% (pays from ~17%): after
    calls that saw 30%, a new row's three rejections in a row do not switch speculation off; its
    own EWMA alone (pool_weight=0, the prior still fading) does."""
    cost = SimpleNamespace(round_cost=lambda d, b: {0: 1.0, 2: 1.16}[d])
    decisions = {}
    for w in (4.0, 0.0):
        pol = AutoDepth([2], cost, learn_cost=False, pool_weight=w)
        pol._reset(1, 1)
        for r in range(20):  # an earlier call: 6 of 20 first drafts accepted
            pol._update(2, [2 if r % 10 < 3 else 1], [True])
        pol._reset(1, 1)
        assert pol.pooled_acceptance()[0] == pytest.approx(0.3)
        for _ in range(3):
            pol._update(2, [1], [True])
        decisions[w] = pol._decide([True])
    assert decisions == {4.0: 2, 0.0: 0}


def replay_calls(pol, betas, B, rounds=8, depth=4, seed=0):
    """One call per entry of ``betas`` ([call] or [call][row] acceptance), each of ``rounds`` rounds
    at ``depth`` on a B-row batch, every draft accepted with that probability until the first miss;
    the last call is folded into the memory (a new call starts)."""
    rng = np.random.default_rng(seed)
    for beta in betas:
        pol._reset(B, B)
        p = np.broadcast_to(np.asarray(beta, dtype=np.float64), (B,))
        for _ in range(rounds):
            hits = rng.random((B, depth)) < p[:, None]
            pol._update(depth, list(1 + np.cumprod(hits, axis=1).sum(axis=1)), [True] * B)
    pol._reset(B, B)


def test_rows_weight_reads_whether_the_batch_s_rows_accept_alike():
    """Before any call with several rows drafted, nothing is said (None: rows lean on the memory
    alone); after calls whose rows all accept 60%, a row's prior is worth many observations
    (up to POOL_MAX); after calls whose rows accept 5% or 95%, hardly any."""
    cost = CostModel(LinearCost(1.0, 0.05))
    alike, apart = AutoDepth([4], cost, learn_cost=False), AutoDepth([4], cost, learn_cost=False)
    assert alike.rows_weight() is None
    replay_calls(alike, [[0.6] * 4] * 6, 4)
    replay_calls(apart, [[0.05, 0.95] * 2] * 6, 4)
    assert alike.rows_weight() >= 16 and apart.rows_weight() <= 1, (alike.rows_weight(), apart.rows_weight())
    one_row = AutoDepth([4], cost, learn_cost=False)
    replay_calls(one_row, [0.6] * 6, 1)
    assert one_row.rows_weight() is None  # one-row calls show no spread across rows


def test_memory_weight_grows_while_calls_agree_and_falls_when_the_workload_changes():
    """The memory counts as many observations as it has predicted calls' acceptance well: at
    least pool_weight, near POOL_MAX after calls at one acceptance, and back to pool_weight once
    calls alternate between 10% and 90%."""
    pol = AutoDepth([4], CostModel(LinearCost(1.0, 0.05)), learn_cost=False)
    assert pol.memory_weight() == adaptive.POOL_WEIGHT
    replay_calls(pol, [0.6] * 8, 4)
    assert pol.memory_weight() >= 16, pol.memory_weight()
    replay_calls(pol, [0.1, 0.9] * 3, 4, seed=1)
    assert pol.memory_weight() == adaptive.POOL_WEIGHT


def test_one_unlucky_round_does_not_switch_a_batch_off(monkeypatch):
    """Round costs at B = 4 (depth 2: 1.63x a plain round, depth 4: 1.65x), calls at 60%: depth 4
    pays. A new call's first round rejects every row's first draft (2.6% of rounds): with the
    memory and the other rows counting as what they were seen to be worth, auto keeps drafting;
    with both held to pool_weight (POOL_MAX = 4) the four rejections read as 32% acceptance and
    switch the call off."""
    cost = SimpleNamespace(round_cost=lambda d, b: {0: 1.0, 2: 1.63, 4: 1.65}[d])
    decisions, caps = {}, (adaptive.POOL_MAX, adaptive.POOL_WEIGHT)
    for cap in caps:
        monkeypatch.setattr(adaptive, "POOL_MAX", cap)
        pol = AutoDepth([2, 4], cost, learn_cost=False)
        replay_calls(pol, [0.6] * 8, 4)
        pol._update(4, [1] * 4, [True] * 4)
        decisions[cap] = pol._decide([True] * 4, np.full(4, 23))
    assert decisions == {caps[0]: 4, caps[1]: 0}, decisions


def simulate_replay(pol, beta, cost, seed, fixed=0, calls=20, max_new=24, drift=False):
    """Tokens per second of ``pol`` (None: depth ``fixed`` every round) on one row accepting each
    draft i.i.d. with probability ``beta`` (fresh draws every call), calls of ``max_new`` tokens, a
    round at depth d taking cost[d] on the policy's clock; the first 4 calls warm up. ``drift``: the
    host turns 2.5x slower in stretches (15% chance per round to start one, 20% to end it; ~43% of
    rounds), with 10% lognormal jitter on every round."""
    rng = np.random.default_rng(seed)
    fake = SimpleNamespace(draft="custom", backend="eager")
    clock = FakeClock()
    if pol is not None:
        pol.clock = clock
    slow, tokens, spent = False, 0.0, 0.0
    for c in range(calls):
        clean = rng.random(max_new + 8) < beta
        if pol is not None:
            pol.start(fake, [[1, 2, 3]], 1, "cpu")
        n = 0
        while n < max_new:
            k = pol.choose([False], [0], None, [max_new - n]) if pol is not None else fixed
            a = 0
            while a < k and clean[n + a]:
                a += 1
            dt = cost[k]
            if drift:
                slow = rng.random() < (0.8 if slow else 0.15)
                dt *= (2.5 if slow else 1.0) * float(np.exp(rng.normal(0.0, 0.1)))
            clock.t += dt
            if pol is not None:
                pol.observe(k, [a + 1], [False], [0])
            if c >= 4:
                tokens, spent = tokens + min(a + 1, max_new - n), spent + dt
            n += a + 1
    return tokens / spent


def test_auto_matches_the_best_depth_near_the_break_even_acceptance():
    """A replay draft at B = 1 near break-even, simulated without a model: in-loop costs plain 1,
    depth 2 1.16, depth 4 2.04, beta = 0.3 (depth 2 pays from ~17%), 24-token calls. Over 8 seeded
    workloads auto reaches >= 0.95x the best of off and fixed depths."""
    cost = {0: 1.0, 2: 1.16, 4: 2.04}
    model = SimpleNamespace(round_cost=lambda d, b: cost[d])
    ratios = []
    for seed in range(8):
        auto = simulate_replay(AutoDepth([2, 4], model, learn_cost=False), 0.3, cost, seed)
        best = max(simulate_replay(None, 0.3, cost, seed, fixed=k) for k in (0, 2, 4))
        ratios.append(auto / best)
    assert np.mean(ratios) >= 0.95, ratios


def test_auto_learns_round_costs_on_a_drifting_host():
    """In-loop costs plain 1, depth 2 1.16, depth 4 2.04, beta = 0.5, and a host slow 2.5x for
    stretches. Timing drafted rounds against plain rounds from elsewhere in the call (or the
    bucket's median from earlier calls) prices depth 2 out in slow stretches; timing them only near
    plain rounds, and never below plain decoding, keeps auto at >= 0.92x the best fixed method on
    average over 24 seeded hosts."""
    cost = {0: 1.0, 2: 1.16, 4: 2.04}
    model = SimpleNamespace(round_cost=lambda d, b: cost[d])
    ratios = []
    for seed in range(24):
        run = dict(calls=24, drift=True)
        auto = simulate_replay(AutoDepth([2, 4], model), 0.5, cost, seed, **run)
        ratios.append(auto / max(simulate_replay(None, 0.5, cost, seed, fixed=k, **run) for k in (0, 2, 4)))
    assert np.mean(ratios) >= 0.92, ratios


def test_policy_switches_back_on_after_a_probe():
    """Unit test of the schedule: rows reject everything, speculation goes off; then rows accept
    everything, and the next probe turns it back on."""
    pol = AutoDepth([2, 4], CostModel(LinearCost(1.0, 0.05)), learn_cost=False)
    pol._reset(2, 2)
    chosen = []
    for r in range(40):
        k = pol._decide([True, True])
        chosen.append(k)
        if k:
            pol._update(k, [1, 1] if r < 15 else [k + 1, k + 1], [True, True])
    first_off = chosen.index(0)
    assert first_off < 8
    back_on = next(i for i in range(16, 40) if chosen[i] > 0)
    assert all(k > 0 for k in chosen[back_on:]), chosen
    assert chosen[-1] == 4


def test_per_row_estimates_follow_each_row():
    pol = AutoDepth([2, 4], CostModel(LinearCost(1.0, 0.05)), learn_cost=False)
    pol._reset(3, 4)
    for _ in range(6):
        pol._update(4, [5, 1, 3], [True, True, False])  # row 0 accepts all, row 1 none, row 2 done
    a = pol.acceptance()
    assert a.shape == (3, 4)
    assert a[0].min() > 0.8 and a[1, 0] < 0.2
    assert torch.allclose(torch.tensor(a[2]), torch.full((4,), 0.5, dtype=torch.float64))  # untouched prior


def test_prior_fades_so_a_useless_draft_is_switched_off_even_when_drafts_are_cheap():
    """Drafts that are never accepted, rounds at depth 2 only 10% dearer than plain: the estimate
    must fall well below the 10% that would still pay. With the prior's weight fixed it would stay
    at ~12% forever and speculation would never turn off."""
    pol = AutoDepth([2], CostModel(LinearCost(1.0, 0.05)), learn_cost=False)
    pol._reset(1, 1)
    for _ in range(20):
        pol._update(2, [1], [True])
    assert pol.acceptance()[0, 0] < 0.02
    assert pol._decide([True]) == 0
    # a fixed-weight prior's estimate from the same counts, for contrast: the prior at its full weight
    old = (pol.acc[0, 0] + pol.prior_weight * pol.prior) / (pol.cnt[0, 0] + pol.prior_weight)
    assert old > 0.1


class FakeClock:
    """Advanced by hand: a round at depth d 'takes' cost[d] seconds."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def simulate_calls(pol, real_cost, n_calls=2, rounds=40, emitted=2, compiles=()):
    """Runs ``pol`` through ``n_calls`` calls of ``rounds`` rounds on one row that accepts the first
    draft of every round and nothing after it; each round takes real_cost[depth run] on the clock.
    Rounds (call, round) in ``compiles`` also build a graph, which takes 100 s more."""
    fake = SimpleNamespace(draft="ngram", backend="inductor", _fns={})
    pol.clock = clock = FakeClock()
    traces = []
    for c in range(n_calls):
        pol.start(fake, [[1, 2, 3]], 1, "cpu")
        for r in range(rounds):
            k = pol.choose([False], [2], None)
            clock.t += real_cost[k]
            if (c, r) in compiles:
                fake._fns[(c, r)] = None
                clock.t += 100.0
            pol.observe(k, [min(emitted, k + 1)], [False], [2])
        traces.append(list(pol.trace))
    return traces


def test_round_costs_learned_in_the_loop_turn_off_drafts_the_cost_model_thinks_free():
    """The cost model says a round at any depth costs a plain step; in the loop depth 2 costs 2.5x
    and depth 4 4x. Rows emit 2 tokens per drafted round, so drafting pays on the model (2 > 1) and
    loses in the loop (2 / 2.5 < 1). The first call times 3 plain rounds, then drafts on the model;
    from the second call the measured factors price the drafts and it stays off but for re-probes."""
    real = {0: 1.0, 2: 2.5, 4: 4.0}
    pol = AutoDepth([2, 4], CostModel(LinearCost(1.0, 0.0)))
    first, second = simulate_calls(pol, real)
    # on the model the deepest depth wins (free rounds, any acceptance left): depth 4 ran every round
    # but for one cost re-check after RECHECK_FIRST of them (a plain round, then depth 2), which
    # timed depth 2 too: both factors are the loop's
    c, r = COST_MIN_PLAIN, COST_MIN_PLAIN + RECHECK_FIRST
    assert first[:c] == [0] * c and first[c:r] == [4] * RECHECK_FIRST and first[r:r + 2] == [0, 2], first
    assert set(first[r + 2:]) == {4} and pol.cost_factors(1).tolist() == pytest.approx([1.0, 2.5, 4.0])
    assert sum(k > 0 for k in second) <= 3 and second[0] == 0, second  # re-probes only
    # the round times: one per round but the last, with the depth that ran
    assert [k for k, _ in pol.round_times] == second[:-1]
    assert [t for _, t in pol.round_times] == pytest.approx([real[k] for k in second[:-1]])
    # deterministic: a fresh policy on the same clock makes the same choices; without learning the
    # second call drafts like the first
    assert simulate_calls(AutoDepth([2, 4], CostModel(LinearCost(1.0, 0.0))), real) == [first, second]
    blind = simulate_calls(AutoDepth([2, 4], CostModel(LinearCost(1.0, 0.0)), learn_cost=False), real)
    assert all(k > 0 for k in blind[1]), blind
    pol.forget()  # drops the times too
    assert pol.cost_factors(1).tolist() == [1.0, 1.0, 1.0]


def test_rounds_that_build_a_graph_are_not_timed():
    """A compile inside a round (a new attended width, a graph's first use) says nothing about what
    the round costs. Drafts pay in the loop, and the first call's few drafted rounds mostly compile
    (100 s each). Auto makes the same choices as without the compiles (drafting all through the
    second call; timing them priced drafts out for good), and the compiling rounds are left out of
    round_times."""
    real = {0: 1.0, 2: 1.05, 4: 1.1}
    clean = simulate_calls(AutoDepth([2, 4], CostModel(LinearCost(1.0, 0.9))), real)
    drafted = [r for r, k in enumerate(clean[0]) if k > 0]
    compiles = {(0, r) for r in drafted[:5]} | {(1, 0), (1, 7), (1, 30)}
    pol = AutoDepth([2, 4], CostModel(LinearCost(1.0, 0.9)))
    # drafting all through the second call but for one cost re-check (a plain round)
    assert simulate_calls(pol, real, compiles=compiles) == clean and clean[1].count(0) == 1
    timed = [r for r in range(39) if (1, r) not in compiles]  # the last round is never timed
    assert len(pol.round_times) == len(timed) == 36
    assert [t for _, t in pol.round_times] == pytest.approx([real[clean[1][r]] for r in timed])


def test_drafted_round_times_are_taken_relative_to_nearby_plain_rounds():
    """The host slows 2.5x for a stretch of a call, and the two probes at depth 2 (1.04x a plain
    round at any speed) fall in it. Against the call's median plain round they read 2.6x and would
    price depth 2 out; against the plain rounds run around them they read 1.04x."""
    pol = AutoDepth([2, 4], CostModel(LinearCost(1.0, 0.0)))  # every depth modelled at 1
    pol._reset(1, 1)
    slow = [(0, 2.5), (2, 2.6), (0, 2.5), (0, 2.5), (2, 2.6), (0, 2.5)]
    pol.round_times = [(0, 1.0)] * 6 + slow + [(0, 1.0)] * 6
    pol._reset(1, 1)  # the next call folds them in
    assert pol.cost_factors(1).tolist() == pytest.approx([1.0, 1.04, 1.04])
    pol.round_times = [(4, 1.1)] * 3  # a call that only drafted: no plain round to compare with
    pol._reset(1, 1)
    assert pol.cost_factors(1).tolist() == pytest.approx([1.0, 1.04, 1.04])


def test_drafted_rounds_far_from_plain_rounds_are_not_timed():
    """Plain rounds, then a long drafted stretch whose second half ran 2.5x slower (the host, not
    the depth): only the drafted rounds within COST_NEAR rounds of a plain round are timed, and
    depth 2 keeps its true 1.1x; timed against the call's plain rounds all of them read ~1.9x."""
    pol = AutoDepth([2], CostModel(LinearCost(1.0, 0.0)))
    pol._reset(1, 1)
    pol.round_times = [(0, 1.0)] * 4 + [(2, 1.1)] * 8 + [(2, 2.75)] * 12
    pol._reset(1, 1)
    assert len(pol.timed[1][2]) == COST_NEAR
    assert pol.cost_factors(1).tolist() == pytest.approx([1.0, 1.1])


def test_a_drafted_depth_never_costs_less_than_plain_decoding():
    """Timing noise can price a drafted depth below a plain round; a depth's round cost is at least
    the shallower ones' (it does their work and more), so a draft accepting nothing stays off."""
    pol = AutoDepth([2, 4], CostModel(LinearCost(1.0, 0.0)))  # every depth modelled at 1
    pol._reset(1, 1)
    pol.round_times = [(0, 1.0), (2, 0.8), (0, 1.0), (4, 0.9), (0, 1.0)]
    pol._reset(1, 1)
    assert pol.cost_factors(1).tolist() == pytest.approx([1.0, 0.8, 0.9])
    assert pol.round_cost.tolist() == pytest.approx([1.0, 1.0, 1.0])
    for _ in range(30):
        pol._update(2, [1], [True])
    assert pol._decide([True]) == 0  # unclamped, depth 2 at 0.8 would win on 1 token per round


def test_a_deeper_depth_cheaper_than_a_shallower_one_is_priced_as_measured(monkeypatch):
    """On a CPU a GEMM over more rows can run faster (here at B = 4: 5 query tokens per row 567 ms,
    3 tokens 643 ms, plain 388 ms). Only plain decoding bounds a drafted depth's cost from below:
    clamped to depth 2's cost, depth 4 pays only from ~55% acceptance, not ~45%."""
    curve = CostCurve({4: {1: 0.388, 3: 0.643, 5: 0.567}})
    pol = AutoDepth([2, 4], CostModel(curve), AcceptanceProfile.from_beta(0.5), learn_cost=False)
    pol._reset(4, 4)
    assert pol.round_cost.tolist() == pytest.approx([0.388, 0.643, 0.567])
    left = np.full(4, 24)
    assert pol._decide([True] * 4, left) == 4
    monkeypatch.setattr(pol, "round_cost", np.maximum.accumulate(pol.round_cost))  # clamped to shallower depths
    assert pol._decide([True] * 4, left) == 0


def test_round_costs_learned_in_the_loop_keep_drafts_that_pay():
    """The mirror case: the model prices drafts dear (per-token cost 1), the loop finds them
    nearly free; from the second call auto drafts where the model kept it off. (Depth 4's predicted
    rate there is exactly 1 / (1 + RECHECK_BAND) of depth 2's: float rounding decides whether a cost
    re-check runs.)"""
    real = {0: 1.0, 2: 1.05, 4: 1.1}
    pol = AutoDepth([2, 4], CostModel(LinearCost(1.0, 1.0)))
    first, second = simulate_calls(pol, real, emitted=2)
    assert sum(k > 0 for k in first) <= 10, first  # the model: depth 2 costs 2x a plain step, so mostly off
    # every round drafts but for at most one cost re-check: a plain round, then the runner-up depth 4
    checks = [i for i, k in enumerate(second) if k == 0]
    rest = [k for i, k in enumerate(second) if i not in checks and i - 1 not in checks]
    assert len(checks) <= 1 and rest == [2] * (40 - 2 * len(checks)), second
    assert all(i >= RECHECK_FIRST and second[i + 1] == 4 for i in checks), second


def batch_calls(pol, cost, calls, max_new=24, seed=0):
    """One call per (acceptance, B) in ``calls`` on a B-row batch of ``max_new``-token rows, each draft
    accepted with that probability until the first miss, a round at depth d taking cost[B][d] on the
    policy's clock: the depths of each call."""
    rng = np.random.default_rng(seed)
    fake = SimpleNamespace(draft="custom", backend="eager", _fns={})
    pol.clock = clock = FakeClock()
    traces = []
    for beta, B in calls:
        pol.start(fake, [[1, 2, 3]] * B, B, "cpu")
        left = np.full(B, max_new)
        while (left > 0).any():
            done = list(left <= 0)
            k = pol.choose(done, [2] * B, None, list(left))
            clock.t += cost[B][k]
            a = np.cumprod(rng.random((B, k)) < beta, axis=1).sum(axis=1)  # [B] drafts accepted
            pol.observe(k, list(a + 1), done, [2] * B)
            left = left - np.where(left > 0, np.minimum(a + 1, left), 0)
        traces.append(list(pol.trace))
    return traces


def test_probes_time_each_depth_once_so_a_deep_depth_the_curve_overprices_is_found(monkeypatch):
    """At B = 4 the cost curve reads depth 2 at 2.04x and depth 4 at 2.22x a plain round; in the
    loop both run at ~1.5x. As in batch_bench, B = 4 calls at 30% acceptance (plain
    wins) come first, then B = 1 calls at 60% (the memory learns 60%), then B = 4 calls at 60%,
    where depth 4 pays (~1.15x plain). Probing at depth 2 only, auto would correct depth 2's price
    but price depth 4 from the curve times depth 2's in-loop ratio (1.63x) and run most of the 60%
    B = 4 calls plain; probing each untimed depth once, the 30% calls read depth 4's price and the
    60% calls draft at depth 4."""
    curve = CostCurve({1: {1: 0.191, 3: 0.211, 5: 0.383}, 4: {1: 0.360, 3: 0.733, 5: 0.798}})
    loop = {1: {0: 0.19, 2: 0.20, 4: 0.34}, 4: {0: 0.36, 2: 0.57, 4: 0.53}}
    calls = [(0.3, 4)] * 4 + [(0.6, 1)] * 8 + [(0.6, 4)] * 4

    def share_at_4(seed):  # over the 60% B = 4 calls
        depths = [k for trace in batch_calls(AutoDepth([2, 4], CostModel(curve)), loop, calls, seed=seed)[12:]
                  for k in trace]
        return depths.count(4) / len(depths)

    probing_each = [share_at_4(seed) for seed in range(10)]
    monkeypatch.setattr(AutoDepth, "_probe_depth", lambda self: self.depths[1])
    probing_2 = [share_at_4(seed) for seed in range(10)]
    assert np.mean(probing_each) > 0.75 and np.mean(probing_2) < 0.5, (probing_each, probing_2)


def test_probe_schedule_carries_over_between_calls():
    """A draft that is never accepted, over two calls of 40 rounds: the re-probes keep doubling
    their wait across the call boundary as if it were one call of 80 rounds (restarting the
    schedule each call re-probed 3-4 times per call). A probe costs 2.5 / 1.5 plain rounds here: the
    PROBE_BUDGET cap (a wait of ~67 rounds) is above PROBE_MAX."""
    pol = AutoDepth([2], CostModel(LinearCost(1.0, 0.5)), learn_cost=False)
    first, second = simulate_calls(pol, {0: 1.0, 2: 1.0}, rounds=40, emitted=1)
    on = [i for i, k in enumerate(first + second) if k > 0]
    gaps = [b - a - 1 for a, b in zip(on, on[1:]) if b - a > 1]  # after the prior's first drafted rounds
    assert gaps == [min(PROBE_EVERY * 2**i, PROBE_MAX) for i in range(3)], on
    assert second.index(2) > PROBE_EVERY, second  # a restarted schedule would probe after 8 plain rounds
    pol.forget()
    assert simulate_calls(pol, {0: 1.0, 2: 1.0}, n_calls=1, rounds=40, emitted=1)[0] == first


def test_probes_of_a_draft_just_short_of_paying_come_often():
    """The wait between re-probes is capped where a probe is cheap: a never-accepted draft whose
    round costs 1.095 plain rounds loses ~0.095 of one per probe, so probing every ~10 rounds keeps
    to PROBE_BUDGET (1%) of the time; doubling alone waits up to PROBE_MAX = 64 rounds, slow to
    notice a workload that begins to accept."""
    pol = AutoDepth([2], CostModel(LinearCost(1.0, 0.05)), learn_cost=False)
    (trace,) = simulate_calls(pol, {0: 1.0, 2: 1.0}, n_calls=1, rounds=160, emitted=1)
    on = [i for i, k in enumerate(trace) if k > 0]
    gaps = [b - a - 1 for a, b in zip(on, on[1:]) if b - a > 1]
    assert gaps[0] == PROBE_EVERY and len(gaps) >= 12, on
    assert all(PROBE_EVERY <= g <= 10 for g in gaps), gaps
    loss = 1.15 / 1.05 - 1.0  # per probe, in plain rounds (no draft accepted)
    assert len(gaps) * loss / len(trace) <= 1.2 * adaptive.PROBE_BUDGET


def test_round_times_record_the_depth_that_ran(llama):
    ids, mask = left_pad(PROMPTS_4)
    fast = _replay_fast(llama, PROMPTS_4, 1.0, 20)
    sg_generate(fast, ids, mask, max_new_tokens=20)
    times = fast.policy.round_times
    assert len(times) == fast.stats.rounds - 1
    assert [k for k, _ in times] == fast.policy.trace[:-1]  # replay always proposes: the chosen depth ran
    assert all(t > 0 for _, t in times)


# ----------------------------------------------------------------------------------------------
# batch serving: rows independent, up to 32


def test_rows_alone_equal_rows_in_a_batch_of_32(llama):
    g = torch.Generator().manual_seed(11)
    rows = []
    for i in range(32):
        period = 2 + i % 5
        pattern = torch.randint(2, 100, (period,), generator=g).tolist()
        rows.append(repeated(pattern, 3 + (7 * i) % 29))
    rd = ReplayDrafter.from_model(llama, rows, 24, beta=0.7, seed=1, eos_token_id=[])
    fast = specgraph.compile(llama, rd, num_speculative_tokens="auto", plan=cheap_plan(), backend="eager",
                             max_batch_size=32, max_seq_len=MAX_SEQ)
    ids, mask = left_pad(rows)
    eos = 77  # stops some rows early: rows finish at different times
    batched = fast.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=PAD, eos_token_id=eos)
    assert fast.policy.acceptance().shape[0] == 32  # per-row estimates ...
    assert len(fast.policy.trace) == fast.stats.rounds  # ... one depth per round for the batch
    per_row = fast.policy.acceptance()[:, 0]
    assert per_row.max() - per_row.min() > 0.1, "ragged acceptance expected across rows"
    T = ids.shape[1]
    stopped = 0
    for b, r in enumerate(rows):
        alone = fast.generate(torch.tensor([r]), max_new_tokens=24, pad_token_id=PAD, eos_token_id=eos)
        new_alone = alone[0, len(r):].tolist()
        new_batched = batched[b, T:].tolist()[: len(new_alone)]
        assert new_batched == new_alone, f"row {b}"
        assert all(t == PAD for t in batched[b, T + len(new_alone):].tolist())
        stopped += len(new_alone) < 24
    assert 0 < stopped < 32, "EOS should stop some rows and not others"
    ref = hf_generate(llama, ids, mask, max_new_tokens=24, eos_token_id=eos)
    assert torch.equal(batched, ref)


# ----------------------------------------------------------------------------------------------
# plumbing and refusals


def test_forced_depth_restores_the_object(llama):
    fast = specgraph.compile(llama, "ngram", num_speculative_tokens="auto", backend="eager", max_batch_size=2,
                             max_seq_len=MAX_SEQ)
    pol, k, span = fast.policy, fast.k, fast.span
    ids, mask = left_pad(PROMPT_1)
    ref = hf_generate(llama, ids, mask, max_new_tokens=12)
    with forced_depth(fast, 12) as fixed:
        assert isinstance(fixed, FixedDepth)
        assert torch.equal(sg_generate(fast, ids, mask, max_new_tokens=12), ref)
        assert set(fixed.trace) == {12}
    assert (fast.policy, fast.k, fast.span) == (pol, k, span)


def test_custom_chain_drafter_protocol(llama):
    class Nothing(ChainDrafter):  # proposes nothing: every round is a plain step
        def propose(self, hist, L, k, active):
            return None

    fast = specgraph.compile(llama, Nothing(), backend="eager", max_seq_len=MAX_SEQ)
    ids, mask = left_pad(PROMPT_1)
    assert torch.equal(sg_generate(fast, ids, mask, max_new_tokens=10), hf_generate(llama, ids, mask, max_new_tokens=10))
    assert fast.stats.drafted == 0
    with pytest.raises(ValueError, match="chains"):
        specgraph.compile(llama, Nothing(), tree=[(0,)], backend="eager")


@pytest.mark.parametrize("kwargs, match", [
    (dict(draft=None, num_speculative_tokens="auto"), "auto"),
    (dict(draft="ngram", num_speculative_tokens="fast"), "'auto'"),
    (dict(draft="ngram", num_speculative_tokens="auto", tree=[(0,), (0, 0)]), "auto"),
    (dict(draft="ngram", num_speculative_tokens=4, plan=cheap_plan()), "plan="),
    (dict(draft="ngram", num_speculative_tokens="auto", depths=[0]), "positive"),
])
def test_auto_refusals(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        specgraph.compile(llama, backend="eager", **kwargs)


def test_replay_drafter_unknown_prompt_is_refused(llama):
    rd = ReplayDrafter({(1, 2): [3, 4]}, beta=1.0, vocab_size=128)
    fast = specgraph.compile(llama, rd, backend="eager", max_seq_len=MAX_SEQ)
    with pytest.raises(ValueError, match="no continuation"):
        fast.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)


def test_replay_drafter_acceptance_rate(llama):
    """Per-position acceptance is i.i.d. β: the measured first-position acceptance is near β."""
    rows = [repeated([i + 2, i + 40, i + 7], 6) for i in range(8)]
    rd = ReplayDrafter.from_model(llama, rows, 64, beta=0.6, seed=2, eos_token_id=[])
    fast = specgraph.compile(llama, rd, num_speculative_tokens=1, backend="eager", max_batch_size=8,
                             max_seq_len=MAX_SEQ, depths=[1])
    ids, mask = left_pad(rows)
    assert torch.equal(sg_generate(fast, ids, mask, max_new_tokens=64), hf_generate(llama, ids, mask, max_new_tokens=64))
    rate = fast.stats.accepted / fast.stats.drafted
    assert abs(rate - 0.6) < 0.1, rate


# ----------------------------------------------------------------------------------------------
# the planner


def test_plan_measures_fits_recommends_and_round_trips(llama, tmp_path):
    fast = specgraph.compile(llama, "ngram", num_speculative_tokens=4, backend="eager", max_batch_size=2,
                             max_seq_len=MAX_SEQ)
    prompts = [repeated([11, 42, 7, 93], 13), repeated([17, 64, 3, 88, 25], 20)]
    p = specgraph.plan(fast, prompts, batch_sizes=[1, 2], grid=[1, 2, 3, 5], max_new_tokens=16, repeats=2,
                       measure_depths=[1, 2, 4], measure_batch_sizes=[1, 2], progress=False,
                       eos_token_id=[], pad_token_id=PAD)
    assert set(p.recommended) == {1, 2} and all(0 <= g <= 4 for g in p.recommended.values())
    assert set(p.measured) == {1, 2} and all({1, 2, 4} <= set(row) for row in p.measured.values())
    for b, g in p.recommended.items():  # the recommended depth is measured too (it may be 3)
        assert g == 0 or g in p.measured[b]
        assert set(p.measured[b]) - {1, 2, 4} <= {g}
    assert all(s > 0 for row in p.measured.values() for s in row.values())
    assert p.profile.draft_rate > 0 and p.profile.survival[0] > 0  # repetitive prompts: lookups accepted
    assert fast.policy is None and fast.k == 4  # the object is left as it was
    for b, g in p.recommended.items():  # the argmax of the fitted model, if it beats plain by MARGIN
        best = max(range(0, 5), key=lambda x: (p.speedup(x, b), -x))
        if p.speedup(best, b) > 1.0 + adaptive.MARGIN:
            assert p.speedup(g, b) == pytest.approx(p.speedup(best, b))
        else:
            assert g == 0
    files = p.save(tmp_path)
    back = Plan.load(tmp_path)
    assert back.recommended == p.recommended and back.measured == p.measured
    assert back.speedup(2, 2) == pytest.approx(p.speedup(2, 2))
    assert json.loads(files["json"].read_text())["format"] == "specgraph-plan"
    if files["png"] is not None:
        assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the plan drives auto: its costs, its acceptance prior, and its depths (the recommended ones)
    auto = specgraph.compile(llama, "ngram", num_speculative_tokens="auto", plan=tmp_path / "plan.json",
                             backend="eager", max_batch_size=2, max_seq_len=MAX_SEQ)
    rec = sorted({g for g in p.recommended.values() if g > 0}) or [2]
    assert auto.k_ladder == rec
    ids, mask = left_pad(prompts)
    assert torch.equal(sg_generate(auto, ids, mask, max_new_tokens=16), hf_generate(llama, ids, mask, max_new_tokens=16))


def test_plan_recommends_no_depth_predicted_within_the_margin_of_plain():
    """A depth predicted 1% faster than plain decoding is not recommended (auto's MARGIN, 2%); one
    predicted 10% faster is."""
    prof = AcceptanceProfile.from_beta(0.5)  # depth 2 emits 1.75 tokens per round
    for ratio, want in ((1.75 / 1.01, 0), (1.75 / 1.10, 2)):
        flat = SimpleNamespace(round_cost=lambda d, b, r=ratio: 1.0 if d == 0 else r)  # a drafted round: r plain ones
        p = Plan.from_measurements(flat, prof, [1], [2])
        assert p.speedup(2, 1) == pytest.approx(1.75 / ratio, rel=0.02)
        assert p.recommended == {1: want}


def test_plan_measures_a_recommended_depth_it_had_not_measured(llama):
    from specgraph.planner import _measure_recommended

    fast = specgraph.compile(llama, "ngram", num_speculative_tokens=4, backend="eager", max_batch_size=1,
                             max_seq_len=MAX_SEQ)
    p = cheap_plan()
    p.recommended, p.measured = {1: 3}, {1: {1: 1.0, 2: 1.0}}
    extra = _measure_recommended(fast, p, [repeated([11, 42, 7, 93], 13)], 8, 1, [], PAD, False)
    assert set(extra) == {1} and set(extra[1]) == {3} and extra[1][3] > 0
    p.recommended = {1: 2}  # already measured: nothing to do
    assert _measure_recommended(fast, p, [repeated([11, 42, 7, 93], 13)], 8, 1, [], PAD, False) == {}


def test_plan_with_a_draft_model_measures_the_draft_cost(llama):
    fast = specgraph.compile(llama, tiny_model("llama", seed=1), num_speculative_tokens=2, backend="eager",
                             max_batch_size=1, max_seq_len=MAX_SEQ)
    p = specgraph.plan(fast, [PROMPT_1[0]], batch_sizes=[1], grid=[1, 3], max_new_tokens=8, repeats=1,
                       measure_depths=[2], measure_batch_sizes=[], progress=False, eos_token_id=[], pad_token_id=PAD)
    assert p.cost.draft_step[1] > 0 and 0 < p.cost.draft_ratio(1) < 10
    assert p.measured == {}


def test_plan_png_skipped_with_a_message_without_matplotlib(monkeypatch, tmp_path, capsys):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    files = cheap_plan().save(tmp_path)
    assert files["png"] is None and (tmp_path / "plan.json").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_cost_curve_fit_is_monotone_in_n():
    # a noisy dip at N=4 is pooled away: more query tokens never cost less
    c = CostCurve.fit([(1, 1, 1.0), (1, 2, 1.2), (1, 4, 1.1), (1, 8, 2.0)])
    vals = [c(n, 1) for n in (1, 2, 3, 4, 6, 8, 12)]
    assert vals == sorted(vals)


def _tiny_model_dir(path, model):
    """A local HF folder (config, weights, a word-level tokenizer over 'w0'..'w127') for the CLI."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(128)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="w1", pad_token=f"w{PAD}").save_pretrained(path)
    model.save_pretrained(path)
    return path


def test_cli_plan_on_a_tiny_local_model(llama, tmp_path):
    import subprocess

    d = _tiny_model_dir(tmp_path / "tiny", llama)
    prompt = " ".join(f"w{t}" for t in repeated([11, 42, 7, 93], 13))
    r = subprocess.run([sys.executable, "-m", "specgraph.cli", "plan", str(d), "--prompt", prompt, "--backend", "eager",
                        "--grid", "1,2,3", "--batch-sizes", "1,2", "--measure-depths", "1,2", "--max-new-tokens", "12",
                        "--repeats", "1", "--out", str(tmp_path / "plan")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "best γ" in r.stdout and "[plan] cost" in r.stderr
    p = Plan.load(tmp_path / "plan")
    assert set(p.recommended) == {1, 2} and set(p.measured[1]) == {1, 2}
    bad = subprocess.run([sys.executable, "-m", "specgraph.cli", "plan", str(d), "--grid", "0,2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--grid" in bad.stderr


def test_cost_curve_builds_every_shape_before_timing_them_in_turn():
    """measure_round_costs: each shape is built and warmed (its first call plus ``warmup``) before
    any timed call, then the timed calls go round the shapes ``repeats`` times; one sample per
    timed call."""
    from specgraph.timing import measure_round_costs

    log = []

    class Fake:  # the parts of a compiled object the cost curve touches
        model = torch.nn.Linear(4, 8)
        model.get_output_embeddings = lambda: Fake.model
        slots, min_attend, width_step = 64, None, None

        def kv_cache(self, B):
            return ()

        def round_graph(self, B, params, width, k):
            log.append(("build", B, k + 1))
            return lambda *args: log.append(("call", B, k + 1))

    samples = measure_round_costs(Fake(), [1, 2], [1, 3], context=8, repeats=2, progress=False, warmup=1)
    shapes = [(1, 1), (1, 3), (2, 1), (2, 3)]
    built = [("build", *s) for s in shapes]
    warm = [e for s in shapes for e in (("build", *s), ("call", *s), ("call", *s))]
    assert log[: len(warm)] == warm and [e for e in log if e[0] == "build"] == built
    assert log[len(warm):] == [("call", *s) for s in shapes] * 2  # timed in turn, after every build
    assert sorted((B, N) for B, N, _ in samples) == sorted(shapes * 2) and all(t >= 0 for *_, t in samples)


def test_a_row_s_remaining_budget_caps_its_predicted_tokens():
    """A draft accepted 90% of the time, depth 4 cheap enough to beat depth 2 on open-ended rows:
    a row that may emit only 3 more tokens gains nothing past depth 2, one with 1 left nothing from
    drafting at all, and a batch is judged by what its rows can still emit (with 24-token calls
    the budget cuts depth 4's rounds well below the open-ended prediction)."""
    cost = {0: 1.0, 2: 1.3, 4: 1.5}
    pol = AutoDepth([2, 4], SimpleNamespace(round_cost=lambda d, b: cost[d]), learn_cost=False)
    pol.start(SimpleNamespace(draft="custom", backend="eager"), [[1, 2, 3], [4, 5, 6]], 2, "cpu")
    for _ in range(20):
        pol._update(4, [5, 5], [True, True])
        pol._update(4, [1, 1], [True, True])
        pol._update(4, [5, 5], [True, True])
        pol._update(4, [5, 5], [True, True])
    assert pol.choose([False, False], [0, 0], None) == 4
    assert pol.choose([False, False], [0, 0], None, [30, 30]) == 4
    assert pol.choose([False, False], [0, 0], None, [3, 3]) == 2
    assert pol.choose([False, False], [0, 0], None, [1, 1]) == 0
    assert pol.choose([False, True], [0, 0], None, [30, 1]) == 4  # a finished row's budget does not count
    rounds = pol.finish_rounds([True, True], np.array([2, 2]))  # past 2 tokens deeper drafts add nothing
    assert rounds[1] == rounds[2] < rounds[0] == 2


def _rounds_to_finish(rng, beta, depth, left, n=2000):
    """Monte Carlo: mean over n batches of the rounds until every row has emitted its left[b]
    tokens, each round at ``depth`` with i.i.d. acceptance ``beta``."""
    accepted = (rng.random((n, len(left), max(left), depth)) < beta).cumprod(axis=3).sum(axis=3)
    emitted = np.cumsum(accepted + 1, axis=2)  # [n, rows, rounds] after each round
    rounds = (emitted < np.array(left)[None, :, None]).sum(axis=2) + 1
    return float(rounds.max(axis=1).mean())


@pytest.mark.parametrize("beta", [0.3, 0.6, 0.9])
def test_a_batch_is_judged_by_when_its_slowest_row_finishes(beta):
    """A static batch runs until its slowest row is done: 16 rows at 30% acceptance emit 1.39
    tokens per depth-2 round on average but need ~21 rounds for 24 tokens, not 17 (so plain
    decoding can win where a per-round rate picks depth 2). finish_rounds predicts a Monte Carlo of
    the rows' counts within 10% (the largest errors with a few tokens left), for full and ragged
    budgets; with depth 2 at 1.31x a plain round and 24 tokens left, auto stays plain for 16 rows at
    30% acceptance and drafts for one."""
    rng = np.random.default_rng(0)
    for left in ([24] * 16, [24], [1, 2, 2, 4, 7, 7, 5, 8, 3, 5, 3], [3, 3, 1, 4, 1]):
        pol = AutoDepth([2, 4], SimpleNamespace(round_cost=lambda d, b: 1.0), learn_cost=False)
        pol._reset(len(left), len(left))
        pol.acc[:], pol.cnt[:] = beta * 1e4, 1e4  # acceptance known: beta at every position
        predicted = pol.finish_rounds([True] * len(left), np.array(left))
        assert predicted[0] == max(left)  # plain decoding: one token per round
        for i, d in enumerate((2, 4), start=1):
            assert predicted[i] == pytest.approx(_rounds_to_finish(rng, beta, d, left), rel=0.10), (left, d)
    if beta == 0.3:
        cost = {0: 1.0, 2: 1.31, 4: 1.67}
        for rows, depth in ((16, 0), (1, 2)):
            pol = AutoDepth([2, 4], SimpleNamespace(round_cost=lambda d, b: cost[d]), learn_cost=False)
            pol._reset(rows, rows)
            pol.acc[:], pol.cnt[:] = 0.3 * 1e4, 1e4
            assert pol._decide([True] * rows, np.full(rows, 24)) == depth, rows


def test_cost_recheck_corrects_a_depth_priced_wrong_in_drafted_only_calls(monkeypatch):
    """A bucket's first call prices depth 4 at 0.6x its real cost (noise), so auto drafts at depth 4
    every round from then on; a call that only drafts times nothing (drafted rounds are read next to
    plain ones), so without re-checks the wrong price stands for good. In-loop costs plain 1,
    depth 2 1.16, depth 4 2.6 (depth 2 wins at 90% acceptance: 2.71 / 1.16 against 4.1 / 2.6);
    over 8 seeded workloads of 30 calls of 64 tokens auto reaches >= 0.95x the best fixed depth with
    the re-checks and stays below 0.85x without them."""
    cost = {0: 1.0, 2: 1.16, 4: 2.6}
    model = SimpleNamespace(round_cost=lambda d, b: cost[d])

    def ratios():
        out = []
        for seed in range(8):
            pol = AutoDepth([2, 4], model)
            pol.timed = {1: {0: [1.0] * COST_MIN_PLAIN, 2: [1.0], 4: [0.6] * 16}}  # the first call's reading
            auto = simulate_replay(pol, 0.9, cost, seed, calls=30, max_new=64)
            best = max(simulate_replay(None, 0.9, cost, seed, fixed=k, calls=30, max_new=64) for k in (0, 2, 4))
            out.append(auto / best)
        return float(np.mean(out))

    assert ratios() >= 0.95
    monkeypatch.setattr(adaptive, "RECHECK_BAND", -1.0)  # never close enough: no re-checks
    assert ratios() < 0.85
