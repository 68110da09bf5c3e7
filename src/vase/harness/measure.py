"""The measurements of ``vase bench``: decode speed, KV bytes, process memory and eviction cost of one cache, or of
several caches side by side in one process.

- :func:`decode_run`: greedy decoding of N new tokens (end-of-sequence ignored) with marks at the requested lengths;
  at each mark the decode speed over the last bucket of tokens and over the last 512 tokens ("at that context"), the
  KV bytes the cache holds, the process's current and peak RSS, and the seconds spent in eviction (scoring +
  selection + compaction). Run in a fresh subprocess per configuration by :func:`vase.harness.bench.run_bench`.
- :func:`paired_speed`: several caches take turns of one eviction cycle at the same context length.
- :func:`compiled_speed`: compiled against uncompiled decode steps, paired the same way.
- :func:`profile_eviction`: the eviction steps' time per component under the torch profiler.

The full cache is transformers' own ``DynamicCache``: the baseline a user would otherwise run.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

from ..core.config import VaseConfig
from ..hf.compat import cache_kwargs

DEFAULT_PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a mysterious map."
COMPILED = "+compile"  # the label suffix of a compiled run in compiled_speed's results


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process in bytes (Linux /proc; falls back to getrusage)."""
    cur = peak = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not peak:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return cur or peak, peak


def kv_bytes(cache) -> int:
    """Bytes a cache holds now (any transformers cache): key/value tensors, the convolution and recurrent states of
    linear-attention layers (hybrid models), and quest's page metadata."""
    from ..hf.hybrid import state_bytes

    total = 0
    for layer in cache.layers:
        pages = getattr(layer, "pages", None)
        total += state_bytes(layer) + (pages.nbytes if pages is not None else 0)
    return total


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _make_cache(model, policy: str, budget: int, buffer: int):
    """transformers' ``DynamicCache`` for ``policy == "full"`` (what a user runs without vase), else an
    :class:`~vase.EvictingCache`."""
    from transformers import DynamicCache

    from ..hf.cache import EvictingCache

    if policy == "full":
        return DynamicCache(config=model.config)
    return EvictingCache(model, config=VaseConfig.resolve(policy, budget=budget, buffer=buffer))


def _repeated_prompt(lm, prompt: str, length: int) -> torch.Tensor:
    """``[1, length]`` token ids: the chat-templated ``prompt`` repeated, on the model's device."""
    from .generation import encode_prompts

    base = encode_prompts(lm.tokenizer, [prompt])["input_ids"]
    return base.repeat(1, length // base.shape[1] + 1)[:, :length].to(lm.device)


@torch.inference_mode()
def decode_run(
    model,
    input_ids: torch.Tensor,
    policy: str,
    budget: int,
    buffer: int,
    tokens: int,
    marks: list[int],
    window: int = 512,
) -> dict:
    """Greedy decode ``tokens`` new tokens (EOS ignored) and measure at each mark. ``policy='full'`` uses
    ``transformers.DynamicCache``. Returns a dict with ``marks`` rows and totals; times in seconds."""
    device = input_ids.device
    cache = _make_cache(model, policy, budget, buffer)
    t0 = time.perf_counter()
    logits = model(input_ids=input_ids, **cache_kwargs(cache)).logits[:, -1:]
    _sync(device)
    prefill = time.perf_counter() - t0
    stamps = []
    nxt = logits.argmax(-1)
    rows, last_mark, mark_set = [], 0, set(marks)
    start = time.perf_counter()
    for i in range(1, tokens + 1):
        logits = model(input_ids=nxt, **cache_kwargs(cache)).logits
        nxt = logits[:, -1:].argmax(-1)
        if i in mark_set:
            _sync(device)
        stamps.append(time.perf_counter())
        if i in mark_set:
            now = stamps[-1]
            prev = stamps[last_mark - 1] if last_mark else start
            w = min(window, i - 1)
            cur, peak = rss_bytes()
            ev = _cost_counters(cache)[0]
            rows.append(
                {
                    "tokens": i,
                    "context": input_ids.shape[1] + i,
                    "tok_s_bucket": (i - last_mark) / (now - prev),
                    "tok_s_last": w / (now - stamps[i - 1 - w]) if w else 0.0,
                    "kv_bytes": kv_bytes(cache),
                    "rss": cur,
                    "peak_rss": peak,
                    "eviction_s": ev,
                    "decode_s": now - start,
                    "evictions": cache.stats().evictions if hasattr(cache, "stats") else 0,
                }
            )
            last_mark = i
    return {
        "policy": policy,
        "budget": budget if policy != "full" else None,
        "buffer": buffer,
        "prompt_tokens": input_ids.shape[1],
        "prefill_s": prefill,
        "marks": rows,
    }


@torch.inference_mode()
def paired_speed(
    lm,
    policies: list[str],
    budget: int = 1024,
    buffer: int = 64,
    context: int = 8192,
    steps: int = 512,
    prompt: str = DEFAULT_PROMPT,
    progress: bool = True,
    make_cache=None,
    make_step=None,
    warmup: int = 0,
) -> dict:
    """Decode speed of several caches measured in one process, interleaved, at the same context length.

    Each policy (``"full"`` = ``DynamicCache``) gets its own cache, prefilled with the same ``context``-token
    prompt (the chat prompt repeated), then they take turns: ``buffer`` decode steps each (one full eviction cycle),
    in rotating order, until each has decoded ``steps`` tokens. A slow spell of the machine hits every policy
    alike, which sequential runs cannot guarantee on a shared machine.

    Args:
        lm: a loaded model (:func:`vase.hf.models.load_model`).
        policies: policy names; the first is the reference of the ratios.
        budget, buffer: cache sizes in tokens for the evicting policies.
        context: prompt length in tokens (the full cache decodes at ``context`` to ``context + steps``).
        steps: decode steps per policy (a multiple of ``buffer`` measures whole eviction cycles).
        make_cache: ``(model, policy, budget, buffer) -> cache`` for caches other than the default ones (a label
            the caller defines, e.g. the ``full`` policy in vase's static buffers); default: :func:`_make_cache`.
        make_step: ``(model, policy, cache) -> step``, ``step(next_ids [1, 1], position) -> next_ids``: one greedy
            decode step (e.g. a compiled forward, see :func:`compiled_speed`); default: ``model(...)`` and argmax.
        warmup: untimed decode steps of every policy after its prefill (compilation, a first eviction).

    Returns:
        ``{"context", "steps", "budget", "buffer", "runs": [{"policy", "tok_s", "block_tok_s": [min, max],
        "vs_first", "kv_bytes", "evict_ms", "quant_ms", "dequant_ms"}]}``; tokens/s = steps / total seconds of that
        policy's blocks; ``kv_bytes``: what its cache holds at the end (:func:`kv_bytes`: buffers allocated, quest's
        page metadata included); ``evict_ms`` / ``quant_ms`` / ``dequant_ms``: milliseconds per decode step spent
        evicting (scoring, selection, compaction and, with ``kv_bits``, quantizing what is kept), quantizing with
        ``kv_bits`` (at compactions, so partly inside ``evict_ms``, and every ``buffer`` tokens without one) and
        dequantizing for attention, over the timed steps (0 for ``DynamicCache``).

    Raises:
        ValueError: for ``steps`` < 1 or a ``context`` shorter than ``budget + buffer``.
    """
    from tqdm.auto import tqdm

    if steps < 1 or context < budget + buffer:
        raise ValueError(f"need steps >= 1 and context >= budget + buffer; got steps {steps}, context {context}")
    ids = _repeated_prompt(lm, prompt, context)
    states = []
    for policy in policies:
        cache = (make_cache or _make_cache)(lm.model, policy, budget, buffer)
        nxt = lm.model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        step = (make_step or _eager_step)(lm.model, policy, cache)
        for i in range(warmup):
            nxt = step(nxt, context + i)
        states.append(
            {"policy": policy, "cache": cache, "step": step, "next": nxt, "done": 0, "seconds": 0.0, "blocks": []}
        )
        states[-1].update(evict=0.0, quant=0.0, dequant=0.0)
    bar = tqdm(total=steps * len(policies), desc="paired decode", unit="tok", disable=not progress)
    turn = 0
    while any(s["done"] < steps for s in states):
        k = turn % len(states)
        for s in states[k:] + states[:k]:  # rotate who goes first
            n = min(buffer, steps - s["done"])
            if n <= 0:
                continue
            _sync(lm.device)
            counters = _cost_counters(s["cache"])
            t0 = time.perf_counter()
            nxt, step, at = s["next"], s["step"], context + warmup + s["done"]
            for i in range(n):
                nxt = step(nxt, at + i)
            _sync(lm.device)
            dt = time.perf_counter() - t0
            ev, qu, dq = (b - a for a, b in zip(counters, _cost_counters(s["cache"])))
            s["evict"], s["quant"], s["dequant"] = s["evict"] + ev, s["quant"] + qu, s["dequant"] + dq
            s["next"], s["done"], s["seconds"] = nxt, s["done"] + n, s["seconds"] + dt
            s["blocks"].append(n / dt)
            bar.update(n)
        turn += 1
    bar.close()
    first = steps / states[0]["seconds"]
    runs = [
        {
            "policy": s["policy"],
            "tok_s": steps / s["seconds"],
            "block_tok_s": [min(s["blocks"]), max(s["blocks"])],
            "vs_first": steps / s["seconds"] / first,
            "kv_bytes": kv_bytes(s["cache"]),
            "evict_ms": 1000 * s["evict"] / steps,
            "quant_ms": 1000 * s["quant"] / steps,
            "dequant_ms": 1000 * s["dequant"] / steps,
        }
        for s in states
    ]
    return {"context": context, "steps": steps, "budget": budget, "buffer": buffer, "runs": runs}


def _cost_counters(cache) -> tuple[float, float, float]:
    """(eviction, quantization, dequantization) seconds a cache has counted so far (0 for a transformers cache)."""
    counters, ws = getattr(cache, "counters", None), getattr(cache, "workspace", None)
    ev = counters.eviction_seconds if counters is not None else 0.0
    return (ev, ws.quant_seconds, ws.dequant_seconds) if ws is not None else (ev, 0.0, 0.0)


def _eager_step(model, policy: str, cache):
    def step(nxt: torch.Tensor, position: int) -> torch.Tensor:
        return model(input_ids=nxt, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)

    return step


def _compiled_cache(model, label: str, budget: int, buffer: int, max_len: int):
    """The cache of a :func:`compiled_speed` label: ``full`` = ``DynamicCache``, ``full+compile`` = transformers'
    ``StaticCache`` of ``max_len`` tokens (what a user compiles without vase), ``P`` / ``P+compile`` = vase's
    :class:`~vase.EvictingCache` (compileable for the latter)."""
    from transformers import StaticCache

    from ..hf.cache import EvictingCache

    policy, compiled = label.removesuffix(COMPILED), label.endswith(COMPILED)
    if policy == "full":
        return StaticCache(config=model.config, max_cache_len=max_len) if compiled else _make_cache(model, "full", 0, 0)
    return EvictingCache(model, config=VaseConfig.resolve(policy, budget=budget, buffer=buffer, compile=compiled))


def compiled_speed(
    lm,
    policies: list[str] = ("full", "vase"),
    contexts: list[int] = (1024, 8192),
    budget: int = 1024,
    buffer: int = 64,
    steps: int = 256,
    backend: str = "inductor",
    mode: str | None = None,
    progress: bool = True,
) -> list[dict]:
    """Decode speed compiled vs uncompiled, side by side in one process (:func:`paired_speed` at each context).

    For each policy, two runs take turns: the uncompiled forward, and ``torch.compile(model, fullgraph=True,
    dynamic=False)`` with a compiled-ready cache (vase: ``EvictingCache(..., compileable=True)``, its eager part
    :meth:`~vase.EvictingCache.prepare_decode` before each step; ``full``: transformers' ``StaticCache`` against
    the uncompiled ``DynamicCache``). Compilation and a first eviction happen in ``buffer + 1`` untimed warm-up steps.
    The budget of a context shorter than ``budget + buffer`` is cut to half the context.

    Args:
        lm: a loaded model (:func:`vase.hf.models.load_model`), sdpa or eager attention.
        policies: ``full`` and vase policies; the first policy's uncompiled run is the reference of the ratios.
        contexts: prompt lengths in tokens.
        budget, buffer: tokens, for the evicting policies.
        steps: timed decode steps per run.
        backend, mode: of ``torch.compile``; mode default: 'reduce-overhead' (CUDA graphs) on a GPU, else 'default'.

    Returns:
        One :func:`paired_speed` result per context, runs labelled ``P`` and ``P+compile``.
    """
    from ..hf.attention import install

    mode = mode or ("reduce-overhead" if lm.device.type == "cuda" else "default")
    # vase's attention function first, for every run: creating a vase cache switches the model to it, which would
    # send an earlier compiled run (the full cache's) into a recompilation in the middle of its timed steps
    install(lm.model)
    compiled = torch.compile(lm.model, backend=backend, mode=mode, fullgraph=True, dynamic=False)
    labels = [label for p in policies for label in (p, p + COMPILED)]
    results = []
    for context in contexts:
        size = budget if context >= budget + buffer else context // 2
        max_len = context + buffer + 1 + steps + 1

        def make_cache(model, label, budget_, buffer_, max_len=max_len):
            return _compiled_cache(model, label, budget_, buffer_, max_len)

        def make_step(model, label, cache):
            if not label.endswith(COMPILED):
                return _eager_step(model, label, cache)
            prepare = getattr(cache, "prepare_decode", None)

            def step(nxt: torch.Tensor, position: int) -> torch.Tensor:
                if prepare is not None:
                    prepare()
                pos = torch.full((nxt.shape[0], 1), position, dtype=torch.long, device=nxt.device)
                return compiled(input_ids=nxt, **cache_kwargs(cache), position_ids=pos).logits[:, -1:].argmax(-1)

            return step

        res = paired_speed(
            lm,
            labels,
            budget=size,
            buffer=buffer,
            context=context,
            steps=steps,
            progress=progress,
            make_cache=make_cache,
            make_step=make_step,
            warmup=buffer + 1,
        )
        res.update(backend=backend, mode=mode)
        results.append(res)
    return results


@torch.inference_mode()
def profile_eviction(
    lm, policy: str = "vase", budget: int = 1024, buffer: int = 64, evictions: int = 4, prompt: str = DEFAULT_PROMPT
) -> str:
    """Profile the eviction steps of a decode run: time per component (milliseconds per eviction, all layers)."""
    from torch.profiler import ProfilerActivity, profile

    ids = _repeated_prompt(lm, prompt, budget + buffer + 1)  # compressed at prefill: steady state at once
    cache = _make_cache(lm.model, policy, budget, buffer)
    model = lm.model
    nxt = model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
    steps = evictions * buffer
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if lm.device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            nxt = model(input_ids=nxt, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        _sync(lm.device)
    wall = time.perf_counter() - start
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.key.startswith("vase."):
            totals[evt.key] = evt.cpu_time_total / 1e3  # ms (inclusive)
    n_ev = evictions
    lines = [
        f"{policy}, budget {budget}, buffer {buffer}: {steps} decode steps with {n_ev} evictions, "
        f"{wall:.2f} s under the profiler",
        f"{'component':<20}{'ms/evict':>10}{'share of decode':>17}",
    ]
    parts = ["vase.score", "vase.guard", "vase.select", "vase.compact"]
    rows = [(k, totals.get(k, 0.0)) for k in parts]
    rows.append(("other (masks, ctx)", totals.get("vase.evict", 0.0) - sum(v for _, v in rows)))
    rows.append(("eviction total", totals.get("vase.evict", 0.0)))
    for key, ms in rows:
        lines.append(f"{key:<20}{ms / n_ev:>10.1f}{100 * ms / 1e3 / wall:>16.2f}%")
    return "\n".join(lines)
