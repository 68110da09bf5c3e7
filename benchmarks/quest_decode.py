"""quest against the full cache and vase at 8K context: decode speed and KV memory, side by side in one process.

Each cache is prefilled with the same 8,192-token prompt, then they take turns of ``buffer`` decode steps (see
`vase bench --paired`); the table gives tokens/s and the KV bytes each cache holds at the end (quest: the whole
cache plus its page metadata), with ratios to the first policy (the full cache, transformers' DynamicCache).

.venv/bin/python benchmarks/quest_decode.py                  # full, vase, quest; budget 1024; 8K context; 128 steps
.venv/bin/python benchmarks/quest_decode.py --steps 256      # longer
"""

import sys

from vase.cli import app

DEFAULTS = ["--policies", "full,vase,quest", "--paired-budget", "1024", "--context", "8192", "--steps", "128"]

if __name__ == "__main__":
    app(["bench", "--paired", *DEFAULTS, *sys.argv[1:]])
