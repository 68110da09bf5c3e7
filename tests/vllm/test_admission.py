"""Elastic admission's plan (vase.vllm.admission) and the budget ladder (vase.vllm.settings), exact values; no vLLM."""

from __future__ import annotations

import re

import pytest

from vase.vllm.admission import Demand, plan_admission
from vase.vllm.settings import EngineSettings, VaseConfigError, parse


def _settings(spec: str) -> EngineSettings:
    config, engine = parse(spec)
    return EngineSettings(config, block_size=32, **engine)


def _demand(s: EngineSettings, rid: str, target: int, upto: int | None = None) -> Demand:
    steps = [b for b in s.ladder(target) if upto is None or b <= upto]
    return Demand(rid, tuple((b, s.cap_blocks_for(b)) for b in steps))


def test_ladder_and_floor():
    """Per block count the largest budget the rules allow (budget + buffer fills the blocks); the floor is the first
    at least a quarter of the budget, or min_budget; the published preset keeps to multiples of the buffer."""
    s = _settings("vase:budget=256:buffer=64")
    assert s.admission == "elastic" and s.elastic and s.floor == 96
    assert s.ladder(256) == (96, 128, 160, 192, 224, 256)
    assert [s.cap_blocks_for(b) for b in s.ladder(256)] == [5, 6, 7, 8, 9, 10]
    assert s.ladder(200) == (96, 128, 160, 192, 200)  # a target between two steps is its own top
    assert s.ladder(80) == (80,)  # below the floor: its own budget only
    paper = _settings("vase:preset=paper:budget=256:buffer=64")
    assert paper.floor == 128 and paper.ladder(256) == (128, 192, 256)
    own = _settings("vase:budget=1024:buffer=64:min_budget=300")
    assert own.floor == 300  # 300 holds 12 blocks, as 320 does: the ladder starts at 320
    assert own.ladder(1024)[:2] == (320, 352) and own.ladder(1024)[-1] == 1024
    assert _settings("h2o:budget=48:buffer=16:sinks=4").ladder(48) == (48,)
    assert "budgets down to 96 when the pool is short" in s.describe()
    assert "prefill_first" not in s.describe()
    assert "prefill_first off" in _settings("vase:budget=256:buffer=64:prefill_first=false").describe()
    assert "prefill_priority" not in s.describe() and s.prefill_priority
    off = _settings("vase:budget=256:buffer=64:prefill_priority=false")
    assert not off.prefill_priority and "prefill_priority off" in off.describe()
    assert not _settings("vase:budget=256:admission=reserve").elastic
    assert not _settings("full:budget=256").elastic


def test_concurrent_rows_sizes_the_worker_pool_by_the_floor():
    """The rows a worker makes room for at start-up: the requests the pool holds with each at its cap at the floor
    (elastic), at the budget (reserve), none without eviction."""
    assert _settings("vase:budget=256:buffer=64").concurrent_rows(160) == 160 // 5  # floor 96: 5 blocks
    assert _settings("vase:budget=256:buffer=64:admission=reserve").concurrent_rows(160) == 160 // 10
    assert _settings("full:budget=256").concurrent_rows(160) == 0


@pytest.mark.parametrize(
    "spec, words",
    [
        ("vase:budget=256:min_budget=512", "min_budget must be an integer number of tokens at most the budget (256)"),
        ("vase:budget=256:buffer=64:min_budget=40", "min_budget 40: budget (40) must be larger than sinks + buffer"),
        ("vase:preset=paper:budget=256:buffer=64:min_budget=100", "min_budget 100: the published method"),
        ("vase:budget=256:min_budget=x", "min_budget must be an integer"),
    ],
)
def test_min_budget_errors(spec, words):
    with pytest.raises(VaseConfigError, match=re.escape(words)):
        parse(spec)


def test_plan_admits_at_the_water_level_and_shrinks_the_running():
    """Eight requests run at 256 (10 blocks each). With 95 usable blocks two arrivals fit only at 224 (9 blocks: 90),
    so the running shrink to 224 and the two are admitted at 224. With 100 usable and twelve arrivals, all twenty fit
    at the floor 96 (5 blocks: 100) but not at 128 (120); a thirteenth does not fit even at the floor and waits."""
    s = _settings("vase:budget=256:buffer=64")
    running = [_demand(s, f"r{i}", 256, upto=256) for i in range(8)]
    current = {f"r{i}": 256 for i in range(8)}
    plan = plan_admission(running, [_demand(s, "w0", 256), _demand(s, "w1", 256)], 95, current)
    assert plan.level == 224 and plan.admit == {"w0": (224, 9), "w1": (224, 9)} and plan.blocks == 90
    assert plan.shrink == {f"r{i}": (224, 9) for i in range(8)}
    assert plan_admission(running, [_demand(s, "w0", 256), _demand(s, "w1", 256)], 100, current).shrink == {}
    plan = plan_admission(running, [_demand(s, f"w{i}", 256) for i in range(12)], 100, current)
    assert plan.level == 96 and len(plan.admit) == 12 and plan.blocks == 100
    assert set(plan.shrink.values()) == {(96, 5)} and len(plan.shrink) == 8
    plan = plan_admission(running, [_demand(s, f"w{i}", 256) for i in range(13)], 100, current)
    assert len(plan.admit) == 12 and "w12" not in plan.admit


def test_plan_keeps_budgets_that_fit_and_respects_own_targets():
    """With room for everyone nothing shrinks and a request that asked for less keeps it; a request that cannot
    shrink (one option) counts with what it holds; a large request lowers the level only as far as needed; with
    nobody fitting at the floor, nothing changes."""
    s = _settings("vase:budget=256:buffer=64:max_budget=512")
    running = [_demand(s, "r0", 256, upto=256), Demand("fixed", ((256, 30),))]
    current = {"r0": 256}
    plan = plan_admission(running, [_demand(s, "small", 128)], 100, current)
    assert plan.level == 256 and plan.admit == {"small": (128, 6)} and plan.shrink == {} and plan.blocks == 46
    # 60 usable: r0 10 + fixed 30 + small 6 leave 14 for a 512 request (18 blocks): it gets 384 (14), r0 keeps 256
    wait = [_demand(s, "small", 128), _demand(s, "big", 512)]
    plan = plan_admission(running, wait, 60, current)
    assert plan.level == 384 and plan.admit == {"small": (128, 6), "big": (384, 14)} and plan.shrink == {}
    # 50 usable: 14 left for r0 and big together: both at 160 (7 blocks each)
    plan = plan_admission(running, wait, 50, current)
    assert plan.level == 160 and plan.admit == {"small": (128, 6), "big": (160, 7)} and plan.blocks == 50
    assert plan.shrink == {"r0": (160, 7)}
    nobody = plan_admission(running, [_demand(s, "big", 512)], 39, current)  # floors: 5 + 30 + 5 = 40 > 39
    assert nobody.level is None and nobody.admit == {} and nobody.shrink == {} and nobody.blocks == 40


def _engine(tp=1, pp=1, kv_heads=3, prefix=False, hybrid=False, device="cpu"):
    """A stand-in for vLLM's configuration with the fields the engine rules read."""
    from types import SimpleNamespace as NS

    from vase.vllm.rules import SCHEDULER_CLS, WORKER_CLS

    return NS(
        cache_config=NS(block_size=32, enable_prefix_caching=prefix, cache_dtype="auto"),
        scheduler_config=NS(scheduler_cls=SCHEDULER_CLS),
        parallel_config=NS(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=1, worker_cls=WORKER_CLS
        ),
        model_config=NS(
            get_total_num_kv_heads=lambda: kv_heads,
            get_head_size=lambda: 64,
            hf_text_config=NS(layer_types=None, sliding_window=None, num_hidden_layers=2),
            is_hybrid=hybrid,
            is_attention_free=False,
            is_encoder_decoder=False,
        ),
        speculative_config=None,
        use_v2_model_runner=False,
        device_config=NS(device_type=device),
    )


def test_engine_rules_name_each_broken_rule():
    """Tensor parallelism is refused only where a worker would hold part of a KV head's query heads and the policy
    scores with queries; pipeline parallelism, state-space hybrids and prefix caching with prompts compressed at
    prefill are refused; data parallelism and dense-prompt prefix caching are not."""
    from vase.vllm.rules import check_engine

    vase_cfg, _ = parse("vase:budget=128")
    stream, _ = parse("streaming_llm:budget=128")
    paper, _ = parse("vase:preset=paper:budget=128:buffer=64")
    assert check_engine(_engine(tp=2, kv_heads=2), vase_cfg) == []
    assert "query-based scores would differ" in " ".join(check_engine(_engine(tp=2, kv_heads=1), vase_cfg))
    assert check_engine(_engine(tp=2, kv_heads=1), stream) == []  # keys only: the replicated head is the same
    assert "pipeline parallelism" in " ".join(check_engine(_engine(pp=2), vase_cfg))
    assert "state-space or linear-attention" in " ".join(check_engine(_engine(hybrid=True), vase_cfg))
    assert "compresses prompts at prefill" in " ".join(check_engine(_engine(prefix=True), vase_cfg))
    assert check_engine(_engine(prefix=True), paper) == []
    # vase's backend is vLLM's CPU one: on a GPU an engine with vase is refused at start, before weights load
    assert "device 'cuda': vase runs on vLLM's CPU attention backend only" in " ".join(
        check_engine(_engine(device="cuda"), vase_cfg)
    )


def test_learned_weights_for_another_shape_are_refused_by_the_engine_rules(tmp_path):
    """A learned scorer's weights are checked against the model when the engine starts, before its weights load (the
    config names the full-attention layers), with the transformers cache's rule and message: weights for fewer KV
    heads (a worker would broadcast them) or missing a layer (it would fail at that layer's first eviction) are
    refused; weights of the model's shape pass."""
    from tests.core.test_learned import _weights
    from vase.vllm.rules import check_engine, full_attention_layers

    engine = _engine(kv_heads=2)  # 2 layers of full attention, 2 KV heads of dim 64
    for layers, heads, words in (
        ((0, 1), 1, "with 2 evicting layers x 1 KV heads x head_dim 64; this model has 2 x 2 x 64"),
        ((0,), 2, "with 1 evicting layers x 2 KV heads x head_dim 64; this model has 2 x 2 x 64"),
    ):
        path = _weights(layers=layers, kv_heads=heads, head_dim=64).save(tmp_path / f"{len(layers)}-{heads}.pt")
        config, _ = parse(f"learned:weights={path}:window=64:budget=128")
        problems = check_engine(engine, config)
        assert len(problems) == 1 and words in problems[0] and "vase train-scorer" in problems[0], problems
    good = _weights(layers=(0, 1), kv_heads=2, head_dim=64).save(tmp_path / "good.pt")
    assert check_engine(engine, parse(f"learned:weights={good}:window=64:budget=128")[0]) == []
    assert check_engine(engine, parse("learned:budget=128")[0]) == []  # the prior: no weights to check
    from types import SimpleNamespace as NS

    hybrid = NS(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=32, num_hidden_layers=4)
    assert full_attention_layers(hybrid) == [1, 3]
    assert full_attention_layers(NS(layer_types=None, sliding_window=64, num_hidden_layers=4)) is None
