"""The core's sequence model (:mod:`vase.core.sequence`): schedule, row tables, query ring, and a third integration.

The last test builds a toy integration — plain tensors for keys and values, a dozen lines of storage — on the core's
sequence model alone, feeds it the keys, values and queries the transformers cache saw, and gets the same kept sets
as :mod:`vase.hf` at every step: what an integration must provide is storage and attention, nothing more.
"""

from __future__ import annotations

import pytest
import torch

import vase
from tests.conftest import random_ids, tiny_model
from tests.policies import variants
from vase.core.config import VaseConfig
from vase.core.evict import gather_kept
from vase.core.ring import QueryRing
from vase.core.schedule import Schedule, first_limit
from vase.core.sequence import Sequences
from vase.core.tables import RowTables
from vase.hf.compat import cache_kwargs


# -------------------------------------------------------------------------------------------------- schedule
def test_first_limit_follows_the_prompt_only_when_dense():
    kw = dict(budget=64, buffer=16, evicts=True)
    assert first_limit(10, compress_prompt=True, **kw) == 80
    assert first_limit(500, compress_prompt=True, **kw) == 80
    assert first_limit(10, compress_prompt=False, **kw) == 80  # at least budget + buffer
    assert first_limit(100, compress_prompt=False, **kw) == 96 + 16  # the first multiple of 16 above 100
    assert first_limit(112, compress_prompt=False, **kw) == 112 + 16
    assert first_limit(100, budget=64, buffer=16, evicts=False, compress_prompt=True) == 116  # never evicts: grows


def test_schedule_plans_evictions_fills_and_counts():
    s = Schedule(budget=8, buffer=4, slots=8, evicts=True, compress_prompt=True)
    s.admit(0, 5)
    s.admit(1, 20)
    step = s.plan([0, 1], [5, 20])  # row 1 does not fit: compressed at prefill
    assert (step.keep, step.evict, step.fill_after, step.seen_before) == ([5, 8], [1], [5, 20], [0, 0])
    s.commit(step)
    assert (s.fill, s.seen, s.evictions, s.tokens_evicted, s.eviction_steps) == ([5, 8], [5, 20], [0, 1], 12, 1)
    assert s.room() == [7, 4]
    for _ in range(3):
        s.commit(s.plan([0, 1], [1, 1]))
    step = s.plan([0, 1], [1, 1])  # row 1 reaches 8 + 4
    assert step.evict == [1] and step.keep == [9, 8] and step.latest == [8, 23]
    s.commit(step)
    assert s.evictions == [0, 2] and s.rows_evicted == 2 and s.tokens_evicted == 12 + 4


def test_schedule_quantization_limits():
    s = Schedule(budget=16, buffer=8, slots=16, evicts=True, compress_prompt=True, quantize=True)
    s.admit(0, 3)
    s.commit(s.plan([0], [3]))
    for _ in range(4):
        s.commit(s.plan([0], [1], append=True))
    step = s.plan([0], [1], append=True)  # 8 recent tokens: quantized, without an eviction
    assert step.qlimit == [8] and step.flush == [0] and not step.evict
    s.commit(step)
    assert s.room() == [8]


def test_schedule_full_precision_window():
    """kv_window=R: the newest R tokens are never below the quantization limit; a row quantizes buffer tokens each
    time R + buffer are above it, a compaction quantizes slots - R, a chunk whole buffers leaving at least R."""
    s = Schedule(budget=16, buffer=8, slots=16, evicts=True, compress_prompt=True, quantize=True, window=4)
    s.admit(0, 3)
    s.commit(s.plan([0], [3]))
    assert s.room() == [9]  # the flush comes at 4 + 8 recent tokens
    for _ in range(8):
        step = s.plan([0], [1], append=True)
        assert step.qlimit == [0] and not step.flush
        s.commit(step)
    step = s.plan([0], [1], append=True)
    assert step.qlimit == [8] and step.flush == [0]  # fill 12: 8 quantized, the newest 4 kept
    s.commit(step)
    assert (s.fill, s.qlimit, s.room()) == ([12], [8], [8])
    for _ in range(7):
        s.commit(s.plan([0], [1], append=True))
    assert (s.fill, s.qlimit) == ([19], [8])  # the most quantized before the first eviction: 24 - 8 - 4 = 12
    step = s.plan([0], [1], append=True)
    assert step.qlimit == [12] and step.flush == [0]
    s.commit(step)
    for _ in range(3):
        s.commit(s.plan([0], [1], append=True))
    step = s.plan([0], [1], append=True)  # fill 24: evicts, keeps 16, quantizes 16 - 4
    assert step.evict == [0] and step.keep == [16] and step.qlimit == [12]
    s.commit(step)
    assert s.room() == [8]  # the next eviction (24) comes before the next quantization (12 + 12)
    chunk = Schedule(budget=64, buffer=8, slots=64, evicts=True, compress_prompt=True, quantize=True, window=4)
    chunk.admit(0, 30)
    step = chunk.plan([0], [30])  # a prefill of 30: 24 quantized (whole buffers), 6 >= 4 recent
    assert step.qlimit == [24] and not step.evict
    with pytest.raises(ValueError, match="full-precision window"):
        Schedule(budget=16, buffer=8, slots=16, evicts=True, compress_prompt=True, quantize=True, window=16)


def test_rows_with_budgets_of_their_own():
    """A row admitted with its own budget evicts at its budget + buffer back to its budget, a row admitted without
    eviction never evicts, the others keep the schedule's; one eviction call takes one budget (budget_groups splits),
    and the kept entries number the row's budget."""
    from vase.core.sequence import budget_groups

    s = Schedule(budget=16, buffer=8, slots=16, evicts=True, compress_prompt=True)
    s.admit(0, 4)
    s.admit(1, 4, budget=32)
    s.admit(2, 4, evicts=False)
    s.commit(s.plan([0, 1, 2], [4, 4, 4]))
    assert s.limits() == [24, 40, 24] and s.room() == [20, 36, 20]
    step = s.plan([0, 1, 2], [20, 20, 20])
    assert step.evict == [0] and step.keep == [16, 24, 24]
    s.commit(step)
    step = s.plan([0, 1, 2], [8, 16, 100])
    assert step.evict == [0, 1] and step.keep == [16, 32, 124]
    assert budget_groups(step, step.evict, s) == [[0], [1]]
    s.commit(step)
    assert s.limits()[:2] == [24, 40] and s.tokens_evicted == 8 + 8 + 8
    with pytest.raises(ValueError, match="uniform budgets"):
        Schedule(budget=16, buffer=8, slots=24, evicts=True, compress_prompt=True).admit(0, 4, budget=32)

    config = VaseConfig.resolve("keydiff", budget=16, buffer=8, sinks=2)
    seq = Sequences(config, [0])
    seq.admit(0, 40, seed=1)
    seq.admit(1, 40, seed=2, budget=24)
    seq.tables.allocate(0, 2, 2, 40, "cpu")
    step = seq.schedule.plan([0, 1], [40, 40])
    assert step.evict == [0, 1] and step.keep == [16, 24]
    keys, values = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    positions = torch.arange(40).view(1, 1, 40).expand(2, 2, 40).clone()
    valid = torch.ones(2, 40, dtype=torch.bool)
    state = {n: torch.rand(2, 2, 40) for n in config.policy.state_names}
    with pytest.raises(ValueError, match="share a budget"):
        seq.evict(0, step, [0, 1], keys, values, positions, valid, state)
    for group in budget_groups(step, step.evict, seq.schedule):
        g = torch.tensor(group)
        ev = seq.evict(0, step, group, keys[g], values[g], positions[g], valid[g], {n: t[g] for n, t in state.items()})
        want = seq.schedule.row_budget[group[0]]
        assert ev.indices.shape[2] == want and ev.keep.tolist() == [want]
        kept = set(ev.indices[0, 0].tolist())
        assert {0, 1} | set(range(32, 40)) <= kept and len(kept) == want  # the sinks, the recent window, the budget


def test_a_row_budget_changes_while_it_runs():
    """set_budget (a serving engine's elastic budget): a row whose fill is at or past its new limit evicts at its next
    step to the new budget; a row below it goes on to the new limit; before its first eviction a compressed prompt's
    limit follows the new budget, a dense prompt's stays above the prompt; rows that never evict, adaptive budgets
    and quantized storage are refused."""
    s = Schedule(budget=32, buffer=8, slots=32, evicts=True, compress_prompt=True)
    for row in range(3):
        s.admit(row, 4)
    s.commit(s.plan([0, 1, 2], [38, 20, 4]))  # fills 38, 20, 4: none at its limit 40
    s.set_budget(0, 16)  # limit 24 <= fill 38: evicts at its next step
    s.set_budget(1, 24)  # limit 32 > fill 20: not yet
    assert s.limits() == [24, 32, 40] and s.row_budget[:2] == [16, 24]
    step = s.plan([0, 1, 2], [1, 1, 1])
    assert step.evict == [0] and step.keep == [16, 21, 5]
    s.commit(step)
    assert s.limits() == [24, 32, 40] and s.tokens_evicted == 39 - 16
    step = s.plan([0, 1, 2], [8, 11, 1])
    assert step.evict == [0, 1] and step.keep == [16, 24, 6]
    dense = Schedule(budget=32, buffer=8, slots=32, evicts=True, compress_prompt=False)
    dense.admit(0, 50)
    dense.set_budget(0, 16)
    assert dense.limit(0) == first_limit(50, budget=16, buffer=8, evicts=True, compress_prompt=False) == 56
    dense.admit(1, 50, evicts=False)
    with pytest.raises(ValueError, match="never evicts"):
        dense.set_budget(1, 16)
    for kw in ({"slots": 40}, {"quantize": True}):
        other = Schedule(**{"budget": 32, "buffer": 8, "slots": 32, "evicts": True, "compress_prompt": True, **kw})
        other.admit(0, 4)
        with pytest.raises(ValueError, match="uniform budgets, full-precision storage"):
            other.set_budget(0, 16)


# --------------------------------------------------------------------------------------------- tables, ring
def test_tables_write_kept_and_held():
    t = RowTables([0], ("acc",), {"acc_upto": -1})
    t.allocate(0, rows=2, heads=1, width=6, device="cpu")
    t.put_span(0, 0, torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]))
    t.state[0]["acc"][:, :, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    idx = torch.tensor([[[0, 2, 3]]])
    p, s = t.held(0, torch.tensor([1]), 4)
    _, _, kept, st = gather_kept(idx, torch.tensor([2]), torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, 4, 1), p, s)
    t.write_kept(0, torch.tensor([1]), kept, st)
    assert t.positions[0][1, 0].tolist() == [0, 2, -1, -1, -1, -1]
    assert t.state[0]["acc"][1, 0].tolist() == [1.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    assert t.positions[0][0, 0].tolist() == [0, 1, 2, 3, -1, -1]  # the other row untouched
    p, s = t.held(0, None, 8, never_evicted=[True, False])  # a row never compacted holds position i in slot i
    assert p[0, 0].tolist() == list(range(8)) and p[1, 0].tolist() == [0, 2, -1, -1, -1, -1, -1, -1]
    assert t.memo[0]["acc_upto"].tolist() == [-1, -1]


def test_ring_has_one_pointer_per_row():
    ring = QueryRing(layers=1, window=3)
    ring.prepare(2, "cpu")
    ring.allocate(0, q_heads=1, head_dim=1, dtype=torch.float32, device="cpu")
    w = ring.plan([0, 1], [2, 5], [0, 0])  # row 0 saves its 2 tokens, row 1 its last 3
    assert w.kind == "scatter" and w.offsets == [0, 1, 2, 3, 4]
    ring.write(0, w, torch.tensor([10.0, 11.0, 22.0, 23.0, 24.0]).view(5, 1, 1))
    ring.commit(w)
    assert ring.next == [2, 0]
    w = ring.plan([0, 1], [1, 1], [2, 5])
    ring.write(0, w, torch.tensor([12.0, 25.0]).view(2, 1, 1))
    ring.commit(w)
    q, pos, valid = ring.read(0)
    assert q[:, 0, :, 0].tolist() == [[10.0, 11.0, 12.0], [25.0, 23.0, 24.0]]
    assert pos.tolist() == [[0, 1, 2], [5, 3, 4]] and bool(valid.all())


# ------------------------------------------------------------------------------------- a third integration
class ToyIntegration:
    """vase in an imaginary engine: keys and values in plain tensors, attention done elsewhere; everything else is
    the core's sequence model."""

    def __init__(self, config: VaseConfig, layers: int, heads: int, dim: int):
        self.seq = Sequences(config, list(range(layers)))
        self.cap = config.budget + config.buffer
        self.k = torch.zeros(layers, 1, heads, self.cap, dim)  # the storage: a dozen lines, this class
        self.v = torch.zeros_like(self.k)

    def step(self, keys, values, queries, scaling) -> None:
        """One forward of ``n`` tokens: ``keys[l]``, ``values[l]`` ``[1, H, n, D]``, ``queries[l]`` ``[1, Hq, n,
        D]``."""
        seq, n = self.seq, keys[0].shape[2]
        if not seq.schedule.rows:
            seq.admit(0, n, seed=3)
            seq.ring.prepare(1, "cpu")
        plan = seq.schedule.plan([0], [n])
        ring = seq.ring.plan([0], [n], plan.seen_before)
        f, after = plan.fill_before[0], plan.fill_after[0]
        for li in range(len(keys)):
            if not seq.tables.allocated(li):
                seq.tables.allocate(li, 1, keys[li].shape[1], self.cap, "cpu")
                seq.ring.allocate(li, queries[li].shape[1], queries[li].shape[3], torch.float32, "cpu")
            self.k[li, :, :, f:after], self.v[li, :, :, f:after] = keys[li], values[li]
            seq.tables.put_span(li, f, torch.arange(plan.seen_before[0], plan.seen_before[0] + n).view(1, n))
            q = queries[li][:, :, -ring.index.numel() :] if ring.kind == "block" else queries[li][:, :, -1:]
            seq.ring.write(li, ring, q)
            if plan.evict:
                pos, state = seq.tables.positions[li], seq.tables.state[li]
                valid = torch.arange(self.cap).view(1, -1) < after
                ev = seq.evict(li, plan, [0], self.k[li], self.v[li], pos, valid, state, scaling=scaling)
                k, v, p, st = gather_kept(ev.indices, ev.keep, self.k[li], self.v[li], pos, ev.state)
                self.k[li, :, :, : k.shape[2]], self.v[li, :, :, : k.shape[2]] = k, v
                seq.tables.write_kept(li, None, p, st)
        seq.commit(plan, ring)


@pytest.mark.parametrize("policy", ["vase", "h2o"])
def test_a_toy_integration_keeps_what_vase_hf_keeps(policy):
    model = tiny_model("llama")
    cache = vase.EvictingCache(model, policy=policy, budget=24, buffer=8, seed=3)
    seen: list[dict] = []  # per forward: each layer's new keys, values, queries (what the hf cache was given)
    update = cache.update

    def spy_update(k, v, layer_idx, *args, **kwargs):
        seen[-1]["kv"].append((k.clone(), v.clone()))
        return update(k, v, layer_idx, *args, **kwargs)

    cache.update = spy_update
    for layer in cache.layers:
        record = layer.record_queries

        def spy_record(query, scaling, record=record):
            seen[-1]["q"].append(query.clone())
            seen[-1]["scaling"] = scaling if scaling is not None else query.shape[-1] ** -0.5
            return record(query, scaling)

        layer.record_queries = spy_record
    snapshots = []
    with torch.no_grad():
        ids = random_ids(20)
        for _ in range(70):
            seen.append({"kv": [], "q": []})
            logits = model(input_ids=ids, **cache_kwargs(cache)).logits
            ids = logits[:, -1:].argmax(-1)
            snapshots.append([layer.positions[0].clone() for layer in cache.layers])
    assert cache.stats().evictions >= 7
    toy = ToyIntegration(cache.config, len(cache.layers), cache.num_kv_heads, cache.head_dim)
    for t, (fwd, snap) in enumerate(zip(seen, snapshots)):
        toy.step([k for k, _ in fwd["kv"]], [v for _, v in fwd["kv"]], fwd["q"], fwd["scaling"])
        for li, held in enumerate(snap):
            assert torch.equal(toy.seq.tables.positions[li][0], held), (policy, t, li)
    for li, layer in enumerate(cache.layers):
        for name, state in layer.state.items():
            assert torch.equal(toy.seq.tables.state[li][name], state), (policy, name)
        assert torch.equal(toy.k[li], layer.keys)


# ------------------------------------------------------------------------------------ several layers, one call
def _layers_case(spec: str, layer_ids=(3, 5, 9), b=2, h=2, hq=4, s=40, d=16):
    """A fresh sequence model for ``spec`` over three layers, and per layer the held entries of ``b`` rows (the second
    one shorter), their state and saved queries: what an integration gives one eviction call per layer."""
    from vase.core.policies import parse_policy_spec

    name, options = parse_policy_spec(spec)
    config = VaseConfig.resolve(name, budget=16, buffer=8, sinks=2, **options)
    seq = Sequences(config, list(layer_ids))
    g = torch.Generator().manual_seed(7)
    lengths = [s, s - 6]
    for r, n in enumerate(lengths):
        seq.admit(r, n, seed=11 + r)
    step = seq.schedule.plan([0, 1], lengths)
    if seq.ring is not None:
        seq.ring.prepare(b, "cpu")
        ring = seq.ring.plan([0, 1], lengths, [0, 0], scatter=True)
    per_layer = []
    for li in range(len(layer_ids)):
        seq.tables.allocate(li, b, h, s, "cpu")
        keys, values = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
        values[:, :, 5] *= 20  # a value outlier for the guards
        valid = torch.arange(s).view(1, s) < torch.tensor(lengths).view(b, 1)
        positions = torch.arange(s).expand(b, h, s).masked_fill(~valid.unsqueeze(1), -1)
        state = {n: torch.rand(b, h, s, generator=g) * valid.unsqueeze(1) for n in config.policy.state_names}
        if seq.ring is not None:
            seq.ring.allocate(li, hq, d, torch.float32, "cpu")
            seq.ring.write(li, ring, torch.randn(sum(ring.saved), hq, d, generator=g))
        per_layer.append((keys, values, positions, valid, state))
    return seq, step, per_layer


@pytest.mark.parametrize("spec", variants() + ["learned:weights=LEARNED"])
def test_evict_layers_chooses_what_one_call_per_layer_chooses(spec, tmp_path):
    """Sequences.evict_layers (the rows of several layers stacked into one call, as the vLLM plugin does after a
    step's forward) keeps, for every policy, exactly the slots, counts, state and memo that one evict call per layer
    keeps: the random choices are keyed by each row's layer."""
    if "LEARNED" in spec:
        from vase.core.learned import FEATURES, LearnedWeights

        n, f = 3, len(FEATURES)
        g = torch.Generator().manual_seed(1)
        weights = LearnedWeights(
            layer_ids=[3, 5, 9], kv_heads=2, head_dim=16, mean=torch.randn(n, 2, f, generator=g),
            std=torch.rand(n, 2, f, generator=g) + 0.5, weight=torch.randn(n, 2, f, generator=g),
            bias=torch.randn(n, 2, generator=g), model="tiny", window=64, info={},
        )  # fmt: skip
        spec = spec.replace("LEARNED", str(weights.save(tmp_path / "w.pt")))
    one, step, inputs = _layers_case(spec)
    alone = [
        one.evict(li, step, [0, 1], k, v, p.clone(), ok, {n: t.clone() for n, t in st.items()})
        for li, (k, v, p, ok, st) in enumerate(inputs)
    ]
    many, step, inputs = _layers_case(spec)
    layers = [0, 1, 2]
    assert many.layer_groups(layers) == [layers]
    ev = many.evict_layers(
        layers,
        step,
        [0, 1],
        *(torch.cat([x[i] for x in inputs]) for i in range(4)),
        {n: torch.cat([x[4][n] for x in inputs]) for n in inputs[0][4]},
    )
    for li, a in enumerate(alone):
        part = slice(2 * li, 2 * li + 2)
        assert torch.equal(ev.indices[part], a.indices), (spec, li)
        assert torch.equal(ev.keep[part], a.keep), (spec, li)
        for n, t in a.state.items():
            assert torch.equal(ev.state[n][part], t), (spec, li, n)
        for n, m in one.tables.memo[li].items():
            assert torch.equal(many.tables.memo[li][n], m), (spec, li, n)


def test_evict_layers_refuses_layers_of_different_budgets():
    config = VaseConfig.resolve("snapkv", budget=16, buffer=8, sinks=2, layer_budget="pyramid")
    seq = Sequences(config, [0, 1, 2, 3], layer_budgets=[24, 20, 12, 8])
    assert seq.layer_groups([0, 1, 2, 3]) == [[0], [1], [2], [3]]
    seq.admit(0, 30, seed=1)
    step = seq.schedule.plan([0], [30])
    keys, positions, valid = torch.randn(2, 2, 30, 16), torch.arange(30).expand(2, 2, 30), torch.ones(2, 30, dtype=bool)
    with pytest.raises(ValueError, match="share a budget, got \\[20, 24\\]: see layer_groups"):
        seq.evict_layers([0, 1], step, [0], keys, keys, positions, valid, {})
