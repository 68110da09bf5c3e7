"""The main job: `vase generate` on the embedded model, the Python API, and bad input at the command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache
from typer.testing import CliRunner

import vase
from tests.conftest import TinyTokenizer, need_data, random_ids, tiny_model
from vase.cli import app
from vase.harness.generation import encode_prompts, generate
from vase.hf.compat import cache_kwargs

runner = CliRunner()
STATS = re.compile(
    r"\[vase\] prompt (\d+) tok, generated (\d+) tok \| policy (\w+), budget (\d+) \+ buffer (\d+) \| 1 sequence, "
    r"\d+ tokens seen, (\d+) evictions \| KV (\d+)/(\d+) slots, ([\d.]+) MiB held vs ([\d.]+) MiB full: ([\d.]+)x "
    r"smaller \| ([\d.]+) tok/s"
)


def test_cli_end_to_end_on_embedded_model(embedded, tmp_path):
    """A short real run with several evictions: exit 0, streamed text, a consistent stats line."""
    new_tokens = 64  # with the prompt (~150 tokens) past budget + buffer: compactions at prefill and every 16 tokens
    args = [
        sys.executable,
        "-m",
        "vase.cli",
        "generate",
        "--budget",
        "48",
        "--buffer",
        "16",
        "-n",
        str(new_tokens),
        "--min-new-tokens",
        str(new_tokens),
    ]
    try:
        data = need_data("reasoning/gsm8k.jsonl")
        args += ["--data", str(data), "--index", "3"]
    except pytest.skip.Exception:
        args += ["How many legs do three spiders and two cats have together?"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    m = STATS.search(proc.stdout)
    assert m, proc.stdout[-500:]
    prompt, new, policy, budget, buffer, evictions, held, cap = m.groups()[:8]
    assert policy == "vase" and int(new) == new_tokens and int(budget) == 48 and int(buffer) == 16
    assert int(held) <= int(budget) + int(buffer) and int(cap) == 64
    # a prompt of 64+ tokens is compacted at prefill; then every 16 decode forwards (the last token is not fed back)
    first = max(0, 64 - int(prompt))  # decode forwards before the first compaction
    assert int(evictions) == (int(prompt) >= 64) + (first > 0) + (new_tokens - 1 - first) // 16
    assert float(m.group(11)) > 1.5  # bytes: full / held
    assert len(proc.stdout.split("[vase]")[0].strip()) > 50  # the text itself was streamed


def test_embedded_no_eviction_matches_full_cache(embedded):
    model, tok = embedded.model, embedded.tokenizer
    enc = encode_prompts(tok, ["Write a short poem about the sea."])
    with torch.inference_mode():
        ref = model.generate(
            **enc, max_new_tokens=40, do_sample=False, **cache_kwargs(DynamicCache(config=model.config))
        )
        cache = vase.EvictingCache(model, policy="vase", budget=512)
        out = model.generate(**enc, max_new_tokens=40, do_sample=False, **cache_kwargs(cache))
    assert torch.equal(out, ref)
    assert cache.stats().evictions == 0


def test_embedded_with_eviction_stays_bounded(embedded):
    res = generate(
        embedded.model,
        embedded.tokenizer,
        "Count from one to fifty in words.",
        policy="vase",
        budget=40,
        buffer=8,
        max_new_tokens=60,
        min_new_tokens=60,
    )
    st = res.stats
    assert res.completions[0].new_tokens == 60
    assert st.evictions >= 5 and st.slots_held <= 48 and st.capacity == 48
    assert st.bytes_held == 30 * 2 * 3 * 48 * 64 * 4  # layers x (K,V) x kv heads x slots x head_dim x fp32


def test_python_api_batch_and_ratio():
    model = tiny_model("llama")

    res = generate(
        model,
        TinyTokenizer(),
        ["hello there, a longer prompt", "hi"],
        policy="snapkv",
        compression_ratio=2.0,
        buffer=4,
        max_new_tokens=30,
        min_new_tokens=30,
    )
    assert [c.new_tokens for c in res.completions] == [30, 30]
    assert res.stats.budget == (28 + 30 + 1) // 2
    with pytest.raises(ValueError, match="compression ratio must be > 1"):
        generate(model, TinyTokenizer(), "x", compression_ratio=0.5)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(model, TinyTokenizer(), "  ")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_p=2.0), r"top_p must be in \(0, 1\] \(1 = off\), got 2.0"),
        (dict(top_p=0.0, temperature=0.6), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), r"top_k must be an integer >= 0 \(0 = off\), got -1"),
        (dict(temperature=-0.1), r"temperature must be >= 0 \(0 = greedy\), got -0.1"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
        (dict(max_new_tokens=4, min_new_tokens=5), r"min_new_tokens must be in \[0, max_new_tokens = 4\], got 5"),
        (dict(budget=20, buffer=16), r"budget \(20\) must be larger than sinks \+ buffer \(4 \+ 16 = 20\)"),
        (dict(budget=64, compression_ratio=2.0), "either a budget or a compression ratio"),
        (dict(compression_ratio=1.0), "compression ratio must be > 1"),
        (dict(window=0), "window must be a positive number of queries, got 0"),
        (dict(sinks=-2), "sinks must be >= 0 tokens, got -2"),
        (dict(policy="vase", protect_share=1.0), r"protected share must be in \[0, 1\), got 1.0"),
        (dict(policy="lru"), "unknown policy 'lru'"),
    ],
)
def test_python_api_checks_options_before_running(kwargs, message):
    """vase.harness.generation.generate refuses out-of-range options before tokenizing or running the model."""
    model = tiny_model("llama")

    def never(*args, **kw):
        raise AssertionError("the model ran before the options were checked")

    model.generate = never
    with pytest.raises(ValueError, match=message):
        generate(model, TinyTokenizer(), "a prompt", **kwargs)


def test_cache_reused_for_a_new_prompt_says_reset():
    """A filled cache given a new, shorter prompt: a ValueError naming reset(), not a reshape error in transformers.
    Continuing the same sequence still works, and so does the cache after reset()."""
    model = tiny_model("llama")
    cache = vase.EvictingCache(model, budget=24, buffer=8)
    short = random_ids(10, seed=2)
    with torch.inference_mode():
        out = model.generate(input_ids=random_ids(30), **cache_kwargs(cache), max_new_tokens=12, do_sample=False)
        assert cache.get_seq_length() == 41 and cache.stats().evictions == 2
        with pytest.raises(ValueError, match=r"already holds 41 tokens .*: call cache.reset\(\) or create a new"):
            model.generate(input_ids=short, **cache_kwargs(cache), max_new_tokens=5, do_sample=False)
        with pytest.raises(ValueError, match=r"attention_mask covers 10 tokens for 10 new ones \(41 \+ 10 expected"):
            model(input_ids=short, attention_mask=torch.ones_like(short), **cache_kwargs(cache))
        assert cache.get_seq_length() == 41  # the refused calls changed nothing
        more = torch.cat([out, random_ids(3, seed=4)], 1)  # the same sequence, continued: all its tokens + 3 new
        cont = model.generate(input_ids=more, **cache_kwargs(cache), max_new_tokens=4, do_sample=False)
        assert cont.shape[1] == more.shape[1] + 4 and cache.get_seq_length() == 48
        cache.reset()
        again = model.generate(input_ids=short, **cache_kwargs(cache), max_new_tokens=5, do_sample=False)
        ref = model.generate(
            input_ids=short, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=5, do_sample=False
        )
    assert torch.equal(again, ref)  # 15 tokens: under the budget, so exactly the full cache's output


# --------------------------------------------------------------------------------------- bad input, CLI level
def _cli(args, **kw):
    result = runner.invoke(app, args, **kw)
    assert result.exit_code != 0
    err = result.stderr if hasattr(result, "stderr") else result.output
    assert "Traceback" not in result.output
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_cli_missing_model_path():
    assert "model path not found" in _cli(["generate", "hi", "--model", "./no/such/model"])


def test_cli_gguf_that_does_not_load(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert "could not load GGUF file" in _cli(["generate", "hi", "--model", str(bad)])


def test_cli_jsonl_without_field(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"text": "x", "answer": "1"}) + "\n")
    assert "no question field" in _cli(["generate", "--data", str(f)])
    assert "no question field 'body'" in _cli(["generate", "--data", str(f), "--question-field", "body"])


def test_cli_index_out_of_range(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(3)))
    assert "index 7 is out of range: the file has 3 problems (0..2)" in _cli(
        ["generate", "--data", str(f), "--index", "7"]
    )


def test_cli_empty_prompt():
    assert "empty" in _cli(["generate", "   "])
    assert "empty" in _cli(["generate", "-"], input="")


def test_cli_bad_policy_and_budget():
    assert "valid policies" in _cli(["generate", "hi", "--policy", "nope"])
    assert "protected share" in _cli(["generate", "hi", "--protect-share", "1.5"])


def test_cli_prompt_longer_than_context(embedded):
    assert "more than the model's context of 8192 tokens" in _cli(["generate", "word " * 9000])


def test_load_model_from_local_folder(embedded, tmp_path):
    """A local Qwen3 checkpoint folder (config + weights + tokenizer) loads through the same path as a hub id."""
    from vase.hf.models import load_model

    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    embedded.tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float32", device="cpu", attn="eager")
    assert lm.model.config.model_type == "qwen3" and lm.model.config._attn_implementation == "eager"
    assert lm.tokenizer.padding_side == "left" and lm.tokenizer.pad_token is not None
    ref = model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)
    out = lm.model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)
    assert torch.equal(ref, out)


def test_model_load_errors(tmp_path):
    from vase.hf.models import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="flash_attention_2 needs a CUDA device"):
        load_model("smollm2", device="cpu", attn="flash_attention_2")
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model("smollm2", dtype="float8")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json and 0 .gguf files"):
        load_model(str(tmp_path / "empty"))


def test_python_api_compile(monkeypatch):
    """``generate(..., compile=True)``: a compileable cache and transformers' compiled decode steps (aot_eager here;
    inductor in tests/hf/test_compile.py): the same completions as without."""
    import torch._dynamo

    import vase.harness.generation
    from vase.core.sizes import compiled_capacity

    def quick(device, backend="inductor"):
        return real(device, backend="aot_eager")

    real = vase.harness.generation.compile_config
    monkeypatch.setattr(vase.harness.generation, "compile_config", quick)
    torch._dynamo.reset()
    model = tiny_model("llama")
    prompts = ["a first prompt", "and a longer second prompt"]
    kwargs = dict(budget=40, buffer=8, max_new_tokens=60, min_new_tokens=60)
    plain = generate(model, TinyTokenizer(), prompts, **kwargs)
    compiled = generate(model, TinyTokenizer(), prompts, compile=True, **kwargs)
    assert [c.token_ids for c in compiled.completions] == [c.token_ids for c in plain.completions]
    assert compiled.stats.evictions == plain.stats.evictions >= 3
    assert compiled.stats_line().endswith("(compilation included)") and "compilation" not in plain.stats_line()
    full = generate(model, TinyTokenizer(), prompts, policy="full", compile=True, **kwargs)
    reference = generate(model, TinyTokenizer(), prompts, policy="full", **kwargs)
    assert [c.token_ids for c in full.completions] == [c.token_ids for c in reference.completions]
    # max_cache_len = prompt + new tokens + 1 (the last new token is never fed back), rounded up to a power of two so
    # that prompts of other lengths reuse the graph: allocated once, never grown
    assert full.stats.capacity == compiled_capacity(reference.stats.tokens_seen + 2) == 256


def test_stats_line_says_sequences_and_when_memory_exceeds_the_full_cache():
    """One format for the API and the CLI: the number of sequences, and a plain word when the buffers (allocated at
    budget + buffer from the first token) hold more than a full cache would, as in a run too short to evict."""
    model, tok = tiny_model("llama"), TinyTokenizer()
    short = generate(model, tok, "abcdefgh", budget=96, buffer=16, max_new_tokens=4, chat=False)
    line = short.stats_line()
    assert short.stats.bytes_held > short.stats.bytes_full and short.stats.evictions == 0
    assert "prompt 8 tok, generated 4 tok" in line and "| 1 sequence, 11 tokens seen, 0 evictions |" in line
    assert "x MORE than the full cache (no eviction yet" in line and "smaller" not in line
    assert line.split(" | ", 1)[1].startswith(short.stats.line())  # the cache's own line, unchanged inside
    batch = generate(
        model,
        tok,
        ["abcdefgh", "abcdefghijklmnop"],
        budget=24,
        buffer=8,
        max_new_tokens=40,
        min_new_tokens=40,
        chat=False,
    )
    line = batch.stats_line()
    assert line.startswith("[vase] 2 prompts, 24 tok in all, generated 80 tok in all | ")
    assert "| 2 sequences, 55 tokens seen each, " in line and "slots each" in line and "x smaller |" in line
    assert " eviction steps | KV " in line  # steps in which any sequence evicted, not evictions per sequence


def test_generate_keeps_the_published_presets_dense_prompt():
    """``generate`` leaves the prompt's handling to the policy unless told: the published preset keeps a prompt longer
    than the budget dense until its first eviction (capacity follows the prompt); ``compress_prompt=True`` overrides
    it, and plain ``vase`` compresses at prefill (capacity budget + buffer)."""
    model, tok, text = tiny_model(), TinyTokenizer(), "the quick brown fox jumps over the lazy dog, twice " * 2
    kw = dict(budget=24, buffer=8, max_new_tokens=2, chat=False)
    prompt = int(tok(text)["input_ids"].shape[1])
    assert prompt > 24 + 8
    dense = generate(model, tok, text, policy="vase:preset=paper", **kw).stats
    forced = generate(model, tok, text, policy="vase:preset=paper", compress_prompt=True, **kw).stats
    plain = generate(model, tok, text, policy="vase", **kw).stats
    assert dense.evictions == 0 and dense.capacity > prompt and dense.slots_held == prompt + 1
    assert forced.evictions == 1 and forced.capacity == 32 and forced.slots_held <= 32
    assert plain.evictions == 1 and plain.capacity == 32
