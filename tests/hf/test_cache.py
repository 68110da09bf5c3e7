"""The evicting cache: equality with the default cache, static buffers, schedule, ragged batches, bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3Config

import vase
from tests.conftest import random_ids, tiny_model
from vase.hf.cache import check_model_supported
from vase.hf.compat import CACHE_KEYWORD, cache_kwargs


def greedy(model, ids, n, cache=None, mask=None, keyword=CACHE_KEYWORD):
    kwargs = {} if cache is None else {keyword: cache}
    if mask is not None:
        kwargs["attention_mask"] = mask
    return model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", vase.POLICY_NAMES)
def test_no_eviction_equals_default_cache(family, attn, policy):
    """Budget >= prompt + new tokens: exactly the tokens of transformers' default cache."""
    model = tiny_model(family, attn)
    ids = random_ids(20)
    ref = greedy(model, ids, 40)
    cache = vase.EvictingCache(model, policy=policy, budget=64, buffer=8)
    out = greedy(model, ids, 40, cache)
    assert torch.equal(out, ref)
    st = cache.stats()
    assert st.evictions == 0 and st.tokens_seen == 59 and st.slots_held == 59


def test_cache_keyword_of_this_transformers_and_hand_loop():
    """The keyword that hands a cache over: ``cache`` in the newer transformers (the old ``past_key_values`` still
    works there, with a warning), ``past_key_values`` before the rename (5.19); ``vase.cache_kwargs`` picks it."""
    model = tiny_model("qwen3")
    ids = random_ids(16)
    ref = greedy(model, ids, 30)
    assert vase.cache_kwargs(None) == {CACHE_KEYWORD: None}
    if CACHE_KEYWORD == "cache":
        with pytest.warns(FutureWarning, match="past_key_values"):
            out = greedy(model, ids, 30, vase.EvictingCache(model, budget=64, buffer=8), keyword="past_key_values")
        assert torch.equal(out, ref)
    else:
        assert CACHE_KEYWORD == "past_key_values"
        with pytest.raises(ValueError, match="cache"):  # the newer keyword is an unused model keyword there
            greedy(model, ids, 30, vase.EvictingCache(model, budget=64, buffer=8), keyword="cache")

    # a hand-written forward loop, no generate
    cache = vase.EvictingCache(model, policy="snapkv", budget=64, buffer=8)
    tokens = ids
    with torch.no_grad():
        logits = model(input_ids=ids, **cache_kwargs(cache)).logits
        for _ in range(30):
            nxt = logits[:, -1:].argmax(-1)
            tokens = torch.cat([tokens, nxt], 1)
            logits = model(input_ids=nxt, **cache_kwargs(cache)).logits
    assert torch.equal(tokens, ref)


def test_default_cache_still_works_after_install():
    """The installed wrapper is transparent for any other cache."""
    model = tiny_model("llama")
    ids = random_ids(12)
    ref = greedy(model, ids, 20)
    vase.EvictingCache(model, budget=64, buffer=8)  # installs vase's attention
    assert model.config._attn_implementation == "vase_sdpa"
    assert torch.equal(greedy(model, ids, 20, DynamicCache(config=model.config)), ref)
    assert torch.equal(greedy(model, ids, 20), ref)


@pytest.mark.parametrize("policy", ["vase", "streaming_llm", "h2o", "rkv"])
def test_static_buffers_over_long_generation(policy):
    """1,100 decode steps at budget 48 + buffer 16: buffers never move or grow, bookkeeping stays exact."""
    model = tiny_model("llama")
    ids = random_ids(10)
    budget, buffer = 48, 16
    cache = vase.EvictingCache(model, policy=policy, budget=budget, buffer=buffer)
    with torch.no_grad():
        logits = model(input_ids=ids, **cache_kwargs(cache)).logits
        ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr()) for layer in cache.layers]
        shape = tuple(cache.layers[0].keys.shape)
        assert shape == (1, 2, budget + buffer, 16)
        seen = ids.shape[1]
        for _ in range(1100):
            nxt = logits[:, -1:].argmax(-1)
            logits = model(input_ids=nxt, **cache_kwargs(cache)).logits
            seen += 1
            assert cache.get_seq_length() == seen
            assert cache.fill[0] <= budget + buffer - 1
            for layer, ptr in zip(cache.layers, ptrs):
                assert (layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr()) == ptr
                assert tuple(layer.keys.shape) == shape and tuple(layer.values.shape) == shape
    st = cache.stats()
    assert st.tokens_seen == 1110 and st.real_tokens == [1110]
    # first eviction when the fill reaches 64, then every 16 steps
    assert st.evictions == (1110 - (budget + buffer)) // buffer + 1
    assert st.bytes_held == 2 * 2 * 2 * (budget + buffer) * 16 * 4
    assert st.bytes_full == 2 * 2 * 2 * 1110 * 16 * 4
    # live slots hold distinct, ordered positions, all in the past
    for layer in cache.layers:
        pos = layer.positions[0, :, : cache.fill[0]]
        assert (pos[:, 1:] > pos[:, :-1]).all() and pos.max() == 1109


def test_sinks_recent_and_guard_after_each_eviction():
    """After every eviction: sinks and recent window present; the vase guard protects exactly the top value ranges."""
    model = tiny_model("qwen3")
    budget, buffer = 40, 8
    cache = vase.EvictingCache(model, policy="vase", budget=budget, buffer=buffer, record_evictions=True)
    n_protect = round(0.25 * budget) - 4  # the 4 sinks count inside the protected quarter, as published
    ids = random_ids(12)
    checked = 0
    with torch.no_grad():
        logits = model(input_ids=ids, **cache_kwargs(cache)).logits
        for _ in range(150):
            nxt = logits[:, -1:].argmax(-1)
            before = cache.stats().evictions
            logits = model(input_ids=nxt, **cache_kwargs(cache)).logits
            if cache.stats().evictions == before:
                continue
            seen = cache.get_seq_length()
            for layer in cache.layers:
                ev = layer.last_eviction
                kept = layer.positions[0, :, :budget]
                assert cache.fill == [budget]
                for h in range(kept.shape[0]):
                    s = set(kept[h].tolist())
                    assert {0, 1, 2, 3} <= s, "sinks evicted"
                    assert set(range(seen - buffer, seen)) <= s, "recent window evicted"
                # direct computation of the protected set: top-n_protect value ranges among the candidates
                v = ev["values"][0].double()
                rng = v.amax(-1) - v.amin(-1)
                cand = ev["candidates"][0]
                rng[:, ~cand] = float("-inf")
                for h in range(rng.shape[0]):
                    expect = set(torch.sort(rng[h], descending=True, stable=True).indices[:n_protect].tolist())
                    got = set(ev["protected"][0, h].nonzero().flatten().tolist())
                    assert got == expect
                    kept_slots = set(ev["kept"][0, h].tolist())
                    assert expect <= kept_slots, "a protected slot was evicted"
                checked += 1
    assert checked >= 2 * 5


def _direct_window_scores(ev, group, kernel=5):
    """Recompute SnapKV/VaSE importance in float64 from what the eviction saw."""
    k = ev["keys"][0].double()  # [H, S, D]
    q = ev["queries"][0].double()  # [Hq, W, D]
    pos, qpos, qvalid, valid = ev["positions"][0], ev["query_positions"][0], ev["query_valid"][0], ev["valid"][0]
    H, S, _ = k.shape
    out = torch.zeros(H, S, dtype=torch.float64)
    for h in range(H):
        per_head = []
        for g in range(group):
            qh = q[h * group + g]
            acc = torch.zeros(S, dtype=torch.float64)
            seen = torch.zeros(S, dtype=torch.float64)  # causal mean: each slot over the queries that can see it
            for w in range(qh.shape[0]):
                if not qvalid[w]:
                    continue
                allowed = valid & (pos[h] <= qpos[w])
                logits = (k[h] @ qh[w]) * ev["scaling"]
                logits[~allowed] = float("-inf")
                acc += torch.softmax(logits, 0)
                seen += (pos[h] <= qpos[w]).double()
            mean = acc / seen.clamp_min(1)
            pooled = torch.nn.functional.avg_pool1d(mean.view(1, 1, S), kernel, 1, kernel // 2).view(S)
            per_head.append(pooled)
        out[h] = torch.stack(per_head).mean(0)
    return out


def test_topk_selection_equals_direct_computation():
    model = tiny_model("llama")
    budget, buffer = 32, 8
    cache = vase.EvictingCache(model, policy="snapkv", budget=budget, buffer=buffer, window=16, record_evictions=True)
    greedy(model, random_ids(50), 30, cache)
    assert cache.stats().evictions >= 3
    for layer in cache.layers:
        ev = layer.last_eviction
        direct = _direct_window_scores(ev, group=2)
        assert torch.allclose(ev["scores"][0].double(), direct, atol=1e-5)
        forced, cand = ev["forced"][0], ev["candidates"][0]
        n_choose = budget - int(forced.sum())
        for h in range(direct.shape[0]):
            sc = direct[h].clone()
            sc[~cand] = float("-inf")
            expect = set(forced.nonzero().flatten().tolist()) | set(sc.topk(n_choose).indices.tolist())
            assert set(ev["kept"][0, h].tolist()) == expect


def test_sampling_reproducible_and_seed_dependent():
    model = tiny_model("llama")
    ids = random_ids(40)

    def kept(seed):
        cache = vase.EvictingCache(model, policy="vase", budget=32, buffer=8, seed=seed)
        out = greedy(model, ids, 40, cache)
        return out, [layer.positions[0, :, :32].clone() for layer in cache.layers]

    out_a, pos_a = kept(0)
    out_b, pos_b = kept(0)
    _, pos_c = kept(1)
    assert torch.equal(out_a, out_b) and all(torch.equal(x, y) for x, y in zip(pos_a, pos_b))
    assert any(not torch.equal(x, y) for x, y in zip(pos_a, pos_c))


def test_sampling_follows_scores():
    """Gumbel-top-k picks candidates in proportion to score ** (1 / T)."""
    from vase.core.scoring import EvictionContext
    from vase.core.selection import Sample, select, structural_masks

    class Fixed:
        window = 0
        state_names = ()

        def score(self, ctx):
            return torch.tensor([0.0, 1.0, 2.0, 7.0, 0.0]).view(1, 1, 5).expand(ctx.positions.shape[0], 1, 5)

    n = 4000
    valid = torch.ones(n, 5, dtype=torch.bool)
    forced, cand = structural_masks(valid, sinks=1, buffer=1)  # slots 0 and 4 forced
    ctx = EvictionContext(
        keys=torch.zeros(n, 1, 5, 2),
        values=torch.zeros(n, 1, 5, 2),
        positions=torch.arange(5).view(1, 1, 5).expand(n, 1, 5),
        valid=valid,
        candidates=cand,
        queries=None,
        query_positions=None,
        query_valid=None,
        scaling=1.0,
        layer_idx=0,
        budget=3,
        row_keys=torch.arange(n),
        eviction_index=torch.zeros(n, dtype=torch.long),
    )
    for temperature, probs in [(1.0, [0.1, 0.2, 0.7]), (0.5, [1 / 54, 4 / 54, 49 / 54])]:
        sel = select(Fixed(), Sample(temperature), None, ctx, torch.full((n,), 3), 3, forced)
        chosen = sel.indices[:, 0, 1]  # the one sampled slot, between the two forced ones
        freq = torch.bincount(chosen, minlength=5)[1:4].double() / n
        assert torch.allclose(freq, torch.tensor(probs, dtype=torch.float64), atol=0.03)


@pytest.mark.parametrize("policy", ["vase", "streaming_llm", "h2o", "snapkv", "rkv", "vase_dkv"])
@pytest.mark.parametrize("compress_prompt", [True, False])
def test_ragged_batch_equals_rows_alone(family, policy, compress_prompt):
    model = tiny_model(family)
    a, b = random_ids(30, seed=1), random_ids(12, seed=2)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 18, dtype=torch.long), b], 1)])
    mask = (ids != 0).long()
    mask[0] = 1
    kw = dict(policy=policy, budget=24, buffer=8, compress_prompt=compress_prompt)
    batch_cache = vase.EvictingCache(model, seed=[5, 9], **kw)
    out = greedy(model, ids, 60, batch_cache, mask=mask)
    assert batch_cache.stats().evictions > 0
    for row, (x, seed) in enumerate([(a, 5), (b, 9)]):
        alone = greedy(model, x, 60, vase.EvictingCache(model, seed=seed, **kw))
        assert torch.equal(alone[0, -60:], out[row, -60:])
    # padding took no slot: the short row never held more real tokens than it saw
    assert batch_cache.stats().real_tokens == [89, 71]  # the last token is never fed back


def test_prompt_longer_than_budget_is_compressed_at_prefill():
    model = tiny_model("llama")
    ids = random_ids(100)
    cache = vase.EvictingCache(model, policy="vase", budget=32, buffer=8, record_evictions=True)
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    assert cache.fill == [32] and cache.get_seq_length() == 100 and cache.stats().evictions == 1
    assert cache.layers[0].keys.shape[2] == 40
    kept = cache.layers[0].positions[0, :, :32]
    assert set(range(92, 100)) <= set(kept[0].tolist()) and {0, 1, 2, 3} <= set(kept[0].tolist())

    dense = vase.EvictingCache(model, policy="vase", budget=32, buffer=8, compress_prompt=False)
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(dense))
    # dense: first eviction at the first multiple of the buffer above the prompt (104), as the reference code
    assert dense.fill == [100] and dense.layers[0].keys.shape[2] == 104
    ref = model(input_ids=ids).logits
    assert torch.allclose(out.logits, ref, atol=1e-5)


def test_full_policy_grows_and_never_evicts():
    model = tiny_model("llama")
    ids = random_ids(10)
    cache = vase.EvictingCache(model, policy="full", budget=16, buffer=4)
    out = greedy(model, ids, 60, cache)
    assert torch.equal(out, greedy(model, ids, 60))
    assert cache.stats().evictions == 0 and cache.fill == [69]


def test_mha_and_gqa():
    for kv in (4, 1):
        model = tiny_model("llama", kv_heads=kv)
        ids = random_ids(20)
        assert torch.equal(
            greedy(model, ids, 20, vase.EvictingCache(model, budget=64, buffer=8)), greedy(model, ids, 20)
        )
        cache = vase.EvictingCache(model, budget=16, buffer=4)
        greedy(model, ids, 30, cache)
        assert cache.layers[0].keys.shape == (1, kv, 20, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_attention_2_on_gpu():
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    model = tiny_model("qwen3", attn="flash_attention_2").to("cuda", torch.bfloat16)
    ids = random_ids(30).cuda()
    ref = greedy(model, ids, 40, DynamicCache(config=model.config))
    assert torch.equal(greedy(model, ids, 40, vase.EvictingCache(model, budget=128, buffer=8)), ref)
    cache = vase.EvictingCache(model, budget=24, buffer=8)
    greedy(model, ids, 60, cache)
    assert cache.stats().evictions > 0


# ------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget=12, buffer=8), "must be larger than sinks"),
        (dict(budget=64, buffer=0), "buffer must be >= 1"),
        (dict(budget=256, protect_share=1.0), "protected share"),
        (dict(budget=256, protect_share=-0.1), "protected share"),
        (dict(policy="lru"), "valid policies: full, streaming_llm"),
        (dict(sampling_temperature=0.0), "sampling_temperature must be > 0"),
        (dict(policy="streaming_llm", sampling_temperature=-1.0), "sampling_temperature must be > 0"),
        (dict(temperature=0.5), "'temperature' is ambiguous: use sampling_temperature .* or attention_temperature"),
        (dict(attention_temperature=0.0), "attention_temperature must be > 0"),
        (dict(policy="vase:preset=paper", budget=100), r"multiple of the buffer \(64\); got 100: use 128"),
        (dict(policy="vase:preset=paper", budget=200), r"got 200: use 192 or 256"),
        (dict(policy="vase:preset=paper", budget=256, window=32), "window must equal the buffer"),
        (dict(policy="vase:preset=papr"), "unknown preset 'papr'"),
        (dict(policy="vase:pool_edge=through"), "pool_order='slot' .* needs pool_edge='zero'"),
        (dict(policy="vase:guard_sinks=both"), "guard_sinks must be one of outside, inside"),
        (dict(policy="vase_dkv:projection=layer"), "projection must be 'head'"),
        (dict(policy="tova", kernel=3), "does not take option"),
        (dict(window=0), "window must be"),
        (dict(seed="x"), "seed must be"),
    ],
)
def test_bad_arguments(kwargs, message):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        vase.EvictingCache(model, **kwargs)


def test_cache_reused_for_other_batch_or_model():
    model, other = tiny_model("llama"), tiny_model("llama", seed=3)
    cache = vase.EvictingCache(model, budget=32, buffer=8)
    greedy(model, random_ids(10), 5, cache)
    with pytest.raises(ValueError, match="batch of 1 rows but got 2"):
        greedy(model, random_ids(10, batch=2), 5, cache)
    vase.EvictingCache(other, budget=32, buffer=8)  # installs the hook on the other model
    with pytest.raises(ValueError, match="created for another model"):
        greedy(other, random_ids(10), 5, cache)
    cache.reset()
    greedy(model, random_ids(10, batch=2), 5, cache)
    assert cache.batch == 2


def test_unsupported_layer_type():
    """A model mixing sliding-window and full-attention layers is taken (see tests/hf/test_hybrid.py); one whose layers
    are all sliding-window has nothing to evict and is refused, naming its layer type."""

    def cfg(full_layers):
        return Qwen3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=full_layers,
        )

    check_model_supported(cfg(1))
    with pytest.raises(ValueError, match="no full-attention layer.*sliding_attention"):
        check_model_supported(cfg(0))


def test_compression_ratio_helper():
    from vase.core.config import VaseConfig

    assert VaseConfig.resolve("vase", ratio=4.0).for_length(4096).budget == 1024
    with pytest.raises(ValueError, match="compression ratio must be > 1"):
        VaseConfig.resolve("vase", ratio=1.0)


def test_ratio_budget_is_shared_by_generate_eval_and_fidelity():
    from vase.core.sizes import ratio_budget

    assert ratio_budget(4096, 4.0, 64) == 1024
    assert ratio_budget(1089, 8.0, 64) == 137  # ceil(1089 / 8)
    assert ratio_budget(100, 8.0, 64) == 69 and ratio_budget(100, 8.0, 16, sinks=2) == 19  # sinks + buffer + 1
    assert ratio_budget(1000, 4.0, 64, published=True) == 256  # 250 to the nearest multiple of the buffer
    assert ratio_budget(100, 8.0, 64, published=True) == 128  # at least two buffers


def test_policy_specs_are_ablations():
    """'name:key=value' specs build the paper's ablations as configurations of the same parts."""
    from vase.core.policies import parse_policy_spec
    from vase.core.selection import Sample, TopK

    assert parse_policy_spec("snapkv:selector=sample:protect_share=0.1:guard=none") == (
        "snapkv",
        {"selector": "sample", "protect_share": 0.1, "guard": None},
    )
    sampling_only = vase.make_policy("vase:guard=none")
    assert sampling_only.guard is None and isinstance(sampling_only.selector, Sample)
    guard_only = vase.make_policy("snapkv:guard=range")
    assert guard_only.guard.metric == "range" and isinstance(guard_only.selector, TopK)
    assert vase.make_policy("vase:guard=random").guard.metric == "random"
    assert vase.make_policy("snapkv:guard=range:guard_mode=evict").guard.mode == "evict"
    with pytest.raises(ValueError, match="expected name:key=value"):
        vase.make_policy("vase:guard")
    model = tiny_model("llama")
    ids = random_ids(40)
    a = greedy(model, ids, 30, vase.EvictingCache(model, policy="vase:guard=none", budget=24, buffer=8))
    b = greedy(model, ids, 30, vase.EvictingCache(model, policy="vase", guard=None, budget=24, buffer=8))
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_device_sync_in_decode_path_on_gpu():
    """The cache's decode path (writes, saved queries, evictions every 8 steps) never synchronizes with the GPU, for
    a ragged batch (rows whose query rings are at different slots) as for one sequence."""
    model = tiny_model("llama").cuda()
    for batch in (2, 1):
        ids = random_ids(40, batch=batch)
        mask = torch.ones_like(ids)
        mask[1:, :7] = 0  # row 1 left-padded: 33 real tokens
        cache = vase.EvictingCache(model, policy="vase", budget=32, buffer=8)
        model(input_ids=ids.cuda(), attention_mask=mask.cuda(), **cache_kwargs(cache))
        tok = torch.full((batch, 1), 5, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for s in range(40):  # 5 evictions
                pos = torch.full((batch, 1), 40 + s, device="cuda")
                model(input_ids=tok, position_ids=pos, **cache_kwargs(cache))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert cache.stats().evictions >= 5


def test_rkv_redundancy_equals_direct_computation():
    """R-KV's suffix-sum redundancy equals the mean cosine similarity to later valid keys, computed densely."""
    import torch.nn.functional as F

    from vase.core.scoring import EvictionContext, RedundancyAware

    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 3, 12, 8
    keys = torch.randn(b, h, s, d, generator=g)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[0, :3] = False  # left padding
    valid[1, 9:] = False  # free slots at the end
    valid[1, 5] = False  # a hole
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0).unsqueeze(1).expand(b, h, s)
    queries = torch.randn(b, 6, 4, d, generator=g)
    ctx = EvictionContext(
        keys=keys,
        values=torch.randn(b, h, s, d, generator=g),
        positions=positions,
        valid=valid,
        candidates=valid.clone(),
        queries=queries,
        query_positions=torch.arange(20, 24).expand(b, 4),
        query_valid=torch.ones(b, 4, dtype=torch.bool),
        scaling=d**-0.5,
        layer_idx=0,
        budget=6,
        row_keys=torch.arange(b),
        eviction_index=torch.zeros(b, dtype=torch.long),
    )
    lam = 0.1
    scorer = RedundancyAware(window=4, kernel=3, lam=lam)
    got = scorer.score(ctx)
    importance = scorer._importance.score(ctx)
    kn = F.normalize(keys, dim=-1)
    sim = kn @ kn.transpose(-1, -2)
    later = (torch.arange(s).view(s, 1) < torch.arange(s).view(1, s)) & valid.view(b, 1, 1, s)
    red = (sim * later).sum(-1) / later.sum(-1).clamp_min(1)
    red = torch.softmax(red.masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1)
    want = lam * importance - (1 - lam) * red
    assert torch.allclose(got[valid.unsqueeze(1).expand_as(got)], want[valid.unsqueeze(1).expand_as(want)], atol=1e-6)
