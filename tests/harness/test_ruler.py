"""The synthetic long-context tasks (vase.harness.ruler): names, generators, fitting, grading, the decode-heavy
follow-up question, and a small `vase eval` run on them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from vase.harness import ruler
from vase.harness.data import DataError
from vase.harness.evaluate import EvalConfig, read_records, run_sweep, task_problems
from vase.harness.generation import encode_prompts, generate
from vase.hf.compat import cache_kwargs


def test_task_names_and_lengths():
    t = ruler.parse_task("ruler:niah_single@4k")
    assert (t.name, t.length, t.label, t.answer_tokens, t.decode_heavy) == ("niah_single", 4096, t.label, 48, False)
    assert ruler.parse_task("ruler:vt@2048").length == 2048
    assert ruler.parse_task("ruler:niah_decode@1K").label == "ruler:niah_decode@1k"
    assert ruler.parse_task("ruler:niah_decode@1k").decode_heavy
    assert EvalConfig(tasks=["ruler:cwe@2K"], policies=["full"], budgets=[64]).tasks == ["ruler:cwe@2k"]
    with pytest.raises(DataError, match="unknown long-context task 'needle'.*niah_single"):
        ruler.parse_task("ruler:needle@4k")
    with pytest.raises(DataError, match="give the context length after '@'"):
        ruler.parse_task("ruler:vt")
    with pytest.raises(DataError, match="at least 256 tokens"):
        ruler.parse_task("ruler:vt@100")
    with pytest.raises(DataError, match="9216 tokens is longer than the model's 8192"):
        ruler.parse_task("ruler:vt@9k", context=8192)
    ruler.parse_task("ruler:niah_single@7k", context=8192, written=2048)  # written tokens count for niah_decode only
    with pytest.raises(DataError, match="7168 tokens plus 2048 written tokens is longer than the model's 8192"):
        ruler.parse_task("ruler:niah_decode@7k", context=8192, written=2048)


def test_grading_counts_whole_values():
    assert ruler.score("the number is 7463343.", ["7463343"]) == 1.0
    assert ruler.score("the number is 17463343.", ["7463343"]) == 0.0  # a longer number is another number
    assert ruler.score("the number is 746334.", ["7463343"]) == 0.0
    assert ruler.score("ABCDE and FGHIJ", ["abcde", "FGHIJ", "KLMNO", "PQRST"]) == 0.5
    assert ruler.grade("They are: gulu, repe and kita.", "gulu | repe | kita") == ("gulu | repe | kita", True)
    assert ruler.grade("They are: gulu and kita.", "gulu | repe | kita") == ("gulu | kita", False)
    from vase.harness.grading import grade

    assert grade("is 5531997.", "5531997", "ruler") == ("5531997", True)
    assert grade("is 5531.", "5531997", "ruler") == ("", False)


def test_problems_fit_their_length_and_hold_their_needles(embedded):
    tok = embedded.tokenizer
    for name in ruler.TASKS:
        label = f"ruler:{name}@512"
        problems = ruler.problems(label, tok, count=3, context=8192)
        assert [p.id for p in problems] == ["0", "1", "2"] and {p.task for p in problems} == {label}
        assert problems == ruler.problems(label, tok, count=3), "generated from the task and the index alone"
        task = ruler.parse_task(label)
        for p in problems:
            n = ruler.prompt_tokens(tok, p.prompt())
            units = p.meta["units"]
            room = task.answer_tokens + (ruler.QUESTION_TOKENS if task.decode_heavy else 0)
            assert n <= task.length - room, "the prompt and its answer (and question) fit in the length"
            bigger = ruler._Builder(task, int(p.id)).build(units + 1)[0]
            assert ruler.prompt_tokens(tok, bigger) > task.length - room, "the largest haystack"
            refs = ruler.references(p.answer)
            assert refs and all(ruler.score(p.question, [r]) == 1.0 for r in refs), "every value is in the text"
            assert ruler.score(p.question.split("Question:")[-1], refs) < 1 or name.startswith("niah"), name


def test_needles_sit_at_their_depths(embedded):
    problems = ruler.problems("ruler:niah_single@1k", embedded.tokenizer, count=11)
    for p in problems:
        (depth,) = p.meta["depths"]
        assert depth == pytest.approx(int(p.id) / 10)
        needle = f"One of the special magic numbers for {p.meta['key']} is: {p.answer}. "
        assert ruler.needle_depth(p.question, needle) == pytest.approx(depth, abs=1 / p.meta["units"])
    multi = ruler.problems("ruler:niah_multivalue@1k", embedded.tokenizer, count=2)
    for p in multi:
        key = re.search(r"numbers for (\w+) mentioned", p.question).group(1)
        for value, depth in zip(ruler.references(p.answer), p.meta["depths"]):
            needle = f"One of the special magic numbers for {key} is: {value}. "
            assert ruler.needle_depth(p.question, needle) == pytest.approx(depth, abs=1.5 / p.meta["units"])


def test_word_tasks_count_what_they_ask(embedded):
    (cwe,) = ruler.problems("ruler:cwe@1k", embedded.tokenizer, count=1)
    words = re.findall(r"\d+\. (\w+)", cwe.question)
    counts = {w: words.count(w) for w in set(words)}
    common = ruler.references(cwe.answer)
    assert len(common) == 10 and all(counts[w] == cwe.meta["each"] > 2 for w in common)
    assert all(c == 2 for w, c in counts.items() if w not in common)
    (fwe,) = ruler.problems("ruler:fwe@1k", embedded.tokenizer, count=1)
    coded = fwe.question.split("\n")[1].split()
    top = ruler.references(fwe.answer)
    freq = sorted(((coded.count(w), w) for w in set(coded)), reverse=True)
    assert [coded.count(w) for w in top] == fwe.meta["counts"] == [c for c, _ in freq[:3]]
    (vt,) = ruler.problems("ruler:vt@1k", embedded.tokenizer, count=1)
    names = ruler.references(vt.answer)
    value = re.search(r"VAR \w+ = (\d+)\.", vt.question).group(1)
    assert f"VAR {names[0]} = {value}." in vt.question
    assert all(f"VAR {b} = VAR {a}." in vt.question for a, b in zip(names, names[1:]))


@pytest.mark.parametrize("length", ["256", "512", "1k"])
def test_frequent_words_have_no_ties(embedded, length):
    """The three answer words of `fwe` have strictly decreasing counts in the coded text, each above every other
    word's: with a tie, another word would be as right as the reference (at 256 tokens, 6 of 20 problems had one)."""
    problems = ruler.problems(f"ruler:fwe@{length}", embedded.tokenizer, count=20)
    for p in problems:
        coded = re.search(r"coded words\.\n(.*)\nQuestion:", p.question).group(1).split()
        top = ruler.references(p.answer)
        counts = [coded.count(w) for w in top]
        others = [coded.count(w) for w in set(coded) - set(top)]
        assert len(top) == 3 and counts[0] > counts[1] > counts[2] > max(others, default=0) >= 0, (p.id, counts)
    assert problems == ruler.problems(f"ruler:fwe@{length}", embedded.tokenizer, count=20), "the same every run"


def test_frequent_word_ties_are_broken_by_recoding():
    """Ties among the top words are broken by recoding other words into the answer words (same length); with too few
    other words, the missing occurrences are inserted."""
    import random

    vocab = ["a", "b", "c", "d", "e"]
    draws = ["a"] * 6 + ["b"] * 3 + ["c"] * 3 + ["d"] * 3 + ["e"] * 2
    ruler._strict_top(draws, vocab, random.Random(0))
    counts = [draws.count(w) for w in vocab]
    assert len(draws) == 17 and counts[:3] == [6, 5, 4] and counts[3] + counts[4] == 2, counts
    draws = ["a"] * 20 + ["b"] * 10
    ruler._strict_top(draws, vocab, random.Random(0))
    assert len(draws) == 31 and [draws.count(w) for w in vocab] == [20, 10, 1, 0, 0]


def test_follow_up_question_continues_the_cache(embedded):
    """Written then asked on one cache: with a budget that never evicts, the answers equal plain transformers doing
    the same two turns on a DynamicCache; a row's answer is the same in a batch (questions of other lengths) and
    alone."""
    from transformers import DynamicCache

    model, tok = embedded.model, embedded.tokenizer
    prompts = ["Remember the number 4831138. Now write a poem about the sea.", "Remember 77. Write about a cat."]
    asks = ["What was the number I asked you to remember?", "Which number was it? Answer with the number only."]
    res = generate(model, tok, prompts, policy="vase", budget=1024, max_new_tokens=24, follow_up=asks)
    assert [c.written_tokens for c in res.completions] == [24, 24] and res.stats.evictions == 0
    enc = encode_prompts(tok, prompts)
    cache = DynamicCache()
    with torch.inference_mode():
        first = model.generate(
            **enc, min_new_tokens=24, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
            **cache_kwargs(cache), pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        from vase.harness.generation import _follow_up_ids

        ids, mask = _follow_up_ids(tok, asks, chat=True)
        full = torch.cat([first.sequences, ids], 1)
        mask = torch.cat([enc["attention_mask"], torch.ones(2, 24, dtype=mask.dtype), mask], 1)
        second = model.generate(
            input_ids=full, attention_mask=mask, **cache_kwargs(cache), max_new_tokens=64,
            do_sample=False, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    for row, comp in enumerate(res.completions):
        assert comp.written == tok.decode(first.sequences[row, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        want = second[row, full.shape[1] :].tolist()
        assert comp.token_ids == want[: len(comp.token_ids)] and comp.text.strip()
        alone = generate(
            model, tok, [prompts[row]], policy="vase", budget=1024, max_new_tokens=24, follow_up=[asks[row]]
        )
        assert alone.completions[0].token_ids == comp.token_ids
    with pytest.raises(ValueError, match="one non-empty follow-up question per prompt"):
        generate(model, tok, prompts, max_new_tokens=4, follow_up=["only one"])


def test_sweep_on_synthetic_tasks(embedded, tmp_path):
    """`vase eval` on two synthetic tasks: records with scores and needle depths, the decode-heavy task's written
    tokens, resume without work, and the report's table."""
    cfg = EvalConfig(
        tasks=["ruler:niah_single@300", "ruler:niah_decode@300"],
        policies=["full", "vase"],
        ratios=[2.0],
        limit=2,
        max_new_tokens=64,
        temperature=0.0,
        buffer=16,
    )
    out = tmp_path / "ruler"
    recs = read_records(run_sweep(cfg, out, batch_size=2, progress=False, lm=embedded))
    assert len(recs) == 8 and {r["task"] for r in recs} == set(cfg.tasks)
    for r in recs:
        assert r["score"] == (1.0 if r["correct"] else r["score"]) and 0 <= r["score"] <= 1
        assert r["meta"]["depths"] == [int(r["problem_id"]) / 10] and "ask" not in r["meta"]
        assert r["new_tokens"] <= ruler.parse_task(r["task"]).answer_tokens
        decode = r["task"].startswith("ruler:niah_decode")
        assert (r.get("written_tokens") == 64) == decode
        if r["policy"] == "vase" and decode:
            assert r["evictions"] > 0, "the decode-heavy task evicts while the model writes"
    full = [r for r in recs if r["policy"] == "full"]
    assert sum(r["correct"] for r in full) >= 3, "the full cache finds the needle of these short tasks"
    assert run_sweep(cfg, out, batch_size=2, progress=False, lm=embedded).read_text().count("\n") == 8
    placeholders = task_problems(cfg)
    assert [p.id for p in placeholders["ruler:niah_decode@300"]] == ["0", "1"]
    report = subprocess.run(
        [sys.executable, "-m", "vase.cli", "report", str(out)], capture_output=True, text=True, timeout=300
    )
    assert report.returncode == 0, report.stderr
    text = (out / "REPORT.md").read_text()
    assert "ruler:niah_single@300" in text and "eval_ruler_niah_single_300.png" in text
    assert "### Long-context tasks: score (%)" in text
    assert "| ruler:niah_decode@300 | ruler:niah_single@300 | mean |" in text
    assert (out / "eval_ruler_niah_single_300.png").exists()
    json.loads((out / "config.json").read_text())


def test_cli_refuses_bad_synthetic_tasks(tmp_path):
    for tasks, message in (
        ("ruler:needle@4k", "unknown long-context task 'needle'"),
        ("ruler:niah_single@9k", "longer than the model's 8192"),
        ("ruler:niah_decode@7k", "plus 2048 written tokens"),
    ):
        run = subprocess.run(
            [sys.executable, "-m", "vase.cli", "eval", "--out", str(tmp_path / "x"), "--tasks", tasks]
            + ["--policies", "full", "--budgets", "256", "-n", "2048"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode != 0 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert not (tmp_path / "x").exists()


def test_scores_in_the_summary_and_the_table():
    """Scores are means over problems of each problem's mean score, with their standard error; a table row per
    policy and size, a column per task, the mean over tasks."""
    from vase.harness.evaluate import summarize
    from vase.harness.report import scores_table

    def rec(task, pid, policy, score, seed=0):
        return dict(
            task=task, problem_id=pid, policy=policy, budget=100, ratio=4.0, seed=seed, correct=score == 1,
            loop=False, paper_loop=False, new_tokens=5, finished=True, kv_bytes=1, kv_bytes_full=4, score=score,
        )  # fmt: skip

    recs = [rec("ruler:a@1k", "0", "vase", 1.0), rec("ruler:a@1k", "0", "vase", 0.5, seed=1)]
    recs += [rec("ruler:a@1k", "1", "vase", 0.0), rec("ruler:b@1k", "0", "vase", 0.25)]
    rows = {r["task"]: r for r in summarize(recs)}
    assert rows["ruler:a@1k"]["score"] == pytest.approx(100 * (0.75 + 0.0) / 2)
    assert rows["ruler:a@1k"]["score_se"] == pytest.approx(100 * 0.75 / 2**0.5 / 2**0.5)
    assert rows["ruler:a@1k"]["pass1"] == pytest.approx(25.0)
    table = scores_table(list(rows.values()))
    assert table[2] == "| policy | cache size | ruler:a@1k | ruler:b@1k | mean |"
    assert table[4].startswith("| vase | 4x | 37.5 ± 37.5 | 25.0 | 31.2 |")
    plain = [dict(r, score=None) for r in recs]
    assert summarize(plain)[0]["score"] is None and scores_table(summarize(plain)) == []
