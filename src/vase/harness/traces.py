"""The sources of a fidelity run (:mod:`vase.harness.fidelity`): ``{"id", "prompt": [ids], "continuation": [ids]}``,
either a task prompt with the model's own reasoning as continuation (a trace, generated once with the full cache and
kept in ``sources.jsonl`` so that an interrupted run resumes), or a window of a long text (``--source text:PATH``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .data import load_problems
from .evaluate import read_records

if TYPE_CHECKING:  # the configuration is fidelity's, which imports this module
    from .fidelity import FidelityConfig

SOURCES_FILE = "sources.jsonl"


def text_file(config: FidelityConfig) -> Path:
    """The file of a ``text:PATH`` source.

    Raises:
        ValueError: a file that does not exist or is not a file.
    """
    file = Path(config.source[5:]).expanduser()
    if file.is_dir():
        raise ValueError(f"{file} is a folder: --source text:PATH takes a plain text file")
    if not file.is_file():
        raise ValueError(f"text file not found: {file} (--source text:PATH takes a plain text file)")
    return file


def text_sources(config: FidelityConfig, tokenizer) -> list[dict]:
    """The ``config.prompts`` windows of a ``text:PATH`` source, evenly spaced: ``prefix_tokens`` of context then
    ``tokens`` of continuation each.

    Raises:
        ValueError: a missing file, or one shorter than ``prefix_tokens + tokens`` tokens.
    """
    file = text_file(config)
    ids = tokenizer(file.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    span = config.prefix_tokens + config.tokens
    if len(ids) < span:
        raise ValueError(
            f"{file} has {len(ids)} tokens, fewer than prefix + tokens = {span}: lower --tokens or use a longer file"
        )
    step = max((len(ids) - span) // max(config.prompts, 1), 1)
    return [
        {
            "id": f"{file.name}@{i * step}",
            "prompt": ids[i * step : i * step + config.prefix_tokens],
            "continuation": ids[i * step + config.prefix_tokens : i * step + span],
        }
        for i in range(config.prompts)
    ]


def build_sources(config: FidelityConfig, lm, progress: bool = True, path: Path | None = None) -> list[dict]:
    """The run's ``config.prompts`` sources: ``{"id", "prompt": [ids], "continuation": [ids]}``.

    Text windows are cut afresh (their spacing depends on ``prompts``). Task sources are the model's own greedy
    reasoning with the full cache, ``config.tokens`` tokens each (about a minute per source on a CPU): with ``path``,
    the sources of that length already in that JSONL file are reused by id and the file is rewritten (atomically)
    after each new source, so an interrupted run keeps what it generated and ``--prompts 20`` on a folder of 10
    generates 10.

    Raises:
        ValueError: a text file that is missing or shorter than ``prefix_tokens + tokens``; an unknown task.
    """
    if config.source.startswith("text:"):
        out = text_sources(config, lm.tokenizer)
        if path is not None:
            write_sources(path, out)
        return out
    from tqdm.auto import tqdm

    from .generation import encode_prompts, generate

    # reuse only traces of this run's length (a sources file copied from a run with other --tokens is regenerated)
    have = {s["id"]: s for s in read_records(path) if len(s["continuation"]) == config.tokens} if path else {}
    problems = load_problems(config.source, require_answer=False)[: config.prompts]
    out = [have[f"{p.task}:{p.id}"] for p in problems if f"{p.task}:{p.id}" in have]
    todo = [p for p in problems if f"{p.task}:{p.id}" not in have]
    for p in tqdm(todo, desc="reference reasoning (full cache)", disable=not progress, dynamic_ncols=True):
        res = generate(
            lm.model,
            lm.tokenizer,
            p.prompt(),
            policy="full",
            budget=config.tokens + 64,
            max_new_tokens=config.tokens,
            min_new_tokens=config.tokens,
            seed=config.seed,
        )
        prompt = encode_prompts(lm.tokenizer, [p.prompt()])["input_ids"][0].tolist()
        out.append({"id": f"{p.task}:{p.id}", "prompt": prompt, "continuation": res.completions[0].token_ids})
        if path is not None:
            write_sources(path, out)
    order = {f"{p.task}:{p.id}": i for i, p in enumerate(problems)}
    out.sort(key=lambda s: order[s["id"]])
    if path is not None:
        write_sources(path, out)
    return out


def write_sources(path: Path, sources: list[dict]) -> None:
    """Write ``sources`` to the JSONL file ``path`` through a temporary file and a rename (never half-written)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for s in sources:
            fh.write(json.dumps(s) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
