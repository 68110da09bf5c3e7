"""Evaluation: resume, shards, configuration checks, fidelity exactness, report, inspect, task files."""

from __future__ import annotations

import json

import pytest
import torch

import vase.harness.generation
from tests.conftest import random_ids, tiny_lm, tiny_model
from vase.harness.data import DataError, load_problems
from vase.harness.evaluate import EvalConfig, merge, read_records, record_key, run_sweep, summarize
from vase.harness.fidelity import compare, replay
from vase.harness.magnitudes import magnitude_table
from vase.harness.report import eval_summary, write_report
from vase.hf.compat import cache_kwargs


@pytest.fixture()
def task_file(tmp_path):
    path = tmp_path / "mini.jsonl"
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"Work... #### {2 * i}", "id": f"q{i}"} for i in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config_for(task_file, **kw):
    base = dict(
        model="tiny",
        tasks=[str(task_file)],
        policies=["vase", "streaming_llm"],
        budgets=[24],
        seeds=[0, 1],
        max_new_tokens=30,
        temperature=0.0,
        buffer=8,
    )
    base.update(kw)
    return EvalConfig(**base)


def test_sweep_records_and_resume_after_interrupt(tmp_path, task_file, monkeypatch):
    lm = tiny_lm()
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    cfg = config_for(task_file)
    ref = read_records(run_sweep(cfg, ref_dir, batch_size=3, progress=False, lm=lm))
    assert len(ref) == 2 * 1 * 2 * 5
    r0 = ref[0]
    assert {
        "task",
        "problem_id",
        "policy",
        "budget",
        "seed",
        "text",
        "answer",
        "correct",
        "new_tokens",
        "evictions",
        "loop",
        "paper_loop",
        "finished",
        "seconds",
        "kv_bytes",
        "kv_bytes_full",
    } <= set(r0)
    assert r0["gold"] == "0" and r0["evictions"] > 0 and r0["new_tokens"] == 30

    # interrupt during the 3rd batch (Ctrl-C), then a kill -9 in the middle of writing a record
    real, calls = vase.harness.generation.generate, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(vase.harness.generation, "generate", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, run_dir, batch_size=3, progress=False, lm=lm)
    monkeypatch.setattr(vase.harness.generation, "generate", real)
    path = run_dir / "records.jsonl"
    assert len(read_records(path)) == 6  # two batches of 3 survived
    with path.open("a") as fh:
        fh.write('{"task": "half a rec')  # torn write
    run_sweep(cfg, run_dir, batch_size=3, progress=False, lm=lm)
    got = read_records(path)
    keys = [record_key(r) for r in got]
    assert len(keys) == len(set(keys)) == len(ref)
    assert set(keys) == {record_key(r) for r in ref}
    by_key = {record_key(r): r["text"] for r in ref}
    assert all(by_key[record_key(r)] == r["text"] for r in got)  # greedy: identical completions


def test_refuses_another_configuration(tmp_path, task_file):
    lm = tiny_lm()
    run_sweep(config_for(task_file, seeds=[0], policies=["streaming_llm"]), tmp_path / "r", progress=False, lm=lm)
    with pytest.raises(ValueError, match=r"another configuration \(max_new_tokens: 30 there, 40 now\).*--out"):
        run_sweep(
            config_for(task_file, seeds=[0], policies=["streaming_llm"], max_new_tokens=40),
            tmp_path / "r",
            progress=False,
            lm=lm,
        )


def test_shards_and_merge(tmp_path, task_file):
    lm = tiny_lm()
    cfg = config_for(task_file, seeds=[0], policies=["streaming_llm", "snapkv"])
    run_sweep(cfg, tmp_path / "a", shard=(0, 2), progress=False, lm=lm)
    run_sweep(cfg, tmp_path / "b", shard=(1, 2), progress=False, lm=lm)
    a = read_records(tmp_path / "a" / "records.shard-0-of-2.jsonl")
    b = read_records(tmp_path / "b" / "records.shard-1-of-2.jsonl")
    assert len(a) == len(b) == 5 and not ({record_key(r) for r in a} & {record_key(r) for r in b})
    n, missing = merge(tmp_path / "all", [tmp_path / "a", tmp_path / "b"])
    assert n == 10 and missing == 0
    assert len(read_records(tmp_path / "all" / "records.jsonl")) == 10


def test_bad_task_files(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("question,answer\n1,2\n")
    with pytest.raises(DataError, match="unknown file format .csv"):
        load_problems(str(csv))
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"question": "q", "solution": "s"}) + "\n")
    with pytest.raises(DataError, match="no answer field 'answer'.*fields: question, solution.*--answer-field"):
        load_problems(str(f))
    assert load_problems(str(f), answer_field="solution")[0].answer == "s"
    g = tmp_path / "mcq.jsonl"
    g.write_text(json.dumps({"question": "Pick (A) 1 (B) 2", "answer": "B"}) + "\n")
    assert load_problems(str(g))[0].kind == "mcq"


def test_pass_at_1_and_standard_error():
    recs = []
    for pid, outcomes in {"a": [1, 1], "b": [1, 0], "c": [0, 0]}.items():
        for seed, ok in enumerate(outcomes):
            recs.append(
                dict(
                    task="t",
                    problem_id=pid,
                    policy="vase",
                    budget=64,
                    ratio=None,
                    seed=seed,
                    correct=ok,
                    loop=seed == 0 and pid == "c",
                    new_tokens=100,
                    kv_bytes=10,
                    kv_bytes_full=40,
                )
            )
    (row,) = summarize(recs)
    assert row["pass1"] == pytest.approx(50.0)
    assert row["se"] == pytest.approx(100 * 0.5 / 3**0.5)  # stdev([1, .5, 0]) / sqrt(3)
    assert row["loop_rate"] == pytest.approx(100 / 6) and row["problems"] == 3


def test_fidelity_exact_when_budget_covers_everything():
    model = tiny_model("llama")
    ids = random_ids(90)
    prompt, cont = ids[0, :20], ids[0, 20:]
    ref = replay(model, prompt, cont, "full", 200, 8)
    for policy in ("vase", "snapkv", "streaming_llm"):
        res = compare(ref, replay(model, prompt, cont, policy, 200, 8), cont, bucket=32)
        assert res["kl_mean"] == 0.0 and res["top1"] == 1.0 and res["ppl_change"] == 0.0
        assert [b["start"] for b in res["buckets"]] == [0, 32, 64]
    small = compare(ref, replay(model, prompt, cont, "vase", 24, 8), cont, bucket=32)
    assert small["kl_mean"] > 0


def test_fidelity_sources_are_extended_and_survive_an_interrupt(task_file, tmp_path, monkeypatch):
    """Task sources (the model's own reasoning, about a minute each on the embedded model) are written as each is
    generated, and a folder of 2 run with 3 prompts generates only the third, keeping the first two as they were."""
    from vase.harness.fidelity import FidelityConfig, run_fidelity
    from vase.harness.traces import SOURCES_FILE, build_sources

    lm = tiny_lm()
    calls = []
    real = vase.harness.generation.generate

    def counting(*args, **kw):
        calls.append(args[2])
        if boom and len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    boom = True
    monkeypatch.setattr(vase.harness.generation, "generate", counting)
    cfg = FidelityConfig(model="tiny", source=str(task_file), policies=["vase"], prompts=2, tokens=30, ratios=[2.0])
    path = tmp_path / SOURCES_FILE
    with pytest.raises(KeyboardInterrupt):
        build_sources(cfg, lm, progress=False, path=path)
    first = read_records(path)
    assert [s["id"] for s in first] == ["mini:q0"] and len(first[0]["continuation"]) == 30

    boom = False
    out = tmp_path / "run"
    out.mkdir()
    path.rename(out / SOURCES_FILE)
    calls.clear()
    run_fidelity(cfg, out, progress=False, lm=lm)
    assert len(calls) == 1 and "1 plus 1" in calls[0]  # only the missing second source
    two = read_records(out / SOURCES_FILE)
    assert two[0] == first[0] and [s["id"] for s in two] == ["mini:q0", "mini:q1"]

    cfg3 = cfg.model_copy(update={"prompts": 3})
    calls.clear()
    three = build_sources(cfg3, lm, progress=False, path=out / SOURCES_FILE)
    assert len(calls) == 1 and [s["id"] for s in three] == ["mini:q0", "mini:q1", "mini:q2"]
    assert three[:2] == two and read_records(out / SOURCES_FILE) == three
    assert not (out / (SOURCES_FILE + ".tmp")).exists()

    longer = cfg3.model_copy(update={"tokens": 31})  # traces of another length are not reused
    calls.clear()
    assert [len(s["continuation"]) for s in build_sources(longer, lm, progress=False, path=out / SOURCES_FILE)] == [
        31
    ] * 3
    assert len(calls) == 3


def test_fidelity_progress_counts_only_this_runs_replays(task_file, tmp_path, monkeypatch):
    """A folder whose records hold other policies (copied in to reuse them) shows this run's replays only: total =
    sources x sizes x policies, started at those already recorded (it used to count every record of the file)."""
    import tqdm.auto

    from vase.harness.fidelity import FidelityConfig, run_fidelity

    bars = []

    class Bar:
        def __init__(self, *args, desc="", total=None, initial=0, **kw):
            self.items, self.desc, self.total, self.initial, self.n = args[:1], desc, total, initial, initial
            bars.append(self)

        def __iter__(self):  # the reference-trace bar wraps its list
            return iter(self.items[0])

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    lm = tiny_lm()
    cfg = FidelityConfig(
        model="tiny", source=str(task_file), policies=["vase", "h2o"], prompts=2, tokens=24, ratios=[2.0, 4.0], buffer=8
    )
    out = tmp_path / "run"
    run_fidelity(cfg, out, progress=True, lm=lm)
    more = tmp_path / "more"  # a new folder starting from the first one's traces and records (RESULTS.md does so)
    more.mkdir()
    for name in ("sources.jsonl", "fidelity.jsonl"):
        (more / name).write_bytes((out / name).read_bytes())
    run_fidelity(cfg.model_copy(update={"policies": ["h2o", "snapkv"]}), more, progress=True, lm=lm)
    runs = [(b.total, b.initial, b.n) for b in bars if b.desc == "fidelity"]
    assert runs == [(8, 0, 8), (8, 4, 8)]  # the second: h2o's 4 replays recorded, snapkv's 4 to run
    recs = read_records(more / "fidelity.jsonl")
    assert len(recs) == 12 and sum(r["policy"] == "snapkv" for r in recs) == 4


def test_chunked_replay_equals_token_by_token_decode():
    """Chunks ending at eviction points reproduce decoding one token at a time."""
    import vase

    model = tiny_model("qwen3")
    ids = random_ids(100, seed=4)
    prompt, cont = ids[0, :15], ids[0, 15:]
    for policy in ("vase", "h2o", "rkv"):
        fast = replay(model, prompt, cont, policy, 24, 8)
        cache = vase.EvictingCache(model, policy=policy, budget=24, buffer=8)
        slow = []
        with torch.no_grad():
            logits = model(input_ids=prompt.view(1, -1), **cache_kwargs(cache)).logits[0, -1:]
            slow.append(torch.log_softmax(logits.float(), -1))
            for t in cont[:-1]:
                slow.append(
                    torch.log_softmax(model(input_ids=t.view(1, 1), **cache_kwargs(cache)).logits[0].float(), -1)
                )
        assert torch.allclose(fast, torch.cat(slow), atol=1e-4)
        assert cache.stats().evictions == 9  # first at 15 + 17 = 32 = budget + buffer, then every 8 tokens


def test_replay_chunks_follow_the_cache_schedule():
    """The replay asks the cache where the next eviction is: a dense prompt longer than the budget first evicts at
    the first multiple of the buffer above it (the reference schedule), a compressed one at budget + buffer."""
    import vase

    model = tiny_model("llama")
    with torch.no_grad():
        # (compress, prompt, fill after prefill, fill at the first eviction)
        for compress, prompt_len, fill, limit in (
            (True, 40, 24, 32),
            (True, 30, 30, 32),
            (False, 40, 40, 48),
            (False, 30, 30, 32),
            (False, 10, 10, 32),
        ):
            cache = vase.EvictingCache(model, policy="vase", budget=24, buffer=8, compress_prompt=compress)
            model(input_ids=random_ids(prompt_len), **cache_kwargs(cache))
            assert cache.fill == [fill] and cache.fill[0] + cache.room()[0] == limit


LOOP_TEXT = "So the answer is 18. " + "Let me check the eggs again: 16 - 7 = 9 eggs are left.\n" * 4 + "Let me"
PROSE_TEXT = "We need to find the eggs sold. We need to subtract 3 and 4 from 16, and we need to multiply by 2. So"


def eval_record(policy="vase", pid="a", correct=False, text=PROSE_TEXT, finished=False, **kw):
    rec = dict(
        task="gsm8k",
        problem_id=pid,
        policy=policy,
        budget=128,
        ratio=None,
        seed=0,
        correct=correct,
        loop=False,
        new_tokens=50,
        kv_bytes=2**20,
        kv_bytes_full=4 * 2**20,
        text=text,
        finished=finished,
    )
    rec.update(kw)
    return rec


def test_loop_flags_are_recomputed_from_the_text():
    """Stored flags are ignored when the text is there (records of an older detector report the current one)."""
    recs = [
        eval_record(pid="a", text=LOOP_TEXT, loop=False),  # cut at the limit while looping: a loop
        eval_record(pid="b", text=LOOP_TEXT, finished=True, loop=True),  # ended by itself: not a loop
        eval_record(pid="c", text=PROSE_TEXT, loop=True),  # prose cut at the limit (the old flag said loop)
        eval_record(pid="d", text="The answer is 18. " * 5, finished=True),  # paper regex: fires, finished or not
    ]
    (row,) = summarize(recs)
    assert row["loop_rate"] == 25.0
    assert row["paper_loop_rate"] == 25.0
    assert row["limit_rate"] == 50.0
    # without text: the stored flags; no paper flag stored -> no paper rate
    bare = [{k: v for k, v in r.items() if k not in ("text", "finished")} for r in recs]
    (row,) = summarize(bare)
    assert row["loop_rate"] == 50.0 and row["paper_loop_rate"] is None and row["limit_rate"] is None
    (row,) = summarize([dict(r, paper_loop=i == 0) for i, r in enumerate(bare)])
    assert row["paper_loop_rate"] == 25.0


def test_report_on_fixture(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    recs = []
    for policy, acc in (("full", [1, 1, 0]), ("vase", [1, 0, 0])):
        for pid, ok in zip("abc", acc):
            # the full cache's buffers grow in steps: it holds more than the dense bytes, and is still 1.00x
            held = 5 * 2**20 if policy == "full" else 2**20
            text = LOOP_TEXT if (policy, pid) == ("vase", "c") else PROSE_TEXT
            recs.append(eval_record(policy, pid, bool(ok), text=text, kv_bytes=held))
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fid = []
    for policy, kl in (("full", 0.0), ("vase", 0.01), ("snapkv", 0.02)):
        for ratio in (2.0, 4.0):
            fid.append(
                dict(
                    source="s1",
                    policy=policy,
                    budget=100,
                    ratio=ratio,
                    compression=ratio,
                    tokens=64,
                    kl_mean=kl * ratio,
                    top1=1 - kl,
                    ppl_change=kl,
                    buckets=[{"start": 0, "end": 64, "kl": kl * ratio, "top1": 1 - kl}],
                )
            )
    (run / "fidelity.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fid))
    text = write_report(run, tmp_path / "out").read_text()
    printed = eval_summary(recs)  # what `vase eval` prints at its end: the same rows
    assert "| vase | budget 128 | 4.00x | 33.3 ± 33.3 | 33.3 ± 33.3 | 0.0 | 100.0 | 50 | 1.00 | 4.00 | 3 |" in printed
    assert "| full | budget 128 | 1.00x | 66.7 ± 33.3 | 0.0 ± 0.0 | 0.0 | 100.0 | 50 | 5.00 | 4.00 | 3 |" in text
    assert "| vase | budget 128 | 4.00x | 33.3 ± 33.3 | 33.3 ± 33.3 | 0.0 | 100.0 | 50 | 1.00 | 4.00 | 3 |" in text
    # one source: no standard error, so no best policy is named (tests/harness/test_report.py has the sentences with
    # errors)
    assert "- 2x (budget 100): lowest mean KL vase (0.0200), then snapkv (0.0400); under 2 sources in common" in text
    assert (tmp_path / "out" / "eval_gsm8k.png").stat().st_size > 1000
    assert (tmp_path / "out" / "fidelity.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="holds no records"):
        write_report(tmp_path / "out", tmp_path / "out")


def test_report_axes_one_compression_and_no_degenerate_ranges():
    """The plot's x for each policy is the table's compression (full at exactly 1); percentages span 0-100 even when
    every value is equal (no -0.04..0.04 pass@1 axis)."""
    import matplotlib.pyplot as plt

    from vase.harness.plots import PERCENT_LIMITS, _flat_axis, eval_figure
    from vase.harness.ranking import compression

    recs = [eval_record("full", p, kv_bytes=5 * 2**20) for p in "ab"]
    recs += [eval_record("vase", p, kv_bytes=2**20, budget=b) for p in "ab" for b in (128, 256)]
    recs += [eval_record("vase", p, kv_bytes=2 * 2**20, budget=256) for p in "ab"]
    rows = summarize(recs)
    assert [compression(r) for r in rows] == [1.0, 4.0, 8 / 3]  # budget 256: mean held 1.5 MiB
    fig = eval_figure(rows, "gsm8k")
    acc, loops = fig.axes
    for ax in (acc, loops):
        assert ax.get_ylim() == PERCENT_LIMITS  # all pass@1 and loop rates are 0
        assert ax.get_xlim() == (0.0, 4.4)  # 0 to 1.1 x the largest compression
    # each policy is an error bar container (standard error over problems), its x the table's compression
    lines = {c.get_label(): list(c.lines[0].get_xdata()) for c in loops.containers}
    assert lines == {"full": [1.0], "vase": [8 / 3, 4.0]}
    plt.close(fig)

    fig, ax = plt.subplots()
    ax.plot([1, 2], [100.0, 100.0])
    _flat_axis(ax, [100.0, 100.0], lo=0.0, hi=100.0)  # e.g. top-1 agreement 100% everywhere
    assert ax.get_ylim() == (98.0, 100.0)
    _flat_axis(ax, [0.5, 0.5])
    assert ax.get_ylim() == (-0.5, 1.5)
    plt.close(fig)


def test_inspect_writes_under_runs_by_default():
    """`vase inspect` without --out writes into runs/inspect (ignored by git), not ./inspect of the working folder."""
    import inspect as pyinspect
    from pathlib import Path

    from vase import cli

    assert pyinspect.signature(cli.inspect).parameters["out"].default.default == Path("runs/inspect")


def test_magnitude_table_finds_the_outlier():
    torch.manual_seed(0)
    values = [torch.randn(2, 40, 16) for _ in range(3)]
    keys = [torch.randn(2, 40, 16) for _ in range(3)]
    values[1][1, 17] *= 12
    rows = magnitude_table(keys, values, top=3)
    worst = max(rows, key=lambda r: r["v_range_max_over_median"])
    assert (worst["layer"], worst["head"], worst["top_positions"][0]) == (1, 1, 17)
    assert worst["v_range_max_over_median"] > 8


def test_eval_command_prints_its_accuracy_table(tmp_path, task_file, monkeypatch):
    """`vase eval` ends with the table `vase report` opens with for its folder, holding the run's own numbers, then
    where the records are."""
    from typer.testing import CliRunner

    from vase.cli import app

    monkeypatch.setattr("vase.hf.models.load_model", lambda *a, **k: tiny_lm())
    out = tmp_path / "run"
    args = ["eval", "--out", str(out), "--tasks", str(task_file), "--policies", "full,streaming_llm"]
    res = CliRunner().invoke(app, args + ["--budgets", "24", "--buffer", "8", "-n", "12", "--greedy", "--limit", "3"])
    assert res.exit_code == 0, res.output
    recs = read_records(out / "records.jsonl")
    assert len(recs) == 6 and {r["new_tokens"] for r in recs} == {12}
    printed = res.stdout.strip().splitlines()
    assert printed[0] == "### mini: accuracy (3 problems)"
    rows = {line.split(" | ")[0]: line for line in printed if line.startswith("| full |") or "streaming_llm" in line}
    assert len(rows) == 2
    for policy, row in rows.items():
        mine = [r for r in recs if f"| {r['policy']}" == policy]
        held, full = (sum(r[k] for r in mine) / len(mine) for k in ("kv_bytes", "kv_bytes_full"))
        ratio = 1.0 if policy == "| full" else full / held
        assert f"| budget 24 | {ratio:.2f}x | {100 * sum(r['correct'] for r in mine) / 3:.1f} ± " in row
        assert f"| {held / 2**20:.2f} | {full / 2**20:.2f} |" in row
        assert row.endswith("| 3 |")  # completions
    report = write_report(out, tmp_path / "report").read_text()
    assert "\n".join(printed[:-1]) in report, "the same table as the report's"
    assert printed[-1] == f"[vase] records in {out / 'records.jsonl'}; notes and plots: vase report {out}"
