"""Tensor parallelism in vLLM: a worker holds a share of each layer's KV heads and evicts them alone, so every policy
the plugin serves must choose per KV head (or be refused with more than one worker).

No engine: the eviction a worker runs (:func:`vase.core.evict.evict_layer` over its heads, keyed by the model's index
of its first head) for one worker holding every head against two holding half each, and the engine rule that refuses
what two workers cannot reproduce. Runs in any environment (the rule needs no vLLM: a stand-in engine config).
"""

from __future__ import annotations

import pytest
import torch

from tests.policies import variants
from tests.vllm.test_admission import _engine
from vase.core.config import VaseConfig
from vase.core.evict import evict_layer
from vase.core.policies import parse_policy_spec

H, G, S, D, W = 4, 2, 48, 16, 8  # KV heads, GQA group, slots, head dim, saved queries


def _kept(config: VaseConfig, heads: slice, inputs: dict) -> torch.Tensor:
    """The kept slot indices ``[b, h, budget]`` (sorted) of one worker holding the KV heads ``heads``."""
    pol = config.policy
    b = inputs["keys"].shape[0]
    h = heads.stop - heads.start
    qheads = slice(heads.start * G, heads.stop * G)
    window = bool(config.window)
    ev = evict_layer(
        pol,
        inputs["keys"][:, heads].contiguous(),
        inputs["values"][:, heads].contiguous(),
        inputs["positions"][:, heads].contiguous(),
        inputs["valid"],
        budget=config.budget,
        slots=config.budget,
        sinks=config.sinks,
        recent=config.recent,
        row_keys=torch.tensor([5, 9]),
        eviction_index=torch.tensor([0, 1]),
        latest_query=torch.tensor([S - 1, S - 1]),
        queries=inputs["queries"][:, qheads].contiguous() if window else None,
        query_positions=inputs["query_positions"] if window else None,
        query_valid=inputs["query_valid"] if window else None,
        state={name: torch.zeros(b, h, S) for name in pol.state_names},
        memo={name: torch.full((b,), value) for name, value in pol.memo_names.items()},
        layer_idx=3,
        head_offset=heads.start,  # the worker's first KV head in the model (rank x H / tp)
    )
    return ev.indices.sort(-1).values


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    b = 2
    return {
        "keys": torch.randn(b, H, S, D, generator=g),
        "values": torch.randn(b, H, S, D, generator=g),
        "positions": torch.arange(S).view(1, 1, S).expand(b, H, S).clone(),
        "valid": torch.ones(b, S, dtype=torch.bool),
        "queries": torch.randn(b, H * G, W, D, generator=g),
        "query_positions": torch.arange(S - W, S).view(1, W).expand(b, W).clone(),
        "query_valid": torch.ones(b, W, dtype=torch.bool),
    }


@pytest.mark.parametrize("spec", variants())
def test_two_workers_keep_what_one_keeps_or_the_policy_is_refused(spec):
    """For every policy the plugin serves: one eviction by one worker (heads 0..H-1) against two workers (heads
    0..H/2-1 from offset 0, H/2..H-1 from offset H/2). Either the kept slots are equal in every (row, KV head), or the
    engine rules (:func:`vase.vllm.rules.check_engine`, run at engine start and before it) refuse the policy with
    ``tensor_parallel_size=2`` (and accept it with one worker)."""
    from vase.vllm.rules import check_engine

    name, options = parse_policy_spec(spec)
    config = VaseConfig.resolve(name, budget=24, buffer=8, sinks=2, **options)
    inputs = _inputs()
    one = _kept(config, slice(0, H), inputs)
    two = torch.cat([_kept(config, slice(0, H // 2), inputs), _kept(config, slice(H // 2, H), inputs)], dim=1)
    refused = [p for p in check_engine(_engine(tp=2, kv_heads=H), config) if "reduced over every KV head" in p]
    assert not [p for p in check_engine(_engine(tp=1, kv_heads=H), config) if "reduced over every KV head" in p]
    if torch.equal(one, two):
        assert not refused, f"{spec}: per KV head, yet refused with two workers"
    else:
        assert refused, f"{spec}: two workers keep other slots than one in {(one != two).any(-1).sum()} heads"
        assert config.policy.name == "tova"  # the one layer-wide score today


def test_tova_is_the_layer_wide_score():
    """TOVA's mean over every head of the layer makes its choices depend on the other heads (refused with tensor
    parallelism); every other served policy chooses per KV head."""
    layer_wide = set()
    for spec in variants():
        name, options = parse_policy_spec(spec)
        if not VaseConfig.resolve(name, budget=24, buffer=8, **options).policy.per_kv_head:
            layer_wide.add(name)
    assert layer_wide == {"tova"}


def test_adakv_is_not_per_kv_head():
    assert not VaseConfig.resolve("snapkv", budget=256, head_budget="adakv").policy.per_kv_head
    assert VaseConfig.resolve("snapkv", budget=256).policy.per_kv_head
