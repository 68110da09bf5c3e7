"""Prefill memory: with an evicting cache the prefill peak does not exceed the dense prefill's.

transformers builds an attention mask for every multi-token step from the cache's logical sizes (``[B, 1, q, seen+q]``,
float in eager); vase attends with its own mask over physical slots, so the mask function registered for the
``vase_*`` implementations builds nothing during a forward with an :class:`~vase.EvictingCache` (issue 10.3).

Peaks are measured with the PyTorch profiler's memory events (every CPU allocation and free, in time order): the
largest number of bytes allocated at once above the level at the start, tensors only (tracemalloc and RSS do not
see torch's allocations, or only with noise).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

import vase
from tests.conftest import random_ids, tiny_model
from vase.hf import attention as attn
from vase.hf.compat import cache_kwargs

MIB = 2.0**20
PROMPT = 1024
EVICTING = [p for p in vase.POLICY_NAMES if vase.make_policy(p).evicts]  # not full, nor quest (keeps all)


def peak_bytes(fn) -> int:
    """Largest number of bytes of CPU tensor memory held at once while ``fn()`` runs, above the level at its start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert events, "the profiler recorded no allocation"
    held = top = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        top = max(top, held)
    return top


def _inputs(batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` rows of ``n`` columns; rows after the first are left-padded to half length."""
    ids = random_ids(n, batch=batch)
    mask = torch.ones_like(ids)
    mask[1:, : n // 2] = 0
    return ids.masked_fill(mask == 0, 0), mask


@functools.cache
def _model(attn_impl: str):
    return tiny_model("llama", attn_impl)


def prefill_peak(attn_impl: str, batch: int, cache_factory) -> int:
    """Peak bytes of one prefill forward of a ``PROMPT``-column batch with the cache ``cache_factory(model)``."""
    model = _model(attn_impl)
    ids, mask = _inputs(batch, PROMPT)

    def run():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache_factory(model)), use_cache=True)

    return peak_bytes(run)


@functools.cache
def dense_peak(attn_impl: str, batch: int) -> int:
    # installs vase's attention on the model first, as the evicting runs do (the dense run goes through the wrapper)
    vase.hf.attention.install(_model(attn_impl))
    return prefill_peak(attn_impl, batch, lambda m: DynamicCache(config=m.config))


def test_peak_measurement_sees_tensor_allocations():
    def work():
        a = torch.zeros(1024, 1024)  # 4 MiB
        b = a + 1  # 4 MiB more
        del a, b
        c = torch.ones(256, 1024)  # 1 MiB
        del c

    assert 8 * 2**20 <= peak_bytes(work) < 8 * 2**20 + 1024  # the two 4 MiB tensors, plus a few scalars


@pytest.mark.parametrize("attn_impl,batch", [("eager", 1), ("sdpa", 2)])
@pytest.mark.parametrize("policy", EVICTING)
def test_evicting_prefill_peak_not_above_dense(attn_impl, batch, policy):
    """Eager (float mask, batch 1) and sdpa with left padding (bool mask, batch 2): a 1024-token prefill compressed to
    budget 64 + buffer 16 holds at most what the dense prefill holds at its peak. Before the fix, transformers' unused
    mask came on top: eager 41.97 vs 38.13 MiB, sdpa 2 rows 17.37 vs 15.70 MiB (vase)."""
    dense = dense_peak(attn_impl, batch)
    peak = prefill_peak(
        attn_impl, batch, lambda m: vase.EvictingCache(m, policy=policy, budget=64, buffer=16, seed=list(range(batch)))
    )
    what = f"{policy} {attn_impl} batch {batch}: prefill peak {peak / MIB:.2f} MiB > dense {dense / MIB:.2f}"
    assert peak <= dense, what
    # the dense run does build the mask: a [B, 1, q, q] mask is within the peak of the dense prefill
    mask_bytes = batch * PROMPT * PROMPT * (4 if attn_impl == "eager" else 1)
    assert dense >= mask_bytes


def test_mask_function_builds_nothing_only_with_an_evicting_cache():
    """The registered ``vase_*`` mask functions: transformers' mask, except inside a forward with an EvictingCache."""
    model = tiny_model("llama", "eager")
    vase.EvictingCache(model, budget=16, buffer=4)  # installs vase_eager
    kw = dict(batch_size=1, q_length=3, kv_length=3, attention_mask=None, dtype=torch.float32)
    vase_mask = ALL_MASK_ATTENTION_FUNCTIONS["vase_eager"]
    expected = ALL_MASK_ATTENTION_FUNCTIONS["eager"](**kw)
    assert torch.equal(vase_mask(**kw), expected)
    assert expected[0, 0, 0, 1] == torch.finfo(torch.float32).min and expected[0, 0, 2, 0] == 0

    seen = []
    real = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["vase_eager"]

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["vase_eager"] = spy
    try:
        ids, mask = _inputs(2, 12)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(vase.EvictingCache(model, budget=16, buffer=4)))
            assert seen == [None] and not attn.evicting_forward()
            model(input_ids=ids, attention_mask=mask, **cache_kwargs(DynamicCache(config=model.config)))
    finally:
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["vase_eager"] = real
    assert len(seen) == 2 and seen[1].shape == (2, 1, 12, 12)


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_padded_prefill_logits_unchanged_with_either_cache(attn_impl):
    """Without transformers' mask, the evicting cache's prefill (its own mask) equals the model without vase; and a
    dense forward right after an evicting one gets its usual mask back (sdpa's causal skip included)."""
    plain = tiny_model("llama", attn_impl)
    ids, mask = _inputs(2, 24)
    with torch.no_grad():
        ref = plain(input_ids=ids, attention_mask=mask).logits
        ref_one = plain(input_ids=ids[:1]).logits
        model = tiny_model("llama", attn_impl)
        cache = vase.EvictingCache(model, policy="vase", budget=32, buffer=8)
        out = model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache)).logits
        dense = model(input_ids=ids, attention_mask=mask, **cache_kwargs(DynamicCache(config=model.config))).logits
        one = model(
            input_ids=ids[:1], **cache_kwargs(vase.EvictingCache(model, policy="vase", budget=32, buffer=8))
        ).logits
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense[valid], ref[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one, ref_one, atol=1e-5, rtol=1e-5)
