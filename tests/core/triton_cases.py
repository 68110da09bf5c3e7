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


def test_triton_kernel_refuses_a_head_dim_that_is_not_a_power_of_two():
    a = on_device(store(8, b=1, h=1, g=1, d=48, lim=30, p=0, r=4, group=16))
    with pytest.raises(ValueError, match="power-of-two head dim"):
        codes.decode_attention(**a, backend="triton")
