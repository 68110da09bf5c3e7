"""Configurations vase refuses at engine start: for each case, the error the engine raised (or that it started).

Job: ``{"model", "learned": {case: spec}}`` (the last: learned-scorer cases, their weights files made by the test).
Each case starts an in-process engine with ``additional_config`` set directly (not through
``engine_args``, which would refuse most of them before any engine starts) and records the exception.
"""

from __future__ import annotations

import json
import os
import tempfile

import common

import vase.vllm
from vase.vllm.rules import SCHEDULER_CLS, WORKER_CLS

GOOD = "streaming_llm:budget=128:buffer=16"
CASES = {
    "unknown_policy": {"vase": "snapkvv:budget=128"},
    "adakv": {"vase": "snapkv:head_budget=adakv:budget=128"},
    "pyramid": {"vase": "snapkv:layer_budget=pyramid:budget=128"},
    "quest": {"vase": "quest:budget=128"},
    "ratio": {"vase": "vase:ratio=4"},
    "compile": {"vase": "vase:budget=128:compile=true"},
    "kv_bits": {"vase": "vase:budget=128:kv_bits=4"},
    "sizes": {"vase": "streaming_llm:budget=16:buffer=16:sinks=4"},
    "paper_budget": {"vase": "vase:preset=paper:budget=100:buffer=16"},
    "prefix_caching": {"kw": {"enable_prefix_caching": True}},
    "block_size": {"kw": {"block_size": 16}},
    "no_classes": {"classes": False},
    "speculative": {
        "kw": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}}
    },
    "sliding_model": {"sliding": True},
    "good": {},
}


def sliding_copy(model: str) -> str:
    """The model's folder with ``sliding_window`` set in its config (the weights linked, not copied)."""
    folder = tempfile.mkdtemp(prefix="vase-sliding-")
    for name in os.listdir(model):
        if name != "config.json":
            os.symlink(os.path.join(model, name), os.path.join(folder, name))
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["sliding_window"] = 64
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


if __name__ == "__main__":
    spec, out = common.job()
    result = {}
    cases = {**CASES, **{name: {"vase": v} for name, v in spec.get("learned", {}).items()}}
    for name, case in cases.items():
        kw = dict(additional_config={"vase": case.get("vase", GOOD)}, **case.get("kw", {}))
        if case.get("classes", True):
            kw.update(scheduler_cls=SCHEDULER_CLS, worker_cls=WORKER_CLS)
        model = sliding_copy(spec["model"]) if case.get("sliding") else spec["model"]
        try:
            llm = common.make_llm(model, None, **kw)
        except Exception as exc:  # noqa: BLE001 - the error is the result
            cause = exc
            while cause.__cause__ is not None and not isinstance(cause, vase.vllm.VaseConfigError):
                cause = cause.__cause__
            result[name] = {"error": type(cause).__name__, "message": str(cause)}
        else:
            result[name] = {"error": None}
            common.free(llm)
        common.write(out, result)
