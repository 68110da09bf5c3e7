"""Decode speed of the full cache, streaming_llm and vase measured interleaved in one process at 8K context.

Sequential runs on a shared machine can land in a slow spell; taking turns of one eviction cycle (buffer steps)
each puts every policy through the same spells, so the ratios are robust. Same as `vase bench paired`.

.venv/bin/python benchmarks/paired_decode.py --policies full,streaming_llm,vase --budget 1024
"""

import sys

from vase.cli import app

if __name__ == "__main__":
    app(["bench", "paired", *sys.argv[1:]])
