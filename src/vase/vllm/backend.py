"""The CPU attention backend with vase: physical lengths and slots, then eviction after each layer's attention.

Registered in place of vLLM's ``CPU_ATTN`` by the plugin's entry point (:func:`vase.vllm.register`), in every process.
Subclasses of vLLM's classes (``v1/attention/backends/cpu_attn.py``), each calling the original:

* :class:`VaseCPUAttentionMetadataBuilder`: when the worker made a plan for the step, the metadata of a
  full-attention KV cache group gets the plan's physical ``seq_lens``, that group's slot mapping and block table, so
  vLLM's kernel scheduler metadata is computed from physical lengths; logical positions (RoPE) are untouched. A step
  with dense rows (entries that do not fit in their blocks) gets one per run of adjacent rows of one kind: the other
  rows' over the paged cache, the dense rows' over a scratch cache (:class:`vase.vllm.compact.DenseSplit`). Without
  a plan (vase not configured, dummy and profiling runs) and for sliding-window groups (vLLM bounds them itself) it is
  the stock builder.
* :class:`VaseCPUAttentionImpl`: writes the step's new keys and values at the plan's physical slots (the backend
  sets ``forward_includes_kv_cache_update``, so vLLM's layer does not write them at logical slots), runs vLLM's kernel
  (over the rows that fit in their blocks), then :mod:`vase.vllm.compact` (ring, dense rows, eviction). Without a
  plan it writes at the runner's slots and runs the kernel: exactly the stock backend.
"""

from __future__ import annotations

import dataclasses
import time

from . import compact
from .layout import LayoutError
from .paged import cpu_layout
from .plan_metadata import PlanBuilder
from .seam import AttentionType, CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadataBuilder


class VaseCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend whose impl writes the KV cache itself (at physical slots) and evicts."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return VaseCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return VaseCPUAttentionMetadataBuilder


class VaseCPUAttentionMetadataBuilder(PlanBuilder, CPUAttentionMetadataBuilder):
    """vLLM's builder, given the step plan's physical lengths and slots (see the module docstring and
    :class:`vase.vllm.plan_metadata.PlanBuilder`).

    Raises:
        VaseConfigError: at engine start, for a configuration :func:`vase.vllm.settings.settings_from` refuses (this
            also catches an engine with vase configured but without the plugin's scheduler and worker classes).
        ValueError: a CPU attention ISA whose cache write does not store each key and value element as given (its
            layout is read off that write at start, :func:`vase.vllm.paged.cpu_layout`: vec, vec16 and amx are).
    """

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.vase_setup(kv_cache_spec, layer_names, vllm_config)
        if self.vase is not None and self.vase.evicts:
            spec = kv_cache_spec
            try:  # the cache's layout for this kernel ISA, read off vLLM's own cache write
                self.vase_paged = cpu_layout(self.isa, spec.num_kv_heads, spec.block_size, spec.head_size, spec.dtype)
            except LayoutError as exc:
                raise ValueError(f"vase cannot read the KV cache of the CPU attention ISA {self.isa!r}: {exc}") from exc

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        plan, layout = self.vase_plan(common_attn_metadata)
        if plan is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        t = time.perf_counter()
        ws = self.vase_state
        cm = self.vase_metadata(common_attn_metadata, plan, layout)
        if plan.dense.any():
            # dense rows do not fit in their blocks: the kernel attends them over a scratch cache of their own
            # (vase.vllm.compact.DenseSplit), the other rows over the paged cache, a call per run of adjacent rows
            # of one kind over views of the step's queries and output
            split = compact.split_dense(plan, self.block_size)
            runs = []
            for run in split.runs:
                sub = _scratch_metadata(cm, split, run) if run.dense else _subset(cm, run)
                runs.append((run, super().build(0 if run.dense else common_prefix_len, sub, fast_build)))
            md = runs[0][1]
            md.vase_split, md.vase_runs = split, runs
        else:
            md = super().build(common_prefix_len, cm, fast_build)
        md.vase_plan = plan
        md.vase_state = ws
        md.vase_layout = layout
        md.vase_paged = self.vase_paged
        md.vase_tokens, md.vase_slots = cm.num_actual_tokens, cm.slot_mapping
        ws.stats["t_build"] += time.perf_counter() - t
        return md


class VaseCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention impl, plus the write at physical slots and the eviction (see the module docstring).

    Learned sinks (gpt-oss) are the kernel's; the eviction scores leave them out, as vase on transformers does (a
    sink only adds to each softmax's denominator: the order of one query's weights over the keys is unchanged).

    Raises:
        ValueError: at the first step with vase, a full-attention layer with a sliding window, ALiBi or a logit
            soft-cap (the eviction scores would not see what the kernel computes).
    """

    _vase_layer: int | None = None

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        if attn_metadata is None:  # warm-up
            return output
        plan = getattr(attn_metadata, "vase_plan", None)
        n = attn_metadata.num_actual_tokens if plan is None else attn_metadata.vase_tokens
        encoder = self.attn_type in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER)
        if not encoder and key is not None and value is not None:
            # the slots are the plan's physical ones with vase, the runner's otherwise (stock behaviour)
            slots = attn_metadata.slot_mapping if plan is None else attn_metadata.vase_slots
            self.do_kv_cache_update(layer, key[:n], value[:n], kv_cache, slots)
        runs = getattr(attn_metadata, "vase_runs", None)
        if runs is None:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        else:  # the runs of rows that fit in their blocks: the kernel over the paged cache (dense runs: after)
            for run, run_md in runs:
                if not run.dense:
                    o = output[run.a : run.b]
                    super().forward(layer, query[run.a : run.b], None, None, kv_cache, run_md, o)
        if plan is not None:
            t = time.perf_counter()
            self._after_attention(layer, query[:n], key[:n], value[:n], kv_cache, plan, attn_metadata, output)
            attn_metadata.vase_state.stats["t_after"] += time.perf_counter() - t
        return output

    def _after_attention(self, layer, q, k, v, kv_cache, plan, md, output) -> None:
        ws = md.vase_state
        if self._vase_layer is None:
            plain = self.sliding_window in (-1, None) and self.alibi_slopes is None and not self.logits_soft_cap
            self._vase_layer = compact.full_attention_layer(ws, layer, plain)
        li, layout = self._vase_layer, md.vase_layout
        compact.save_queries(ws, li, q, plan)
        dense = {}
        split = getattr(md, "vase_split", None)
        if split is not None:
            dense = compact.attend_dense(
                self, layer, ws, li, q, k, v, kv_cache, output, plan, layout, split, md, md.vase_paged
            )
        compact.evict_rows(ws, li, layer, kv_cache, plan, layout, dense, self.scale, md.vase_paged)

    def attend_scratch(self, layer, query, scratch, md, output) -> None:
        """vLLM's kernel over a scratch cache (``md``: its metadata; the dense rows of a step)."""
        CPUAttentionBackendImpl.forward(self, layer, query, None, None, scratch, md, output)


def _subset(cm, run):
    """``cm`` restricted to the adjacent batch rows of ``run`` (:class:`vase.vllm.compact.Run`), their query start
    locations from 0, for the kernel's call over the paged cache on the step's tokens ``[run.a, run.b)``."""
    qsl = cm.query_start_loc_cpu[run.r0 : run.r1 + 1] - run.a
    return _rows_metadata(cm, run, qsl, cm.seq_lens[run.r0 : run.r1], cm.block_table_tensor[run.r0 : run.r1])


def _scratch_metadata(cm, split, run):
    """The metadata of the dense rows of ``run`` (places ``[run.j0, run.j1)`` of ``split.rows``) over the step's
    scratch cache (:class:`vase.vllm.compact.DenseSplit`)."""
    j0, j1 = run.j0, run.j1
    qsl = split.qsl[j0 : j1 + 1] - split.qsl[j0]
    table = split.block_table[j0:j1]
    return _rows_metadata(cm, run, qsl, split.seq_lens[j0:j1], table, slot_mapping=split.slots)


def _rows_metadata(cm, run, qsl, seq_lens, block_table, **more):
    """``cm`` for the rows of ``run`` alone: their query start locations ``qsl`` (from 0), kernel lengths
    ``seq_lens`` and block table (``more``: other fields replaced as given)."""
    return dataclasses.replace(
        cm,
        num_reqs=len(seq_lens),
        num_actual_tokens=run.b - run.a,
        max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        block_table_tensor=block_table,
        **more,
    )
