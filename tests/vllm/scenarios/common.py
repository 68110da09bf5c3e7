"""Shared by the vLLM scenario scripts (run with ``.venv-vllm/bin/python`` by tests/vllm/test_vllm.py).

Each script reads a JSON job (model folder, prompts as token ids, engines to run), starts each engine in-process with
the fast CPU settings of ../shared/VLLM.md, and writes a JSON result file; tests/vllm/test_vllm.py asserts on it.
"""

from __future__ import annotations

import gc
import json
import os
import sys

FAST_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: its scheduler and worker readable here
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
for _k, _v in FAST_ENV.items():
    os.environ.setdefault(_k, _v)


def job() -> tuple[dict, str]:
    """The job (argv[1], JSON) and the result path (argv[2])."""
    with open(sys.argv[1]) as f:
        return json.load(f), sys.argv[2]


def write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


def make_llm(model: str, vase_kw=None, **kw):
    """An in-process engine on ``model`` (fp32, eager, block size 32, prefix caching off); with ``vase_kw`` (a dict of
    :func:`vase.vllm.engine_args` arguments) the plugin's engine arguments are filled in."""
    from vllm import LLM

    import vase.vllm

    args = dict(
        model=model,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=512,
        seed=0,
        enable_prefix_caching=False,
        max_num_seqs=8,
        enable_chunked_prefill=False,
        max_num_batched_tokens=512,
    )
    if vase_kw is not None:
        args.update(vase.vllm.engine_args(**vase_kw))
    args.update(kw)
    return LLM(**args)


def free(llm) -> None:
    """Shut an engine down before the next one starts in this process."""
    shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
    if shutdown is not None:
        shutdown()
    del llm
    gc.collect()


def stats(llm) -> dict:
    import vase.vllm

    return vase.vllm.engine_stats(llm)


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def params(max_tokens: int, **kw):
    """Greedy unless ``temperature`` is given; end-of-sequence ignored."""
    from vllm import SamplingParams

    kw.setdefault("temperature", 0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens_prompt(ids):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))
