"""Parity of ``vase:preset=paper`` / ``vase_dkv:preset=paper`` with the published method.

The reference semantics are written out here independently, as plain per-(row, KV head) code over the reference's
own physical slot layout (a list of token positions per head, compacted as the reference compacts it), from the
description of the authors' code (terarachang/VaSE, ``EvictLayer`` of ``cache_utils.py``, modes
``range_sink_sample_attn`` with smoothing and ``cur_resample_gauss``):

* a decode step appends; when the length exceeds the budget and is a multiple of the buffer, the cache is compacted
  to ``budget - buffer`` chosen slots followed by the ``buffer`` most recent slots; the prompt is kept dense;
* importance: softmax(q k^T / sqrt(d)) of the last ``buffer`` queries over the slots before the recent window only,
  mean over the queries, ``avg_pool1d(kernel 5, padding 2)`` over those slots in slot order, mean over the GQA group;
* guard: value range (max - min over head_dim) of those slots, the first 4 slots (the sinks) set to +inf, top
  ``budget / 4`` (sinks inside that count), in decreasing order;
* the protected slots' importance is set to 0 and ``budget - buffer - budget / 4`` slots are drawn without
  replacement in proportion to the importance (given draws here: Gumbel keys, in decreasing order);
* the new layout is protected (in top-k order) + drawn (in draw order) + recent;
* VaSE-DKV: G ~ N(0, 1/20) ``[head_dim, 20]`` per (layer, row), shared by the KV heads, drawn at every eviction;
  score ||K G||^2 ||V G||^2 over the slots before the recent window, normalised, sinks set to 1, top-k.

The random draws are given: both sides use vase's counter-based noise for the same (row, layer, eviction, head,
token), so equal inputs must give equal kept sets. Each comparison is also run with one of the published settings
reverted to vase's own, and must then fail: the tests would notice if a point of parity were lost.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import vase
from vase.core import rng
from vase.core.policies import make_policy
from vase.core.scoring import STREAM_PROJECTION, STREAM_SAMPLE, EvictionContext
from vase.harness.outliers import PlantedValues
from vase.hf.compat import cache_kwargs

SINKS = 4


# ------------------------------------------------------------------------------------- the reference, written out
def ref_importance(q: torch.Tensor, k_old: torch.Tensor) -> torch.Tensor:
    """q ``[Hq, W, D]``, k_old ``[L, D]`` of one KV head -> ``[L]`` (the ``G = Hq`` query heads of that head)."""
    d = q.shape[-1]
    p = torch.softmax(q @ k_old.T / math.sqrt(d), dim=-1).mean(1)  # [G, L]
    p = F.avg_pool1d(p.unsqueeze(1), kernel_size=5, stride=1, padding=2).squeeze(1)
    return p.mean(0)


def ref_guard(v_old: torch.Tensor, n_large: int) -> list[int]:
    """Indices (into the slots before the recent window) of the protected slots, in top-k order. The sinks tie at
    +inf; ``topk`` leaves their order unspecified, here they come in slot order (a stable sort)."""
    mag = v_old.amax(-1) - v_old.amin(-1)
    mag[:SINKS] = float("inf")
    return torch.sort(mag, descending=True, stable=True).indices[:n_large].tolist()


def ref_vase_eviction(layout, keys, values, q, noise, budget, buffer):
    """One (row, KV head): layout = list of positions in slot order; keys/values/noise: dicts position -> tensor.

    Returns (new layout, importance by position, protected positions)."""
    old = layout[:-buffer]
    k_old = torch.stack([keys[p] for p in old])
    v_old = torch.stack([values[p] for p in old])
    imp = ref_importance(q, k_old)
    n_large = budget // 4
    large = ref_guard(v_old, n_large)
    attn = imp.clone()
    attn[large] = 0.0
    draw_key = torch.where(
        attn > 0, torch.log(attn.clamp_min(1e-38)) + torch.stack([noise[p] for p in old]), -torch.inf
    )
    drawn = torch.sort(draw_key, descending=True, stable=True).indices[: budget - buffer - n_large].tolist()
    new = [old[i] for i in large] + [old[i] for i in drawn] + layout[-buffer:]
    return new, {old[i]: float(imp[i]) for i in range(len(old))}, {old[i] for i in large}


def ref_dkv_eviction(layout, keys, values, g, budget, buffer):
    old = layout[:-buffer]
    k_old = torch.stack([keys[p] for p in old])
    v_old = torch.stack([values[p] for p in old])
    s = (k_old @ g).pow(2).sum(-1) * (v_old @ g).pow(2).sum(-1)
    s = s / s.sum()
    s[:SINKS] = 1.0
    top = torch.topk(s, budget - buffer).indices.tolist()
    return [old[i] for i in top] + layout[-buffer:]


def ref_schedule(prompt: int, steps: int, budget: int, buffer: int) -> list[int]:
    """Held length after each decode step: the reference appends, then compacts when the length exceeds the budget
    and is a multiple of the buffer."""
    length, out = prompt, []
    for _ in range(steps):
        length += 1
        if length > budget and length % buffer == 0:
            length = budget
        out.append(length)
    return out


# ------------------------------------------------------------------------------ one eviction on identical tensors
B, H, GQA, D, S, BUDGET, BUFFER = 2, 2, 3, 64, 400, 256, 64
OUTLIERS = (17, 90, 201, 333)


def planted_tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, H, S, D, generator=g)
    values = torch.randn(B, H, S, D, generator=g)
    values[:, :, list(OUTLIERS)] *= 20.0  # planted value outliers
    values[:, :, :SINKS] *= 0.1  # sinks: small values, as measured on real models
    queries = torch.randn(B, H * GQA, BUFFER, D, generator=g) * 2.0
    queries[:, :, :, :8] += 3.0 * keys[:, :, 5].repeat_interleave(GQA, 1)[:, :, None, :8]  # a favourite token
    return keys, values, queries


def context(keys, values, queries, policy, state=None):
    positions = torch.arange(S).view(1, 1, S).expand(B, H, S).clone()
    valid = torch.ones(B, S, dtype=torch.bool)
    rank = torch.arange(S).view(1, S).expand(B, S)
    forced = (rank < SINKS) | (rank >= S - BUFFER)
    return (
        EvictionContext(
            keys=keys,
            values=values,
            positions=positions,
            valid=valid,
            candidates=valid & ~forced,
            queries=queries,
            query_positions=torch.arange(S - BUFFER, S).view(1, BUFFER).expand(B, BUFFER).clone(),
            query_valid=torch.ones(B, BUFFER, dtype=torch.bool),
            scaling=D**-0.5,
            layer_idx=3,
            budget=BUDGET,
            row_keys=torch.tensor([rng.row_key(7), rng.row_key(8)]),
            eviction_index=torch.tensor([0, 2]),
            state=state if state is not None else {n: torch.zeros(B, H, S) for n in policy.state_names},
            sinks=SINKS,
            buffer=BUFFER,
        ),
        forced,
    )


def first_eviction_mismatches(spec: str) -> dict:
    """Compare one eviction of ``spec`` with the reference on the planted tensors (slots in position order, as
    before the first compaction); returns the number of differing guard sets, kept sets and the max score error."""
    policy = make_policy(spec)
    keys, values, queries = planted_tensors()
    ctx, forced = context(keys, values, queries, policy)
    noise = rng.gumbel(*ctx.noise_parts(STREAM_SAMPLE))
    sel = policy.select(ctx, torch.full((B,), BUDGET), BUDGET, forced)
    out = {"guard": 0, "kept": 0, "score_err": 0.0}
    for b in range(B):
        for h in range(H):
            layout = list(range(S))
            kd = {p: keys[b, h, p] for p in layout}
            vd = {p: values[b, h, p] for p in layout}
            nd = {p: noise[b, h, p] for p in layout}
            q = queries[b, h * GQA : (h + 1) * GQA]
            new, imp, large = ref_vase_eviction(layout, kd, vd, q, nd, BUDGET, BUFFER)
            ours_prot = set(sel.protected[b, h].nonzero().flatten().tolist()) | set(range(SINKS))
            out["guard"] += ours_prot != large
            out["kept"] += set(sel.indices[b, h].tolist()) != set(new)
            err = max(abs(float(sel.scores[b, h, p]) - v) for p, v in imp.items())
            out["score_err"] = max(out["score_err"], err)
    return out


def test_published_preset_equals_reference_on_one_eviction():
    m = first_eviction_mismatches("vase:preset=paper")
    assert m == {"guard": 0, "kept": 0, "score_err": pytest.approx(0.0, abs=1e-6)}
    # the planted outliers are protected in every (row, head)
    policy = make_policy("vase:preset=paper")
    keys, values, queries = planted_tensors()
    ctx, forced = context(keys, values, queries, policy)
    sel = policy.select(ctx, torch.full((B,), BUDGET), BUDGET, forced)
    assert sel.protected[:, :, list(OUTLIERS)].all()
    assert int(sel.protected[0, 0].sum()) == BUDGET // 4 - SINKS  # sinks counted inside the share


@pytest.mark.parametrize(
    "override, broken",
    [
        ("guard_sinks=outside", "guard"),  # point 1: budget/4 value slots on top of the sinks
        ("softmax=all", "score_err"),  # point 2: recent window in the softmax denominator
    ],
)
def test_each_reverted_point_breaks_parity(override, broken):
    m = first_eviction_mismatches(f"vase:preset=paper:{override}")
    assert (m[broken] > 1e-4) if broken == "score_err" else (m[broken] > 0), m


def test_pooling_through_the_recent_boundary():
    """Issue #9 point 3: pooling through the boundary lets the last two slots before the recent window average the
    recent window's attention. With the reference's softmax (recent slots get no attention) it equals zero padding;
    with a softmax over the whole cache it changes exactly those two slots."""
    keys, values, queries = planted_tensors()
    scores = {}
    for softmax in ("older", "all"):
        for edge in ("zero", "through"):
            policy = make_policy(f"vase:softmax={softmax}:pool_edge={edge}:pool_order=position")
            ctx, _ = context(keys, values, queries, policy)
            scores[softmax, edge] = policy.scorer.score(ctx)
    old = slice(0, S - BUFFER)  # the slots before the recent window (the ones scored)
    assert torch.allclose(scores["older", "zero"][..., old], scores["older", "through"][..., old], atol=1e-7, rtol=0)
    diff = (scores["all", "zero"] - scores["all", "through"]).abs()[..., old]
    changed = (diff > 1e-7).nonzero()[:, 2].unique().tolist()
    assert changed == [S - BUFFER - 2, S - BUFFER - 1]
    assert (scores["all", "through"] > scores["all", "zero"])[..., S - BUFFER - 2 : S - BUFFER].all()


def test_softmax_point_on_the_smallest_case():
    """Issue #9 point 2: query A attends slot 0 and recent slot 4, query B slot 1: the reference gives slots 0 and 1
    equal importance (recent slots are not in its softmax), vase's own softmax halves slot 0."""
    keys = torch.zeros(1, 1, 6, 2)
    keys[0, 0, 0] = torch.tensor([10.0, 0.0])
    keys[0, 0, 1] = torch.tensor([0.0, 10.0])
    keys[0, 0, 4] = torch.tensor([10.0, 0.0])
    queries = torch.tensor([[[[10.0, 0.0], [0.0, 10.0]]]])  # [1, 1, W=2, D=2]
    ratios = {}
    for softmax in ("older", "all"):
        scorer = make_policy(f"snapkv:kernel=1:softmax={softmax}:window=2").scorer
        ctx = EvictionContext(
            keys=keys,
            values=torch.zeros_like(keys),
            positions=torch.arange(6).view(1, 1, 6),
            valid=torch.ones(1, 6, dtype=torch.bool),
            candidates=torch.tensor([[True, True, True, True, False, False]]),
            queries=queries,
            query_positions=torch.tensor([[6, 7]]),
            query_valid=torch.ones(1, 2, dtype=torch.bool),
            scaling=1.0,
            layer_idx=0,
            budget=4,
            row_keys=torch.tensor([1]),
            eviction_index=torch.tensor([0]),
            buffer=2,
        )
        s = scorer.score(ctx)[0, 0]
        ratios[softmax] = float(s[0] / s[1])
    assert ratios["older"] == pytest.approx(1.0, abs=1e-6) and ratios["all"] == pytest.approx(0.5, abs=1e-6)


# ---------------------------------------------------------------------------------------------------- VaSE-DKV
def dkv_mismatches(spec: str, identical_heads: bool = False) -> tuple[int, int]:
    """(kept sets differing from the reference given the same G, head pairs keeping different sets when both heads
    hold identical keys/values)."""
    policy = make_policy(spec)
    keys, values, queries = planted_tensors(seed=5)
    if identical_heads:
        keys[:, 1], values[:, 1] = keys[:, 0], values[:, 0]
    ctx, forced = context(keys, values, None, policy)
    sel = policy.select(ctx, torch.full((B,), BUDGET), BUDGET, forced)
    r = 20
    diff = 0
    for b in range(B):
        g = rng.normal(
            ctx.row_keys[b],
            ctx.layer_idx,
            ctx.eviction_index[b],
            0,
            torch.arange(D).view(D, 1),
            torch.arange(r).view(1, r),
            STREAM_PROJECTION,
        ) / math.sqrt(r)
        for h in range(H):
            layout = list(range(S))
            new = ref_dkv_eviction(
                layout, {p: keys[b, h, p] for p in layout}, {p: values[b, h, p] for p in layout}, g, BUDGET, BUFFER
            )
            diff += set(sel.indices[b, h].tolist()) != set(new)
    same = sum(set(sel.indices[b, 0].tolist()) != set(sel.indices[b, 1].tolist()) for b in range(B))
    return diff, same


def test_published_dkv_equals_reference_given_the_same_projection():
    assert dkv_mismatches("vase_dkv:preset=paper")[0] == 0
    assert dkv_mismatches("vase_dkv:preset=paper", identical_heads=True) == (0, 0)  # one G shared by the heads


def test_dkv_projection_per_head_breaks_parity():
    """Issue #9 point 5, reverted: one G per KV head keeps different sets in two identical heads."""
    diff, _ = dkv_mismatches("vase_dkv:preset=paper:projection=head")
    _, split = dkv_mismatches("vase_dkv:preset=paper:projection=head", identical_heads=True)
    assert diff > 0 and split > 0


# ------------------------------------------------------------ whole decoding runs: layout, schedule, every eviction
def tiny_gqa_model(seed: int = 0):
    """Random Llama with 2 KV heads, GQA 3, head_dim 64 (2 layers)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=H * GQA * D,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=H * GQA,
        num_key_value_heads=H,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


class PositionJitter:
    """Adds a tiny position-dependent offset to every value vector. In layer 0 a repeated token has bit-identical
    values (values carry no position), and the reference leaves ties between equal magnitudes to ``topk``'s
    unspecified order; the jitter makes the comparison about the method, not about tie-breaking."""

    def __init__(self, model):
        self.start = 0
        decoder = model.get_decoder()
        self.handles = [decoder.register_forward_pre_hook(self.pre, with_kwargs=True)]
        for layer in decoder.layers:
            self.handles.append(layer.self_attn.v_proj.register_forward_hook(self.hook))

    def pre(self, module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.start = cache.get_seq_length() if cache is not None else 0

    def hook(self, module, inputs, output):
        q, width = output.shape[1], output.shape[2]
        pos = torch.arange(self.start, self.start + q, dtype=output.dtype).view(1, q, 1)
        return output + 1e-3 * torch.sin(0.37 * pos + 0.11 * torch.arange(width, dtype=output.dtype))

    def detach(self):
        for h in self.handles:
            h.remove()


def run_against_reference(spec: str, prompt: int, steps: int, budget: int = 128, buffer: int = 64, **cache_kw):
    """Greedy decoding of a batch of 2 rows through ``spec``, with a reference simulation fed the same tensors at
    every eviction of every layer. Returns mismatch counts and the held counts of both sides."""
    model = tiny_gqa_model()
    jitter = PositionJitter(model)
    planted = PlantedValues(layers=[0, 1], positions=[6, prompt // 2, prompt + 20], scale=20.0).attach(model)
    cache = vase.EvictingCache(
        model, policy=spec, budget=budget, buffer=buffer, seed=[7, 8], record_evictions=True, **cache_kw
    )
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 128, (2, prompt), generator=g)
    layouts: dict[tuple[int, int, int], list[int]] = {}
    out = {"guard": 0, "kept": 0, "score_err": 0.0, "evictions": 0}
    held, seen_ev = [], [None] * len(cache.layers)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, **cache_kwargs(cache)).logits
            for layer in cache.layers:
                for b in range(2):
                    for h in range(H):
                        pos = layer.positions[b, h]
                        layouts[(layer.layer_idx, b, h)] = pos[pos >= 0].tolist()
            for _ in range(steps):
                nxt = logits[:, -1:].argmax(-1)
                before = list(cache.seq.schedule.evictions)
                logits = model(input_ids=nxt, **cache_kwargs(cache)).logits
                held.append(cache.fill[0])
                for layer in cache.layers:
                    ev = layer.last_eviction
                    fresh = ev is not None and ev is not seen_ev[layer.layer_idx]
                    seen_ev[layer.layer_idx] = ev
                    for b in range(2):
                        for h in range(H):
                            key = (layer.layer_idx, b, h)
                            pos = ev["positions"][b, h] if fresh else layer.positions[b, h]
                            newer = sorted(p for p in pos.tolist() if p > max(layouts[key]))
                            layouts[key] = layouts[key] + newer
                            if not fresh:
                                continue
                            slot = {p: i for i, p in enumerate(ev["positions"][b, h].tolist()) if p >= 0}
                            kd = {p: ev["keys"][b, h, i] for p, i in slot.items()}
                            vd = {p: ev["values"][b, h, i] for p, i in slot.items()}
                            ctx_noise = rng.gumbel(
                                rng.row_key([7, 8][b]),
                                layer.layer_idx,
                                before[b],
                                h,
                                ev["positions"][b, h],
                                STREAM_SAMPLE,
                            )
                            nd = {p: ctx_noise[i] for p, i in slot.items()}
                            q = ev["queries"][b, h * GQA : (h + 1) * GQA]
                            new, imp, large = ref_vase_eviction(layouts[key], kd, vd, q, nd, budget, buffer)
                            layouts[key] = new
                            ours_kept = set(ev["kept_positions"][b, h].tolist())
                            out["kept"] += ours_kept != set(new)
                            prot = ev["protected"][b, h]
                            ours_prot = {int(ev["positions"][b, h, i]) for i in prot.nonzero().flatten()}
                            out["guard"] += (ours_prot | set(range(SINKS))) != large
                            err = max(abs(float(ev["scores"][b, h, slot[p]]) - v) for p, v in imp.items())
                            out["score_err"] = max(out["score_err"], err)
                            out["evictions"] += 1
    finally:
        planted.detach()
        jitter.detach()
    return out, held


@pytest.mark.parametrize("prompt", [100, 300])  # shorter and longer than the budget (dense prompt)
def test_published_preset_follows_the_reference_through_decoding(prompt):
    steps = 330
    m, held = run_against_reference("vase:preset=paper", prompt, steps)
    assert held == ref_schedule(prompt, steps, 128, 64)  # point 6: held slots at every decode step
    assert m["evictions"] >= 2 * 2 * H * 4  # layers x rows x heads x evictions
    assert m["guard"] == 0 and m["kept"] == 0 and m["score_err"] < 1e-6, m


def test_pooling_in_position_order_breaks_parity_after_the_first_compaction():
    """Issue #9 point 4, reverted: pooling over token positions instead of the reference's scrambled slot order
    gives the same first eviction but different importance scores from the second on (the score assertion of the
    parity test fails; the kept sets, drawn with the same noise, often survive such small changes)."""
    m, _ = run_against_reference("vase:preset=paper:pool_order=position", 100, 200)
    assert m["guard"] == 0 and m["score_err"] > 1e-4, m


def test_compressed_prompt_schedule():
    """Held slots with a compressed prompt (vase's own option): budget right after prefill, then a compaction every
    `buffer` steps; differs from the reference schedule for a prompt longer than the budget (point 6 reverted)."""
    model = tiny_gqa_model()
    for prompt in (100, 300):
        cache = vase.EvictingCache(model, policy="vase:preset=paper:prompt=compress", budget=128, buffer=64)
        ids = torch.randint(3, 128, (2, prompt), generator=torch.Generator().manual_seed(3))
        held = []
        with torch.no_grad():
            logits = model(input_ids=ids, **cache_kwargs(cache)).logits
            for _ in range(200):
                logits = model(input_ids=logits[:, -1:].argmax(-1), **cache_kwargs(cache)).logits
                held.append(cache.fill[0])
        fill = min(prompt, 128) if prompt >= 128 + 64 else prompt
        expect = []
        for _ in range(200):
            fill += 1
            fill = 128 if fill >= 192 else fill
            expect.append(fill)
        assert held == expect
        assert (held == ref_schedule(prompt, 200, 128, 64)) == (prompt < 128)


def test_cli_spec_builds_the_published_preset():
    p = make_policy("vase:preset=paper")
    assert p.published and not p.compress_prompt
    assert (p.scorer.softmax, p.scorer.pool_edge, p.scorer.pool_order) == ("older", "zero", "slot")
    assert p.guard.sinks == "inside" and p.guard.count(1024, 4) == 252
    q = make_policy("vase_dkv:preset=paper")
    assert q.scorer.projection == "row" and q.published
    # plain vase: the published selection (chosen by measurement), prompt compressed, no preset rules
    v = make_policy("vase")
    assert (v.scorer.softmax, v.scorer.pool_edge, v.scorer.pool_order, v.guard.sinks) == (
        "older",
        "zero",
        "slot",
        "inside",
    )
    assert v.compress_prompt and not v.published
    assert make_policy("vase_dkv").scorer.projection == "row"


def test_published_budget_rules_and_ratio_rounding():
    from vase.harness.generation import check_options, generate

    with pytest.raises(ValueError, match=r"multiple of the buffer \(64\); got 300: use 256 or 320"):
        check_options(policy="vase:preset=paper", budget=300)
    check_options(policy="vase:preset=paper", budget=320)
    check_options(policy="vase:preset=paper", compression_ratio=4)  # rounded when the prompt is known
    model = tiny_gqa_model()
    from tests.conftest import TinyTokenizer

    res = generate(
        model,
        TinyTokenizer(),
        ["abcdefgh" * 5],
        policy="vase:preset=paper",
        compression_ratio=3,
        buffer=16,
        max_new_tokens=60,
    )
    assert res.stats.budget == 32  # (40 + 60) / 3 = 34 -> the nearest multiple of the buffer
