"""What an :class:`~vase.EvictingCache` holds and has done: :class:`CacheStats`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheStats:
    """What a cache holds and has done, for a user to read after a run.

    Attributes:
        policy: policy name.
        budget, buffer: tokens.
        batch: batch rows.
        layers: evicting (full-attention) layers.
        tokens_seen: logical length (tokens per row, padding columns included).
        real_tokens: real (non-padding) tokens seen by each row.
        slots_held: largest number of filled slots of a row, right now (tokens; with adaptive budgets the dead slots
            of heads keeping fewer than the cap count too).
        capacity: slots allocated per row and layer (tokens).
        evictions: forward passes in which at least one row evicted.
        tokens_evicted: tokens dropped, summed over rows (each counted once, not per layer).
        bytes_held: bytes held now, all layers: the key/value buffers allocated for the evicting layers, plus the
            state the other layers of a hybrid model hold (``bytes_other``); with the page metadata of ``quest``.
        bytes_full: bytes the model's default cache (``DynamicCache(config=...)``) would hold for the same tokens:
            the full-attention layers' keys and values for every token seen (padding columns included), plus
            ``bytes_other`` (the other layers' state is the default cache's own). With adaptive budgets the evicting
            buffers are allocated for the cap (``budget_cap`` x budget + buffer slots per head), so ``bytes_held`` is
            more than the budget's bytes.
        eviction_seconds: wall time spent scoring, selecting and compacting (seconds).
        protected: value slots the guard protected (or, with ``guard_mode='evict'``, demoted), summed over evictions,
            layers, rows and KV heads (0 without a guard); with ``guard_rule='outlier'`` the count varies per head.
        other_layers: layers of a hybrid model kept as transformers holds them (sliding-window, linear attention).
        bytes_other: bytes those layers hold now (keys/values of a sliding window, convolution and recurrent states).
        bytes_live: bytes of the evicting layers' key/value entries holding a token right now: what attention reads
            there (below their buffers by the free slots and, with adaptive budgets, the dead ones); quantized entries
            at their codes and scales.
        kv_bits: bits per stored element of the kept entries (policy option ``kv_bits``), None: the model's dtype.
            ``bytes_held`` then counts every byte the evicting layers store (:mod:`vase.hf.quantized`): packed codes,
            float16 steps and minima, the key channel factors and the full-precision store (the guard's entries and
            the recent tokens); entry positions and scorer state are not counted, with or without ``kv_bits``.
        kv_group: channels per quantization group.
        kv_window: the newest tokens held in full precision (``kv_window``; 0: the recent buffer only).
        bytes_workspace: the dequantization workspace (one layer's entries in the model's dtype, shared by all
            layers; not in ``bytes_held``: a fused attention kernel would not need it).
        dequant_seconds: wall time spent dequantizing entries for attention (seconds).
        quant_seconds: wall time spent quantizing and storing entries after compactions and multi-token steps
            (seconds; within ``eviction_seconds`` for the steps that evict).
    """

    policy: str
    budget: int
    buffer: int
    batch: int
    layers: int
    tokens_seen: int
    real_tokens: list[int]
    slots_held: int
    capacity: int
    evictions: int
    tokens_evicted: int
    bytes_held: int
    bytes_full: int
    eviction_seconds: float
    protected: int = 0
    other_layers: int = 0
    bytes_other: int = 0
    bytes_live: int = 0
    kv_bits: int | None = None
    kv_group: int = 32
    kv_window: int = 0
    bytes_workspace: int = 0
    dequant_seconds: float = 0.0
    quant_seconds: float = 0.0

    @property
    def compression(self) -> float:
        """Full-cache bytes over bytes held (>1 means savings)."""
        return self.bytes_full / self.bytes_held if self.bytes_held else 1.0

    def memory_text(self) -> str:
        """``'8.44 MiB held vs 26.10 MiB full: 3.09x smaller'``, or, when the buffers (allocated at budget + buffer
        from the first token) hold more than a full cache would, ``'... 5.90x more than the full cache'`` with why."""
        mib = 2.0**20
        held, full = self.bytes_held / mib, self.bytes_full / mib
        text = f"{held:.2f} MiB held vs {full:.2f} MiB full: "
        if self.bytes_held <= self.bytes_full:
            text += f"{self.compression:.2f}x smaller"
        else:
            why = "no eviction yet" if not self.evictions else "buffers larger than the tokens seen"
            text += (
                f"{self.bytes_held / max(self.bytes_full, 1):.2f}x MORE than the full cache ({why}: the buffers are "
                "allocated at budget + buffer from the first token; the saving starts past that length)"
            )
        if self.other_layers:
            text += f" (both incl. {self.bytes_other / mib:.2f} MiB in {self.other_layers} sliding/linear layers)"
        if self.kv_bits is not None:
            text += f", + {self.bytes_workspace / mib:.2f} MiB dequantization workspace"
        return text

    def line(self) -> str:
        """The one-line summary of the cache, the same in the API and at the end of ``vase generate``:
        ``policy vase, budget 128 + buffer 64 | 1 sequence, 595 tokens seen, 7 evictions | KV 146/192 slots,
        8.44 MiB held vs 26.10 MiB full: 3.09x smaller``."""
        seqs = f"{self.batch} sequence" + ("s" if self.batch != 1 else "")
        each = " each" if self.batch > 1 else ""
        kv = f", {self.kv_bits}-bit KV (groups of {self.kv_group})" if self.kv_bits is not None else ""
        if self.kv_bits is not None and self.kv_window:
            kv += f", newest {self.kv_window} in full precision"
        evictions = "evictions" if self.batch <= 1 else "eviction steps"  # a step where any sequence evicted
        return (
            f"policy {self.policy}, budget {self.budget} + buffer {self.buffer}{kv} | {seqs}, {self.tokens_seen} "
            f"tokens seen{each}, {self.evictions} {evictions} | KV {self.slots_held}/{self.capacity} slots{each}, "
            f"{self.memory_text()}"
        )
