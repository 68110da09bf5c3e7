"""Planted value outliers (the mechanism VaSE is about) and the causal mean over window queries."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import random_ids, tiny_model
from vase.core.policies import make_policy
from vase.core.scoring import EvictionContext
from vase.harness.fidelity import FidelityConfig, planted_positions, replay, run_fidelity
from vase.harness.outliers import PlantedValues, kept_share
from vase.hf.compat import cache_kwargs


def test_planting_scales_the_chosen_values_only():
    model = tiny_model("llama", kv_heads=2)
    ids = random_ids(40)
    from transformers import DynamicCache

    with torch.no_grad():
        plain = DynamicCache(config=model.config)
        model(input_ids=ids, **cache_kwargs(plain))
        hooks = PlantedValues(layers=[1], positions=[7, 30], scale=20.0).attach(model)
        planted = DynamicCache(config=model.config)
        model(input_ids=ids, **cache_kwargs(planted))
        hooks.detach()
    v0, v1 = plain.layers[1].values[0], planted.layers[1].values[0]  # [H, T, D]
    rng0 = v0.amax(-1) - v0.amin(-1)
    rng1 = v1.amax(-1) - v1.amin(-1)
    median = rng0.median(-1).values  # [H]
    for p in (7, 30):
        assert torch.allclose(rng1[:, p], 20 * median, rtol=1e-4)
        assert torch.allclose(
            v1[:, p] / v1[:, p].norm(dim=-1, keepdim=True), v0[:, p] / v0[:, p].norm(dim=-1, keepdim=True), atol=1e-5
        )
    others = [t for t in range(40) if t not in (7, 30)]
    assert torch.equal(v1[:, others], v0[:, others])  # untouched tokens, and layer 0 untouched:
    assert torch.equal(plain.layers[0].values, planted.layers[0].values)
    with pytest.raises(ValueError, match="not in the model"):
        PlantedValues(layers=[5], positions=[1]).attach(model)


def test_value_guard_keeps_planted_outliers_attention_only_policies_lose_some():
    model = tiny_model("llama", kv_heads=2, layers=2)
    ids = random_ids(300, seed=9)[0]
    prompt, cont = ids[:40], ids[40:]
    positions = planted_positions(40, 260, 6)
    held = {}
    for policy in ("vase", "snapkv", "h2o", "tova"):
        hooks = PlantedValues(layers=[0, 1], positions=positions, scale=20.0).attach(model)
        try:
            _, cache = replay(model, prompt, cont, policy, 48, 8, record=True)
        finally:
            hooks.detach()
        held[policy] = kept_share(cache, [0, 1], positions)
    assert held["vase"] == 1.0
    assert min(held["snapkv"], held["h2o"], held["tova"]) < 1.0, held


class CharTokenizer:
    """Characters to ids, for a text source replayed through a tiny random model."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 100 for c in text]}


def test_fidelity_records_planted_share(tmp_path):
    from tests.conftest import tiny_lm

    lm = tiny_lm("llama")
    lm.tokenizer = CharTokenizer()
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij" * 40)
    cfg = FidelityConfig(
        model="tiny",
        source=f"text:{text}",
        prompts=1,
        tokens=100,
        prefix_tokens=20,
        policies=["vase", "snapkv"],
        ratios=[4.0],
        buffer=8,
        plant_layers=[1],
        plant_tokens=3,
    )
    path = run_fidelity(cfg, tmp_path / "run", progress=False, lm=lm)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["policy"] for r in recs} == {"vase", "snapkv"}
    assert all(0.0 <= r["planted_kept"] <= 1.0 for r in recs)
    assert [r for r in recs if r["policy"] == "vase"][0]["planted_kept"] == 1.0


def test_window_queries_older_than_a_candidate_do_not_starve_it():
    """Issue #10 point 4: with a buffer (8) smaller than the observation window (64), a candidate newer than some
    window queries is averaged over the queries that can see it. On uniform attention the newest candidate then
    scores close to the oldest ones (0.86x here: later queries spread over more slots), instead of ~0.07x."""
    s, w = 200, 64
    ctx = EvictionContext(
        keys=torch.zeros(1, 1, s, 4),
        values=torch.zeros(1, 1, s, 4),
        positions=torch.arange(s).view(1, 1, s),
        valid=torch.ones(1, s, dtype=torch.bool),
        candidates=torch.ones(1, s, dtype=torch.bool),
        queries=torch.zeros(1, 1, w, 4),
        query_positions=torch.arange(s - w, s).view(1, w),
        query_valid=torch.ones(1, w, dtype=torch.bool),
        scaling=1.0,
        layer_idx=0,
        budget=100,
        row_keys=torch.tensor([1]),
        eviction_index=torch.tensor([0]),
        sinks=4,
        buffer=8,
    )
    scores = make_policy("snapkv:kernel=1").scorer.score(ctx)[0, 0]
    newest, oldest = s - 9, 4
    expect_new = sum(1 / (q + 1) for q in range(newest, s)) / (s - newest)
    expect_old = sum(1 / (q + 1) for q in range(s - w, s)) / w
    assert scores[newest].item() == pytest.approx(expect_new, rel=1e-5)
    assert scores[oldest].item() == pytest.approx(expect_old, rel=1e-5)
    assert scores[newest] / scores[oldest] > 0.8
