"""Quantized storage of kept entries (policy option ``kv_bits``, issue 24): the quantization itself, the static
stores, the bytes they hold, the guard's full-precision entries, ragged batches, sizes in bytes and bad input."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import vase
from tests.conftest import random_ids, tiny_model
from tests.hf.test_ragged import CONTINUATIONS, PROMPTS, SEEDS, STEPS, run_phases
from vase.core import quant
from vase.core.config import VaseConfig
from vase.harness.fidelity import replay
from vase.hf.compat import cache_kwargs
from vase.hf.quantized import QuantizedStorage
from vase.hf.storage import DenseStorage

GROUP = 8  # the tiny models have head_dim 16


# ------------------------------------------------------------------------------------------------ the arithmetic
@pytest.mark.parametrize("bits", quant.KV_BITS)
def test_pack_unpack_inverse(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = quant.pack(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", quant.KV_BITS)
def test_round_trip_error_within_half_a_step(bits):
    """Every element comes back within half its group's step (plus float16's rounding of the stored scales), and the
    step is (max - min) / (2**bits - 1) of its group: the error bound per bit width."""
    torch.manual_seed(bits)
    x = torch.randn(4, 3, 50, 64) * torch.rand(64) * 5 + torch.randn(64)
    x[0, 0, 0, 5] = 300.0  # an outlier widens its group only
    codes, step, lo = quant.quantize(x, bits, 32)
    assert codes.shape == (4, 3, 50, 64 * bits // 8) and step.dtype == lo.dtype == torch.float16
    back = quant.dequantize(codes, step, lo, bits)
    g = x.view(4, 3, 50, 2, 32)
    span = g.amax(-1) - g.amin(-1)
    levels = (1 << bits) - 1
    torch.testing.assert_close(step.float(), span / levels, rtol=2e-3, atol=1e-6)
    err = (back - x).abs().view(4, 3, 50, 2, 32).amax(-1)
    bound = step.float() * (0.5 + levels * 2**-10) + g.abs().amax(-1) * 2**-11 + 1e-6
    assert bool((err <= bound).all())
    rel = ((back - x).norm() / x.norm()).item()
    assert rel < {8: 0.008, 4: 0.13, 2: 0.5}[bits]  # measured 0.0057, 0.101, 0.415


def test_round_trip_is_a_fixed_point_and_constant_groups_exact():
    """Quantizing the dequantized values gives the same codes and scales (a kept entry never drifts), and a constant
    group comes back exactly."""
    torch.manual_seed(0)
    x = torch.randn(2, 2, 40, 32)
    x[0, 0, 0] = 1.5
    for bits in quant.KV_BITS:
        q1 = quant.quantize(x, bits, 16)
        back = quant.dequantize(*q1, bits)
        q2 = quant.quantize(back, bits, 16)
        assert all(torch.equal(a, b) for a, b in zip(q1, q2))
        assert torch.equal(back[0, 0, 0], x[0, 0, 0])


def test_precision_mask_ranks_eligible_values_by_the_guard_metric():
    guard = vase.make_policy("vase").guard
    v = torch.zeros(1, 2, 6, 4)
    v[0, 0, 1, 0], v[0, 0, 3, 0], v[0, 0, 5, 0] = 5.0, 9.0, 20.0  # slot 5 not eligible
    v[0, 1, 2, 1] = 3.0
    eligible = torch.tensor([True] * 5 + [False]).expand(1, 2, 6)
    mask = quant.precision_mask(guard, v, eligible, torch.tensor([2]))
    assert mask[0, 0].nonzero().flatten().tolist() == [1, 3]
    assert mask[0, 1].sum() == 2 and bool(mask[0, 1, 2])


# ------------------------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    "spec, message",
    [
        ("vase:kv_bits=3", "kv_bits must be one of none, 8, 4, 2"),
        ("h2o:kv_bits=4:protect_precision=guard", "needs a value guard"),
        ("vase:protect_precision=guard", "applies to quantized entries only"),
        ("vase:kv_bits=4:protect_precision=all", "protect_precision must be one of"),
        ("vase:kv_bits=4:kv_group=12", "kv_group must be a positive power of two"),
        ("full:kv_bits=4:protect_precision=guard", "needs a value guard"),
        ("full:guard=range", "never evicts uses a value guard only"),
        ("vase:kv_bits=4:guard=random:protect_precision=guard", "needs a magnitude metric"),
        ("snapkv:kv_bits=4:head_budget=adakv", "adaptive budgets"),
        ("quest:kv_bits=4", "does not take option"),
    ],
)
def test_bad_quantization_options_fail_at_resolve(spec, message):
    with pytest.raises(ValueError, match=message):
        VaseConfig.resolve(spec, budget=256)


def test_sizes_in_bytes():
    """A byte ratio r buys the budget whose quantized bytes are 1/r of the full cache's: r * cost as a token ratio
    (without kv_bits, the budget of the ratio r); a memory budget M buys floor(M / cost) tokens."""
    n = 1088
    cost4 = (4 / 8 + 4 / 32) / 4
    assert quant.token_cost(4, 32, 4) == cost4
    cfg = VaseConfig.resolve("vase:kv_bits=4", byte_ratio=8, element_bytes=4)
    assert cfg.for_length(n).budget == math.ceil(n / (8 * cost4)) == 871
    plain = VaseConfig.resolve("vase", byte_ratio=8)
    assert plain.for_length(n).budget == VaseConfig.resolve("vase", ratio=8).for_length(n).budget == 136
    guard = VaseConfig.resolve(
        "vase:kv_bits=4:protect_precision=guard:protect_share=0.05", byte_ratio=16, element_bytes=2
    )
    assert guard.for_length(n).budget == math.ceil(n / (16 * ((0.5 + 0.125) / 2 + 0.05)))
    assert VaseConfig.resolve("h2o:kv_bits=2", memory_budget=100, element_bytes=4).budget == math.floor(
        100 / ((0.25 + 0.125) / 4)
    )
    assert "byte ratio 8x" in cfg.describe()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(memory_budget=60), "holds 60 tokens, not more than sinks \\+ buffer"),
        (dict(memory_budget=10, policy="vase:kv_bits=8", element_bytes=2), "holds 17 tokens at kv_bits=8"),
        (dict(byte_ratio=4, policy="vase:kv_bits=4"), "needs element_bytes"),
        (dict(byte_ratio=0.5), "byte compression ratio must be > 1"),
        (dict(byte_ratio=4, budget=100), "give one of a budget"),
        (dict(byte_ratio=4, element_bytes=3), "element_bytes must be"),
        (dict(budget=256, policy="vase:kv_bits=4", compile=True), "compiled decoding does not support quantized"),
    ],
)
def test_bad_sizes_in_bytes_fail_at_resolve(kwargs, message):
    kwargs = {"policy": "vase", **kwargs}
    with pytest.raises(ValueError, match=message):
        VaseConfig.resolve(kwargs.pop("policy"), **kwargs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--policy", "vase:kv_bits=3"], "kv_bits must be one of"),
        (["generate", "hi", "--policy", "snapkv:kv_bits=4:protect_precision=guard"], "needs a value guard"),
        (["generate", "hi", "--memory-budget", "50"], "not more than sinks \\+ buffer"),
        (["fidelity", "--out", "/tmp/vase-never", "--byte-ratios", "0.5"], "byte compression ratio must be > 1"),
    ],
)
def test_cli_refuses_bad_quantization_before_loading(args, message, tmp_path):
    """Exit code 2 and the message within a few seconds: nothing is loaded (the tests' models are not even built),
    and no data is read (run where there is no ../shared, as outside this workplace)."""
    env = {k: v for k, v in os.environ.items() if k != "VASE_DATA_DIR"}
    out = subprocess.run(
        [sys.executable, "-m", "vase.cli", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert out.returncode == 2, out.stderr
    assert __import__("re").search(message, out.stderr), out.stderr
    assert "Loading" not in out.stderr


# ------------------------------------------------------------------------------------------------ the cache
def _decode(model, cache, prompt: torch.Tensor, steps: int) -> list[int]:
    tokens = []
    with torch.no_grad():
        logits = model(input_ids=prompt, **cache_kwargs(cache)).logits[:, -1]
        for _ in range(steps):
            tok = logits.argmax(-1, keepdim=True)
            tokens.append(int(tok))
            logits = model(input_ids=tok, **cache_kwargs(cache)).logits[:, -1]
    return tokens


def test_kv_bits_none_is_the_unquantized_cache():
    """kv_bits=none is the cache as before: its layer class, the same tokens and the same tensors."""
    model = tiny_model("llama")
    prompt = random_ids(30, seed=3)
    a = vase.EvictingCache(model, policy="vase", budget=16, buffer=8)
    b = vase.EvictingCache(model, policy="vase:kv_bits=none", budget=16, buffer=8)
    assert type(b.layers[0].storage) is DenseStorage and b.kv_bits is None
    assert _decode(model, a, prompt, 40) == _decode(model, b, prompt, 40)
    for la, lb in zip(a.layers, b.layers):
        for name in ("keys", "values", "positions"):
            assert torch.equal(getattr(la, name), getattr(lb, name))
        for n in la.state:
            assert torch.equal(la.state[n], lb.state[n])
    assert a.stats().line() == b.stats().line()


STORE_NAMES = ("kq", "ks", "kz", "vq", "vs", "vz", "kf", "fp_k", "fp_v", "qmask", "protected")


@pytest.mark.parametrize(
    "spec", ["vase:kv_bits=4", "h2o:kv_bits=2:guard=range:protect_share=0.25:protect_precision=guard"]
)
def test_static_stores_and_bytes_held(spec):
    """The stores are allocated once (their addresses never move over many compactions) and ``bytes_held`` is the
    formula: per layer and (row, KV head), L quantized slots of codes and float16 steps and minima, the key channel
    factors, P + buffer full-precision slots."""
    model = tiny_model("qwen3")
    budget, buffer = 16, 8
    cache = vase.EvictingCache(model, policy=spec + f":kv_group={GROUP}", budget=budget, buffer=buffer)
    _decode(model, cache, random_ids(20, seed=4), 1)
    addresses = [[getattr(layer.storage, n).data_ptr() for n in STORE_NAMES] for layer in cache.layers]
    ws = [t.data_ptr() for t in cache.workspace.tensors]
    _decode(model, cache, random_ids(5, seed=5), 120)
    st = cache.stats()
    assert st.evictions >= 14
    assert [[getattr(layer.storage, n).data_ptr() for n in STORE_NAMES] for layer in cache.layers] == addresses
    assert [t.data_ptr() for t in cache.workspace.tensors] == ws
    bits = cache.kv_bits
    b, h, d, e = 1, 2, 16, 4
    lim = budget  # L = capacity - buffer = budget
    p = cache.policy.guard.count(budget, 4) if cache.protect_precision == "guard" else 0
    per_layer = b * h * (lim * (2 * d * bits // 8 + 2 * 2 * 2 * d // GROUP) + 4 * d + 2 * (p + buffer) * d * e)
    assert st.bytes_held == len(cache.layers) * per_layer
    assert st.bytes_workspace == 2 * b * h * (budget + buffer) * d * e
    assert st.kv_bits == bits and f"{bits}-bit KV" in st.line() and "dequantization workspace" in st.line()


def _full_values(model, ids: torch.Tensor, first: int):
    """Layer 0's keys and values of every position with the unquantized full cache, fed as the quantized run is (the
    first ``first`` tokens, then one at a time: the same shapes, so the same floating-point results)."""
    cache = vase.EvictingCache(model, policy="full", budget=ids.shape[1] + 8, buffer=8)
    with torch.no_grad():
        model(input_ids=ids[:, :first], **cache_kwargs(cache))
        for t in range(first, ids.shape[1]):
            model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache))
    layer = cache.layers[0]
    return layer.keys[0].clone(), layer.values[0].clone()


def test_guard_entries_bit_exact_and_codes_never_drift():
    """With protect_precision=guard the planted large values of layer 0 stay in full precision, bit for bit, through
    every compaction; the other kept entries are quantized once: each one's dequantized value is the same at every
    later compaction (no re-quantization), within the 4-bit bound of its original."""
    from vase.harness.outliers import PlantedValues

    model = tiny_model("llama")
    ids = random_ids(160, seed=7)
    planted = [20, 45, 70]
    hooks = PlantedValues([0], planted, 20.0).attach(model)
    try:
        ref_k, ref_v = _full_values(model, ids, 40)
        spec = f"vase:kv_bits=4:kv_group={GROUP}:protect_precision=guard:protect_share=0.5:selector=topk"
        cache = vase.EvictingCache(model, policy=spec, budget=24, buffer=8)
        seen: dict[tuple[int, int], torch.Tensor] = {}
        checked = 0
        with torch.no_grad():
            model(input_ids=ids[:, :40], **cache_kwargs(cache))
            for t in range(40, 160):
                model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache))
                layer = cache.layers[0]
                keys, values = layer.entries()
                pos = layer.positions[0]
                for h in range(2):
                    for s in range(cache.fill[0]):
                        key = (h, int(pos[h, s]))
                        if s < cache.seq.schedule.qlimit[0] and bool(layer.storage.qmask[0, h, s]):
                            if key in seen:
                                assert torch.equal(seen[key], values[0, h, s]), f"entry {key} drifted at step {t}"
                            seen[key] = values[0, h, s].clone()
                for h in range(2):
                    prot = set(layer.storage.protected[0, h].tolist())
                    for p in planted:
                        at = (pos[h] == p).nonzero().flatten().tolist()
                        if (
                            at and at[0] < cache.seq.schedule.qlimit[0]
                        ):  # held and past the recent window: kept in full precision
                            checked += 1
                            assert at[0] in prot and not bool(layer.storage.qmask[0, h, at[0]]), (t, h, p)
                            assert torch.equal(values[0, h, at[0]], ref_v[h, p]), (t, h, p)
                            assert torch.equal(keys[0, h, at[0]], ref_k[h, p]), (t, h, p)
        assert cache.stats().evictions >= 10 and len(seen) > 50 and checked > 100
        # quantized entries within the 4-bit bound of their originals (a tenth of the head's value range)
        for (h, p), v in seen.items():
            span = float(ref_v[h, p].max() - ref_v[h, p].min())
            assert float((v - ref_v[h, p]).abs().max()) <= span / 15 * 0.51 + 1e-5
    finally:
        hooks.detach()


@pytest.mark.parametrize(
    "spec, window",
    [("vase:kv_bits=4", 8), ("h2o:kv_bits=2:guard=range:protect_precision=guard", 4), ("full:kv_bits=4", 12)],
)
def test_window_keeps_the_newest_tokens_in_full_precision(spec, window):
    """kv_window=R (KIVI's sliding residual): after every step the newest R tokens a row holds are its full-precision
    entries bit for bit (never quantized, through compactions and flushes); between R and R + buffer tokens sit above
    the quantization limit; the stores hold R more full-precision slots and R fewer quantized ones, as bytes_held
    says."""
    model = tiny_model("llama")
    ids = random_ids(150, seed=3)
    budget, buffer, first = 24, 8, 30
    ref_k, ref_v = _full_values(model, ids, first)
    cache = vase.EvictingCache(
        model, policy=f"{spec}:kv_group={GROUP}:kv_window={window}", budget=budget, buffer=buffer
    )
    checked = 0
    with torch.no_grad():
        model(input_ids=ids[:, :first], **cache_kwargs(cache))
        for t in range(first, ids.shape[1]):
            model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache))
            fill, q = cache.fill[0], cache.seq.schedule.qlimit[0]
            assert window <= fill - q < window + buffer, (t, fill, q)
            layer = cache.layers[0]
            keys, values = layer.entries()
            for h in range(2):
                for s in range(fill - window, fill):
                    p = int(layer.positions[0, h, s])
                    assert p > t - window - buffer  # the newest tokens are held (the recent window keeps them)
                    assert not bool(layer.storage.qmask[0, h, s]) if s < layer.storage.qmask.shape[2] else True
                    assert torch.equal(keys[0, h, s], ref_k[h, p]) and torch.equal(values[0, h, s], ref_v[h, p])
                    checked += 1
    assert checked >= 2 * window * 100 and max(cache.seq.schedule.qlimit) > 0
    assert (cache.stats().evictions > 5) == cache.policy.evicts
    storage = cache.layers[0].storage
    p = storage.protected.shape[2]
    lim = (budget if cache.policy.evicts else cache.capacity) - window
    assert storage.qmask.shape[2] == lim and storage.fp_k.shape[2] == p + window + buffer
    if cache.policy.evicts:
        b, h, d, e = 1, 2, 16, 4
        bits = cache.kv_bits
        per_layer = (
            b * h * (lim * (2 * d * bits // 8 + 2 * 2 * 2 * d // GROUP) + 4 * d + 2 * (p + window + buffer) * d * e)
        )
        assert cache.stats().bytes_held == len(cache.layers) * per_layer
        assert f"newest {window} in full precision" in cache.stats().line()


def test_window_sizes_in_bytes():
    """A byte ratio with a window: the budget whose kept bytes (budget at the quantized cost, the window's R tokens
    at full precision) are 1/r of the full cache's; a memory budget likewise; a window as large as the budget is
    refused."""
    n = 1088
    cost4 = (4 / 8 + 4 / 32) / 4
    cfg = VaseConfig.resolve("vase:kv_bits=4:kv_window=32", byte_ratio=8, element_bytes=4)
    budget = cfg.for_length(n).budget
    assert budget == math.ceil((n / 8 - 32 * (1 - cost4)) / cost4) == 698
    assert cfg.kept_bytes(budget) == pytest.approx(n / 8, abs=cost4)
    assert cfg.for_length(n).kept_bytes(budget) == budget * cost4 + 32 * (1 - cost4)
    assert VaseConfig.resolve("vase:kv_bits=4", byte_ratio=8, element_bytes=4).kept_bytes(871) == 871 * cost4
    mem = VaseConfig.resolve("h2o:kv_bits=8:kv_window=16", memory_budget=200, element_bytes=2)
    cost8 = (1 + 4 / 32) / 2
    assert mem.budget == math.floor((200 - 16 * (1 - cost8)) / cost8) == 343
    assert "newest 32 in full precision" in cfg.policy.describe()
    with pytest.raises(ValueError, match="kv_window 64 must be below the budget 64"):
        VaseConfig.resolve("vase:kv_bits=4:kv_window=64", budget=64, buffer=8)
    with pytest.raises(ValueError, match="kv_window applies to quantized entries only"):
        VaseConfig.resolve("vase:kv_window=8", budget=256)
    with pytest.raises(ValueError, match="kv_window must be a number of tokens >= 0"):
        VaseConfig.resolve("vase:kv_bits=4:kv_window=-1", budget=256)


def _quant_snapshot(cache) -> list[dict]:
    rows = []
    for r in range(cache.batch):
        f = cache.fill[r]
        layers = []
        for layer in cache.layers:
            keys, values = layer.entries()
            layers.append(
                {
                    "positions": layer.positions[r, :, :f].clone(),
                    "keys": keys[r, :, :f],
                    "values": values[r, :, :f],
                    "qmask": layer.storage.qmask[r, :, : min(f, layer.storage.qmask.shape[2])].clone(),
                    "qlimit": cache.seq.schedule.qlimit[r],
                }
            )
        rows.append({"fill": f, "layers": layers})
    return rows


@pytest.mark.parametrize(
    "spec, attn",
    [
        ("vase:kv_bits=4", "sdpa"),
        ("vase:kv_bits=4", "eager"),
        ("snapkv:kv_bits=2:guard=range:protect_precision=guard", "sdpa"),
        ("full:kv_bits=8", "eager"),
        ("h2o:kv_bits=8", "sdpa"),
        ("vase:kv_bits=4:kv_window=4", "sdpa"),
    ],
)
def test_ragged_rows_equal_rows_alone(spec, attn):
    """Rows compressed at prefill, at decode, at a continuation or never, quantized at different steps: each row's
    tokens and stored entries (dequantized) equal those of the row alone, with sdpa and eager attention.

    In float64: a batched forward computes a row's keys and values a few ulps away from the row alone, and in float32
    those ulps can flip a near-tie of the guard's ranking (which entry stays in full precision), after which a 2-bit
    row diverges from its alone run by a quantization step, machine by machine; float64 noise rounds away in the
    float32 quantization arithmetic."""
    model = tiny_model("qwen3", attn).double()
    spec += f":kv_group={GROUP}"
    first = [random_ids(n, seed=10 + i)[0] for i, n in enumerate(PROMPTS)]
    second = [random_ids(n, seed=20 + i)[0] for i, n in enumerate(CONTINUATIONS)]
    kw = dict(policy=spec, budget=16, buffer=8)
    cache = vase.EvictingCache(model, seed=list(SEEDS), **kw)
    levels = (1 << cache.kv_bits) - 1
    tokens, _ = run_phases(model, cache, [(first, STEPS[0]), (second, STEPS[1])])
    snap = _quant_snapshot(cache)
    for r in range(len(PROMPTS)):
        alone = vase.EvictingCache(model, seed=SEEDS[r], **kw)
        solo, _ = run_phases(model, alone, [([first[r]], STEPS[0]), ([second[r]], STEPS[1])])
        assert tokens[r].tolist() == solo[0].tolist(), f"row {r}"
        mine, theirs = snap[r], _quant_snapshot(alone)[0]
        assert mine["fill"] == theirs["fill"]
        for a, b in zip(mine["layers"], theirs["layers"]):
            assert a["qlimit"] == b["qlimit"] and torch.equal(a["positions"], b["positions"])
            assert torch.equal(a["qmask"], b["qmask"])
            for name in ("keys", "values"):
                _close_up_to_one_code(a[name], b[name], levels)
    assert max(cache.seq.schedule.qlimit) > 0


def _close_up_to_one_code(a: torch.Tensor, b: torch.Tensor, levels: int) -> None:
    """Equal up to float noise, except a few elements one quantization step apart: a batched forward computes the
    keys and values a few 1e-7 away from the row alone (the unquantized ragged test allows 1e-5), and a value that
    close to a rounding boundary can take the neighbouring code."""
    diff = (a - b).abs()
    off = diff > 1e-5
    step = (b.abs().amax(-1, keepdim=True) * 2 / levels).expand_as(b)
    assert float(off.float().mean()) < 0.05
    assert bool((diff[off] <= step[off] * 1.01 + 1e-5).all())


@pytest.mark.parametrize(
    "spec, qlimit",
    [
        ("vase:kv_bits=4", 24),
        ("full:kv_bits=4:guard=range:protect_precision=guard", 88),
        ("vase:kv_bits=4:kv_window=8", 16),
        ("full:kv_bits=4:kv_window=12", 72),
    ],
)
def test_replay_chunks_equal_token_by_token(spec, qlimit):
    """The fidelity replay cuts its chunks where decoding evicts or quantizes (room()), so a chunked replay gives the
    next-token distributions of feeding one token at a time."""
    model = tiny_model("llama")
    spec += f":kv_group={GROUP}"
    prompt, cont = random_ids(21, seed=8)[0], random_ids(70, seed=9)[0]
    cfg = VaseConfig.resolve(spec, budget=24, buffer=8)
    chunked = replay(model, prompt, cont, config=cfg)
    cache = vase.EvictingCache(model, config=cfg)
    out = []
    with torch.no_grad():
        out.append(torch.log_softmax(model(input_ids=prompt.view(1, -1), **cache_kwargs(cache)).logits[0, -1:], -1))
        for t in cont[:-1]:
            out.append(torch.log_softmax(model(input_ids=t.view(1, 1), **cache_kwargs(cache)).logits[0, -1:], -1))
    torch.testing.assert_close(chunked, torch.cat(out), atol=2e-4, rtol=1e-4)
    assert cache.seq.schedule.qlimit[0] == qlimit and cache.fill[0] == (26 if cfg.policy.evicts else 90)


@pytest.mark.parametrize(
    "spec",
    ["vase:kv_bits=4:kv_window=8", "vase:kv_bits=4", "full:kv_bits=2:kv_window=4", "h2o:kv_bits=8:kv_window=8"],
)
def test_a_chunked_prompt_quantizes_as_a_whole_one(spec):
    """A 40-token prompt fed whole quantizes two blocks of 16 at once, fed in 8 chunks of 5 one block at a time: the
    key channel factors (from the first block) are the same, and so are layer 0's codes, scales and full-precision
    window (its keys and values are projections of the tokens alone). Deeper layers' later tokens differ by what the
    chunked prefill's attention read from the quantized first block, so there only the factors and the first block's
    codes are compared. In float64, where both paths compute the same keys and values up to rounding: a CPU's GEMM
    may round a 40-row product and a 5-row one apart in the last bit, so codes must be equal and the floats (scales,
    zero points, the full-precision window) equal to 1e-12."""
    model = tiny_model("qwen3").double()
    ids = random_ids(40, seed=4)
    caches = []
    for chunks in (1, 8):
        cache = vase.EvictingCache(model, policy=f"{spec}:kv_group={GROUP}", budget=64, buffer=16)
        with torch.no_grad():
            for part in ids.chunk(chunks, dim=1):
                model(input_ids=part, **cache_kwargs(cache))
        caches.append(cache)
    whole, chunked = caches
    window = whole.config.kv_window
    q = whole.seq.schedule.qlimit[0]
    assert q == chunked.seq.schedule.qlimit[0] == (40 - window) // 16 * 16 >= 32  # two blocks or more
    assert whole.fill == chunked.fill == [40] and whole.stats().evictions == chunked.stats().evictions == 0
    for i, (a, b) in enumerate(zip(whole.layers, chunked.layers)):
        sa, sb = a.storage, b.storage
        assert bool(sa.qmask[0, :, :q].all()) and torch.equal(sa.qmask, sb.qmask)
        assert not torch.equal(sa.kf, torch.ones_like(sa.kf))
        torch.testing.assert_close(sa.kf, sb.kf, rtol=1e-6, atol=0)  # up to 0.95 apart when fixed on 16 vs 32 tokens
        upto = q if i == 0 else 16
        for name in ("kq", "vq"):
            assert torch.equal(getattr(sa, name)[:, :, :upto], getattr(sb, name)[:, :, :upto]), (i, name)
        for name in ("ks", "kz", "vs", "vz"):
            a_, b_ = getattr(sa, name)[:, :, :upto], getattr(sb, name)[:, :, :upto]
            torch.testing.assert_close(a_, b_, rtol=1e-12, atol=1e-15, msg=f"layer {i}: {name}")
        if i == 0:
            p = sa.protected.shape[2]
            for name in ("fp_k", "fp_v"):
                held_a, held_b = getattr(sa, name)[:, :, p : p + 40 - q], getattr(sb, name)[:, :, p : p + 40 - q]
                assert not torch.equal(held_a, torch.zeros_like(held_a)), name
                torch.testing.assert_close(held_a, held_b, rtol=1e-12, atol=1e-15, msg=name)


def test_full_quantizes_in_blocks_of_buffer():
    """full:kv_bits keeps every token; everything older than its recent window is quantized, in blocks of buffer."""
    model = tiny_model("llama")
    cache = vase.EvictingCache(model, policy=f"full:kv_bits=4:kv_group={GROUP}", budget=32, buffer=8)
    _decode(model, cache, random_ids(13, seed=2), 60)
    assert cache.fill[0] == 73 and cache.stats().evictions == 0  # the prompt and 60 decode steps
    assert cache.seq.schedule.qlimit[0] == 72 and cache.room() == [7]
    layer = cache.layers[0]
    assert (
        type(layer.storage) is QuantizedStorage
        and bool(layer.storage.qmask[0, :, :72].all())
        and not layer.storage.qmask[0, :, 72:].any()
    )


def test_fidelity_at_equal_bytes(tmp_path):
    """`vase fidelity --byte-ratios`: each policy gets the budget its bytes hold at its kv_bits, records carry the
    bytes, a quantized full cache is replayed once per source (the same figures at every ratio, each with its label),
    and the report labels the sizes in bytes."""
    import json

    from tests.conftest import tiny_lm
    from tests.harness.test_outliers import CharTokenizer
    from vase.harness.fidelity import FidelityConfig, run_fidelity
    from vase.harness.report import write_report

    lm = tiny_lm("llama")
    lm.tokenizer = CharTokenizer()
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    g = f"kv_group={GROUP}"
    cfg = FidelityConfig(
        model="tiny",
        source=f"text:{text}",
        prompts=2,
        tokens=120,
        prefix_tokens=16,
        policies=[
            "vase",
            f"vase:kv_bits=4:{g}",
            f"full:kv_bits=8:{g}",
            f"h2o:kv_bits=4:{g}:guard=range:protect_precision=guard",
        ],
        byte_ratios=[4.0, 8.0],
        buffer=8,
    )
    recs = [
        json.loads(line) for line in run_fidelity(cfg, tmp_path / "run", progress=False, lm=lm).read_text().splitlines()
    ]
    assert len(recs) == 2 * 2 * 4 and {r["byte_ratio"] for r in recs} == {4.0, 8.0}
    by = {(r["source"], r["policy"], r["byte_ratio"]): r for r in recs}
    src = recs[0]["source"]
    assert by[(src, "vase", 8.0)]["budget"] == math.ceil(136 / 8)  # as --ratios 8
    cost4 = (0.5 + 4 / GROUP) / 4
    assert by[(src, f"vase:kv_bits=4:{g}", 8.0)]["budget"] == math.ceil(136 / (8 * cost4))
    quantized_full = [by[(src, f"full:kv_bits=8:{g}", r)] for r in (4.0, 8.0)]
    assert quantized_full[0]["kl_mean"] == quantized_full[1]["kl_mean"] and quantized_full[0]["budget"] == 136
    for r in recs:
        assert r["kv_bits"] in (None, 4, 8) and r["memory_compression"] > 0 and r["kept_compression"] > 0
    assert by[(src, "vase", 4.0)]["kept_compression"] == 4.0
    report = write_report(tmp_path / "run", tmp_path / "report").read_text()
    assert "4x bytes (budget" in report and "8x bytes (budget" in report

    # interrupted after the first size: resuming writes the missing sizes, the quantized full cache's included
    # (its budget is the source's length at every byte ratio, so the size, not the budget, says what is done)
    path = tmp_path / "run" / "fidelity.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("".join(x + "\n" for x in lines if json.loads(x)["byte_ratio"] == 4.0))
    again = [json.loads(x) for x in run_fidelity(cfg, tmp_path / "run", progress=False, lm=lm).read_text().splitlines()]
    assert len(again) == len(recs)
    redone = {(r["source"], r["policy"], r["byte_ratio"]): r for r in again}
    assert redone.keys() == by.keys()
    for key, r in by.items():
        assert redone[key]["kl_mean"] == r["kl_mean"] and redone[key]["budget"] == r["budget"], key


def _kv_quant_table():
    """benchmarks/kv_quant_table.py as a module (it is a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "kv_quant_table", Path(__file__).parents[2] / "benchmarks" / "kv_quant_table.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.load.cache_clear()  # a fresh record cache per test
    return mod


def _byte_ratio_records(kls: dict[str, list[float]]) -> list[dict]:
    """Hand-made ``vase fidelity --byte-ratios 8`` records: ``kls`` maps a policy to its KL per source (``s0``...)."""
    return [
        {"source": f"s{i}", "policy": p, "budget": 100, "byte_ratio": 8.0, "kl_mean": kl, "memory_compression": 6.5}
        for p, v in kls.items()
        for i, kl in enumerate(v)
    ]


def test_kv_quant_table_answers_from_the_records(tmp_path):
    """benchmarks/kv_quant_table.py on hand-made records: the summary's means, the goal check's winners (a
    quantize-only configuration qualifies only at its own compression), the protect table's paired differences and
    median ratios."""
    import json

    mod = _kv_quant_table()
    pp = "vase:kv_bits=4:protect_precision=guard:protect_share=0.05"
    kls = {  # policy -> KL per source (3 sources), at byte ratio 8
        "vase": [0.10, 0.20, 0.30],
        "vase:kv_bits=4": [0.010, 0.020, 0.030],
        pp: [0.005, 0.030, 0.015],
    }
    run = tmp_path / "run"
    run.mkdir()
    recs = _byte_ratio_records(kls)
    recs += [  # quantize-only at 6.4x: does not reach 8x
        {
            "source": f"s{i}",
            "policy": "full:kv_bits=4",
            "budget": 1000,
            "byte_ratio": 8.0,
            "kl_mean": 0.001,
            "kept_compression": 6.4,
            "memory_compression": 5.3,
        }
        for i in range(3)
    ]
    (run / "fidelity.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = "\n".join(mod.summary({"T": run}, [8.0]))
    assert "| evict-only | `vase` | 0.2000 ± 0.0577 |" in summary
    assert "| quantize-only | `full:kv_bits=4` | 0.0010 ± 0.0000 (at 6.4x) |" in summary
    assert f"| evict + quantize | `{pp}` | 0.0150 |" in "\n".join(mod.summary({"T": run}, [8.0], median=True))
    goal = "\n".join(mod.goal({"T": run}, [8.0]))
    assert "best quantize-only none keeps every token at this ratio" in goal
    assert f"every cell above: `vase:kv_bits=4`, `{pp}`" in goal
    assert "| `vase:kv_bits=4` | 0.0200 | -0.1800 ± 0.0520 (3/3) | — |" in goal
    protect = "\n".join(mod.protect({"T": run}, [8.0]))
    # differences -0.005, +0.010, -0.015: mean -0.0033, lower on 2 of 3; ratios 0.5, 1.5, 0.5 -> median 0.5
    assert f"| `{pp}` | `vase:kv_bits=4` | -0.0033 ± 0.0073 (2/3; ×0.50) |" in protect


def test_kv_quant_table_pairs_windows_on_the_sources_every_configuration_has(tmp_path):
    """benchmarks/kv_quant_table.py --window: each kv_window configuration against the same without its window, paired;
    a run stopped part-way (one configuration lacks the last source) is compared on the sources all configurations
    have, in every table."""
    import json

    mod = _kv_quant_table()
    kls = {  # policy -> KL per source; the window configuration has not reached s3
        "vase:kv_bits=4": [0.010, 0.020, 0.040, 0.900],
        "vase:kv_bits=4:kv_window=16": [0.005, 0.030, 0.020],
    }
    run = tmp_path / "run"
    run.mkdir()
    recs = _byte_ratio_records(kls)
    (run / "fidelity.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = "\n".join(mod.summary({"T": run}, [8.0]))
    assert "| evict + quantize | `vase:kv_bits=4` | 0.0233 ± 0.0088 |" in summary  # s0-s2 only, not s3's 0.9
    assert "T 8x (3)" in summary
    window = "\n".join(mod.window({"T": run}, [8.0]))
    # differences -0.005, +0.010, -0.020: mean -0.0050, lower on 2 of 3; ratios 0.5, 1.5, 0.5 -> median 0.5
    assert "| `vase:kv_bits=4:kv_window=16` | `vase:kv_bits=4` | -0.0050 ± 0.0087 (2/3; ×0.50) |" in window
