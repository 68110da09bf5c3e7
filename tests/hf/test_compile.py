"""Compiled decoding (``EvictingCache(..., compileable=True)``): one fixed-shape graph per decode step, eviction
outside it, token for token the same output as the uncompiled cache.

The inductor tests compile on CPU (about a minute for the first graph of a fresh process, seconds with a warm
inductor cache); the others use the ``aot_eager`` backend, which traces the same graph without generating code.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from transformers import CompileConfig

import vase
from tests.conftest import random_ids, tiny_model
from vase.hf.compat import cache_kwargs
from vase.hf.compiled import check_compileable

POLICIES = [p for p in vase.POLICY_NAMES if p != "quest"]


def compile_config(backend: str = "inductor") -> CompileConfig:
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode="default")
    config._compile_all_devices = True  # transformers compiles generate's decode steps on GPUs only, unless told
    return config


def ragged(prompt: int = 40, batch: int = 2, pad: int = 7):
    """Left-padded prompts: row 1 has ``pad`` padding columns."""
    ids = random_ids(prompt, batch=batch)
    mask = torch.ones_like(ids)
    mask[1:, :pad] = 0
    ids[1:, :pad] = 0
    return ids, mask


def generate(model, cache, ids, mask, new: int, config=None) -> torch.Tensor:
    return model.generate(
        input_ids=ids,
        attention_mask=mask,
        **cache_kwargs(cache),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        compile_config=config,
    )


def fresh_model(family: str = "llama", attn: str = "sdpa"):
    """A new tiny model, with dynamo's caches emptied first: each model adds guarded entries to the same code objects
    (the modeling code's forwards), and a test session of many models would reach dynamo's recompile limit (8), which
    one application with one model never does."""
    torch._dynamo.reset()
    return tiny_model(family, attn=attn)


def graphs() -> int:
    """Graphs compiled so far in this process (dynamo's count)."""
    return dynamo_utils.counters["stats"]["unique_graphs"]


def caches(model, policy: str, budget: int, buffer: int, new: int, prompt: int, **options):
    size = prompt + new + 1 if policy == "full" else None
    plain = vase.EvictingCache(model, policy=policy, budget=budget, buffer=buffer, **options)
    static = vase.EvictingCache(
        model, policy=policy, budget=budget, buffer=buffer, compileable=True, max_cache_len=size, **options
    )
    return plain, static


def same_stats(a: vase.EvictingCache, b: vase.EvictingCache) -> None:
    sa, sb = a.stats(), b.stats()
    assert (sa.evictions, sa.tokens_evicted, sa.tokens_seen, sa.real_tokens) == (
        sb.evictions,
        sb.tokens_evicted,
        sb.tokens_seen,
        sb.real_tokens,
    )
    assert a.fill == b.fill


@pytest.fixture(scope="module")
def shared_model():
    """One model for the inductor tests: its compiled decode step (transformers keeps it on the model) is reused by
    every cache of the same shape."""
    return fresh_model("llama")


def test_inductor_thousand_steps_one_graph(shared_model):
    """1,000 decode steps of a ragged batch, evicting every 64 steps: one graph in all, the same tokens."""
    model = shared_model
    ids, mask = ragged()
    plain, static = caches(model, "vase", 128, 64, 1000, 40)
    ref = generate(model, plain, ids, mask, 1000)
    before = graphs()
    out = generate(model, static, ids, mask, 1000, compile_config())
    assert graphs() - before == 1  # the bound: one graph, whatever the length
    assert torch.equal(ref, out)
    same_stats(plain, static)
    assert static.stats().evictions >= 14
    # a second, longer run with a new cache of the same sizes compiles nothing
    plain2, static2 = caches(model, "vase", 128, 64, 1000, 40)
    out2 = generate(model, static2, ids, mask, 1000, compile_config())
    assert graphs() - before == 1
    assert torch.equal(ref, out2)


@pytest.mark.parametrize("policy", POLICIES)
def test_inductor_every_policy_matches_uncompiled(shared_model, policy):
    """Greedy tokens and eviction counts of the compiled run equal the uncompiled cache's, for every policy. The
    graph depends on the policy only through the saved queries (policies with an observation window) and the buffer
    size (``full``), so at most one new graph per test."""
    model = shared_model
    ids, mask = ragged()
    plain, static = caches(model, policy, 96, 16, 150, 40)
    ref = generate(model, plain, ids, mask, 150)
    before = graphs()
    out = generate(model, static, ids, mask, 150, compile_config())
    assert graphs() - before <= 1
    assert torch.equal(ref, out)
    same_stats(plain, static)
    if policy != "full":
        assert static.stats().evictions >= 8


@pytest.mark.parametrize(
    "family,attn,options",
    [
        ("qwen3", "sdpa", {"head_budget": "adakv"}),
        ("llama", "eager", {"layer_budget": "pyramid"}),
        ("llama", "eager", {}),
        ("qwen3", "sdpa", {"preset": "paper"}),
        ("llama", "sdpa", {"selector": "sample", "value_weight": "output_error", "recent": 8}),
    ],
)
def test_compiled_variants_match_uncompiled(family, attn, options):
    """Adaptive budgets (per-head masks), eager attention (additive masks), the published preset (dense prompt),
    sampling selection: compiled (aot_eager, full graph) equals uncompiled."""
    model = fresh_model(family, attn=attn)
    ids, mask = ragged()
    plain, static = caches(model, "vase", 96, 16, 120, 40, **options)
    ref = generate(model, plain, ids, mask, 120)
    out = generate(model, static, ids, mask, 120, compile_config("aot_eager"))
    assert torch.equal(ref, out)
    same_stats(plain, static)


def test_static_path_uncompiled_matches_and_buffers_stay():
    """The compileable cache without compiling: same tokens, buffers never move, eviction state as the plain one."""
    model = tiny_model("llama")
    ids, mask = ragged()
    plain, static = caches(model, "vase", 96, 16, 100, 40, record_evictions=True)
    ref = generate(model, plain, ids, mask, 100)
    layer = static.layers[0]
    out = generate(model, static, ids, mask, 100)
    ptrs = (
        layer.keys.data_ptr(),
        layer.values.data_ptr(),
        layer.positions.data_ptr(),
        static.compiled.fill_t.data_ptr(),
    )
    assert static.compiled.decode_ok and static.is_compileable and not plain.is_compileable
    assert torch.equal(ref, out)
    same_stats(plain, static)
    for a, b in zip(plain.layers, static.layers):
        assert torch.equal(a.positions, b.positions)
        held = a.positions >= 0  # the same tokens; attention over the whole buffer (masked) rounds differently
        torch.testing.assert_close(a.keys[held], b.keys[held], rtol=1e-4, atol=1e-5)
        assert torch.equal(a.last_eviction["kept_positions"], b.last_eviction["kept_positions"])
    # continue both with 40 more decode steps (the same cache objects): the buffers stay where they were
    full_ids = torch.cat([ids, out[:, ids.shape[1] :]], 1)
    full_mask = torch.cat([mask, torch.ones_like(out[:, ids.shape[1] :])], 1)
    ref2 = generate(model, plain, full_ids, full_mask, 40)
    out2 = generate(model, static, full_ids, full_mask, 40)
    assert torch.equal(ref2, out2)
    assert ptrs == (
        layer.keys.data_ptr(),
        layer.values.data_ptr(),
        layer.positions.data_ptr(),
        static.compiled.fill_t.data_ptr(),
    )
    same_stats(plain, static)


def _hand_loop(model, cache, forward, prompt: torch.Tensor, steps: int, prepare: bool) -> torch.Tensor:
    out = model(input_ids=prompt, **cache_kwargs(cache))
    tok = out.logits[:, -1:].argmax(-1)
    toks = [tok]
    for s in range(steps):
        if prepare:
            cache.prepare_decode()
        pos = torch.full((prompt.shape[0], 1), prompt.shape[1] + s)
        out = forward(input_ids=tok, **cache_kwargs(cache), position_ids=pos)
        tok = out.logits[:, -1:].argmax(-1)
        toks.append(tok)
    return torch.cat(toks, 1)


def test_hand_written_compiled_loop():
    """``torch.compile(model)`` in a loop of one's own: with ``cache.prepare_decode()`` before each step, one full
    graph; without it the compiled forward runs it itself (a graph break), and the tokens are the same."""
    model = fresh_model("llama")
    prompt = random_ids(40)
    ref = _hand_loop(model, vase.EvictingCache(model, budget=96, buffer=16), model, prompt, 120, False)
    fullgraph = torch.compile(model, backend="aot_eager", fullgraph=True)
    before = graphs()
    cache = vase.EvictingCache(model, budget=96, buffer=16, compileable=True)
    assert torch.equal(_hand_loop(model, cache, fullgraph, prompt, 120, True), ref)
    assert graphs() - before == 1
    assert cache.stats().evictions >= 4
    broken = torch.compile(model, backend="aot_eager")
    cache = vase.EvictingCache(model, budget=96, buffer=16, compileable=True)
    assert torch.equal(_hand_loop(model, cache, broken, prompt, 120, False), ref)


def test_full_policy_growth_warns():
    """``full`` without ``max_cache_len`` still decodes exactly, but its buffers grow (a new graph): a warning says
    what to give."""
    model = tiny_model("llama")
    ids, mask = ragged()
    plain = vase.EvictingCache(model, policy="full", budget=24, buffer=8)
    static = vase.EvictingCache(model, policy="full", budget=24, buffer=8, compileable=True)
    ref = generate(model, plain, ids, mask, 40)
    with pytest.warns(UserWarning, match="max_cache_len"):
        out = generate(model, static, ids, mask, 40)
    assert torch.equal(ref, out)


def test_compileable_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="selection policy 'quest'"):
        vase.EvictingCache(model, policy="quest", budget=96, compileable=True)
    with pytest.raises(ValueError, match="max_cache_len must be a positive"):
        vase.EvictingCache(model, policy="full", compileable=True, max_cache_len=0)
    cache = vase.EvictingCache(model, budget=96, buffer=16, compileable=True)
    with pytest.raises(RuntimeError, match="after the first forward"):
        cache.prepare_decode()
    plain = vase.EvictingCache(model, budget=96, buffer=16)
    with pytest.raises(RuntimeError, match="compileable=True"):
        plain.prepare_decode()
    policy = vase.make_policy("vase")
    plan = vase.hf.hybrid.plan_layers(model.config)
    with pytest.raises(ValueError, match="sdpa or eager"):
        check_compileable(policy, plan, "flash_attention_2", None)


def test_compileable_refuses_hybrid_models():
    from transformers import Qwen3ForCausalLM

    from tests.hf.test_hybrid import hybrid_config

    config = hybrid_config("qwen3_sliding")  # full, full, sliding, sliding
    model = Qwen3ForCausalLM(config).eval()
    with pytest.raises(ValueError, match="all full attention"):
        vase.EvictingCache(model, budget=96, buffer=16, compileable=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
def test_compiled_decode_no_sync_on_gpu():
    """On a GPU, the eager part of a compiled decode step and the uncompiled static path never synchronize."""
    model = tiny_model("llama").cuda()
    ids, mask = ragged()
    cache = vase.EvictingCache(model, budget=96, buffer=16, compileable=True)
    model(input_ids=ids.cuda(), attention_mask=mask.cuda(), **cache_kwargs(cache))
    tok = torch.full((2, 1), 5, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(140):  # 9 evictions (4 by the 100th step: rows compact every 16 steps from 96 + 16)
            cache.prepare_decode()
            model(input_ids=tok, **cache_kwargs(cache), position_ids=torch.full((2, 1), 40 + s, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert cache.stats().evictions >= 9


def _aot_eager_config(device, backend="inductor"):
    return vase.compile_config(device, backend="aot_eager")


@pytest.mark.parametrize(
    "options",
    [
        {"policy": "full", "budget": 48},
        {"policy": "vase", "compression_ratio": 4},
        {"policy": "vase", "budget": 24, "compress_prompt": False},  # dense prompt: capacity follows the prompt
    ],
    ids=["full", "ratio", "dense"],
)
def test_many_prompt_lengths_compile_few_graphs(monkeypatch, options):
    """20 prompt lengths in one process through ``vase.generate(..., compile=True)`` (fullgraph): tokens equal the
    uncompiled run's, and the graphs stay within the README's bound, one per power of two of the buffers' slots
    (plus the budget's own shape), instead of one per prompt length (the ninth raised FailOnRecompileLimitHit)."""
    from tests.conftest import TinyTokenizer
    from vase.core.sizes import compiled_capacity
    from vase.harness import generation

    monkeypatch.setattr(generation, "compile_config", _aot_eager_config)
    model, tok = fresh_model("llama"), TinyTokenizer()
    lengths = [10 + round(2.6 * i) for i in range(20)]  # 10 .. 59 tokens
    before, shapes = graphs(), set()
    for n in lengths:
        kwargs = dict(buffer=16, max_new_tokens=30, min_new_tokens=30, chat=False, **options)
        ref = vase.generate(model, tok, ["x" * n], **kwargs)
        out = vase.generate(model, tok, ["x" * n], compile=True, **kwargs)
        assert out.completions[0].token_ids == ref.completions[0].token_ids
        assert out.stats.evictions == ref.stats.evictions
        shapes.add(out.stats.capacity)
    assert all(c == compiled_capacity(c) or c == 40 for c in shapes)  # powers of two, or the budget's own 24 + 16
    assert graphs() - before <= len(shapes) <= 2
