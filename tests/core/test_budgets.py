"""Issue 11 piece 3: adaptive budgets. Allocation rules on hand-made scores, exact sums, the per-head mask against a
dense per-head reference in transformers' sdpa and eager attention, and the cache with ``head_budget='adakv'`` /
``layer_budget='pyramid'``: model outputs equal a masked-dense reference over each head's own tokens, counts add up to
the static total after every eviction, dead slots are never attended, the adaptive path with uniform counts equals
the uniform cache, ragged rows equal rows alone, clear errors."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.llama.modeling_llama import eager_attention_forward

import vase
from tests.conftest import random_ids, tiny_model
from tests.hf.test_ragged import check_ragged_equals_alone
from vase.core.budgets import check_head_budgets_supported, head_counts, head_mask, layout, pyramid_budgets
from vase.core.selection import TopK, ValueGuard, select, structural_masks
from vase.hf.compat import cache_kwargs

torch.set_num_threads(1)

HEAD0 = [0.9, 0.8, 0.7, 0.6, 0.05, 0.01]
HEAD1 = [0.5, 0.4, 0.35, 0.3, 0.2, 0.1]


def _scores():
    return torch.tensor([HEAD0, HEAD1]).unsqueeze(0), torch.ones(1, 6, dtype=torch.bool)


def test_head_counts_one_topk_over_the_layer():
    scores, cand = _scores()
    three = torch.tensor([3])
    # layer-wide top 6 of 12: .9 .8 .7 .6 (head 0) and .5 .4 (head 1)
    assert head_counts(scores, cand, three, floor_share=0.0).tolist() == [[4, 2]]
    # floor 1 each, then the best 4 of the rest: .8 .7 .6 (head 0), .4 (head 1)
    assert head_counts(scores, cand, three, floor_share=0.5).tolist() == [[4, 2]]
    # floor 2 each (.9 .8 | .5 .4), then the best 4 of the rest: .7 .6 (head 0), .35 .3 (head 1)
    assert head_counts(scores, cand, torch.tensor([4]), floor_share=0.5).tolist() == [[4, 4]]
    assert head_counts(scores, cand, torch.tensor([2]), floor_share=0.0).tolist() == [[4, 0]]
    assert head_counts(scores, cand, three, floor_share=1.0).tolist() == [[3, 3]]  # uniform
    assert head_counts(scores, cand, three, floor_share=0.0, cap=3).tolist() == [[3, 3]]
    # a candidate mask: slots 0 and 1 are forced elsewhere, head 0's best of the rest are .7 .6
    cand2 = torch.tensor([[False, False, True, True, True, True]])
    assert head_counts(scores, cand2, torch.tensor([2]), floor_share=0.0).tolist() == [[2, 2]]


def test_head_counts_ragged_rows_and_errors():
    scores, cand = _scores()
    scores2 = torch.cat([scores, scores.flip(1)])  # row 1: heads swapped
    counts = head_counts(scores2, cand.expand(2, 6), torch.tensor([3, 1]), floor_share=0.0)
    assert counts.tolist() == [[4, 2], [0, 2]]
    assert (counts.sum(-1) == torch.tensor([6, 2])).all()
    with pytest.raises(ValueError, match="floor_share"):
        head_counts(scores, cand, torch.tensor([3]), floor_share=1.5)
    with pytest.raises(ValueError, match="cannot choose"):
        head_counts(scores, cand, torch.tensor([7]))
    with pytest.raises(ValueError, match="cap"):
        head_counts(scores, cand, torch.tensor([3]), cap=2)
    # a cap as a device scalar, and the checks off (the eviction path on a GPU): the same counts
    assert torch.equal(
        head_counts(scores2, cand.expand(2, 6), torch.tensor([3, 1]), 0.0, torch.tensor(6), False), counts
    )


@pytest.mark.parametrize("heads", ["uniform", "adakv"])
def test_a_layer_budget_above_what_the_layer_holds_keeps_everything(heads):
    """Pyramid budgets at 32 on two layers: 51 and 13 slots. The prompt's eviction (40 tokens) asks layer 0 for more
    than it holds: it keeps all 40 (with AdaKV it once asked for 39 chosen of 28 candidates and failed); layer 1 keeps
    its 13: the 4 sinks, the 8 recent and one chosen."""
    model = tiny_model("llama")
    cache = vase.EvictingCache(model, policy=f"snapkv:head_budget={heads}:layer_budget=pyramid", budget=32, buffer=8)
    model(input_ids=random_ids(40), **cache_kwargs(cache))
    assert cache.stats().evictions == 1
    first, second = ([sorted(p[p >= 0].tolist()) for p in layer.positions[0]] for layer in cache.layers)
    assert first == [list(range(40))] * 2
    for kept in second:
        assert kept[:4] == [0, 1, 2, 3] and kept[-8:] == list(range(32, 40)) and len(kept) == 13


def test_pyramid_budgets_linear_and_exact_total():
    assert pyramid_budgets(100, 5, fixed=20, beta=4) == [160, 130, 100, 70, 40]  # chosen 140 .. 20, mean 80
    # exact values 16.67, 10, 3.33 over fixed 0: floors 16, 10, 3, the missing token to the largest remainder
    assert pyramid_budgets(10, 3, beta=3) == [17, 10, 3]
    assert pyramid_budgets(64, 30, fixed=8) and sum(pyramid_budgets(64, 30, fixed=8)) == 64 * 30
    assert pyramid_budgets(64, 4, fixed=8, beta=1) == [64] * 4
    with pytest.raises(ValueError, match="larger than the tokens every layer keeps"):
        pyramid_budgets(8, 4, fixed=8)


def test_select_with_per_head_keep():
    """keep [b, H]: each head keeps its forced slots plus its own count of best candidates (and the guard's)."""
    scores, _ = _scores()
    valid = torch.ones(1, 8, dtype=torch.bool)
    forced, cand = structural_masks(valid, 1, 1)  # slots 0 and 7 forced; candidates 1..6 hold HEAD0 / HEAD1
    full = torch.cat([torch.zeros(1, 2, 1), scores, torch.zeros(1, 2, 1)], -1)

    class Fixed:
        window = 0
        state_names = ()

        def score(self, ctx):
            return full.clone()

    from tests.core.test_value_aware import hand_ctx

    ranges = torch.ones(2, 8)
    ranges[1, 6] = 50.0  # head 1: a large value at its worst-scored slot
    ctx, forced = hand_ctx(torch.zeros(2, 8, 2), torch.stack([ranges, torch.zeros_like(ranges)], -1), budget=6)
    counts = head_counts(full, cand, torch.tensor([3]), floor_share=0.0)
    assert counts.tolist() == [[4, 2]]
    keep = counts + 2
    sel = select(Fixed(), TopK(), None, ctx, keep, int(keep.max()), forced)
    assert sel.indices[0, 0].tolist() == [0, 1, 2, 3, 4, 7]
    assert sel.indices[0, 1, :4].tolist() == [0, 1, 2, 7]  # the rest is padding
    guard = ValueGuard("range", share=1 / 6, rule="outlier", factor=4.0)  # cap 1 slot
    sel = select(Fixed(), TopK(), guard, ctx, keep, int(keep.max()), forced)
    assert sel.protected[0].sum(-1).tolist() == [0, 1]
    assert sel.indices[0, 1, :4].tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_head_mask_equals_dense_attention_per_head(kernel):
    """Heads holding different counts, masked per head: the kernels' output equals attention over each head's own
    slots, computed densely."""
    g = torch.Generator().manual_seed(0)
    b, h, group, s, d = 2, 2, 3, 10, 8
    q = torch.randn(b, h * group, 1, d, generator=g)
    k = torch.randn(b, h, s, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g)
    fill = torch.tensor([[5, 10], [7, 3]])
    module = types.SimpleNamespace(num_key_value_groups=group, is_causal=True, training=False)
    if kernel == "sdpa":
        out, _ = sdpa_attention_forward(module, q, k, v, head_mask(fill, s, group), scaling=d**-0.5)
    else:
        out, _ = eager_attention_forward(module, q, k, v, head_mask(fill, s, group, "additive"), scaling=d**-0.5)
    ref = torch.zeros(b, 1, h * group, d)
    for r in range(b):
        for hq in range(h * group):
            n = int(fill[r, hq // group])
            a = torch.softmax((k[r, hq // group, :n] @ q[r, hq, 0]) * d**-0.5, 0)
            ref[r, 0, hq] = a @ v[r, hq // group, :n]
    assert torch.allclose(out, ref, atol=1e-5)


def test_flash_attention_refused_clearly():
    check_head_budgets_supported("sdpa")
    check_head_budgets_supported("vase_eager")
    with pytest.raises(ValueError, match="per-head mask"):
        check_head_budgets_supported("flash_attention_2")


def test_head_counts_with_per_head_candidates():
    """Candidates ``[b, H, S]`` (heads holding different tokens): each head chooses among its own, at most them."""
    scores, _ = _scores()
    cand = torch.ones(1, 2, 6, dtype=torch.bool)
    cand[0, 0, 3:] = False  # head 0 has 3 candidates: .9 .8 .7
    # floor 0, layer-wide top 5: .9 .8 .7 (head 0, all it has), .5 .4 (head 1)
    assert head_counts(scores, cand, torch.tensor([2]) + 0, floor_share=0.0).tolist() == [[3, 1]]
    assert head_counts(scores, cand, torch.tensor([3]), floor_share=0.0).tolist() == [[3, 3]]
    with pytest.raises(ValueError, match="cannot choose"):
        head_counts(scores, cand, torch.tensor([5]), floor_share=0.0)  # 10 wanted, 3 + 6 available


# ------------------------------------------------------------------------------------------------- in the cache
BUDGET, BUFFER, SINKS = 16, 8, 2
ADAPTIVE = (
    "rkv:head_budget=adakv",
    "snapkv:head_budget=adakv:layer_budget=pyramid:head_floor=0",
    "vase:layer_budget=pyramid",
    "vase:preset=paper:head_budget=adakv",  # the prompt kept dense until the first eviction
)
_REF: dict = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Masked-dense reference: each query head attends, by hand, over the tokens its KV head holds in the snapshot
    of the evicting cache (``_REF``) plus the new tokens, causally."""
    old_k, old_v = _REF[module.layer_idx]
    b, hq, q, d = query.shape
    g = hq // key.shape[1]
    out = torch.zeros(b, q, hq, value.shape[-1])
    for j in range(hq):
        k = torch.cat([old_k[j // g], key[0, j // g]])
        v = torch.cat([old_v[j // g], value[0, j // g]])
        n = old_k[j // g].shape[0]
        logits = (query[0, j] @ k.T) * scaling
        seen = torch.ones(q, n + q, dtype=torch.bool)
        seen[:, n:] = torch.ones(q, q, dtype=torch.bool).tril()
        out[0, :, j] = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1) @ v
    return out, None


AttentionInterface.register("budget_reference", _reference_attention)
AttentionMaskInterface.register("budget_reference", lambda *args, **kwargs: None)


def _reference_logits(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Logits of ``ids`` ``[1, q]`` attending over each (layer, KV head)'s live tokens of ``cache`` (batch 1)."""
    for layer in cache.layers:
        live = layer.positions[0] >= 0  # [H, capacity]
        _REF[layer.layer_idx] = (
            [layer.keys[0, h, live[h]].clone() for h in range(live.shape[0])],
            [layer.values[0, h, live[h]].clone() for h in range(live.shape[0])],
        )
    impl = model.config._attn_implementation
    seen = cache.get_seq_length()
    model.set_attn_implementation("budget_reference")
    try:
        with torch.no_grad():
            pos = torch.arange(seen, seen + ids.shape[1]).view(1, -1)
            return model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(impl)


def _step(model, cache, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits[0]


def _poison_dead_slots(cache) -> int:
    """Huge keys and values in the dead slots below the fill (slots of heads keeping fewer than the cap)."""
    n = 0
    for layer in cache.layers:
        f = cache.fill[0]
        dead = layer.positions[:, :, :f] < 0
        layer.keys[:, :, :f][dead] = 50.0
        layer.values[:, :, :f][dead] = 1e4
        n += int(dead.sum())
    return n


def _counts(cache) -> list[list[int]]:
    """Live tokens per (layer, KV head) of row 0."""
    return [(layer.positions[0] >= 0).sum(-1).tolist() for layer in cache.layers]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", ADAPTIVE)
def test_outputs_equal_masked_dense_reference_with_per_head_fills(family, attn, policy):
    """After real evictions with per-head counts (and dead slots poisoned with huge keys and values), a decode step
    and a 3-token chunk give the logits of attention computed by hand over each KV head's own live tokens."""
    model = tiny_model(family, attn, layers=3)
    cache = vase.EvictingCache(model, policy=policy, budget=BUDGET, buffer=BUFFER, sinks=SINKS)
    logits = _step(model, cache, random_ids(40, seed=3))  # compressed at prefill
    checked = 0
    for i in range(30):
        tok = logits[-1:].argmax(-1).view(1, 1)
        if i % 7 == 3:
            tok = torch.cat([tok, random_ids(2, seed=i)], 1)  # a multi-token chunk (teacher-forced replay, chat)
        if cache.stats().evictions and _poison_dead_slots(cache):
            ref = _reference_logits(model, cache, tok)
            logits = _step(model, cache, tok)
            torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)
            checked += 1
        else:
            logits = _step(model, cache, tok)
    assert checked >= 20
    counts = _counts(cache)
    assert any(len(set(c)) > 1 for c in counts) or len({sum(c) for c in counts}) > 1  # heads or layers differ


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", ADAPTIVE + ("h2o:head_budget=adakv:budget_cap=1.5",))
def test_counts_sum_to_the_static_total_after_every_eviction(attn, policy):
    """After each compaction: every head's tokens packed at [0, n) in position order, n <= slots, the heads of a
    layer keeping H x its budget, the layers keeping layers x H x budget, as the eviction recorded."""
    model = tiny_model("llama", attn, layers=4)
    cache = vase.EvictingCache(
        model, policy=policy, budget=BUDGET, buffer=BUFFER, sinks=SINKS, record_evictions=True, seed=3
    )
    h, layers = cache.num_kv_heads, cache.num_layers
    ids = torch.cat([random_ids(30, seed=4), random_ids(70, seed=5)], 1)
    ev = 0
    logits = _step(model, cache, ids[:, :30])
    for i in range(30, 100):
        if cache.stats().evictions > ev:
            ev = cache.stats().evictions
            assert cache.fill == [cache.slots]
            total = 0
            for layer, counts in zip(cache.layers, _counts(cache)):
                budget = cache.layer_budgets[layer.layer_idx]
                assert sum(counts) == h * budget
                assert counts == layer.last_eviction["keep"].view(1, -1).expand(1, h)[0].tolist()
                for head, n in enumerate(counts):
                    pos = layer.positions[0, head]
                    assert n <= cache.slots and bool((pos[:n] >= 0).all()) and bool((pos[n:] == -1).all())
                    assert bool((pos[1:n] > pos[: n - 1]).all())
                total += sum(counts)
            assert total == layers * h * BUDGET
        logits = _step(model, cache, ids[:, i : i + 1] if i % 2 else logits[-1:].argmax(-1).view(1, 1))
    assert ev >= 8
    st = cache.stats()
    # tokens held per (layer, KV head) on average = tokens seen - evicted; the bytes attended are those of them
    since = cache.fill[0] - cache.slots
    assert st.real_tokens[0] - st.tokens_evicted == BUDGET + since
    entry = 2 * cache.head_dim * 4
    assert st.bytes_live == layers * h * (BUDGET + since) * entry
    assert st.bytes_held == layers * h * (cache.slots + BUFFER) * entry
    assert cache.capacity == cache.slots + BUFFER


@pytest.mark.parametrize("policy", [p for p in vase.POLICY_NAMES if vase.make_policy(p).evicts])
@pytest.mark.parametrize("variant", ["layer_budget=pyramid:pyramid_beta=1", "head_budget=adakv:head_floor=1"])
def test_adaptive_path_with_uniform_counts_equals_uniform_cache(policy, variant):
    """Uniform counts through the adaptive path (per-head masks, per-head validity, and with AdaKV twice the slots,
    dead ones included) keep the very tokens the uniform cache keeps: same greedy tokens, same kept positions."""
    model = tiny_model("qwen3", "sdpa", layers=2)
    prompt = random_ids(30, seed=6)
    runs = []
    for spec in (policy, f"{policy}:{variant}"):
        cache = vase.EvictingCache(model, policy=spec, budget=BUDGET, buffer=BUFFER, sinks=SINKS, seed=7)
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            **cache_kwargs(cache),
            max_new_tokens=40,
            min_new_tokens=40,
            do_sample=False,
        )
        kept = [
            [layer.positions[0, h][layer.positions[0, h] >= 0].tolist() for h in range(cache.num_kv_heads)]
            for layer in cache.layers
        ]
        runs.append((out[0].tolist(), kept, cache))
    (tok_u, kept_u, uni), (tok_a, kept_a, ada) = runs
    assert ada.adaptive and not uni.adaptive and ada.stats().evictions == uni.stats().evictions >= 4
    assert tok_a == tok_u
    assert kept_a == kept_u
    assert ada.stats().tokens_evicted == uni.stats().tokens_evicted


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "policy", ["snapkv:head_budget=adakv:head_floor=0", "vase:head_budget=adakv:layer_budget=pyramid"]
)
def test_ragged_rows_equal_rows_alone_with_adaptive_budgets(attn, policy):
    model = tiny_model("llama", attn)
    cache = check_ragged_equals_alone(model, policy)
    assert cache.adaptive and cache.stats().evictions >= 4


def test_layout_and_options():
    adakv = {"head_budget": "adakv", "budget_cap": 2.0}
    assert layout({}, 64, 4, 8) == ([64] * 4, 64)
    assert layout(adakv, 64, 4, 8) == ([64] * 4, 128)
    pyramid = {"layer_budget": "pyramid", "pyramid_beta": 20.0}
    per_layer, slots = layout(pyramid, 64, 4, 8)
    assert sum(per_layer) == 256 and slots == per_layer[0] == max(per_layer)
    with pytest.raises(ValueError, match="raise budget_cap to at least"):
        layout({**pyramid, "budget_cap": 1.5}, 64, 4, 8)
    policy = vase.make_policy("snapkv:head_budget=adakv:layer_budget=pyramid")
    assert policy.adaptive_budgets and "AdaKV" in policy.describe() and "PyramidKV" in policy.describe()
    assert not vase.make_policy("snapkv").adaptive_budgets


@pytest.mark.parametrize(
    "options, message",
    [
        ({"head_budget": "per_head"}, "head_budget must be one of uniform, adakv"),
        ({"layer_budget": "linear"}, "layer_budget must be one of uniform, pyramid"),
        ({"head_budget": "adakv", "budget_cap": 0.5}, "budget_cap must be a number >= 1"),
        ({"head_budget": "adakv", "budget_cap": "big"}, "budget_cap must be a number >= 1"),
        ({"head_budget": "adakv", "head_floor": 1.5}, "head_floor must be in"),
        ({"layer_budget": "pyramid", "pyramid_beta": 0.5}, "pyramid_beta must be a number >= 1"),
        ({"budget_cap": 3}, "budget_cap applies to adaptive budgets only"),
        ({"layer_budget": "pyramid", "head_floor": 0.1}, "head_floor applies to adaptive budgets only"),
        ({"head_budget": "adakv", "pyramid_beta": 4}, "pyramid_beta applies to adaptive budgets only"),
    ],
)
def test_bad_budget_options(options, message):
    with pytest.raises(ValueError, match=message):
        vase.make_policy("snapkv", **options)


def test_cache_errors_flash_attention_and_small_cap():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(ValueError, match="raise budget_cap"):
        vase.EvictingCache(model, policy="snapkv:layer_budget=pyramid:budget_cap=1", budget=BUDGET, buffer=BUFFER)
    vase.EvictingCache(model, policy="snapkv:layer_budget=pyramid", budget=BUDGET, buffer=BUFFER)
    flash = tiny_model("llama", "sdpa")
    flash.config._attn_implementation = "flash_attention_2"  # as loaded with it (no flash kernel on CPU)
    with pytest.raises(ValueError, match="per-head mask"):
        vase.EvictingCache(flash, policy="snapkv:head_budget=adakv", budget=BUDGET, buffer=BUFFER)
    assert flash.config._attn_implementation == "flash_attention_2"  # refused before installing anything


@pytest.mark.parametrize(
    "policy", ["snapkv", "snapkv:softmax=older:pool_edge=zero", "vase:selector=topk", "h2o", "rkv", "keydiff", "knorm"]
)
def test_scorers_skip_dead_slots(policy):
    """Scores with per-head validity ``[b, H, S]`` (dead slots inside each head's layout) equal, on each head's live
    slots, the scores of that head alone with its live slots packed: dead slots neither attract softmax mass nor
    pool into their neighbours."""
    from vase.core.scoring import EvictionContext

    g = torch.Generator().manual_seed(1)
    h, group, s, w, d = 2, 2, 14, 4, 8
    live = torch.ones(h, s, dtype=torch.bool)
    live[0, 5:9] = False
    live[1, 8] = False
    keys, values = torch.randn(h, s, d, generator=g), torch.randn(h, s, d, generator=g)
    queries = torch.randn(h * group, w, d, generator=g)
    scorer = vase.make_policy(policy).scorer

    def ctx_of(k, v, q, valid, positions):
        hh, ss = positions.shape
        forced, cand = structural_masks(valid, 2, 3)
        return EvictionContext(
            keys=k.unsqueeze(0),
            values=v.unsqueeze(0),
            positions=positions.unsqueeze(0),
            valid=valid,
            candidates=cand,
            queries=q.unsqueeze(0),
            query_positions=torch.arange(20, 20 + w).view(1, w),
            query_valid=torch.ones(1, w, dtype=torch.bool),
            scaling=d**-0.5,
            layer_idx=0,
            budget=8,
            row_keys=torch.tensor([7]),
            eviction_index=torch.tensor([0]),
            state={n: torch.zeros(1, hh, ss) for n in scorer.state_names},
            sinks=2,
            buffer=3,
            memo={"latest_query": torch.tensor([23])},
        )

    positions = torch.where(live, live.long().cumsum(-1) - 1, torch.full((h, s), -1))
    both = scorer.score(ctx_of(keys, values, queries, live.unsqueeze(0), positions))
    for head in range(h):
        n = int(live[head].sum())
        alone = scorer.score(
            ctx_of(
                keys[head, live[head]].unsqueeze(0),
                values[head, live[head]].unsqueeze(0),
                queries[head * group : (head + 1) * group],
                torch.ones(1, n, dtype=torch.bool),
                torch.arange(n).view(1, n),
            )
        )
        torch.testing.assert_close(both[0, head, live[head]], alone[0, 0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fam", ["gpt_oss", "olmo3", "qwen3_5"])
def test_hybrid_models_with_adaptive_budgets(fam):
    """Hybrid models (sliding-window or linear-attention layers kept as transformers holds them): with AdaKV and
    PyramidKV over the evicting layers, every decode step's logits equal a dense replay whose full-attention layers
    attend per KV head only to that head's live tokens (tests/hf/test_hybrid.py's masked-dense reference)."""
    from transformers import DynamicCache

    from tests.hf.test_hybrid import MaskedDense, hybrid_model, ids_of, run_with_eviction

    policy = "snapkv:head_budget=adakv:layer_budget=pyramid:head_floor=0"
    model = hybrid_model(fam)
    ids = ids_of(20)
    steps = 50
    cache, logits, tokens, helds = run_with_eviction(model, ids, steps, policy=policy, budget=16, buffer=8)
    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert cache.stats().evictions >= 4 and sorted(cache.layer_budgets) == full
    assert sum(cache.layer_budgets.values()) == 16 * len(full)
    # at some step, the heads of an evicting layer held different counts
    assert any(len(set((held[i] >= 0).sum(-1).tolist())) > 1 for held in helds for i in full)

    ref_model = hybrid_model(fam)
    ref = MaskedDense(ref_model)
    default = DynamicCache(config=ref_model.config)
    with torch.no_grad():
        ref_model(input_ids=ids, **cache_kwargs(default))
        for t in range(steps):
            seen = ids.shape[1] + t
            ref.allowed = {}
            for i in full:
                pos = helds[t][i]  # [kv_heads, fill]; -1 = dead or free
                allowed = torch.zeros((1, pos.shape[0], seen + 1), dtype=torch.bool)
                for h in range(pos.shape[0]):
                    allowed[0, h, pos[h][pos[h] >= 0]] = True
                allowed[..., seen] = True
                ref.allowed[i] = allowed
            out = ref_model(input_ids=tokens[:, t : t + 1], **cache_kwargs(default)).logits[:, -1]
            torch.testing.assert_close(out, logits[t], rtol=1e-4, atol=1e-5)


def test_fidelity_replay_with_adaptive_budgets_reports_its_memory():
    """Teacher-forced replay (chunks ending where the cache evicts) runs with adaptive budgets, equals token-by-token
    decoding, and its record says the slots and the memory compression the cap really gives."""
    from vase.harness.fidelity import replay
    from vase.harness.held import adaptive_slots

    model = tiny_model("llama", "sdpa", layers=3)
    prompt, cont = random_ids(30, seed=8)[0], random_ids(60, seed=9)[0]
    policy = "snapkv:head_budget=adakv:layer_budget=pyramid"
    logprobs, cache = replay(model, prompt, cont, policy, BUDGET, BUFFER, record=True)
    step = vase.EvictingCache(model, policy=policy, budget=BUDGET, buffer=BUFFER)
    with torch.no_grad():
        out = [model(input_ids=prompt.view(1, -1), **cache_kwargs(step)).logits[0, -1:]]
        out += [model(input_ids=t.view(1, 1), **cache_kwargs(step)).logits[0] for t in cont[:-1]]
    torch.testing.assert_close(logprobs, torch.log_softmax(torch.cat(out), -1), atol=1e-4, rtol=1e-4)
    info = adaptive_slots(cache)
    assert info["slots"] == cache.slots == 2 * BUDGET
    full = (30 + 59) / (cache.slots + BUFFER)  # all layers alike: tokens seen over slots allocated per head
    assert info["memory_compression"] == pytest.approx(full)
    assert adaptive_slots(vase.EvictingCache(model, policy="snapkv", budget=BUDGET, buffer=BUFFER)) == {}


@pytest.mark.parametrize("policy", ["full", "quest"])
def test_policies_that_never_evict_take_no_budget_options(policy):
    """Adaptive budgets share what an eviction keeps: ``full`` and the selection policy ``quest`` keep everything."""
    with pytest.raises(ValueError, match="does not take option"):
        vase.make_policy(policy, head_budget="adakv")
    assert not vase.make_policy(policy).adaptive_budgets
