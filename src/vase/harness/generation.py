"""One call from prompts to completions with an evicting cache: ``vase.generate(model, tokenizer, prompts, ...)``."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList

from ..core.config import VaseConfig
from ..core.sizes import DEFAULT_BUDGET, is_int
from ..hf.cache import EvictingCache
from ..hf.compat import cache_kwargs
from ..hf.compiled import compile_config
from ..hf.confidence import ConfidenceFeed
from ..hf.stats import CacheStats

__all__ = ["DEFAULT_BUDGET", "Completion", "GenerationResult", "check_options", "encode_prompts", "generate"]


def check_options(
    *,
    policy="vase",
    budget: int | None = None,
    compression_ratio: float | None = None,
    buffer: int = 64,
    sinks: int = 4,
    window: int | None = None,
    compress_prompt: bool | None = None,
    max_new_tokens: int = 512,
    min_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    compile: bool = False,
    byte_ratio: float | None = None,
    memory_budget: float | None = None,
    element_bytes: int | None = None,
    **policy_options,
) -> VaseConfig:
    """Check generation options before anything is loaded and return the resolved :class:`vase.VaseConfig`: the
    rules of :func:`generate` and :class:`~vase.EvictingCache`, so that bad values fail in a second rather than after
    the model has loaded.

    Sampling values are checked even for greedy decoding (``temperature`` 0), where they would be ignored.

    Raises:
        ValueError: naming the option and the allowed range: max_new_tokens < 1, min_new_tokens outside [0,
            max_new_tokens], temperature < 0, top_p outside (0, 1], top_k < 0, and every rule of
            :meth:`vase.VaseConfig.resolve` (budget and ratio both given, budget not larger than sinks + buffer,
            ratio <= 1, an unknown policy or option, the published preset's budget and window, quest's budget,
            ``compile`` with quest, ...; sizes in bytes: ``byte_ratio``, ``memory_budget`` counted in elements of
            ``element_bytes``, see :meth:`vase.VaseConfig.resolve`).
    """
    config = VaseConfig.resolve(
        policy,
        budget=budget,
        ratio=compression_ratio,
        buffer=buffer,
        sinks=sinks,
        window=window,
        compress_prompt=compress_prompt,
        compile=compile,
        byte_ratio=byte_ratio,
        memory_budget=memory_budget,
        element_bytes=element_bytes,
        **policy_options,
    )
    check_decoding(max_new_tokens, min_new_tokens, temperature, top_p, top_k)
    return config


def check_decoding(
    max_new_tokens: int = 512, min_new_tokens: int = 0, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0
) -> None:
    """The decoding options: token counts and sampling (see :func:`check_sampling`).

    Raises:
        ValueError: max_new_tokens < 1, min_new_tokens outside [0, max_new_tokens], or a sampling value out of range.
    """
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
    if not is_int(min_new_tokens) or not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens = {max_new_tokens}], got {min_new_tokens!r}")
    check_sampling(temperature, top_p, top_k)


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Check the sampling options: ``temperature >= 0`` (0 = greedy), ``top_p`` in (0, 1], ``top_k >= 0`` (0 = off).

    Raises:
        ValueError: naming the option, its allowed range and the value given.
    """
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")


def encode_prompts(tokenizer, prompts: Sequence[str], chat: bool = True, system: str | None = None):
    """Tokenize prompts, left-padded, through the chat template when ``chat`` (and the tokenizer has one).

    Returns a ``BatchEncoding`` with ``input_ids`` and ``attention_mask`` ``[batch, tokens]``.

    Raises:
        ValueError: for an empty prompt.
    """
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"prompt {i} is empty: give some text")
    tokenizer.padding_side = "left"
    if chat and getattr(tokenizer, "chat_template", None):
        texts = []
        for p in prompts:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": p}]
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return tokenizer(list(prompts), return_tensors="pt", padding=True)


@dataclass
class Completion:
    """One generated continuation: ``text``, its token ids, and whether it ended with end-of-sequence."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finished: bool
    written: str | None = None  # with a follow-up question: what the model wrote before it was asked
    written_tokens: int = 0

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class GenerationResult:
    """Completions of one batch, the cache statistics and timings (seconds)."""

    completions: list[Completion]
    stats: CacheStats
    seconds: float
    first_token_seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        """Tokens generated in all rows (with a follow-up question: what was written before it, and the answers)."""
        return sum(c.new_tokens + c.written_tokens for c in self.completions)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens after the first one, over the time after the first one (all rows)."""
        decode = self.seconds - self.first_token_seconds
        steps = max(max((c.new_tokens + c.written_tokens for c in self.completions), default=0) - 1, 0)
        rows = len(self.completions)
        return steps * rows / decode if decode > 0 else 0.0

    def stats_line(self) -> str:
        """The one-line summary printed after ``vase generate``: prompt and generated tokens, then the cache's own
        line (:meth:`vase.CacheStats.line`: policy, sequences, evictions, KV slots and bytes), then the speed."""
        n = len(self.completions)
        prompt = sum(c.prompt_tokens for c in self.completions)
        tokens = (
            f"prompt {prompt} tok, generated {self.new_tokens} tok"
            if n == 1
            else f"{n} prompts, {prompt} tok in all, generated {self.new_tokens} tok in all"
        )
        return f"[vase] {tokens} | {self.stats.line()} | {self.tokens_per_second:.1f} tok/s, {self.seconds:.1f} s" + (
            " (compilation included)" if self.extra.get("compiled") else ""
        )


class _Observe:
    """A logits processor that hands the cache to an observer after each forward pass and leaves the scores."""

    def __init__(self, cache, observe):
        self.cache, self.observe = cache, observe

    def __call__(self, input_ids, scores):
        self.observe(self.cache)
        return scores


class _Clock:
    """A streamer that notes when the first new token arrives, and forwards to another streamer."""

    def __init__(self, inner=None):
        self.inner, self.calls, self.first = inner, 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        if self.inner is not None:
            self.inner.end()


def generate(
    model,
    tokenizer,
    prompts: str | Sequence[str],
    *,
    policy: str = "vase",
    budget: int | None = None,
    compression_ratio: float | None = None,
    buffer: int = 64,
    sinks: int = 4,
    window: int | None = None,
    seed: int | Sequence[int] = 0,
    compress_prompt: bool | None = None,
    max_new_tokens: int = 512,
    min_new_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    chat: bool = True,
    system: str | None = None,
    streamer=None,
    compile: bool = False,
    config: VaseConfig | None = None,
    byte_ratio: float | None = None,
    memory_budget: float | None = None,
    follow_up: Sequence[str] | None = None,
    follow_up_tokens: int = 64,
    observe=None,
    **policy_options,
) -> GenerationResult:
    """Generate from ``prompts`` with an :class:`~vase.EvictingCache`.

    Args:
        prompts: one prompt or a list (batched, left-padded).
        policy, buffer, sinks, window, compress_prompt, policy_options: see :class:`~vase.EvictingCache`.
        budget: cache budget in tokens; or give ``compression_ratio`` (budget = (prompt + max_new_tokens) /
            ratio; for the published preset, ``preset='paper'``, rounded to the nearest multiple of the buffer).
            Default 1024.
        seed: keys eviction sampling (row i uses ``seed + i``, or one seed per row) and token sampling.
        temperature: 0 = greedy; > 0 samples with ``top_p`` / ``top_k`` (reasoning models: 0.6 / 0.95 / 20).
        streamer: a transformers streamer (e.g. ``TextStreamer``) to see text as it is generated (batch 1).
        compile: compile the decode steps (``torch.compile``, CUDA graphs on a GPU; see :mod:`vase.hf.compiled`):
            the first steps wait for the compilation (about a minute), the others run one graph each; sdpa or eager
            attention, not quest, not hybrid models.
        config: a :class:`vase.VaseConfig` (from :func:`check_options` or :meth:`vase.VaseConfig.resolve`) instead of
            the policy and size arguments, which then stay at their defaults.
        byte_ratio, memory_budget: a size in bytes instead of a budget, for a policy with ``kv_bits`` (counted in the
            model's dtype; see :meth:`vase.VaseConfig.resolve`).
        follow_up: one question per prompt, asked in a second turn on the same cache once the model has written
            exactly ``max_new_tokens`` tokens (end-of-sequence suppressed until then): a recall test after decode-time
            evictions. The completions are then the answers (at most ``follow_up_tokens``), with what was written
            before in :attr:`Completion.written`.
        observe: called with the cache after each forward pass of decoding (prefill included), before the next token
            is chosen: a hook for measurements (e.g. :class:`vase.harness.dynamics.KeptDynamics`); not with
            ``compile``.

    Raises:
        ValueError: empty prompt, a prompt longer than the model's context, or an option out of range (see
            :func:`check_options`), one follow-up question per prompt, before anything runs.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if follow_up is not None:
        follow_up = [follow_up] if isinstance(follow_up, str) else list(follow_up)
        if len(follow_up) != len(prompts) or not all(isinstance(q, str) and q.strip() for q in follow_up):
            raise ValueError(f"give one non-empty follow-up question per prompt ({len(prompts)}), got {follow_up!r}")
        if not is_int(follow_up_tokens) or follow_up_tokens < 1:
            raise ValueError(f"follow_up_tokens must be >= 1, got {follow_up_tokens!r}")
    if config is None:
        config = check_options(
            policy=policy,
            budget=budget,
            compression_ratio=compression_ratio,
            buffer=buffer,
            sinks=sinks,
            window=window,
            compress_prompt=compress_prompt,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            compile=compile,
            byte_ratio=byte_ratio,
            memory_budget=memory_budget,
            element_bytes=next(model.parameters()).element_size(),
            **policy_options,
        )
    else:
        given = (policy, budget, compression_ratio, buffer, sinks, window, compress_prompt, compile)
        given += (byte_ratio, memory_budget)
        if policy_options or given != ("vase", None, None, 64, 4, None, None, False, None, None):
            raise ValueError("give either config= or the policy and size arguments, not both")
        check_decoding(max_new_tokens, min_new_tokens, temperature, top_p, top_k)
    compile = config.compile
    if observe is not None and compile:
        raise ValueError("observe= reads the cache between steps, which compiled decoding defers: use one or the other")
    enc = encode_prompts(tokenizer, prompts, chat=chat, system=system)
    device = next(model.parameters()).device
    enc = enc.to(device)
    prompt_len = int(enc["input_ids"].shape[1])
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if context and prompt_len >= context:
        raise ValueError(f"the prompt has {prompt_len} tokens, more than the model's context of {context} tokens")
    if context and prompt_len + max_new_tokens > context:
        warnings.warn(
            f"max_new_tokens cut to {context - prompt_len} to stay within the model's context of {context}",
            stacklevel=2,
        )
        max_new_tokens = context - prompt_len
    asked = _follow_up_ids(tokenizer, follow_up, chat) if follow_up is not None else None
    extra_len = asked[0].shape[1] + follow_up_tokens if asked is not None else 0
    # a ratio's budget (the published preset: to the buffer)
    config = config.for_length(prompt_len + max_new_tokens + extra_len)
    batch = len(prompts)
    row_seeds = list(seed) if not isinstance(seed, int) else [seed + i for i in range(batch)]
    cache = EvictingCache(
        model,
        config=config,
        seed=row_seeds,
        compileable=compile,
        max_cache_len=prompt_len + max_new_tokens + 1 if compile else None,
    )
    sampling = temperature > 0
    gen_kwargs = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens if follow_up is not None else min_new_tokens,
        do_sample=sampling,
        pad_token_id=tokenizer.pad_token_id,
    )
    if sampling:
        gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    else:
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    if compile:
        gen_kwargs.update(compile_config=compile_config(device))
    processors = []
    if config.policy.confidence_budget:  # the cache follows the model's confidence at each step
        processors.append(ConfidenceFeed(cache))
    if observe is not None:
        processors.append(_Observe(cache, observe))
    if processors:
        gen_kwargs.update(logits_processor=LogitsProcessorList(processors))
    clock = _Clock(streamer)
    torch.manual_seed(row_seeds[0])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, **cache_kwargs(cache), streamer=clock, **gen_kwargs)
        if asked is not None:
            ids, mask = (t.to(device) for t in asked)
            written = out[:, prompt_len:]
            out = model.generate(
                input_ids=torch.cat([out, ids], 1),
                attention_mask=torch.cat([enc["attention_mask"], torch.ones_like(written), mask], 1),
                **cache_kwargs(cache),
                **{**gen_kwargs, "max_new_tokens": follow_up_tokens, "min_new_tokens": 0},
            )
            prompt_len += written.shape[1] + ids.shape[1]  # the answers start after the question
    seconds = time.perf_counter() - start
    first = (clock.first - start) if clock.first is not None else seconds
    eos = _eos_ids(model, tokenizer)
    completions = []
    lengths = enc["attention_mask"].sum(-1).tolist()
    for row, ids in enumerate(out[:, prompt_len:].tolist()):
        finished = False
        kept = []
        for t in ids:
            if t in eos:
                finished = True
                break
            kept.append(t)
        text = tokenizer.decode(kept, skip_special_tokens=True)
        comp = Completion(text=text, token_ids=kept, prompt_tokens=int(lengths[row]), finished=finished)
        if asked is not None:
            comp.written = tokenizer.decode(written[row].tolist(), skip_special_tokens=True)
            comp.written_tokens = int(written.shape[1])
        completions.append(comp)
    return GenerationResult(
        completions=completions,
        stats=cache.stats(),
        seconds=seconds,
        first_token_seconds=first,
        extra={"compiled": True} if compile else {},
    )


def _follow_up_ids(tokenizer, questions: list[str], chat: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that close the model's turn and ask each question in a new one (chat template), left-padded:
    ``(input_ids, attention_mask)`` ``[batch, tokens]``."""
    marker = "\x00vase-written\x00"
    rows = []
    for q in questions:
        if chat and getattr(tokenizer, "chat_template", None):
            turns = [{"role": "user", "content": "-"}, {"role": "assistant", "content": marker}]
            text = tokenizer.apply_chat_template(
                turns + [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            text = text[text.index(marker) + len(marker) :]
        else:
            text = "\n\n" + q + "\n"
        rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
