"""Compiled decoding (``EvictingCache(..., compileable=True)``): a decode step as one fixed-shape graph.

A decode step (one token per row, after the first forward) is a fixed-shape graph. Each evicting layer writes the
token at its row's fill (``_fill_t``, a ``[B]`` int64 device tensor), returns its whole buffers ``[B, kv_heads,
capacity, head_dim]``, and attends with a mask built from ``_fill_t`` (``[B, 1, 1, capacity]``; per KV head from the
slot positions with adaptive budgets); the query goes into the ring at a device pointer; the counters advance in place
after the last layer. No Python value that changes from step to step is read inside the step and nothing in it
synchronizes with the host. The eager part runs before the step in :meth:`CompiledDecodeMixin.prepare_decode`: the
compaction of the rows the previous step filled (every ``buffer`` steps, the same code and result as the uncompiled
cache) and the host bookkeeping. ``model.generate(..., compile_config=vase.compile_config(device))`` calls it through
the mask transformers builds before each compiled step (vase's mask function then returns its own mask); an
uncompiled forward calls it from vase's pre-hook.

One graph per model, batch size, buffer shape and saved-query ring: a fixed budget gives one buffer shape for any
prompt length; where the slots needed follow the prompt (the ``full`` policy, a compression ratio, a dense prompt)
the buffers are allocated at :func:`vase.core.config.compiled_capacity` (the next power of two), so one process
compiles at most one graph per power of two.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..core.config import check_compileable_policy, is_int
from ..core.masks import mask_in_kind
from ..core.policy import Policy
from . import attention as attn
from .step import upload

if TYPE_CHECKING:
    from .layer import EvictingLayer


RECOMPILE_LIMIT = 64
"""Graphs torch may compile for one decode step (:func:`compile_config` raises dynamo's ``recompile_limit``, 8 by
default, to this): one per batch size and buffer shape, and the buffer shapes that follow the prompt are powers of
two (:func:`vase.core.config.compiled_capacity`), so a process serving many prompt lengths and batch sizes stays
below it."""


def compile_config(device: torch.device | str, backend: str = "inductor"):
    """transformers' ``CompileConfig`` for compiled decode steps on ``device``: the whole step as one graph
    (``fullgraph``), fixed shapes, CUDA graphs on a GPU (mode 'reduce-overhead'), plain inductor code elsewhere; set
    to compile on any device (transformers compiles on GPUs only unless told).

    Also raises torch's limit of graphs per compiled function (``torch._dynamo.config.recompile_limit``) to at least
    :data:`RECOMPILE_LIMIT`: with ``fullgraph=True`` the default 8 makes the ninth buffer shape in one process fail
    (``FailOnRecompileLimitHit``) instead of compiling it."""
    from transformers import CompileConfig

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    cuda = torch.device(device).type == "cuda"
    config = CompileConfig(
        fullgraph=True, dynamic=False, backend=backend, mode="reduce-overhead" if cuda else "default"
    )
    config._compile_all_devices = True
    return config


def check_compileable(policy: Policy, plan, attn_impl: str, max_cache_len: int | None) -> None:
    """The rules of compiled decoding (``EvictingCache(..., compileable=True)``), as clear errors.

    Raises:
        ValueError: flash-attention (its padded path is not a fixed-shape graph: use sdpa), a hybrid model (its
            sliding-window layers are transformers' dynamic ones), the selection policy ``quest`` (its page table
            grows with the sequence), quantized entries (``kv_bits``: dequantized into a workspace outside any graph),
            a ``max_cache_len`` that is not a positive integer.
    """
    if attn_impl not in ("sdpa", "eager"):
        raise ValueError(
            f"compiled decoding needs sdpa or eager attention, not {attn_impl!r}: load the model with "
            "attn_implementation='sdpa'"
        )
    if any(not p.evicts for p in plan):
        raise ValueError(
            "compiled decoding supports models whose layers are all full attention; this hybrid model's "
            "sliding-window or linear layers are kept by transformers' dynamic layers: use compileable=False"
        )
    check_compileable_policy(policy)
    if max_cache_len is not None and (not is_int(max_cache_len) or max_cache_len < 1):
        raise ValueError(f"max_cache_len must be a positive number of tokens, got {max_cache_len!r}")


@torch.compiler.disable
def _prepare_outside_graph(cache) -> None:
    """:meth:`CompiledDecodeMixin.prepare_decode` run eagerly from inside a compiled forward (a graph break)."""
    cache.prepare_decode()


class StaticLayerMixin:
    """The fixed-shape path of one evicting layer in a compiled decode step (see the module docstring)."""

    def _static_update(self, k: torch.Tensor, v: torch.Tensor):
        """Write the step's token ``[B, kv_heads, 1, D]`` at each row's fill; return the whole buffers
        ``[B, kv_heads, capacity, D]`` (the slots past a row's fill are masked by :meth:`_static_mask`)."""
        c = self.cache
        b, h, _, d = k.shape
        slot = c._fill_t.view(b, 1, 1, 1)
        self.keys.scatter_(2, slot.expand(b, h, 1, d), k)
        self.values.scatter_(2, slot.expand(b, h, 1, v.shape[-1]), v)
        self.positions.scatter_(2, slot.view(b, 1, 1).expand(b, h, 1), c._real_t.view(b, 1, 1).expand(b, h, 1))
        attn.hand_off(self, self.keys)
        return self.keys, self.values

    def _static_mask(self, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """``[B, 1, 1, capacity]`` (``[B, q_heads, 1, capacity]`` with adaptive budgets): the slots holding a token,
        the new one included; bool for sdpa, 0 / dtype-min for eager."""
        c = self.cache
        if c.adaptive:
            h = self.positions.shape[1]
            m = (self.positions >= 0).unsqueeze(2).repeat_interleave(self._q_heads // h, dim=1)
        else:
            m = c._decode_slot_mask()
        return mask_in_kind(m, kind, dtype)

    def _static_after(self) -> None:
        """After the last evicting layer: advance the device counters (fill, position, ring pointer)."""
        c = self.cache
        if self.layer_idx != c._evicting[-1]:
            return
        c._fill_t.add_(1)
        c._real_t.add_(1)
        c._seen_t.add_(1)
        if c.window:
            c._qnext_t.add_(1).remainder_(c.window)
        c._static_forward = False
        c._phase = "ran"


class CompiledDecodeMixin:
    """The compiled-decode bookkeeping of an :class:`~vase.EvictingCache` (see the module docstring)."""

    def prepare_decode(self) -> None:
        """The eager part of the next decode step (one token per row) of a compileable cache: evict the rows the last
        step filled, update the host bookkeeping, plan the step. Idempotent until the step runs.

        ``model.generate(..., compile_config=...)`` calls it for you (through the mask transformers builds before each
        compiled step), and so does an uncompiled forward. A hand-written loop around a compiled forward should call
        it before each step (and pass ``position_ids``): otherwise the compiled forward calls it itself, at the cost
        of a graph break at the start of each step.

        Raises:
            RuntimeError: for a cache made without ``compileable=True``, or before the first forward (the prefill).
        """
        if not self.compileable:
            raise RuntimeError("prepare_decode() is for a cache made with EvictingCache(..., compileable=True)")
        if not self._decode_ok:
            raise RuntimeError("prepare_decode() comes after the first forward pass (the prefill), before each decode")
        if self._phase == "planned":
            return
        self._flush()
        layer = self.layers[self._evicting[0]]
        self._step = None
        self._static_step = self._step_for(self.batch, 1, layer.keys.device)
        self._step = None
        if layer.capacity < self._static_step.capacity:  # `full` past its max_cache_len: larger buffers (recompiles)
            warnings.warn(
                f"the {self.policy.name!r} policy's buffers grow from {layer.capacity} to "
                f"{self._static_step.capacity} slots: compiled decode steps are compiled again for the new shape; "
                "give EvictingCache(..., max_cache_len=prompt + new tokens + 1) to allocate them once",
                stacklevel=2,
            )
            for i in self._evicting:
                self.layers[i]._grow(self._static_step.capacity)
            self._counters_synced = False
        if not self._counters_synced:
            self._sync_counters(layer)
        self._phase = "planned"

    def _flush(self) -> None:
        """After a compiled decode step ran: evict the rows it filled (eagerly, outside the graph) and commit it."""
        if self._phase != "ran":
            return
        step, self._static_step = self._static_step, None
        self._phase = "idle"
        if step.evict_rows:
            for i in self._evicting:
                with self._timed(True, self._fill_t.device):
                    self.layers[i]._compact_rows(step)
        self._commit(step)
        for i in self._evicting:
            self.layers[i].ring.advance()
        if step.evict_rows:
            self._fill_t.copy_(upload(self._fill, self._fill_t.device))

    def _sync_counters(self, layer: EvictingLayer) -> None:
        """Device copies of the host counters, allocated once (their addresses never change, as CUDA graphs need);
        the cache's buffers are marked as static inputs of compiled graphs."""
        dev = layer.keys.device
        values = {
            "_fill_t": upload(self._fill, dev),
            "_real_t": upload(self._real, dev),
            "_seen_t": upload([self._seen], dev).view(()),
            "_qnext_t": upload([layer.ring.next], dev),
            "_slot_ids": torch.arange(layer.capacity, device=dev),
        }
        for name, value in values.items():
            held = getattr(self, name)
            if held is None or held.shape != value.shape or held.device != value.device:
                setattr(self, name, value)
                torch._dynamo.mark_static_address(value)
            else:
                held.copy_(value)
        for i in self._evicting:
            lay = self.layers[i]
            tensors = [lay.keys, lay.values, lay.positions, *lay.ring.tensors()]
            for t in tensors + list(lay.state.values()) + list(lay.row_memo.values()):
                torch._dynamo.mark_static_address(t)
        self._counters_synced = True

    def _begin_static(self) -> None:
        """Start of a compiled decode step (vase's forward pre-hook, inside the graph)."""
        if self._phase != "planned":
            if torch.compiler.is_compiling():
                _prepare_outside_graph(self)
            else:
                self.prepare_decode()
        self._static_forward = True

    def _eager_mask(self, kind: str, dtype: torch.dtype, kwargs: dict) -> torch.Tensor:
        """``[B, 1, 1, capacity]``: the slots each row holds in the planned decode step, the new token's included, built
        before the compiled step. It stands in for the mask transformers would build; vase's attention builds its own
        in the graph (per KV head with adaptive budgets, where each layer's is different)."""
        return mask_in_kind(self._decode_slot_mask(), kind, dtype)

    def _decode_slot_mask(self) -> torch.Tensor:
        """``[B, 1, 1, capacity]`` bool: the slots each row holds in the decode step, its new token's included."""
        b, cap = self._fill_t.shape[0], self._slot_ids.shape[0]
        return (self._slot_ids.view(1, cap) <= self._fill_t.view(b, 1)).view(b, 1, 1, cap)
