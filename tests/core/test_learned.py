"""The learned retention score (policy ``learned``): features on hand-made entries (exact values), the ridge fit
recovering a known linear rule, weights that round-trip and are refused for another model, the prior equal to
window attention, training deterministic with a seed, and the stack (learned score x value guard x sampling x
confidence budget) running in the cache and through ``vase train-scorer``."""

from __future__ import annotations

import math

import pytest
import torch

import vase
from tests.conftest import random_ids, tiny_model
from vase.core.learned import FEATURES, LearnedWeights, entry_features, fit_ridge
from vase.hf import ConfidenceFeed
from vase.hf.compat import cache_kwargs

torch.set_num_threads(1)


def test_entry_features_exact():
    keys = torch.tensor([[[[3.0, 4.0], [0.0, 1.0], [1.0, 0.0]]]])  # [1, 1, 3, 2]
    values = torch.tensor([[[[1.0, -1.0], [2.0, 2.0], [0.0, 5.0]]]])
    positions = torch.tensor([[[0, 4, 9]]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    attention = torch.tensor([[[0.5, 0.25, 0.25]]])
    f = entry_features(keys, values, positions, valid, attention, torch.tensor([9]))
    assert f.shape == (1, 1, 3, len(FEATURES))
    col = {name: f[0, 0, :, i] for i, name in enumerate(FEATURES)}
    eps = 1e-6
    torch.testing.assert_close(col["log_attention"], torch.log(attention[0, 0] + eps))
    # average pool of 5 with zero padding over 3 slots: every window holds all three (sum 1), each mean divides by 5
    pooled = torch.log(torch.full((3,), 0.2) + eps)
    torch.testing.assert_close(col["log_pooled_attention"], pooled)
    torch.testing.assert_close(col["log_key_norm"], torch.log(torch.tensor([5.0, 1.0, 1.0]) + eps))
    torch.testing.assert_close(col["log_value_norm"], torch.log(torch.tensor([2**0.5, 8**0.5, 5.0]) + eps))
    torch.testing.assert_close(col["log_value_range"], torch.log(torch.tensor([2.0, 0.0, 5.0]) + eps))
    torch.testing.assert_close(col["log_age"], torch.log1p(torch.tensor([9.0, 5.0, 0.0])))
    torch.testing.assert_close(col["relative_position"], torch.tensor([0.0, 0.4, 0.9]))
    # mean key direction: (0.6, 0.8) + (0, 1) + (1, 0) = (1.6, 1.8), normalised
    anchor = torch.tensor([1.6, 1.8]) / math.hypot(1.6, 1.8)
    expected = torch.stack([torch.tensor([0.6, 0.8]) @ anchor, torch.tensor([0.0, 1.0]) @ anchor, anchor[0]])
    torch.testing.assert_close(col["key_mean_cosine"], expected)
    # an invalid slot: zeros, and left out of the mean key
    f2 = entry_features(keys, values, positions, torch.tensor([[True, True, False]]), attention, torch.tensor([9]))
    assert f2[0, 0, 2].abs().sum() == 0


def test_fit_ridge_recovers_a_linear_rule_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 3, generator=g)
    y = 2.0 * x[:, 0] - 3.0 * x[:, 1] + 1.0
    mean, std, w, b = fit_ridge(x, y, ridge=0.0)
    pred = ((x - mean) / std) @ w + b
    torch.testing.assert_close(pred, y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w / std, torch.tensor([2.0, -3.0, 0.0]), atol=1e-4, rtol=1e-4)
    again = fit_ridge(x, y, ridge=0.0)
    assert all(torch.equal(a, c) for a, c in zip((mean, std, w, b), again))
    shrunk = fit_ridge(x, y, ridge=1.0)[2]
    assert shrunk.abs().sum() < w.abs().sum()  # the penalty shrinks the weights
    with pytest.raises(ValueError, match="N >= 2"):
        fit_ridge(x[:1], y[:1])


def _weights(layers=(0, 1), kv_heads=2, head_dim=16, window=64, model="tiny") -> LearnedWeights:
    n, f = len(layers), len(FEATURES)
    g = torch.Generator().manual_seed(1)
    return LearnedWeights(
        layer_ids=list(layers),
        kv_heads=kv_heads,
        head_dim=head_dim,
        mean=torch.randn(n, kv_heads, f, generator=g),
        std=torch.rand(n, kv_heads, f, generator=g) + 0.5,
        weight=torch.randn(n, kv_heads, f, generator=g),
        bias=torch.randn(n, kv_heads, generator=g),
        model=model,
        window=window,
        info={"note": "hand-made"},
    )


def test_weights_round_trip_and_clear_errors(tmp_path):
    w = _weights()
    path = w.save(tmp_path / "sub" / "w.pt")
    back = LearnedWeights.load(path)
    for name in ("mean", "std", "weight", "bias"):
        assert torch.equal(getattr(back, name), getattr(w, name))
    assert (back.layer_ids, back.kv_heads, back.head_dim, back.model, back.window, back.info) == (
        [0, 1],
        2,
        16,
        "tiny",
        64,
        {"note": "hand-made"},
    )
    with pytest.raises(ValueError, match="not found: train them with `vase train-scorer"):
        vase.make_policy(f"learned:weights={tmp_path / 'missing.pt'}")
    (tmp_path / "junk.pt").write_text("not torch")
    with pytest.raises(ValueError, match="is not a learned scorer weights file"):
        vase.make_policy(f"learned:weights={tmp_path / 'junk.pt'}")
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a learned scorer weights file of format"):
        LearnedWeights.load(tmp_path / "other.pt")
    with pytest.raises(ValueError, match="trained with an attention window of 64 queries: give window=64"):
        vase.make_policy(f"learned:weights={path}:window=32")
    # weights for another shape: refused when the cache is made, naming both shapes
    _weights(layers=(0, 1, 2)).save(tmp_path / "three.pt")
    model = tiny_model("llama", "sdpa", layers=2)
    with pytest.raises(ValueError, match=r"3 evicting layers x 2 KV heads x head_dim 16; this model has 2 x 2 x 16"):
        vase.EvictingCache(model, policy=f"learned:weights={tmp_path / 'three.pt'}", budget=16, buffer=8)
    # and a run naming another model, before anything loads
    from vase.harness.evaluate import RunConfig

    with pytest.raises(ValueError, match="trained on the model 'tiny', this run uses 'smollm2'"):
        RunConfig(model="smollm2", policies=[f"learned:weights={path}"])
    assert RunConfig(model="tiny", policies=[f"learned:weights={path}"]).policies


def _kept(cache):
    return [
        [layer.positions[0, h][layer.positions[0, h] >= 0].tolist() for h in range(cache.num_kv_heads)]
        for layer in cache.layers
    ]


def _generate(model, spec, prompt, n=50, seed=3, **kw):
    cache = vase.EvictingCache(model, policy=spec, budget=16, buffer=8, sinks=2, seed=seed, **kw)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        **cache_kwargs(cache),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        logits_processor=[ConfidenceFeed(cache)],  # a no-op unless step_budget=confidence
    )
    return out[0].tolist(), cache


def test_the_prior_is_window_attention():
    """Without weights the learned score keeps exactly what SnapKV without pooling keeps."""
    model = tiny_model("qwen3", "sdpa", layers=2)
    prompt = random_ids(30, seed=6)
    tok_a, a = _generate(model, "learned", prompt)
    tok_b, b = _generate(model, "snapkv:kernel=1", prompt)
    assert a.stats().evictions == b.stats().evictions >= 4
    assert tok_a == tok_b and _kept(a) == _kept(b)
    assert "learned score prior" in a.policy.describe()


def test_scores_are_the_exponential_of_the_linear_prediction():
    """On a hand-made eviction context: exp(((features - mean) / std) . w + b) of the weights' row for the layer and
    of the KV heads from ``head_offset`` (a tensor-parallel rank's share)."""
    from vase.core.learned import LearnedScore
    from vase.core.scoring import EvictionContext, window_attention

    g = torch.Generator().manual_seed(2)
    b, h, s, d, w = 1, 1, 12, 16, 4
    keys, values = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
    positions = torch.arange(s).view(1, 1, s)
    valid = torch.ones(b, s, dtype=torch.bool)
    ctx = EvictionContext(
        keys=keys,
        values=values,
        positions=positions,
        valid=valid,
        candidates=valid,
        queries=torch.randn(b, 2, w, d, generator=g),
        query_positions=torch.arange(s - w, s).view(1, w),
        query_valid=torch.ones(b, w, dtype=torch.bool),
        scaling=d**-0.5,
        layer_idx=1,
        budget=6,
        row_keys=torch.tensor([1]),
        eviction_index=torch.tensor([0]),
        memo={"latest_query": torch.tensor([s - 1])},
        head_offset=1,
    )
    weights = _weights()
    scorer = LearnedScore.__new__(LearnedScore)
    scorer.path, scorer.weights, scorer.window, scorer._rows = "w.pt", weights, w, {0: 0, 1: 1}
    probs, seen = window_attention(ctx)
    attention = (probs.sum(3) / seen.clamp_min(1).unsqueeze(2)).mean(2)
    f = entry_features(keys, values, positions, valid, attention, torch.tensor([s - 1]))[0, 0]
    z = (f - weights.mean[1, 1]) / weights.std[1, 1]
    expected = torch.exp(z @ weights.weight[1, 1] + weights.bias[1, 1])
    torch.testing.assert_close(scorer.score(ctx)[0, 0], expected)
    ctx.layer_idx = 5
    with pytest.raises(ValueError, match="hold no layer 5"):
        scorer.score(ctx)


def _stack_run(device: str, path) -> tuple[list[int], list[list[int]], int]:
    """Greedy tokens, live entries per (layer, KV head) and evictions of the stack (learned score, value guard,
    confidence budget; top-k, so no random draw differs between devices) on ``device``, float32."""
    model = tiny_model("llama", "sdpa", layers=2).to(device)
    prompt = random_ids(30, seed=6).to(device)
    tokens, cache = _generate(model, f"learned:weights={path}:guard=range:step_budget=confidence", prompt, n=60)
    live = [(layer.positions[0] >= 0).sum(-1).tolist() for layer in cache.layers]
    return tokens, live, cache.stats().evictions


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_stack_on_gpu_equals_cpu(tmp_path):
    """On a GPU, the learned score with the value guard and the confidence budget (weights loaded on the CPU, the
    confidence folded lazily on the device) decodes the CPU's tokens and keeps as many entries per head."""
    path = _weights().save(tmp_path / "w.pt")
    cpu, gpu = _stack_run("cpu", path), _stack_run("cuda", path)
    assert gpu[2] == cpu[2] >= 4
    assert gpu[0] == cpu[0]
    assert gpu[1] == cpu[1]
