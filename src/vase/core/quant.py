"""Low-bit storage of kept entries: group quantization of keys and values, and what it costs in bytes (torch only).

The option ``kv_bits`` (8, 4 or 2; None = the model's dtype, as before) stores the entries an evicting cache keeps
after a compaction in ``kv_bits``-bit integers, while the newest tokens (the ``buffer`` written since the last
compaction) stay in full precision: KIVI's scheme (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", arXiv 2402.02750, Sec. 3: asymmetric min/max quantization in groups, keys per channel,
values per token, a full-precision residual of the newest tokens).

**The full-precision window** (``kv_window``): by default the recent tokens are those written since the row's last
quantization, so the window drops to zero at every quantization and compaction and the newest tokens are quantized at
once. With ``kv_window=R`` the newest ``R`` tokens always stay in full precision, the window in ``[R, R + buffer)``
(KIVI's sliding residual, Sec. 3.2: ``R`` recent tokens kept, quantized in blocks of ``G`` as they age). Its bytes are
counted: ``R`` tokens at full precision instead of their codes (:func:`window_cost`).

**Keys: per channel, made movable.** KIVI quantizes keys per channel over groups of consecutive tokens, because a
few key channels hold much larger magnitudes than the others. An evicting cache moves its kept entries at every
compaction (the kept ones are gathered to the front, in position order), and eviction breaks any group of tokens
that shared a per-channel scale: either every kept token is re-quantized at every compaction (its error grows with
each one) or each group's scales must outlive the group. Here each key is first divided by a fixed per-channel factor
(the largest magnitude of that channel, per layer and KV head, over the entries its row quantizes first: what it
keeps when that is a compaction, else its first ``buffer`` tokens, the same block however the prompt was chunked:
:func:`channel_scale`), then quantized per token in groups of ``group`` channels. The channel factor takes out
the outlier channels, as KIVI's per-channel grouping does, while every scale belongs to one token: its codes and
scales move with it and are never re-quantized (the channel-separable scheme of ZipCache, He et al. 2024, arXiv
2405.14256, Sec. 4.2). **Values: per token**, in groups of ``group`` channels, as KIVI.

**Scales** (the group's step and minimum, KIVI's scale and zero point) are stored in float16 (2 bytes each; a value
beyond float16's range, 65,504, is clipped to it), the key channel factors in float32.

**Outlier-aware precision** (``protect_precision='guard'``): the value guard that protects the largest values from
eviction (VaSE, arXiv 2606.03928, Sec. 3.1) also keeps the largest values of what is quantized in full precision:
:func:`precision_mask` picks, at each quantization, the entries with the largest magnitude under the guard's metric.

Shapes: ``[..., D]`` for entries (``D`` head dim, a multiple of ``group``); packed codes ``[..., D * bits / 8]`` uint8;
scales and minima ``[..., D / group]`` float16.
"""

from __future__ import annotations

import torch

KV_BITS = (8, 4, 2)
"""Bit widths ``kv_bits`` may take (None: entries kept in the model's dtype)."""
DEFAULT_GROUP = 32
"""Channels per quantization group (KIVI, arXiv 2402.02750, Sec. 4: G = 32)."""
PROTECT_PRECISION = ("none", "guard")
KV_ATTENTION = ("codes", "dequantize")
"""How decoding attends over quantized entries (policy option ``kv_attention``): ``codes`` reads the codes directly
(:mod:`vase.core.codes`), ``dequantize`` dequantizes each layer into a workspace first."""
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2  # one float16 scale and one float16 minimum per group
FACTOR_BYTES = 4  # the key channel factors: float32, one per channel and (row, layer, KV head)
_FP16_MAX = 65504.0


def check_options(kv_bits, group, protect_precision, guard, attention: str = "codes", window=0) -> None:
    """The quantization options of a policy (``kv_bits``, ``kv_group``, ``protect_precision``, ``kv_attention``,
    ``kv_window``), as clear errors.

    Args:
        kv_bits: None, 8, 4 or 2; group: channels per group; protect_precision: 'none' or 'guard';
        guard: the policy's :class:`vase.core.selection.ValueGuard`, or None; attention: one of :data:`KV_ATTENTION`;
        window: the newest tokens always kept in full precision (tokens, >= 0).

    Raises:
        ValueError: ``kv_bits`` not one of None, 8, 4, 2; a group that is not a positive power of two;
            ``protect_precision`` not 'none' or 'guard'; 'guard' without kv_bits, without a value guard, with the
            ``random`` guard (it has no magnitudes to rank) or with ``guard_mode='evict'``; ``kv_attention`` not
            'codes' or 'dequantize'; a window that is not a whole number of tokens >= 0, or above 0 without kv_bits.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(
            f"kv_window must be a number of tokens >= 0 (the newest tokens always kept in full precision), got "
            f"{window!r}"
        )
    if window and kv_bits is None:
        raise ValueError("kv_window applies to quantized entries only: add kv_bits=8, 4 or 2")
    if attention not in KV_ATTENTION:
        raise ValueError(
            f"kv_attention must be one of {', '.join(KV_ATTENTION)} (codes: decoding reads the quantized codes; "
            f"dequantize: each layer is dequantized into a workspace first), got {attention!r}"
        )
    if kv_bits is not None and (isinstance(kv_bits, bool) or kv_bits not in KV_BITS):
        raise ValueError(
            f"kv_bits must be one of none, {', '.join(map(str, KV_BITS))} (bits per stored key/value element), got "
            f"{kv_bits!r}"
        )
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or group & (group - 1):
        raise ValueError(f"kv_group must be a positive power of two (channels per quantization group), got {group!r}")
    if protect_precision not in PROTECT_PRECISION:
        raise ValueError(
            f"protect_precision must be one of {', '.join(PROTECT_PRECISION)} (guard: the entries the value guard "
            f"ranks highest stay in full precision), got {protect_precision!r}"
        )
    if protect_precision == "guard":
        if kv_bits is None:
            raise ValueError("protect_precision=guard applies to quantized entries only: add kv_bits=8, 4 or 2")
        if guard is None:
            raise ValueError(
                "protect_precision=guard needs a value guard to rank the entries: add guard=range (or l2, var) and "
                "protect_share (the share of the budget kept in full precision)"
            )
        if guard.metric == "random":
            raise ValueError("protect_precision=guard needs a magnitude metric (range, l2 or var), not guard=random")
        if guard.mode != "protect":
            raise ValueError("protect_precision=guard needs guard_mode=protect (evict demotes the large values)")


def token_cost(kv_bits: int | None, group: int, element_bytes: int, protect_share: float = 0.0) -> float:
    """Bytes of one kept token over the bytes of the same token in the model's dtype (1.0 without ``kv_bits``).

    A quantized key or value element costs ``kv_bits / 8`` bytes plus its share of its group's two float16 scales
    (``4 / group``); with ``protect_share`` of the budget kept in full precision on top (``protect_precision=guard``)
    each kept token costs that share of a full-precision token more. The key channel factors (4 bytes per channel
    per row, layer and KV head, whatever the length) are left out.

    Args:
        element_bytes: bytes of one element in the model's dtype (4 for float32, 2 for bfloat16).
    """
    if kv_bits is None:
        return 1.0
    return (kv_bits / 8 + 2 * SCALE_BYTES / group) / element_bytes + protect_share


def window_cost(kv_bits: int | None, group: int, element_bytes: int) -> float:
    """What one token of the full-precision window (``kv_window``) costs above a quantized kept token, in tokens of
    the model's dtype: ``1 - (kv_bits / 8 + 4 / group) / element_bytes`` (0 without ``kv_bits``). A compaction that
    keeps ``budget`` tokens with a window of ``R`` holds ``budget * token_cost + R * window_cost`` tokens' bytes."""
    if kv_bits is None:
        return 0.0
    return 1.0 - token_cost(kv_bits, group, element_bytes)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` integer codes in ``[0, 2**bits)`` -> ``[..., D * bits / 8]`` uint8, ``8 / bits`` codes per byte
    (the first code in the lowest bits)."""
    per = 8 // bits
    codes = codes.to(torch.uint8)
    if per == 1:
        return codes
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., D * bits / 8]`` uint8 -> ``[..., D]`` uint8 codes."""
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.unsqueeze(-1) >> shifts) & mask).flatten(-2)


def quantize(x: torch.Tensor, bits: int, group: int):
    """Asymmetric min/max quantization of ``x`` ``[..., D]`` in groups of ``group`` consecutive channels (KIVI,
    arXiv 2402.02750, Sec. 3.1): per group, ``step = (max - min) / (2**bits - 1)`` and ``code = round((x - min) /
    step)``, both stored in float16 (the codes are computed from the stored, rounded, scales).

    Returns:
        ``(codes [..., D * bits / 8] uint8 packed, step [..., D / group] float16, minimum [..., D / group] float16)``.
        Round-trip error per element: at most half a step (plus float16's rounding of the minimum; values beyond
        +-65,504 are clipped).

    Raises:
        ValueError: ``D`` not a multiple of ``group``.
    """
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"head dim {d} is not a multiple of the quantization group {group}")
    levels = (1 << bits) - 1
    g = x.float().reshape(*x.shape[:-1], d // group, group)
    lo = g.amin(-1).clamp_(-_FP16_MAX, _FP16_MAX).to(SCALE_DTYPE)
    step = ((g.amax(-1).clamp_(-_FP16_MAX, _FP16_MAX) - lo.float()) / levels).to(SCALE_DTYPE)
    step = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: every code 0, exact
    codes = (g - lo.float().unsqueeze(-1)).div_(step.float().unsqueeze(-1)).round_().clamp_(0, levels)
    return pack(codes.view(*x.shape[:-1], d), bits), step, lo


def dequantize(codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor, bits: int, out_dtype=torch.float32):
    """Inverse of :func:`quantize`: ``x = minimum + code * step`` per group, ``[..., D]`` in ``out_dtype``."""
    c = unpack(codes, bits)
    n = step.shape[-1]
    g = c.view(*c.shape[:-1], n, c.shape[-1] // n).float()
    x = torch.addcmul(lo.float().unsqueeze(-1), g, step.float().unsqueeze(-1))
    return x.view(c.shape).to(out_dtype)


def channel_scale(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The per-channel factor keys are divided by before their per-token quantization: the largest magnitude of each
    channel over the valid tokens, ``[b, H, D]`` float32 (1 for a channel that is zero on every valid token).

    Args:
        keys: ``[b, H, S, D]``; valid: ``[b, H, S]`` (or broadcastable) bool.
    """
    mag = keys.float().abs().masked_fill(~valid.unsqueeze(-1), 0.0).amax(-2)
    return torch.where(mag > 0, mag, torch.ones_like(mag))


def precision_mask(guard, values: torch.Tensor, eligible: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The entries kept in full precision at a quantization (``protect_precision='guard'``): per (row, KV head),
    the ``count`` eligible entries with the largest magnitude under the guard's metric (range, l2 or var over the
    head dim; VaSE, arXiv 2606.03928, Sec. 3.1). With the guard's ``rule='outlier'`` only those above ``factor`` x
    the median magnitude of the eligible entries of that head, at most ``count``.

    Args:
        guard: a :class:`vase.core.selection.ValueGuard` (metric range, l2 or var).
        values: ``[b, H, S, D]``; eligible: ``[b, H, S]`` bool (the entries being stored quantized);
        count: ``[b]`` int64, the most entries kept in full precision per (row, KV head).

    Returns:
        ``[b, H, S]`` bool.
    """
    b, h, s = eligible.shape
    k = min(int(count.max()) if count.numel() else 0, s)
    out = torch.zeros_like(eligible)
    if k == 0:
        return out
    v = values.float()
    if guard.metric == "range":
        mag = v.amax(-1) - v.amin(-1)
    elif guard.metric == "l2":
        mag = v.norm(dim=-1)
    else:
        mag = v.var(-1)
    mag = mag.masked_fill(~eligible, float("-inf"))
    top_v, top_i = torch.sort(mag, dim=-1, descending=True, stable=True)
    top_v, top_i = top_v[..., :k], top_i[..., :k]
    ok = (torch.arange(k, device=mag.device).view(1, 1, k) < count.view(b, 1, 1)) & torch.isfinite(top_v)
    if guard.rule == "outlier":
        median = mag.masked_fill(~eligible, float("nan")).nanmedian(-1, keepdim=True).values
        ok = ok & (top_v > guard.factor * median)
    return out.scatter_(-1, top_i, ok)


def protected_slots(guard, share_of: int, sinks: int) -> int:
    """Full-precision entries per (row, layer, KV head) for ``share_of`` tokens quantized: the guard's count
    (``round(protect_share * share_of)``, less the sinks when the guard counts them inside its share)."""
    return guard.count(share_of, sinks) if guard is not None else 0


def bits_text(
    kv_bits: int | None, group: int, protect: str = "none", share: float | None = None, window: int = 0
) -> str:
    """``'4-bit KV (groups of 32)'``, with the guard's full-precision share when protecting and the full-precision
    window when there is one; '' without kv_bits."""
    if kv_bits is None:
        return ""
    text = f"{kv_bits}-bit KV (groups of {group})"
    if protect == "guard" and share is not None:
        text += f", largest {share:.0%} in full precision"
    if window:
        text += f", newest {window} in full precision"
    return text
