"""Decode attention over quantized codes (vase.core.codes): every implementation equals attention over the
dequantized entries, with the validity rules of the quantized store."""

from __future__ import annotations

import pytest
import torch

from vase.core import codes, quant


def store(bits: int, b=2, h=3, g=3, d=64, lim=300, p=5, r=16, group=32, dtype=torch.float32, seed=0):
    """A random quantized store with dead slots, unused guard entries and rows with different recent counts."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, lim, d, generator=gen) * 2
    v = torch.randn(b, h, lim, d, generator=gen)
    factors = torch.rand(b, h, d, generator=gen) + 0.5
    kq, ks, kz = quant.quantize(k / factors.unsqueeze(2), bits, group)
    vq, vs, vz = quant.quantize(v, bits, group)
    cap = lim + r
    positions = torch.randint(0, 1000, (b, h, cap), generator=gen)
    positions[torch.rand(b, h, cap, generator=gen) < 0.1] = -1
    qlimit = torch.tensor([lim - 10, lim - 3][:b])
    protected = torch.randint(0, lim - 10, (b, h, p), generator=gen)
    if p:
        protected[0, 0, 0] = qlimit[0]  # an unused guard entry
    return dict(
        query=torch.randn(b, h * g, d, generator=gen).to(dtype),
        factors=factors,
        scaling=d**-0.5,
        codes=(kq, ks, kz, vq, vs, vz),
        qmask=torch.rand(b, h, lim, generator=gen) > 0.2,
        positions=positions,
        fp_k=torch.randn(b, h, p + r, d, generator=gen).to(dtype),
        fp_v=torch.randn(b, h, p + r, d, generator=gen).to(dtype),
        protected=protected,
        qlimit=qlimit,
        recent=torch.tensor([r, 7][:b]),
        bits=bits,
        sinks=torch.randn(h * g, generator=gen),
    )


def dequantized_attention(a: dict) -> torch.Tensor:
    """The reference: the store dequantized, the valid entries gathered, softmax attention in float64."""
    kq, ks, kz, vq, vs, vz = a["codes"]
    keys = quant.dequantize(kq, ks, kz, a["bits"]) * a["factors"].unsqueeze(2)
    values = quant.dequantize(vq, vs, vz, a["bits"])
    b, h, lim, d = keys.shape
    p = a["protected"].shape[2]
    r = a["fp_k"].shape[2] - p
    pos = a["positions"]
    ok = torch.cat(
        [
            a["qmask"] & (pos[:, :, :lim] >= 0),
            (a["protected"] < a["qlimit"].view(-1, 1, 1)) & (pos.gather(2, a["protected"]) >= 0),
            (torch.arange(r, device=pos.device).view(1, 1, r) < a["recent"].view(-1, 1, 1)).expand(b, h, r),
        ],
        -1,
    )
    k_all = torch.cat([keys.double(), a["fp_k"].double()], 2)
    v_all = torch.cat([values.double(), a["fp_v"].double()], 2)
    q = a["query"].double().view(b, h, -1, d)
    s = (q @ k_all.transpose(-1, -2) * a["scaling"]).masked_fill(~ok.unsqueeze(2), float("-inf"))
    if a["sinks"] is not None:
        s = torch.cat([s, a["sinks"].double().view(1, h, -1, 1).expand(b, h, -1, 1)], -1)
        v_all = torch.cat([v_all, v_all.new_zeros(b, h, 1, v_all.shape[-1])], 2)
    return (torch.softmax(s, -1) @ v_all).view(b, -1, v_all.shape[-1])


def _backends():
    out = ["torch"]
    if codes.cpp_available():
        out.append("cpp")
    return out


def test_the_cpu_kernel_builds_here():
    """The C++ kernel builds on this machine (CI has a compiler); elsewhere the torch path serves, with a warning."""
    assert codes.cpp_available(), codes._cpp_error


@pytest.mark.parametrize("bits", quant.KV_BITS)
@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("guard", [5, 0])
@pytest.mark.parametrize("backend", _backends())
def test_codes_attention_equals_attention_over_the_dequantized_store(bits, sinks, guard, backend):
    a = store(bits, p=guard)
    if not sinks:
        a["sinks"] = None
    out = codes.decode_attention(**a, backend=backend)
    assert out.shape == a["query"].shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dequantized_attention(a), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_blocks_and_chunks_do_not_change_the_result(backend):
    """A long store (several blocks and thread chunks), one row, one query head per KV head, 8 bits."""
    a = store(8, b=1, h=2, g=1, d=32, lim=1500, p=3, r=8, group=16, seed=3)
    torch.testing.assert_close(
        codes.decode_attention(**a, backend=backend).double(), dequantized_attention(a), atol=1e-5, rtol=1e-5
    )
    if backend == "torch":
        small = codes.decode_attention_torch(*[a[n] for n in list(a)[:-1]], sinks=a["sinks"], block=100)
        torch.testing.assert_close(small, codes.decode_attention(**a, backend="torch"), atol=1e-5, rtol=1e-5)


def test_float64_stays_float64_and_an_empty_row_gives_zeros():
    a = store(4, dtype=torch.float64)
    a["sinks"] = None
    out = codes.decode_attention(**a)
    assert out.dtype == torch.float64
    torch.testing.assert_close(
        out, dequantized_attention(a), atol=1e-6, rtol=1e-5
    )  # the reference dequantizes in float32
    a = store(4, b=1)
    a["qmask"][:] = False
    a["recent"][:] = 0
    a["protected"][:] = a["qlimit"][0]
    a["sinks"] = None
    for backend in _backends():
        assert torch.equal(codes.decode_attention(**a, backend=backend), torch.zeros_like(a["query"]))


def test_bad_backend_is_a_clear_error():
    a = store(4, b=1)
    with pytest.raises(ValueError, match="unknown codes-attention backend 'gpu'"):
        codes.decode_attention(**a, backend="gpu")
    a["query"] = a["query"].double()
    with pytest.raises(ValueError, match="cpp backend runs float32 on CPU"):
        codes.decode_attention(**a, backend="cpp")
    with pytest.raises(ValueError, match="triton backend runs on CUDA"):
        codes.decode_attention(**a, backend="triton")
