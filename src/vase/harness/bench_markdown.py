"""The markdown tables of ``vase bench``'s results: the sweep's speed, memory and goals (:func:`bench_markdown`),
the paired runs (:func:`paired_markdown`) and compiled against uncompiled (:func:`compiled_markdown`)."""

from __future__ import annotations

from ..core.policies import make_policy
from .measure import COMPILED

MIB = 2.0**20


def compiled_markdown(results: list[dict]) -> str:
    """The results of :func:`~vase.harness.measure.compiled_speed`: one table per context, with compiled /
    uncompiled ratios."""
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
    """The result of :func:`~vase.harness.measure.paired_speed` as a markdown table."""
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
