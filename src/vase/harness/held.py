"""What a replay's cache held, as fidelity record fields beside the KL: the value guard's protections, the slots of
adaptive budgets, the entries a confidence step budget kept after each eviction, and the bytes of quantized storage.
Each reads a batch-1 replay's cache (:func:`vase.harness.fidelity.replay` with ``record=True``)."""

from __future__ import annotations

from ..core.config import VaseConfig


def guard_counts(cache) -> dict:
    """``{"protected": total slots the value guard protected, "protected_per_eviction": mean per (layer, KV head)
    eviction}`` for a batch-1 replay's cache, or ``{}`` for a policy without a guard."""
    if cache.policy.guard is None:
        return {}
    st = cache.stats()
    per = st.protected / (st.evictions * st.layers * cache.num_kv_heads * max(st.batch, 1)) if st.evictions else 0.0
    return {"protected": st.protected, "protected_per_eviction": per}


class KeptAfterEviction:
    """An ``on_chunk`` hook of :func:`replay` for a confidence step budget, whose records otherwise give only the
    nominal budget: the entries each (layer, KV head) holds right after each eviction, averaged over the evicting
    layers and KV heads. ``fields(budget)`` gives ``kept_mean`` (tokens, mean over evictions) and ``kept_share``
    (``kept_mean / budget``), or ``{}`` when nothing was evicted."""

    def __init__(self):
        self.kept: list[float] = []
        self._evictions = 0

    def __call__(self, cache, seen: int) -> None:
        n = cache.stats().evictions
        if n > self._evictions:  # chunks end at evictions: what the cache holds now is what the last one kept
            self._evictions = n
            live = [(layer.positions[0] >= 0).sum(-1).float().mean().item() for layer in cache.layers]
            self.kept.append(sum(live) / len(live))

    def fields(self, budget: int) -> dict:
        if not self.kept:
            return {}
        mean = sum(self.kept) / len(self.kept)
        return {"kept_mean": mean, "kept_share": mean / budget}


def adaptive_slots(cache) -> dict:
    """``{"slots": physical slots per (layer, KV head) for kept tokens, "memory_compression": full-cache bytes over
    bytes held at the end}`` for a policy with adaptive budgets (``head_budget``/``layer_budget``: its buffers are
    allocated for ``budget_cap`` x budget, so its memory compression is below ``compression``), or ``{}``."""
    if not getattr(cache, "adaptive", False):
        return {}
    return {"slots": cache.slots, "memory_compression": cache.stats().compression}


def memory_fields(kind: str, cfg: VaseConfig, cache, length: int, budget: int) -> dict:
    """The byte fields of a record with ``kv_bits`` or at a byte ratio: ``byte_ratio`` asked, ``kv_bits``,
    ``kept_compression`` (the full cache's bytes for the sequence over the bytes of what a compaction keeps, the budget
    at the policy's cost per token with its full-precision window: what a byte ratio asks for), ``bytes_held`` /
    ``bytes_full`` (every byte the evicting layers store at the end, and a full cache's) and ``memory_compression``
    (their ratio); ``{}`` for other records (so records without kv_bits and byte ratios are as before)."""
    if kind != "bytes" and cfg.kv_bits is None:
        return {}
    kept = length if not cfg.policy.evicts else min(budget, length)
    out = {"byte_ratio": None, "kv_bits": cfg.kv_bits, "kept_compression": length / cfg.kept_bytes(kept)}
    if kind == "bytes":
        out["byte_ratio"] = cfg.byte_ratio
    if cache is not None:
        st = cache.stats()
        out.update(bytes_held=st.bytes_held, bytes_full=st.bytes_full, memory_compression=st.compression)
    else:
        out["memory_compression"] = 1.0
    return out
