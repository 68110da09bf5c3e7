"""What vLLM's GPU path needs of vase beyond its attention backend, as far as CPU can test it.

Async scheduling (``tests/vllm/scenarios/async_sched.py``): at the scheduler level, with a stand-in runner that returns
step N's output only after step N+1 is scheduled, no block that a step still in flight lists for one request is
listed for another (blocks given back by a dense prompt's first eviction, a shrink, a finish or an abort); two
planted faults (vLLM's deferred freeing off; a trim's blocks back at once) are caught.

CUDA graphs (``tests/vllm/scenarios/graph_buffers.py``): the ``seq_lens``, slot mapping and block table vase's builder
hands vLLM's builder keep their storage at every step and batch size (a captured graph reads fixed addresses).
"""

from __future__ import annotations

import random

import pytest

from tests.vllm.test_vllm import BUFFER, SINKS, _run_script, converted_model, needs_vllm

pytestmark = needs_vllm


def _handed_over(run: dict) -> list[tuple]:
    """``(step in flight, later step, block, its request, the other request)`` for every block a step lists for one
    request while an earlier step still in flight lists it for another."""
    steps, out = run["steps"], []
    for t, step in enumerate(steps):
        for s in step["in_flight"]:
            owner = {b: rid for rid, blocks in steps[s]["tables"].items() for b in blocks}
            out += [
                (s, t, b, owner[b], rid) for rid, bl in step["tables"].items() for b in bl if owner.get(b, rid) != rid
            ]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("async")
    job = {
        "model": str(converted_model()),
        "vase": {"policy": "vase:preset=paper", "budget": 112, "buffer": BUFFER, "sinks": SINKS},
        "blocks": 24,  # 23 usable: 8 requests at their 4-block caps do not fit, so elastic admission shrinks
        "max_num_seqs": 8,
        "requests": 14,
        "burst": 8,
        "prompt_range": [60, 200],
        "gen_range": [100, 300],
        "abort": {"3": 40, "10": 150},
    }
    return _run_script("async_sched", job, folder)


def test_vllm_builds_the_async_variant_under_async_scheduling(runs):
    assert runs["sync"]["class"] == "VaseScheduler" and "AsyncScheduler" not in runs["sync"]["mro"]
    assert runs["async"]["class"] == "VaseAsyncScheduler"
    assert runs["async"]["mro"][:4] == ["VaseAsyncScheduler", "VaseScheduler", "AsyncScheduler", "Scheduler"]


def test_no_block_goes_to_another_request_while_a_step_in_flight_lists_it(runs):
    run = runs["async"]
    assert sum(bool(s["in_flight"]) for s in run["steps"]) >= 0.95 * len(run["steps"])  # a step mostly in flight
    stats = run["stats"]
    assert stats["trimmed"] > 0 and stats["shrinks"] > 0 and stats["preemptions"] == 0  # trims and shrinks happened
    assert [a["in_flight"] for a in run["aborted"]] == [True, True]  # both aborts hit a request in flight
    assert _handed_over(run) == []
    assert _handed_over(runs["sync"]) == []
    assert stats["max_over_cap"] <= 0
    for mode in ("sync", "async"):  # every block back in the pool at the end (all but vLLM's null block)
        assert runs[mode]["free_blocks"] == runs[mode]["pool_blocks"] - 1 and runs[mode]["deferred_left"] == 0


@pytest.mark.parametrize("fault", ["async-undeferred", "async-trims-now"])
def test_the_planted_faults_hand_blocks_over_early(runs, fault):
    """Without vLLM's deferred freeing, or with a trim's blocks back at once, a block listed by the step in flight
    goes to another request in the next step."""
    early = _handed_over(runs[fault])
    assert early and all(t == s + 1 for s, t, *_ in early)


def test_the_kernels_inputs_keep_their_storage_across_steps_and_batch_sizes(tmp_path):
    """8 requests of different lengths, batches shrinking from 8 rows to 1, evictions every few steps: the plan's
    physical lengths always reach vLLM's builder, from one storage per tensor for the whole run."""
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(20, 60))] for _ in range(8)]
    job = {
        "model": str(converted_model()),
        "prompts": prompts,
        "max_tokens": [24 + 22 * i for i in range(8)],
        "vase": {"policy": "vase", "budget": 48, "buffer": BUFFER, "sinks": SINKS},
    }
    res = _run_script("graph_buffers", job, tmp_path)
    steps = res["steps"]
    assert [len(o) for o in res["outputs"]] == job["max_tokens"]
    assert res["stats"]["worker"]["rows_evicted"] > 8
    assert {s["rows"] for s in steps} == set(range(1, 9))
    assert all(s["physical"] for s in steps)
    assert len({s["builder"] for s in steps}) == 1  # one full-attention group
    for tensor in ("seq_lens", "slots", "table"):
        assert len({s[tensor] for s in steps}) == 1, tensor
