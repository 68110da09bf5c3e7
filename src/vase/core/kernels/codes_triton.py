"""Decode attention over quantized codes as a Triton kernel (CUDA): the GPU twin of ``codes_attention.cpp``.

Programs per (row, KV head) and split, every query head of its GQA group together (padded to 16 rows, one tensor-core
product per block of entries, in the query's dtype with float32 accumulation): each split reads its share of the
quantized slots in blocks of ``BLOCK_T`` entries, unpacks and scales their codes in registers (no dequantized copy in
memory) under an online softmax; the last split also reads the full-precision store. With one split the program
normalizes and writes the output; with several (flash-decoding, after Dao et al., "Flash-Decoding for long-context
inference", 2023) each writes its running maximum, denominator and accumulator, and a second kernel merges them. A
batch of one row with 8 KV heads is 8 programs without a split, a few percent of an H100's or H200's 132 SMs; the
split fills them. Same arguments and validity rules as :func:`vase.core.codes.decode_attention`. Tested on CPU
through Triton's interpreter (``TRITON_INTERPRET=1``) against the torch implementation, with one split and several.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_NEG = tl.constexpr(-1.0e30)  # a constexpr: compiled kernels may read no other globals (the interpreter may)


@triton.jit
def _dot(a, b, LOWP: tl.constexpr):
    """``a @ b`` accumulated in float32 on the tensor cores: operands in bfloat16 (``LOWP`` 1) or float16 (2), the
    precision of the model's own attention and of the dequantize path's workspace; float32 exactly (0)."""
    if LOWP == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif LOWP == 2:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _codes_attention_kernel(
    q_ptr,
    kf_ptr,
    kq_ptr,
    ks_ptr,
    kz_ptr,
    vq_ptr,
    vs_ptr,
    vz_ptr,
    qmask_ptr,
    pos_ptr,
    fk_ptr,
    fv_ptr,
    prot_ptr,
    qlimit_ptr,
    recent_ptr,
    sinks_ptr,
    out_ptr,
    part_m_ptr,
    part_d_ptr,
    part_a_ptr,
    scaling,
    L,
    CAP,
    CHUNK,
    NSPLIT,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    NG: tl.constexpr,
    BITS: tl.constexpr,
    P: tl.constexpr,
    F: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
    LOWP: tl.constexpr,
):
    bh = tl.program_id(0)
    sp = tl.program_id(1)  # this program's split: quantized slots [sp * CHUNK, (sp + 1) * CHUNK)
    b = bh // H
    h = bh % H
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    j = tl.arange(0, GP)
    jok = j < G
    c = tl.arange(0, D)
    cv = tl.arange(0, DV)
    q = tl.load(q_ptr + (b * H * G + h * G + j)[:, None] * D + c[None, :], mask=jok[:, None], other=0.0)
    q_fp = q.to(tl.float32) * scaling  # the full-precision keys are the keys themselves
    q_k = q_fp * tl.load(kf_ptr + bh * D + c)[None, :]  # the quantized ones were divided by the channel factors
    k_byte = c // PER
    k_shift = (c % PER) * BITS
    k_group = c // (D // NG)
    v_byte = cv // PER
    v_shift = (cv % PER) * BITS
    v_group = cv // (DV // NG)
    m = tl.full((GP,), _NEG, tl.float32)
    den = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, DV), tl.float32)
    t_lo = sp * CHUNK
    t_hi = tl.minimum(t_lo + CHUNK, L)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        inside = t < t_hi
        slot = bh * L + t
        ok = inside & (tl.load(qmask_ptr + slot, mask=inside, other=0) != 0)
        ok = ok & (tl.load(pos_ptr + bh * CAP + t, mask=inside, other=-1) >= 0)
        kb = tl.load(kq_ptr + slot[:, None] * (D // PER) + k_byte[None, :], mask=ok[:, None], other=0).to(tl.int32)
        kst = tl.load(ks_ptr + slot[:, None] * NG + k_group[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        kmn = tl.load(kz_ptr + slot[:, None] * NG + k_group[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        keys = kmn + kst * ((kb >> k_shift[None, :]) & MASK).to(tl.float32)  # [BLOCK_T, D], in registers
        s = _dot(q_k, tl.trans(keys), LOWP)  # [GP, BLOCK_T]
        s = tl.where(ok[None, :], s, _NEG)
        new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - new)
        p = tl.where(ok[None, :], tl.exp(s - new[:, None]), 0.0)
        vb = tl.load(vq_ptr + slot[:, None] * (DV // PER) + v_byte[None, :], mask=ok[:, None], other=0).to(tl.int32)
        vst = tl.load(vs_ptr + slot[:, None] * NG + v_group[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        vmn = tl.load(vz_ptr + slot[:, None] * NG + v_group[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        values = vmn + vst * ((vb >> v_shift[None, :]) & MASK).to(tl.float32)  # [BLOCK_T, DV]
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p, values, LOWP)
        m = new
    qlimit = tl.load(qlimit_ptr + b)
    recent = tl.load(recent_ptr + b)
    f_hi = tl.where(sp == NSPLIT - 1, F, 0)  # the full-precision store: the last split's
    for f0 in range(0, f_hi, BLOCK_T):
        f = f0 + tl.arange(0, BLOCK_T)
        inside = f < F
        guard = f < P
        slot = tl.load(prot_ptr + bh * P + f, mask=inside & guard, other=0)
        held = tl.load(pos_ptr + bh * CAP + tl.minimum(slot, CAP - 1), mask=inside & guard, other=-1) >= 0
        ok = inside & tl.where(guard, (slot < qlimit) & held, (f - P) < recent)
        row = bh * F + f
        keys = tl.load(fk_ptr + row[:, None] * D + c[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = _dot(q_fp, tl.trans(keys), LOWP)
        s = tl.where(ok[None, :], s, _NEG)
        new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - new)
        p = tl.where(ok[None, :], tl.exp(s - new[:, None]), 0.0)
        values = tl.load(fv_ptr + row[:, None] * DV + cv[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p, values, LOWP)
        m = new
    if SPLIT:  # partial results, merged by _merge_kernel
        at = (bh * NSPLIT + sp) * GP + j
        tl.store(part_m_ptr + at, m)
        tl.store(part_d_ptr + at, den)
        tl.store(part_a_ptr + at[:, None] * DV + cv[None, :], acc)
    else:
        if HAS_SINKS:
            den = den + tl.exp(tl.load(sinks_ptr + h * G + j, mask=jok, other=_NEG) - m)
        out = acc / tl.maximum(den, 1e-30)[:, None]
        tl.store(out_ptr + (b * H * G + h * G + j)[:, None] * DV + cv[None, :], out, mask=jok[:, None])


@triton.jit
def _merge_kernel(
    part_m_ptr,
    part_d_ptr,
    part_a_ptr,
    sinks_ptr,
    out_ptr,
    NSPLIT,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    DV: tl.constexpr,
    SP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One program per (row, KV head): the splits' softmax pieces rescaled to their common maximum and summed."""
    bh = tl.program_id(0)
    h = bh % H
    b = bh // H
    sp = tl.arange(0, SP)
    j = tl.arange(0, GP)
    cv = tl.arange(0, DV)
    sok = sp < NSPLIT
    jok = j < G
    at = (bh * NSPLIT + sp)[:, None] * GP + j[None, :]  # [SP, GP]
    m = tl.load(part_m_ptr + at, mask=sok[:, None], other=_NEG)
    den = tl.load(part_d_ptr + at, mask=sok[:, None], other=0.0)
    top = tl.max(m, axis=0)  # [GP]
    w = tl.where(sok[:, None], tl.exp(m - top[None, :]), 0.0)
    total = tl.sum(w * den, axis=0)
    acc = tl.zeros((GP, DV), tl.float32)
    for k in range(0, NSPLIT):
        a = tl.load(part_a_ptr + ((bh * NSPLIT + k) * GP + j)[:, None] * DV + cv[None, :])
        wk = tl.exp(tl.load(part_m_ptr + (bh * NSPLIT + k) * GP + j) - top)
        acc += wk[:, None] * a
    if HAS_SINKS:
        total = total + tl.exp(tl.load(sinks_ptr + h * G + j, mask=jok, other=_NEG) - top)
    out = acc / tl.maximum(total, 1e-30)[:, None]
    tl.store(out_ptr + (b * H * G + h * G + j)[:, None] * DV + cv[None, :], out, mask=jok[:, None])


def _low_precision(dtype: torch.dtype) -> int:
    """The products' operand dtype for queries of ``dtype`` (see ``_dot``). Triton's interpreter (3.9) multiplies
    bfloat16 operands wrongly, so under it bfloat16 queries take the float32 product."""
    if dtype == torch.bfloat16:
        return 0 if os.environ.get("TRITON_INTERPRET") == "1" else 1
    return 2 if dtype == torch.float16 else 0


def split_count(rows_x_heads: int, slots: int, block: int, device: torch.device, splits: int | None = None) -> int:
    """How many splits of the quantized slots: enough programs for about two per SM of the GPU (one split when
    ``rows_x_heads`` already fills them), each split at least 4 blocks of slots; ``splits`` forces a count (tests)."""
    blocks = max(1, -(-slots // block))
    if splits is None:
        if device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        splits = max(1, min(-(-2 * sms // rows_x_heads), blocks // 4))
    return max(1, min(int(splits), blocks))


def decode_attention_triton(
    query,
    factors,
    scaling,
    codes,
    qmask,
    positions,
    fp_k,
    fp_v,
    protected,
    qlimit,
    recent,
    bits,
    sinks=None,
    block: int = 32,
    splits: int | None = None,
) -> torch.Tensor:
    """:func:`vase.core.codes.decode_attention` as one Triton launch per layer, two with a split of the slots (see the
    module docstring); ``splits``: how many (default: :func:`split_count`).

    Raises:
        ValueError: a head dim that is not a power of two (Triton's block shapes).
    """
    kq, ks, kz, vq, vs, vz = codes
    b, hq, d = query.shape
    h, lim = kq.shape[1], kq.shape[2]
    g, dv = hq // h, fp_v.shape[-1]
    for name, n in (("head dim", d), ("value head dim", dv)):
        if n & (n - 1):
            raise ValueError(f"the triton backend needs a power-of-two {name}, got {n}: use backend='torch'")
    out = torch.empty((b, hq, dv), dtype=torch.float32, device=query.device)
    has_sinks = sinks is not None
    sinks_t = sinks.detach().float().contiguous() if has_sinks else out  # any pointer when unused
    n = split_count(b * h, lim, block, query.device, splits)
    chunk = -(-max(lim, 1) // n)
    chunk = -(-chunk // block) * block  # whole blocks per split
    n = max(1, -(-lim // chunk))
    gp = max(16, triton.next_power_of_2(g))  # the tensor cores' smallest tile: the GQA group padded to 16 rows
    if n > 1:
        part_m = torch.empty((b * h, n, gp), dtype=torch.float32, device=query.device)
        part_d = torch.empty_like(part_m)
        part_a = torch.empty((b * h, n, gp, dv), dtype=torch.float32, device=query.device)
    else:
        part_m = part_d = part_a = out  # unused
    _codes_attention_kernel[(b * h, n)](
        query.contiguous(),
        factors.float().contiguous(),
        kq.contiguous(),
        ks.contiguous(),
        kz.contiguous(),
        vq.contiguous(),
        vs.contiguous(),
        vz.contiguous(),
        qmask.contiguous(),
        positions.contiguous(),
        fp_k.contiguous(),
        fp_v.contiguous(),
        protected.contiguous(),
        qlimit.contiguous(),
        recent.contiguous(),
        sinks_t,
        out,
        part_m,
        part_d,
        part_a,
        float(scaling),
        lim,
        positions.shape[2],
        chunk,
        n,
        H=h,
        G=g,
        GP=gp,
        D=d,
        DV=dv,
        NG=ks.shape[-1],
        BITS=int(bits),
        P=protected.shape[2],
        F=fp_k.shape[2],
        BLOCK_T=block,
        HAS_SINKS=has_sinks,
        SPLIT=n > 1,
        LOWP=_low_precision(query.dtype),
    )
    if n > 1:
        _merge_kernel[(b * h,)](
            part_m, part_d, part_a, sinks_t, out, n, H=h, G=g, GP=gp, DV=dv, SP=triton.next_power_of_2(n),
            HAS_SINKS=has_sinks,
        )  # fmt: skip
    return out.to(query.dtype)
