"""Issue 11, beyond the paper: value-aware importance (value_weight), the adaptive guard (guard_rule='outlier'), the
knorm policy and a recent window apart from the buffer (recent). Expected values are computed independently here."""

from __future__ import annotations

import pytest
import torch

import vase
from tests.conftest import random_ids, tiny_model
from vase.core.policies import make_policy
from vase.core.scoring import AccumulatedAttention, EvictionContext, WindowAttention, weight_by_value
from vase.core.selection import TopK, ValueGuard, select, structural_masks
from vase.harness.outliers import PlantedValues
from vase.hf.compat import cache_kwargs

torch.set_num_threads(1)


def hand_ctx(keys, values, budget, sinks=1, recent=1, queries=None, query_positions=None):
    """One row: ``keys``/``values`` ``[H, S, D]``; optional ``queries`` ``[Hq, W, D]`` at ``query_positions``."""
    h, s, _ = keys.shape
    valid = torch.ones(1, s, dtype=torch.bool)
    forced, cand = structural_masks(valid, sinks, recent)
    q = None if queries is None else queries.unsqueeze(0)
    qp = None if query_positions is None else torch.tensor(query_positions).view(1, -1)
    qv = None if queries is None else torch.ones(1, queries.shape[1], dtype=torch.bool)
    ctx = EvictionContext(
        keys=keys.unsqueeze(0),
        values=values.unsqueeze(0),
        positions=torch.arange(s).view(1, 1, s).expand(1, h, s),
        valid=valid,
        candidates=cand,
        queries=q,
        query_positions=qp,
        query_valid=qv,
        scaling=1.0,
        layer_idx=0,
        budget=budget,
        row_keys=torch.tensor([7]),
        eviction_index=torch.tensor([0]),
        sinks=sinks,
        buffer=recent,
        memo={"latest_query": torch.tensor([s - 1])},
    )
    return ctx, forced


# ------------------------------------------------------------------------------------------ value-aware importance
A = [0.5, 0.3, 0.2]
V = [[1.0, -1.0], [2.0, 0.0], [0.0, 3.0]]


def _probs_values():
    return torch.tensor(A).view(1, 1, 1, 1, 3), torch.tensor(V).view(1, 1, 3, 2)


def test_l1_weight_is_attention_times_value_l1_norm():
    probs, values = _probs_values()
    raw = [0.5 * 2.0, 0.3 * 2.0, 0.2 * 3.0]  # a_i * ||v_i||_1
    expect = torch.tensor(raw) / sum(raw)  # normalised to the query's attention mass (1)
    got = weight_by_value(probs, values, "l1").view(3)
    assert torch.allclose(got, expect, atol=1e-6)


def test_output_error_is_the_change_of_the_attention_output_when_a_token_is_removed():
    probs, values = _probs_values()
    a, v = torch.tensor(A, dtype=torch.float64), torch.tensor(V, dtype=torch.float64)
    out = a @ v
    raw = []
    for i in range(3):
        rest = [j for j in range(3) if j != i]
        out_without = (a[rest] @ v[rest]) / a[rest].sum()  # renormalised attention without token i
        raw.append((out - out_without).norm().item())
    # the closed form of CAOTE, from the numbers by hand: o = (1.1, 0.1)
    assert raw == pytest.approx([0.5 / 0.5 * 1.22**0.5, 0.3 / 0.7 * 0.82**0.5, 0.2 / 0.8 * 9.62**0.5], rel=1e-9)
    expect = torch.tensor(raw, dtype=torch.float64) / sum(raw)
    got = weight_by_value(probs, values, "output_error").view(3)
    assert torch.allclose(got.double(), expect, atol=1e-6)


def test_value_weight_keeps_each_heads_attention_mass_and_zeros():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 2, 4, 6, generator=g)
    logits[..., 4:] = float("-inf")  # slots outside the domain
    probs = torch.softmax(logits, -1)
    probs[:, :, :, 3] = 0.0  # an invalid query
    values = torch.randn(2, 3, 6, 5, generator=g)
    for how in ("l1", "output_error"):
        w = weight_by_value(probs, values, how)
        assert torch.allclose(w.sum((2, 3, 4)), probs.sum((2, 3, 4)), atol=1e-5)
        assert (w[probs == 0] == 0).all() and (w[probs > 0] > 0).all()
    assert weight_by_value(probs, values, "none") is probs
    with pytest.raises(ValueError, match="value_weight must be one of"):
        weight_by_value(probs, values, "l2")


def _direct_weighted_scores(ev, group, how, kernel):
    """SnapKV score with value weights, recomputed in float64 from what the eviction saw, the removal error by brute
    force."""
    k, v = ev["keys"][0].double(), ev["values"][0].double()
    q = ev["queries"][0].double()
    pos, qpos, qvalid, valid = ev["positions"][0], ev["query_positions"][0], ev["query_valid"][0], ev["valid"][0]
    n_heads, n_slots, _ = k.shape
    out = torch.zeros(n_heads, n_slots, dtype=torch.float64)
    for h in range(n_heads):
        weighted = torch.zeros(group, n_slots, dtype=torch.float64)
        mass = 0.0
        seen = torch.zeros(n_slots, dtype=torch.float64)
        for w in range(q.shape[1]):
            if qvalid[w]:
                seen += (valid & (pos[h] <= qpos[w])).double()
        for g in range(group):
            for w in range(q.shape[1]):
                if not qvalid[w]:
                    continue
                allowed = valid & (pos[h] <= qpos[w])
                logits = (k[h] @ q[h * group + g, w]) * ev["scaling"]
                logits[~allowed] = float("-inf")
                a = torch.softmax(logits, 0)
                mass += a.sum().item()
                o = a @ v[h]
                for i in allowed.nonzero().flatten().tolist():
                    if how == "l1":
                        weighted[g, i] += a[i] * v[h, i].abs().sum()
                    else:
                        rest = allowed.clone()
                        rest[i] = False
                        o_without = (a[rest] @ v[h][rest]) / a[rest].sum()
                        weighted[g, i] += (o - o_without).norm()
        weighted *= mass / weighted.sum()
        mean = weighted / seen.clamp_min(1)
        pooled = torch.nn.functional.avg_pool1d(mean.view(group, 1, n_slots), kernel, 1, kernel // 2).view(group, -1)
        out[h] = pooled.mean(0)
    return out


@pytest.mark.parametrize("how", ["l1", "output_error"])
def test_snapkv_value_weight_in_a_generation_equals_direct_computation(how):
    model = tiny_model("llama")
    budget, buffer = 32, 8
    cache = vase.EvictingCache(
        model, policy=f"snapkv:value_weight={how}", budget=budget, buffer=buffer, window=6, record_evictions=True
    )
    model.generate(
        input_ids=random_ids(40), max_new_tokens=12, min_new_tokens=12, do_sample=False, **cache_kwargs(cache)
    )
    assert cache.stats().evictions >= 2
    for layer in cache.layers:
        ev = layer.last_eviction
        direct = _direct_weighted_scores(ev, group=2, how=how, kernel=5)
        assert torch.allclose(ev["scores"][0].double(), direct, atol=1e-5)
        forced, cand = ev["forced"][0], ev["candidates"][0]
        for h in range(direct.shape[0]):
            sc = direct[h].clone()
            sc[~cand] = float("-inf")
            top = sc.topk(budget - int(forced.sum())).indices
            expect = set(forced.nonzero().flatten().tolist()) | set(top.tolist())
            assert set(ev["kept"][0, h].tolist()) == expect


def test_h2o_accumulates_value_weighted_attention():
    """Two queries, one KV head: the accumulated score is the sum over queries of the normalised a_i ||v_i||_1."""
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]])
    values = torch.tensor([[[1.0, 1.0], [4.0, 0.0], [0.0, -2.0], [0.5, 0.5]]])
    queries = torch.tensor([[[1.0, 2.0], [0.5, -1.0]]])
    ctx, _ = hand_ctx(keys, values, budget=3, queries=queries, query_positions=[2, 3])
    ctx.state["acc"] = torch.zeros(1, 1, 4)
    got = AccumulatedAttention(value_weight="l1").score(ctx)[0, 0]
    norms = values[0].abs().sum(-1)
    weighted, mass = torch.zeros(4), 0.0
    for w, p in enumerate([2, 3]):
        logits = keys[0, : p + 1] @ queries[0, w]
        a = torch.softmax(logits, 0)
        weighted[: p + 1] += a * norms[: p + 1]
        mass += 1.0
    expect = weighted * mass / weighted.sum()
    assert torch.allclose(got, expect, atol=1e-6)
    assert ctx.memo["acc_upto"].item() == 3


def test_value_weight_none_is_the_default_and_tova_rkv_take_it():
    model = tiny_model("qwen3")
    ids = random_ids(30)

    def run(spec):
        cache = vase.EvictingCache(model, policy=spec, budget=20, buffer=8)
        return model.generate(
            input_ids=ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, **cache_kwargs(cache)
        )

    assert torch.equal(run("snapkv:value_weight=none"), run("snapkv"))
    assert torch.equal(run("h2o:value_weight=none"), run("h2o"))
    assert isinstance(make_policy("tova:value_weight=l1").scorer, WindowAttention)
    assert make_policy("rkv:value_weight=output_error").scorer._importance.value_weight == "output_error"


# --------------------------------------------------------------------------------------------- adaptive guard
def _guard_ctx():
    """Two KV heads, 12 slots (slot 0 a sink, slot 11 the recent window, 10 candidates); value range = |x| of
    v = (x, 0). Head 0: no outlier (largest 3.5x the median 1). Head 1: three outliers (10, 20, 30 x the median 1)."""
    ranges = torch.ones(2, 12)
    ranges[0, 4] = 3.5
    ranges[1, 3], ranges[1, 5], ranges[1, 7] = 10.0, 20.0, 30.0
    values = torch.stack([ranges, torch.zeros_like(ranges)], -1)
    keys = torch.zeros(2, 12, 2)
    return hand_ctx(keys, values, budget=6)


class Fixed:
    """Scores decreasing with the slot index (earlier slots preferred)."""

    window = 0
    state_names = ()

    def score(self, ctx):
        s = ctx.positions.shape[-1]
        return (s - torch.arange(s, dtype=torch.float32)).view(1, 1, s).expand(ctx.positions.shape).clone()


def test_outlier_guard_protects_outliers_only_capped_and_keeps_the_budget():
    ctx, forced = _guard_ctx()
    guard = ValueGuard("range", share=2 / 6, rule="outlier", factor=4.0)  # cap round(2) = 2 slots
    assert guard.count(6) == 2
    sel = select(Fixed(), TopK(), guard, ctx, torch.tensor([6]), 6, forced)
    assert sel.protected[0, 0].sum() == 0, "a head without outliers protects none"
    assert sel.protected[0, 1].nonzero().flatten().tolist() == [5, 7], "the two largest outliers (cap 2)"
    # exactly `budget` kept per head: sink 0, recent 11, then the protected, then the best scores (earliest slots)
    assert sel.indices[0, 0].tolist() == [0, 1, 2, 3, 4, 11]
    assert sel.indices[0, 1].tolist() == [0, 1, 2, 5, 7, 11]


def test_outlier_guard_factor_and_evict_mode():
    ctx, forced = _guard_ctx()
    keep = torch.tensor([6])
    loose = ValueGuard("range", share=0.5, rule="outlier", factor=3.0)  # cap 3; head 0's 3.5 is now an outlier
    sel = select(Fixed(), TopK(), loose, ctx, keep, 6, forced)
    assert sel.protected[0, 0].nonzero().flatten().tolist() == [4]
    assert sel.protected[0, 1].nonzero().flatten().tolist() == [3, 5, 7]
    strict = ValueGuard("range", share=0.5, rule="outlier", factor=40.0)
    assert select(Fixed(), TopK(), strict, ctx, keep, 6, forced).protected.sum() == 0
    demote = ValueGuard("range", share=0.5, mode="evict", rule="outlier", factor=4.0)
    sel = select(Fixed(), TopK(), demote, ctx, keep, 6, forced)
    assert sel.indices[0, 0].tolist() == [0, 1, 2, 3, 4, 11]
    assert sel.indices[0, 1].tolist() == [0, 1, 2, 4, 6, 11], "outliers 3, 5, 7 evicted first"


@pytest.mark.parametrize(("metric", "slot"), [("range", 1), ("l2", 2), ("var", 3)])
def test_guard_metric_ranks_values_by_its_own_measure(metric, slot):
    """Three candidates that each metric ranks differently: slot 1 (3, -3, 0, 0) has the largest range (6), slot 2
    (4, 4, 4, 4) the largest L2 norm (8), slot 3 (5, 0, 0, 0) the largest variance (6.25 against 6, unbiased over
    head_dim). A budget of sink + recent + one guarded slot keeps exactly the metric's choice."""
    values = torch.tensor([[0.1, 0, 0, 0], [3, -3, 0, 0], [4, 4, 4, 4], [5, 0, 0, 0], [0.2, 0, 0, 0], [0.1, 0, 0, 0]])
    ctx, forced = hand_ctx(torch.zeros(1, 6, 4), values.view(1, 6, 4), budget=3)
    guard = ValueGuard(metric, share=1 / 3)
    assert guard.count(3) == 1
    sel = select(Fixed(), TopK(), guard, ctx, torch.tensor([3]), 3, forced)
    assert sel.protected[0, 0].nonzero().flatten().tolist() == [slot]
    assert sel.indices[0, 0].tolist() == [0, slot, 5]


def test_share_guard_unchanged_protects_a_fixed_count():
    ctx, forced = _guard_ctx()
    sel = select(Fixed(), TopK(), ValueGuard("range", share=2 / 6), ctx, torch.tensor([6]), 6, forced)
    assert sel.protected[0].sum(-1).tolist() == [2, 2]
    assert sel.protected[0, 1].nonzero().flatten().tolist() == [5, 7]


def test_outlier_guard_keeps_planted_outliers_and_counts_protections():
    """Planted value outliers (20x the median range) in layer 0: the adaptive guard keeps them in every head and
    the cache reports what it protected, per eviction and in total."""
    model = tiny_model("llama")
    planted = PlantedValues(layers=[0], positions=[6, 9], scale=20.0).attach(model)
    budget, buffer = 24, 8
    cache = vase.EvictingCache(
        model, policy="vase:guard_rule=outlier", budget=budget, buffer=buffer, record_evictions=True
    )
    total = 0
    with torch.no_grad():
        logits = model(input_ids=random_ids(20), **cache_kwargs(cache)).logits
        for _ in range(40):
            before = cache.stats().evictions
            logits = model(input_ids=logits[:, -1:].argmax(-1), **cache_kwargs(cache)).logits
            if cache.stats().evictions == before:
                continue
            for i, layer in enumerate(cache.layers):
                ev = layer.last_eviction
                n = ev["n_protected"]
                assert n.shape == (1, 2) and torch.equal(n, ev["protected"].sum(-1))
                assert (n <= ev["n_protect"]).all() and ev["n_protect"] == round(0.25 * budget) - 4
                total += int(n.sum())
                if i == 0:
                    for h in range(2):
                        kept = set(ev["kept_positions"][0, h].tolist())
                        assert {6, 9} <= kept
                        prot = ev["positions"][0, h][ev["protected"][0, h]].tolist()
                        assert {6, 9} <= set(prot)
    planted.detach()
    assert cache.stats().evictions >= 4
    assert cache.stats().protected == total > 0


def test_protected_total_with_the_share_guard():
    model = tiny_model("llama")
    budget, buffer = 24, 8
    cache = vase.EvictingCache(model, policy="snapkv:guard=range", budget=budget, buffer=buffer)
    model.generate(
        input_ids=random_ids(10), max_new_tokens=40, min_new_tokens=40, do_sample=False, **cache_kwargs(cache)
    )
    st = cache.stats()
    # every eviction of every layer protects round(0.25 * budget) = 6 slots in each of the 2 KV heads
    assert st.evictions > 0 and st.protected == st.evictions * st.layers * 2 * 6
    plain = vase.EvictingCache(model, policy="snapkv", budget=budget, buffer=buffer)
    model.generate(
        input_ids=random_ids(10), max_new_tokens=40, min_new_tokens=40, do_sample=False, **cache_kwargs(plain)
    )
    assert plain.stats().protected == 0


# ------------------------------------------------------------------------------------------------------ knorm
def test_knorm_keeps_the_lowest_norm_keys():
    norms = torch.tensor([[5.0, 3.0, 0.5, 2.0, 4.0, 1.0, 6.0, 9.0], [1.0, 8.0, 7.0, 0.1, 6.0, 0.2, 5.0, 9.0]])
    keys = torch.stack([norms * 0.6, norms * 0.8], -1)  # ||(0.6 n, 0.8 n)|| = n
    ctx, forced = hand_ctx(keys, torch.zeros(2, 8, 2), budget=5)
    policy = make_policy("knorm")
    assert torch.allclose(policy.scorer.score(ctx)[0], 1.0 / norms, rtol=2.5e-4)  # norms to 12 significant bits
    sel = policy.select(ctx, torch.tensor([5]), 5, forced)
    # sink 0 and recent 7 forced; then the 3 lowest norms among slots 1..6
    assert sel.indices[0, 0].tolist() == [0, 2, 3, 5, 7]
    assert sel.indices[0, 1].tolist() == [0, 3, 5, 6, 7]


def test_knorm_ties_rotated_copies_of_a_key():
    """The same key rotated (RoPE at two positions) keeps its norm up to float rounding: a tie, broken by slot."""
    key = torch.tensor([3.0, -1.25, 0.7, 2.2])
    angle = torch.tensor(0.731)
    c, s = torch.cos(angle), torch.sin(angle)
    rotated = torch.stack(
        [c * key[0] - s * key[1], s * key[0] + c * key[1], c * key[2] - s * key[3], s * key[2] + c * key[3]]
    )
    keys = torch.stack([torch.full((4,), 9.0), rotated, key, torch.full((4,), 9.0)]).view(1, 4, 4)
    ctx, forced = hand_ctx(keys, torch.zeros(1, 4, 4), budget=3)
    scores = make_policy("knorm").scorer.score(ctx)[0, 0]
    assert scores[1] == scores[2]
    sel = make_policy("knorm").select(ctx, torch.tensor([3]), 3, forced)
    assert sel.indices[0, 0].tolist() == [0, 1, 3]


# ----------------------------------------------------------------------------------------------------- recent
def test_recent_smaller_than_buffer_lets_older_tokens_of_the_last_buffer_go():
    model = tiny_model("llama")
    budget, buffer, recent = 24, 8, 2
    cache = vase.EvictingCache(
        model, policy=f"vase:recent={recent}", budget=budget, buffer=buffer, record_evictions=True
    )
    assert cache.recent == recent
    dropped_young = 0
    with torch.no_grad():
        logits = model(input_ids=random_ids(10), **cache_kwargs(cache)).logits
        for _ in range(60):
            before = cache.stats().evictions
            logits = model(input_ids=logits[:, -1:].argmax(-1), **cache_kwargs(cache)).logits
            if cache.stats().evictions == before:
                continue
            seen = cache.get_seq_length()
            for layer in cache.layers:
                ev = layer.last_eviction
                pos = ev["positions"][0, 0]
                forced_pos = set(pos[ev["forced"][0]].tolist())
                assert forced_pos == {0, 1, 2, 3, seen - 2, seen - 1}, "only the sinks and the last `recent` forced"
                young = ev["candidates"][0] & (pos >= seen - buffer)
                assert int(young.sum()) == buffer - recent, "the rest of the last buffer is up for eviction"
                assert (ev["scores"][0][:, young] > 0).all(), "and scored (the softmax domain follows recent)"
                for h in range(2):
                    kept = set(ev["kept_positions"][0, h].tolist())
                    assert {seen - 2, seen - 1} <= kept
                    dropped_young += len(set(range(seen - buffer, seen - recent)) - kept)
    assert cache.stats().evictions >= 4 and dropped_young > 0


def test_recent_larger_than_buffer_and_validation():
    model = tiny_model("llama")
    cache = vase.EvictingCache(model, policy="knorm:recent=12", budget=24, buffer=8, record_evictions=True)
    model.generate(
        input_ids=random_ids(10), max_new_tokens=30, min_new_tokens=30, do_sample=False, **cache_kwargs(cache)
    )
    seen = cache.get_seq_length()
    for layer in cache.layers:
        assert int(layer.last_eviction["forced"].sum()) == 4 + 12
        assert set(range(seen - 12, seen)) <= set(layer.positions[0, 0, : cache.fill[0]].tolist())
    with pytest.raises(ValueError, match=r"recent \(20\) \+ sinks \(4\) must be below the budget \(24\)"):
        vase.EvictingCache(model, policy="h2o:recent=20", budget=24, buffer=8)
    with pytest.raises(ValueError, match="recent must be a number of tokens >= 0"):
        make_policy("h2o:recent=-3")
    with pytest.raises(ValueError, match="does not take option"):
        make_policy("full:recent=3")
    assert make_policy("h2o:recent=0").describe().endswith("recent window 0")
    from vase.harness.generation import check_options

    with pytest.raises(ValueError, match="must be below the budget"):
        check_options(policy="snapkv:recent=30", budget=32, buffer=8)


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "spec, message",
    [
        ("keydiff:value_weight=l1", "does not take option"),
        ("knorm:value_weight=l1", "does not take option"),
        ("snapkv:value_weight=l2", "value_weight must be one of none, l1, output_error"),
        ("snapkv:guard_rule=outlier", "needs a value guard: add guard=range"),
        ("vase:guard_rule=median", "guard_rule must be one of share, outlier"),
        ("vase:guard_rule=outlier:outlier_factor=0.5", "outlier_factor must be a number >= 1"),
        ("vase:outlier_factor=3", "outlier_factor applies to the adaptive guard only"),
        ("vase:guard=random:guard_rule=outlier", "needs a magnitude metric"),
    ],
)
def test_bad_options_fail_clearly(spec, message):
    with pytest.raises(ValueError, match=message):
        make_policy(spec)


# ------------------------------------------------------------------------------------------------- end to end
NEW_SPECS = [
    "knorm",
    "snapkv:value_weight=l1",
    "snapkv:value_weight=output_error",
    "vase:value_weight=output_error",
    "h2o:value_weight=l1",
    "h2o:value_weight=output_error",
    "tova:value_weight=output_error",
    "rkv:value_weight=l1",
    "vase:guard_rule=outlier",
    "snapkv:guard=l2:guard_rule=outlier:outlier_factor=3",
    "h2o:recent=2",
    "vase:recent=12",
]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("spec", NEW_SPECS)
def test_new_options_generate_end_to_end(spec, attn):
    model = tiny_model("qwen3", attn)
    budget, buffer = 24, 8
    cache = vase.EvictingCache(model, policy=spec, budget=budget, buffer=buffer)
    ids = random_ids(20, batch=2)
    out = model.generate(input_ids=ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, **cache_kwargs(cache))
    st = cache.stats()
    assert out.shape == (2, 60) and st.evictions >= 4
    assert st.capacity == budget + buffer and cache.layers[0].keys.shape[2] == budget + buffer


def test_fidelity_records_guard_counts():
    from vase.harness.fidelity import replay
    from vase.harness.held import guard_counts

    model = tiny_model("llama")
    prompt, cont = random_ids(12)[0], random_ids(60, seed=3)[0]
    _, cache = replay(model, prompt, cont, "snapkv:guard=range", 24, 8, record=True)
    counts = guard_counts(cache)
    assert counts["protected"] > 0 and counts["protected_per_eviction"] == 6.0  # round(0.25 * 24) per head
    _, plain = replay(model, prompt, cont, "snapkv", 24, 8, record=True)
    assert guard_counts(plain) == {}
