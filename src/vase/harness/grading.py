"""Answer extraction and grading for reasoning evaluations (math answers and multiple choice).

``extract_answer`` finds the final answer in a completion, ``is_equivalent`` compares it with the reference
(math answers through math-verify, after a cheap numeric fast path), ``grade`` does both::

    grade("... so the total is \\boxed{\\frac{1}{2}}.", "0.5")   # -> ("\\frac{1}{2}", True)

Percentages: a number with a percent sign equals the bare number and the number divided by 100, on either side
("50\\%" is equivalent to "50" and to "0.5"; "50" and "0.5" are not equivalent to each other).
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Iterator
from fractions import Fraction

from math_verify import parse, verify

try:
    from math_verify.errors import TimeoutException  # a BaseException, not an Exception
except ImportError:  # pragma: no cover - older math-verify
    TimeoutException = Exception

KINDS = ("math", "mcq")
TIMEOUT_S = 5  # per math-verify parse / comparison, in the main thread only (it relies on SIGALRM)

_PARSE_PARAMS = inspect.signature(parse).parameters
_VERIFY_PARAMS = inspect.signature(verify).parameters

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K = re.compile(r"####[ \t]*([^\n]+)")
_PHRASE = re.compile(r"(?i:answer)[\s*]*(?:(?i:is)\b|:|=)[\s*:]*")
_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{")
_LETTER_ALONE = re.compile(r"(?:(?i:option|choice)\s*)?\(?([A-Ja-j])\)?")
_LETTER_LEAD = re.compile(r"(?:(?i:option|choice)\s*)?\(?([A-J])\)?(?![A-Za-z0-9])")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:/\d+)?")  # no exponent: Fraction("1e999999999") is slow


def _closing(text: str, start: int) -> int | None:
    """Index of the brace closing the group whose content starts at ``start``; escaped braces do not count."""
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` / ``\\fbox{...}``, nested braces included."""
    for m in reversed(list(_BOXED.finditer(text))):
        end = _closing(text, m.end())
        if end is not None:
            return text[m.end() : end]
    return None


def _sentence(s: str) -> str:
    """The answer part of what follows "answer is": an inline math span, else up to the end of the sentence."""
    m = re.match(r"\s*(?:\$+(.+?)\$|\\\((.+?)\\\))", s)
    if m:
        return m.group(1) or m.group(2)
    return re.split(r"\.(?=\s|$)", s, maxsplit=1)[0]


def _candidates(text: str) -> Iterator[str]:
    """Possible final answers, most trusted first: last box, last ``####`` line, "answer is" phrases from the end."""
    boxed = _last_boxed(text)
    if boxed is not None:
        yield boxed
    gsm = _GSM8K.findall(text)
    if gsm:
        yield gsm[-1]
    for m in reversed(list(_PHRASE.finditer(text))):
        yield _sentence(text[m.end() :].split("\n", 1)[0])


def _clean(s: str) -> str:
    """Strip whitespace, ``$``, markdown bold, trailing periods and a ``\\text{...}`` wrapping the whole answer."""
    s = s.replace("\\$", "").replace("$", "").replace("**", "").strip()
    m = _WRAPPER.match(s)
    if m and _closing(s, m.end()) == len(s) - 1:
        s = s[m.end() : -1].strip()
    while s.endswith(".") or s != s.strip():
        s = s.strip().rstrip(".")
    return s


def _letter(s: str) -> str | None:
    """The option letter A-J that ``s`` starts with ("B", "(b)", "Option C", "(D) 42"), uppercase; else None."""
    s = _clean(s)
    m = _LETTER_ALONE.fullmatch(s) or _LETTER_LEAD.match(s)
    return m.group(1).upper() if m else None


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown answer kind {kind!r}: expected one of {', '.join(KINDS)}")


def extract_answer(text: str, kind: str = "math") -> str | None:
    """The final answer given in a model completion.

    Looks, in this order, for the last ``\\boxed{...}`` (or ``\\fbox{...}``, nested braces handled), a GSM8K
    ``#### 72`` line, then phrases such as "The answer is 72", "Final answer: 72" (the last one first).
    The answer is cleaned: surrounding whitespace, ``$``, trailing periods and a ``\\text{...}`` wrapper removed.

    Args:
        text: the completion.
        kind: "math" (return the answer string as written) or "mcq" (return one uppercase letter A-J, taken from
            e.g. ``\\boxed{B}``, "answer is (B)", "Answer: B", or a completion that is only "B" / "(B)").

    Returns:
        The answer, or None when none is found. Raises ValueError only for an unknown ``kind``.
    """
    _check_kind(kind)
    if not isinstance(text, str):
        return None
    for candidate in _candidates(text):
        answer = _letter(candidate) if kind == "mcq" else _clean(candidate)
        if answer:
            return answer
    if kind == "mcq":
        m = _LETTER_ALONE.fullmatch(_clean(text))
        return m.group(1).upper() if m else None
    return None


def _number(s: str) -> tuple[Fraction, bool] | None:
    """``s`` as an exact number and whether it had a percent sign, or None when it is not a plain number."""
    s = s.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace(" ", "")
    percent = s.endswith("%")
    s = s.removesuffix("\\%").removesuffix("%")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Fraction(s), percent
    except (ValueError, ZeroDivisionError):  # 1/0, or more digits than int() accepts
        return None


def _same_number(pred: str, gold: str) -> bool:
    """Fast path: both are plain numbers ("72", "72.0", "1,000", "1/2", "50%") of equal value."""
    a, b = _number(pred), _number(gold)
    if a is None or b is None:
        return False
    (x, x_percent), (y, y_percent) = a, b
    if x == y:
        return True
    if x_percent != y_percent:  # exactly one side is a percentage: also try it as a fraction
        return x / 100 == y if x_percent else y / 100 == x
    return False


def _timeouts() -> tuple[dict, dict]:
    """math-verify keyword arguments: its signal-based timeout in the main thread, none elsewhere."""
    seconds = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    parse_kw = {"parsing_timeout": seconds} if "parsing_timeout" in _PARSE_PARAMS else {}
    verify_kw = {"timeout_seconds": seconds} if "timeout_seconds" in _VERIFY_PARAMS else {}
    return parse_kw, verify_kw


def _math_verify(pred: str, gold: str) -> bool:
    parse_kw, verify_kw = _timeouts()
    try:
        gold_parsed = parse(f"\\boxed{{{gold}}}", **parse_kw)
        pred_parsed = parse(f"\\boxed{{{pred}}}", **parse_kw)
        return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, **verify_kw))
    except (Exception, TimeoutException):
        return False


def is_equivalent(pred: str | None, gold: str, kind: str = "math") -> bool:
    """Whether a predicted answer matches the reference answer.

    Args:
        pred: the extracted answer (None, e.g. when nothing was extracted, is never equivalent).
        gold: the reference answer.
        kind: "mcq": the option letters are compared, case-insensitively ("b", "(B)", "B" are the same).
            "math": plain numbers are compared exactly first ("72" = "72.0", "1,000" = "1000", "1/2" = "0.5",
            "50\\%" = "50" and "50\\%" = "0.5": the percentage rule of the module docstring), then with
            math-verify (fractions, radicals, tuples, intervals, sets, algebraic expressions, ...), under its
            timeout when called from the main thread (without one from other threads: it relies on signals).

    Returns:
        True when equivalent. Never raises for any answer text (a math-verify error or timeout gives False);
        raises ValueError only for an unknown ``kind``.
    """
    _check_kind(kind)
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    if kind == "mcq":
        letter = _letter(pred)
        return letter is not None and letter == _letter(gold)
    pred, gold = _clean(pred), _clean(gold)
    if not pred or not gold:
        return False
    return pred == gold or _same_number(pred, gold) or _math_verify(pred, gold)


def grade(text: str, gold: str, kind: str = "math") -> tuple[str | None, bool]:
    """Extract the answer of a completion and compare it with the reference.

    Args:
        text: the model completion.
        gold: the reference answer.
        kind: "math" or "mcq" (see :func:`extract_answer` and :func:`is_equivalent`), or "ruler": the synthetic
            long-context tasks, ``gold`` their reference values (see :func:`vase.harness.ruler.grade`).

    Returns:
        ``(answer, correct)``: the extracted answer (None when absent, then ``correct`` is False) and whether it
        is equivalent to ``gold``. Never raises for any text; raises ValueError only for an unknown ``kind``.
    """
    if kind == "ruler":
        from .ruler import grade as grade_ruler

        return grade_ruler(text, gold)
    pred = extract_answer(text, kind)
    return pred, is_equivalent(pred, gold, kind)
