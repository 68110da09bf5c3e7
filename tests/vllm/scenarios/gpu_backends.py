"""vase's GPU backend classes (:mod:`vase.vllm.gpu_backends`) inside a running CPU engine with evictions.

At every step with a plan, for the first and the last full-attention layer: a token-major copy of the layer's cache
(as the GPU backends hold it, ``[blocks, block_size, H, 2D]`` in memory) is taken before vLLM's CPU kernel runs;
then vase's FlashAttention and Triton builders build their metadata from the same runner metadata (logical) and the
same step plan, and vase's impls run vLLM's own ``FlashAttentionImpl.forward`` / ``TritonAttentionImpl.forward`` and
cache writes on the copy, with the kernel and cache-write calls replaced by plain torch
(``paged_reference.py``) that reads exactly the arguments the impls pass. The outputs are compared with vLLM's CPU
kernel's; the copy's new entries with the step's keys and values at the plan's physical slots. A step with dense rows
must be refused by the GPU builders.

Job: ``{"model", "prompts": [[ids]], "max_tokens": [...], "vase": engine_args kwargs, "batches": [[prompt
indices]] (one generate call each, in order; default one)}``. Result: ``{"compared":
{backend: [{"rows", "tokens", "evicted_rows", "max_abs", "written", "physical"}]}, "refused_dense", "outputs",
"stats"}``.
"""

from __future__ import annotations

import common
import paged_reference as ref
import torch
import vllm.v1.attention.backends.flash_attn as fa
import vllm.v1.attention.backends.triton_attn as ta

from vase.vllm import gpu_backends as gb
from vase.vllm.backend import VaseCPUAttentionImpl, VaseCPUAttentionMetadataBuilder


def _check(kw, expect_window=True):
    """The kernel arguments paged attention here does not model must be the plain ones."""
    assert kw.get("alibi_slopes") is None and not kw.get("softcap")
    window = kw.get("window_size")
    assert window is None or tuple(window) == (-1, -1), window
    assert kw.get("causal") in (True, None), kw.get("causal")
    sinks = kw.get("s_aux", kw.get("sinks"))
    assert sinks is None
    assert int(kw["max_seqlen_k"]) >= int(kw["seqused_k"].max())


def fa_kernel(**kw):  # vLLM's _FA4_DENSE_ATTENTION_KERNEL(...) call, keyword arguments only
    _check(kw)
    out = ref.paged_attention(kw["q"], kw["k"], kw["v"], kw["block_table"], kw["seqused_k"], kw["cu_seqlens_q"],
                              kw["softmax_scale"])  # fmt: skip
    kw["out"].copy_(out)


def triton_kernel(**kw):  # vLLM's unified_attention(...) call
    _check(kw)
    out = ref.paged_attention(kw["q"], kw["k"], kw["v"], kw["block_table"], kw["seqused_k"], kw["cu_seqlens_q"],
                              kw["softmax_scale"])  # fmt: skip
    kw["out"].copy_(out)


def cache_write(key, value, key_cache, value_cache, slot_mapping, *rest):
    ref.write_slots(key, value, key_cache, value_cache, slot_mapping)


if __name__ == "__main__":
    spec, out = common.job()
    fa._FA4_DENSE_ATTENTION_KERNEL = fa_kernel
    fa.reshape_and_cache_flash = cache_write  # not imported by the CPU build (no FlashAttention): set here
    ta.unified_attention = triton_kernel
    ta.triton_reshape_and_cache_flash = cache_write
    compared = {"flash_attn": [], "triton": []}
    refused = []
    builders, impls = {}, {}
    cpu_build = VaseCPUAttentionMetadataBuilder.build

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = cpu_build(self, common_prefix_len, common_attn_metadata, fast_build)
        if getattr(md, "vase_plan", None) is not None:
            md.shadow = (self, common_prefix_len, common_attn_metadata)  # the runner's (logical) metadata
        return md

    cpu_forward = VaseCPUAttentionImpl.forward
    sampled = set()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, **more):
        rest = (output_scale, more.get("output_block_scale"))
        shadow = getattr(attn_metadata, "shadow", None) if attn_metadata is not None else None
        if shadow is None or layer.layer_name not in sampled:
            return cpu_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest)
        builder, cpl, cm = shadow
        plan, ws = attn_metadata.vase_plan, attn_metadata.vase_state
        keys, values = attn_metadata.vase_paged.read(kv_cache, torch.arange(kv_cache.shape[0]))  # [B, H, bs, D]
        b, h, bs, d = keys.shape
        copy = torch.empty(b, bs, h, 2 * d, dtype=keys.dtype).transpose(1, 2)  # token-major in memory
        copy.copy_(torch.cat([keys, values], dim=-1))
        n = attn_metadata.vase_tokens
        cpu_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest)
        for name, (bcls, icls) in {
            "flash_attn": (gb.VaseFlashAttentionMetadataBuilder, gb.VaseFlashAttentionImpl),
            "triton": (gb.VaseTritonAttentionMetadataBuilder, gb.VaseTritonAttentionImpl),
        }.items():
            key_b = (name, id(builder))
            if key_b not in builders:
                builders[key_b] = bcls(builder.kv_cache_spec, builder.vase_layers, builder.vllm_config, builder.device)
                builders[key_b].vase_state = ws
            if plan.dense.any():
                try:
                    builders[key_b].build(cpl, cm)
                except NotImplementedError:
                    refused.append(name)
                continue
            gmd = builders[key_b].build(cpl, cm)
            if (name, layer.layer_name) not in impls:
                impl = icls(self.num_heads, self.head_size, self.scale, self.num_kv_heads, None, None, "auto")
                if name == "flash_attn":
                    impl.vllm_flash_attn_version = 2  # what a CUDA build detects; the CPU build detects none
                impls[(name, layer.layer_name)] = impl
            impl = impls[(name, layer.layer_name)]
            sh = copy.clone()
            got = torch.zeros_like(output)
            impl.vase_attend(layer, query, key, value, sh, gmd, got)
            kc, vc = sh.transpose(1, 2).split(d, dim=-1)
            slots = gmd.slot_mapping[:n]
            ok = slots >= 0
            s = slots[ok]
            written = torch.equal(kc[s // bs, s % bs], key[:n][ok]) and torch.equal(vc[s // bs, s % bs], value[:n][ok])
            compared[name].append(
                {
                    "rows": int(cm.num_reqs),
                    "tokens": int(n),
                    "evicted_rows": int((plan.seq_lens < cm.seq_lens[: cm.num_reqs].to(plan.seq_lens.dtype)).sum()),
                    "max_abs": float((got[:n] - output[:n]).abs().max()),
                    "written": bool(written),
                    "physical": gmd.seq_lens.tolist() == plan.seq_lens.tolist()
                    and torch.equal(gmd.slot_mapping[:n], attn_metadata.vase_slots[:n]),
                }
            )
        return output

    VaseCPUAttentionMetadataBuilder.build = build
    VaseCPUAttentionImpl.forward = forward
    llm = common.make_llm(spec["model"], spec["vase"], **spec.get("kw", {}))
    from vase.vllm.seam import driver_worker

    layers = sorted(driver_worker(llm).model_runner.vase_state.layer_index, key=lambda name: int(name.split(".")[2]))
    sampled.update({layers[0], layers[-1]})
    outs = []
    for batch in spec.get("batches", [list(range(len(spec["prompts"])))]):  # one generate call each
        ps = [common.params(spec["max_tokens"][i]) for i in batch]
        outs += llm.generate([common.tokens_prompt(spec["prompts"][i]) for i in batch], ps, use_tqdm=False)
    result = {
        "compared": compared,
        "refused_dense": refused,
        "layers": sorted(sampled),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "stats": common.stats(llm),
    }
    common.write(out, result)
    common.free(llm)
