"""vase's FlashAttention and Triton backend classes (:mod:`vase.vllm.gpu_backends`), tested on CPU inside a running
engine with evictions (``tests/vllm/scenarios/gpu_backends.py``): at every step with a plan, for the first and the
last full-attention layer, the metadata vase's GPU builders make from the runner's metadata and the step plan, run
through vLLM's own FlashAttention and Triton impls (their kernel and cache-write calls replaced by plain torch that
reads exactly the arguments the impls pass, over a token-major copy of the cache) gives the attention vLLM's CPU
kernel gives, with the new entries at the plan's physical slots.
"""

from __future__ import annotations

import random

import pytest

from tests.vllm.test_vllm import BUFFER, SINKS, _run_script, converted_model, needs_vllm

pytestmark = needs_vllm


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(20, 50))] for _ in range(5)]
    prompts.append([rng.randrange(100, 20000) for _ in range(150)])  # larger than its blocks: dense rows
    job = {
        "model": str(converted_model()),
        "prompts": prompts,
        "max_tokens": [30 + 20 * i for i in range(6)],
        "vase": {"policy": "vase", "budget": 48, "buffer": BUFFER, "sinks": SINKS},
        "batches": [[0, 1, 2, 3, 4], [5]],  # the short prompts' prefill without the dense row, then the long one
    }
    return _run_script("gpu_backends", job, tmp_path_factory.mktemp("gpu_backends"))


@pytest.mark.parametrize("backend", ["flash_attn", "triton"])
def test_the_gpu_backends_attend_what_the_cpu_kernel_attends(run, backend):
    steps = run["compared"][backend]
    assert len(steps) > 40
    assert sum(s["evicted_rows"] > 0 for s in steps) > 20  # physical lengths below logical ones
    assert {s["rows"] for s in steps} >= {1, 2, 5}
    assert any(s["tokens"] > s["rows"] for s in steps)  # prefill steps too
    assert all(s["physical"] for s in steps)  # the plan's lengths and slots in the backend's metadata
    assert all(s["written"] for s in steps)  # the new entries at the physical slots
    assert max(s["max_abs"] for s in steps) < 1e-4


def test_dense_rows_are_refused_by_the_gpu_builders(run):
    assert "flash_attn" in run["refused_dense"] and "triton" in run["refused_dense"]
    assert run["stats"]["worker"]["rows_evicted"] > 6
    assert len(run["layers"]) == 2
