"""Benchmarks: the measuring loop, the report of goals, and the GPU script at toy size on CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import random_ids, tiny_lm, tiny_model
from vase.harness.bench_markdown import bench_markdown, compiled_markdown, paired_markdown
from vase.harness.measure import compiled_speed, decode_run, paired_speed, rss_bytes

ROOT = Path(__file__).resolve().parents[2]


def test_decode_run_measures_static_memory():
    model = tiny_model("llama")
    ids = random_ids(10)
    full = decode_run(model, ids, "full", 0, 8, 96, [32, 96])
    vase_run = decode_run(model, ids, "vase", 24, 8, 96, [32, 96])
    assert [m["tokens"] for m in vase_run["marks"]] == [32, 96]
    assert full["marks"][1]["kv_bytes"] == 2 * 2 * 2 * (10 + 96) * 16 * 4  # grows with the context
    assert vase_run["marks"][0]["kv_bytes"] == vase_run["marks"][1]["kv_bytes"] == 2 * 2 * 2 * 32 * 16 * 4
    assert vase_run["marks"][1]["evictions"] > 5 and vase_run["marks"][1]["eviction_s"] > 0
    assert all(m["tok_s_bucket"] > 0 for m in vase_run["marks"])
    cur, peak = rss_bytes()
    assert 0 < cur <= peak


def _run(policy, budget, tok, kv, rss, ev=0.0):
    marks = [
        {
            "tokens": t,
            "tok_s_bucket": s,
            "tok_s_last": s,
            "kv_bytes": k,
            "peak_rss": r,
            "eviction_s": ev,
            "decode_s": 100.0,
        }
        for t, s, k, r in zip((1024, 8192), tok, kv, rss)
    ]
    return {
        "policy": policy,
        "budget": budget,
        "model": "m",
        "device": "cpu",
        "threads": 2,
        "prompt_tokens": 30,
        "marks": marks,
    }


def test_bench_markdown_goals():
    data = {
        "marks": [1024, 8192],
        "buffer": 64,
        "runs": [
            _run("full", None, (16.0, 10.0), (2**20, 8 * 2**20), (1000 * 2**20, 1400 * 2**20)),
            _run("streaming_llm", 512, (17.0, 17.0), (2**20, 2**20), (1000 * 2**20, 1010 * 2**20)),
            _run("vase", 512, (16.5, 16.5), (2**20, 2**20), (1000 * 2**20, 1020 * 2**20), ev=2.0),
        ],
    }
    text = bench_markdown(data)
    assert "| vase | 512 | 16.5 | 16.5 | 16.5 | 1.65 | 0.971 | 2.0% |" in text  # speed table
    assert "| vase | 512 | 1.0 | 1.0 | 1000 | 1020 | +2.0% |" in text  # memory table
    assert "| full | — | 16.0 | 10.0 | 10.0 | 1.00 | — | 0.0% |" in text  # no streaming_llm ratio for full
    for block in text.split("\n\n"):  # every markdown table: header, delimiter and rows with equal column counts
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len({row.count("|") for row in rows}) <= 1, block
    assert "KV bytes held constant from 1024 to 8192 tokens for every evicting policy: met" in text
    assert "peak RSS growth 1024→8192 +2.0% (goal < 5%; full cache +40.0%): met" in text
    assert "decode at 8192 tokens 1.65x the full cache (goal >= 1.3x): met" in text
    assert "throughput 0.971x streaming_llm's (goal >= 0.95): met" in text


def _script(name: str):
    """A script of benchmarks/ loaded as a module."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "benchmarks" / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_script_at_toy_size_on_cpu(tmp_path):
    mod = _script("gpu_qwen3_4b.py")
    res = mod.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "g.json")])
    saved = json.loads((tmp_path / "g.json").read_text())
    assert saved["shape"] == "tiny" and [r["mode"] for r in saved["runs"]] == ["vase", "full"]
    assert all(r["complete"] and r["tok_s"] > 0 for r in saved["runs"]) and res["speedup"] > 0
    assert "eviction steps" in saved["runs"][0]["stats"]


def test_gpu_script_compiled_mode_at_toy_size_on_cpu(tmp_path):
    """``--compile``: four runs (vase and the full cache, compiled and not), ratios to both full-cache runs."""
    mod = _script("gpu_qwen3_4b.py")
    torch._dynamo.reset()  # a new model: start from empty dynamo caches (see tests/hf/test_compile.py, fresh_model)
    res = mod.main(
        ["--tiny", "--device", "cpu", "--compile", "--backend", "aot_eager", "--out", str(tmp_path / "g.json")]
    )
    modes = [r["mode"] for r in res["runs"]]
    assert modes == ["vase+compile", "vase", "full+compile", "full"]
    assert all(r["complete"] and r["tok_s"] > 0 for r in res["runs"])
    assert res["vs_full"]["full"] == 1.0 and res["vs_full_compiled"]["full+compile"] == 1.0
    assert "eviction steps" in res["runs"][0]["stats"] and res["attn"] == "sdpa"


def test_cli_bench_end_to_end(embedded, tmp_path):
    """`vase bench sweep` at toy lengths: one subprocess per configuration (full cache + vase), a table and the goals.

    Each configuration is a fresh process (imports and model load dominate), so the test keeps to two; the tables
    of several policies are checked by test_bench_markdown_goals."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vase.cli",
            "bench",
            "sweep",
            "--out",
            str(tmp_path),
            "--lengths",
            "24,48",
            "--budgets",
            "24",
            "--buffer",
            "8",
            "--policies",
            "vase",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["policy"], r["budget"]) for r in data["runs"]] == [("full", None), ("vase", 24)]
    assert "| vase | 24 |" in proc.stdout and "Goals:" in proc.stdout
    assert "KV bytes held constant from 24 to 48 tokens for every evicting policy: met" in proc.stdout
    vase_run = data["runs"][1]["marks"]
    assert vase_run[0]["kv_bytes"] == vase_run[1]["kv_bytes"] == 30 * 2 * 3 * 32 * 64 * 4


def test_paired_speed_interleaves_policies():
    lm = tiny_lm("llama")
    res = paired_speed(lm, ["full", "streaming_llm", "vase"], budget=24, buffer=8, context=40, steps=20, progress=False)
    assert [r["policy"] for r in res["runs"]] == ["full", "streaming_llm", "vase"]
    assert res["runs"][0]["vs_first"] == 1.0 and all(r["tok_s"] > 0 for r in res["runs"])
    lo, hi = res["runs"][2]["block_tok_s"]
    assert 0 < lo <= hi
    table = paired_markdown(res)
    assert "| vase |" in table and "× full" in table
    with pytest.raises(ValueError, match="context >= budget \\+ buffer"):
        paired_speed(lm, ["vase"], budget=24, buffer=8, context=20, steps=4, progress=False)


def test_compiled_speed_pairs_compiled_and_uncompiled_runs():
    """`vase bench compiled`'s measurement at toy size: each policy compiled and not, at each context, with ratios;
    the compiled vase run evicts, the compiled full cache is transformers' StaticCache."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    lm = tiny_lm("llama")
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    res = compiled_speed(
        lm, ["full", "vase"], contexts=[30, 64], budget=24, buffer=8, steps=16, backend="aot_eager", progress=False
    )
    assert [r["context"] for r in res] == [30, 64] and res[0]["budget"] == 15 and res[1]["budget"] == 24
    for r in res:
        assert [x["policy"] for x in r["runs"]] == ["full", "full+compile", "vase", "vase+compile"]
        assert all(x["tok_s"] > 0 for x in r["runs"]) and r["mode"] == "default"
    # one graph per compiled run (2 runs x 2 contexts): none recompiles in its timed steps when another cache runs
    # between its turns (vase's per-thread state is guarded by value, and set from the start)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 4
    text = compiled_markdown(res)
    assert "compiled / uncompiled (aot_eager, default): full " in text and "vase " in text


def test_gpu_codes_script_at_toy_size_on_cpu(tmp_path):
    """benchmarks/gpu_codes_attention.py: codes, dequantize and dense timed side by side, the codes' result checked."""
    mod = _script("gpu_codes_attention.py")
    res = mod.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "c.json")])
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved == res and [(r["batch"], r["slots"]) for r in res["rows"]] == [(1, 256), (2, 512)]
    assert all(r["codes_ms"] > 0 and r["dense_ms"] > 0 and r["max_abs_diff"] < 1e-4 for r in res["rows"])


def test_decode_step_limit_script_on_the_embedded_model(embedded):
    """benchmarks/decode_step_limit.py at toy lengths: the bytes a step must read, the KV held, the profile's parts."""
    mod = _script("decode_step_limit.py")
    res = mod.main(
        ["--contexts", "160", "--budget", "64", "--buffer", "16", "--steps", "3", "--profile-steps", "2"]
        + ["--short", "24", "--bandwidth-gib", "0.0625"],
        lm=embedded,
    )
    params = {p.data_ptr(): p.numel() for p in embedded.model.parameters()}
    assert res["weight_bytes"] == 4 * sum(params.values()) and 530e6 < res["weight_bytes"] < 545e6
    assert [(r["cache"], r["context"]) for r in res["rows"]] == [("full", 24), ("full", 72), ("vase", 160)]
    # the evicting cache holds its static buffers, budget + buffer slots per layer and KV head
    assert res["rows"][2]["kv_bytes"] == 30 * 2 * 3 * (64 + 16) * 64 * 4
    assert all(r["step_s"] > 0 and r["limit_s"] > 0 for r in res["rows"]) and res["bandwidth"] > 1e9
    parts = res["split"]
    assert parts["weight matmuls"] > 0 and parts["attention"] > 0
    assert parts["step (unprofiled median)"] == pytest.approx(1e3 * res["rows"][2]["step_s"])


def test_serve_bench_records_the_machine():
    """The served benchmark's ratios depend on the machine: each engine's result records it, and the table names it
    (or says the rows differ, or that an older result did not record it)."""
    mod = _script("vllm_serve_bench.py")
    machine = mod._machine()
    assert machine["cores"] >= 1 and machine["cpu"] and "torch" in machine["versions"]
    line = mod._describe(machine)
    assert line.startswith(machine["cpu"]) and f"{machine['cores']} cores" in line
    client = {"output_throughput": 100.0, "median_ttft_ms": 1000.0, "p99_ttft_ms": 2000.0}
    server = {"preemptions": 0, "shrinks": 0}
    row = {"workload": "burst", "engines": {"stock": {"client": client, "server": server}}}
    assert mod._table({"workloads": [row]}, "stock").startswith("Machine: not recorded\n")
    row["engines"]["stock"]["machine"] = machine
    table = mod._table({"workloads": [row]}, "stock")
    assert table.startswith(f"Machine: {line}\n") and "| burst | stock | 100.0 | 1.00x | 1.00 | 2.00 |" in table
    other = {**machine, "cores": machine["cores"] + 1}
    row["engines"]["vase"] = {"client": client, "server": server, "machine": other}
    assert mod._table({"workloads": [row]}, "stock").startswith("Machine: differs between rows (see results.json)")
