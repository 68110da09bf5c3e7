"""The step plan in an attention backend's metadata: one builder mixin for every backend vase runs on.

vLLM's metadata builders (CPU, FlashAttention, Triton) all start from the runner's ``CommonAttentionMetadata``, with
logical lengths and slots. With vase, a row's cache holds fewer entries than its logical length, at physical slots the
worker's step plan (:class:`vase.vllm.state.PagedStep`) gives. :class:`PlanBuilder` replaces, in that metadata, the
``seq_lens`` with the plan's physical ones, the slot mapping with the plan's physical slots and (rows past their
front blocks, with prefix caching) the block table, before the backend's own ``build`` sees it, so every kernel
argument the backend derives (FlashAttention's ``seqused_k`` and its ahead-of-time scheduler metadata, Triton's
``seq_lens``, the CPU kernel's scheduler metadata) is derived from physical lengths. Logical positions (RoPE) are
untouched. The three tensors are views of buffers the builder allocates once, so a captured CUDA graph reads them
at fixed addresses.
"""

from __future__ import annotations

import dataclasses

import torch

from .settings import settings_from
from .spec import VaseFullAttentionSpec


class PlanBuilder:
    """Mixin for a vLLM attention metadata builder (listed before it in the bases): the step plan's physical lengths,
    slots and block table in the metadata (see the module docstring).

    ``vase_state`` is handed over by vase's model runner (:mod:`vase.vllm.worker`); ``vase`` is the engine's
    settings, None for a sliding-window group (vLLM bounds it itself) or without vase; ``vase_paged`` the layout of
    the backend's cache (:mod:`vase.vllm.layout`), set by :meth:`vase_setup`.
    """

    vase_state = None
    vase = None
    vase_paged = None
    vase_buffers = None  # persistent seq_lens, slot mapping, block table (_vase_buffers)

    def vase_setup(self, kv_cache_spec, layer_names, vllm_config) -> None:
        """Called at the end of the builder's ``__init__``: the engine's settings and this group's layers."""
        self.vase = settings_from(vllm_config)
        self.vase_layers = list(layer_names)
        if not isinstance(kv_cache_spec, VaseFullAttentionSpec):  # a sliding-window group: vLLM's own metadata
            self.vase = None

    def vase_plan(self, cm):
        """The step plan and this group's :class:`vase.vllm.state.GroupLayout`, or ``(None, None)`` for a step vase
        does not touch (vase off, a dummy or profiling run, a sliding-window group).

        Raises:
            RuntimeError: the plan and the runner's metadata disagree on the number of requests.
        """
        ws = self.vase_state
        plan = ws.plan if (ws is not None and self.vase is not None) else None
        if plan is None:
            return None, None
        if cm.num_reqs != plan.num_reqs:
            raise RuntimeError(f"vase: the step plan has {plan.num_reqs} requests, the metadata {cm.num_reqs}")
        return plan, plan.layouts[ws.layer_group[self.vase_layers[0]]]

    def vase_metadata(self, cm, plan, layout):
        """``cm`` (vLLM's ``CommonAttentionMetadata``) with the plan's physical ``seq_lens`` ``[R]`` int32, slot
        mapping ``[T]`` int64 (the new tokens' physical slots) and block table ``[R, nb]``, in the builder's persistent
        buffers."""
        seq_lens, slots, table = self._vase_buffers(cm.num_reqs, len(layout.slot_mapping), cm.block_table_tensor)
        seq_lens.copy_(plan.seq_lens)
        slots.copy_(layout.slot_mapping)
        table.copy_(cm.block_table_tensor)
        if plan.shifted.any():  # rows past their front blocks (prefix caching): their blocks from there on
            rows = torch.from_numpy(plan.shifted)
            nb = min(layout.block_rows.shape[1], table.shape[1])
            table[rows, :nb] = layout.block_rows[rows, :nb].to(table.dtype)
        return dataclasses.replace(
            cm,
            seq_lens=seq_lens,
            max_seq_len=int(plan.seq_lens.max()),
            slot_mapping=slots,
            block_table_tensor=table,
        )

    def _vase_buffers(self, rows: int, tokens: int, table: torch.Tensor):
        """Views of the builder's persistent ``seq_lens`` ``[rows]`` int32, slot mapping ``[tokens]`` int64 and block
        table ``[rows, blocks]`` (``table``'s dtype): allocated once for the engine's largest step (``max_num_seqs``
        rows, ``max_num_batched_tokens`` tokens), so the kernel reads the plan from the same storage at every step
        and batch size, as a captured CUDA graph needs (vLLM's own metadata buffers are persistent the same way).
        Reallocated, larger, only for a step beyond them (never, within the engine's limits)."""
        b = self.vase_buffers
        if b is None or rows > len(b[0]) or tokens > len(b[1]) or table.shape[1] != b[2].shape[1]:
            sc = self.vllm_config.scheduler_config
            most_rows, most_tokens = max(rows, sc.max_num_seqs), max(tokens, sc.max_num_batched_tokens)
            b = self.vase_buffers = (
                torch.zeros(most_rows, dtype=torch.int32, device=table.device),
                torch.zeros(most_tokens, dtype=torch.int64, device=table.device),
                torch.zeros(most_rows, table.shape[1], dtype=table.dtype, device=table.device),
            )
        return b[0][:rows], b[1][:tokens], b[2][:rows]
