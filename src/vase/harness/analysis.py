"""The quantities that test *why* sampled eviction is closer to the full cache than top-k (VaSE, arXiv 2606.03928,
Sec. 5 attributes it to "cache diversity" without testing the mechanism).

Each function takes what a replay records (next-token log-probabilities, the positions a cache holds after each
eviction, attention rows and keys of the full cache) and returns plain numbers, so that each hypothesis has its own
measurement:

- **ensemble**: :func:`ensemble_kl`: KL to the full cache of each sampled run against that of the mixture of the
  runs' next-token distributions. A mixture much closer than each run means sampling acts as an ensemble over
  sub-caches; each run alone as close means it does not need one.
- **starvation and coverage**: :func:`hold_stats`: how many evictions each position survives, the age of the kept
  entries, the share of positions held at the end.
- **future-attention recall**: :func:`attention_recall`: the share of the full cache's attention mass of the next
  queries that falls on the kept entries.
- **diversity of the kept keys**: :func:`key_diversity`: mean pairwise cosine distance and the log-determinant of
  their normalized Gram matrix.
- **fixed points**: :func:`kept_overlap` (the share of a kept set still kept one eviction later) and
  :func:`settled_at` (the first eviction from which the kept set stops changing).
"""

from __future__ import annotations

import math

import torch


def ensemble_kl(full: torch.Tensor, runs: torch.Tensor) -> dict:
    """KL(full ‖ run) of each run and KL(full ‖ mixture of the runs), in nats per position (means over positions).

    Args:
        full: ``[T, V]`` log-probabilities of the full cache.
        runs: ``[S, T, V]`` log-probabilities of S runs (seeds) of one policy on the same positions.

    Returns:
        ``{"runs": [S] mean KL of each run, "mean_run": their mean, "mixture": KL of the mixture (the mean of the runs'
        probabilities), "gain": mixture / mean_run}`` (gain < 1: the mixture is closer).

    Raises:
        ValueError: if the shapes do not match.
    """
    if runs.dim() != 3 or runs.shape[1:] != full.shape:
        raise ValueError(f"runs must be [S, T, V] with [T, V] = {tuple(full.shape)}, got {tuple(runs.shape)}")
    p = full.exp()

    def kl(logq: torch.Tensor) -> torch.Tensor:
        return (p * (full - logq)).sum(-1).clamp_min(0).mean()

    per_run = [kl(r).item() for r in runs]
    mixture = torch.logsumexp(runs, 0) - math.log(runs.shape[0])
    mix = kl(mixture).item()
    mean_run = sum(per_run) / len(per_run)
    return {"runs": per_run, "mean_run": mean_run, "mixture": mix, "gain": mix / mean_run if mean_run else math.nan}


def hold_stats(held: list[torch.Tensor], first: int = 0, recent: int = 0) -> dict:
    """Starvation and coverage of one (layer, KV head) over a replay.

    A position takes part in an eviction once it is past the sinks and older than the recent window (kept by rule,
    not chosen): position p at eviction e when ``first <= p < n_e - recent``.

    Args:
        held: after each eviction e, a bool ``[n_e]`` over the positions seen so far (True: held), ``n_e``
            non-decreasing (``n_e`` is the time of eviction e).
        first: positions before it (the sinks) are left out.
        recent: the recent window (tokens).

    Returns:
        ``survived``: ``[n]`` evictions each position was held through while taking part; ``age``: mean age
        (``n_e - position``) of the held entries at each eviction; ``held_at_end``: the share of the positions past the
        sinks that the last set holds; ``dropped_first``: the share of the positions that took part in an eviction
        evicted at the first one (starved at once).

    Raises:
        ValueError: for no sets, or sets that shrink.
    """
    if not held or any(a.numel() > b.numel() for a, b in zip(held, held[1:])):
        raise ValueError(f"give one held set per eviction, each at least as long as the one before: {len(held)} sets")
    n = held[-1].numel()
    survived = torch.zeros(n, dtype=torch.long)
    first_kept = torch.zeros(n, dtype=torch.bool)
    decided = torch.zeros(n, dtype=torch.bool)  # took part in an eviction already
    ages = []
    for h in held:
        t = h.numel()
        pos = torch.arange(t)
        part = (pos >= first) & (pos < t - recent)
        new = part & ~decided[:t]
        first_kept[:t][new] = h[new]
        decided[:t] |= part
        survived[:t] += (h & part).long()
        kept = pos[h & (pos >= first)]
        ages.append(float((t - kept).float().mean()) if kept.numel() else math.nan)
    last = held[-1].clone()
    last[:first] = False
    return {
        "survived": survived,
        "age": ages,
        "held_at_end": float(last.sum()) / max(n - first, 1),
        "dropped_first": float((decided & ~first_kept).sum()) / max(int(decided.sum()), 1),
    }


def attention_recall(attention: torch.Tensor, held: torch.Tensor) -> float:
    """The share of the attention mass that falls on the held entries.

    Args:
        attention: ``[k, n]`` the full cache's attention weights of the next k queries over the n positions that
            existed at the eviction (a GQA group's heads averaged; renormalized here over these n).
        held: bool ``[n]``.

    Raises:
        ValueError: if the widths differ.
    """
    if attention.shape[-1] != held.numel():
        raise ValueError(f"attention over {attention.shape[-1]} positions, held set over {held.numel()}")
    mass = attention.float().sum(-1)
    return float((attention.float()[:, held].sum(-1) / mass.clamp_min(1e-30)).mean())


def key_diversity(keys: torch.Tensor, eps: float = 1e-4) -> dict:
    """How spread the kept keys are: mean pairwise cosine distance (0: all parallel; about 1: orthogonal on average)
    and the log-determinant of the Gram matrix of the unit keys plus ``eps`` times the identity, per key (higher:
    more diverse; a set of near-copies tends to ``log(eps)``).

    Args:
        keys: ``[m, d]`` (m >= 2).

    Raises:
        ValueError: for fewer than two keys.
    """
    if keys.dim() != 2 or keys.shape[0] < 2:
        raise ValueError(f"give [m, d] keys with m >= 2, got {tuple(keys.shape)}")
    unit = torch.nn.functional.normalize(keys.double(), dim=-1)
    gram = unit @ unit.T
    m = keys.shape[0]
    off = gram.sum() - gram.diagonal().sum()
    logdet = torch.logdet(gram + eps * torch.eye(m, dtype=gram.dtype)).item()
    return {"cosine_distance": float(1 - off / (m * (m - 1))), "logdet": logdet / m}


def kept_overlap(before: torch.Tensor, after: torch.Tensor) -> float:
    """The share of the entries held ``before`` an eviction that are still held ``after`` it (bool masks over
    positions; ``after`` may be longer: positions written since)."""
    n = before.numel()
    kept = int(before.sum())
    return float((before & after[:n]).sum()) / kept if kept else math.nan


def settled_at(overlaps: list[float], threshold: float = 0.99) -> int | None:
    """The first eviction from which every later overlap is at least ``threshold`` (the kept set stopped changing),
    or None if it never settles."""
    at = None
    for i, o in enumerate(overlaps):
        if o >= threshold:
            at = i if at is None else at
        else:
            at = None
    return at
