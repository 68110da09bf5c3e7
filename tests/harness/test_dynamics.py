"""Kept-set dynamics during free generation (``vase eval --kept-dynamics``): the overlap of consecutive kept sets on
hand-made caches, where a loop begins, the report's quantities on hand-made records, and one small sweep."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import tiny_lm
from vase.harness.dynamics import KeptDynamics, aligned_overlap, fixed_point_rows, loop_onset, record_fields
from vase.harness.evaluate import EvalConfig, read_records, run_sweep
from vase.harness.report import write_report


def fake_cache(held: list[list[int]], seen: int, evictions: int, prompt: int = 2, slots: int = 6):
    """A one-row, one-layer cache whose KV heads hold the positions ``held`` (one list per head)."""
    pos = torch.full((1, len(held), slots), -1, dtype=torch.long)
    for h, ps in enumerate(held):
        pos[0, h, : len(ps)] = torch.tensor(ps)
    schedule = SimpleNamespace(evictions=[evictions], seen=[seen], prompt=[prompt])
    return SimpleNamespace(
        batch=1, evicting=[0], layers=[SimpleNamespace(positions=pos)], seq=SimpleNamespace(schedule=schedule)
    )


def test_overlap_of_consecutive_kept_sets_on_hand_made_caches():
    watch = KeptDynamics(sinks=1, recent=2)
    # eviction 1 at 10 tokens seen: chosen (not a sink, not among the 2 newest) = head 0 {3, 4, 5}, head 1 {1, 2, 6}
    watch(fake_cache([[0, 3, 4, 5, 8, 9], [0, 1, 2, 6, 8, 9]], seen=10, evictions=1))
    assert watch.rows == [[]]
    watch(fake_cache([[0, 3, 4, 5, 8, 9], [0, 1, 2, 6, 8, 9]], seen=11, evictions=1))  # no new eviction: nothing read
    assert watch.rows == [[]]
    # eviction 2 at 14: head 0 keeps 3 and 4 of {3, 4, 5} (2/3), head 1 all of {1, 2, 6}
    watch(fake_cache([[0, 3, 4, 9, 12, 13], [0, 1, 2, 6, 12, 13]], seen=14, evictions=2))
    (entry,) = watch.rows[0]
    assert entry[0] == 12  # new tokens: 14 seen - 2 of prompt
    assert entry[1] == pytest.approx((2 / 3 + 1) / 2)
    assert entry[2] == pytest.approx(0.5)  # one of two heads kept all it chose
    # eviction 3 at 18: head 0 chose {3, 4, 9} (12, 13 were the recent window), keeps none; head 1 chose {1, 2, 6},
    # keeps 1 and 2
    watch(fake_cache([[0, 14, 15, 16, 17], [0, 1, 2, 15, 16, 17]], seen=18, evictions=3))
    assert watch.rows[0][1] == [16, pytest.approx((0 + 2 / 3) / 2), 0.0]


def test_a_head_that_chose_nothing_is_left_out_of_the_mean():
    watch = KeptDynamics(sinks=1, recent=4)
    watch(fake_cache([[0, 6, 7, 8, 9], [0, 3, 7, 8, 9]], seen=10, evictions=1))  # head 0 chose nothing, head 1 {3}
    watch(fake_cache([[0, 6, 7, 8, 9], [0, 3, 7, 8, 9]], seen=14, evictions=2))
    assert watch.rows[0] == [[12, 1.0, 1.0]]
    watch = KeptDynamics(sinks=1, recent=4)
    watch(fake_cache([[0, 6, 7, 8, 9]], seen=10, evictions=1))
    watch(fake_cache([[0, 10, 11, 12, 13]], seen=14, evictions=2))
    assert math.isnan(watch.rows[0][0][1]) and math.isnan(watch.rows[0][0][2])


class CharTokenizer:
    """One token per character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize(
    "prefix, unit, times",
    [
        ("First we read the question carefully and note the numbers. ", "Then we add the two numbers together. ", 6),
        ("Let us count. ", "Step 1: we add 3 to the total and write it down. ", 5),  # numbers change below
        ("x" * 50 + "\n", "the same words again and again ", 12),
    ],
)
def test_the_loop_onset_is_where_the_first_repetition_starts(prefix, unit, times):
    body = "".join(unit.replace("1", str(i + 1)).replace("3", str(3 * i + 3)) for i in range(times))
    text = prefix + body
    ids = [ord(c) for c in text]
    onset = loop_onset(text, ids, CharTokenizer())
    assert onset is not None and abs(onset - len(prefix)) <= 2  # the run's windows align on the end: a space early
    assert loop_onset(prefix + unit, [ord(c) for c in prefix + unit], CharTokenizer()) is None


def test_a_loop_longer_than_the_tail_read_for_the_flag_is_counted_from_its_start():
    prefix, unit = "We start with a short plan. ", "Add the cost of the apples to the cost of the pears. "
    text = prefix + unit * 120  # 6,360 characters of loop: more than the flag's 4,000
    onset = loop_onset(text, [ord(c) for c in text], CharTokenizer())
    assert abs(onset - len(prefix)) <= 2


def record(policy, loop, onset, entries, ratio=8.0, budget=100, problem="p0"):
    return {
        "task": "t",
        "problem_id": problem,
        "seed": 0,
        "policy": policy,
        "ratio": ratio,
        "budget": budget,
        "loop": loop,
        "loop_onset": onset,
        "kept_overlap": entries,
    }


def test_fixed_point_rows_on_hand_made_records():
    recs = [
        record("a", True, 300, [[100, 0.5, 0.0], [200, 0.9, 0.5], [300, 1.0, 1.0], [400, 1.0, 1.0]]),
        record("a", False, None, [[100, 0.4, 0.0], [200, 0.5, 0.0], [300, 0.6, 0.0], [400, 0.7, 1.0]]),
        record("full", False, None, None),  # no dynamics: not in the table
    ]
    (row,) = fixed_point_rows(recs, window=256)
    assert row["induced"] == 1 and row["induced_before"] == pytest.approx(0.7) and row["induced_after"] == 1.0
    recs[0]["problem_id"] = "p1"  # the full cache looped on p1: not eviction's loop
    recs.append(record("full", True, 100, None, problem="p1"))
    (row,) = fixed_point_rows(recs, window=256)
    assert row["induced"] == 0 and math.isnan(row["induced_before"])
    assert row["completions"] == 2 and row["loops"] == 1 and row["onset_median"] == 300
    assert row["overlap"] == pytest.approx((0.5 + 0.9 + 1 + 1 + 0.4 + 0.5 + 0.6 + 0.7) / 8)
    assert row["settled"] == pytest.approx(3.5 / 8)
    assert row["before"] == pytest.approx(0.7)  # evictions at 44 <= t < 300
    assert row["after"] == pytest.approx(1.0)
    assert row["other_before"] == pytest.approx(0.45) and row["other_after"] == pytest.approx(0.65)
    assert row["settled_before_onset"] == 0.0  # settled at the onset, not before
    assert row["other_settled"] == 1.0
    curves = aligned_overlap(recs, bins=64, span=128)
    starts, means = curves["a @ 8x"]
    assert starts == [-128, -64, 0, 64]
    assert means[0] == 0.9 and math.isnan(means[1]) and means[2:] == [1.0, 1.0]  # 100 before: bin -128


def test_sweep_with_kept_dynamics_records_and_reports(tmp_path):
    task = tmp_path / "mini.jsonl"
    rows = [
        {"question": f"What is {i} plus {i}? " * (1 + i), "answer": f"#### {2 * i}", "id": f"q{i}"} for i in range(3)
    ]
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = EvalConfig(
        model="tiny",
        tasks=[str(task)],
        policies=["full", "snapkv", "snapkv:selector=sample"],
        budgets=[24],
        max_new_tokens=48,
        temperature=0.0,
        buffer=8,
        kept_dynamics=True,
    )
    recs = read_records(run_sweep(config, tmp_path / "run", batch_size=3, progress=False, lm=tiny_lm()))
    full = [r for r in recs if r["policy"] == "full"]
    assert len(recs) == 9 and all(r["kept_overlap"] is None and r["loop_onset"] is None for r in full)
    for r in recs[3:]:
        # the prompts (60 tokens) are compressed at prefill, then every 8 new tokens; the first eviction has no
        # predecessor
        assert r["prompt_tokens"] == 60 and r["evictions"] == 6
        assert [e[0] for e in r["kept_overlap"]] == [8, 16, 24, 32, 40]
        assert (r["loop_onset"] is None) == (not r["loop"])
    # on this random model top-k keeps what it chose every time, sampling by the same score does not
    assert all(e[1:] == [1.0, 1.0] for r in recs[3:6] for e in r["kept_overlap"])
    assert all(0.5 < e[1] < 0.8 and e[2] == 0.0 for r in recs[6:] for e in r["kept_overlap"])
    report = write_report(tmp_path / "run", tmp_path / "rep").read_text()
    assert "## Kept-set dynamics and loops (free generation)" in report
    assert "| mini | snapkv | 24 | 3 | 0 | — | 1.000 |" in report


def test_a_row_that_ended_keeps_only_the_evictions_of_its_own_completion():
    watch = KeptDynamics(sinks=1, recent=2)
    watch.rows = [[[8, 0.5, 0.0], [16, 0.6, 0.0], [24, 0.7, 0.0]]]
    done = SimpleNamespace(text="The answer is 4.", finished=True, new_tokens=16, token_ids=list(range(16)))
    assert record_fields(watch, 0, done, CharTokenizer()) == {
        "kept_overlap": [[8, 0.5, 0.0], [16, 0.6, 0.0]],
        "loop_onset": None,
    }
    assert record_fields(None, 0, done, CharTokenizer()) == {"kept_overlap": None, "loop_onset": None}
    # records written before the cut: the report leaves those evictions out as well
    rec = record("a", False, None, [[8, 0.5, 0.0], [16, 0.6, 0.0], [24, 1.0, 1.0]])
    rec["new_tokens"] = 16
    (row,) = fixed_point_rows([rec])
    assert row["overlap"] == pytest.approx(0.55) and row["other_settled"] == 0.0
