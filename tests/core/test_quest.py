"""quest: page metadata, page selection on a hand-made case, exactness against the full cache, chunked = token by
token, ragged rows = rows alone, stats, errors, and the harness (eval, fidelity, bench, CLI) with quest."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

import vase
import vase.harness.generation
from tests.conftest import random_ids, tiny_lm, tiny_model
from tests.hf.test_ragged import assert_row_equal, run_phases
from vase.core.pages import PageSelection, PageTable, page_bound, select_pages
from vase.harness.measure import decode_run, kv_bytes
from vase.hf.compat import cache_kwargs

# Hand-made case: page 4, head_dim 2, one KV head; pages 1-4 have these element-wise key minima / maxima.
HAND_MIN = {1: (-1.0, 0.0), 2: (0.0, 0.0), 3: (-3.0, -1.0), 4: (0.5, 0.5)}
HAND_MAX = {1: (1.0, 0.0), 2: (2.0, 1.0), 3: (0.0, 0.0), 4: (1.0, 3.0)}


def hand_keys() -> torch.Tensor:
    """``[1, 1, 22, 2]``: 22 tokens (positions 0-21); page 0 (the sink page) and page 5 (positions 20-21) arbitrary,
    pages 1-4 hit exactly the minima and maxima above (each coordinate's extremes on different tokens)."""
    keys = torch.zeros(22, 2)
    keys[0:4] = torch.tensor([[9.0, 9.0], [-9.0, -9.0], [0.0, 0.0], [1.0, 1.0]])
    for p in range(1, 5):
        lo, hi = HAND_MIN[p], HAND_MAX[p]
        mid = ((lo[0] + hi[0]) / 2, (lo[1] + hi[1]) / 2)
        keys[4 * p : 4 * p + 4] = torch.tensor([[lo[0], mid[1]], [hi[0], lo[1]], [mid[0], hi[1]], list(mid)])
    keys[20:22] = torch.tensor([[5.0, -5.0], [-5.0, 5.0]])
    return keys.view(1, 1, 22, 2)


def test_page_metadata_is_min_max_and_updated_incrementally():
    keys = hand_keys()
    table = PageTable(4)
    # written as a ragged multi-token chunk (with padding), then token by token: the same metadata
    pos = torch.arange(14).view(1, 14)
    padded = torch.cat([torch.zeros(1, 1, 3, 2), keys[:, :, :14]], 2)
    valid = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, 14, dtype=torch.bool)], 1)
    table.write(padded, torch.cat([torch.zeros(1, 3, dtype=torch.long), pos], 1), valid, last=13)
    for t in range(14, 22):
        table.write(keys[:, :, t : t + 1], torch.tensor([[t]]), None, last=t)
    for p in range(1, 5):
        assert table.kmin[0, 0, p].tolist() == list(HAND_MIN[p])
        assert table.kmax[0, 0, p].tolist() == list(HAND_MAX[p])
    assert table.kmin[0, 0, 0].tolist() == [-9.0, -9.0] and table.kmax[0, 0, 5].tolist() == [5.0, 5.0]
    assert table.kmin.shape[2] >= 6 and table.nbytes == 2 * table.kmin.numel() * 4


def test_selected_pages_are_the_true_top_pages_on_a_hand_made_case():
    table = PageTable(4)
    keys = hand_keys()
    table.write(keys, torch.arange(22).view(1, 22), None, last=21)
    query = torch.tensor([[1.0, -1.0], [-1.0, 1.0]]).view(1, 2, 1, 2)  # two query heads sharing the KV head
    bounds = page_bound(query, table.kmin[:, :, :6], table.kmax[:, :, :6])
    # sum_d max(q_d min_d, q_d max_d), by hand
    assert bounds[0, 0, 0, 1:5].tolist() == [1.0, 2.0, 1.0, 0.5]
    assert bounds[0, 1, 0, 1:5].tolist() == [1.0, 1.0, 3.0, 2.5]
    # ... an upper bound of q.k for every key of the page, reached where the keys hit the corners
    qk = (query[0, :, 0] @ keys[0, 0].T).view(2, -1)
    for p in range(1, 5):
        assert bool((qk[:, 4 * p : 4 * p + 4] <= bounds[0, :, 0, p : p + 1]).all())
    # query at position 21 (page 5): forced = page 5 (2 tokens) + sink page 0 (4 tokens); budget 14 leaves 2 pages
    pos = torch.tensor([[21]])
    chosen = select_pages(bounds, pos, page=4, sinks=4, budget=14)[0, :, 0]
    sets = [set(torch.nonzero(chosen[h]).flatten().tolist()) for h in range(2)]
    assert sets == [{0, 1, 2, 5}, {0, 3, 4, 5}]  # head 0: page 2, then the tie 1 = 3 goes to the earlier page
    # budgets: 13 -> one page; 6 -> none (forced only); 22 -> every page
    assert set(torch.nonzero(select_pages(bounds, pos, 4, 4, 13)[0, 1, 0]).flatten().tolist()) == {0, 3, 5}
    assert set(torch.nonzero(select_pages(bounds, pos, 4, 4, 6)[0, 0, 0]).flatten().tolist()) == {0, 5}
    assert bool(select_pages(bounds, pos, 4, 4, 22).all())
    # a query in page 1 at position 5: page 0 (sink) and page 1 (its own); later pages never
    early = select_pages(bounds, torch.tensor([[5]]), 4, 4, 100)[0, 0, 0]
    assert early.tolist() == [True, True, False, False, False, False]
    # no sinks: page 0 is an ordinary candidate (bound 18 for head 1: its keys span [-9, 9]); budget 10 = 2 pages
    assert bounds[0, 1, 0, 0].item() == 18.0
    assert set(torch.nonzero(select_pages(bounds, pos, 4, 0, 10)[0, 1, 0]).flatten().tolist()) == {0, 3, 5}


def _brute_force_mask(layer, query, qpos, budget, sinks, page):
    """The page mask of one decode step recomputed from the held keys alone: min/max from the keys, the bound by the
    formula, python top-k, per query head."""
    b, hq = query.shape[:2]
    hk = layer.keys.shape[1]
    out = []
    for r in range(b):
        t = int(qpos[r])
        n_pages = t // page + 1
        heads = []
        for h in range(hq):
            k = layer.keys[r, h // (hq // hk), : t + 1].float()
            q = query[r, h, 0].float()
            own, sp = t // page, -(-sinks // page)
            bound = {}
            for j in range(sp, own):
                blk = k[j * page : (j + 1) * page]
                bound[j] = float(torch.maximum(q * blk.min(0).values, q * blk.max(0).values).sum())
            forced = t % page + 1 + page * min(sp, own)
            take = max((budget - forced) // page, 0)
            top = sorted(bound, key=lambda j: (-bound[j], j))[:take]
            keep = set(top) | {own} | set(range(min(sp, own)))
            heads.append([j in keep for j in range(n_pages)])
        out.append(heads)
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_decode_mask_selects_the_top_pages_of_the_held_keys(attn, monkeypatch):
    """On a real model: each decode step's mask is exactly the brute-force page choice from the held keys."""
    model = tiny_model("qwen3", attn, kv_heads=2)
    seen = []
    real = PageSelection.mask

    def spy(self, layer, step, query, kind, dtype, budget, sinks):
        m = real(self, layer, step, query, kind, dtype, budget, sinks)
        if step.append and m is not None and m.shape[1] > 1:
            seen.append((layer.layer_idx, m.clone(), query.clone(), step.new_positions().clone()))
        return m

    monkeypatch.setattr(PageSelection, "mask", spy)
    cache = vase.EvictingCache(model, policy="quest:page=8", budget=40, buffer=8)
    with torch.no_grad():
        model.generate(
            input_ids=random_ids(50), max_new_tokens=30, min_new_tokens=30, do_sample=False, **cache_kwargs(cache)
        )
    assert len(seen) == 29 * 2
    for li, m, query, qpos in seen:
        allowed = m if m.dtype == torch.bool else m == 0
        t = int(qpos[0, 0])
        expect = _brute_force_mask(cache.layers[li], query, qpos[:, 0], 40, 4, 8)
        for h in range(4):
            got = allowed[0, h, 0, : t + 1].view(-1)
            pages = expect[0][h]
            want = torch.tensor([pages[j // 8] for j in range(t + 1)])
            assert torch.equal(got, want), f"layer {li}, position {t}, head {h}"
            assert int(got.sum()) <= 40
    # heads of a GQA group do choose differently somewhere (selection is per query head)
    assert any(not torch.equal(m[0, 0], m[0, 1]) for _, m, _, _ in seen)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_budget_at_least_the_length_equals_the_full_cache(family, attn):
    model = tiny_model(family, attn)
    ids = random_ids(24)
    ref = model.generate(input_ids=ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    cache = vase.EvictingCache(model, policy="quest", budget=64, buffer=8)
    out = model.generate(input_ids=ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, **cache_kwargs(cache))
    assert torch.equal(out, ref)
    # logits too, step by step, against DynamicCache
    full, quest = DynamicCache(config=model.config), vase.EvictingCache(model, policy="quest", budget=64, buffer=8)
    with torch.no_grad():
        a = model(input_ids=ids, **cache_kwargs(full)).logits
        b = model(input_ids=ids, **cache_kwargs(quest)).logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for t in out[0, 24:40]:
            a = model(input_ids=t.view(1, 1), **cache_kwargs(full)).logits
            b = model(input_ids=t.view(1, 1), **cache_kwargs(quest)).logits
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    st = quest.stats()
    assert st.evictions == 0 and st.slots_held == 40
    # fidelity: exactly the full cache's distributions
    from vase.harness.fidelity import compare, replay

    prompt, cont = out[0, :24], out[0, 24:]
    res = compare(replay(model, prompt, cont, "full", 64, 8), replay(model, prompt, cont, "quest", 64, 8), cont, 16)
    assert res["kl_mean"] == 0.0 and res["top1"] == 1.0


def _decode_logits(model, prompt, cont, cache, chunk: bool):
    with torch.no_grad():
        out = [model(input_ids=prompt.view(1, -1), **cache_kwargs(cache)).logits[0, -1:]]
        if chunk:
            out.append(model(input_ids=cont[:-1].view(1, -1), **cache_kwargs(cache)).logits[0])
        else:
            for t in cont[:-1]:
                out.append(model(input_ids=t.view(1, 1), **cache_kwargs(cache)).logits[0])
    return torch.log_softmax(torch.cat(out).float(), -1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_chunked_replay_equals_token_by_token_decode(attn):
    """A teacher-forced chunk selects per query token exactly what token-by-token decoding selects, so fidelity's
    one-chunk replay is exact for quest; and the selection does change the result (it is not the full cache)."""
    from vase.harness.fidelity import replay

    model = tiny_model("llama", attn, kv_heads=2)
    ids = random_ids(120, seed=4)[0]
    prompt, cont = ids[:20], ids[20:]
    kw = dict(policy="quest:page=8", budget=40, buffer=8)
    chunk = _decode_logits(model, prompt, cont, vase.EvictingCache(model, **kw), chunk=True)
    steps = _decode_logits(model, prompt, cont, vase.EvictingCache(model, **kw), chunk=False)
    torch.testing.assert_close(chunk, steps, atol=1e-4, rtol=1e-4)
    assert torch.equal(chunk.argmax(-1), steps.argmax(-1))
    torch.testing.assert_close(replay(model, prompt, cont, "quest:page=8", 40, 8), chunk, atol=1e-5, rtol=1e-5)
    full = _decode_logits(model, prompt, cont, DynamicCache(config=model.config), chunk=True)
    assert (full - chunk).abs().max() > 1e-2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_ragged_rows_equal_rows_alone(attn):
    """Prompt, greedy decode, a multi-token continuation with padding, decode again: each row of the batch gives its
    own solo tokens and holds the same keys, positions and page metadata."""
    model = tiny_model("qwen3", attn)
    lengths, more = (70, 33, 9), (5, 40, 21)
    first = [random_ids(n, seed=30 + i)[0] for i, n in enumerate(lengths)]
    second = [random_ids(n, seed=40 + i)[0] for i, n in enumerate(more)]
    kw = dict(policy="quest", budget=40, buffer=8)
    cache = vase.EvictingCache(model, **kw)
    tokens, snaps = run_phases(model, cache, [(first, 20), (second, 12)])
    for r in range(3):
        alone = vase.EvictingCache(model, **kw)
        solo_tokens, solo_snaps = run_phases(model, alone, [([first[r]], 20), ([second[r]], 12)])
        assert tokens[r].tolist() == solo_tokens[0].tolist(), f"row {r}"
        for phase in range(2):
            assert_row_equal(snaps[phase][r], solo_snaps[phase][0], f"row {r}, phase {phase}")
        n = math.ceil(alone.fill[0] / 16)
        for layer, solo in zip(cache.layers, alone.layers):
            torch.testing.assert_close(layer.pages.kmin[r, :, :n], solo.pages.kmin[0, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(layer.pages.kmax[r, :, :n], solo.pages.kmax[0, :, :n], atol=1e-5, rtol=1e-5)
    assert cache.stats().evictions == 0


def test_page_metadata_equals_min_max_of_the_held_keys():
    model = tiny_model("llama")
    cache = vase.EvictingCache(model, policy="quest", budget=48, buffer=8)
    with torch.no_grad():
        model.generate(
            input_ids=random_ids(37), max_new_tokens=60, min_new_tokens=60, do_sample=False, **cache_kwargs(cache)
        )
    for layer in cache.layers:
        n = cache.fill[0] // 16  # complete pages
        k = layer.keys[:, :, : n * 16].unflatten(2, (n, 16))
        assert torch.equal(layer.pages.kmin[:, :, :n], k.amin(3))
        assert torch.equal(layer.pages.kmax[:, :, :n], k.amax(3))


def test_stats_count_the_page_metadata_and_grow_with_length():
    model = tiny_model("llama")
    ids = random_ids(10)
    run = decode_run(model, ids, "quest", 48, 8, 150, [40, 150])
    kv = [m["kv_bytes"] for m in run["marks"]]
    assert kv[1] > kv[0]  # the whole cache is kept
    cache = vase.EvictingCache(model, policy="quest", budget=48, buffer=8)
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=150, min_new_tokens=150, do_sample=False, **cache_kwargs(cache))
    st = cache.stats()
    buffers = sum(layer.keys.numel() * 4 * 2 for layer in cache.layers)
    meta = sum(layer.pages.nbytes for layer in cache.layers)
    n = cache.layers[0].pages.kmin.shape[2]
    cap = cache.layers[0].keys.shape[2]
    assert cap == 200 and n == 13  # buffers grown 56 -> 104 -> 152 -> 200 slots; pages cover them: ceil(200 / 16)
    assert meta == 2 * 2 * (1 * 2 * n * 16 * 4)  # layers x (min, max) x [B, KV heads, pages, D] fp32
    assert st.bytes_held == buffers + meta == kv_bytes(cache) and st.evictions == 0 and st.slots_held == 159


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(policy="quest", budget=20, buffer=4), r"budget \(20\) is smaller than the pages always attended"),
        (dict(policy="quest:page=0", budget=80), "page must be a positive"),
        (dict(policy="quest:page=x", budget=80), "page must be a positive"),
        (dict(policy="quest:window=8", budget=80), "does not take option"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        vase.EvictingCache(tiny_model("llama"), **kwargs)
    with pytest.raises(ValueError, match=message):
        vase.harness.generation.check_options(**kwargs)


def test_flash_attention_is_refused_with_a_clear_error():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # as loaded with it (no flash kernel on this CPU)
    with pytest.raises(ValueError, match="attn_implementation='sdpa' or 'eager'"):
        vase.EvictingCache(model, policy="quest", budget=128)


def test_policy_listing():
    policy = vase.make_policy("quest")
    assert not policy.evicts and policy.sparse.page == 16
    assert "quest" in vase.POLICY_NAMES and "top pages of 16 tokens" in policy.describe()
    assert any(name == "quest" and "2406.10774" in src for name, _, src in vase.policy_table())


def test_eval_and_fidelity_run_with_quest(tmp_path):
    from vase.harness.evaluate import EvalConfig, read_records, run_sweep
    from vase.harness.fidelity import FidelityConfig, run_fidelity

    lm = tiny_lm()
    task = tmp_path / "t.jsonl"
    task.write_text(
        "".join(json.dumps({"question": f"{i} + {i}?", "answer": f"#### {2 * i}"}) + "\n" for i in range(2))
    )
    cfg = EvalConfig(
        model="tiny",
        tasks=[str(task)],
        policies=["quest", "vase"],
        budgets=[40],
        seeds=[0],
        max_new_tokens=40,
        buffer=8,
    )
    recs = read_records(run_sweep(cfg, tmp_path / "eval", batch_size=2, progress=False, lm=lm))
    quest = [r for r in recs if r["policy"] == "quest"]
    assert len(quest) == 2 and all(r["evictions"] == 0 and r["kv_bytes"] > r["kv_bytes_full"] for r in quest)

    fcfg = FidelityConfig(
        model="tiny", source=str(task), policies=["quest", "vase"], prompts=1, tokens=100, ratios=[2.0], buffer=8
    )
    recs = read_records(run_fidelity(fcfg, tmp_path / "fid", progress=False, lm=lm))
    assert {r["policy"] for r in recs} == {"quest", "vase"} and all(0 <= r["top1"] <= 1 for r in recs)


def test_cli_generate_and_bench_with_quest_on_the_embedded_model(embedded, tmp_path):
    """The command line with quest on the embedded model: generate (stats line), and bench next to the full cache
    (quest's KV bytes grow, so the 'constant KV' goal covers the evicting policies only)."""
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "vase.cli",
            "generate",
            "--policy",
            "quest",
            "--budget",
            "48",
            "--buffer",
            "16",
            "-n",
            "24",
            "--min-new-tokens",
            "24",
            "What is 2 + 3?",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert re.search(r"policy quest, budget \d+ \+ buffer \d+ \| 1 sequence, \d+ tokens seen, 0 evictions", gen.stdout)
    bench = subprocess.run(
        [
            sys.executable,
            "-m",
            "vase.cli",
            "bench",
            "sweep",
            "--out",
            str(tmp_path),
            "--lengths",
            "4,64",
            "--budgets",
            "40",
            "--buffer",
            "8",
            "--policies",
            "quest,streaming_llm",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bench.returncode == 0, bench.stderr[-2000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["policy"], r["budget"]) for r in data["runs"]] == [("full", None), ("quest", 40), ("streaming_llm", 40)]
    marks = data["runs"][1]["marks"]
    assert marks[1]["kv_bytes"] > marks[0]["kv_bytes"]  # 50 tokens held in 54 slots, then 110 in 134
    assert "for every evicting policy: met" in bench.stdout
