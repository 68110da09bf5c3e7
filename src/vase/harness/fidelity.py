"""Fidelity to the full cache: how far a policy's next-token distributions drift from the full cache's.

Works where a model is too small to solve the tasks. For each source (a task prompt with the model's own reasoning
as continuation, generated once with the full cache; or a window of a long text), the continuation is replayed
teacher-forced through a policy's cache and through the full cache, and at every position we compare the two
next-token distributions: KL(full || policy) in nats, top-1 agreement, and the perplexity of the continuation.

Replay feeds the continuation in chunks that end exactly where the cache would evict during token-by-token decoding
(first when the fill reaches budget + buffer, then every ``buffer`` tokens), so every token attends to exactly the
entries it would have seen while decoding, at the cost of a prefill. The full-cache reference is replayed with the
same chunks, so a budget that covers the whole length gives exactly zero KL and full agreement. The sources (traces
and text windows): :mod:`vase.harness.traces`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from pydantic import Field, model_validator

from ..core.config import VaseConfig
from ..core.sizes import check_sizes, ratio_budget
from ..hf.compat import cache_kwargs
from ..hf.models import check_load_options, resolve_device, resolve_dtype
from .data import load_problems
from .evaluate import RunConfig, append_records, check_same_config, prepare_dir, read_records
from .held import KeptAfterEviction, adaptive_slots, guard_counts, memory_fields
from .notes import warn
from .outliers import PlantedValues, full_precision_share, kept_share
from .traces import SOURCES_FILE, build_sources, text_file, text_sources

DEFAULT_RATIOS = (2.0, 4.0, 8.0)
RECORDS = "fidelity.jsonl"


class FidelityConfig(RunConfig):
    """What decides a fidelity run's results."""

    source: str = "gsm8k"  # a task name / JSONL file, or text:PATH
    prompts: int = 20
    tokens: int = 1024
    prefix_tokens: int = 64  # text sources: tokens of context before the continuation
    ratios: list[float] = Field(default_factory=list)  # none and no budgets: DEFAULT_RATIOS
    budgets: list[int] = Field(default_factory=list)
    byte_ratios: list[float] = Field(default_factory=list)  # compression ratios in bytes (kv_bits: see VaseConfig)
    bucket: int = 256
    seed: int = 0
    plant_layers: list[int] = Field(default_factory=list)  # planted value outliers (harness.outliers); none by default
    plant_tokens: int = 0
    plant_scale: float = 20.0

    @model_validator(mode="after")
    def _default_sizes(self):
        """Budgets replace the default ratios: the ratios default to :data:`DEFAULT_RATIOS` only when no budget (and
        no byte ratio) is given either."""
        if not self.ratios and not self.budgets and not self.byte_ratios:
            self.ratios = list(DEFAULT_RATIOS)
        return self


def planted_positions(prompt: int, tokens: int, count: int) -> list[int]:
    """Logical positions of ``count`` planted outliers: spread evenly over the first half of the continuation, so
    each must survive many evictions to be held at the end."""
    if count <= 0:
        return []
    step = max(tokens // 2 // count, 1)
    return [prompt + step // 2 + i * step for i in range(count)]


@torch.inference_mode()
def replay(
    model,
    prompt_ids: torch.Tensor,
    continuation: torch.Tensor,
    policy: str | None = None,
    budget: int | None = None,
    buffer: int = 64,
    seed: int = 0,
    record: bool = False,
    config: VaseConfig | None = None,
    on_chunk=None,
):
    """Teacher-forced log-probabilities ``[T, vocab]`` (float32) of the next token at each continuation position.

    The continuation is fed in chunks that end exactly where the cache evicts (:meth:`vase.EvictingCache.room`), so each
    token attends to what it would have seen in token-by-token decoding. With ``record=True`` returns
    ``(logprobs, cache)`` so the caller can look at what the cache holds at the end.

    Args:
        prompt_ids: ``[P]`` token ids; continuation: ``[T]`` token ids (the targets).
        policy, budget, buffer: the cache (tokens); or ``config``, a :class:`vase.VaseConfig` with a fixed budget.
        seed: keys the cache's random choices.
        on_chunk: called as ``on_chunk(cache, seen)`` after the prompt and after each chunk (``seen``: tokens fed so
            far), to look at what the cache holds after each eviction.
    """
    from ..hf.cache import EvictingCache

    dev = next(model.parameters()).device
    if config is None:
        config = VaseConfig.resolve(policy, budget=budget, buffer=buffer)
    cache = EvictingCache(model, config=config, seed=seed)
    last = model(input_ids=prompt_ids.view(1, -1).to(dev), **cache_kwargs(cache)).logits[:, -1]
    cache.observe_confidence(last)  # a confidence step budget follows the predictions of the continuation
    out = [torch.log_softmax(last.float(), -1)]
    if on_chunk is not None:
        on_chunk(cache, prompt_ids.numel())
    fed = continuation[:-1]
    start = 0
    cut = cache.policy.evicts or cache.quantized  # chunks end where decoding evicts (or quantizes, with kv_bits)
    while start < fed.numel():
        c = fed.numel() - start if not cut else min(fed.numel() - start, cache.room()[0])
        piece = fed[start : start + c].view(1, -1).to(dev)
        # a confidence step budget evicts on the predictions of every token before the evicting one, as decoding
        # does: the chunk's last token (the one that evicts) goes in its own forward pass
        parts = [piece[:, :-1], piece[:, -1:]] if cache.policy.confidence_budget and c > 1 else [piece]
        for part in parts:
            logits = model(input_ids=part, **cache_kwargs(cache)).logits
            cache.observe_confidence(logits)
            out.append(torch.log_softmax(logits[0].float(), -1))
        start += c
        if on_chunk is not None:
            on_chunk(cache, prompt_ids.numel() + start)
    logprobs = torch.cat(out).cpu()
    return (logprobs, cache) if record else logprobs


def compare(ref: torch.Tensor, pol: torch.Tensor, targets: torch.Tensor, bucket: int) -> dict:
    """Per-position KL(full || policy), top-1 agreement and NLL, averaged overall and per position bucket."""
    kl = (ref.exp() * (ref - pol)).sum(-1).clamp_min(0.0)
    top1 = (ref.argmax(-1) == pol.argmax(-1)).float()
    idx = targets.view(-1, 1)
    nll_ref = -ref.gather(1, idx).squeeze(1)
    nll_pol = -pol.gather(1, idx).squeeze(1)
    n = kl.numel()

    def agg(sl):
        return {
            "kl": kl[sl].mean().item(),
            "top1": top1[sl].mean().item(),
            "nll_full": nll_ref[sl].mean().item(),
            "nll_policy": nll_pol[sl].mean().item(),
        }

    whole = agg(slice(0, n))
    buckets = [
        {"start": s, "end": min(s + bucket, n), **agg(slice(s, min(s + bucket, n)))} for s in range(0, n, bucket)
    ]
    return {
        "kl_mean": whole["kl"],
        "top1": whole["top1"],
        "ppl_full": math.exp(whole["nll_full"]),
        "ppl_policy": math.exp(whole["nll_policy"]),
        "ppl_change": math.exp(whole["nll_policy"] - whole["nll_full"]) - 1.0,
        "buckets": buckets,
    }


def replay_budget(config: FidelityConfig, source: dict, kind: str, value: float) -> int:
    """The budget (tokens per KV head) of one replay of ``source``: ``value`` itself for ``kind='budget'``, else
    :func:`vase.core.sizes.ratio_budget` of the source's length (prompt + continuation, tokens) at the ratio ``value``
    (rounded to the buffer for every policy alike when the run holds the published method)."""
    if kind == "budget":
        return int(value)
    length = len(source["prompt"]) + len(source["continuation"])
    return ratio_budget(length, value, config.buffer, published=config.has_published)


def check_fidelity(config: FidelityConfig, device: str = "auto") -> dict[tuple[str, str, float], VaseConfig]:
    """Every option of a fidelity run, checked before anything loads or any trace is generated; returns the resolved
    :class:`vase.VaseConfig` of each (policy, 'ratio' | 'budget' | 'bytes', value) (byte ratios counted in the dtype
    the model will be loaded in).

    Raises:
        ValueError: no ratio and no budget; counts out of range (prompts, tokens, prefix tokens, bucket, planted
            tokens, scale); a policy or size any replay would refuse (a budget not larger than sinks + buffer, a
            recent window or a published-preset rule a ratio's budget cannot meet); a text file that does not exist; a
            task file that cannot be read; an unknown dtype, device or attention.
    """
    check_load_options(config.dtype, device, config.attn)
    if not config.ratios and not config.budgets and not config.byte_ratios:
        raise ValueError(
            "give at least one compression ratio (--ratios), budget (--budgets) or byte ratio (--byte-ratios)"
        )
    for name, value, low in (
        ("--prompts", config.prompts, 1),
        ("--tokens", config.tokens, 2),
        ("prefix_tokens", config.prefix_tokens, 1),
        ("--bucket", config.bucket, 1),
        ("--plant-tokens", config.plant_tokens, 0),
    ):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if config.plant_layers and (min(config.plant_layers) < 0 or not config.plant_scale > 0):
        raise ValueError("--plant-layers must be layer indices >= 0 and --plant-scale > 0")
    check_sizes(None, config.buffer, 4)
    text = config.source.startswith("text:")
    # a task prompt has at least one token
    shortest = config.prefix_tokens + config.tokens if text else config.tokens + 1
    resolved = {}
    element = resolve_dtype(config.dtype, resolve_device(device)).itemsize
    for policy in config.policies:
        for kind, values in (("budget", config.budgets), ("ratio", config.ratios), ("bytes", config.byte_ratios)):
            for value in values:
                # the model's element size for every kind: a kv_bits record gives its bytes at a token budget too
                size = {"byte_ratio": value} if kind == "bytes" else {kind: value}
                cfg = VaseConfig.resolve(policy, buffer=config.buffer, element_bytes=element, **size)
                cfg.for_length(shortest, published=config.has_published)  # a ratio's smallest budget must fit too
                resolved[(policy, kind, float(value))] = cfg
    # the sources last: the options' own errors come first, wherever the data is
    if text:
        text_file(config)
    else:
        load_problems(config.source, require_answer=False)  # a missing task file or field: its clear error
    return resolved


def policy_budgets(config: FidelityConfig, configs: dict, source: dict, kind: str, value: float) -> dict[str, int]:
    """The budget (tokens per KV head) of each policy's replay of ``source`` at one size: the same for every policy
    for a budget or a ratio (:func:`replay_budget`); for a byte ratio, what the bytes hold at the policy's
    ``kv_bits`` (:meth:`vase.VaseConfig.for_length`). A quantized policy that never evicts (``full`` with
    ``kv_bits``) gets the source's length: its buffers then hold the sequence without growing."""
    length = len(source["prompt"]) + len(source["continuation"])
    shared = replay_budget(config, source, kind, value) if kind != "bytes" else None
    out = {}
    for policy in config.policies:
        cfg = configs[(policy, kind, value)]
        if not cfg.policy.evicts and (cfg.kv_bits is not None or (kind == "bytes" and cfg.policy.sparse is None)):
            out[policy] = length
        elif kind == "bytes":
            out[policy] = cfg.for_length(length, published=config.has_published).budget
        else:
            out[policy] = shared
    return out


def run_notes(config: FidelityConfig, configs: dict, plan: list[tuple]) -> list[str]:
    """What a user must know before trusting a run's labels: per ratio, when the budgets the sources get (the floor
    ``sinks + buffer + 1``, or the published preset's rounding) compress them by less than 95% of the ratio asked;
    per size and policy, when the policy chooses fewer than a quarter of the budget (:meth:`VaseConfig.buffer_note`).
    ``plan`` holds (source, kind, value, {policy: budget}) tuples; at a byte ratio the notes are per policy."""
    notes: list[str] = []
    for kind, value in dict.fromkeys((k, v) for _, k, v, _ in plan):
        for group in config.policies if kind == "bytes" else [config.policies[0]]:
            rows = [
                (len(s["prompt"]) + len(s["continuation"]), b[group]) for s, k, v, b in plan if (k, v) == (kind, value)
            ]
            cfg = configs[(group, kind, value)]
            if kind == "bytes" and not cfg.policy.evicts:
                continue
            measured = [n / b for n, b in rows]
            budgets = sorted({b for _, b in rows})
            span = f"budget {budgets[0]}" if len(budgets) == 1 else f"budgets {budgets[0]}-{budgets[-1]}"
            asked = value if kind == "ratio" else (cfg.ratio if kind == "bytes" else None)
            if asked is not None and sum(measured) / len(measured) < 0.95 * asked:
                what = f"ratio {value:g}x" if kind == "ratio" else f"{group} at byte ratio {value:g}x"
                scale = 1.0 if kind == "ratio" else value / asked
                lo, hi = min(measured) * scale, max(measured) * scale
                got = f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"
                n = len(rows)
                notes.append(
                    f"{what} asked, {got} measured over {n} source{'s' if n != 1 else ''} "
                    f"({span}: at least sinks + buffer + 1 = {4 + config.buffer + 1} tokens"
                    + (", rounded to the buffer for the published preset" if config.has_published else "")
                    + "); records and reports give the compression measured"
                )
            for policy in config.policies if kind != "bytes" else [group]:
                note = configs[(policy, kind, value)].with_budget(budgets[0]).buffer_note()
                if note and note not in notes:
                    notes.append(note)
    return notes


def record_size(rec: dict) -> tuple[str, float]:
    """The size a fidelity record was replayed at: ``("bytes", byte ratio)``, ``("ratio", ratio)`` or ``("budget",
    tokens)``. Resuming keys on it (with source and policy), not on the budget: a quantized policy that never evicts
    has the source's length as its budget at every byte ratio."""
    if rec.get("byte_ratio") is not None:
        return ("bytes", float(rec["byte_ratio"]))
    if rec.get("ratio") is not None:
        return ("ratio", float(rec["ratio"]))
    return ("budget", float(rec["budget"]))


def run_fidelity(config: FidelityConfig, out: Path, device: str = "auto", progress: bool = True, lm=None) -> Path:
    """Run (or resume) a fidelity sweep into ``out/fidelity.jsonl``; returns that path.

    Every option is checked first (:func:`check_fidelity`), then the model is loaded and the sources checked; only
    then is ``out`` written (its ``config.json``), so a run that cannot start leaves nothing behind.

    With ``plant_layers`` and ``plant_tokens``, value outliers are planted
    (:class:`vase.harness.outliers.PlantedValues`) in the reference and in every policy's replay, and each record
    gains ``planted_kept``: the share of planted (layer, KV head, token) entries the policy's cache still holds at
    the end (and, with ``kv_bits``, ``planted_full_precision``: the share of those held in full precision).

    Raises:
        ValueError: see :func:`check_fidelity`; another configuration in ``out`` (names every field that differs);
            planted layers the model lacks; a text source shorter than prefix + tokens.
    """
    from tqdm.auto import tqdm

    from ..hf.models import load_model

    configs = check_fidelity(config, device)
    check_same_config(out, config)
    lm = lm or load_model(config.model, dtype=config.dtype, device=device, attn=config.attn)
    if config.plant_layers:
        n_layers = lm.model.config.get_text_config(decoder=True).num_hidden_layers
        if max(config.plant_layers) >= n_layers:
            raise ValueError(f"--plant-layers {max(config.plant_layers)}: the model has layers 0-{n_layers - 1}")
    if config.source.startswith("text:"):
        text_sources(config, lm.tokenizer)  # long enough, before anything is written
    prepare_dir(out, config)
    src_path = out / SOURCES_FILE
    sources = read_records(src_path)[: config.prompts]
    if len(sources) < config.prompts:
        sources = build_sources(config, lm, progress, path=src_path)
    path = out / RECORDS
    done = {(r["source"], r["policy"], record_size(r)) for r in read_records(path)}
    plant = bool(config.plant_layers) and config.plant_tokens > 0
    sizes = [("ratio", r) for r in config.ratios] + [("budget", float(b)) for b in config.budgets]
    sizes += [("bytes", r) for r in config.byte_ratios]
    plan = [(s, kind, value, policy_budgets(config, configs, s, kind, value)) for s in sources for kind, value in sizes]
    for note in run_notes(config, configs, plan):
        warn(note)
    todo_of = [[p for p in config.policies if (s["id"], p, (k, v)) not in done] for s, k, v, _ in plan]
    total = len(plan) * len(config.policies)  # this run's replays: records of other policies in the file not counted
    initial = total - sum(map(len, todo_of))
    bar = tqdm(total=total, initial=initial, desc="fidelity", unit="replay", disable=not progress, dynamic_ncols=True)
    refs: dict[str, torch.Tensor] = {}
    same: dict[tuple[str, str], tuple] = {}  # a quantized policy that never evicts: one replay per source
    same_bytes: dict[tuple[str, str], dict] = {}
    with path.open("a", encoding="utf-8") as fh:
        for (s, kind, value, budgets), todo in zip(plan, todo_of):
            if not todo:
                continue
            prompt, cont = torch.tensor(s["prompt"]), torch.tensor(s["continuation"])
            length = prompt.numel() + cont.numel()
            positions = planted_positions(prompt.numel(), cont.numel(), config.plant_tokens) if plant else []
            hooks = (
                PlantedValues(config.plant_layers, positions, config.plant_scale).attach(lm.model) if plant else None
            )
            try:
                if s["id"] not in refs:  # the full cache does not depend on the budget: one replay per source
                    ref_budget = budgets[config.policies[0]] if kind != "bytes" else length
                    refs = {s["id"]: replay(lm.model, prompt, cont, "full", ref_budget, config.buffer, config.seed)}
                ref = refs[s["id"]]
                results = []  # (policy, its scores against the reference, extra fields): no logprobs kept
                for policy in todo:
                    if policy == "full":
                        scores = compare(ref, ref, cont, config.bucket)
                        results.append(
                            (policy, scores, memory_fields(kind, configs[(policy, kind, value)], None, length, 0))
                        )
                        continue
                    cfg = configs[(policy, kind, value)].with_budget(budgets[policy])
                    if (s["id"], policy) in same:  # the same replay whatever the size: the size's own labels
                        scores, extra = same[(s["id"], policy)]
                        extra = {**extra, **memory_fields(kind, cfg, None, length, budgets[policy])}
                        results.append((policy, scores, {**extra, **same_bytes[(s["id"], policy)]}))
                        continue
                    kept = KeptAfterEviction() if cfg.policy.confidence_budget else None
                    pol, cache = replay(
                        lm.model, prompt, cont, seed=config.seed, record=True, config=cfg, on_chunk=kept
                    )  # fmt: skip
                    extra = {"planted_kept": kept_share(cache, config.plant_layers, positions)} if plant else {}
                    if plant and cache.quantized:
                        extra["planted_full_precision"] = full_precision_share(cache, config.plant_layers, positions)
                    extra.update(guard_counts(cache))
                    extra.update(adaptive_slots(cache))
                    extra.update(memory_fields(kind, cfg, cache, length, budgets[policy]))
                    if kept is not None:
                        extra.update(kept.fields(budgets[policy]))
                    scores = compare(ref, pol, cont, config.bucket)
                    results.append((policy, scores, extra))
                    if cache.quantized and not cfg.policy.evicts:
                        same = {k: v for k, v in same.items() if k[0] == s["id"]}
                        same[(s["id"], policy)] = (scores, extra)
                        held = ("bytes_held", "bytes_full", "memory_compression")
                        same_bytes[(s["id"], policy)] = {k: extra[k] for k in held}
                    del cache, pol
            finally:
                if hooks is not None:
                    hooks.detach()
            for policy, scores, extra in results:
                budget = budgets[policy]
                rec = {
                    "source": s["id"],
                    "policy": policy,
                    "budget": budget,
                    "ratio": value if kind == "ratio" else None,
                    "compression": extra["kept_compression"] if kind == "bytes" else length / budget,
                    "prompt_tokens": prompt.numel(),
                    "tokens": cont.numel(),
                    **scores,
                    **extra,
                }
                append_records(fh, [rec])
                bar.update(1)
    bar.close()
    return path


def summarize(records: list[dict]) -> list[dict]:
    """Mean over sources per (policy, ratio or budget), with standard errors over sources
    (:func:`vase.harness.stats.mean_se`, NaN for one source).

    Each row: ``policy``, ``size`` (``("ratio", asked)``, ``("budget", tokens)`` or ``("bytes", byte ratio asked)``),
    ``ratio`` (asked, or None),
    ``sources`` (count), ``budgets`` (the distinct budgets replayed, tokens, sorted: a ratio gives each source its own),
    ``compression`` (mean measured context tokens / budget), ``kl`` and ``kl_se`` (nats per token), ``top1`` and
    ``top1_se`` (%), ``ppl_change`` and ``ppl_change_se`` (%), ``kl_by_source`` (source id -> mean KL, for paired
    differences), ``planted_kept`` (%, None without planting), and ``buckets`` (per position bucket: start, end, mean
    KL, top-1 %)."""
    from .stats import mean_se

    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("byte_ratio") is not None:
            size = ("bytes", r["byte_ratio"])
        else:
            size = ("ratio", r["ratio"]) if r.get("ratio") is not None else ("budget", r["budget"])
        groups.setdefault((r["policy"], size), []).append(r)
    rows = []
    for (policy, size), recs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        n = len(recs)
        nb = min(len(r["buckets"]) for r in recs)
        kl, kl_se = mean_se(r["kl_mean"] for r in recs)
        top1, top1_se = mean_se(100 * r["top1"] for r in recs)
        ppl, ppl_se = mean_se(100 * r["ppl_change"] for r in recs)
        rows.append(
            {
                "policy": policy,
                "size": size,
                "ratio": size[1] if size[0] == "ratio" else None,
                "sources": n,
                "budgets": sorted({int(r["budget"]) for r in recs}),
                "compression": sum(r["compression"] for r in recs) / n,
                "kl": kl,
                "kl_se": kl_se,
                "top1": top1,
                "top1_se": top1_se,
                "ppl_change": ppl,
                "ppl_change_se": ppl_se,
                "kl_by_source": {r["source"]: r["kl_mean"] for r in recs},
                "memory_compression": (
                    sum(r["memory_compression"] for r in recs) / n
                    if all("memory_compression" in r for r in recs)
                    else None
                ),
                "planted_kept": (
                    100 * sum(r["planted_kept"] for r in recs) / n if all("planted_kept" in r for r in recs) else None
                ),
                "kept_share": (
                    100 * sum(r["kept_share"] for r in recs) / n if all("kept_share" in r for r in recs) else None
                ),
                "buckets": [
                    {
                        "start": recs[0]["buckets"][i]["start"],
                        "end": recs[0]["buckets"][i]["end"],
                        "kl": sum(r["buckets"][i]["kl"] for r in recs) / n,
                        "top1": 100 * sum(r["buckets"][i]["top1"] for r in recs) / n,
                    }
                    for i in range(nb)
                ],
            }
        )
    return rows
