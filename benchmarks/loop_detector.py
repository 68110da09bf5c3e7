"""Error rates of the loop flags: false positives on natural text cut at random points, recall on constructed loops.

.venv/bin/python benchmarks/loop_detector.py                               # held-out split (the figures in the docs)
.venv/bin/python benchmarks/loop_detector.py --split dev                   # the split the thresholds were chosen on
.venv/bin/python benchmarks/loop_detector.py --completions runs/eval-gsm8k-loops  # + finished completions

Natural text (every flag should stay silent), each piece cut at a uniformly random character:
  gsm8k      reference solutions of ../shared/data/reasoning/gsm8k.jsonl (calculator marks <<...>> removed), 2 cuts
  math500    reference solutions of math500.jsonl, 4 cuts each
  shakespeare windows of ../shared/data/text/tinyshakespeare.txt, 200-3,000 characters, ending at a random point
  completions the distinct completions of `vase eval` result folders that ended by themselves (EOS), 5 cuts each
             (all of them in both splits: the thresholds were fixed before any of them was generated)
Constructed loops (every flag should fire): a natural prefix (0-2,000 characters), then a unit repeated at least 3
times and over at least 200 characters (200-1,000), cut at a random point of the next repetition. Units:
  phrase     a random stretch of natural text, 5-300 characters (log-uniform length), repeated verbatim
  sentence   a whole sentence of natural text (up to 300 characters) with a random separator, repeated verbatim
  numbers    a sentence with numbers (natural, or a calculation template); every repetition draws new numbers
  tokens     a word or 2-3 words, with a random whitespace separator (" ", "  ", "\\n", "\\n\\n", "\\t") each time
  case       a stretch of 10-300 characters whose first letter changes case and last punctuation mark changes
  drift      a sentence repeated verbatim, then a last repetition in which one word is another, cut after that word
  short      a short unit repeated verbatim only 6-25 times (below the 200 characters above), cut at a random point
             of the next repetition: half the units are a stretch of natural text (5-15 characters, its whitespace
             collapsed, then a random separator), half a short step with fixed numbers ("so x = 3, ", "\\boxed{7} ",
             "1+1=2 ", "Wait, "; 5-16 characters)
Items are split by index parity (dev = even, test = odd; shakespeare: first / second half of the file) and the
random cuts use another seed in each split, so the thresholds in src/vase/harness/loops.py were set on text that
the test figures never saw. Rates come with a 95% Wilson interval.

--dense (used to set SHORT_MIN_REPEATS on the dev split): every cut point of the split's natural text, not a random
few, at which identical repetitions of a unit of 5-23 normalised characters end (the short-unit rule), counted for
2-6 repetitions, with numbers kept (the rule) and with numbers normalised to 0 and a letter required (the rule had
it counted repetitions whose numbers change).

Flags compared: `loop` (vase.harness.loops.ends_in_loop, the text check of the reported loop rate), `loop, no drift`
(the same with the run required to reach the very end), `loop, span rule only` (the same without the short-unit
rule: the detector before that rule was added), `paper` (the VaSE reference regex,
vase.harness.loops.paper_loop) and `old` (the flag vase reported before, "a 10-character unit occurs 3 times in the
last 500 characters", reimplemented here for comparison only).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from vase.harness.loops import (
    _LETTER,
    MIN_SPAN,
    MIN_UNIT,
    SHORT_MIN_REPEATS,
    _primitive_period,
    ends_in_loop,
    find_loop,
    normalise,
    paper_loop,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SEPARATORS = [" ", "  ", "\n", "\n\n", "\t"]
SPLIT_SEED = {"dev": 0, "test": 1}


# --- the flag vase used before (for comparison only) ---------------------------------------------------------------
def old_flag(text: str) -> bool:
    """The former ``hit_limit_while_repeating`` for an unfinished text: a loop at the end (10-40 character unit
    repeated 5 times) or any non-blank 10-character unit occurring 3 times, without overlap, in the last 500."""
    if re.search(r"(.{10,40}?)\1{4,}\s*\Z", text.rstrip()[-500:], re.DOTALL):
        return True
    tail, starts = text.rstrip()[-500:], {}
    for i in range(len(tail) - 9):
        unit = tail[i : i + 10]
        if unit.isspace():
            continue
        seen = starts.setdefault(unit, [])
        if not seen or i - seen[-1] >= 10:
            seen.append(i)
            if len(seen) >= 3:
                return True
    return False


def end_anchored(text: str) -> bool:
    """The loop check without the drift allowance: the run must reach the end of the text."""
    return find_loop(text, drift=False) is not None


def span_rule_only(text: str) -> bool:
    """The loop check without the short-unit rule (identical repetitions counted instead of characters)."""
    return find_loop(text, short_repeats=None) is not None


FLAGS: dict[str, Callable[[str], bool]] = {
    "loop": ends_in_loop,
    "loop, no drift": end_anchored,
    "loop, span rule only": span_rule_only,
    "paper": paper_loop,
    "old": old_flag,
}


# --- natural text ---------------------------------------------------------------------------------------------------
def _jsonl(name: str) -> list[dict]:
    path = DATA / "reasoning" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is not here: the benchmark needs the shared data of this workplace")
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _half(items: list, split: str) -> list:
    return items[0::2] if split == "dev" else items[1::2]


def gsm8k_solutions(split: str) -> list[str]:
    """GSM8K reference solutions of the split, calculator marks ``<<3*4=12>>`` removed."""
    return [re.sub(r"<<[^>]*>>", "", r["answer"]) for r in _half(_jsonl("gsm8k.jsonl"), split)]


def math_solutions(split: str) -> list[str]:
    return [r["solution"] for r in _half(_jsonl("math500.jsonl"), split)]


def shakespeare(split: str) -> str:
    path = DATA / "text" / "tinyshakespeare.txt"
    if not path.exists():
        raise FileNotFoundError(f"{path} is not here: the benchmark needs the shared data of this workplace")
    text = path.read_text(encoding="utf-8")
    return text[: len(text) // 2] if split == "dev" else text[len(text) // 2 :]


def finished_completions(dirs: list[Path]) -> list[str]:
    """Distinct texts of the completions that ended by themselves in ``vase eval`` result folders (records*.jsonl),
    in file order."""
    texts = []
    for d in dirs:
        for path in sorted(Path(d).glob("records*.jsonl")):
            with path.open(encoding="utf-8") as fh:
                for line in fh:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if rec.get("finished") and rec.get("text"):
                        texts.append(rec["text"])
    return list(dict.fromkeys(texts))  # each distinct text once (greedy runs repeat themselves)


def _cut(rng: random.Random, text: str) -> str:
    """The text up to a uniformly random character (1 to all of it)."""
    return text[: rng.randint(1, len(text))] if text else text


def natural_cuts(split: str, completions: list[Path] = (), scale: float = 1.0) -> dict[str, list[str]]:
    """Natural text cut at random points, per source; ``scale`` < 1 keeps that share of the pieces (tests)."""
    rng = random.Random(1000 + SPLIT_SEED[split])

    def some(items):
        return items if scale >= 1 else rng.sample(items, max(1, round(scale * len(items))))

    out = {
        "gsm8k": [_cut(rng, t) for t in some(gsm8k_solutions(split)) for _ in range(2)],
        "math500": [_cut(rng, t) for t in some(math_solutions(split)) for _ in range(4)],
    }
    play = shakespeare(split)
    windows = []
    for _ in range(round(1000 * min(scale, 1.0))):
        length = rng.randint(200, 3000)
        start = rng.randrange(0, len(play) - length)
        windows.append(play[start : start + length])
    out["shakespeare"] = windows
    if completions:
        finished = finished_completions(list(completions))
        out["completions"] = [_cut(rng, t) for t in some(finished) for _ in range(5)]
    return out


# --- constructed loops ----------------------------------------------------------------------------------------------
_NUM = re.compile(r"\d+(?:\.\d+)?")
TEMPLATES = [
    "So {} + {} = {}.",
    "Let me check: {} * {} = {}, not {}. ",
    "Step {}: the total is {} dollars, since {} - {} = {}.\n",
    "Wait, {} / {} is {}. Let me recompute.\n\n",
    "x = {} gives {}^2 = {}, which is not {}. Try again with x = {}.\n",
]
SHORT_TEMPLATES = [
    "so x = {}, ",
    "\\boxed{{{}}} ",
    "{}+{}={} ",
    "x = {}. ",
    "{} * {} = {}, ",
    "Wait, ",
    "Hmm, wait. ",
    "Let me see. ",
]


def _sentences(texts: list[str]) -> list[str]:
    out = []
    for t in texts:
        out += [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", t) if 5 <= len(s.strip()) <= 300]
    return out


def _stretch(rng: random.Random, text: str, lo: int, hi: int) -> str:
    """A stretch of ``text`` of log-uniform length in [lo, hi]."""
    n = min(len(text), round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    start = rng.randrange(0, len(text) - n + 1)
    return text[start : start + n]


def _new_numbers(rng: random.Random, unit: str) -> str:
    return _NUM.sub(lambda m: str(rng.randint(0, 10 ** rng.randint(1, 4))), unit)


def _flip(rng: random.Random, unit: str) -> str:
    """Change the case of the first letter and swap the last punctuation mark that ends a word or the unit for
    another (same length; a decimal point inside a number is left alone)."""
    for i, c in enumerate(unit):
        if c.isalpha():
            unit = unit[:i] + (c.lower() if c.isupper() else c.upper()) + unit[i + 1 :]
            break
    for i in range(len(unit) - 1, -1, -1):
        if unit[i] in ".,;:!?" and (i == len(unit) - 1 or unit[i + 1].isspace()):
            return unit[:i] + rng.choice([p for p in ".,;:!?" if p != unit[i]]) + unit[i + 1 :]
    return unit


def _repeat(rng: random.Random, make: Callable[[], str], min_chars: int, max_chars: int) -> str:
    """Repetitions from ``make()`` (at least 3, at least ``target`` characters), then part of one more."""
    target = rng.randint(min_chars, max_chars)
    parts: list[str] = []
    while len(parts) < 3 or sum(map(len, parts)) < target:
        parts.append(make())
    last = make()
    return "".join(parts) + last[: rng.randrange(0, len(last))]


def constructed_loops(split: str, per_kind: int = 300, min_chars: int = 200, max_chars: int = 1000) -> dict:
    """``per_kind`` loops of each kind (see the module docstring), each after a natural prefix."""
    rng = random.Random(2000 + SPLIT_SEED[split])
    pool = gsm8k_solutions(split) + math_solutions(split)
    play = shakespeare(split)
    sentences = _sentences(pool) + _sentences([play[i : i + 20000] for i in range(0, 200000, 20000)])
    numbered = [s for s in sentences if _NUM.search(s)]
    words = re.findall(r"[A-Za-z]{2,12}", " ".join(pool[:300]))

    def prefix():
        source = rng.choice(pool + [play[rng.randrange(len(play) - 3000) :][:3000]])
        return source[: rng.randint(0, min(len(source), 2000))]

    def phrase():
        unit = _stretch(rng, rng.choice(pool + [play[rng.randrange(len(play) - 400) :][:400]]), 5, 300)
        while len(unit) < 5:
            unit = _stretch(rng, rng.choice(pool), 5, 300)
        return lambda: unit

    def sentence():
        unit = rng.choice(sentences) + rng.choice(SEPARATORS)
        return lambda: unit

    def numbers():
        if rng.random() < 0.5:
            unit = rng.choice(numbered) + rng.choice(SEPARATORS)
            return lambda: _new_numbers(rng, unit)
        template = rng.choice(TEMPLATES)
        return lambda: template.format(*(rng.randint(0, 10 ** rng.randint(1, 4)) for _ in range(5)))

    def tokens():
        unit = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
        return lambda: unit + rng.choice(SEPARATORS)

    def drift():
        unit = rng.choice(sentences) + rng.choice(SEPARATORS)
        return lambda: unit

    def case():
        unit = _stretch(rng, rng.choice(pool), 10, 300)
        while len(unit) < 10:
            unit = _stretch(rng, rng.choice(pool), 10, 300)
        state = {"u": unit}

        def make():
            state["u"] = _flip(rng, state["u"])
            return state["u"]

        return make

    kinds = {"phrase": phrase, "sentence": sentence, "numbers": numbers, "tokens": tokens, "case": case}
    out = {}
    for name, factory in kinds.items():
        out[name] = [prefix() + _repeat(rng, factory(), min_chars, max_chars) for _ in range(per_kind)]
    out["drift"] = []
    for _ in range(per_kind):
        make = drift()
        loop = _repeat(rng, make, min_chars, max_chars)
        unit = make()
        cut = len(loop) - len(loop) % len(unit) if len(loop) % len(unit) else len(loop)  # end of the full repetitions
        out["drift"].append(prefix() + loop[:cut] + _drifted(rng, unit, words))
    out["short"] = short_loops(split, per_kind)
    return out


def short_loops(split: str, n: int) -> list[str]:
    """Short units (5-16 characters) repeated verbatim 6-25 times after a natural prefix, cut at a random point of
    the next repetition (the `short` kind; its own random stream, so that the other kinds stay as they were)."""
    rng = random.Random(4000 + SPLIT_SEED[split])
    pool = gsm8k_solutions(split) + math_solutions(split)
    play = shakespeare(split)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            unit = rng.choice(SHORT_TEMPLATES).format(*(rng.randint(0, 99) for _ in range(3)))
        else:
            stretch = ""
            while len(stretch) < 4:
                source = rng.choice(pool + [play[rng.randrange(len(play) - 400) :][:400]])
                stretch = " ".join(_stretch(rng, source, 5, 15).split())
            unit = stretch + rng.choice(SEPARATORS)
        source = rng.choice(pool + [play[rng.randrange(len(play) - 3000) :][:3000]])
        prefix = source[: rng.randint(0, min(len(source), 2000))]
        out.append(prefix + unit * rng.randint(6, 25) + unit[: rng.randrange(len(unit))])
    return out


def _drifted(rng: random.Random, unit: str, words: list[str]) -> str:
    """The unit with one word swapped for another (of any length), cut at a random point after the swap."""
    spans = [m.span() for m in re.finditer(r"[A-Za-z]+", unit)]
    if not spans:
        return unit[: rng.randrange(len(unit))]
    a, b = rng.choice(spans)
    changed = unit[:a] + rng.choice(words) + unit[b:]
    return changed[: rng.randint(a + 1, len(changed))]


def boundary_loops(split: str, per_cell: int = 100) -> dict:
    """Phrase loops with exactly ``r`` full repetitions (then part of one more), per unit length: what the flags
    catch near their thresholds. {(length range, r): [texts]}."""
    rng = random.Random(3000 + SPLIT_SEED[split])
    pool = gsm8k_solutions(split) + math_solutions(split)
    out = {}
    for lo, hi in ((5, 20), (21, 60), (61, 300)):
        for r in (2, 3, 4, 6, 10, 20):
            texts = []
            for _ in range(per_cell):
                unit = ""
                while len(unit) < lo:
                    unit = _stretch(rng, rng.choice(pool), lo, hi)
                prefix = rng.choice(pool)
                texts.append(prefix[: rng.randint(0, len(prefix))] + unit * r + unit[: rng.randrange(len(unit))])
            out[(f"{lo}-{hi}", r)] = texts
    return out


# --- every cut point: the short-unit rule -----------------------------------------------------------------------------
def short_run_repeats(s: str, max_unit: int = MIN_SPAN // SHORT_MIN_REPEATS - 1, letter: bool = False) -> list[int]:
    """For each cut point ``e`` of the normalised text ``s`` (``s[:e]``, 1 <= e <= len(s)), the most identical
    repetitions of a unit of :data:`MIN_UNIT`-``max_unit`` characters, not a multiple of a shorter one (and holding a
    letter with ``letter``), that ``s[:e]`` ends in; 0 at a cut after a space (a cut text is stripped)."""
    best = [0] * (len(s) + 1)
    for p in range(MIN_UNIT, max_unit + 1):
        run = 0  # characters equal to the one p before, in a row
        for i in range(p, len(s)):
            run = run + 1 if s[i] == s[i - p] else 0
            repeats = (run + p) // p
            if repeats >= 2 and repeats > best[i + 1] and s[i] != " ":
                unit = s[i + 1 - p : i + 1]
                if _primitive_period(unit) >= MIN_UNIT and (not letter or _LETTER.search(unit)):
                    best[i + 1] = repeats
    return best[1:]


def dense_short_runs(split: str) -> str:
    """Markdown: per natural source of the split, the cut points at which r identical repetitions of a short unit
    end, with numbers kept and with numbers normalised."""
    sources = {"gsm8k": gsm8k_solutions(split), "math500": math_solutions(split), "shakespeare": [shakespeare(split)]}
    reps = range(2, 7)
    lines = [
        f"Cut points of the natural text ({split}) ending in r or more identical repetitions of a unit of "
        f"{MIN_UNIT}-{MIN_SPAN // SHORT_MIN_REPEATS - 1} characters",
        "",
        "| texts | numbers | cut points | " + " | ".join(f"r >= {r}" for r in reps) + " |",
        "|---|---|---" + "|---" * len(reps) + "|",
    ]
    examples = []
    for name, texts in sources.items():
        for numbers in (False, True):
            counts, points = [0] * len(reps), 0
            for t in texts:
                s = normalise(t, numbers=numbers)
                best = short_run_repeats(s, letter=numbers)
                points += len(s)
                for j, r in enumerate(reps):
                    counts[j] += sum(b >= r for b in best)
                k = SHORT_MIN_REPEATS - 1
                ends = [e for e, b in enumerate(best) if b >= k and max(best[e + 1 : e + 25], default=0) < k]
                examples += [
                    f"{name}, numbers {'normalised' if numbers else 'kept'}: ...{s[e - 59 : e + 1]!r}" for e in ends
                ]
            kind = "normalised, letter needed" if numbers else "kept"
            lines.append(f"| {name} | {kind} | {points} | " + " | ".join(map(str, counts)) + " |")
    head = f"runs of {SHORT_MIN_REPEATS - 1} or more repetitions, where each ends (the first 20):"
    return "\n".join(lines + ["", head] + examples[:20])


# --- measuring ------------------------------------------------------------------------------------------------------
def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a rate k / n, as fractions."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rates(groups: dict[str, list[str]], flags: dict[str, Callable[[str], bool]]) -> dict:
    """{flag: {group: (flagged, total)}} plus an "all" group."""
    out = {}
    for fname, flag in flags.items():
        per = {g: (sum(map(flag, texts)), len(texts)) for g, texts in groups.items()}
        per["all"] = (sum(k for k, _ in per.values()), sum(n for _, n in per.values()))
        out[fname] = per
    return out


def table(title: str, res: dict, groups: list[str]) -> str:
    """Markdown: one row per group, one column per flag, cells "k / n = rate% [95% interval]"."""
    flags = list(res)
    lines = [title, "", "| texts | " + " | ".join(f"`{f}`" for f in flags) + " |", "|---" * (len(flags) + 1) + "|"]
    for g in groups:
        cells = []
        for f in flags:
            k, n = res[f][g]
            lo, hi = wilson(k, n)
            cells.append(f"{k} / {n} = {100 * k / max(n, 1):.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--split", choices=["dev", "test"], default="test")
    ap.add_argument("--completions", nargs="*", type=Path, default=[], help="vase eval result folders")
    ap.add_argument("--per-kind", type=int, default=300, help="constructed loops per kind")
    ap.add_argument("--show", type=int, default=3, help="print this many misses of each kind (flag `loop`)")
    ap.add_argument("--dense", action="store_true", help="only count the cut points of the short-unit rule")
    args = ap.parse_args(argv)
    if args.dense:
        print(dense_short_runs(args.split))
        return 0

    start = time.perf_counter()
    natural = natural_cuts(args.split, args.completions)
    loops = constructed_loops(args.split, args.per_kind)
    fp = rates(natural, FLAGS)
    rec = rates(loops, FLAGS)
    print(f"split {args.split}; {time.perf_counter() - start:.0f} s\n")
    print(table("False positives on natural text (flagged / cuts, 95% interval, %)", fp, [*natural, "all"]) + "\n")
    print(table("Recall on constructed loops (flagged / loops, 95% interval, %)", rec, [*loops, "all"]) + "\n")
    cells = boundary_loops(args.split)
    lengths = sorted({k[0] for k in cells}, key=lambda x: int(x.split("-")[0]))
    reps = sorted({k[1] for k in cells})
    print("Recall near the thresholds: phrase loops with exactly r full repetitions, by unit length (%)\n")
    print("| flag | unit length | " + " | ".join(f"r = {r}" for r in reps) + " |")
    print("|---|---" + "|---" * len(reps) + "|")
    for fname, flag in FLAGS.items():
        for length in lengths:
            row = [100 * sum(map(flag, cells[(length, r)])) / len(cells[(length, r)]) for r in reps]
            print(f"| {fname} | {length} | " + " | ".join(f"{x:.0f}" for x in row) + " |")
    print()
    texts = [t for group in natural.values() for t in group]
    tic = time.perf_counter()
    for t in texts:
        ends_in_loop(t)
    print(f"ends_in_loop: {1000 * (time.perf_counter() - tic) / len(texts):.2f} ms per natural text\n")
    for g, texts in natural.items():
        for t in [t for t in texts if ends_in_loop(t)][: args.show]:
            print(f"false positive ({g}): {find_loop(t)}\n    ...{t[-300:]!r}\n")
    for g, texts in loops.items():
        for t in [t for t in texts if not ends_in_loop(t)][: args.show]:
            print(f"missed ({g}): ...{t[-300:]!r}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
