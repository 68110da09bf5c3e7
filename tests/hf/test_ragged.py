"""Ragged batches: every row of a batch gives what it gives alone, whichever rows compress in a step.

A row's tokens and its cache contents (slots kept, their positions, keys and per-slot scorer state) must not depend
on the other rows of its batch: not at prefill when only some rows are compressed, not at a decode compaction of some
rows, not at a multi-token continuation where some rows overflow. Each row keeps its own random key (``seed=[...]``),
so stochastic policies are comparable too.
"""

from __future__ import annotations

import pytest
import torch

import vase
from tests.conftest import random_ids, tiny_model
from tests.policies import compresses_prompt, evicting_names, variants
from vase.core.config import VaseConfig
from vase.core.policy import Policy
from vase.core.scoring import EvictionContext, Scorer
from vase.core.selection import TopK
from vase.hf.compat import cache_kwargs

BUDGET, BUFFER = 16, 8
# Prompt lengths of the rows and, per row, the length of a second multi-token chunk (a chat continuation).
# With budget 16 + buffer 8: row 0 (60 tokens) is compressed at prefill, row 1 (20) at its 4th decode step, row 2
# (5) never during the first phase; in the continuation rows 1 and 2 overflow and are compressed, row 0 is not.
PROMPTS = (60, 20, 5)
CONTINUATIONS = (3, 10, 30)
SEEDS = (5, 9, 13)
STEPS = (12, 6)  # greedy decode steps after the prompt, after the continuation


def _feed(model, cache, chunks: list[torch.Tensor], mask: torch.Tensor | None):
    """One forward of ``chunks`` (``[q_i]`` int64 per row), left-padded to a common length; returns (logits, mask).

    ``mask`` is the 2-D attention mask so far (``[B, seen]``) and is extended; positions count real tokens only, as
    ``generate`` computes them from the mask.
    """
    q = max(len(c) for c in chunks)
    ids = torch.zeros((len(chunks), q), dtype=torch.long)
    new = torch.zeros((len(chunks), q), dtype=torch.long)
    for i, c in enumerate(chunks):
        ids[i, q - len(c) :] = c
        new[i, q - len(c) :] = 1
    mask = new if mask is None else torch.cat([mask, new], 1)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)[:, -q:]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache), use_cache=True)
    return out.logits[:, -1], mask


def run_phases(model, cache, phases: list[tuple[list[torch.Tensor], int]]):
    """Feed each phase's chunks (one per row), then decode greedily ``n`` steps; returns tokens and snapshots.

    Returns ``(tokens [B, sum(n)], snapshots)``: one snapshot of the cache per phase end (see :func:`snapshot`).
    """
    mask, tokens, snaps = None, [], []
    for chunks, n in phases:
        logits, mask = _feed(model, cache, chunks, mask)
        for step in range(n):
            tok = logits.argmax(-1)
            tokens.append(tok)
            if step < n - 1:
                logits, mask = _feed(model, cache, [t.view(1) for t in tok], mask)
        snaps.append(snapshot(cache))
    return torch.stack(tokens, 1), snaps


def snapshot(cache: vase.EvictingCache) -> list[dict]:
    """Per row: fill, real tokens seen, and per layer the positions, keys, values and scorer state of its slots."""
    rows = []
    for r in range(cache.batch):
        f = cache.fill[r]
        layers = []
        for layer in cache.layers:
            layers.append(
                {
                    "positions": layer.positions[r, :, :f].clone(),
                    "free": layer.positions[r, :, f:].clone(),
                    "keys": layer.keys[r, :, :f].clone(),
                    "values": layer.values[r, :, :f].clone(),
                    "state": {n: s[r, :, :f].clone() for n, s in layer.state.items()},
                    "memo": {n: m[r].clone() for n, m in layer.row_memo.items()},
                    "queries": _saved_queries(layer, r),
                }
            )
        rows.append({"fill": f, "real": cache.stats().real_tokens[r], "layers": layers})
    return rows


def _saved_queries(layer, r: int) -> tuple[list[int], torch.Tensor] | None:
    """Row ``r``'s saved queries in the layer's ring: their positions (ascending) and ``[q_heads, n, head_dim]``."""
    if layer.queries is None:
        return None
    valid = layer.query_valid[r]
    pos = layer.query_positions[r][valid]
    order = pos.argsort()
    return pos[order].tolist(), layer.queries[r][:, valid][:, order].clone()


def assert_row_equal(batch_row: dict, solo_row: dict, what: str) -> None:
    assert batch_row["fill"] == solo_row["fill"], what
    assert batch_row["real"] == solo_row["real"], what
    for li, (b, s) in enumerate(zip(batch_row["layers"], solo_row["layers"])):
        where = f"{what}, layer {li}"
        assert torch.equal(b["positions"], s["positions"]), where
        assert bool((b["free"] == -1).all()), where
        torch.testing.assert_close(b["keys"], s["keys"], atol=1e-5, rtol=1e-5, msg=where)
        torch.testing.assert_close(b["values"], s["values"], atol=1e-5, rtol=1e-5, msg=where)
        assert b["state"].keys() == s["state"].keys(), where
        for n in b["state"]:
            torch.testing.assert_close(b["state"][n], s["state"][n], atol=1e-4, rtol=1e-4, msg=f"{where}, {n}")
        for n in b["memo"]:
            assert torch.equal(b["memo"][n], s["memo"][n]), f"{where}, {n}"
        assert (b["queries"] is None) == (s["queries"] is None), where
        if b["queries"] is not None:
            assert b["queries"][0] == s["queries"][0], f"{where}: positions of the saved queries"
            torch.testing.assert_close(b["queries"][1], s["queries"][1], atol=1e-5, rtol=1e-5, msg=where)


def check_ragged_equals_alone(model, policy, prompts=PROMPTS, continuations=CONTINUATIONS, steps=STEPS, **kw):
    """Run the rows together and each alone; compare tokens and cache contents after each phase. Returns the batch
    cache."""
    seeds = list(SEEDS[: len(prompts)])
    first = [random_ids(n, seed=10 + i)[0] for i, n in enumerate(prompts)]
    second = [random_ids(n, seed=20 + i)[0] for i, n in enumerate(continuations)]
    cache = vase.EvictingCache(model, policy=policy, budget=BUDGET, buffer=BUFFER, seed=seeds, **kw)
    tokens, snaps = run_phases(model, cache, [(first, steps[0]), (second, steps[1])])
    for r in range(len(prompts)):
        alone = vase.EvictingCache(model, policy=policy, budget=BUDGET, buffer=BUFFER, seed=seeds[r], **kw)
        solo_tokens, solo_snaps = run_phases(model, alone, [([first[r]], steps[0]), ([second[r]], steps[1])])
        assert tokens[r].tolist() == solo_tokens[0].tolist(), f"row {r}: tokens differ from the row alone"
        for phase, (bs, ss) in enumerate(zip(snaps, solo_snaps)):
            assert_row_equal(bs[r], ss[0], f"row {r}, phase {phase}")
    return cache


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", [*variants(), "full", "quest:page=4"])
def test_ragged_rows_equal_rows_alone(family, attn, policy):
    """Rows compressed at prefill, at decode, at a continuation, or never: each equals the row run alone. (quest
    never evicts; with pages of 4 tokens it selects within this test's budget of 16 at every step after the prefill.)

    The demanding variants run in float64: their value guards rank entries by their values' range, and the tiny
    model's first-layer values repeat exactly for a repeated token (values carry no position), so the ranking has exact
    ties that the few float32 ulps between a batched forward and a row alone break one way or the other; computed in
    float64, the guard's float32 metric keeps the ties exact and breaks them by slot, as the row alone does."""
    model = tiny_model(family, attn)
    if policy not in evicting_names() and policy not in ("full", "quest:page=4"):
        model = model.double()
    cache = check_ragged_equals_alone(model, policy)
    if VaseConfig.resolve(policy).policy.evicts:
        # The schedule the test is about did happen: prefill compressed row 0 only, and rows evicted on their own
        # (a dense prompt, the published preset, waits for its first multiple of the buffer: fewer evictions).
        assert cache.stats().evictions >= (4 if compresses_prompt(policy) else 2)
        fed = [p + c + STEPS[0] - 1 + STEPS[1] - 1 for p, c in zip(PROMPTS, CONTINUATIONS)]
        assert cache.stats().real_tokens == fed


def test_h2o_accumulated_attention_survives_partial_prefill_compression():
    """Issue 10.2, smallest case: a 1-token row and an 8-token row; only the long row is compressed at prefill."""
    model = tiny_model("llama")
    short, long_ = random_ids(1, seed=1)[0], random_ids(8, seed=2)[0]
    kw = dict(policy="h2o", budget=5, buffer=1, sinks=1)
    batch = vase.EvictingCache(model, seed=[0, 1], **kw)
    tokens, snaps = run_phases(model, batch, [([short, long_], 8)])
    alone = vase.EvictingCache(model, seed=1, **kw)
    solo_tokens, solo_snaps = run_phases(model, alone, [([long_], 8)])
    # Right after prefill: the long row's accumulated attention is the one it has alone (not the zeros of new slots).
    batch2 = vase.EvictingCache(model, seed=[0, 1], **kw)
    run_phases(model, batch2, [([short, long_], 1)])
    alone2 = vase.EvictingCache(model, seed=1, **kw)
    run_phases(model, alone2, [([long_], 1)])
    acc_batch = batch2.layers[0].state["acc"][1, :, :5]
    acc_alone = alone2.layers[0].state["acc"][0, :, :5]
    assert batch2.fill == [1, 5] and alone2.fill == [5]
    assert acc_alone.sum().item() == pytest.approx(13.3337, abs=1e-3)
    torch.testing.assert_close(acc_batch, acc_alone)
    assert torch.equal(batch2.layers[0].row_memo["acc_upto"], torch.tensor([-1, 7]))
    # ... and the long row's greedy tokens stay those it gives alone.
    assert tokens[1].tolist() == solo_tokens[0].tolist()
    assert_row_equal(snaps[0][1], solo_snaps[0][0], "long row")


class _Visits(Scorer):
    """A test scorer with two per-slot states and a per-row memo: ``seen`` counts the evictions each slot went
    through (replaced, not updated in place), ``score`` is its position plus that count (updated in place)."""

    state_names = ("seen", "score")

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        ctx.state["seen"] = ctx.state["seen"] + ctx.valid.unsqueeze(1).float()
        ctx.state["score"].copy_(ctx.positions.float() + ctx.state["seen"])
        ctx.memo["acc_upto"] = ctx.memo["latest_query"]
        return ctx.state["score"].clone()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_scorer_state_survives_partial_compaction(attn):
    """Any scorer's per-slot states, updated in place or replaced, move with their tokens for exactly the rows that
    were scored, at prefill, decode and continuation, whole batch or some rows."""
    policy = Policy("visits", _Visits(), TopK(), None, "test", "test", {})
    model = tiny_model("qwen3", attn)
    cache = check_ragged_equals_alone(model, policy)
    counts = [layer.state["seen"] for layer in cache.layers]
    assert max(float(c.max()) for c in counts) >= 2  # some tokens went through several evictions
    # A slot's count is at most the evictions its row had; free slots hold no state.
    for layer in cache.layers:
        for r, f in enumerate(cache.fill):
            assert float(layer.state["seen"][r, :, :f].max()) <= cache.seq.schedule.evictions[r]
            assert bool((layer.state["seen"][r, :, f:] == 0).all())
    # the whole batch compacting together (all rows the same length) takes the whole-batch paths
    check_ragged_equals_alone(model, policy, prompts=(30, 30), continuations=(12, 12), steps=(10, 4))
