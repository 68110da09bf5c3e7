"""Loop detection in completions: loops reaching the end, normal solutions, and the looser token-limit check."""

from __future__ import annotations

import random
import string

import pytest

from vase.loops import LOOP_PATTERN, hit_limit_while_repeating, is_looping, loop_flag

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
UNIQUE_TEXT = (
    "Let x be the number of apples. Then Tom has 2x pears and Mary has x + 5 plums. Together they own 4x + 5 "
    "pieces of fruit, and we are told this is 41, so 4x = 36 and x = 9. Checking: nine apples, eighteen pears, "
    "fourteen plums make forty-one in all, which matches the statement. Hence Tom has eighteen pears, Mary "
    "fourteen plums, and the basket holds nine apples; every count is a whole number as it should be. "
    "So the final answer is \\boxed{9}."
)
NOISE = "".join(random.Random(0).choices(string.ascii_letters + " ", k=600))  # no 10-character unit recurs
MILES_UNIT = "4200 + 4200 = 8400 total miles he runs a week.\n\n"  # 48 characters: longer than a loop unit

LOOPING = [
    "The sum of the angles is 180(n-2).\n\n" + "The answer is 180.\n\n" * 5 + "The answer",
    "Let me compute again. " + "The answer is 180.\n\n" * 8,  # ends with a full unit and blank lines
    "Let me compute again. " + "The answer is 180.\n\n" * 5 + "\n\n\n",  # exactly five, then more blank lines
    "John runs 60 miles a week.\n\n" + "4200 + 4200 = 8400\n\n" * 6,
    "Wait, let me recheck. " * 10,
    "So x = 12.\n" + "Wait, that's not right. Let me redo it. " * 6 + "Wait, that",
    "The digits are " + "1, 2, 3, 4, 5, 6, 7, " * 10,
    "long reasoning " * 100 + "and and and and and and and and and and and and and and and and and",
]
NOT_LOOPING = [
    GSM8K_SOLUTION,
    POLYGON_SOLUTION,
    UNIQUE_TEXT,
    # Repeated in the middle, then moved on and ended normally.
    "Hmm. "
    + "Let me try again.\n\n" * 6
    + "Now with n = 5 we get 180 * 3 = 540 degrees, so the answer is \\boxed{540}.",
    # Short repeated tokens (unit under 10 characters) only.
    "Step 1: add.\n\n\nStep 2: multiply.\n\n\nStep 3: done." + "\n" * 60,
    "Yes yes yes yes yes. So the answer is 4.",
    # Four units and a partial one: one repetition short.
    "The sum of the angles is 180(n-2).\n\n" + "The answer is 180.\n\n" * 4 + "The answer",
    "",
]


@pytest.mark.parametrize("text", LOOPING)
def test_looping(text):
    assert is_looping(text) is True
    assert loop_flag(text, finished=True) is True
    assert loop_flag(text, finished=False) is True


@pytest.mark.parametrize("text", NOT_LOOPING)
def test_not_looping(text):
    assert is_looping(text) is False
    assert loop_flag(text, finished=True) is False


def test_only_the_tail_is_read():
    assert is_looping(NOISE + "The answer is 180.\n\n" * 5) is True
    assert is_looping("The answer is 180.\n\n" * 5 + NOISE) is False
    assert is_looping("The answer is 180.\n\n" * 5, tail_chars=50) is False  # 50 chars hold 2.5 units


def test_long_unit_is_caught_only_at_the_token_limit():
    """A 48-character sentence repeated: no 10-40 character unit repeats 5 times in a row, as in the reference."""
    text = "He runs 600 miles a day for 7 days.\n\n" + MILES_UNIT * 6
    assert is_looping(text) is False
    assert hit_limit_while_repeating(text, finished=False) is True
    assert loop_flag(text, finished=False) is True
    assert loop_flag(text, finished=True) is False


def test_hit_limit_while_repeating():
    cut_while_cycling = (
        "x = 3 gives 27. Let me check x = 4: that gives 64. Let me check x = 3 again: 27. Let me check x = 4 again"
    )
    assert hit_limit_while_repeating(cut_while_cycling, finished=False) is True
    assert hit_limit_while_repeating(cut_while_cycling, finished=True) is False
    assert is_looping(cut_while_cycling) is False
    # Cut by the limit but not repeating: not flagged.
    assert hit_limit_while_repeating(UNIQUE_TEXT[:300], finished=False) is False
    assert loop_flag(UNIQUE_TEXT[:300], finished=False) is False
    # Blank lines are not a repeated unit.
    assert hit_limit_while_repeating("Step 1: add." + "\n" * 60 + "Step 2", finished=False) is False
    # Only the last 500 characters count.
    assert hit_limit_while_repeating("Let me check. " * 3 + NOISE, finished=False) is False
    assert hit_limit_while_repeating(NOISE, finished=False) is False


def test_loop_pattern():
    assert LOOP_PATTERN.search("The answer is 180.\n\n" * 5) is not None
    assert LOOP_PATTERN.search("The answer is 180.\n\n" * 4) is None
    assert LOOP_PATTERN.search("ab" * 4) is None
    match = LOOP_PATTERN.search("Intro: " + "I am stuck here. " * 6)
    assert match is not None and match.group(1) == " I am stuck here."  # leftmost: a rotation of the sentence
    assert match.end() == len("Intro: " + "I am stuck here. " * 6) - 1
