"""Loop detection: labelled loops and natural texts, the paper's regex kept apart, measured error rates on data."""

from __future__ import annotations

import importlib.util
import random
import string
from pathlib import Path

import pytest

from tests.conftest import need_data
from vase.harness.loops import (
    MIN_SPAN,
    MIN_UNIT,
    PAPER_LOOP_PATTERN,
    SHORT_MIN_REPEATS,
    Loop,
    ends_in_loop,
    find_loop,
    loop_flag,
    normalise,
    paper_loop,
)

GSM8K_SOLUTION = (
    "Janet's ducks lay 16 eggs per day. She eats 3 for breakfast and bakes muffins with 4, so she uses "
    "3 + 4 = 7 eggs.\n\nShe has 16 - 7 = 9 eggs left to sell at the farmers' market.\n\n"
    "Each egg sells for $2, so she makes 9 * 2 = $18 every day.\n\n#### 18"
)
POLYGON_SOLUTION = (
    "The sum of the interior angles of a polygon with n sides is 180(n - 2) degrees. A pentagon has n = 5 "
    "sides, so the interior angles add up to 180 * 3 degrees. Multiplying, 180 * 3 = 540.\n\n"
    "Therefore the sum of the interior angles of a pentagon is \\boxed{540}."
)
# Ordinary reasoning prose in which "we need to " occurs 4 times: the old flag called such text a loop.
PROSE = (
    "To solve this, we need to find how many apples are left. First we need to count the apples picked: "
    "12 on Monday and 15 on Tuesday, 27 in all. Then we need to subtract the 8 that were eaten, which leaves "
    "19. Finally we need to share them between 3 friends, so each friend gets 6 and there is 1 left over. "
    "Let me double-check the subtraction: 27 - 8 = 19, and 19 = 3 * 6 + 1, so the division is right. "
    "So the answer is"
)
NOISE = "".join(random.Random(0).choices(string.ascii_letters + " ", k=600))

LOOPING = {
    # units of 5 to 300 characters, verbatim, after a natural prefix, cut inside the next repetition
    "5-char unit": PROSE + " yes," * 40,
    "token loop, whitespace varies": "So the answer is " + "".join(f"the{s}" for s in [" ", "\n", "  ", "\n\n"] * 12),
    "sentence": GSM8K_SOLUTION + "\n\nThe answer is 18.\n\n" * 7 + "The ans",
    "long sentence": POLYGON_SOLUTION + " So the sum of the interior angles of a pentagon is 540 degrees." * 4,
    "paragraph of 300 characters": PROSE
    + (
        " Wait, I should check this again. The apples picked were 12 and 15, so 27 in all, and 8 were eaten, so "
        "19 are left. Shared between 3 friends, each gets 6 and 1 is left over. That matches what I had before, "
        "so I am confident, but let me verify the whole computation once more from the start."
    )
    * 3,
    "numbers change": "Let me list the multiples.\n"
    + "".join(f"Next, {k} times 7 is {7 * k}, which is not the answer.\n" for k in range(3, 12)),
    "numbers change, digits grow": "".join(f"Step {k}: the total is now {k * k} apples.\n" for k in range(1, 15)),
    "numbers only, repeated verbatim": "John runs 60 miles a week.\n\n" + "4200 + 4200 = 8400\n\n" * 9,
    "case and punctuation vary": "Hmm. "
    + "".join(f"{w} me recompute this sum{p} " for w, p in [("Let", "."), ("let", ",")] * 6),
    "loop at the end of unrelated text": NOISE + " I am stuck here, let me think." * 6,
    # the last repetition drifts (another word, another number length): seen in real completions at the limit
    "last repetition drifts": "Janet lays out 16 ducks.\n\n"
    + "The total number of ducks that Janet lays out every day is 16 ducks * 3 days = 48 ducks.\n\n" * 4
    + "The final answer is 16 ducks * 3",
    "numbers change, then the wording": "".join(
        f"So, {k} + {k + 1} = {2 * k + 1} cups of feed.\n" for k in (9, 18, 37, 74, 149)
    )
    + "Therefore, 149 + 150 = 299 cups",
}

NOT_LOOPING = {
    "prose": PROSE,
    "prose cut mid-word": PROSE[:333],
    "gsm8k solution": GSM8K_SOLUTION,
    "polygon solution": POLYGON_SOLUTION,
    "empty": "",
    "blank": "\n\n\n   \n",
    "noise": NOISE,
    # repeated in the middle, then moved on
    "escaped loop": "Hmm. " + "Let me try again.\n\n" * 8 + PROSE + " 6.",
    # a sentence repeated only twice, and a short word a few times
    "twice": PROSE + " Each friend gets 6 apples and there is 1 apple left over." * 2,
    "short repeats": "Yes yes yes yes yes. " + PROSE,
    "below the span": "So: " + "ha, " * 20,
    # tables and lists of different numbers: repetitive structure, not a loop
    "table of numbers": "\\begin{array}{c|ccccc}\n"
    + "".join(f"{i} & {i + 1} & {2 * i} & {i * i} & {3 * i + 1} & {i % 3} \\\\\n" for i in range(1, 8)),
    "primes": "The primes below 100 are 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71",
    "squares": "\\begin{align*}\n" + "".join(f"{k}^2 &= {k * k}, \\\\\n" for k in range(3, 12)),
    # short units a few times: an enumeration whose numbers change, a product of sines (MATH-500), a line of
    # tinyshakespeare cut after its 5th "kill" (4 identical repetitions of ", kill"), alternating punctuation: not
    # identical repetitions, or too few
    "enumeration": "Trying each case in turn: x = 1, x = 2, x = 3, x = 4, x = 5, x = 6, x = 7, x = 8,",
    "product of sines": "We want \\sin 10^\\circ \\sin 20^\\circ \\sin 30^\\circ \\sin 40^\\circ \\sin 50^\\circ "
    "\\sin 60^\\circ \\sin 70^\\circ",
    "Coriolanus": "Insolent villain!\n\nAll Conspirators:\nKill, kill, kill, kill, kill",
    "punctuation alternates": PROSE + " I think so. I think so, I think so. I think so, I think so.",
}

# The constructed set: a short unit repeated only a few times after natural text, cut at the token limit
# (after a copy or inside the next one). The span rule alone needs 120 characters: 10-24 repetitions of these.
SHORT_UNITS = ["so x = 3, ", "\\boxed{7} ", "1+1=2 ", "Wait, ", "I think so. ", "x^2 = 49. "]


@pytest.mark.parametrize("name", LOOPING)
def test_looping(name):
    text = LOOPING[name]
    assert ends_in_loop(text), name
    assert loop_flag(text, finished=False) is True
    assert loop_flag(text, finished=True) is False  # ended by itself: never a loop


@pytest.mark.parametrize("unit", SHORT_UNITS)
@pytest.mark.parametrize("repeats", [6, 10])
@pytest.mark.parametrize("prefix", [GSM8K_SOLUTION, PROSE, GSM8K_SOLUTION + "\n\n", PROSE + " "])
def test_short_unit_few_repeats(unit, repeats, prefix):
    """A short unit (5-15 characters) repeated 6 or 10 times at the end is a loop, cut anywhere in the next one."""
    for cut in range(len(unit)):
        text = prefix + unit * repeats + unit[:cut]
        loop = find_loop(text)
        assert loop is not None, (unit, repeats, cut)
        # the first copy counts when the text before it ends as the unit does (here in a space), or with a cut
        # inside the next copy: the windows are aligned on the end
        assert loop.repeats >= repeats - 1 and loop.period == len(unit)  # no run of whitespace in these units
        assert loop_flag(text, finished=False) is True
        assert loop_flag(text, finished=True) is False


def test_short_unit_rule():
    """Identical repetitions with numbers kept, SHORT_MIN_REPEATS of them, of a unit of MIN_UNIT characters or more."""
    assert SHORT_MIN_REPEATS == 5 and MIN_UNIT == 5
    # the three examples, 10 times: 100 and 60 normalised characters, below MIN_SPAN
    assert find_loop(PROSE + " so x = 3," * 10) == Loop(unit=" so x = 3,", period=10, repeats=10, span=100)
    assert find_loop(PROSE + " \\boxed{7}" * 10 + " \\bo") == Loop(unit="xed{7} \\bo", period=10, repeats=10, span=100)
    assert find_loop(GSM8K_SOLUTION + " 1+1=2" * 10) == Loop(unit=" 1+1=2", period=6, repeats=10, span=60)
    assert find_loop(LOOPING["sentence"]).span >= MIN_SPAN  # the span rule is still what finds long units
    # 5 identical repetitions are a loop, 4 are not; the span rule alone needs 12 of these 10 characters
    assert find_loop(PROSE + " so x = 3," * 4) is None
    assert find_loop(PROSE + " so x = 3," * 5).repeats == 5
    assert find_loop(PROSE + " so x = 3," * 11, short_repeats=None) is None
    assert find_loop(PROSE + " so x = 3," * 12, short_repeats=None).span == MIN_SPAN
    # numbers must repeat too: with a new number each time a short unit is an enumeration until it spans MIN_SPAN
    counting = "".join(f" so x = {k}," for k in range(3, 14))  # 11 units of 10 normalised characters
    assert find_loop(PROSE + counting) is None
    assert find_loop(PROSE + counting + " so x = 14," + " so x = 15,").span >= MIN_SPAN
    # no mismatch: "." and "," alternating is 1 character in 12, allowed by the span rule, not by this one
    assert find_loop(PROSE + " I think so. I think so," * 4) is None
    # a unit under MIN_UNIT characters is left to the span rule, through its multiples
    assert find_loop("So: " + "ha, " * 29) is None
    assert find_loop("So: " + "ha, " * 31).span >= MIN_SPAN
    # letters are not needed (numbers kept), and the drift allowance applies
    assert find_loop("Check: " + "12 & 13 \\\\ " * 5).repeats == 5
    drifted = find_loop(PROSE + " \\boxed{7}" * 6 + " So the")  # " so the": its first space repeats the unit's
    assert (drifted.repeats, drifted.drift) == (6, 6)


@pytest.mark.parametrize("name", NOT_LOOPING)
def test_not_looping(name):
    assert find_loop(NOT_LOOPING[name]) is None, name
    assert loop_flag(NOT_LOOPING[name], finished=False) is False


def test_normalise():
    assert normalise("Step 12:\n\n 3.5 + 1,000  \n") == "step 0: 0 + 0"
    assert normalise("Step 12:\n\n 3.5", numbers=False) == "step 12: 3.5"


def test_what_find_loop_reports():
    # "the answer is 180. " is 19 normalised characters: 7 full repetitions, then a partial one; the unit reported is
    # the last 19 characters (a rotation of the sentence, as windows are aligned on the end)
    loop = find_loop("Intro. " + "The answer is 180.\n\n" * 7 + "The ans")
    assert loop == Loop(unit="wer is 180. the ans", period=19, repeats=7, span=133)
    # with numbers normalised the unit is 17 characters and 7 repetitions cover 119 < MIN_SPAN: the numbers-kept
    # reading found it
    assert 7 * len("the answer is 0. ") < MIN_SPAN
    # a 5-character unit repeated identically: 5 times is a loop by the short-unit rule (4 are not); by the span
    # rule alone it needs MIN_SPAN characters: 23 repetitions of "yes, " (115) are not enough, 24 are
    assert find_loop(PROSE + " yes," * 4) is None
    assert find_loop(PROSE + " yes," * 5) == Loop(unit=" yes,", period=5, repeats=5, span=25)
    assert find_loop(PROSE + " yes," * 23) == Loop(unit=" yes,", period=5, repeats=23, span=115)
    assert find_loop(PROSE + " yes," * 23, short_repeats=None) is None
    assert find_loop(PROSE + " yes," * 24) == Loop(unit=" yes,", period=5, repeats=24, span=120)
    # a long unit needs 3 repetitions: 2 are not a loop
    unit = " I will now recompute every step of this problem slowly and carefully, starting from the top."
    assert find_loop(PROSE + unit * 2) is None
    assert find_loop(PROSE + unit * 3).repeats == 3
    # only the end counts: the run may stop at most 1.5 units before it (the drift)
    assert find_loop(" I am stuck here, let me think." * 6 + NOISE) is None
    drifted = find_loop(LOOPING["last repetition drifts"])
    assert (drifted.period, drifted.repeats, drifted.drift) == (89, 4, 28)
    assert find_loop(LOOPING["last repetition drifts"], drift=False) is None
    stuck = " I am stuck here, let me think." * 6  # 31 normalised characters a unit: up to 46 may follow
    assert find_loop(stuck + " Now I see it: the answer is twelve.").drift == 35  # its first space repeats
    assert find_loop(stuck + " Now I see it: the answer is twelve apples, I think.") is None  # 51 characters after


def test_numbers_only_units():
    """Without letters a unit must repeat its numbers too, or run over 300 characters (a long list is a loop)."""
    table = "".join(f"{i} & {i + 1} \\\\ " for i in range(10, 40))  # 30 rows: 269 normalised characters
    assert find_loop(table) is None
    long_table = "".join(f"{i} & {i + 1} \\\\ " for i in range(10, 50))  # 40 rows: 359 normalised characters
    assert find_loop(long_table) is not None
    assert find_loop("12 & 13 \\\\ " * 14) is not None  # the same row again and again


def test_paper_regex_is_its_own_measure():
    """The VaSE reference check, as in its code: (.{10,40})\\1{4,} anywhere in the last 500 characters, no flags."""
    assert PAPER_LOOP_PATTERN.pattern == r"(.{10,40})\1{4,}"
    assert paper_loop("The answer is 180. " * 5)
    assert not paper_loop("The answer is 180. " * 4)
    assert not paper_loop("The answer is 180.\n\n" * 8)  # "." does not match a newline: no unit spans lines
    assert paper_loop("The answer is 180. " * 5 + "Then I moved on.")  # anywhere in the tail, not only at the end
    assert not paper_loop("The answer is 180. " * 5 + NOISE)  # outside the last 500 characters
    assert not paper_loop(LOOPING["numbers change"])  # numbers change: not caught by the regex
    assert not paper_loop(LOOPING["paragraph of 300 characters"])  # unit over 40 characters
    assert not paper_loop(PROSE)


def _benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "loop_detector.py"
    spec = importlib.util.spec_from_file_location("loop_detector", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measured_error_rates_on_data():
    """The held-out split of benchmarks/loop_detector.py, a third of it: FP <= 1% on natural text cut at random
    points, none of them added by the short-unit rule, recall >= 95% on constructed loops, short units repeated a
    few times included (the docs give the full run)."""
    need_data("reasoning/gsm8k.jsonl")
    need_data("reasoning/math500.jsonl")
    need_data("text/tinyshakespeare.txt")
    bench = _benchmark()
    natural = bench.natural_cuts("test", scale=0.33)
    loops = bench.constructed_loops("test", per_kind=60)
    fp = bench.rates(natural, {"loop": ends_in_loop})["loop"]["all"]
    span_rule = {g: [t for t in texts if bench.span_rule_only(t)] for g, texts in natural.items()}
    assert {g: [t for t in texts if ends_in_loop(t)] for g, texts in natural.items()} == span_rule
    rec = bench.rates(loops, {"loop": ends_in_loop})["loop"]
    assert fp[1] > 1000 and fp[0] / fp[1] <= 0.01, fp
    assert rec["all"][0] / rec["all"][1] >= 0.95, rec
    assert all(k / n >= 0.9 for k, n in rec.values()), rec  # every kind of loop, not just on average
