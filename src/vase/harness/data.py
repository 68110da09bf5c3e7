"""Reasoning tasks from JSONL files: loading with field mapping, prompt templates per task kind.

The files of ``../shared/data/reasoning/`` are known by short names (``gsm8k``, ``math500``, ``aime24``, ``aime25``,
``aime26``, ``amc23``, ``hmmt25``, ``gpqa``); any other JSONL file works with ``question_field`` / ``answer_field``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

TASK_FILES = {
    "gsm8k": "gsm8k.jsonl",
    "math500": "math500.jsonl",
    "aime24": "aime24.jsonl",
    "aime25": "aime25.jsonl",
    "aime26": "aime26.jsonl",
    "amc23": "amc23.jsonl",
    "hmmt25": "hmmt25.jsonl",
    "gpqa": "gpqa_diamond_mcq.jsonl",
}
QUESTION_FIELDS = ("problem", "question", "prompt", "input")
ID_FIELDS = ("id", "idx", "unique_id")
KINDS = ("math", "mcq")
TEMPLATES = {
    "math": "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "mcq": (
        "{question}\nPlease reason step by step, and put the letter of the correct option (A, B, C or D) within "
        "\\boxed{{}}."
    ),
}
BUILTIN_PROMPT = (
    "A bakery sells muffins for $3 each and cookies for $2 each. On Monday it sold 24 muffins and 35 cookies. On "
    "Tuesday it sold twice as many muffins and 10 fewer cookies than on Monday. How much money did the bakery make "
    "on the two days together?"
)


class DataError(ValueError):
    """A task file or field could not be read; the message says what to do."""


@dataclass(frozen=True)
class Problem:
    """One problem: ``question`` text, reference ``answer`` (or None), ``kind`` ('math', 'mcq' or 'ruler' for the
    synthetic long-context tasks), ``meta``: what a generated problem records about itself (needle depths...)."""

    task: str
    id: str
    question: str
    answer: str | None
    kind: str
    meta: dict | None = field(default=None, compare=False)

    def prompt(self) -> str:
        """The question wrapped in its task kind's instruction template (a synthetic task's text is its prompt)."""
        return self.question if self.kind == "ruler" else TEMPLATES[self.kind].format(question=self.question)


def data_dir() -> Path:
    """Where the reasoning files are: ``$VASE_DATA_DIR`` or ``../shared/data/reasoning`` from the working directory."""
    return Path(os.environ.get("VASE_DATA_DIR", Path("..") / "shared" / "data" / "reasoning"))


def resolve_task(name_or_path: str) -> tuple[str, Path]:
    """A task short name or a file path -> (task name, file path). Does not check that the file exists."""
    if name_or_path in TASK_FILES:
        return name_or_path, data_dir() / TASK_FILES[name_or_path]
    path = Path(name_or_path).expanduser()
    return path.stem.replace("_diamond_mcq", ""), path


def read_jsonl(path: Path) -> list[dict]:
    """Read a JSONL file (one JSON object per line).

    Raises:
        DataError: missing file, a format other than JSONL, or a line that is not a JSON object.
    """
    if not path.exists():
        hint = "" if path.suffix else f" (known task names: {', '.join(TASK_FILES)}; or a path to a JSONL file)"
        raise DataError(f"data file not found: {path}{hint}")
    if path.suffix not in (".jsonl", ".json") and not path.name.endswith(".jsonl.txt"):
        raise DataError(
            f"unknown file format {path.suffix or '(none)'} for {path}: vase reads JSONL, one JSON object per line"
        )
    rows = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"line {n} of {path} is not valid JSON ({exc.msg}): vase reads JSONL") from None
            if not isinstance(row, dict):
                raise DataError(f"line {n} of {path} is not a JSON object: vase reads JSONL")
            rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no problems")
    return rows


def _gold(raw) -> str | None:
    if raw is None:
        return None
    text = str(raw)
    if "####" in text:  # GSM8K: reasoning then "#### 72"
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    return text.replace(",", "") if text.replace(",", "").replace(".", "", 1).lstrip("-").isdigit() else text


def load_problems(
    name_or_path: str,
    question_field: str | None = None,
    answer_field: str | None = "answer",
    kind: str | None = None,
    require_answer: bool = True,
) -> list[Problem]:
    """Load the problems of a task.

    Args:
        name_or_path: a task short name (see ``TASK_FILES``) or a JSONL path.
        question_field: field with the question (default: the first of problem, question, prompt, input).
        answer_field: field with the reference answer (GSM8K's "... #### 72" is reduced to "72").
        kind: 'math' or 'mcq' (default: 'mcq' for GPQA files or when every answer is a single letter A-J).
        require_answer: raise if the answer field is missing.

    Raises:
        DataError: a missing file or field (the message lists the fields present), an unknown format or kind.
    """
    task, path = resolve_task(name_or_path)
    rows = read_jsonl(path)
    fields = sorted({k for r in rows for k in r})
    qf = question_field or next((f for f in QUESTION_FIELDS if f in rows[0]), None)
    if qf is None or qf not in rows[0]:
        want = question_field or " / ".join(QUESTION_FIELDS)
        raise DataError(f"no question field {want!r} in {path} (fields: {', '.join(fields)}); use --question-field")
    missing = [i for i, r in enumerate(rows) if qf not in r]
    if missing:
        raise DataError(f"problem {missing[0]} of {path} has no field {qf!r}")
    if require_answer and (answer_field is None or any(answer_field not in r for r in rows)):
        raise DataError(f"no answer field {answer_field!r} in {path} (fields: {', '.join(fields)}); use --answer-field")
    golds = [_gold(r.get(answer_field)) if answer_field else None for r in rows]
    if kind is None:
        letters = all(g is not None and len(g) == 1 and g.upper() in "ABCDEFGHIJ" for g in golds)
        kind = "mcq" if ("gpqa" in path.name or letters) else "math"
    if kind not in KINDS:
        raise DataError(f"unknown task kind {kind!r}; choose one of {', '.join(KINDS)}")
    idf = next((f for f in ID_FIELDS if f in rows[0]), None)
    return [
        Problem(task=task, id=str(r[idf]) if idf else str(i), question=str(r[qf]).strip(), answer=g, kind=kind)
        for i, (r, g) in enumerate(zip(rows, golds))
    ]


def pick_problem(name_or_path: str, index: int, question_field: str | None = None) -> Problem:
    """Problem number ``index`` (0-based) of a task file, for ``vase generate --data``.

    Raises:
        DataError: an index out of range (gives the valid range), or any error of :func:`load_problems`.
    """
    problems = load_problems(name_or_path, question_field=question_field, require_answer=False)
    if not 0 <= index < len(problems):
        raise DataError(
            f"index {index} is out of range: the file has {len(problems)} problems (0..{len(problems) - 1})"
        )
    return problems[index]
