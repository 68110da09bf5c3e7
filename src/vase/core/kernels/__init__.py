"""Compiled kernels of the core: the CPU kernel of decode attention over quantized codes (``codes_attention.cpp``,
built on first use by :mod:`vase.core.codes`) and its Triton twin for CUDA (:mod:`vase.core.kernels.codes_triton`)."""
