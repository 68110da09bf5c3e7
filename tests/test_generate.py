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
from vase.cli import app
from vase.generation import encode_prompts, generate

from .conftest import TinyTokenizer, need_data, tiny_model

runner = CliRunner()
STATS = re.compile(
    r"\[vase\] prompt (\d+) tok, generated (\d+) tok \| policy (\w+), (\d+) evictions \| KV (\d+)/(\d+) slots "
    r"\(budget (\d+) \+ buffer (\d+)\), ([\d.]+) MiB held vs ([\d.]+) MiB full \(([\d.]+)x\) \| ([\d.]+) tok/s"
)


def test_cli_end_to_end_on_embedded_model(embedded, tmp_path):
    """A short real run with several evictions: exit 0, streamed text, a consistent stats line."""
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
        "100",
        "--min-new-tokens",
        "100",
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
    prompt, new, policy, evictions, held, cap, budget, buffer = map(lambda x: x, m.groups()[:8])
    assert policy == "vase" and int(new) == 100 and int(budget) == 48 and int(buffer) == 16
    assert int(held) <= int(budget) + int(buffer) and int(cap) == 64
    assert int(evictions) >= (int(prompt) + 100 - 64) // 16  # compactions every 16 tokens after the first
    assert float(m.group(11)) > 1.5  # bytes: full / held
    assert len(proc.stdout.split("[vase]")[0].strip()) > 50  # the text itself was streamed


def test_embedded_no_eviction_matches_full_cache(embedded):
    model, tok = embedded.model, embedded.tokenizer
    enc = encode_prompts(tok, ["Write a short poem about the sea."])
    with torch.inference_mode():
        ref = model.generate(**enc, max_new_tokens=40, do_sample=False, cache=DynamicCache(config=model.config))
        cache = vase.EvictingCache(model, policy="vase", budget=512)
        out = model.generate(**enc, max_new_tokens=40, do_sample=False, cache=cache)
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
    from vase.models import load_model

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
    from vase.models import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="flash_attention_2 needs a CUDA device"):
        load_model("smollm2", device="cpu", attn="flash_attention_2")
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model("smollm2", dtype="float8")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json and 0 .gguf files"):
        load_model(str(tmp_path / "empty"))
