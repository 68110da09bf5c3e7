"""The metadata vase's builder hands vLLM's kernel, step after step: the storage of its ``seq_lens``, slot mapping
and block table (a captured CUDA graph reads its inputs at fixed addresses), with batches shrinking from
``max_num_seqs`` requests to one as requests of different lengths finish, evictions on the way.

Job: ``{"model", "prompts": [[ids]], "max_tokens": [one per prompt], "vase": engine_args kwargs, "kw": LLM
kwargs}``. Result: ``{"steps": [{"builder", "rows", "tokens", "seq_lens", "slots", "table", "physical"}], "outputs",
"stats"}``: per step without dense rows, the data pointers of the three tensors vase's builder hands vLLM's, and
whether the lengths are the plan's.
"""

from __future__ import annotations

import common

from vase.vllm.backend import VaseCPUAttentionMetadataBuilder
from vase.vllm.seam import CPUAttentionMetadataBuilder

if __name__ == "__main__":
    spec, out = common.job()
    steps = []
    parent = CPUAttentionMetadataBuilder.build  # what vase's builder calls with the metadata it made

    def recording(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        ws = getattr(self, "vase_state", None)
        plan = ws.plan if ws is not None and getattr(self, "vase", None) is not None else None
        if isinstance(self, VaseCPUAttentionMetadataBuilder) and plan is not None and not plan.dense.any():
            steps.append(
                {
                    "builder": id(self),
                    "rows": int(cm.num_reqs),
                    "tokens": int(cm.num_actual_tokens),
                    "seq_lens": cm.seq_lens.data_ptr(),
                    "slots": cm.slot_mapping.data_ptr(),
                    "table": cm.block_table_tensor.data_ptr(),
                    "physical": cm.seq_lens.tolist() == plan.seq_lens.tolist(),
                }
            )
        return parent(self, common_prefix_len, common_attn_metadata, fast_build)

    CPUAttentionMetadataBuilder.build = recording
    llm = common.make_llm(spec["model"], spec["vase"], **spec.get("kw", {}))
    ps = [common.params(n) for n in spec["max_tokens"]]
    outs = llm.generate([common.tokens_prompt(p) for p in spec["prompts"]], ps, use_tqdm=False)
    result = {"steps": steps, "outputs": [list(o.outputs[0].token_ids) for o in outs], "stats": common.stats(llm)}
    common.write(out, result)
    common.free(llm)
