"""What a CPU user would pick instead of vase in vLLM: OpenVINO GenAI, which serves on CPU with its own KV cache
eviction (block-granular, ``CacheEvictionConfig``, NORM_SUM scores), on the same prompts, pool and per-sequence cap.

Two measurements, each engine in its own environment (``make openvino`` builds ``.venv-openvino``: OpenVINO GenAI
and the exporter, CPU torch first; the model exported to ``build/openvino/smollm2``):

* ``throughput`` (OpenVINO only): 24 prompts x 1,024 sampled tokens (end-of-sequence ignored) offered at once to its
  ``ContinuousBatchingPipeline`` with a pool of ``--pool-tokens`` and eviction at ``--cap`` tokens per sequence
  (start 32, recent 64, as vase's 4 sinks + 64 recent are kept), then without eviction at the same pool; output
  tokens per second of wall time, in-process (no HTTP server or client). ``--threads`` (default 2) and ``--f32``
  (float32 compute and KV cache; OpenVINO's default on AMX CPUs is bfloat16) set what vLLM ran with to compare
  like with like (the protocol's servers: float32, one thread). vLLM's figures at the same pool come from
  ``benchmarks/vllm_serve_bench.py``.
* ``agreement`` (either engine, ``--engine openvino`` or ``--engine vllm``): on a few prompts, greedy decoding with
  eviction against the same engine without it (its own full cache): the tokens until the first that differs, and
  the share of positions whose token is equal. vase in vLLM: ``vase:budget=256:buffer=64`` against plain vLLM.

Writes ``OUT/<engine>-<measure>[-f32]-t<threads>.json`` (vLLM: ``OUT/vllm-agreement.json``) and prints one line
per run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "runs" / "protocol-1k-tight" / "repeat-0" / "prompts-burst.jsonl"


def _prompts(path: Path, n: int) -> list[str]:
    """The serving benchmark's prompts (chat template applied), the first ``n``."""
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: run benchmarks/vllm_serve_bench.py first, or pass --prompts FILE")
    texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    return texts[:n]


# --------------------------------------------------------------------------------------------------- OpenVINO
def _ov_pipeline(args, evict: bool, pool_tokens: int):
    import openvino_genai as og

    sc = og.SchedulerConfig()
    sc.num_kv_blocks = pool_tokens // args.block_size
    sc.max_num_seqs = 64
    sc.max_num_batched_tokens = 4096
    sc.enable_prefix_caching = False
    if evict:
        sc.use_cache_eviction = True
        sc.cache_eviction_config = og.CacheEvictionConfig(
            start_size=args.block_size,
            recent_size=2 * args.block_size,
            max_cache_size=args.cap,
            aggregation_mode=og.AggregationMode.NORM_SUM,
        )
    props = {"INFERENCE_NUM_THREADS": args.threads}
    if args.f32:  # as vLLM runs in vllm_serve_bench.py (--dtype float32); OpenVINO's default on AMX CPUs is bf16
        props.update({"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"})
    return og.ContinuousBatchingPipeline(str(args.model), sc, "CPU", props)


def _ov_generate(pipe, prompts: list[str], new: int, sample: bool) -> tuple[list[list[int]], float]:
    import openvino_genai as og

    tok = pipe.get_tokenizer()
    ids = [tok.encode(p, add_special_tokens=False).input_ids for p in prompts]
    configs = []
    for i in range(len(prompts)):
        g = og.GenerationConfig()
        g.max_new_tokens, g.min_new_tokens, g.ignore_eos = new, new, True
        if sample:
            g.do_sample, g.temperature, g.top_p, g.rng_seed = True, 0.6, 0.95, i
        configs.append(g)
    t = time.perf_counter()
    results = pipe.generate(ids, configs)
    wall = time.perf_counter() - t
    return [list(r.m_generation_ids[0]) for r in results], wall


def ov_throughput(args) -> list[dict]:
    prompts = _prompts(args.prompts, args.n)
    rows = []
    for evict in (True, False):
        pipe = _ov_pipeline(args, evict, args.pool_tokens)
        _ov_generate(pipe, prompts[:2], 8, True)  # warm-up: compiled kernels, first allocations
        out, wall = _ov_generate(pipe, prompts, args.gen, True)
        tokens = sum(len(o) for o in out)
        rows.append({"engine": "openvino", "eviction": evict, "cap": args.cap if evict else None, "wall_s": wall,
                     "output_tokens": tokens, "out_tok_s": tokens / wall})  # fmt: skip
        print(f"[peer] openvino eviction={evict}: {tokens} tokens in {wall:.1f} s, {tokens / wall:.1f} tok/s")
        del pipe
    return rows


def ov_agreement(args) -> list[dict]:
    prompts = _prompts(args.prompts, args.agree)
    full, _ = _ov_generate(_ov_pipeline(args, False, 1 << 16), prompts, args.agree_gen, False)
    evicted, _ = _ov_generate(_ov_pipeline(args, True, 1 << 16), prompts, args.agree_gen, False)
    return _agreement("openvino", full, evicted)


# ------------------------------------------------------------------------------------------------------- vLLM
def vllm_agreement(args) -> list[dict]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's CPU default takes most of the memory
    from vllm import LLM, SamplingParams

    import vase.vllm

    prompts = _prompts(args.prompts, args.agree)
    params = SamplingParams(max_tokens=args.agree_gen, min_tokens=args.agree_gen, ignore_eos=True, temperature=0)
    outs = {}
    for name, kw in (("full", {}), ("vase", vase.vllm.engine_args("vase", budget=args.cap - 64, buffer=64))):
        llm = LLM(model=str(args.vllm_model), dtype="float32", max_model_len=4096, seed=0, **kw)
        outs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.engine_core.shutdown()
        del llm
    return _agreement("vase in vLLM", outs["full"], outs["vase"])


def _agreement(engine: str, full: list[list[int]], evicted: list[list[int]]) -> list[dict]:
    rows = []
    for i, (a, b) in enumerate(zip(full, evicted)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same = sum(x == y for x, y in zip(a, b)) / max(len(a), 1)
        rows.append({"engine": engine, "prompt": i, "tokens": len(a), "first_difference": first, "equal_share": same})
        print(f"[peer] {engine} prompt {i}: first difference at token {first} of {len(a)}, {same:.1%} equal")
    return rows


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["openvino", "vllm"], default="openvino")
    ap.add_argument("--measure", choices=["throughput", "agreement"], default="throughput")
    ap.add_argument("--model", type=Path, default=ROOT / "build" / "openvino" / "smollm2", help="OpenVINO model")
    ap.add_argument("--vllm-model", type=Path, default=ROOT / "build" / "vllm" / "smollm2")
    ap.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL of {'prompt': text}")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "peer-openvino")
    ap.add_argument("--n", type=int, default=24, help="prompts offered at once (throughput)")
    ap.add_argument("--gen", type=int, default=1024, help="sampled tokens per prompt (throughput)")
    ap.add_argument("--pool-tokens", type=int, default=5120, help="KV pool, as vllm_serve_bench.py's")
    ap.add_argument("--cap", type=int, default=320, help="tokens per sequence with eviction (vase: 256 + 64)")
    ap.add_argument("--block-size", type=int, default=32, help="OpenVINO's CPU KV block size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--f32", action="store_true", help="float32 compute and KV cache (default: bf16 with AMX)")
    ap.add_argument("--agree", type=int, default=4, help="prompts (agreement)")
    ap.add_argument("--agree-gen", type=int, default=512, help="greedy tokens per prompt (agreement)")
    args = ap.parse_args(argv)
    if args.engine == "vllm" and args.measure != "agreement":
        raise SystemExit("error: --engine vllm measures agreement only (throughput: benchmarks/vllm_serve_bench.py)")
    if args.engine == "openvino":
        try:
            import openvino_genai  # noqa: F401
        except ImportError:
            raise SystemExit(
                "skipped: OpenVINO GenAI is not installed here: `make openvino` builds .venv-openvino (run this "
                "script with .venv-openvino/bin/python)"
            ) from None
    if args.engine == "openvino" and not (args.model / "openvino_model.xml").is_file():
        raise SystemExit(f"error: {args.model} holds no exported model: `make openvino` exports the embedded model")
    run = {("openvino", "throughput"): ov_throughput, ("openvino", "agreement"): ov_agreement}
    rows = run.get((args.engine, args.measure), vllm_agreement)(args)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    tag = (f"{'-f32' if args.f32 else ''}-t{args.threads}") if args.engine == "openvino" else ""
    path = args.out / f"{args.engine}-{args.measure}{tag}.json"
    path.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    print(f"[peer] written: {path}")


if __name__ == "__main__":
    main()
