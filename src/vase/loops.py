"""Detection of repetitive loops in completions: the failure mode that the value guard of VaSE prevents.

Loop detection as in the VaSE reference evaluation (regex ``(.{10,40})\\1{4,}`` over the last 500 characters):
a unit of 10-40 characters followed by 4 or more copies of itself. :func:`is_looping` requires the repetition to
reach the end of the completion; :func:`hit_limit_while_repeating` is the looser check for generations cut by the
token limit; :func:`loop_flag` is either.
"""

from __future__ import annotations

import re

TAIL_CHARS = 500
MIN_UNIT, MAX_UNIT = 10, 40

# A unit of 10-40 characters repeated 4+ more times consecutively. The lazy unit tries the shortest period first;
# on a 500-character tail any search stays in the milliseconds.
LOOP_PATTERN = re.compile(r"(.{10,40}?)\1{4,}", re.DOTALL)
_LOOP_AT_END = re.compile(LOOP_PATTERN.pattern + r"\s*\Z", re.DOTALL)


def _tail(text: str, tail_chars: int) -> str:
    return text.rstrip()[-tail_chars:] if tail_chars > 0 else ""


def is_looping(text: str, tail_chars: int = TAIL_CHARS) -> bool:
    """Whether the completion ends in a loop.

    Loop detection as in the VaSE reference evaluation (regex ``(.{10,40})\\1{4,}`` over the last 500
    characters), with the repetition required to reach the end of the text: True when the last ``tail_chars``
    characters (trailing whitespace ignored) end with a unit of 10-40 characters repeated 5 times in a row.
    A partial final repetition is allowed (five times "The answer is 180.\\n\\n", then "The answer"): the last
    five units then repeat a rotation of the unit. Trailing whitespace such as a run of "\\n\\n\\n" never counts
    (a shorter non-blank unit does once its run is long enough to repeat a 10-character multiple of it 5 times),
    and neither does a text that repeated itself in the middle and then moved on. A sentence longer than 40
    characters repeated over and over is not caught here (as in the reference), only by
    :func:`hit_limit_while_repeating` when the generation hit the token limit.

    Args:
        text: the completion.
        tail_chars: how many final characters to look at.

    Returns:
        True when looping. Never raises for any string.
    """
    end = len(text.rstrip())
    # The last tail_chars characters before the trailing whitespace, and enough of that whitespace to complete a
    # unit: a loop of "...180.\n\n" stripped of its final "\n\n" keeps its fifth repetition. No whitespace-only
    # unit fits in MAX_UNIT characters five times, so a run of blank lines is never a loop.
    return _LOOP_AT_END.search(text[max(0, end - tail_chars) : end + MAX_UNIT]) is not None


def _recurring_unit(tail: str, times: int = 3) -> bool:
    """Whether some unit of 10-40 characters occurs ``times`` times, without overlap, anywhere in ``tail``.

    A unit of 10-40 characters occurring n times implies that its first 10 characters do, so only 10-character
    units are counted. Whitespace-only units (runs of blank lines) are ignored.
    """
    starts: dict[str, list[int]] = {}
    for i in range(len(tail) - MIN_UNIT + 1):
        unit = tail[i : i + MIN_UNIT]
        if unit.isspace():
            continue
        seen = starts.setdefault(unit, [])
        if not seen or i - seen[-1] >= MIN_UNIT:
            seen.append(i)
            if len(seen) >= times:
                return True
    return False


def hit_limit_while_repeating(text: str, finished: bool) -> bool:
    """Whether the generation was cut by the token limit while repeating itself.

    Looser than :func:`is_looping` (loop detection as in the VaSE reference evaluation, regex
    ``(.{10,40})\\1{4,}`` over the last 500 characters): True when the generation did not finish
    (``finished=False``: it hit the max-token limit) and either :func:`is_looping` holds or the last 500
    characters contain one unit of 10-40 characters 3 or more times in total, not necessarily consecutively
    (whitespace-only units ignored).

    Args:
        text: the completion.
        finished: whether the generation ended by itself (EOS / stop string) rather than at the token limit.

    Returns:
        True when unfinished and repetitive; always False for a finished generation. Never raises for any string.
    """
    if finished:
        return False
    return is_looping(text) or _recurring_unit(_tail(text, TAIL_CHARS))


def loop_flag(text: str, finished: bool) -> bool:
    """The loop flag of one completion: ``is_looping(text) or hit_limit_while_repeating(text, finished)``.

    Loop detection as in the VaSE reference evaluation (regex ``(.{10,40})\\1{4,}`` over the last 500 characters).
    Never raises for any string.
    """
    return is_looping(text) or hit_limit_while_repeating(text, finished)
