"""vase's counters on vLLM's Prometheus endpoint (``/metrics``), beside vLLM's own ``vllm:*`` metrics.

The counters are kept where they happen, in the engine core's process (the scheduler and, with one worker, the
worker in the same process), as ``prometheus_client`` metrics. vLLM's OpenAI server shows metrics of other processes
when ``PROMETHEUS_MULTIPROC_DIR`` names a folder shared by them (prometheus_client's multiprocess mode, which vLLM
uses for several API servers): ``python -m vase.vllm.serve`` sets it to a fresh temporary folder unless it is set.

Every metric has the label ``engine`` (the engine core's data-parallel index, ``"0"`` with one engine), as vLLM labels
its own: with ``--data-parallel-size 2`` the gauges show one series per engine core (sum them for the server's
total), never whichever core wrote last.

| metric | kind | meaning |
|---|---|---|
| ``vase:evictions_total`` | counter | evictions: one request compacted back to its budget in every layer |
| ``vase:requests_compressed_at_prefill_total`` | counter | requests whose prompt did not fit the cap: compressed |
| ``vase:kv_blocks_held`` | gauge | KV blocks the running requests hold now |
| ``vase:kv_blocks_without_eviction`` | gauge | KV blocks their tokens would fill without eviction (plain vLLM) |
| ``vase:budget_shrinks_total`` | counter | running requests whose budget elastic admission lowered to admit others |

Without ``prometheus_client`` (it comes with vLLM) the functions do nothing.
"""

from __future__ import annotations

try:
    from prometheus_client import Counter, Gauge
except ImportError:  # pragma: no cover - vLLM depends on it
    Counter = Gauge = None

_METRICS: dict | None = None
LABELS = ["engine"]  # vLLM's own label for the engine core (v1/metrics/loggers.py)


def _metrics() -> dict | None:
    global _METRICS
    if _METRICS is None and Counter is not None:
        _METRICS = {
            "evictions": Counter(
                "vase:evictions",
                "Evictions by vase: a request compacted back to its budget in every layer.",
                labelnames=LABELS,
            ),
            "compressed": Counter(
                "vase:requests_compressed_at_prefill",
                "Requests whose prompt did not fit the cap, compressed by vase.",
                labelnames=LABELS,
            ),
            "shrinks": Counter(
                "vase:budget_shrinks",
                "Running requests whose budget vase's elastic admission lowered so that waiting requests are admitted.",
                labelnames=LABELS,
            ),
            # mostrecent per label set: each engine core writes its own series
            "held": Gauge(
                "vase:kv_blocks_held",
                "KV blocks the running requests hold now.",
                labelnames=LABELS,
                multiprocess_mode="mostrecent",
            ),
            "without": Gauge(
                "vase:kv_blocks_without_eviction",
                "KV blocks the running requests' tokens would fill without eviction (as plain vLLM holds them).",
                labelnames=LABELS,
                multiprocess_mode="mostrecent",
            ),
        }
    return _METRICS


def record_step(evictions: int, compressed_at_prefill: int, engine: str = "0") -> None:
    """After a worker step of engine core ``engine``: ``evictions`` requests evicted, ``compressed_at_prefill``
    prompts compressed."""
    m = _metrics()
    if m is None:
        return
    if evictions:
        m["evictions"].labels(engine).inc(evictions)
    if compressed_at_prefill:
        m["compressed"].labels(engine).inc(compressed_at_prefill)


def record_blocks(held: int, without_eviction: int, engine: str = "0") -> None:
    """After a scheduler step of engine core ``engine``: blocks held by its running requests, and what they would
    hold without eviction."""
    m = _metrics()
    if m is None:
        return
    m["held"].labels(engine).set(held)
    m["without"].labels(engine).set(without_eviction)


def record_admission(shrinks: int, engine: str = "0") -> None:
    """After a scheduler step of engine core ``engine``: ``shrinks`` running requests had their budget lowered
    (elastic admission)."""
    m = _metrics()
    if m is None or not shrinks:
        return
    m["shrinks"].labels(engine).inc(shrinks)
