"""Cases of the Triton kernel (decode attention over quantized codes), run by tests/core/test_codes_triton.py in a
process started with ``TRITON_INTERPRET=1`` (Triton reads it when it is imported), or directly on a CUDA machine."""

from __future__ import annotations

import os

import pytest
import torch

from tests.core.test_codes import dequantized_attention, store
from vase.core import codes, quant

assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(), "run through test_codes_triton.py"
from vase.core.kernels import codes_triton  # noqa: E402,F401

# under the interpreter the kernel reads CPU tensors; on a CUDA machine the cases run on the GPU
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def on_device(a: dict) -> dict:
    """The store's tensors (the codes tuple too) moved to DEVICE."""
    move = lambda x: x.to(DEVICE) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return {k: tuple(map(move, v)) if isinstance(v, tuple) else move(v) for k, v in a.items()}


@pytest.mark.parametrize("bits", quant.KV_BITS)
@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("guard", [5, 0])
def test_triton_kernel_equals_the_torch_path(bits, sinks, guard):
    a = store(bits, b=2, h=2, g=3, d=32, lim=70, p=guard, r=8, group=16, seed=bits + guard)
    if not sinks:
        a["sinks"] = None
    a = on_device(a)
    out = codes.decode_attention(**a, backend="triton")
    torch.testing.assert_close(out, codes.decode_attention(**a, backend="torch"), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), dequantized_attention(a), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("sinks", [True, False])
def test_split_slots_equal_one_program(splits, sinks):
    """The slots split over several programs per (row, KV head) and merged (flash-decoding) give the one-program
    result; 70 slots in blocks of 16: 5 blocks, the last split shorter; the full-precision store in the last split."""
    from vase.core.kernels.codes_triton import decode_attention_triton, split_count

    a = store(4, b=2, h=2, g=3, d=32, lim=70, p=5, r=8, group=16, seed=splits)
    if not sinks:
        a["sinks"] = None
    a = on_device(a)
    args = [a[k] for k in ("query", "factors", "scaling", "codes", "qmask", "positions", "fp_k", "fp_v")]
    args += [a[k] for k in ("protected", "qlimit", "recent", "bits", "sinks")]
    assert split_count(4, 70, 16, torch.device(DEVICE), splits) == splits
    one = decode_attention_triton(*args, block=16, splits=1)
    torch.testing.assert_close(decode_attention_triton(*args, block=16, splits=splits), one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one, codes.decode_attention(**a, backend="torch"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_products_stay_close(dtype):
    """bfloat16 or float16 queries: the products run on the tensor cores in that dtype (float32 accumulation), as the
    model's own attention does; the result stays within the dtype's rounding of the float32 path's."""
    a = store(4, b=2, h=2, g=3, d=32, lim=70, p=5, r=8, group=16, dtype=dtype, seed=11)
    a = on_device(a)
    out = codes.decode_attention(**a, backend="triton")
    assert out.dtype == dtype
    ref = codes.decode_attention(**{**a, "query": a["query"].float(), "fp_k": a["fp_k"].float(),
                                    "fp_v": a["fp_v"].float()}, backend="torch")  # fmt: skip
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_triton_kernel_refuses_a_head_dim_that_is_not_a_power_of_two():
    a = on_device(store(8, b=1, h=1, g=1, d=48, lim=30, p=0, r=4, group=16))
    with pytest.raises(ValueError, match="power-of-two head dim"):
        codes.decode_attention(**a, backend="triton")
