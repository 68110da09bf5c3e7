"""Kept-set dynamics during free generation: does a loop start once the kept set stops changing?

The fixed-point question of the VaSE paper's open problems (arXiv 2606.03928, the "cache diversity" argument for
sampled eviction): top-k selection could fall into a fixed point where each eviction keeps the same entries, the
model then reads the same context step after step, and generation loops. ``vase analyze`` measures how kept sets
overlap on teacher-forced replays; a loop, though, only exists in free generation. This module measures the same
overlap while ``vase eval --kept-dynamics`` generates, and places it against where the completion's loop begins:

- :class:`KeptDynamics`: an observer of :func:`vase.harness.generation.generate` (called after each forward pass);
  after each eviction of a row it reads the positions every (layer, KV head) holds and records, per eviction, the
  tokens generated so far, the **overlap** (the share of the entries the previous eviction chose, sinks and the
  recent window left out, that this one kept; the definition of ``vase analyze``) and the **settled share** (the
  share of (layer, KV head) whose overlap is at least :data:`SETTLED`);
- :func:`loop_onset`: the generated token at which the loop a completion ends in begins (its first repetition);
- :func:`fixed_point_rows` / :func:`dynamics_section`: per (policy, size), the overlap before and after the onset
  of the looped completions against the same stretch of the others, and how often the kept set had settled before
  the loop began; ``vase report`` prints them with a plot aligned on the onset.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .mechanism import held_masks

SETTLED = 0.99  # overlap at which a (layer, KV head)'s kept set counts as unchanged (as in ``vase analyze``)
WINDOW = 256  # generated tokens before and after a loop's onset that the table compares


class KeptDynamics:
    """Observer of :func:`~vase.harness.generation.generate` (``observe=``): the kept-set overlap of each row at each
    of its evictions.

    Args:
        sinks: the policy's attention sinks (positions below are kept by rule, not chosen).
        recent: the recent window kept by rule (the buffer), in tokens.

    Attributes:
        rows: per batch row, a list of ``[new_tokens, overlap, settled]`` per eviction after its first: ``new_tokens``
            generated when it evicted, ``overlap`` the mean over (layer, KV head) of the share of the entries the
            previous eviction chose still held (NaN where no (layer, KV head) had chosen any), ``settled`` the share
            of (layer, KV head) with overlap >= :data:`SETTLED`.
    """

    def __init__(self, sinks: int, recent: int):
        self.sinks, self.recent = sinks, recent
        self.rows: list[list[list[float]]] = []
        self._count: list[int] = []
        self._chosen: list[tuple[torch.Tensor, int] | None] = []

    def __call__(self, cache) -> None:
        sched = cache.seq.schedule
        batch = cache.batch or 0
        if len(self.rows) < batch:
            grow = batch - len(self.rows)
            self.rows += [[] for _ in range(grow)]
            self._count += [0] * grow
            self._chosen += [None] * grow
        for row in range(batch):
            n = sched.evictions[row]
            if n == self._count[row]:
                continue
            self._count[row] = n
            seen = sched.seen[row]
            held = held_masks(cache, seen, row)  # [L, H, seen]
            prev = self._chosen[row]
            if prev is not None:
                chosen, _ = prev
                kept = chosen.sum(-1)
                share = (chosen & held[:, :, : chosen.shape[-1]]).sum(-1) / kept.clamp_min(1)
                valid = kept > 0
                overlap = float(share[valid].mean()) if bool(valid.any()) else math.nan
                settled = float((share[valid] >= SETTLED).float().mean()) if bool(valid.any()) else math.nan
                self.rows[row].append([seen - sched.prompt[row], overlap, settled])
            chosen = held.clone()
            chosen[:, :, : self.sinks] = False
            chosen[:, :, max(seen - self.recent, 0) :] = False  # the recent window is kept by rule, not chosen
            self._chosen[row] = (chosen, seen)


def record_fields(watch: KeptDynamics | None, row: int, completion, tokenizer) -> dict:
    """The fields ``vase eval --kept-dynamics`` adds to the record of batch row ``row``: ``kept_overlap`` (its
    :attr:`KeptDynamics.rows` entries up to its last token: a row that ended goes on evicting while the rest of its
    batch generates; None for a policy that never evicts, ``watch`` None) and ``loop_onset``
    (:func:`loop_onset` when the loop flag is set, else None)."""
    from .loops import loop_flag

    looped = loop_flag(completion.text, completion.finished)
    own = [e for e in watch.rows[row] if e[0] <= completion.new_tokens] if watch and row < len(watch.rows) else []
    return {
        "kept_overlap": own if watch is not None else None,
        "loop_onset": loop_onset(completion.text, completion.token_ids, tokenizer) if looped else None,
    }


def loop_onset(text: str, token_ids: list[int], tokenizer) -> int | None:
    """The generated token at which the loop ``text`` ends in begins (the start of its first repetition), or None
    when it ends in none.

    The loop is :func:`vase.harness.loops.find_loop` over the whole text (not only its last 4,000 characters, so a
    long loop is counted from its real start); its start in normalised characters is mapped to tokens by normalising
    the decoded prefixes (a binary search over the token count).

    Args:
        text: the completion; token_ids: its tokens (``tokenizer.decode(token_ids, skip_special_tokens=True)`` gives
            ``text``).
    """
    from .loops import find_loop, normalise

    loop = find_loop(text, tail_chars=len(text))
    if loop is None:
        return None
    for numbers in (True, False):  # the reading the loop was found in: its unit ends where the run ends
        s = normalise(text, numbers=numbers)
        end = len(s) - loop.drift
        if s[end - loop.period : end] == loop.unit:
            break
    start = max(end - loop.span, 0)
    lo, hi = 0, len(token_ids)  # the smallest prefix whose normalised text reaches past the loop's start
    while lo < hi:
        mid = (lo + hi) // 2
        if len(normalise(tokenizer.decode(token_ids[:mid], skip_special_tokens=True), numbers=numbers)) > start:
            hi = mid
        else:
            lo = mid + 1
    return max(lo - 1, 0)


def fixed_point_rows(records: list[dict], window: int = WINDOW) -> list[dict]:
    """Per (task, policy, size) of ``vase eval --kept-dynamics`` records: completions, loops (the loop flag), the mean
    overlap and settled share over all evictions, and for the looped completions the mean overlap in the ``window``
    generated tokens before the onset and after it, the same stretches of the completions that did not loop (at the
    looped ones' median onset), and the share of looped completions whose kept set had settled (an eviction with
    every (layer, KV head) at overlap >= :data:`SETTLED`) before the onset, against the share of the others that
    ever settle.

    With ``full`` records of the same problems and seeds in ``records``, ``induced`` counts the loops the full cache
    does not make on the same problem (eviction's own loops: with greedy decoding the full cache's completion is the
    one the policy would write without eviction), with their overlap before / after the onset and how many had settled
    before it (``induced_*``)."""
    full = {(r["task"], r.get("problem_id"), r.get("seed")): r["loop"] for r in records if r["policy"] == "full"}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("kept_overlap") is not None:
            groups.setdefault((r["task"], r["policy"], r.get("ratio"), r["budget"]), []).append(r)
    rows = []
    for (task, policy, ratio, budget), recs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        looped = [r for r in recs if r.get("loop") and r.get("loop_onset") is not None]
        other = [r for r in recs if not r.get("loop")]
        induced = [r for r in looped if full.get((r["task"], r.get("problem_id"), r.get("seed"))) is False]
        onsets = sorted(r["loop_onset"] for r in looped)
        mid = onsets[len(onsets) // 2] if onsets else None
        every = [e for r in recs for e in _entries(r)]
        row = {
            "task": task,
            "policy": policy,
            "ratio": ratio,
            "budget": budget,
            "completions": len(recs),
            "loops": len(looped),
            "onset_median": mid,
            "overlap": _nanmean([e[1] for e in every]),
            "settled": _nanmean([e[2] for e in every]),
            **_around_onset(looped, window),
            "other_before": _nanmean([e[1] for r in other for e in _stretch(r, mid - window, mid)])
            if mid is not None
            else math.nan,
            "other_after": _nanmean([e[1] for r in other for e in _stretch(r, mid, mid + window)])
            if mid is not None
            else math.nan,
            "other_settled": _share([any(e[2] >= 1.0 for e in _entries(r)) for r in other]),
            "induced": len(induced) if full else None,
        }
        row.update({"induced_" + k: v for k, v in _around_onset(induced, window).items()})
        rows.append(row)
    return rows


def _around_onset(looped: list[dict], window: int) -> dict:
    """``before`` / ``after``: the mean overlap of the evictions in the ``window`` tokens before / from each onset;
    ``settled_before_onset``: the share of the completions with a settled eviction before their onset."""
    return {
        "before": _nanmean([e[1] for r in looped for e in _stretch(r, r["loop_onset"] - window, r["loop_onset"])]),
        "after": _nanmean([e[1] for r in looped for e in _stretch(r, r["loop_onset"], r["loop_onset"] + window)]),
        "settled_before_onset": _share([any(e[2] >= 1.0 for e in _stretch(r, 0, r["loop_onset"])) for r in looped]),
    }


def _stretch(rec: dict, start: float, end: float) -> list[list[float]]:
    """The evictions of a record made at ``start <= new_tokens < end``."""
    return [e for e in _entries(rec) if start <= e[0] < end]


def _entries(rec: dict) -> list[list[float]]:
    """The evictions of a record made while its completion was written: a row that ended (end of sequence) goes on
    evicting while the rest of its batch generates, and those evictions are not its own."""
    end = rec.get("new_tokens")
    return [e for e in rec["kept_overlap"] if end is None or e[0] <= end]


def _nanmean(values: list[float]) -> float:
    clean = [v for v in values if v == v]
    return sum(clean) / len(clean) if clean else math.nan


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else math.nan


def aligned_overlap(records: list[dict], bins: int = 64, span: int = 512) -> dict[str, tuple[list[int], list[float]]]:
    """Per policy (and size), the mean overlap of looped completions in ``bins``-token bins of generated tokens
    relative to the loop's onset, from ``-span`` to ``span``: ``{label: (bin starts, means)}`` (NaN in empty bins)."""
    out = {}
    for r in records:
        if r.get("kept_overlap") is None or not r.get("loop") or r.get("loop_onset") is None:
            continue
        label = f"{r['policy']} @ {r['ratio']:g}x" if r.get("ratio") else f"{r['policy']} @ {r['budget']}"
        sums = out.setdefault(label, {})
        for t, overlap, _ in _entries(r):
            rel = t - r["loop_onset"]
            if -span <= rel < span and overlap == overlap:
                b = math.floor(rel / bins) * bins
                s, n = sums.get(b, (0.0, 0))
                sums[b] = (s + overlap, n + 1)
    starts = list(range(-span, span, bins))
    return {
        label: (starts, [sums[b][0] / sums[b][1] if b in sums else math.nan for b in starts])
        for label, sums in out.items()
    }


def dynamics_section(records: list[dict], out: Path) -> list[str]:
    """The report section of ``vase eval --kept-dynamics`` records: the table of :func:`fixed_point_rows` and a plot
    of :func:`aligned_overlap` (``kept_dynamics.png`` in ``out``); ``[]`` without such records."""
    rows = fixed_point_rows(records)
    if not rows:
        return []

    def f(x: float) -> str:
        return "—" if x != x else f"{x:.3f}"

    def pct(x: float) -> str:
        return "—" if x != x else f"{100 * x:.0f}"

    lines = [
        "## Kept-set dynamics and loops (free generation)",
        "",
        "Overlap: the share of the entries one eviction chose (sinks and the recent window left out) that the next "
        "one kept, mean over (layer, KV head); heads settled: the share of (layer, KV head) that kept at least "
        f"{SETTLED:.0%} of it, mean over evictions; before / after: over the {WINDOW} generated tokens before and "
        "after a looped completion's onset (the first token of the loop it ends in), and for the completions that "
        "did not loop over the same stretches at the looped ones' median onset. Settled: an eviction at which every "
        f"(layer, KV head) kept at least {SETTLED:.0%} of what the previous one chose. Loops the full cache does not "
        "make: looped completions of problems (and seeds) whose full-cache completion did not loop (with `full` in "
        "the same run and greedy decoding, the loops eviction caused).",
        "",
        "| task | policy | size | completions | loops | median onset | overlap | heads settled (%) "
        "| looped: before | looped: after | others: before | others: after | looped, settled before onset (%) "
        "| others, ever settled (%) | loops the full cache does not make | those: before | those: after "
        "| those, settled before onset (%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = f"{r['ratio']:g}x ({r['budget']})" if r["ratio"] else str(r["budget"])
        onset = "—" if r["onset_median"] is None else str(r["onset_median"])
        lines.append(
            f"| {r['task']} | {r['policy']} | {size} | {r['completions']} | {r['loops']} | {onset} "
            f"| {f(r['overlap'])} | {pct(r['settled'])} "
            f"| {f(r['before'])} | {f(r['after'])} | {f(r['other_before'])} | {f(r['other_after'])} "
            f"| {pct(r['settled_before_onset'])} | {pct(r['other_settled'])} "
            f"| {'—' if r['induced'] is None else r['induced']} | {f(r['induced_before'])} | {f(r['induced_after'])} "
            f"| {pct(r['induced_settled_before_onset'])} |"
        )
    lines.append("")
    curves = aligned_overlap(records)
    if curves:
        from .plots import overlap_figure, save

        save(overlap_figure(curves), out / "kept_dynamics.png")
        lines += ["![kept-set overlap around the loop onset](kept_dynamics.png)", ""]
    return lines
