"""Detection of repetitive loops in completions: the failure mode that the value guard of VaSE is meant to prevent.

Two measures, kept apart:

* :func:`loop_flag` (reported as "loop rate"): the generation was cut by the token limit while its end was a run
  of near-identical repetitions of one unit (:func:`find_loop`). Its error rates are measured, not assumed:
  ``benchmarks/loop_detector.py`` cuts natural text at random points (GSM8K and MATH-500 reference solutions,
  windows of tinyshakespeare, completions that ended by themselves) and builds loops of units of 5-300
  characters (sentence loops, loops whose numbers change, token loops with whitespace variation, short units
  repeated only 6-25 times); the figures and the command are in docs/RESULTS.md, and labelled cases are in
  tests/harness/test_loops.py.
* :func:`paper_loop` (reported as "paper regex loop rate"): the check of the VaSE reference evaluation
  (arXiv 2606.03928), regex ``(.{10,40})\\1{4,}`` searched anywhere in the last 500 characters, kept only for
  comparison with the paper.

How :func:`find_loop` reads a text: the last :data:`TAIL_CHARS` characters are normalised (lower case, every run
of whitespace one space, and every run of digits such as ``12``, ``3.5`` or ``1,000`` becomes ``0``), so that
loops whose numbers change and token loops with varying whitespace repeat exactly. For each period ``p`` of
:data:`MIN_UNIT`-:data:`MAX_UNIT` normalised characters, windows of ``p`` characters are compared with the ``p``
characters before them, going back from the end; a window matches when at most :data:`MISMATCH_SHARE` of its
characters differ. ``k`` matching windows in a row make ``k + 1`` repetitions covering ``(k + 1) * p``
characters. A loop is at least :data:`MIN_REPEATS` repetitions covering at least :data:`MIN_SPAN` normalised
characters (the span rule), reaching the end of the text (a partial last repetition is fine: windows are aligned
on the end) or stopping at most :data:`DRIFT_UNITS` units before it (the last repetition drifted: a word or a
number of another length changed, as real completions cut at the limit do). A unit shorter than 5 characters
(``"the "``) is found through its multiples (``"the the "``). A unit without any letter (a table or list of
numbers, ``"0 & 0 \\\\ "``) counts with changing numbers only over :data:`NUMBERS_MIN_SPAN` characters; with its
numbers unchanged (``"4200 + 4200 = 8400"`` again and again) the usual thresholds apply.

A short unit repeated a few times covers fewer than :data:`MIN_SPAN` characters (``"so x = 3, "`` 10 times is 100),
so a second rule, the short-unit rule, counts repetitions instead of characters: :data:`SHORT_MIN_REPEATS` or more
repetitions in a row that are identical with the numbers kept (case and whitespace still normalised; no mismatch
allowed), of a unit of at least :data:`MIN_UNIT` characters that is not a multiple of a shorter one, are a loop
whatever their span (the same end and drift conditions apply). Letters are not needed (``"1+1=2 "``). It matters for
units under ``MIN_SPAN / SHORT_MIN_REPEATS`` = 24 characters; longer ones reach the span first. How it was set, on
the dev split only, counting every cut point of its natural text (``benchmarks/loop_detector.py --split dev
--dense``; 861,905 cut points): with numbers kept, no cut point ends in 5 identical repetitions of a unit of 5-23
characters, 7 end in 4, in two places (a sum of ``\\frac{d}{4}`` in a MATH-500 solution, and Coriolanus's "Kill,
kill, kill, kill, kill": 4 repetitions of ``", kill"``). With numbers normalised (a letter needed), 150 of the
137,186 cut points of the MATH-500 solutions end in 5 (normalised: ``\\sin 0^\\circ`` again and again,
``\\pm 0,~``, ``\\frac{0 \\pi}{0} +``): a short unit whose numbers change (``"x = 3, x = 4, x = 5, "``) is an
enumeration as often as a loop, and needs the span rule. 5 is also what the paper's regex asks (5 copies), and the
least that catches 6 copies cut right after the last one: with the trailing space stripped, the windows are shifted
by one character and the first copy counts only when the text before it ends as the unit does (in a space). A unit
under 5 characters (``"ha, ha, "``, ``"0 & 0 & "``) is left to the span rule.

The thresholds were set on the dev half of the benchmark's data and measured on the other; the drift allowance was
added after reading real completions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# --- The VaSE reference check, for comparison with the paper -------------------------------------------------------
PAPER_TAIL_CHARS = 500
# As in the reference evaluation code: no flags, so "." does not match a newline and a unit never spans lines.
PAPER_LOOP_PATTERN = re.compile(r"(.{10,40})\1{4,}")

# --- The measured detector -----------------------------------------------------------------------------------------
MIN_UNIT = 5  # normalised characters
MAX_UNIT = 300  # normalised characters
MIN_REPEATS = 3  # repetitions of the unit, the first one included
MIN_SPAN = 120  # normalised characters covered by the repetitions
NUMBERS_MIN_SPAN = 300  # normalised characters, for a unit of numbers and signs only whose numbers change
DRIFT_UNITS = 1.5  # the text may go on this many units (of the loop's period) after the run: the drift
MISMATCH_SHARE = 0.1  # share of a unit's characters allowed to differ from the previous repetition
TAIL_CHARS = 4000  # raw characters read from the end; enough for 300-character units repeated over 10 times
SHORT_MIN_REPEATS = 5  # identical repetitions (numbers kept) that make a loop whatever their span: the short-unit rule

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_SPACE = re.compile(r"\s+")
_LETTER = re.compile(r"[^\W\d_]")  # a letter of any script


@dataclass(frozen=True)
class Loop:
    """A run of repetitions at the end of a text, in normalised characters (see :func:`normalise`).

    Attributes:
        unit: the last full repetition, normalised.
        period: its length in normalised characters.
        repeats: repetitions in the run, the first one included (a partial last one not counted).
        span: normalised characters covered, ``repeats * period``.
        drift: normalised characters after the run (0: the run reaches the end), at most :data:`DRIFT_UNITS`
            units of the shortest period.
    """

    unit: str
    period: int
    repeats: int
    span: int
    drift: int = 0


def normalise(text: str, numbers: bool = True) -> str:
    """Lower case, each run of whitespace -> one space, no trailing whitespace, and with ``numbers`` each run of
    digits (with inner ``.`` or ``,``) -> ``0``: ``"Step 12:\\n\\n 3.5 + 1,000"`` -> ``"step 0: 0 + 0"``."""
    text = text.lower()
    return _SPACE.sub(" ", _NUMBER.sub("0", text) if numbers else text).rstrip()


def _matching_windows(s: str, p: int, allowed: int, enough: int, end: int | None = None) -> int:
    """How many windows ``s[e - p : e]`` in a row, from ``e = end`` (default ``len(s)``) back by ``p``, differ from
    the ``p`` characters before them in at most ``allowed`` positions; counting stops at ``enough``."""
    count, end = 0, len(s) if end is None else end
    while end - 2 * p >= 0 and count < enough:
        cur, prev = s[end - p : end], s[end - 2 * p : end - p]
        if cur != prev:
            bad = 0
            for a, b in zip(cur, prev):
                if a != b:
                    bad += 1
                    if bad > allowed:
                        return count
        count += 1
        end -= p
    return count


def _drifted_end(s: str, p: int, slack: int) -> int | None:
    """The end of a run of period ``p`` that stops at most ``slack`` characters before the end of ``s`` (the last
    repetition drifted: other words, or a number of another length), or None.

    Probes every ``p // 4`` characters back from the end for a window equal to the one before it (inside a
    periodic run every window is), then walks forward to where the run stops.
    """
    n = len(s)
    for d in range(max(1, p // 4), slack + 1, max(1, p // 4)):
        e = n - d
        if e - 2 * p < 0:
            return None
        if s[e - p : e] == s[e - 2 * p : e - p]:
            while e < n and s[e] == s[e - p]:
                e += 1
            return e if e < n else None
    return None


def _primitive_period(unit: str) -> int:
    """The length of the shortest ``u`` with ``unit == u * k`` (``"abab"`` -> 2)."""
    p = len(unit)
    for q in range(1, p // 2 + 1):
        if p % q == 0 and unit == unit[:q] * (p // q):
            return q
    return p


def find_loop(
    text: str,
    min_repeats: int = MIN_REPEATS,
    min_span: int = MIN_SPAN,
    mismatch_share: float = MISMATCH_SHARE,
    tail_chars: int = TAIL_CHARS,
    drift: bool = True,
    short_repeats: int | None = SHORT_MIN_REPEATS,
) -> Loop | None:
    """The loop the text ends in, or None (see the module docstring for the method).

    The tail is read twice: with numbers normalised to ``0`` (only units holding a letter count, so that a table
    or a list of different numbers is not a loop) and with numbers kept (any unit counts: ``"4200 + 4200 =
    8400\\n"`` repeated verbatim is a loop). Among the periods of :data:`MIN_UNIT`-:data:`MAX_UNIT` normalised
    characters whose run reaches both ``min_repeats`` repetitions and ``min_span`` characters (the span rule), or,
    read with numbers kept, ``short_repeats`` identical repetitions of a unit that is not a multiple of one under
    :data:`MIN_UNIT` characters (the short-unit rule), the one covering the most characters is returned (the first
    found on ties: numbers normalised, shortest period).

    Args:
        text: the completion.
        min_repeats: repetitions needed, the first one included.
        min_span: normalised characters the repetitions must cover.
        mismatch_share: share of a unit's characters that may differ from the previous repetition.
        tail_chars: raw characters read from the end.
        drift: also accept a run that stops at most :data:`DRIFT_UNITS` units (of its shortest period) before the
            end (:func:`_drifted_end`).
        short_repeats: identical repetitions (numbers kept, no mismatch) that make a loop whatever their span, on
            top of the span rule; None: the span rule only.

    Returns:
        a :class:`Loop`, or None. Never raises for any string; a few milliseconds on natural text.
    """
    tail = text[-tail_chars:] if tail_chars > 0 else ""
    best: Loop | None = None
    for s, needs_letter in ((normalise(tail), True), (normalise(tail, numbers=False), False)):
        n = len(s)
        for p in range(MIN_UNIT, min(MAX_UNIT, n // 2) + 1):
            allowed = int(mismatch_share * p)
            ends = [n]
            if drift:
                drifted = _drifted_end(s, p, int(DRIFT_UNITS * p))
                if drifted is not None:
                    ends.append(drifted)
            for end in ends:
                repeats = _matching_windows(s, p, allowed, n, end) + 1
                short = repeats < min_repeats or repeats * p < min_span  # not the span rule: the short-unit rule?
                if short:
                    if needs_letter or short_repeats is None or repeats < short_repeats:
                        continue
                    if allowed:  # identical repetitions only
                        repeats = _matching_windows(s, p, 0, n, end) + 1
                        if repeats < short_repeats:
                            continue
                span = repeats * p
                if best is not None and span <= best.span:
                    continue
                unit = s[end - p : end]
                if needs_letter and span < NUMBERS_MIN_SPAN and not _LETTER.search(unit):
                    continue
                primitive = _primitive_period(unit)
                if short and primitive < MIN_UNIT:  # "ha, ha, ": a unit under MIN_UNIT needs the span rule
                    continue
                if n - end > DRIFT_UNITS * primitive:  # a multiple of the unit gets no more drift
                    continue
                best = Loop(unit=unit, period=p, repeats=repeats, span=span, drift=n - end)
    return best


def ends_in_loop(text: str) -> bool:
    """Whether the text ends in a loop (:func:`find_loop` finds one). Never raises for any string."""
    return find_loop(text) is not None


def loop_flag(text: str, finished: bool) -> bool:
    """The loop flag of one completion, reported as "loop rate": the generation did not end by itself
    (``finished=False``: it hit the max-token limit) and its text ends in a loop (:func:`ends_in_loop`).

    A completion that ended by itself (EOS or stop string) is never a loop: it escaped whatever it repeated. The
    error rates of the text check are measured in ``benchmarks/loop_detector.py`` (docs/RESULTS.md).

    Args:
        text: the completion.
        finished: whether the generation ended by itself rather than at the token limit.

    Returns:
        True when cut by the limit while looping. Never raises for any string.
    """
    return not finished and ends_in_loop(text)


def paper_loop(text: str) -> bool:
    """The loop check of the VaSE reference evaluation, reported as "paper regex loop rate": the regex
    ``(.{10,40})\\1{4,}`` (no flags: a unit never holds a newline) found anywhere in the last 500 characters,
    finished or not. Kept as its own measure for comparison with the paper; ``benchmarks/loop_detector.py``
    measures it too (it misses units longer than 40 characters, units holding a newline and loops whose numbers
    change). Never raises for any string."""
    return PAPER_LOOP_PATTERN.search(text[-PAPER_TAIL_CHARS:]) is not None
