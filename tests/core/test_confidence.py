"""Confidence step budgets (``step_budget='confidence'``): the tracker's counts on hand-made probabilities, the cap
never exceeded, the fixed budget's very tokens and kept positions when the confidence is constant, outputs equal to
attention over each head's live tokens after confidence-driven evictions, the feed inside ``model.generate``, a
teacher-forced replay equal to token-by-token decoding, clear errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import vase
from tests.conftest import random_ids, tiny_model
from tests.core.test_budgets import _poison_dead_slots, _reference_logits, _step
from vase.core.confidence import ConfidenceTracker, top_probability
from vase.hf import ConfidenceFeed
from vase.hf.compat import cache_kwargs

torch.set_num_threads(1)

BUDGET, BUFFER, SINKS = 16, 8, 2


def test_top_probability_exact():
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]])
    torch.testing.assert_close(top_probability(probs.log()), torch.tensor([0.5, 0.7]))
    masked = torch.tensor([[0.0, float("-inf"), 0.0]])  # a processor masked a token: two equal ones remain
    assert top_probability(masked).tolist() == [0.5]
    assert top_probability(torch.zeros(2, 3, 4)).shape == (2, 3)


def test_tracker_ratio_and_keep_on_hand_made_probabilities():
    t = ConfidenceTracker(floor=0.25, cap=2.0)
    t.reset_row(0)
    t.reset_row(2)  # rows made as needed
    assert t.ratio(0) == 1.0 and t.keep(0, 100, 200, 10) == 100  # nothing observed: the budget
    # row 0: uncertainties 0.5, 0.5 (window 1) then 0.1, 0.1 (window 2)
    t.observe([0, 2], torch.tensor([[0.5, 0.5], [0.9, float("nan")]]))
    assert t.ratio(0) == 1.0  # the window is all the row has seen
    t.evicted(0)
    t.observe([0], torch.tensor([[0.9, 0.9]]))
    # window mean 0.1, row mean (0.5 + 0.5 + 0.1 + 0.1) / 4 = 0.3: ratio 1/3
    assert t.ratio(0) == pytest.approx(1 / 3)
    assert t.keep(0, 90, 200, 10) == 30
    assert t.keep(0, 27, 200, 10) == 10  # at least sinks + recent
    t.evicted(0)
    t.observe([0], torch.tensor([0.0]))  # uncertainty 1 against a mean of 0.34: clipped at the cap
    assert t.ratio(0) == 2.0 and t.keep(0, 100, 150, 10) == 150  # and never above the slots
    t.evicted(0)
    t.observe([0], torch.tensor([1.0]))  # certain: the floor
    assert t.ratio(0) == 0.25
    # row 2: one NaN left out; its window is all it has seen
    assert t.window_n[2] == 1 and t.ratio(2) == 1.0
    # a row that has always been certain keeps the budget
    t.reset_row(1)
    t.observe([1], torch.ones(4))
    assert t.ratio(1) == 1.0
    with pytest.raises(ValueError, match="never admitted"):
        t.observe([5], torch.ones(1))


def test_constant_confidence_keeps_the_budget():
    t = ConfidenceTracker(floor=0.25, cap=2.0)
    t.reset_row(0)
    for _ in range(5):
        t.observe([0], torch.full((8,), 0.37))
        assert t.keep(0, 64, 128, 10) == 64
        t.evicted(0)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("vase:step_budget=sometimes", "step_budget must be one of fixed, confidence"),
        ("vase:step_budget=confidence:confidence_floor=0", r"confidence_floor must be in \(0, 1\]"),
        ("vase:confidence_floor=0.5", "confidence_floor applies to adaptive budgets only: add step_budget"),
    ],
)
def test_bad_confidence_options(spec, message):
    with pytest.raises(ValueError, match=message):
        vase.VaseConfig.resolve(spec, budget=BUDGET, buffer=BUFFER, sinks=SINKS)


def test_policy_options_describe_and_layout():
    pol = vase.make_policy("snapkv", step_budget="confidence", budget_cap=1.5, selector="sample")
    assert pol.confidence_budget and pol.adaptive_budgets
    assert "confidence step budgets (floor 0.25)" in pol.describe() and "cap 1.5x budget" in pol.describe()
    cfg = vase.VaseConfig.resolve(pol, budget=64, buffer=BUFFER)
    assert cfg.layout(3) == ([64, 64, 64], 96)
    assert not vase.make_policy("snapkv").confidence_budget
    assert not vase.make_policy("full").confidence_budget
    with pytest.raises(ValueError, match="kv_bits does not combine with adaptive budgets"):
        vase.VaseConfig.resolve("vase:step_budget=confidence:kv_bits=4", budget=64, buffer=BUFFER)


def test_vllm_refuses_the_confidence_budget():
    from vase.vllm.rules import check_policy

    problems = check_policy(vase.VaseConfig.resolve("vase:step_budget=confidence", budget=64, buffer=BUFFER))
    assert len(problems) == 1 and "step_budget=confidence" in problems[0]


# ------------------------------------------------------------------------------------------------- in the cache
def _kept(cache) -> list[list[list[int]]]:
    return [
        [layer.positions[0, h][layer.positions[0, h] >= 0].tolist() for h in range(cache.num_kv_heads)]
        for layer in cache.layers
    ]


@pytest.mark.parametrize("policy", ["snapkv", "vase", "h2o:head_budget=adakv", "vase:layer_budget=pyramid"])
def test_constant_confidence_equals_the_fixed_budget(policy):
    """Fed a constant confidence, the confidence cache (twice the slots, dead ones included) keeps the very positions
    of the fixed-budget cache at every eviction and gives the same logits."""
    model = tiny_model("qwen3", "sdpa", layers=2)
    prompt = random_ids(30, seed=6)
    caches = [
        vase.EvictingCache(model, policy=spec, budget=BUDGET, buffer=BUFFER, sinks=SINKS, seed=7)
        for spec in (policy, f"{policy}:step_budget=confidence")
    ]
    flat = torch.zeros(1, model.config.vocab_size)  # uniform: the same uncertainty at every step
    logits = [_step(model, c, prompt) for c in caches]
    evictions = 0
    for _ in range(50):
        tok = logits[0][-1:].argmax(-1).view(1, 1)
        for c in caches:
            c.observe_confidence(flat)
        logits = [_step(model, c, tok) for c in caches]
        torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
        if caches[0].stats().evictions > evictions:
            evictions = caches[0].stats().evictions
            assert _kept(caches[1]) == _kept(caches[0])
    fixed, conf = caches
    assert conf.slots == 2 * BUDGET and conf.adaptive and evictions >= 5
    assert conf.stats().evictions == fixed.stats().evictions


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", ["vase:step_budget=confidence", "snapkv:step_budget=confidence:head_budget=adakv"])
def test_confidence_counts_follow_the_feed_within_the_cap(attn, policy):
    """Confident and uncertain stretches alternate: each eviction keeps round(budget x ratio) per head (the ratio of
    the window's mean uncertainty over the row's, clipped to [floor, cap]), never more than the slots; dead slots are
    never attended (the logits equal attention over each head's live tokens)."""
    model = tiny_model("llama", attn, layers=3)
    cache = vase.EvictingCache(
        model, policy=policy, budget=BUDGET, buffer=BUFFER, sinks=SINKS, record_evictions=True, seed=3
    )
    vocab = model.config.vocab_size
    logits = _step(model, cache, random_ids(20, seed=4))
    shadow = ConfidenceTracker(0.25, 2.0)  # what the cache should compute
    shadow.reset_row(0)
    seen_counts, checked, ev = set(), 0, 0
    for i in range(90):
        top = 0.95 if (i // 24) % 2 == 0 else 0.2  # stretches of 24 steps
        fed = torch.full((1, vocab), -30.0)
        fed[0, 0] = 0.0
        fed[0, 1:] = math.log((1 - top) / (vocab - 1)) - math.log(top)
        cache.observe_confidence(fed)
        shadow.observe([0], top_probability(fed))
        held = min(int((layer.positions[0] >= 0).sum(-1).min()) for layer in cache.layers)
        # what the row holds when it evicts (its live entries and the buffer's new tokens) bounds what it keeps
        expected = min(shadow.keep(0, BUDGET, cache.slots, SINKS + BUFFER), held + 1)
        tok = logits[-1:].argmax(-1).view(1, 1)
        if cache.stats().evictions and _poison_dead_slots(cache) and i % 5 == 0:
            ref = _reference_logits(model, cache, tok)
            logits = _step(model, cache, tok)
            torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
            checked += 1
        else:
            logits = _step(model, cache, tok)
        if cache.stats().evictions > ev:
            ev = cache.stats().evictions
            shadow.evicted(0)
            for layer in cache.layers:
                live = (layer.positions[0] >= 0).sum(-1)
                assert int(live.max()) <= cache.slots
                assert int(live.sum()) == cache.num_kv_heads * expected  # the heads keep H x the row's count
            seen_counts.add(expected)
    assert ev >= 8 and checked >= 3
    assert min(seen_counts) < BUDGET < max(seen_counts)  # fewer after confident stretches, more after uncertain


def test_generate_feeds_the_confidence_and_warns_without_it():
    """``model.generate`` with :class:`ConfidenceFeed` feeds the cache (no warning); without the feed it warns once
    and keeps the budget."""
    model = tiny_model("llama", "sdpa", layers=2)
    prompt = random_ids(12, seed=2)
    cache = vase.EvictingCache(model, policy="vase:step_budget=confidence", budget=BUDGET, buffer=BUFFER, sinks=SINKS)

    def greedy(c, n, **kw):
        model.generate(
            prompt, attention_mask=torch.ones_like(prompt), **cache_kwargs(c), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, **kw,
        )  # fmt: skip

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        greedy(cache, 60, logits_processor=[ConfidenceFeed(cache)])
    assert not [w for w in caught if "step_budget=confidence" in str(w.message)]
    assert cache.stats().evictions >= 4
    assert cache.seq.confidence.total_n[0] == 60

    bare = vase.EvictingCache(model, policy="vase:step_budget=confidence", budget=BUDGET, buffer=BUFFER, sinks=SINKS)
    with pytest.warns(UserWarning, match="no next-token distribution was fed"):
        greedy(bare, 40)
    assert all(int((layer.positions[0] >= 0).sum(-1).max()) <= BUDGET + BUFFER for layer in bare.layers)
    with pytest.raises(ValueError, match="the cache holds 1"):
        cache.observe_confidence(torch.zeros(2, model.config.vocab_size))


def test_harness_generate_and_replay_with_a_confidence_budget():
    """``vase.generate`` runs with the feed; the teacher-forced replay equals token-by-token decoding fed the same
    way (the evicting token in its own pass, so each eviction sees every prediction before it). The fidelity records'
    ``kept_mean`` (what the rule kept after each eviction, averaged) equals the token-by-token cache's."""
    from vase.harness.fidelity import replay
    from vase.harness.held import KeptAfterEviction

    model = tiny_model("llama", "sdpa", layers=2)
    prompt, cont = random_ids(20, seed=8)[0], random_ids(70, seed=9)[0]
    policy = "vase:step_budget=confidence"
    hook = KeptAfterEviction()
    logprobs, cache = replay(model, prompt, cont, policy, BUDGET, BUFFER, record=True, on_chunk=hook)
    step = vase.EvictingCache(model, policy=policy, budget=BUDGET, buffer=BUFFER)
    kept, ev = [], 0

    def live(c) -> float:
        return sum(float((layer.positions[0] >= 0).sum(-1).float().mean()) for layer in c.layers) / len(c.layers)

    with torch.no_grad():
        out = [model(input_ids=prompt.view(1, -1), **cache_kwargs(step)).logits[0, -1:]]
        step.observe_confidence(out[-1])
        for t in cont[:-1]:
            out.append(model(input_ids=t.view(1, 1), **cache_kwargs(step)).logits[0])
            step.observe_confidence(out[-1])
            if step.stats().evictions > ev:
                ev = step.stats().evictions
                kept.append(live(step))
    torch.testing.assert_close(logprobs, torch.log_softmax(torch.cat(out), -1), atol=1e-4, rtol=1e-4)
    assert cache.stats().evictions == step.stats().evictions >= 5
    assert _kept(cache) == _kept(step)
    assert hook.kept == kept and len(kept) == step.stats().evictions
    fields = hook.fields(BUDGET)
    assert fields["kept_mean"] == sum(kept) / len(kept) and fields["kept_share"] == fields["kept_mean"] / BUDGET
    assert KeptAfterEviction().fields(BUDGET) == {}
