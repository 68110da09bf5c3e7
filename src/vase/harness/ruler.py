"""Synthetic long-context tasks in the style of RULER (Hsieh et al., arXiv 2404.06654), generated locally.

A task is named ``ruler:NAME@LENGTH`` (``ruler:niah_single@4k``, ``ruler:vt@2048``): LENGTH is the context in
tokens of the model's tokenizer, chat template included, answer tokens included; ``k`` means 1,024. Problems are
generated from the task name and the problem index alone (seeded), so every run of a sweep sees the same ones.

Tasks (the haystack is RULER's repeated "noise" sentences unless stated; values are 7-digit numbers unless stated):

- ``niah_single``: one needle ("the special magic number for KEY is VALUE") at a depth spread over [0, 1].
- ``niah_uuid``: one needle whose value is a UUID.
- ``niah_multikey``: four needles with different keys; the question asks for one (the others are distractors).
- ``niah_multivalue``: one key with four values; all four must be given.
- ``niah_multiquery``: four keys; the question asks for all four values.
- ``vt``: variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (five names) spread through the
  noise; all five names assigned the number must be given.
- ``cwe``: common-word extraction: a numbered list of words where ten words occur many times and the others twice;
  the ten must be given.
- ``fwe``: frequent-word extraction: coded words drawn from a Zipf law (exponent 2), a few recoded so that the three
  most frequent have strictly decreasing counts above every other word's (no ties); the three must be given.
- ``niah_decode``: decode-heavy recall (RULER compresses the prompt only): the needle is given in the prompt, the
  model then writes ``max_new_tokens`` tokens of its own (a story; end-of-sequence suppressed), and only then is the
  question asked, in a second turn: the needle must survive the evictions made while it wrote.

Scoring (RULER's ``string_match_all``): the share of the reference values found in the answer (whole words, case
ignored); a completion is correct when it holds all of them.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from .data import DataError, Problem

PREFIX = "ruler:"
TASKS = (
    "niah_single",
    "niah_uuid",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "niah_decode",
)
DEFAULT_PROBLEMS = 20
ANSWER_TOKENS = {"niah_uuid": 96, "niah_multivalue": 96, "niah_multiquery": 96, "cwe": 128, "fwe": 64}
DEFAULT_ANSWER_TOKENS = 48
DECODE_TASKS = ("niah_decode",)
QUESTION_TOKENS = 64  # room kept in a decode-heavy task's length for the second turn's question
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEYS = (
    "apple anchor badge basket beacon blanket bottle bridge bucket button cabin camera candle canvas carpet castle "
    "cellar chimney circle clock cloud compass copper cottage crystal curtain desert diamond dolphin dragon eagle "
    "engine falcon feather fiddle forest fountain garden glacier goblet harbor hammer helmet island jacket jungle "
    "kettle ladder lantern lemon lighthouse magnet marble meadow mirror monkey mountain needle orchard otter oyster "
    "paddle palace parrot pebble pencil pepper piano pillow planet pocket pumpkin puzzle quartz rabbit raven ribbon "
    "river rocket saddle sailor scarf shadow shovel silver spider spoon statue stone sugar tiger tower trumpet tulip "
    "turtle umbrella valley velvet violin wagon walnut whistle window wizard zebra"
).split()
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
TOPICS = ("a journey across the sea", "a lighthouse keeper", "a city in the clouds", "a clockmaker's apprentice")
_WORD = "(?<![0-9A-Za-z]){}(?![0-9A-Za-z])"


@dataclass(frozen=True)
class Task:
    """A parsed task name: ``name`` (one of :data:`TASKS`), ``length`` (context tokens) and the full ``label``."""

    name: str
    length: int
    label: str

    @property
    def answer_tokens(self) -> int:
        """Tokens the answer may take (RULER's tokens to generate, per task)."""
        return ANSWER_TOKENS.get(self.name, DEFAULT_ANSWER_TOKENS)

    @property
    def decode_heavy(self) -> bool:
        """Whether the model writes before it is asked (``niah_decode``)."""
        return self.name in DECODE_TASKS


def is_ruler(task: str) -> bool:
    """Whether a task name is a synthetic long-context task (``ruler:...``)."""
    return task.startswith(PREFIX)


def parse_task(label: str, context: int | None = None, written: int = 0) -> Task:
    """``'ruler:NAME@LENGTH'`` -> :class:`Task`; LENGTH in tokens, ``2k`` = 2,048.

    Args:
        context: the model's context in tokens, if known: the task (plus ``written`` tokens for a decode-heavy task)
            must fit in it.
        written: tokens the model writes before the question (``niah_decode``).

    Raises:
        DataError: an unknown task name (the message lists them), a malformed or too short length, or a context
            longer than the model's.
    """
    body = label[len(PREFIX) :] if is_ruler(label) else label
    name, _, length = body.partition("@")
    if name not in TASKS:
        raise DataError(f"unknown long-context task {name!r} in {label!r}; choose one of {', '.join(TASKS)}")
    m = re.fullmatch(r"(\d+)(k?)", length.strip().lower())
    if not m:
        raise DataError(f"{label!r}: give the context length after '@', in tokens (e.g. {PREFIX}{name}@4k or @4096)")
    tokens = int(m.group(1)) * (1024 if m.group(2) else 1)
    if tokens < 256:
        raise DataError(f"{label!r}: the context must be at least 256 tokens, got {tokens}")
    task = Task(name=name, length=tokens, label=f"{PREFIX}{name}@{length.strip().lower()}")
    total = tokens + (written if task.decode_heavy else 0)
    if context and total > context:
        extra = f" plus {written} written tokens" if task.decode_heavy else ""
        raise DataError(
            f"{label!r}: a context of {tokens} tokens{extra} is longer than the model's {context}; choose a shorter "
            "length"
        )
    return task


def score(text: str, references: list[str]) -> float:
    """RULER's ``string_match_all``: the share of ``references`` found in ``text`` as whole words (case ignored)."""
    if not references:
        return 0.0
    found = sum(bool(re.search(_WORD.format(re.escape(r)), text, re.IGNORECASE)) for r in references)
    return found / len(references)


def references(answer: str) -> list[str]:
    """The reference values of a problem's ``answer`` (stored joined by ``' | '``)."""
    return [r for r in answer.split(" | ") if r]


def grade(text: str, answer: str) -> tuple[str, bool]:
    """``(the references found, joined by ' | ', correct)``: correct when every reference is in ``text``."""
    refs = references(answer)
    found = [r for r in refs if score(text, [r])]
    return " | ".join(found), len(found) == len(refs)


# -- generators: each returns (text built from n haystack units, references, metadata) ----------------------------


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _word(rng: random.Random, syllables: int = 3) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables))


def _distinct(rng: random.Random, n: int, make) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = make(rng)
        if w not in out:
            out.append(w)
    return out


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}. "


def _insert(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """Insert each needle between haystack units at its depth (0 = start, 1 = end)."""
    out = list(units)
    for needle, depth in sorted(zip(needles, depths), key=lambda p: -p[1]):
        out.insert(round(depth * len(units)), needle)
    return out


class _Builder:
    """The text of one problem as a function of its haystack size ``n`` (units), fixed everything else."""

    def __init__(self, task: Task, index: int):
        self.task, self.index = task, index
        rng = random.Random(f"vase-ruler|{task.name}|{index}")
        self.rng = rng
        self.depths = [round(index % 11 / 10, 1)]  # single needles: 0.0, 0.1, ..., 1.0 in turn
        name = task.name
        if name in ("niah_single", "niah_uuid", "niah_decode"):
            self.keys = [rng.choice(KEYS)]
            self.values = [[_uuid(rng) if name == "niah_uuid" else _number(rng)]]
        elif name in ("niah_multikey", "niah_multiquery"):
            self.keys = rng.sample(KEYS, 4)
            self.values = [[_number(rng)] for _ in self.keys]
            self.depths = sorted(rng.random() for _ in self.keys)
        elif name == "niah_multivalue":
            self.keys = [rng.choice(KEYS)]
            self.values = [_distinct(rng, 4, _number)]
            self.depths = sorted(rng.random() for _ in range(4))
        elif name == "vt":
            self.names = _distinct(rng, 5, lambda r: "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
            self.value = str(rng.randint(10_000, 99_999))
            self.depths = sorted(rng.random() for _ in self.names)
        elif name == "cwe":
            self.words = _distinct(rng, 10, _word)
            self.seed = rng.getrandbits(32)
        elif name == "fwe":
            self.seed = rng.getrandbits(32)
        self.asked = 0 if name != "niah_multikey" else rng.randrange(4)

    def build(self, n: int) -> tuple[str, list[str], dict]:
        """(prompt text, references, metadata) with ``n`` haystack units."""
        name = self.task.name
        if name.startswith("niah"):
            return self._niah(n)
        if name == "vt":
            chain = [f"VAR {self.names[0]} = {self.value}. "]
            chain += [f"VAR {b} = VAR {a}. " for a, b in zip(self.names, self.names[1:])]
            hay = "".join(_insert([NOISE] * n, chain, self.depths))
            q = (
                "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
                f"{hay}\nQuestion: Find all variables that are assigned the value {self.value} in the text above. "
                f"Answer: According to the chain of variable assignments in the text above, 5 variables are "
                f"assigned the value {self.value}, they are:"
            )
            return q, list(self.names), {"depths": self.depths}
        if name == "cwe":
            return self._cwe(n)
        return self._fwe(n)

    def _niah(self, n: int) -> tuple[str, list[str], dict]:
        name = self.task.name
        needles = [_needle(k, v) for k, vs in zip(self.keys, self.values) for v in vs]
        hay = "".join(_insert([NOISE] * n, needles, self.depths))
        what = "special magic numbers" if name != "niah_uuid" else "special magic UUIDs"
        if name == "niah_uuid":
            hay = hay.replace("magic numbers for", "magic UUIDs for")
        intro = (
            f"Some {what} are hidden within the following text. Make sure to memorize them. I will quiz you about "
            "them afterwards.\n"
        )
        meta = {"depths": self.depths}
        if name == "niah_multiquery":
            keys = ", ".join(self.keys[:-1]) + f" and {self.keys[-1]}"
            q = f"What are all the special magic numbers for {keys} mentioned in the provided text?"
            refs = [v[0] for v in self.values]
            tail = f" The special magic numbers for {keys} mentioned in the provided text are"
        elif name == "niah_multivalue":
            key = self.keys[0]
            q = f"What are all the special magic numbers for {key} mentioned in the provided text?"
            refs = list(self.values[0])
            tail = f" The special magic numbers for {key} mentioned in the provided text are"
        else:
            key = self.keys[self.asked]
            unit = "UUID" if name == "niah_uuid" else "number"
            q = f"What is the special magic {unit} for {key} mentioned in the provided text?"
            refs = list(self.values[self.asked])
            tail = f" The special magic {unit} for {key} mentioned in the provided text is"
            meta["key"] = key
        if self.task.decode_heavy:
            topic = TOPICS[self.index % len(TOPICS)]
            meta["ask"] = q + tail
            meta["topic"] = topic
            return (
                f"{intro}{hay}\nRemember the special magic number for {key}: I will ask you about it later. First, "
                f"write a long story about {topic}.",
                refs,
                meta,
            )
        return f"{intro}{hay}\n{q}{tail}", refs, meta

    def _cwe(self, n: int) -> tuple[str, list[str], dict]:
        rng = random.Random(self.seed)
        each = max(3, n // 40)  # the common words fill a quarter of the list; every other word occurs twice
        rare = _distinct(rng, max(0, (n - 10 * each) // 2), _word)
        rare = [w for w in rare if w not in self.words]
        items = [w for w in self.words for _ in range(each)] + [w for w in rare for _ in range(2)]
        rng.shuffle(items)
        listing = " ".join(f"{i}. {w}" for i, w in enumerate(items, 1))
        q = (
            "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            f"ones that appear most often.\n{listing}\nQuestion: What are the 10 most common words in the above "
            "list? Answer: The top 10 words that appear most often in the list are:"
        )
        return q, list(self.words), {"each": each}

    def _fwe(self, n: int) -> tuple[str, list[str], dict]:
        rng = random.Random(self.seed)
        vocab = _distinct(rng, 60, lambda r: _word(r, 2))
        weights = [1 / (k + 1) ** 2 for k in range(len(vocab))]
        draws = rng.choices(vocab, weights=weights, k=max(n, 30))
        _strict_top(draws, vocab, rng)
        counts = {w: draws.count(w) for w in vocab}
        top = sorted(vocab, key=lambda w: (-counts[w], vocab.index(w)))[:3]
        text = " ".join(draws)
        q = (
            "Read the following coded text and track the frequency of each coded word. Find the three most "
            f"frequently appeared coded words.\n{text}\nQuestion: Do not provide any explanation. What are the three "
            "most frequently appeared words in the above coded text? Answer: "
            "According to the coded text above, the three most frequently appeared words are:"
        )
        return q, top, {"counts": [counts[w] for w in top]}


def _strict_top(draws: list[str], vocab: list[str], rng: random.Random) -> None:
    """Recode a few of ``draws`` in place so that the three most frequent words have strictly decreasing counts, all
    above every other word's: a tie would make the answer depend on the vocabulary order, not on the text.

    The answer words (the first three by count, then by vocabulary order) only gain occurrences, taken from the other
    words at positions chosen with ``rng``, so the text keeps its length; the others only lose some, so the targets,
    set from the counts before recoding, hold after it. Where too few other words occur (very short texts), the
    missing occurrences are inserted instead.
    """
    counts = {w: draws.count(w) for w in vocab}
    order = sorted(vocab, key=lambda w: (-counts[w], vocab.index(w)))
    top, rest = order[:3], set(order[3:])
    need, above = [], max((counts[w] for w in rest), default=0)
    for w in reversed(top):  # third, second, first: each one above the one after it
        above = max(counts[w], above + 1)
        need += [w] * (above - counts[w])
    donors = [i for i, w in enumerate(draws) if w in rest]
    for i, w in zip(rng.sample(donors, min(len(need), len(donors))), need):
        draws[i] = w
    for w in need[len(donors) :]:
        draws.insert(rng.randrange(len(draws) + 1), w)


def prompt_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` as :func:`vase.harness.generation.encode_prompts` feeds it (chat template included)."""
    from .generation import encode_prompts

    return int(encode_prompts(tokenizer, [text])["input_ids"].shape[1])


def fit(builder: _Builder, target: int, tokenizer) -> tuple[str, list[str], dict]:
    """The largest haystack whose prompt stays within ``target`` tokens (binary search over the units).

    Raises:
        DataError: if even an empty haystack is longer than ``target``.
    """
    lo, hi = 0, 8
    if prompt_tokens(tokenizer, builder.build(0)[0]) > target:
        raise DataError(f"{builder.task.label}: the context of {target} tokens cannot hold the task's question")
    while prompt_tokens(tokenizer, builder.build(hi)[0]) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        if prompt_tokens(tokenizer, builder.build(mid)[0]) <= target:
            lo = mid
        else:
            hi = mid
    text, refs, meta = builder.build(lo)
    meta["units"] = lo
    return text, refs, meta


def problems(label: str, tokenizer, count: int | None = None, context: int | None = None) -> list[Problem]:
    """The problems of a task: ``count`` of them (default :data:`DEFAULT_PROBLEMS`), each fitted to its length
    with ``tokenizer`` (the prompt plus :attr:`Task.answer_tokens` within the length; a decode-heavy task keeps
    :data:`QUESTION_TOKENS` more for its question, so that prompt, question and answer fit in the length and what is
    written comes on top).

    Raises:
        DataError: see :func:`parse_task` and :func:`fit`.
    """
    task = parse_task(label, context)
    out = []
    room = task.answer_tokens + (QUESTION_TOKENS if task.decode_heavy else 0)
    for i in range(count or DEFAULT_PROBLEMS):
        text, refs, meta = fit(_Builder(task, i), task.length - room, tokenizer)
        out.append(Problem(task.label, str(i), text, " | ".join(refs), "ruler", meta=meta))
    return out


def problem_ids(label: str, count: int | None = None) -> list[Problem]:
    """Placeholders of a task's problems (ids and task, no text): what merging shards needs without a tokenizer."""
    task = parse_task(label)
    return [Problem(task.label, str(i), "", None, "ruler") for i in range(count or DEFAULT_PROBLEMS)]


def needle_depth(text: str, needle: str) -> float:
    """Where ``needle`` sits in the haystack of ``text``: the share of noise sentences before it (0 to 1)."""
    at = text.index(needle)
    before, after = text[:at].count(NOISE), text[at:].count(NOISE)
    return before / max(before + after, 1) if before + after else math.nan
