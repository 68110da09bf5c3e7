"""Accuracy sweeps: policies x budgets (or compression ratios) x tasks x seeds, one JSONL record per completion.

Layout of a results directory::

    config.json                      the sweep's configuration (a run refuses to mix configurations)
    records.jsonl                    one record per completion (or records.shard-I-of-N.jsonl per shard)

Records are appended and flushed after every batch, so an interrupt (even ``kill -9``) loses at most the batch in
flight; running the same command again skips what is done. ``--shard I/N`` splits the work units between machines;
:func:`merge` joins their directories.

A work unit is (task, problem, policy, budget, seed): k seeds give k samples per problem, and pass@1 is the mean
over problems of the per-problem mean correctness, with its standard error over problems.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator

from ..core.config import VaseConfig
from ..hf.models import check_load_options
from .data import Problem, load_problems
from .notes import warn
from .ruler import is_ruler, parse_task
from .ruler import references as ruler_references
from .ruler import score as ruler_score
from .summary import loop_flags, summarize  # noqa: F401 - the sweep's summary, importable from here too

CONFIG_FILE = "config.json"
RECORDS = "records.jsonl"


class RunConfig(BaseModel):
    """What every sweep's results depend on: the model, how it is loaded, the policies, the buffer."""

    model: str = "smollm2"
    dtype: str = "auto"
    attn: str = "sdpa"
    policies: list[str]
    buffer: int = 64

    @field_validator("policies")
    @classmethod
    def _known_policies(cls, v):
        from ..core.policies import make_policy

        for spec in v:
            make_policy(spec)  # raises with the list of valid names, or the bad option
        return v

    @model_validator(mode="after")
    def _learned_weights_for_this_model(self):
        """A learned scorer's weights name the model they were trained on: another model is refused before loading
        (its shape is checked again when the cache is made)."""
        from ..core.policies import make_policy

        for spec in self.policies:
            weights = getattr(make_policy(spec).scorer, "weights", None)
            if weights is not None and weights.model and weights.model != self.model:
                raise ValueError(
                    f"policy {spec!r}: its learned scorer weights were trained on the model {weights.model!r}, this "
                    f"run uses {self.model!r}: train weights on it (vase train-scorer)"
                )
        return self

    @property
    def has_published(self) -> bool:
        """Whether a policy of the sweep is the published preset (``preset=paper``): budgets derived from ratios
        are then rounded to multiples of the buffer, for every policy alike."""
        from ..core.policies import make_policy

        return any(make_policy(p).published for p in self.policies)

    @field_validator("ratios", check_fields=False)
    @classmethod
    def _ratios(cls, v):
        for r in v:
            if not r > 1:
                raise ValueError(f"compression ratio must be > 1, got {r}")
        return v


class EvalConfig(RunConfig):
    """Everything that decides the results of an accuracy sweep (the shard excepted)."""

    tasks: list[str]
    budgets: list[int] = Field(default_factory=list)
    ratios: list[float] = Field(default_factory=list)
    seeds: list[int] = Field(default_factory=lambda: [0])
    limit: int | None = None
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 0.95
    top_k: int = 20
    question_field: str | None = None
    answer_field: str = "answer"
    policy_options: dict = Field(default_factory=dict)
    kept_dynamics: bool = False  # record the kept-set overlap at each eviction and the loop's onset

    @field_validator("tasks")
    @classmethod
    def _task_labels(cls, v):
        from .ruler import is_ruler, parse_task

        return [parse_task(t).label if is_ruler(t) else t for t in v]  # one spelling per synthetic task

    def sizes(self) -> list[tuple[str, float]]:
        """The cache sizes of the grid: ('budget', tokens) and ('ratio', r) entries."""
        out = [("budget", float(b)) for b in self.budgets] + [("ratio", float(r)) for r in self.ratios]
        if not out:
            raise ValueError("give at least one budget or compression ratio")
        return out


def unit_key(task: str, problem_id: str, policy: str, size: tuple[str, float], seed: int) -> str:
    """The identity of a work unit (one completion), as stored records are matched on resume."""
    return f"{task}|{problem_id}|{policy}|{size[0]}={size[1]:g}|{seed}"


def record_key(rec: dict) -> str:
    """:func:`unit_key` of a stored record."""
    size = ("ratio", rec["ratio"]) if rec.get("ratio") is not None else ("budget", rec["budget"])
    return unit_key(rec["task"], rec["problem_id"], rec["policy"], size, rec["seed"])


def parse_shard(text: str | None) -> tuple[int, int]:
    """``'I/N'`` -> (I, N) with 0 <= I < N; None -> (0, 1).

    Raises:
        ValueError: for a malformed shard.
    """
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"shard {text!r}: need 0 <= I < N")
    return i, n


def records_path(out: Path, shard: tuple[int, int]) -> Path:
    """The records file of a shard inside a results directory."""
    return out / (RECORDS if shard[1] == 1 else f"records.shard-{shard[0]}-of-{shard[1]}.jsonl")


def repair_tail(path: Path) -> None:
    """Cut a torn last line (a write interrupted by ``kill -9``) so that appending starts on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as fh:
        data = fh.read()
        if data.endswith(b"\n"):
            return
        fh.truncate(data.rfind(b"\n") + 1)


def append_records(fh, records: Iterable[dict]) -> None:
    """Append ``records`` to an open JSONL file, one per line, and force them to disk (an interrupt, even ``kill
    -9``, then loses nothing written before)."""
    for rec in records:
        fh.write(json.dumps(rec) + "\n")
    fh.flush()
    os.fsync(fh.fileno())


def read_records(path: Path) -> list[dict]:
    """Records of a JSONL file; a truncated last line (interrupted write) is ignored."""
    out = []
    if not path.exists():
        return out
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def all_records(out: Path) -> list[dict]:
    """Every record under a results directory (all shards), without duplicates."""
    seen, recs = set(), []
    for path in sorted(out.glob("records*.jsonl")):
        for r in read_records(path):
            k = record_key(r)
            if k not in seen:
                seen.add(k)
                recs.append(r)
    return recs


def check_results_dir(out: Path) -> None:
    """Check that ``out`` can be a results directory: it and the folders above it are folders or do not exist yet.

    Raises:
        ValueError: if ``out`` or a folder above it is a file.
    """
    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            raise ValueError(
                f"{out} cannot be a results directory: {folder} is a file; give a new folder, or the folder of an "
                "earlier run to resume it"
            )


def check_same_config(out: Path, config: RunConfig) -> None:
    """Check, before any work, that ``out`` is a new results directory or one of the same configuration.

    Raises:
        ValueError: if ``out`` (or a folder above it) is a file, or ``out`` holds results of another configuration:
            the message names every field that differs, with both values.
    """
    check_results_dir(out)
    path = out / CONFIG_FILE
    if not path.exists():
        return
    mine, theirs = json.loads(config.model_dump_json()), json.loads(path.read_text())
    fields = type(config).model_fields
    for k in set(mine) - set(theirs):  # a field added since that run: its default there
        if not fields[k].is_required():
            theirs[k] = json.loads(json.dumps(fields[k].get_default(call_default_factory=True)))
    diffs = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if diffs:
        what = "; ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} now" for k in diffs)
        raise ValueError(
            f"{out} holds results of another configuration ({what}); rerun with the same options to resume, or give "
            "a new --out to start afresh"
        )


def prepare_dir(out: Path, config: RunConfig) -> None:
    """Create ``out`` with its config, or check that an existing one holds the same configuration. Call it only once
    the run can start (options checked, model loaded): a run that fails before leaves no folder behind.

    Raises:
        ValueError: see :func:`check_same_config`.
    """
    check_same_config(out, config)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CONFIG_FILE
    if not path.exists():
        path.write_text(json.dumps(json.loads(config.model_dump_json()), indent=1) + "\n")


def load_config(out: Path) -> EvalConfig:
    """The :class:`EvalConfig` saved in a results directory.

    Raises:
        ValueError: if ``out`` has no ``config.json``.
    """
    path = out / CONFIG_FILE
    if not path.exists():
        raise ValueError(f"{out} is not a vase results directory (no {CONFIG_FILE})")
    return EvalConfig.model_validate_json(path.read_text())


def work_units(config: EvalConfig, problems: dict[str, list[Problem]]) -> list[tuple]:
    """All (task, problem, policy, size, seed) units of the grid, in a fixed order (``full`` at one size only)."""
    units = []
    for task in config.tasks:
        for policy in config.policies:
            # the full cache does not depend on the cache size: run it once, at the first size of the grid
            for size in config.sizes()[:1] if policy == "full" else config.sizes():
                for seed in config.seeds:
                    for p in problems[task]:
                        units.append((task, p, policy, size, seed))
    return units


def shard_units(units: list[tuple], shard: tuple[int, int]) -> list[tuple]:
    """Every N-th unit starting at I, for shard (I, N)."""
    i, n = shard
    return [u for j, u in enumerate(units) if j % n == i]


def _batches(units: list[tuple], size: int) -> Iterator[list[tuple]]:
    """Consecutive units that share (task, policy, size), at most ``size`` at a time."""
    batch: list[tuple] = []
    for u in units:
        if batch and (batch[0][0], batch[0][2], batch[0][3]) != (u[0], u[2], u[3]) or len(batch) == size:
            yield batch
            batch = []
        batch.append(u)
    if batch:
        yield batch


def run_sweep(
    config: EvalConfig,
    out: Path,
    shard: tuple[int, int] = (0, 1),
    batch_size: int = 4,
    device: str = "auto",
    progress: bool = True,
    lm=None,
) -> Path:
    """Run (or resume) a sweep; returns the records file.

    Raises:
        ValueError: another configuration in ``out``, unknown task files or fields, bad grid values.
    """
    from tqdm.auto import tqdm

    from ..hf.models import load_model
    from .dynamics import KeptDynamics, record_fields
    from .generation import encode_prompts, generate
    from .grading import grade
    from .loops import loop_flag, paper_loop

    problems = task_problems(config)
    config.sizes()
    check_load_options(config.dtype, device, config.attn)
    prepare_dir(out, config)
    path = records_path(out, shard)
    repair_tail(path)
    done = {record_key(r) for r in read_records(path)}
    units = shard_units(work_units(config, problems), shard)
    todo = [u for u in units if unit_key(u[1].task, u[1].id, u[2], u[3], u[4]) not in done]
    if not todo:
        return path
    lm = lm or load_model(config.model, dtype=config.dtype, device=device, attn=config.attn)
    if any(is_ruler(t) for t in config.tasks):  # generated now, fitted to their lengths with the model's tokenizer
        problems = task_problems(config, lm.tokenizer, lm.context_length)
        real = {(p.task, p.id): p for ps in problems.values() for p in ps}
        todo = [(t, real[(p.task, p.id)], *rest) for t, p, *rest in todo]
    budgets = _ratio_budgets(config, problems, lm.tokenizer, encode_prompts)
    # one configuration per policy, resolved once (the budget of each work unit is set on it below)
    resolved = {
        p: VaseConfig.resolve(p, buffer=config.buffer, per_sequence=True, **config.policy_options)
        for p in config.policies
    }
    bar = tqdm(
        total=len(units),
        initial=len(units) - len(todo),
        desc=f"eval {out.name}",
        unit="completion",
        disable=not progress,
        dynamic_ncols=True,
    )
    with path.open("a", encoding="utf-8") as fh:
        for batch in _batches(todo, batch_size):
            task, _, policy, size, _ = batch[0]
            budget = int(size[1]) if size[0] == "budget" else budgets[(task, size[1])]
            new_tokens, follow_up_tokens = generated_tokens(task, config)
            cfg = resolved[policy].with_budget(budget)
            watch = KeptDynamics(cfg.sinks, cfg.recent) if config.kept_dynamics and cfg.policy.evicts else None
            start = time.perf_counter()
            res = generate(
                lm.model,
                lm.tokenizer,
                [u[1].prompt() for u in batch],
                config=cfg,
                seed=[u[4] for u in batch],
                observe=watch,
                max_new_tokens=new_tokens,
                temperature=config.temperature,
                top_p=config.top_p,
                top_k=config.top_k,
                **(
                    {"follow_up": [u[1].meta["ask"] for u in batch], "follow_up_tokens": follow_up_tokens}
                    if follow_up_tokens
                    else {}
                ),
            )
            seconds = time.perf_counter() - start
            st = res.stats
            done_batch = []
            for i, ((_, problem, policy, size, seed), comp) in enumerate(zip(batch, res.completions)):
                answer, correct = grade(comp.text, problem.answer, problem.kind)
                extra = {}
                if config.kept_dynamics:  # the overlap at each eviction and where the loop begins
                    extra = record_fields(watch, i, comp, lm.tokenizer)
                if problem.kind == "ruler":  # the share of reference values found, and where the needles were
                    extra = {"score": ruler_score(comp.text, ruler_references(problem.answer))}
                    extra["meta"] = {k: v for k, v in (problem.meta or {}).items() if k != "ask"}
                    if comp.written is not None:
                        extra.update(written_tokens=comp.written_tokens, written=comp.written)
                rec = {
                    "task": problem.task,
                    "problem_id": problem.id,
                    "policy": policy,
                    "budget": budget,
                    "ratio": size[1] if size[0] == "ratio" else None,
                    "seed": seed,
                    "gold": problem.answer,
                    "answer": answer,
                    "correct": bool(correct),
                    "loop": loop_flag(comp.text, comp.finished),
                    "paper_loop": paper_loop(comp.text),
                    "new_tokens": comp.new_tokens,
                    "prompt_tokens": comp.prompt_tokens,
                    "finished": comp.finished,
                    "evictions": st.evictions,
                    "kv_bytes": st.bytes_held // max(st.batch, 1),
                    "kv_bytes_full": st.bytes_full // max(st.batch, 1),
                    "seconds": round(seconds, 3),
                    "batch_size": len(batch),
                    "text": comp.text,
                    **extra,
                }
                done_batch.append(rec)
            append_records(fh, done_batch)
            bar.update(len(batch))
    bar.close()
    return path


def task_problems(config: EvalConfig, tokenizer=None, context: int | None = None) -> dict[str, list[Problem]]:
    """The problems of each task of a sweep (the first ``limit``). Synthetic long-context tasks
    (:mod:`vase.harness.ruler`) are generated with ``tokenizer``; without one they are placeholders (ids only, what
    resuming and merging need).

    Raises:
        DataError: an unknown task file, field or synthetic task, a context longer than the model's.
    """
    from .ruler import problem_ids
    from .ruler import problems as ruler_problems

    out = {}
    for t in config.tasks:
        if not is_ruler(t):
            out[t] = load_problems(t, question_field=config.question_field, answer_field=config.answer_field)
        elif tokenizer is None:
            out[t] = problem_ids(t, config.limit)
        else:
            out[t] = ruler_problems(t, tokenizer, config.limit, context)
        out[t] = out[t][: config.limit]
    return out


def generated_tokens(task: str, config: EvalConfig) -> tuple[int, int]:
    """``(max_new_tokens, follow-up answer tokens or 0)`` of a task's completions: the sweep's ``max_new_tokens``
    for reasoning tasks; a synthetic task's answer tokens; for a decode-heavy one (``niah_decode``) the model writes
    ``max_new_tokens`` and then answers in at most its answer tokens."""
    if not is_ruler(task):
        return config.max_new_tokens, 0
    t = parse_task(task)
    return (config.max_new_tokens, t.answer_tokens) if t.decode_heavy else (t.answer_tokens, 0)


def _ratio_budgets(config: EvalConfig, problems, tokenizer, encode_prompts) -> dict:
    """Budget of each (task, ratio): (median prompt tokens + tokens generated) / ratio, at least sinks+buffer+1;
    rounded to the nearest multiple of the buffer when the sweep holds the published preset (``preset=paper``)."""
    from ..core.sizes import ratio_budget, ratio_note

    out = {}
    for task, plist in problems.items():
        if not config.ratios or not plist:
            continue
        lengths = [int(encode_prompts(tokenizer, [p.prompt()])["input_ids"].shape[1]) for p in plist[:50]]
        total = statistics.median(lengths) + sum(generated_tokens(task, config))
        for r in config.ratios:  # multiples of the buffer with the published method; the same for every policy
            out[(task, r)] = ratio_budget(total, r, config.buffer, published=config.has_published)
            warn(ratio_note(round(total), r, config.buffer, published=config.has_published))
    return out


def merge(dest: Path, sources: Iterable[Path]) -> tuple[int, int]:
    """Join the records of ``sources`` (results directories of one configuration, e.g. shards run on several
    machines) into ``dest/records.jsonl``. Returns (records written, units of the grid still missing).

    Raises:
        ValueError: if the sources hold different configurations.
    """
    sources = list(sources)
    if not sources:
        raise ValueError("give at least one results directory to merge")
    config = load_config(sources[0])
    for s in sources[1:]:
        other = load_config(s)
        if other != config:
            raise ValueError(f"{s} holds another configuration than {sources[0]}: cannot merge them")
    recs, seen = [], set()
    for s in [dest, *sources] if (dest / CONFIG_FILE).exists() else sources:
        for r in all_records(s):
            k = record_key(r)
            if k not in seen:
                seen.add(k)
                recs.append(r)
    prepare_dir(dest, config)
    tmp = dest / (RECORDS + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for r in recs:
            fh.write(json.dumps(r) + "\n")
    tmp.replace(dest / RECORDS)
    for shard_file in dest.glob("records.shard-*.jsonl"):
        shard_file.unlink()
    problems = task_problems(config)
    expected = {unit_key(u[1].task, u[1].id, u[2], u[3], u[4]) for u in work_units(config, problems)}
    return len(recs), len(expected - seen)
