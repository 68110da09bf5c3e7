"""Assisted / speculative decoding with an EvictingCache is refused before any token is fed, and leaves the cache as
it was: transformers would feed prompt + draft tokens and crop the rejected ones, which an evicting cache cannot undo.
"""

from __future__ import annotations

import pytest
import torch

import vase
from tests.conftest import random_ids, tiny_model
from tests.hf.test_hybrid import hybrid_model
from vase.hf.compat import cache_kwargs

ASSISTED = ["prompt_lookup", "assistant_model"]


def _models(kind: str):
    if kind == "llama":
        return tiny_model("llama"), tiny_model("llama", seed=1)
    return hybrid_model("gemma3"), hybrid_model("gemma3", seed=1)


def _generate(model, cache, ids, new: int = 40, **kwargs) -> torch.Tensor:
    return model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        **cache_kwargs(cache),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("assisted", ASSISTED)
def test_assisted_decoding_is_refused_and_leaves_nothing_behind(kind, assisted):
    model, assistant = _models(kind)
    ids = random_ids(20)
    cache = vase.EvictingCache(model, budget=16, buffer=4)
    extra = {"prompt_lookup_num_tokens": 3} if assisted == "prompt_lookup" else {"assistant_model": assistant}
    with pytest.raises(ValueError, match="assisted and speculative decoding .* not supported with an EvictingCache"):
        _generate(model, cache, ids, **extra)
    assert cache.get_seq_length() == 0  # nothing was fed
    for layer in cache.layers:
        assert not getattr(layer, "record_past", False)  # the kept sliding layers were not switched to past-recording
    # the same cache then decodes exactly as a new one (40 tokens: several evictions, sliding layers at their window)
    out = _generate(model, cache, ids)
    fresh = vase.EvictingCache(model, budget=16, buffer=4)
    assert torch.equal(out, _generate(model, fresh, ids))
    assert cache.stats().evictions == fresh.stats().evictions > 0
    for a, b in zip(cache.layers, fresh.layers):
        assert a.keys.shape == b.keys.shape and torch.equal(a.keys, b.keys)
