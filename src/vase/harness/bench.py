"""``vase bench``: decode speed, KV bytes, process memory and eviction cost, full cache vs policies, side by side.

Each configuration (policy, budget) runs in a fresh subprocess, so its peak RSS is its own: greedy decoding of N new
tokens from a short prompt, end-of-sequence ignored, with marks at the requested lengths. At each mark it records
the decode speed over the last bucket of tokens and over the last 512 tokens ("at that context"), the KV bytes the
cache holds, the process's current and peak RSS, and the seconds spent in eviction (scoring + selection +
compaction). The full cache is transformers' own ``DynamicCache``: the baseline a user would otherwise run.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..core.config import VaseConfig
from ..core.policies import make_policy

DEFAULT_PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a mysterious map."
MIB = 2.0**20


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
    logits = model(input_ids=input_ids, cache=cache).logits[:, -1:]
    _sync(device)
    prefill = time.perf_counter() - t0
    stamps = []
    nxt = logits.argmax(-1)
    rows, last_mark, mark_set = [], 0, set(marks)
    start = time.perf_counter()
    for i in range(1, tokens + 1):
        logits = model(input_ids=nxt, cache=cache).logits
        nxt = logits[:, -1:].argmax(-1)
        if i in mark_set:
            _sync(device)
        stamps.append(time.perf_counter())
        if i in mark_set:
            now = stamps[-1]
            prev = stamps[last_mark - 1] if last_mark else start
            w = min(window, i - 1)
            cur, peak = rss_bytes()
            ev = getattr(cache, "_eviction_seconds", 0.0)
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
        nxt = lm.model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
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
    names = ("_eviction_seconds", "_quant_seconds", "_dequant_seconds")
    return tuple(getattr(cache, n, 0.0) for n in names)


def _eager_step(model, policy: str, cache):
    def step(nxt: torch.Tensor, position: int) -> torch.Tensor:
        return model(input_ids=nxt, cache=cache).logits[:, -1:].argmax(-1)

    return step


COMPILED = "+compile"


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
                return compiled(input_ids=nxt, cache=cache, position_ids=pos).logits[:, -1:].argmax(-1)

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


def compiled_markdown(results: list[dict]) -> str:
    """The results of :func:`compiled_speed`: one table per context, with compiled / uncompiled ratios."""
    out = []
    for res in results:
        speed = {r["policy"]: r["tok_s"] for r in res["runs"]}
        out.append(paired_markdown(res))
        pairs = [p for p in speed if not p.endswith(COMPILED) and p + COMPILED in speed]
        out.append(
            "compiled / uncompiled ("
            + f"{res['backend']}, {res['mode']}): "
            + ", ".join(f"{p} {speed[p + COMPILED] / speed[p]:.2f}x" for p in pairs)
            + "\n"
        )
    return "\n".join(out)


def paired_markdown(res: dict) -> str:
    """The result of :func:`paired_speed` as a markdown table."""
    ref = res["runs"][0]["policy"]
    lines = [
        f"Interleaved decode from {res['context']} to {res['context'] + res['steps']} tokens of context, "
        f"{res['steps']} steps per policy in turns of {res['buffer']}; budget {res['budget']} + buffer "
        f"{res['buffer']}:",
        "",
        *_table(
            [
                "policy",
                "tok/s",
                "slowest / fastest turn (tok/s)",
                f"× {ref}",
                "KV MiB at the end",
                f"KV × {ref}",
                "eviction ms/step",
                "quantization ms/step",
                "dequantization ms/step",
            ]
        ),
    ]
    kv_ref = res["runs"][0].get("kv_bytes")
    for r in res["runs"]:
        lo, hi = r["block_tok_s"]
        kv = r.get("kv_bytes")
        mem = [f"{kv / MIB:.1f}", f"{kv / kv_ref:.3f}"] if kv is not None and kv_ref else ["—", "—"]
        cost = [f"{r[k]:.2f}" if k in r else "—" for k in ("evict_ms", "quant_ms", "dequant_ms")]
        lines.append(
            _row([r["policy"], f"{r['tok_s']:.2f}", f"{lo:.1f} / {hi:.1f}", f"{r['vs_first']:.3f}", *mem, *cost])
        )
    return "\n".join(lines) + "\n"


def worker(args: dict) -> dict:
    """One configuration in this process (called in a subprocess by :func:`run_bench`)."""
    from ..hf.models import load_model
    from .generation import encode_prompts

    if args.get("threads"):
        torch.set_num_threads(args["threads"])
    lm = load_model(args.get("model"), device=args.get("device", "auto"))
    ids = encode_prompts(lm.tokenizer, [args.get("prompt", DEFAULT_PROMPT)])["input_ids"].to(lm.device)
    # a short warm-up so one-time costs (allocator, kernels) are not billed to the first bucket
    decode_run(lm.model, ids, args["policy"], args["budget"], args["buffer"], 8, [8])
    res = decode_run(lm.model, ids, args["policy"], args["budget"], args["buffer"], max(args["marks"]), args["marks"])
    res["model"] = lm.name
    res["device"] = str(lm.device)
    res["threads"] = torch.get_num_threads()
    return res


def run_bench(
    out: Path,
    policies: list[str],
    budgets: list[int],
    marks: list[int],
    buffer: int = 64,
    model: str | None = None,
    device: str = "auto",
    prompt: str = DEFAULT_PROMPT,
) -> dict:
    """Run every configuration in its own subprocess, write ``bench.json`` and ``BENCH.md`` into ``out``.

    Results of configurations already in ``out/bench.json`` (same marks and buffer) are reused, so an interrupted
    benchmark resumes.
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    if previous.get("marks") != marks or previous.get("buffer") != buffer:
        previous = {}
    results = previous.get("runs", [])
    done = {(r["policy"], r["budget"]) for r in results}
    from tqdm.auto import tqdm

    configs = [("full", None)] + [(p, b) for b in budgets for p in policies if p != "full"]
    bar = tqdm(total=len(configs), initial=len(done & set(configs)), desc="bench", unit="config", dynamic_ncols=True)
    for policy, budget in configs:
        if (policy, budget) in done:
            continue
        bar.set_postfix_str(f"{policy}" + (f" budget {budget}" if budget else ""))
        args = {
            "policy": policy,
            "budget": budget or 0,
            "buffer": buffer,
            "marks": marks,
            "model": model,
            "device": device,
            "prompt": prompt,
            "threads": torch.get_num_threads(),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "vase.harness.bench", json.dumps(args)],
            capture_output=True,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark worker failed for {policy} {budget}: {proc.stderr.strip()[-2000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        path.write_text(json.dumps({"marks": marks, "buffer": buffer, "runs": results}, indent=1))
        bar.update(1)
    bar.close()
    data = {"marks": marks, "buffer": buffer, "runs": results}
    (out / "BENCH.md").write_text(bench_markdown(data))
    return data


def _goal(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str]) -> list[str]:
    return [_row(header), "|" + "---|" * len(header)]


def _num(x: float, digits: int) -> str:
    return "—" if x != x else f"{x:.{digits}f}"  # NaN (no reference run) shows as a dash


def bench_markdown(data: dict) -> str:
    """Tables (speed, memory, eviction share, ratios) and the goals, as markdown."""
    runs = data["runs"]
    marks = data["marks"]
    full = next((r for r in runs if r["policy"] == "full"), None)
    by = {(r["policy"], r["budget"]): r for r in runs}
    first = runs[0]
    intro = (
        f"Model {first['model']} on {first['device']} ({first['threads']} threads), prompt {first['prompt_tokens']} "
        f"tokens, buffer {data['buffer']}; greedy, end-of-sequence ignored. Speed columns: decode tokens/s over the "
        f"bucket ending at that length; 'at N' = over the last 512 tokens before N. Eviction share: seconds in "
        f"eviction / decode seconds, whole run."
    )
    speed = _table(
        [
            "policy",
            "budget",
            *(f"tok/s ≤{m}" for m in marks),
            f"tok/s at {marks[-1]}",
            f"× full at {marks[-1]}",
            f"× streaming_llm ≤{marks[-1]}",
            "eviction share",
        ]
    )
    memory = _table(
        [
            "policy",
            "budget",
            f"KV MiB at {marks[0]}",
            f"KV MiB at {marks[-1]}",
            f"peak RSS MiB at {marks[0]}",
            f"peak RSS MiB at {marks[-1]}",
            "RSS growth",
        ]
    )
    summary = {}
    for r in runs:
        m = r["marks"]
        last = m[-1]
        growth = last["peak_rss"] / m[0]["peak_rss"] - 1
        share = last["eviction_s"] / last["decode_s"] if last["decode_s"] else 0.0
        vs_full = last["tok_s_last"] / full["marks"][-1]["tok_s_last"] if full else float("nan")
        st = by.get(("streaming_llm", r["budget"]))
        vs_st = last["tok_s_bucket"] / st["marks"][-1]["tok_s_bucket"] if st and r["policy"] != "full" else float("nan")
        summary[(r["policy"], r["budget"])] = dict(
            growth=growth, share=share, vs_full=vs_full, vs_st=vs_st, kv_flat=m[0]["kv_bytes"] == last["kv_bytes"]
        )
        name = [r["policy"], str(r["budget"] or "—")]
        speed.append(
            _row(
                name
                + [f"{x['tok_s_bucket']:.1f}" for x in m]
                + [f"{last['tok_s_last']:.1f}", _num(vs_full, 2), _num(vs_st, 3), f"{100 * share:.1f}%"]
            )
        )
        memory.append(
            _row(
                name
                + [f"{m[0]['kv_bytes'] / MIB:.1f}", f"{last['kv_bytes'] / MIB:.1f}", f"{m[0]['peak_rss'] / MIB:.0f}"]
                + [f"{last['peak_rss'] / MIB:.0f}", f"{100 * growth:+.1f}%"]
            )
        )
    lines = [intro, "", "Decode speed:", "", *speed, "", "Memory:", "", *memory]
    lines += ["", "Goals:", ""]
    evicting = [k for k in summary if make_policy(k[0]).evicts]  # quest keeps the whole cache: its KV grows
    vase = [k for k in summary if k[0] == "vase"]
    if evicting:
        flat = all(summary[k]["kv_flat"] for k in evicting)
        lines.append(
            f"- KV bytes held constant from {marks[0]} to {marks[-1]} tokens for every evicting policy: {_goal(flat)}"
        )
    for k in vase:
        s = summary[k]
        fg = summary.get(("full", None), {}).get("growth", float("nan"))
        lines += [
            f"- vase budget {k[1]}: peak RSS growth {marks[0]}→{marks[-1]} {100 * s['growth']:+.1f}% (goal < 5%; full "
            f"cache {100 * fg:+.1f}%): {_goal(s['growth'] < 0.05)}",
            f"- vase budget {k[1]}: decode at {marks[-1]} tokens {s['vs_full']:.2f}x the full cache (goal >= 1.3x): "
            f"{_goal(s['vs_full'] >= 1.3)}",
            f"- vase budget {k[1]}: eviction {100 * s['share']:.1f}% of decode time (goal <= 5%): "
            f"{_goal(s['share'] <= 0.05)}",
            f"- vase budget {k[1]}: throughput {s['vs_st']:.3f}x streaming_llm's (goal >= 0.95): "
            f"{_goal(s['vs_st'] >= 0.95)}",
        ]
    return "\n".join(lines) + "\n"


@torch.inference_mode()
def profile_eviction(
    lm, policy: str = "vase", budget: int = 1024, buffer: int = 64, evictions: int = 4, prompt: str = DEFAULT_PROMPT
) -> str:
    """Profile the eviction steps of a decode run: time per component (milliseconds per eviction, all layers)."""
    from torch.profiler import ProfilerActivity, profile

    ids = _repeated_prompt(lm, prompt, budget + buffer + 1)  # compressed at prefill: steady state at once
    cache = _make_cache(lm.model, policy, budget, buffer)
    model = lm.model
    nxt = model(input_ids=ids, cache=cache).logits[:, -1:].argmax(-1)
    steps = evictions * buffer
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if lm.device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            nxt = model(input_ids=nxt, cache=cache).logits[:, -1:].argmax(-1)
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


if __name__ == "__main__":  # worker mode: one configuration, JSON on the last stdout line
    result = worker(json.loads(sys.argv[1]))
    print(json.dumps(result))
