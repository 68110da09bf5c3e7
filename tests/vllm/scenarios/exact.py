"""Engines one after another on the same prompts, greedy: their tokens and counters (tests/vllm/test_vllm.py compares
them with plain vLLM and with vase on transformers).

Job: ``{"model", "prompts": [[ids]], "max_tokens", "engines": [{"name", "vase": engine_args kwargs or null,
"seeds": [one per prompt] or null, "kw": extra LLM kwargs, "defer_bytes": the plugin's limit on the dense entries a
step holds for its evictions after the forward (0: dense rows evicted in their layer), default the plugin's}]}``.
Result: ``{name: {"outputs": [[ids]], "stats"}}``.
"""

from __future__ import annotations

import common

from vase.vllm import compact

if __name__ == "__main__":
    spec, out = common.job()
    result = {}
    default_defer = compact.DEFER_BYTES
    for eng in spec["engines"]:
        compact.DEFER_BYTES = eng.get("defer_bytes", default_defer)
        llm = common.make_llm(spec["model"], eng.get("vase"), **eng.get("kw", {}))
        seeds = eng.get("seeds") or [None] * len(spec["prompts"])
        ps = [common.params(spec["max_tokens"], extra_args=None if s is None else {"vase_seed": s}) for s in seeds]
        outs = llm.generate([common.tokens_prompt(p) for p in spec["prompts"]], ps, use_tqdm=False)
        result[eng["name"]] = {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "stats": common.stats(llm),
        }
        common.write(out, result)
        common.free(llm)
