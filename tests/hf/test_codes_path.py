"""Decoding over quantized entries reads the codes (policy option kv_attention=codes, the default): the same
next-token distributions as dequantizing each layer into the workspace first (kv_attention=dequantize), for every
bit width, the guard's full-precision entries, ragged batches, continuations and hybrid models
(learned sinks, a soft cap, which falls back to the workspace), and no per-step buffer the size of the cache."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import vase
from tests.conftest import random_ids, tiny_model
from tests.hf.test_hybrid import hybrid_model
from tests.hf.test_quant import _close_up_to_one_code
from tests.hf.test_ragged import CONTINUATIONS, PROMPTS, SEEDS, STEPS, run_phases
from vase.hf.compat import cache_kwargs

GROUP = 8  # the tiny models have head_dim 16


def _forced(model, spec: str, ids: torch.Tensor, first: int, budget: int = 24, buffer: int = 8):
    """Log-probabilities of every next token, the first ``first`` tokens as a prefill and then one at a time."""
    cache = vase.EvictingCache(model, policy=spec, budget=budget, buffer=buffer)
    out = []
    with torch.no_grad():
        out.append(model(input_ids=ids[:, :first], **cache_kwargs(cache)).logits[:, -1])
        for t in range(first, ids.shape[1]):
            out.append(model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache)).logits[:, -1])
    return torch.log_softmax(torch.stack(out, 1).float(), -1), cache


SPECS = [
    "vase:kv_bits=4",
    "vase:kv_bits=8",
    "snapkv:kv_bits=2",
    "h2o:kv_bits=4:guard=range:protect_share=0.25:protect_precision=guard",
    "full:kv_bits=4:guard=range:protect_precision=guard",
    "vase:kv_bits=4:kv_window=8",
    "h2o:kv_bits=2:guard=range:protect_precision=guard:kv_window=4",
    "full:kv_bits=4:kv_window=16",
]


@pytest.mark.parametrize("spec", SPECS)
def test_codes_equal_the_dequantized_workspace(spec):
    model = tiny_model("llama")
    ids = random_ids(150, seed=2)
    spec += f":kv_group={GROUP}"
    codes, cache = _forced(model, spec, ids, 30)
    ref, ref_cache = _forced(model, spec + ":kv_attention=dequantize", ids, 30)
    torch.testing.assert_close(codes, ref, atol=2e-5, rtol=1e-4)
    ws, ref_ws = cache.workspace, ref_cache.workspace
    assert ws.codes_seconds > 0 and ref_ws.codes_seconds == 0
    assert ws.dequant_seconds < ref_ws.dequant_seconds  # only steps that evict or quantize dequantize
    assert cache.stats().evictions == ref_cache.stats().evictions
    for i, (a, b) in enumerate(zip(cache.layers, ref_cache.layers)):  # the same stores after the same steps
        for name in ("qmask", "protected"):
            assert torch.equal(getattr(a.storage, name), getattr(b.storage, name)), name
        assert torch.equal(a.positions, b.positions)
        for name in ("kq", "ks", "kz", "vq", "vs", "vz"):
            x, y = getattr(a.storage, name), getattr(b.storage, name)
            if i == 0:  # the first layer's keys and values are the same inputs: bit for bit
                assert torch.equal(x, y), name
            elif x.dtype == torch.uint8:  # later layers' inputs differ by the two kernels' float rounding
                assert float((x != y).float().mean()) < 0.01, name
            else:
                torch.testing.assert_close(x, y, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("spec", ["vase:kv_bits=4", "snapkv:kv_bits=2:guard=range:protect_precision=guard"])
def test_ragged_rows_and_continuations(spec):
    """Rows of a ragged batch at different fills and quantization limits, a multi-token continuation (a chunk) in the
    middle: the same tokens and stores as the workspace path (float64: the torch implementation)."""
    model = tiny_model("qwen3").double()
    spec += f":kv_group={GROUP}"
    first = [random_ids(n, seed=10 + i)[0] for i, n in enumerate(PROMPTS)]
    second = [random_ids(n, seed=20 + i)[0] for i, n in enumerate(CONTINUATIONS)]
    phases = [(first, STEPS[0] + 20), (second, STEPS[1] + 20)]
    runs = []
    for s in (spec, spec + ":kv_attention=dequantize"):
        cache = vase.EvictingCache(model, policy=s, budget=16, buffer=8, seed=list(SEEDS))
        tokens, _ = run_phases(model, cache, phases)
        runs.append((tokens, cache))
    assert runs[0][0].tolist() == runs[1][0].tolist()
    assert runs[0][1].workspace.codes_seconds > 0 and runs[0][1].stats().evictions > 0
    for a, b in zip(runs[0][1].layers, runs[1][1].layers):
        ka, va = a.entries()
        kb, vb = b.entries()
        for x, y in ((ka, kb), (va, vb)):  # the workspace path's attention reads float32-dequantized keys
            _close_up_to_one_code(x, y, (1 << runs[0][1].kv_bits) - 1)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma3", "gemma2"])
def test_hybrid_models_sinks_scaling_and_soft_cap(family):
    """gpt-oss's learned sinks and Gemma 3's scaling are read by the codes path; Gemma 2's soft-capped logits fall back
    to the workspace (no codes read), with the same results.

    In float64 (but gpt-oss, whose expert matmuls take float32 only): the two paths compute a deeper layer's values a
    few float32 ulps apart, and one of them close to a rounding boundary then takes the neighbouring code in one path
    only (4 bits: 1e-3 in the log-probabilities until it is evicted); float64 noise rounds away in the float32
    quantization arithmetic."""
    model = hybrid_model(family)
    if family != "gpt_oss":
        model = model.double()
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(4))
    spec = f"vase:kv_bits=4:kv_group={GROUP}"
    codes, cache = _forced(model, spec, ids, 20)
    ref, _ = _forced(model, spec + ":kv_attention=dequantize", ids, 20)
    torch.testing.assert_close(codes, ref, atol=2e-5, rtol=1e-4)
    assert (cache.workspace.codes_seconds > 0) == (family != "gemma2")


def _largest_allocation(model, cache, token) -> int:
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=token, **cache_kwargs(cache))
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


def test_no_per_step_buffer_scales_with_the_cache():
    """A decode step over 1,024 quantized slots per (layer, KV head) allocates nothing near the size of one layer's
    dequantized entries; the workspace path does (it dequantizes into temporaries of that size)."""
    model = tiny_model("llama")
    prompt = random_ids(1100, seed=6)
    sizes = {}
    for attention in ("codes", "dequantize"):
        cache = vase.EvictingCache(
            model, policy=f"vase:kv_bits=4:kv_group={GROUP}:kv_attention={attention}", budget=1024, buffer=64
        )
        with torch.no_grad():
            model(input_ids=prompt, **cache_kwargs(cache))
        assert cache.seq.schedule.qlimit[0] == 1024
        sizes[attention] = _largest_allocation(model, cache, random_ids(1, seed=7))
    one_layer = 2 * 1024 * 16 * 4  # keys of one layer: 2 KV heads x 1,024 slots x 16 channels, float32
    assert sizes["codes"] < one_layer / 8, sizes
    assert sizes["dequantize"] >= one_layer, sizes


def test_bad_kv_attention_is_refused():
    with pytest.raises(ValueError, match="kv_attention must be one of codes, dequantize"):
        vase.EvictingCache(tiny_model("llama"), policy="vase:kv_bits=4:kv_attention=fast", budget=16, buffer=8)
