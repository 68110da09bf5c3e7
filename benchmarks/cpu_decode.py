"""CPU decode benchmark on the embedded model: full cache vs policies, side by side (same as `vase bench sweep`).

.venv/bin/python benchmarks/cpu_decode.py                       # 1K-8K tokens, budgets 256/512/1024
.venv/bin/python benchmarks/cpu_decode.py --lengths 512,1024    # quicker
"""

import sys

from vase.cli import app

if __name__ == "__main__":
    app(["bench", "sweep", *sys.argv[1:]])
