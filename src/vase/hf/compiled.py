"""Compiled decoding (``EvictingCache(..., compileable=True)``): a decode step as one fixed-shape graph.

A decode step (one token per row, after the first forward) is a fixed-shape graph. Each evicting layer writes the
token at its row's fill (``fill_t``, a ``[B]`` int64 device tensor), returns its whole buffers ``[B, kv_heads,
capacity, head_dim]``, and attends with a mask built from ``fill_t`` (``[B, 1, 1, capacity]``; per KV head from the
slot positions with adaptive budgets); the query goes into the query ring at each row's device pointer; the counters
advance in place after the last layer. No Python value that changes from step to step is read inside the step and
nothing in it synchronizes with the host. The eager part runs before the step in :meth:`CompiledDecode.prepare`: the
compaction of the rows the previous step filled (every ``buffer`` steps, the same code and result as the uncompiled
cache), the host bookkeeping, and the plan of the next step (which also writes the saved query's position).
``model.generate(..., compile_config=vase.compile_config(device))`` calls it through the mask transformers builds
before each compiled step (vase's mask function then returns its own mask); an uncompiled forward calls it from vase's
pre-hook.

One graph per model, batch size, buffer shape and saved-query ring: a fixed budget gives one buffer shape for any
prompt length; where the slots needed follow the prompt (the ``full`` policy, a compression ratio, a dense prompt)
the buffers are allocated at :func:`vase.core.sizes.compiled_capacity` (the next power of two), so one process
compiles at most one graph per power of two.

Everything of compiled decoding is this one object, held by the cache (``cache.compiled``; None without
``compileable``); during a compiled step the cache routes its layers' update and attention hooks to it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..core.config import check_compileable_policy
from ..core.masks import mask_in_kind
from ..core.policy import Policy
from ..core.sizes import is_int
from ..core.transfer import upload
from . import attention as attn

if TYPE_CHECKING:
    from .cache import EvictingCache
    from .layer import EvictingLayer


RECOMPILE_LIMIT = 64
"""Graphs torch may compile for one decode step (:func:`compile_config` raises dynamo's ``recompile_limit``, 8 by
default, to this): one per batch size and buffer shape, and the buffer shapes that follow the prompt are powers of
two (:func:`vase.core.sizes.compiled_capacity`), so a process serving many prompt lengths and batch sizes stays
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
def _prepare_outside_graph(compiled: CompiledDecode) -> None:
    """:meth:`CompiledDecode.prepare` run eagerly from inside a compiled forward (a graph break)."""
    compiled.prepare()


class _StaticCall:
    """What vase's attention wrapper calls for one layer during a compiled step (the eager one calls the layer)."""

    codes = False  # compiled decoding is refused with kv_bits: attention never reads codes here

    def __init__(self, compiled: CompiledDecode, layer: EvictingLayer):
        self.compiled, self.layer = compiled, layer

    def record_queries(self, query: torch.Tensor, scaling: float | None) -> None:
        self.compiled.record(self.layer, query)

    def attention_mask(self, kind: str, dtype: torch.dtype, query: torch.Tensor | None = None) -> torch.Tensor:
        return self.compiled.mask(self.layer, kind, dtype)

    def after_attention(self) -> None:
        self.compiled.after(self.layer)


class CompiledDecode:
    """The compiled decode steps of one :class:`~vase.EvictingCache` (see the module docstring).

    Attributes:
        decode_ok: decode steps take the static path (after the first forward).
        phase: 'planned' by :meth:`prepare`, 'ran' after the step, 'idle' once flushed.
        in_step: a static step is running (the cache routes its layers here).
        fill_t, real_t, seen_t, qnext_t, slot_ids: the device counters (fill ``[B]``, position of the next token
            ``[B]``, the logical length ``[]``, each row's ring pointer ``[B]``, ``arange(capacity)``), allocated once
            (their addresses never change, as CUDA graphs need).
    """

    def __init__(self, cache: EvictingCache):
        self.cache = cache
        self.clear()

    def attach(self, layer: EvictingLayer) -> None:
        """Give ``layer`` the object vase's attention calls during a compiled step (made once per layer, so that a
        compiled graph never sees it appear)."""
        layer.static_call = _StaticCall(self, layer)

    def clear(self) -> None:
        self.decode_ok = False
        self.phase = "idle"
        self.step = None
        self.in_step = False
        self.synced = False
        self.fill_t = self.real_t = self.seen_t = self.qnext_t = self.slot_ids = None

    # ---------------------------------------------------------------------------------------- the eager part
    def prepare(self) -> None:
        """See :meth:`vase.EvictingCache.prepare_decode`."""
        c = self.cache
        if not self.decode_ok:
            raise RuntimeError("prepare_decode() comes after the first forward pass (the prefill), before each decode")
        if self.phase == "planned":
            return
        self.flush()
        layer = c.layers[c.evicting[0]]
        f = c.forward
        f.step = None
        self.step = f.plan(f.batch, 1, layer.keys.device)
        f.step = None
        if layer.capacity < self.step.capacity:  # `full` past its max_cache_len: larger buffers (recompiles)
            warnings.warn(
                f"the {c.policy.name!r} policy's buffers grow from {layer.capacity} to {self.step.capacity} slots: "
                "compiled decode steps are compiled again for the new shape; give EvictingCache(..., "
                "max_cache_len=prompt + new tokens + 1) to allocate them once",
                stacklevel=3,
            )
            for i in c.evicting:
                c.layers[i].grow(self.step.capacity, self.step)
            self.synced = False
        if not self.synced:
            self.sync_counters(layer)
        self.phase = "planned"

    def flush(self) -> None:
        """After a compiled decode step ran: evict the rows it filled (eagerly, outside the graph) and commit it."""
        if self.phase != "ran":
            return
        c = self.cache
        step, self.step = self.step, None
        self.phase = "idle"
        if step.evict_rows:
            for i in c.evicting:
                with c.counters.timed(True, self.fill_t.device):
                    c.layers[i].compact(step)
        c.forward.commit(step, eager=False)
        if step.evict_rows:
            self.fill_t.copy_(upload(c.seq.schedule.fill[: c.batch], self.fill_t.device))

    def sync_counters(self, layer: EvictingLayer) -> None:
        """Device copies of the host counters, allocated once; the cache's buffers are marked as static inputs of
        compiled graphs."""
        c = self.cache
        dev, b = layer.keys.device, c.batch
        sched = c.seq.schedule
        ring = c.seq.ring
        values = {
            "fill_t": upload(sched.fill[:b], dev),
            "real_t": upload(sched.seen[:b], dev),
            "seen_t": upload([c.forward.seen], dev).view(()),
            "qnext_t": upload(ring.next[:b] if ring is not None else [0] * b, dev),
            "slot_ids": torch.arange(layer.capacity, device=dev),
        }
        for name, value in values.items():
            held = getattr(self, name)
            if held is None or held.shape != value.shape or held.device != value.device:
                setattr(self, name, value)
                torch._dynamo.mark_static_address(value)
            else:
                held.copy_(value)
        tensors = []
        if ring is not None:
            tensors += [q for q in ring.queries if q is not None] + [ring.positions, ring.valid]
        for i in c.evicting:
            lay = c.layers[i]
            tensors += [lay.keys, lay.values, lay.positions, *lay.state.values(), *lay.row_memo.values()]
        for t in tensors:
            torch._dynamo.mark_static_address(t)
        self.synced = True

    def begin(self) -> None:
        """Start of a compiled decode step (vase's forward pre-hook, inside the graph)."""
        if self.phase != "planned":
            if torch.compiler.is_compiling():
                _prepare_outside_graph(self)
            else:
                self.prepare()
        self.in_step = True

    def eager_mask(self, kind: str, dtype: torch.dtype, kwargs: dict) -> torch.Tensor:
        """``[B, 1, 1, capacity]``: the slots each row holds in the planned decode step, the new token's included, built
        before the compiled step. It stands in for the mask transformers would build; vase's attention builds its own
        in the graph (per KV head with adaptive budgets, where each layer's is different)."""
        return mask_in_kind(self.slot_mask(), kind, dtype)

    def slot_mask(self) -> torch.Tensor:
        """``[B, 1, 1, capacity]`` bool: the slots each row holds in the decode step, its new token's included."""
        b, cap = self.fill_t.shape[0], self.slot_ids.shape[0]
        return (self.slot_ids.view(1, cap) <= self.fill_t.view(b, 1)).view(b, 1, 1, cap)

    # ----------------------------------------------------------------------------------- inside the graph
    @torch.no_grad()
    def update(self, layer: EvictingLayer, k: torch.Tensor, v: torch.Tensor):
        """Write the step's token ``[B, kv_heads, 1, D]`` at each row's fill; return the whole buffers
        ``[B, kv_heads, capacity, D]`` (the slots past a row's fill are masked by :meth:`mask`)."""
        b, h, _, d = k.shape
        slot = self.fill_t.view(b, 1, 1, 1)
        layer.keys.scatter_(2, slot.expand(b, h, 1, d), k)
        layer.values.scatter_(2, slot.expand(b, h, 1, v.shape[-1]), v)
        layer.positions.scatter_(2, slot.view(b, 1, 1).expand(b, h, 1), self.real_t.view(b, 1, 1).expand(b, h, 1))
        attn.hand_off(layer.static_call, layer.keys)
        return layer.keys, layer.values

    @torch.no_grad()
    def record(self, layer: EvictingLayer, query: torch.Tensor) -> None:
        """Save the step's query ``[B, q_heads, 1, D]`` at each row's ring pointer (its position was written by the
        step's plan, eagerly)."""
        if not self.cache.window:  # read in the graph: a cache attribute, not the policy (no guard on its classes)
            return
        ring = self.cache.seq.ring
        if ring.queries[layer.index] is None:
            return
        b, hq, _, d = query.shape
        at = self.qnext_t.view(b, 1, 1, 1).expand(b, hq, 1, d)
        ring.queries[layer.index].scatter_(2, at, query.to(ring.queries[layer.index].dtype))

    def mask(self, layer: EvictingLayer, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """``[B, 1, 1, capacity]`` (``[B, q_heads, 1, capacity]`` with adaptive budgets): the slots holding a token,
        the new one included; bool for sdpa, 0 / dtype-min for eager."""
        if self.cache.adaptive:
            h = layer.positions.shape[1]
            m = (layer.positions >= 0).unsqueeze(2).repeat_interleave(layer._q_heads // h, dim=1)
        else:
            m = self.slot_mask()
        return mask_in_kind(m, kind, dtype)

    @torch.no_grad()
    def after(self, layer: EvictingLayer) -> None:
        """After the last evicting layer: advance the device counters (fill, position, ring pointer)."""
        c = self.cache
        if layer.layer_idx != c.evicting[-1]:
            return
        self.fill_t.add_(1)
        self.real_t.add_(1)
        self.seen_t.add_(1)
        if c.window:
            self.qnext_t.add_(1).remainder_(c.window)
        self.in_step = False
        self.phase = "ran"
