"""The evicting KV cache: a ``transformers`` :class:`~transformers.Cache` with a static footprint.

Per layer, keys and values live in buffers ``[batch, kv_heads, budget + buffer, head_dim]`` allocated once, in the
model's dtype and on its device; they never move or grow while generating (VaSE, arXiv 2606.03928, Sec. 3.3).

The cache is composed of parts, one module each: the sequence model it owns (:class:`vase.core.sequence.Sequences`:
the schedule, the row tables of every held slot, the saved queries, the eviction call), its forward passes
(:mod:`vase.hf.forward`: checks, the plan of each step, :mod:`vase.hf.step`), its evicting layers
(:mod:`vase.hf.layer`), each holding a storage strategy (:mod:`vase.hf.storage` dense, :mod:`vase.hf.quantized` with
``kv_bits``), compiled decoding as one object (:mod:`vase.hf.compiled`), the attention hooks and masks
(:mod:`vase.hf.attention`), the hybrid layers (:mod:`vase.hf.hybrid`) and the statistics (:mod:`vase.hf.stats`).

Hybrid models (gpt-oss, Gemma 3, OLMo 3, Qwen3-Next, Qwen3.5): only the full-attention layers are evicting layers;
the sliding-window and linear-attention layers are transformers' own cache layers, built as ``DynamicCache(config=...)``
builds them, in the same cache object.

Adaptive budgets (policy options ``head_budget='adakv'``, ``layer_budget='pyramid'``; :mod:`vase.core.budgets`):
heads and layers keep different counts while the schedule stays shared. Every (layer, KV head) has ``slots`` physical
slots for kept tokens (``budget_cap * budget`` with AdaKV, the largest layer budget with PyramidKV alone); a
compaction leaves every row at fill ``slots``, a head keeping ``n`` holding its tokens at ``[0, n)`` and dead slots
(position -1) at ``[n, slots)``; the row next evicts at ``slots + buffer``, that is ``buffer`` tokens later as in the
uniform case. Dead slots are masked per head in attention (``[B, q_heads, q, kv_len]``, sdpa and eager;
flash-attention is refused at creation) and left out of the next eviction. The first eviction still comes at ``budget
+ buffer`` tokens. The buffers are allocated for ``slots + buffer``: ``stats().bytes_held`` is that,
``stats().bytes_live`` what attention reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core import budgets
from ..core.config import VaseConfig
from ..core.policy import Policy
from ..core.sequence import Sequences
from ..core.sizes import DEFAULT_BUDGET, DEFAULT_BUFFER, DEFAULT_SINKS, is_int
from . import attention as attn
from . import hybrid
from .compiled import CompiledDecode, check_compileable
from .confidence import masked_top
from .forward import ForwardPlanner
from .layer import Counters, EvictingLayer
from .quantized import QuantizedStorage, Workspace
from .stats import CacheStats
from .storage import DenseStorage

SUPPORTED_LAYER_TYPES = hybrid.EVICTING_LAYER_TYPES + hybrid.KEPT_LAYER_TYPES


def check_seed(seed) -> None:
    """Raises a clear ValueError unless ``seed`` is an int or a non-empty list of ints (one per row)."""
    if isinstance(seed, (list, tuple)):
        if not seed or not all(is_int(s) for s in seed):
            raise ValueError(f"seed must be an int or a non-empty list of ints, got {seed!r}")
    elif not is_int(seed):
        raise ValueError(f"seed must be an int or a list of ints, got {seed!r}")


class EvictingCache(Cache):
    """A KV cache held at ``budget + buffer`` tokens per layer by an eviction policy.

    Example::

        cache = vase.EvictingCache(model, policy="vase", budget=1024)
        out = model.generate(**inputs, cache=cache, max_new_tokens=4096)
        # transformers before the keyword's rename (5.19): past_key_values=cache; either: **vase.cache_kwargs(cache)
        print(cache.stats().line())

    Creating the cache installs vase's attention function on ``model`` (:func:`vase.hf.attention.install`): it saves
    the post-RoPE queries for scoring, then calls the model's own sdpa / eager / flash_attention_2 function with a
    mask over physical slots. The kept layers of a hybrid model get transformers' own mask and attention, unchanged
    (learned sinks, soft-capping, sliding windows, per-layer RoPE all stay the model's). Scoring recomputes attention
    from saved queries with the layer's own ``scaling`` (Gemma's ``query_pre_attn_scalar``, Gemma 4's 1.0), but
    without gpt-oss's learned sinks or a logit soft-cap. Neither changes the order of one query's weights over the
    keys (a soft-cap is increasing in the logit; a sink only adds to the softmax denominator), only their scale, hence
    how much each saved query counts in the mean over the window; the model's attention applies both.

    Args:
        model: a ``transformers`` causal LM: full-attention layers (Llama, Qwen3, DeepSeek-R1-Distill, ...), or a
            hybrid model whose other layers are sliding-window or linear attention (gpt-oss, Gemma 3, OLMo 3,
            Qwen3-Next, Qwen3.5): only the full-attention layers evict; the others keep the state transformers'
            default cache gives them, in the same cache object (see :mod:`vase.hf.hybrid`).
        policy: a policy name (see :data:`vase.POLICY_NAMES`) or a built :class:`vase.Policy`.
        budget: tokens kept per (row, layer, KV head) after each eviction (on average over the heads and layers with
            the policy options ``head_budget='adakv'`` / ``layer_budget='pyramid'``, at most ``budget_cap`` x budget
            each; the buffers then hold ``budget_cap`` x budget + buffer slots per head, see the module docstring);
            for the selection policy ``quest``, which keeps every token, the tokens each query attends to (see
            :mod:`vase.core.pages`).
        buffer: recent window in tokens, always kept; the cache is compacted every ``buffer`` decode steps. The
            policy option ``recent`` keeps another count of newest tokens instead (see
            :func:`vase.core.config.recent_window`).
        sinks: first tokens of each row always kept (attention sinks), default 4.
        window: saved queries per layer for attention-based scorers (default: the policy's window; the buffer for
            the published preset).
        seed: int (row ``b`` uses ``seed + b``) or one int per row: keys the random choices of each row.
        compress_prompt: compress a prompt longer than the budget at prefill; False keeps it dense until the first
            eviction, as the paper's code does: the first eviction then comes at the first multiple of ``buffer``
            tokens above the prompt (and at least at ``budget + buffer``). Default: the policy's option ``prompt``
            ('compress' unless the policy says 'dense', as ``preset='paper'`` does).
        record_evictions: keep the details of each layer's last eviction in ``layer.last_eviction`` (tests,
            inspection; ``n_protect`` is the guard's count or cap, ``n_protected`` ``[rows, KV heads]`` how many
            each head protected).
        profile: synchronize the GPU around evictions so ``eviction_seconds`` is exact (slower).
        compileable: decode steps as fixed-shape graphs for ``torch.compile`` / CUDA graphs (see "Compiled
            decoding" below); ``is_compileable`` is then True.
        max_cache_len: with ``compileable``, for a policy that never evicts (``full``): tokens its buffers hold
            from the start (prompt + new tokens + 1), so they never grow (a growth means a new graph).
        config: a resolved :class:`vase.VaseConfig` instead of the policy and size arguments (which then stay at
            their defaults); its budget must be fixed (a ratio: ``config.for_length(prompt + new tokens)``).
        **policy_options: options of the policy (window, kernel, pool, guard, protect_share, guard_mode, selector,
            temperature, lam, rank, head_budget, layer_budget, budget_cap; see :func:`vase.make_policy`), and the
            storage options: ``kv_bits`` (8, 4 or 2: kept entries stored quantized, see "Quantized storage" below),
            ``kv_group``, ``protect_precision``.

    Quantized storage (policy option ``kv_bits``, :mod:`vase.hf.quantized`, :mod:`vase.core.quant`): what a
    compaction keeps is stored in ``kv_bits``-bit integers with float16 scales, allocated once; the tokens written since
    a row's last compaction stay in full precision (for ``full``: every token older than its last ``buffer`` block);
    with ``protect_precision='guard'`` the value guard's largest entries stay in full precision too.
    ``stats().bytes_held`` counts every byte stored. Not with compiled decoding or adaptive budgets (clear errors).

    Compiled decoding (``compileable=True``, :mod:`vase.hf.compiled`): a decode step (one token per row, after the
    first forward) is a fixed-shape graph; the eager part (eviction, bookkeeping) runs before it in
    :meth:`prepare_decode`. Greedy outputs equal the uncompiled cache's token for token (``tests/hf/test_compile.py``).
    Not for flash-attention, hybrid models or ``quest`` (clear errors).

    Raises:
        ValueError: budget not larger than sinks + buffer, buffer < 1, sinks < 0, window < 1, an unknown policy
            or policy option, protected share outside [0, 1), sampling temperature <= 0, for the published preset
            (``preset='paper'``) a budget that is not a multiple of the buffer or a window other than the buffer,
            a model with a layer kind vase cannot hold (see :func:`check_model_supported`), adaptive budgets with an
            attention other than sdpa or eager (flash-attention has no per-head mask) or a ``budget_cap`` below the
            first layer's pyramid budget, for ``quest`` a budget below its forced pages or a flash-attention model,
            or, at the first forward, keys of another shape than the model's, a cache reused for another model or
            batch size, or reused without :meth:`reset` for a new prompt no longer than the tokens it holds; with
            ``compileable``, see :func:`vase.hf.compiled.check_compileable`; ``config`` together with policy or size
            arguments, or a ``config`` whose budget waits for a ratio; the storage options of
            :func:`vase.core.quant.check_options`, and at the first forward a ``kv_group`` that does not divide the
            head dim; a learned scorer's weights trained for a model of another shape.
    """

    def __init__(
        self,
        model,
        policy: str | Policy = "vase",
        budget: int | None = None,
        buffer: int = DEFAULT_BUFFER,
        sinks: int = DEFAULT_SINKS,
        window: int | None = None,
        seed: int | Sequence[int] = 0,
        compress_prompt: bool | None = None,
        record_evictions: bool = False,
        profile: bool = False,
        compileable: bool = False,
        max_cache_len: int | None = None,
        config: VaseConfig | None = None,
        **policy_options,
    ):
        if config is None:
            config = VaseConfig.resolve(
                policy,
                budget=DEFAULT_BUDGET if budget is None else budget,
                buffer=buffer,
                sinks=sinks,
                window=window,
                compress_prompt=compress_prompt,
                compile=compileable,
                **policy_options,
            )
        else:
            given = (policy, budget, buffer, sinks, window, compress_prompt)
            if policy_options or given != ("vase", None, DEFAULT_BUFFER, DEFAULT_SINKS, None, None):
                raise ValueError("give either config= or the policy and size arguments, not both")
            if config.budget is None:
                raise ValueError(
                    f"this configuration has a compression ratio ({config.ratio:g}x) but no budget yet: pass "
                    "config.for_length(prompt + new tokens)"
                )
        check_seed(seed)
        text_config = model.config.get_text_config(decoder=True)
        check_model_supported(text_config)
        self.config = config
        self.policy = config.policy
        self.budget, self.buffer, self.sinks = config.budget, config.buffer, config.sinks
        self.recent, self.window, self.compress_prompt = config.recent, config.window, config.compress_prompt
        self.seed = seed
        if self.policy.sparse is not None:
            self.policy.sparse.check(self.budget, self.sinks, attn.base_implementation(model))
        self.record_evictions = record_evictions
        # One entry per decoder layer: full-attention layers evict, the others (sliding window, linear attention) are
        # transformers' own layer classes, as in DynamicCache(config=...) (see vase.hf.hybrid).
        self._plan = hybrid.plan_layers(text_config)
        self.evicting = [p.index for p in self._plan if p.evicts]
        first = self._plan[self.evicting[0]]
        self.num_kv_heads, self.head_dim = first.kv_heads, first.head_dim
        self.num_layers = len(self.evicting)  # evicting layers: a forward pass is done when all of them are
        check_shape = getattr(self.policy.scorer, "check_model", None)  # a learned scorer: weights for this model
        if check_shape is not None:
            check_shape(self.evicting, self.num_kv_heads, self.head_dim)
        # adaptive budgets (policy options head_budget / layer_budget): the budget of each evicting layer (by model
        # layer index; PyramidKV's depth runs over the evicting layers) and the physical slots per (layer, KV head)
        # for kept tokens; uniform: every layer keeps `budget` in `budget` slots
        per_layer, self.slots = config.layout(self.num_layers)
        self.layer_budgets = dict(zip(self.evicting, per_layer))
        self.adaptive = self.policy.adaptive_budgets
        self.adakv = self.adaptive and self.policy.options.get("head_budget") == "adakv"
        if self.adaptive:
            budgets.check_head_budgets_supported(attn.base_implementation(model))
        self.compileable = bool(compileable) or config.compile
        self.full_length = (
            max_cache_len  # not `max_cache_len`: transformers < 5.24 has a read-only property of that name
        )
        self.kv_bits, self.kv_group, self.protect_precision = config.kv_bits, config.kv_group, config.protect_precision
        if self.compileable:
            check_compileable(self.policy, self._plan, attn.base_implementation(model), max_cache_len)
        self._model_ref = weakref.ref(model)
        self.counters = Counters(profile=profile)
        self.workspace = Workspace() if self.quantized else None
        self.compiled = CompiledDecode(self) if self.compileable else None
        self.forward = ForwardPlanner(self)
        self.seq = self._new_sequences()
        layers = [self._new_layer(p) for p in self._plan]
        super().__init__(layers=layers)
        attn.install(model)

    def _new_sequences(self) -> Sequences:
        return Sequences(self.config, self.evicting, [self.layer_budgets[i] for i in self.evicting], self.slots)

    def _new_layer(self, plan):
        """An evicting layer (its storage: quantized with ``kv_bits``, else dense) or a kept transformers layer."""
        if not plan.evicts:
            return hybrid.kept_layer(plan)
        if self.quantized:
            storage = QuantizedStorage(self.config, self.layer_budgets[plan.index], self.seq.schedule, self.workspace)
        else:
            storage = DenseStorage()
        layer = EvictingLayer(
            self.seq, self.evicting.index(plan.index), plan.index, storage, self.get_seq_length, self.counters
        )
        layer.record = self.record_evictions
        if self.compiled is not None:
            self.compiled.attach(layer)
        return layer

    def reset(self) -> None:
        """Empty the cache so it can be used again (any batch size) with the same model."""
        self.forward.clear()
        if self.compiled is not None:
            self.compiled.clear()
        self.counters.eviction_seconds, self.counters.protected = 0.0, 0
        if self.workspace is not None:
            self.workspace.__init__()
        self.seq = self._new_sequences()
        for p in self._plan:  # transformers' reset zeroes a layer's tensors in place (same batch size): start afresh
            self.layers[p.index] = self._new_layer(p)

    @property
    def quantized(self) -> bool:
        """Whether kept entries are stored quantized (policy option ``kv_bits``)."""
        return self.kv_bits is not None

    @property
    def batch(self) -> int | None:
        """Rows of the batch the cache holds (None before the first forward)."""
        return self.forward.batch

    @property
    def capacity(self) -> int | None:
        """Slots allocated per row and evicting layer (None before the first forward)."""
        return self.forward.capacity

    def row_seeds(self, batch: int) -> list[int]:
        """The eviction seed of each of ``batch`` rows: ``seed + row``, or the list given.

        Raises:
            ValueError: a list of seeds whose length is not the batch's.
        """
        seeds = list(self.seed) if isinstance(self.seed, (list, tuple)) else [self.seed + i for i in range(batch)]
        if len(seeds) != batch:
            raise ValueError(f"got {len(seeds)} seeds for a batch of {batch} rows: give one per row")
        return seeds

    # ------------------------------------------------------------------------------------------ Cache protocol
    def _begin_forward(self, model, batch: int, q: int, attention_mask: torch.Tensor | None) -> None:
        """Called by vase's forward pre-hook before a forward pass (see :meth:`ForwardPlanner.begin`)."""
        self.forward.begin(model, batch, q, attention_mask)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """The model's cache update for layer ``layer_idx``: an evicting layer writes the step's keys and values
        (:meth:`EvictingLayer.write`) with the forward's plan, made at its first evicting layer; a kept layer of a
        hybrid model is transformers' own, whose returned keys vase's attention function passes through unchanged
        with transformers' own mask.

        Raises:
            ValueError: keys whose KV heads or head dim differ from the model's layer the cache was made for.
        """
        layer = self.layers[layer_idx]
        if not self._plan[layer_idx].evicts:
            keys, values = layer.update(key_states, value_states, *args, **kwargs)
            attn.pass_through(keys)
            return keys, values
        if self.compiled is not None and self.compiled.in_step:
            return self.compiled.update(layer, key_states, value_states)
        self.forward.check_keys(layer_idx, key_states)
        step = self.forward.plan(key_states.shape[0], key_states.shape[2], key_states.device)
        return layer.write(step, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Logical length: tokens seen so far (padding columns included), as RoPE positions need (inside a compiled
        decode step: a 0-d int64 device tensor, so the graph does not depend on the value)."""
        c = self.compiled
        if c is not None:
            if torch.compiler.is_compiling() and c.decode_ok:
                return c.seen_t
            c.flush()
        return self.forward.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """Sizes of the mask transformers builds for ``layer_idx``: logical ones for an evicting layer (vase's attention
        function replaces that mask by its own over physical slots, so none is built), the layer's own for a kept
        sliding-window layer (its usual mask is built and used)."""
        evicts = not isinstance(self.layers[layer_idx], CacheLayerMixin) or self._plan[layer_idx].evicts
        c, seen = self.compiled, self.forward.seen
        if c is not None and c.decode_ok and query_length == 1:
            if torch.compiler.is_compiling():  # inside a compiled step (a hand-written loop): no mask is built
                attn.mask_for(True)
                return self.capacity, 0
            if not attn.evicting_forward():
                # transformers' mask creation before a compiled decode step (model.generate with a compileable
                # cache): the eager part of the step runs now, and the mask handed to the graph is vase's own
                c.prepare()
                attn.mask_for(True, override=c.eager_mask)
                return self.capacity, 0
        if c is not None and not attn.evicting_forward() and evicts:
            # the same mask creation before the (uncompiled) prefill: keep the 2-D padding mask for vase's pre-hook
            attn.mask_for(True, override=lambda kind, dtype, kwargs: kwargs.get("attention_mask"))
            return seen + query_length, 0
        attn.mask_for(evicts)
        if evicts:
            return seen + query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    @property
    def is_compileable(self) -> bool:
        """True for a cache made with ``compileable=True``: ``model.generate(..., compile_config=...)`` then compiles
        its decode steps (see "Compiled decoding" in the class docstring)."""
        return self.compileable

    @property
    def is_croppable(self) -> bool:
        return False

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
        if self.compiled is None:
            raise RuntimeError("prepare_decode() is for a cache made with EvictingCache(..., compileable=True)")
        self.compiled.prepare()

    def activate_past_recording(self) -> None:
        """Refuse assisted / speculative decoding before any token is fed.

        transformers calls this at the start of assisted decoding (``model.generate(..., assistant_model=...)`` or
        ``prompt_lookup_num_tokens=...``), before its first forward: it would then feed prompt + draft tokens and crop
        the rejected ones afterwards, which an evicting cache cannot undo (a compaction may already have dropped what
        the crop should restore). Raising here leaves the cache untouched (nothing fed, the kept sliding-window
        layers of a hybrid model not switched to past-recording), so it can be used again as it is.

        Raises:
            ValueError: always.
        """
        raise ValueError(
            "assisted and speculative decoding (assistant_model=..., prompt_lookup_num_tokens=...) are not supported "
            "with an EvictingCache: they feed draft tokens and crop the rejected ones afterwards, and a cache that "
            "evicts cannot restore what a crop needs. Generate without them (the cache is left untouched)"
        )

    def observe_confidence(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Feed the next-token distributions the model just produced, for a confidence step budget
        (``step_budget='confidence'``, :mod:`vase.core.confidence`); a no-op for other policies.

        Call it after each forward pass, before the next (:class:`vase.hf.ConfidenceFeed` does so inside
        ``model.generate``; a teacher-forced replay passes each chunk's logits).

        Args:
            logits: ``[batch, V]`` (one step) or ``[batch, T, V]`` (a chunk) scores over the vocabulary.
            mask: ``[batch, T]`` (or ``[batch]``) bool / 0-1, the real positions of ``logits`` (padding left out).

        Raises:
            ValueError: ``logits`` whose batch is not the cache's, or a mask of another shape.
        """
        if self.policy.confidence_budget:
            self._settled()
            self.seq.observe_confidence(list(range(self.batch)), masked_top(logits, mask, self.batch))

    # ---------------------------------------------------------------------------------------------- reading
    def _settled(self) -> None:
        """A compiled step that ran is evicted and committed before anything reads the bookkeeping."""
        if self.compiled is not None:
            self.compiled.flush()

    @property
    def fill(self) -> list[int]:
        """Filled slots of each row (tokens)."""
        self._settled()
        return list(self.seq.schedule.fill[: self.batch or 0])

    def room(self) -> list[int]:
        """Tokens each row can take before its next eviction (the eviction happens at the token that fills it); with
        ``kv_bits``, before its next eviction or quantization of its recent tokens, whichever comes first (the
        ``full`` policy included).

        Known after the first forward pass; used by :func:`vase.harness.fidelity.replay` to cut teacher-forced chunks
        exactly where token-by-token decoding would evict (or quantize).

        Raises:
            RuntimeError: before the first forward pass, or for a policy that never evicts (without ``kv_bits``).
        """
        if self.capacity is None or not (self.policy.evicts or self.quantized):
            raise RuntimeError("room() is known after the first forward pass, for an evicting or quantizing policy")
        self._settled()
        return self.seq.schedule.room(range(self.batch), self.capacity)

    def stats(self) -> CacheStats:
        """Current :class:`CacheStats` (bytes: see its attributes; the kept layers of a hybrid model count in both
        ``bytes_held`` and ``bytes_full``)."""
        self._settled()
        held = full = other = live = 0
        seen = self.forward.seen
        for p in self._plan:
            layer = self.layers[p.index]
            if not p.evicts:
                other += hybrid.state_bytes(layer)
            elif layer.is_initialized:
                held += hybrid.state_bytes(layer)
                held += layer.pages.nbytes if layer.pages is not None else 0  # quest's page metadata
                b, h = layer.positions.shape[:2]
                full += b * h * seen * layer.storage.entry_bytes()
                live += layer.live_bytes()
        held += other
        full += other
        sched, ws = self.seq.schedule, self.workspace
        return CacheStats(
            policy=self.policy.name,
            budget=self.budget,
            buffer=self.buffer,
            batch=self.batch or 0,
            layers=self.num_layers,
            tokens_seen=seen,
            real_tokens=list(sched.seen[: self.batch or 0]),
            slots_held=max(sched.fill[: self.batch or 0], default=0),
            capacity=self.capacity or 0,
            evictions=sched.eviction_steps,
            tokens_evicted=sched.tokens_evicted,
            bytes_held=held,
            bytes_full=full,
            eviction_seconds=self.counters.eviction_seconds,
            protected=int(self.counters.protected),
            other_layers=len(self._plan) - len(self.evicting),
            bytes_other=other,
            bytes_live=live,
            kv_bits=self.kv_bits,
            kv_group=self.kv_group,
            kv_window=self.config.kv_window,
            bytes_workspace=ws.nbytes() if ws is not None else 0,
            dequant_seconds=ws.dequant_seconds if ws is not None else 0.0,
            quant_seconds=ws.quant_seconds if ws is not None else 0.0,
        )


def check_model_supported(config) -> None:
    """Raise a clear ValueError if ``config`` (a decoder config) has layers an :class:`EvictingCache` cannot hold.

    Full-attention layers are evicted; sliding-window and linear-attention layers (gpt-oss, Gemma 3, OLMo 3,
    Qwen3-Next, Qwen3.5) are kept as transformers' default cache holds them. Refused, with the reason: chunked
    attention, short-convolution and combined linear/attention layers, sparse-indexer layers, KV sharing between
    layers, and models without any full-attention layer (see :func:`vase.hf.hybrid.plan_layers`).
    """
    hybrid.plan_layers(config)
